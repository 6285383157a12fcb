"""kvray's P/D proxy (`kvray.integrations.vllm.proxy`) against stand-in prefill and decode
servers (`httpx.MockTransport`): bodies it cannot pass on are a 400 before any server sees them,
what only the decode leg would refuse is refused before the prefill runs, and a held request
whose decode leg fails (or whose client goes away) is handed back to the prefill server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi", reason="the proxy needs fastapi: pip install -e '.[serve]'")

from kvray.integrations.vllm import tickets
from kvray.integrations.vllm.proxy import build_app

PREFILL, DECODE = "http://prefill", "http://decode"
KEY = tickets.HandoffKey.from_hex(tickets.new_key_hex())
HELD = tickets.held_params(
    KEY, tickets.Held(engine="vllm-p", incarnation=1, request=tickets.mint_handoff(), node="", inbox="/x")
)


class Upstreams:
    """Stand-ins for the two vLLM servers; `decode_status` is what the decode server answers."""

    def __init__(self, decode_status: int = 200) -> None:
        self.decode_status = decode_status
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if url.endswith("/v1/models"):
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 2048}]})
        body = json.loads(request.content)
        self.calls.append((url, body))
        if url.startswith(PREFILL):
            return httpx.Response(200, json={"choices": [{"text": " a"}], "kv_transfer_params": HELD})
        if self.decode_status != 200:
            return httpx.Response(self.decode_status, json={"error": {"message": "refused"}})
        if body.get("stream"):
            events = b'data: {"choices": [{"text": " b"}]}\n\ndata: [DONE]\n\n'
            return httpx.Response(200, stream=httpx.ByteStream(events))
        return httpx.Response(200, json={"choices": [{"text": " b"}]})

    def releases(self) -> list[dict[str, Any]]:
        return [
            body["kv_transfer_params"]
            for url, body in self.calls
            if tickets.RELEASE in body.get("kv_transfer_params", {})
        ]


async def send(upstreams: Upstreams, content: bytes) -> httpx.Response:
    """POST `content` to the proxy, then shut it down (which waits for its releases)."""
    upstream_client = httpx.AsyncClient(transport=httpx.MockTransport(upstreams))
    app = build_app(PREFILL, DECODE, client=upstream_client)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            headers = {"content-type": "application/json"}
            answer = await client.post("/v1/completions", content=content, headers=headers)
    return answer


@pytest.mark.parametrize("content", [b"[1, 2]", b'"text"', b"5", b"null", b"{not json"])
async def test_a_body_that_is_not_a_json_object_is_a_400_that_reaches_no_server(content: bytes) -> None:
    upstreams = Upstreams()
    answer = await send(upstreams, content)
    assert answer.status_code == 400, answer.text
    assert upstreams.calls == []


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "p", "max_tokens": 100000},
        {"model": "m", "prompt": "p", "max_tokens": 8, "stream_options": {"include_usage": True}},
        {"model": "m", "prompt": "p", "max_tokens": "many"},
    ],
)
async def test_what_only_the_decode_leg_would_refuse_is_refused_before_the_prefill(
    body: dict[str, Any],
) -> None:
    upstreams = Upstreams()
    answer = await send(upstreams, json.dumps(body).encode())
    assert answer.status_code == 400, answer.text
    assert upstreams.calls == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_leg_that_fails_hands_the_ticket_back_to_the_prefill_server(stream: bool) -> None:
    upstreams = Upstreams(decode_status=503)
    answer = await send(
        upstreams, json.dumps({"model": "m", "prompt": "p", "max_tokens": 8, "stream": stream}).encode()
    )
    assert answer.status_code == (200 if stream else 503)
    released = upstreams.releases()
    assert (
        len(released) == 1
        and tickets.read_held(KEY, released[0]).request == tickets.read_held(KEY, HELD).request
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_leg_that_answers_keeps_the_ticket(stream: bool) -> None:
    upstreams = Upstreams()
    answer = await send(
        upstreams, json.dumps({"model": "m", "prompt": "p", "max_tokens": 8, "stream": stream}).encode()
    )
    assert answer.status_code == 200
    assert upstreams.releases() == []
    decode_calls = [body for url, body in upstreams.calls if url.startswith(DECODE)]
    assert decode_calls[0]["kv_transfer_params"] == HELD
