"""A small P/D proxy in front of two `vllm serve` processes that use `KvrayConnector`: each
OpenAI completion or chat request goes first to the prefill server (one token, its KV held
there), then to the decode server with the prefill's `kv_transfer_params`, whose answer (or
stream) is the client's. Run it with

    python -m kvray.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

A failure of either server is answered as that server's status with its body; the proxy adds
no state of its own, so several may run side by side. It refuses (400) what the decode server
would refuse although the one-token prefill leg passes, before the prefill runs, and when the
decode leg fails anyway (or the client hangs up first) it hands the prefill server its ticket
back, so the held KV is freed at once rather than at the end of its lease. The two servers
must be reachable only from the proxy: their kv_transfer_params are kvray's control plane.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvray.integrations.vllm.tickets import release_params

log = logging.getLogger("kvray.proxy")

#: How long one upstream call may take (seconds); vLLM answers a failed KV load itself.
UPSTREAM_TIMEOUT_S = 600.0
#: How long handing a ticket back to the prefill server may take.
RELEASE_TIMEOUT_S = 30.0


def _refused(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "BadRequestError", "code": 400}}, status_code=400
    )


def check_request(body: object, max_model_len: int | None) -> str | None:
    """Why the decode server would refuse `body` although its one-token prefill leg passes
    (None: it would not, as far as the proxy can tell). Both legs are then refused alike."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    if body.get("stream_options") is not None and not body.get("stream"):
        return "stream_options can only be given with stream: true"
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{field} must be a positive integer"
        if max_model_len is not None and value > max_model_len:
            return f"{field}={value} is more than the model's context of {max_model_len} tokens"
    return None


def build_app(prefill: str, decode: str, client: httpx.AsyncClient | None = None) -> FastAPI:
    """The proxy as an ASGI app over the two servers' base URLs (`client`: the HTTP client it
    reaches them with, e.g. one over `httpx.MockTransport` in tests)."""
    client = client or httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT_S)
    context: dict[str, int] = {}
    releases: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if releases:  # tickets on their way back to the prefill server
            await asyncio.wait(releases, timeout=RELEASE_TIMEOUT_S)
        await client.aclose()

    app = FastAPI(title="kvray P/D proxy", lifespan=lifespan)

    async def max_model_len(model: object) -> int | None:
        """The decode server's context length for `model` (asked once per model)."""
        name = str(model)
        if name not in context:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                listed = (await client.get(f"{decode}/v1/models")).json()["data"]
                for card in listed:
                    if isinstance(card.get("max_model_len"), int):
                        context[str(card["id"])] = card["max_model_len"]
        return context.get(name)

    async def release(body: dict[str, Any], params: dict[str, Any]) -> None:
        """Hand the prefill server its ticket back: the decode leg will not take the KV."""
        message = {"model": body.get("model"), "prompt": ".", "max_tokens": 1}
        message["kv_transfer_params"] = release_params(params)
        try:
            answer = await client.post(f"{prefill}/v1/completions", json=message, timeout=RELEASE_TIMEOUT_S)
            if answer.status_code != 200:
                log.warning("kvray proxy: the prefill server refused a release: %s", answer.text[:200])
        except httpx.HTTPError as error:
            log.warning("kvray proxy: could not release a held request: %s", error)

    def release_soon(body: dict[str, Any], params: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(release(body, params))
        releases.add(task)
        task.add_done_callback(releases.discard)

    async def handoff(path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _refused("the request body is not JSON")
        why = check_request(body, None)
        if why is None:
            why = check_request(body, await max_model_len(body.get("model")))
        if why is not None:
            return _refused(why)
        first = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        prefilled = await client.post(f"{prefill}{path}", json=first)
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        params = prefilled.json().get("kv_transfer_params")
        if not params:
            return JSONResponse(
                {"error": "the prefill server returned no kv_transfer_params; is it using KvrayConnector?"},
                status_code=502,
            )
        second = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            try:
                decoded = await client.post(f"{decode}{path}", json=second)
            except BaseException:
                release_soon(body, params)
                raise
            if decoded.status_code != 200:
                release_soon(body, params)
            return Response(decoded.content, decoded.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            # Until the first token comes (which the decode engine computes from the pushed KV)
            # it may never ask for the KV (refused, or the client hung up): release it then.
            relayed = False
            try:
                async with client.stream("POST", f"{decode}{path}", json=second) as upstream:
                    if upstream.status_code != 200:
                        error = await upstream.aread()
                        failure = {"error": error.decode(errors="replace")}
                        yield b"data: " + json.dumps(failure).encode() + b"\n\n"
                        return
                    async for chunk in upstream.aiter_raw():
                        relayed = True
                        yield chunk
            finally:
                if not relayed:
                    release_soon(body, params)

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handoff("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handoff("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        for server in (prefill, decode):
            answer = await client.get(f"{server}/health")
            if answer.status_code != 200:
                return Response(status_code=503)
        return Response(status_code=200)

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="base URL of the prefill vllm serve")
    parser.add_argument("--decode", required=True, help="base URL of the decode vllm serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
