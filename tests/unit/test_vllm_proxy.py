"""kvray's P/D proxy (`kvray.integrations.vllm.proxy`) against stand-in prefill and decode
servers (`httpx.MockTransport`): bodies it cannot pass on are a 400 before any server sees them,
what only the decode leg would refuse is refused before the prefill runs, and a held request
whose decode leg fails (or whose client goes away) is handed back to the prefill server. A server
that cannot be reached, does not answer in time or breaks off its answer is a 503 or 502 whose
JSON error names the leg, and a stream that breaks off ends with such an error event."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi", reason="the proxy needs fastapi: pip install -e '.[serve]'")

from kvray.integrations.vllm import tickets
from kvray.integrations.vllm.proxy import Leg, build_app

PREFILL, DECODE = "http://prefill", "http://decode"
KEY = tickets.HandoffKey.from_hex(tickets.new_key_hex())
HELD = tickets.held_params(
    KEY,
    tickets.Held(
        engine="vllm-p", incarnation=1, handoff_id=tickets.mint_handoff_id(), node="", inbox="/x",
        expires=int(time.time()) + 7 * 24 * 3600,
    ),
)  # fmt: skip


class BreaksOff(httpx.AsyncByteStream):
    """A decode server's stream that sends one event, then loses its connection."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": " b"}]}\n\n'
        raise httpx.ReadError("connection reset by peer")


class Upstreams:
    """Stand-ins for the two vLLM servers; `decode_status` is what the decode server answers,
    `prefill_fails` / `decode_fails` (given the request) raise or answer instead of it."""

    def __init__(
        self,
        decode_status: int = 200,
        prefill_fails: Callable[[httpx.Request], httpx.Response] | None = None,
        decode_fails: Callable[[httpx.Request], httpx.Response] | None = None,
    ) -> None:
        self.decode_status = decode_status
        self.prefill_fails = prefill_fails
        self.decode_fails = decode_fails
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if url.endswith("/v1/models"):
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 2048}]})
        body = json.loads(request.content)
        self.calls.append((url, body))
        if url.startswith(PREFILL) and self.prefill_fails is not None and tickets.RELEASE not in str(body):
            return self.prefill_fails(request)
        if url.startswith(DECODE) and self.decode_fails is not None:
            return self.decode_fails(request)
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


async def send(
    upstreams: Upstreams, content: bytes, prefill: str = PREFILL, upstream: httpx.AsyncClient | None = None
) -> httpx.Response:
    """POST `content` to the proxy, then shut it down (which waits for its releases)."""
    upstream_client = upstream or httpx.AsyncClient(transport=httpx.MockTransport(upstreams))
    app = build_app(prefill, DECODE, client=upstream_client)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            headers = {"content-type": "application/json"}
            answer = await client.post("/v1/completions", content=content, headers=headers)
    return answer


def request(stream: bool) -> bytes:
    return json.dumps({"model": "m", "prompt": "p", "max_tokens": 8, "stream": stream}).encode()


