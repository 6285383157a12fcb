"""A small P/D proxy in front of two `vllm serve` processes that use `KvrayConnector`: each
OpenAI completion or chat request goes first to the prefill server (one token, its KV held
there), then to the decode server with the prefill's `kv_transfer_params`, whose answer (or
stream) is the client's. Run it with

    python -m kvray.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

A failure of either server is answered as that server's status with its body; the proxy adds
no state of its own, so several may run side by side.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

#: How long one upstream call may take (seconds); vLLM answers a failed KV load itself.
UPSTREAM_TIMEOUT_S = 600.0


def build_app(prefill: str, decode: str) -> FastAPI:
    """The proxy as an ASGI app over the two servers' base URLs."""
    app = FastAPI(title="kvray P/D proxy")
    client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT_S)

    async def handoff(path: str, request: Request) -> Response:
        body: dict[str, Any] = await request.json()
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
            decoded = await client.post(f"{decode}{path}", json=second)
            return Response(decoded.content, decoded.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            async with client.stream("POST", f"{decode}{path}", json=second) as upstream:
                if upstream.status_code != 200:
                    error = await upstream.aread()
                    yield b"data: " + json.dumps({"error": error.decode(errors="replace")}).encode() + b"\n\n"
                    return
                async for chunk in upstream.aiter_raw():
                    yield chunk

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

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

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
