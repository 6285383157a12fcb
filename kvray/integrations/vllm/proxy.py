"""A small P/D proxy in front of two `vllm serve` processes that use `KvrayConnector`: each
OpenAI completion or chat request goes first to the prefill server (one token, its KV held
there), then to the decode server with the prefill's `kv_transfer_params`, whose answer (or
stream) is the client's. Run it with

    python -m kvray.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

A failure of either server is answered as that server's status with its body. A server that
cannot be reached or does not answer in time is a 503, one whose answer breaks off or makes no
sense a 502, each with an OpenAI-style JSON error that names the leg (`prefill` or `decode`) and
the cause; a stream that breaks off after its first chunk ends with such an error as its last
event. The proxy adds no state of its own, so several may run side by side. It refuses (400)
what the decode server would refuse although the one-token prefill leg passes, before the
prefill runs, and when the decode leg fails anyway (or the client hangs up first) it hands the
prefill server its ticket back, so the held KV is freed at once rather than at the end of its
lease. The two servers must be reachable only from the proxy: their kv_transfer_params are
kvray's control plane.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvray.integrations.vllm.tickets import release_params

log = logging.getLogger("kvray.proxy")

#: How long one upstream call may take (seconds); vLLM answers a failed KV load itself.
UPSTREAM_TIMEOUT_S = 600.0
#: How long handing a ticket back to the prefill server may take.
RELEASE_TIMEOUT_S = 30.0


class Leg(enum.StrEnum):
    """Which of the two servers a request was on its way to."""

    PREFILL = "prefill"
    DECODE = "decode"


def _refused(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "BadRequestError", "code": 400}}, status_code=400
    )


def _upstream_error(leg: Leg, url: str, cause: httpx.HTTPError | str) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-style error body for the `leg` server at `url` failing with `cause`
    (an httpx error, or what was wrong with its answer): 503 where it could not be reached or
    did not answer in time, 502 where its answer broke off or made no sense."""
    if isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout):
        status, kind = 503, "ServiceUnavailableError"
        why = f"could not be reached ({type(cause).__name__}: {cause}); check that it runs at that address"
    elif isinstance(cause, httpx.TimeoutException):
        status, kind = 503, "ServiceUnavailableError"
        why = f"did not answer in time ({type(cause).__name__}: {cause}); retry once it is less busy"
    elif isinstance(cause, httpx.HTTPError):
        status, kind = 502, "BadGatewayError"
        why = f"broke off its answer ({type(cause).__name__}: {cause}); check its log"
    else:
        status, kind = 502, "BadGatewayError"
        why = f"{cause}; check its log"
    message = f"kvray proxy: the {leg} server at {url} {why}"
    log.warning("%s", message)
    return status, {"error": {"message": message, "type": kind, "code": status, "leg": str(leg)}}


def _upstream_failed(leg: Leg, url: str, cause: httpx.HTTPError | str) -> JSONResponse:
    status, body = _upstream_error(leg, url, cause)
    return JSONResponse(body, status_code=status)


class _Relay(StreamingResponse):
    """The decode server's open stream relayed to the client. `settle` runs however the
    response ends: a client that leaves before the first chunk means the relay's generator
    never starts, so its own `finally` would never run."""

    def __init__(self, chunks: AsyncIterator[bytes], settle: Callable[[], None]) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self._settle = settle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._settle()


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
    background: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if background:  # tickets on their way back to the prefill server, streams closing
            await asyncio.wait(background, timeout=RELEASE_TIMEOUT_S)
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

    def soon(work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        background.add(task)
        task.add_done_callback(background.discard)

    def release_soon(body: dict[str, Any], params: dict[str, Any]) -> None:
        soon(release(body, params))

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
        try:
            prefilled = await client.post(f"{prefill}{path}", json=first)
        except httpx.HTTPError as error:
            return _upstream_failed(Leg.PREFILL, prefill, error)
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        try:
            answer = prefilled.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            return _upstream_failed(
                Leg.PREFILL, prefill, "answered 200 with a body that is not a JSON object"
            )
        params = answer.get("kv_transfer_params")
        if not params:
            return _upstream_failed(
                Leg.PREFILL,
                prefill,
                "returned no kv_transfer_params: start it with --kv-transfer-config naming KvrayConnector",
            )
        second = {**body, "kv_transfer_params": params}
        streamed = bool(body.get("stream"))
        # Until the decode server answers 200 (and, streamed, sends its first chunk, which it
        # computes from the pushed KV) it may never ask for the KV: the ticket goes back then.
        try:
            decoded = await client.send(
                client.build_request("POST", f"{decode}{path}", json=second), stream=streamed
            )
        except httpx.HTTPError as error:
            release_soon(body, params)
            return _upstream_failed(Leg.DECODE, decode, error)
        except BaseException:
            release_soon(body, params)
            raise
        if decoded.status_code != 200:
            release_soon(body, params)
            try:
                content = await decoded.aread()
            except httpx.HTTPError as error:
                return _upstream_failed(Leg.DECODE, decode, error)
            finally:
                await decoded.aclose()
            return Response(content, decoded.status_code, media_type="application/json")
        if not streamed:
            return Response(decoded.content, decoded.status_code, media_type="application/json")

        relayed = False

        async def relay() -> AsyncIterator[bytes]:
            nonlocal relayed
            tail = b"\n\n"
            try:
                async for chunk in decoded.aiter_raw():
                    relayed = True
                    tail = chunk[-2:] if chunk else tail
                    yield chunk
            except httpx.HTTPError as error:
                _, failure = _upstream_error(Leg.DECODE, decode, error)
                # The error event must start on a line of its own, after a whole event.
                separator = b"" if tail == b"\n\n" else b"\n\n"
                yield separator + b"data: " + json.dumps(failure).encode() + b"\n\ndata: [DONE]\n\n"

        def settle() -> None:
            soon(decoded.aclose())
            if not relayed:
                release_soon(body, params)

        return _Relay(relay(), settle)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handoff("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handoff("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        for leg, server in ((Leg.PREFILL, prefill), (Leg.DECODE, decode)):
            try:
                answer = await client.get(f"{server}/health")
            except httpx.HTTPError as error:
                return _upstream_failed(leg, server, error)
            if answer.status_code != 200:
                _, failure = _upstream_error(leg, server, f"answered {answer.status_code} to /health")
                return JSONResponse(failure, status_code=503)
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