def error_of(answer: httpx.Response) -> dict[str, Any]:
    """The OpenAI-style error of a proxy's answer, checked for the fields a client reads."""
    error = answer.json()["error"]
    assert isinstance(error, dict), answer.text
    assert error["code"] == answer.status_code and error["type"] and error["message"], answer.text
    return error


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


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
    assert answer.status_code == 503
    assert answer.json() == {"error": {"message": "refused"}}, "the decode server's own answer"
    released = upstreams.releases()
    assert (
        len(released) == 1
        and tickets.read_held(KEY, released[0]).handoff_id == tickets.read_held(KEY, HELD).handoff_id
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
    assert decode_calls[0]["kv_transfer_params"] == tickets.decode_leg_params(HELD)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_server_with_nothing_listening_is_a_503_naming_the_prefill_leg(stream: bool) -> None:
    prefill = f"http://127.0.0.1:{unused_port()}"
    upstreams = Upstreams()
    answer = await send(upstreams, request(stream), prefill=prefill, upstream=httpx.AsyncClient(timeout=10.0))
    assert answer.status_code == 503, answer.text
    error = error_of(answer)
    assert error["leg"] == Leg.PREFILL
    assert prefill in error["message"] and "ConnectError" in error["message"]


def refused_connection(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def no_answer_in_time(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


def broken_answer(request: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fails", "status", "cause"),
    [(refused_connection, 503, "ConnectError"), (no_answer_in_time, 503, "ReadTimeout"),
     (broken_answer, 502, "RemoteProtocolError")],
)  # fmt: skip
async def test_a_decode_server_that_fails_is_a_5xx_naming_the_decode_leg_and_the_ticket_goes_back(
    fails: Callable[[httpx.Request], httpx.Response], status: int, cause: str, stream: bool
) -> None:
    upstreams = Upstreams(decode_fails=fails)
    answer = await send(upstreams, request(stream))
    assert answer.status_code == status, answer.text
    error = error_of(answer)
    assert error["leg"] == Leg.DECODE
    assert DECODE in error["message"] and cause in error["message"]
    assert len(upstreams.releases()) == 1


@pytest.mark.parametrize(
    ("fails", "status", "cause"),
    [
        (no_answer_in_time, 503, "ReadTimeout"),
        (lambda request: httpx.Response(200, content=b"<html>"), 502, "not a JSON object"),
        (lambda request: httpx.Response(200, json={"choices": []}), 502, "no kv_transfer_params"),
    ],
)
async def test_a_prefill_server_that_fails_or_answers_nonsense_is_a_5xx_naming_the_prefill_leg(
    fails: Callable[[httpx.Request], httpx.Response], status: int, cause: str
) -> None:
    upstreams = Upstreams(prefill_fails=fails)
    answer = await send(upstreams, request(False))
    assert answer.status_code == status, answer.text
    error = error_of(answer)
    assert error["leg"] == Leg.PREFILL and cause in error["message"]
    assert not [url for url, _ in upstreams.calls if url.startswith(DECODE)]


async def test_a_stream_that_breaks_off_ends_with_an_error_event_naming_the_decode_leg() -> None:
    upstreams = Upstreams(decode_fails=lambda request: httpx.Response(200, stream=BreaksOff()))
    answer = await send(upstreams, request(True))
    assert answer.status_code == 200, "the stream had started"
    events = [line[len("data: ") :] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == " b"
    error = json.loads(events[1])["error"]
    assert error["leg"] == Leg.DECODE and error["code"] == 502 and "ReadError" in error["message"]
    assert events[2:] == ["[DONE]"]
    assert upstreams.releases() == [], "the decode engine had the KV: it sent a token"


async def test_health_names_the_leg_that_cannot_be_reached() -> None:
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(refused_connection))
    app = build_app(PREFILL, DECODE, client=upstream)
    proxy = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")
    async with app.router.lifespan_context(app), proxy:
        answer = await proxy.get("/health")
    assert answer.status_code == 503
    assert error_of(answer)["leg"] == Leg.PREFILL


async def test_a_stream_whose_client_leaves_before_its_first_chunk_hands_the_ticket_back() -> None:
    """The client is gone when the response starts: the relay never runs, and still the ticket
    goes back and the decode stream is closed."""
    upstreams = Upstreams()
    app = build_app(PREFILL, DECODE, client=httpx.AsyncClient(transport=httpx.MockTransport(upstreams)))
    content = request(True)
    messages = [{"type": "http.request", "body": content, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("the client hung up")

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    async with app.router.lifespan_context(app):
        with pytest.raises(Exception):  # noqa: B017 - whatever the server makes of a lost client
            await app(scope, receive, send)
    assert [url for url, _ in upstreams.calls if url.startswith(DECODE)], "the decode leg ran"
    assert len(upstreams.releases()) == 1
