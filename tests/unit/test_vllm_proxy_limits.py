"""The limits and conventions of kvray's P/D proxy (`kvray.integrations.vllm.proxy`, whose module
docstring is the spec): the request body's size and time (413, 408), the request head's time and
size on a real uvicorn server (`uvicorn_config`), a pool of connections per leg (a full decode
pool is a 503 "busy" that does not stop the prefill leg), streams per client (429, X-Forwarded-For
only when trusted), a client that stops reading its stream (cut off, its decode stream closed),
a stream that runs too long, `n` / `best_of`, a decode server whose KV did not load (502
`kv_load_failed`, as a status while no token has come), `/v1/models`, the headers both legs get,
the fields the prefill leg does not, several servers per leg (fewest in flight, an unreachable one
passed over, a ticket back to its issuer), `/health`, and `ProxyLimits` / `main`'s flags.

Stand-in servers are `httpx.MockTransport`s (`Upstreams` of test_vllm_proxy) where one HTTP
client for both legs will do, and small Starlette apps on uvicorn where the proxy's own pools
are under test. Servers run on the test's event loop, each on a socket bound to a free port."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi", reason="the proxy needs fastapi: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the proxy's server: pip install -e '.[serve]'")

import uvicorn
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message
from test_vllm_proxy import DECODE, HELD, KEY, PREFILL, Upstreams, error_of, refused_connection, request

from kvray.errors import ConfigError
from kvray.integrations.vllm import proxy, tickets
from kvray.integrations.vllm.proxy import Cause, Leg, ProxyLimits, build_app

TOKEN = b'data: {"choices": [{"index": 0, "text": " b", "finish_reason": null}]}\n\n'
DONE = b"data: [DONE]\n\n"
#: vLLM's answer to a request that ended with finish_reason "error" (its GenerationError).
VLLM_FAILED = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                         "code": 500}}  # fmt: skip
P1, P2 = f"{PREFILL}-1", f"{PREFILL}-2"
D1, D2 = f"{DECODE}-1", f"{DECODE}-2"


# ---- stand-ins ----------------------------------------------------------------------------------


class Recorded(Upstreams):
    """`Upstreams` that also keeps every request it gets (model cards included), headers and all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return super().__call__(request)

    def completions(self, base: str = "") -> list[httpx.Request]:
        """The completion requests (releases included) to servers whose URL starts with `base`."""
        return [
            sent
            for sent in self.requests
            if sent.url.path.endswith("/completions") and str(sent.url).startswith(base)
        ]


class Gate:
    """A decode server whose streams send their first token, then wait for `go` (a plain request
    is answered at once); `opened` and `closed` count its streams."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.opened = 0
        self.closed = 0

    def answer(self, request: httpx.Request) -> httpx.Response:
        if not json.loads(request.content).get("stream"):
            return httpx.Response(200, json={"choices": [{"text": " b"}]})
        self.opened += 1
        return httpx.Response(200, stream=HeldStream(self))

    @property
    def open(self) -> int:
        return self.opened - self.closed


class HeldStream(httpx.AsyncByteStream):
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield TOKEN
        await self.gate.go.wait()
        yield DONE

    async def aclose(self) -> None:
        self.gate.closed += 1


class Endless(httpx.AsyncByteStream):
    """A decode server's stream of large events that never ends; `closed` once closed."""

    def __init__(self) -> None:
        self.started = False
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.started = True
        event = b'data: {"choices": [{"index": 0, "text": "' + b"x" * 65536 + b'"}]}\n\n'
        while not self.closed:
            yield event
            await asyncio.sleep(0)

    async def aclose(self) -> None:
        self.closed = True


def events(*chunks: bytes) -> Callable[[httpx.Request], httpx.Response]:
    """A decode server that streams `chunks` as one 200 answer."""
    return lambda request: httpx.Response(200, stream=httpx.ByteStream(b"".join(chunks)))


def mock(handler: Callable[[httpx.Request], Any]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def proxy_app(
    handler: Callable[[httpx.Request], Any],
    prefill: str | list[str] = PREFILL,
    decode: str | list[str] = DECODE,
    **limits: Any,
) -> FastAPI:
    """The proxy over one mock client for both legs, under `ProxyLimits(**limits)`."""
    return build_app(prefill, decode, client=mock(handler), limits=ProxyLimits(**limits))


def held_ticket(engine: str) -> dict[str, Any]:
    return tickets.held_params(
        KEY,
        tickets.Held(
            engine=engine, incarnation=1, handoff_id=tickets.mint_handoff_id(), node="", inbox="/x",
            expires=int(time.time()) + 7 * 24 * 3600,
        ),
    )  # fmt: skip


def prefilled(ticket: dict[str, Any] = HELD) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": " a"}], "kv_transfer_params": ticket})


def data_lines(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


# ---- driving the proxy --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def asgi_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `app` in this process; leaving it shuts the proxy down (its releases done)."""
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=20.0) as client,
    ):
        yield client


@contextlib.asynccontextmanager
async def served(app: Any, config: Any = None) -> AsyncIterator[int]:
    """`app` on a real uvicorn server on this loop (`config`, e.g. the proxy's `uvicorn_config`,
    or a plain one), listening on a free port of 127.0.0.1: that port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port: int = listener.getsockname()[1]
    if callable(config):
        config = config(port)
    config = config or uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    config.timeout_graceful_shutdown = 5
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        async with asyncio.timeout(20):
            while not server.started:
                if task.done():
                    task.result()
                    raise AssertionError("uvicorn stopped before it started")
                await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        listener.close()


def served_proxy(app: FastAPI) -> contextlib.AbstractAsyncContextManager[int]:
    """The proxy `app` on uvicorn as `main` serves it (`uvicorn_config` under its limits)."""
    return served(app, lambda port: proxy.uvicorn_config(app, app.state.limits, port=port))


def client_of(port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20.0, trust_env=False)


async def stream_answer(client: httpx.AsyncClient, headers: dict[str, str] | None = None) -> httpx.Response:
    """A stream request's answer: its body read unless it is a 200 (whose stream is then closed):
    a proxy that wrongly takes the request does not make the test wait for a stream's end."""
    async with client.stream("POST", "/v1/completions", content=request(True), headers=headers) as answer:
        if answer.status_code != 200:
            await answer.aread()
    return answer


async def eventually(condition: Callable[[], bool], what: str, within: float = 15.0) -> None:
    try:
        async with asyncio.timeout(within):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {within} s: {what}") from None


@contextlib.asynccontextmanager
async def raw_connection(port: int, receive_buffer: int | None = None) -> AsyncIterator[socket.socket]:
    """A plain TCP connection to 127.0.0.1:`port` (non-blocking, for the loop's sock_* calls)."""
    sock = socket.socket()
    sock.setblocking(False)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        yield sock
    finally:
        sock.close()


async def until_closed(sock: socket.socket, within: float = 6.0) -> bytes:
    """What the server sends until it closes the connection; AssertionError unless it does so
    within `within` seconds."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    try:
        async with asyncio.timeout(within):
            while chunk := await loop.sock_recv(sock, 1 << 16):
                got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(
            f"the server did not close the connection within {within} s; it sent {bytes(got[:300])!r}"
        ) from None
    return bytes(got)


def reset(sock: socket.socket) -> bool:
    """Whether the peer has reset the connection (read without taking any of its data)."""
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET or (
        _tcp_state(sock) == _TCP_CLOSE
    )


#: Linux's TCP_INFO: its first byte is the connection's state; 7 is TCP_CLOSE.
_TCP_CLOSE = 7


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


async def read_head(sock: socket.socket) -> bytes:
    """An answer's head (and whatever of its body came with it)."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(10):
        while b"\r\n\r\n" not in got:
            chunk = await loop.sock_recv(sock, 1 << 12)
            assert chunk, f"the server closed the connection after {bytes(got)!r}"
            got += chunk
    return bytes(got)


async def read_answer(sock: socket.socket) -> bytes:
    """A whole answer that has a Content-Length."""
    got = await read_head(sock)
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while len(body) < length:
            body += await loop.sock_recv(sock, 1 << 12)
    return got


async def call_app(
    app: FastAPI, headers: list[tuple[bytes, bytes]], first: bytes, more_body: bool
) -> tuple[int, dict[str, str], bytes]:
    """POST /v1/completions straight into the ASGI app: `first` as the body's first part and,
    with `more_body`, the rest of a body that never comes. The answer's status, headers, body."""
    messages: list[Message] = [{"type": "http.request", "body": first, "more_body": more_body}]
    never = asyncio.Event()
    sent: list[Message] = []

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app(scope, receive, send), 20)
    start = next(message for message in sent if message["type"] == "http.response.start")
    answer_headers = {name.decode(): value.decode() for name, value in start["headers"]}
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return start["status"], answer_headers, body


def body_of_size(size: int) -> bytes:
    base = {"model": "m", "prompt": "", "max_tokens": 8}
    content = json.dumps({**base, "prompt": "x" * (size - len(json.dumps(base)))}).encode()
    assert len(content) == size
    return content


# ---- 1. the request body's size -----------------------------------------------------------------


async def test_a_body_over_the_limit_is_a_413_that_reaches_no_server() -> None:
    upstreams = Recorded()
    async with asgi_client(proxy_app(upstreams, max_body_bytes=1000)) as client:
        answer = await client.post("/v1/completions", content=body_of_size(1001))
    assert answer.status_code == 413, answer.text
    assert error_of(answer)["type"] == "RequestEntityTooLargeError"
    assert answer.headers["connection"] == "close"
    assert upstreams.requests == []


async def test_a_content_length_over_the_limit_is_a_413_before_any_of_the_body_is_read() -> None:
    """The body never comes: only its Content-Length can have refused it."""
    upstreams = Recorded()
    app = proxy_app(upstreams, max_body_bytes=1000, receive_timeout_s=60.0)
    status, headers, body = await call_app(app, [(b"content-length", b"1000000000")], b"", more_body=True)
    assert status == 413, body
    assert json.loads(body)["error"]["code"] == 413
    assert headers["connection"] == "close"
    assert upstreams.requests == []


async def test_a_chunked_body_over_the_limit_is_a_413_read_no_further_than_past_the_limit() -> None:
    upstreams = Recorded()
    sent = 0

    async def endless_body() -> AsyncIterator[bytes]:
        nonlocal sent
        while True:
            sent += 100
            yield b" " * 100
            await asyncio.sleep(0)  # a proxy that reads on and on still lets the test's timeout fire

    async with asgi_client(proxy_app(upstreams, max_body_bytes=1000)) as client:
        answer = await asyncio.wait_for(client.post("/v1/completions", content=endless_body()), 20)
    assert answer.status_code == 413, answer.text
    assert error_of(answer)["code"] == 413
    assert sent <= 1000 + 2 * 100, f"the proxy read {sent} bytes of a body limited to 1000"
    assert upstreams.requests == []


async def test_a_body_at_the_limit_passes() -> None:
    upstreams = Recorded()
    async with asgi_client(proxy_app(upstreams, max_body_bytes=1000)) as client:
        answer = await client.post("/v1/completions", content=body_of_size(1000))
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"choices": [{"text": " b"}]}


# ---- 2. the request body's time -----------------------------------------------------------------


async def test_a_body_that_stops_arriving_is_a_408_that_reaches_no_server() -> None:
    upstreams = Recorded()
    app = proxy_app(upstreams, receive_timeout_s=0.5)
    status, headers, body = await call_app(app, [(b"content-length", b"100")], b'{"model": ', more_body=True)
    assert status == 408, body
    assert json.loads(body)["error"]["type"] == "RequestTimeoutError"
    assert headers["connection"] == "close"
    assert upstreams.requests == []


async def test_a_body_that_stops_arriving_at_the_real_server_is_a_408_and_its_connection_closes() -> None:
    """The head came whole (so the head deadline, shorter, does not apply); the body did not."""
    upstreams = Recorded()
    app = proxy_app(upstreams, receive_timeout_s=1.0, head_timeout_s=0.5)
    async with served_proxy(app) as port, raw_connection(port) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Length: 100\r\n\r\n"
        await asyncio.get_running_loop().sock_sendall(sock, head + b'{"model": ')
        answer = await until_closed(sock, within=10)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"RequestTimeoutError" in answer
    assert upstreams.requests == []


@pytest.mark.parametrize("first", [[], [b'{"model": ']], ids=["before-its-body", "mid-body"])
async def test_a_client_that_hangs_up_before_its_body_is_read_reaches_no_server(first: list[bytes]) -> None:
    """The ASGI server reports the client gone while the proxy reads the body (Starlette's
    ClientDisconnect escaped the proxy: "Exception in ASGI application")."""
    upstreams = Recorded()
    app = proxy_app(upstreams)
    messages: list[Message] = [
        {"type": "http.request", "body": chunk, "more_body": True} for chunk in first
    ] + [{"type": "http.disconnect"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
    assert upstreams.requests == []
    assert sent and sent[0]["type"] == "http.response.start"


# ---- 3. the request head -------------------------------------------------------------------------


async def test_a_half_sent_head_is_closed_soon_after_head_timeout_s() -> None:
    app = proxy_app(Recorded(), head_timeout_s=0.5)
    async with served_proxy(app) as port, raw_connection(port) as sock:
        await asyncio.get_running_loop().sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: pro")
        assert await until_closed(sock) == b"", "closed without an answer"


async def test_a_connection_that_sends_nothing_is_closed_soon_after_head_timeout_s() -> None:
    app = proxy_app(Recorded(), head_timeout_s=0.5)
    async with served_proxy(app) as port, raw_connection(port) as sock:
        assert await until_closed(sock) == b""


async def test_the_next_request_on_a_kept_alive_connection_has_its_own_head_deadline() -> None:
    app = proxy_app(Recorded(), head_timeout_s=0.5)
    loop = asyncio.get_running_loop()
    async with served_proxy(app) as port, raw_connection(port) as sock:
        await asyncio.sleep(0.2)  # part of the first deadline gone: the next starts anew
        await loop.sock_sendall(sock, b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n")
        assert (await read_answer(sock)).startswith(b"HTTP/1.1 200 ")
        await loop.sock_sendall(sock, b"GET /v1/models HTTP/1.1\r\nHo")
        assert await until_closed(sock) == b""


async def test_an_idle_connection_stays_open_for_keep_alive_s_and_then_closes() -> None:
    """Longer than a client's own keep-alive (httpx: 5 s): at uvicorn's 5 s a client's next
    request raced the proxy's close and met a ReadError."""
    assert proxy.uvicorn_config(FastAPI(), proxy.ProxyLimits()).timeout_keep_alive == 30.0
    app = proxy_app(Recorded(), keep_alive_s=1.5)
    loop = asyncio.get_running_loop()
    async with served_proxy(app) as port, raw_connection(port) as sock:
        await loop.sock_sendall(sock, b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n")
        assert (await read_answer(sock)).startswith(b"HTTP/1.1 200 ")
        opened = time.monotonic()
        assert await until_closed(sock, within=10) == b""
        assert time.monotonic() - opened >= 1.0  # kept for keep_alive_s, not closed at once


@pytest.mark.parametrize("pieces", [1, 2], ids=["whole", "in-two-pieces"])
async def test_a_head_over_max_head_bytes_is_a_400(pieces: int) -> None:
    """A head over the limit is refused whether it arrives whole in one read or in pieces."""
    upstreams = Recorded()
    app = proxy_app(upstreams, max_head_bytes=4096)
    head = b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n"
    loop = asyncio.get_running_loop()
    async with served_proxy(app) as port, raw_connection(port) as sock:
        if pieces == 1:
            await loop.sock_sendall(sock, head)
        else:
            await loop.sock_sendall(sock, head[:6000])
            await asyncio.sleep(0.1)
            with contextlib.suppress(ConnectionError):
                await loop.sock_sendall(sock, head[6000:])
        answer = await until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert upstreams.requests == []


@pytest.mark.parametrize(("size", "status"), [(4096, b"200"), (4097, b"400")])
async def test_max_head_bytes_is_the_largest_head_that_passes(size: int, status: bytes) -> None:
    app = proxy_app(Recorded(), max_head_bytes=4096)
    start, end = b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\nX-Pad: ", b"\r\n\r\n"
    head = start + b"a" * (size - len(start) - len(end)) + end
    assert len(head) == size
    async with served_proxy(app) as port, raw_connection(port) as sock:
        await asyncio.get_running_loop().sock_sendall(sock, head)
        answer = await read_head(sock)
    assert answer.startswith(b"HTTP/1.1 " + status + b" "), answer[:300]


async def test_a_head_under_max_head_bytes_passes_with_a_larger_body_in_the_same_packet() -> None:
    upstreams = Recorded()
    app = proxy_app(upstreams, max_head_bytes=4096)
    content = body_of_size(8000)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"X-Padding: " + b"a" * 2000 + b"\r\nContent-Length: " + str(len(content)).encode() + b"\r\n\r\n"
    )
    async with served_proxy(app) as port, raw_connection(port) as sock:
        await asyncio.get_running_loop().sock_sendall(sock, head + content)
        answer = await read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


# ---- 4. a pool per leg ---------------------------------------------------------------------------


class StandIns:
    """A prefill and a decode vLLM server as Starlette apps (for real connections): the decode
    server's streams send a token, then wait for `go`; a prefill whose prompt is "slow" waits for
    `go` before it answers."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.prefill_bodies: list[dict[str, Any]] = []
        self.decode_bodies: list[dict[str, Any]] = []

    def prefill(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.prefill_bodies.append(body)
            if body.get("prompt") == "slow":
                await self.go.wait()
            return JSONResponse({"choices": [{"text": " a"}], "kv_transfer_params": HELD})

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    def decode(self) -> Starlette:
        async def models(request: Request) -> Response:
            return JSONResponse({"data": [{"id": "m", "max_model_len": 2048}]})

        async def completions(request: Request) -> Response:
            body = await request.json()
            self.decode_bodies.append(body)

            async def stream() -> AsyncIterator[bytes]:
                yield TOKEN
                await self.go.wait()
                yield DONE

            return StreamingResponse(stream(), media_type="text/event-stream")

        return Starlette(
            routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
        )

    def releases(self) -> list[dict[str, Any]]:
        return [body for body in self.prefill_bodies if tickets.RELEASE in body["kv_transfer_params"]]


async def test_a_full_decode_pool_does_not_stop_the_prefill_leg_and_is_a_503_busy_for_the_decode_leg() -> (
    None
):
    """Two streams hold both of the decode pool's connections: a third request's prefill leg
    still runs (on the prefill pool), its decode leg waits pool_timeout_s, then a 503 "busy"."""
    stand_ins = StandIns()
    async with contextlib.AsyncExitStack() as stack:
        prefill_port = await stack.enter_async_context(served(stand_ins.prefill()))
        decode_port = await stack.enter_async_context(served(stand_ins.decode()))
        app = build_app(
            f"http://127.0.0.1:{prefill_port}",
            f"http://127.0.0.1:{decode_port}",
            limits=ProxyLimits(upstream_connections=2, pool_timeout_s=0.5),
        )
        client = await stack.enter_async_context(
            client_of(await stack.enter_async_context(served_proxy(app)))
        )
        held = []
        for _ in range(2):
            stream = await stack.enter_async_context(
                client.stream("POST", "/v1/completions", content=request(True))
            )
            assert stream.status_code == 200
            held.append(stream)
        third = await stream_answer(client)
        assert third.status_code == 503, third.text
        error = error_of(third)
        assert (error["leg"], error["cause"]) == (Leg.DECODE, Cause.BUSY)
        assert len([body for body in stand_ins.prefill_bodies if body["max_tokens"] == 1]) == 3
        assert len(stand_ins.decode_bodies) == 2
        await eventually(lambda: len(stand_ins.releases()) == 1, "the third request's ticket went back")
        stand_ins.go.set()
        for stream in held:
            assert data_lines((await stream.aread()).decode())[-1] == "[DONE]"


async def test_a_server_slower_than_upstream_timeout_s_is_a_503_timeout_naming_its_leg() -> None:
    stand_ins = StandIns()
    async with contextlib.AsyncExitStack() as stack:
        prefill_port = await stack.enter_async_context(served(stand_ins.prefill()))
        decode_port = await stack.enter_async_context(served(stand_ins.decode()))
        app = build_app(
            f"http://127.0.0.1:{prefill_port}",
            f"http://127.0.0.1:{decode_port}",
            limits=ProxyLimits(upstream_timeout_s=0.5),
        )
        client = await stack.enter_async_context(
            client_of(await stack.enter_async_context(served_proxy(app)))
        )
        slow = json.dumps({"model": "m", "prompt": "slow", "max_tokens": 8}).encode()
        answer = await client.post("/v1/completions", content=slow)
        stand_ins.go.set()
    assert answer.status_code == 503, answer.text
    error = error_of(answer)
    assert (error["leg"], error["cause"]) == (Leg.PREFILL, Cause.TIMEOUT)
    assert stand_ins.decode_bodies == []


# ---- 5. streams per client -----------------------------------------------------------------------


async def test_a_third_stream_of_a_client_is_a_429_a_plain_request_passes_and_ended_streams_free_places() -> (
    None
):
    gate = Gate()
    upstreams = Recorded(decode_fails=gate.answer)
    app = proxy_app(upstreams, max_streams_per_client=2)
    async with served_proxy(app) as port, client_of(port) as client:
        async with contextlib.AsyncExitStack() as streams:
            held = [
                await streams.enter_async_context(
                    client.stream("POST", "/v1/completions", content=request(True))
                )
                for _ in range(2)
            ]
            assert [stream.status_code for stream in held] == [200, 200]
            third = await stream_answer(client)
            assert third.status_code == 429, third.text
            assert error_of(third)["type"] == "RateLimitError"
            plain = await client.post("/v1/completions", content=request(False))
            assert plain.status_code == 200, plain.text
            gate.go.set()
            for stream in held:
                await stream.aread()
        await eventually(lambda: gate.opened == 2 and gate.open == 0, "both streams closed")
        again = [await client.post("/v1/completions", content=request(True)) for _ in range(2)]
    assert [answer.status_code for answer in again] == [200, 200], again[0].text
    assert data_lines(again[1].text)[-1] == "[DONE]"


async def test_with_trust_forwarded_for_the_last_forwarded_address_is_the_client() -> None:
    gate = Gate()
    app = proxy_app(Recorded(decode_fails=gate.answer), max_streams_per_client=1, trust_forwarded_for=True)

    def stream(forwarded: str) -> Any:
        return client.stream(
            "POST", "/v1/completions", content=request(True), headers={"x-forwarded-for": forwarded}
        )

    async with served_proxy(app) as port, client_of(port) as client, contextlib.AsyncExitStack() as streams:
        first = await streams.enter_async_context(stream("203.0.113.9, 10.0.0.1"))
        second = await streams.enter_async_context(stream("203.0.113.9, 10.0.0.2"))
        assert (first.status_code, second.status_code) == (200, 200), "two clients behind one balancer"
        third = await stream_answer(client, {"x-forwarded-for": "198.51.100.7, 10.0.0.1"})
        assert third.status_code == 429, "the first client again: only the last address counts"
        gate.go.set()


async def test_without_trust_forwarded_for_every_client_behind_a_balancer_is_the_balancer() -> None:
    """X-Forwarded-For is a header anyone can send: untrusted, only the peer address counts (on
    the real server too, which would otherwise take it from a peer on 127.0.0.1)."""
    gate = Gate()
    app = proxy_app(Recorded(decode_fails=gate.answer), max_streams_per_client=1)
    async with served_proxy(app) as port, client_of(port) as client, contextlib.AsyncExitStack() as streams:
        first = await streams.enter_async_context(
            client.stream(
                "POST", "/v1/completions", content=request(True), headers={"x-forwarded-for": "10.0.0.1"}
            )
        )
        assert first.status_code == 200
        second = await stream_answer(client, {"x-forwarded-for": "10.0.0.2"})
        assert second.status_code == 429, "the same client as the first"
        assert error_of(second)["type"] == "RateLimitError"
        gate.go.set()


# ---- 6. a client that stops reading -------------------------------------------------------------


async def test_a_client_that_stops_reading_is_cut_off_and_its_decode_stream_closed() -> None:
    endless = Endless()
    answered: list[httpx.Request] = []

    def decode(request: httpx.Request) -> httpx.Response:
        answered.append(request)
        if len(answered) == 1:
            return httpx.Response(200, stream=endless)
        return events(TOKEN, DONE)(request)

    app = proxy_app(Recorded(decode_fails=decode), write_timeout_s=0.5, max_streams_per_client=1)
    content = request(True)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(content)).encode() + b"\r\n\r\n"
    )
    async with served_proxy(app) as port, raw_connection(port, receive_buffer=4096) as sock:
        await asyncio.get_running_loop().sock_sendall(sock, head + content)
        assert (await read_head(sock)).startswith(b"HTTP/1.1 200 ")
        # ... and reads no more: the proxy's writes back up until one waits past write_timeout_s.
        await eventually(lambda: endless.closed, "the decode stream closed", within=20)
        assert endless.started
        async with client_of(port) as client:
            following = await client.post("/v1/completions", content=request(True))
        assert following.status_code == 200, "the cut-off stream no longer counts as the client's"
        assert data_lines(following.text)[-1] == "[DONE]"
        # Its own connection is aborted although it still reads nothing (uvicorn alone keeps it,
        # and the answer it holds, until the client reads or leaves).
        await eventually(lambda: reset(sock), "the client's connection reset", within=20)


async def test_a_stream_still_running_after_max_stream_s_ends_with_an_error_event() -> None:
    gate = Gate()
    async with asgi_client(proxy_app(Recorded(decode_fails=gate.answer), max_stream_s=0.5)) as client:
        answer = await asyncio.wait_for(client.post("/v1/completions", content=request(True)), 20)
    assert answer.status_code == 200
    lines = data_lines(answer.text)
    assert json.loads(lines[0])["choices"][0]["text"] == " b"
    error = json.loads(lines[1])["error"]
    assert (error["leg"], error["cause"], error["code"]) == (Leg.DECODE, Cause.STREAM_TOO_LONG, 504)
    assert lines[2:] == ["[DONE]"]
    assert gate.opened == gate.closed == 1


# ---- 7. n and best_of ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [{"n": 2}, {"best_of": 3}, {"n": True}, {"n": False}, {"best_of": True}, {"n": 1, "best_of": 2}],
    ids=str,
)
async def test_n_or_best_of_other_than_1_is_a_400_that_reaches_no_server(fields: dict[str, Any]) -> None:
    upstreams = Recorded()
    content = json.dumps({"model": "m", "prompt": "p", "max_tokens": 8, **fields}).encode()
    async with asgi_client(proxy_app(upstreams)) as client:
        answer = await client.post("/v1/completions", content=content)
    assert answer.status_code == 400, answer.text
    assert error_of(answer)["type"] == "BadRequestError"
    assert upstreams.requests == []


@pytest.mark.parametrize("fields", [{"n": 1}, {"best_of": 1}, {"n": 1, "best_of": 1}], ids=str)
async def test_n_and_best_of_of_1_pass(fields: dict[str, Any]) -> None:
    content = json.dumps({"model": "m", "prompt": "p", "max_tokens": 8, **fields}).encode()
    async with asgi_client(proxy_app(Recorded())) as client:
        answer = await client.post("/v1/completions", content=content)
    assert answer.status_code == 200, answer.text


# ---- 8. a KV that did not load, and other requests ended with an error -------------------------


ROLE = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]}\n\n'
FINISHED_WITH_ERROR = b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "error"}]}\n\n'


@pytest.mark.parametrize(
    ("stream", "decode"),
    [
        (
            False,
            lambda request: httpx.Response(200, json={"choices": [{"text": "", "finish_reason": "error"}]}),
        ),
        (False, lambda request: httpx.Response(500, json=VLLM_FAILED)),
        (True, lambda request: httpx.Response(500, json=VLLM_FAILED)),
        (True, events(FINISHED_WITH_ERROR, DONE)),
        (True, events(ROLE, b"data: " + json.dumps(VLLM_FAILED).encode() + b"\n\n", DONE)),
    ],
    ids=[
        "finish-error",
        "vllm-500",
        "stream-vllm-500",
        "stream-finish-error-first",
        "stream-error-event-first",
    ],
)
async def test_a_decode_server_that_ends_the_request_with_an_error_before_a_token_is_a_502_kv_load_failed(
    stream: bool, decode: Callable[[httpx.Request], httpx.Response]
) -> None:
    upstreams = Recorded(decode_fails=decode)
    async with asgi_client(proxy_app(upstreams)) as client:
        answer = await client.post("/v1/completions", content=request(stream))
    assert answer.status_code == 502, answer.text
    error = error_of(answer)
    assert (error["leg"], error["cause"]) == (Leg.DECODE, Cause.KV_LOAD_FAILED)
    released = upstreams.releases()
    assert len(released) == 1, "the ticket goes back"
    assert tickets.read_held(KEY, released[0]).handoff_id == tickets.read_held(KEY, HELD).handoff_id


async def test_a_stream_that_ends_with_an_error_after_a_token_ends_with_an_error_event() -> None:
    upstreams = Recorded(decode_fails=events(TOKEN, FINISHED_WITH_ERROR, DONE))
    async with asgi_client(proxy_app(upstreams)) as client:
        answer = await client.post("/v1/completions", content=request(True))
    assert answer.status_code == 200, "the stream had started"
    lines = data_lines(answer.text)
    assert json.loads(lines[0])["choices"][0]["text"] == " b"
    error = json.loads(lines[-2])["error"]
    assert (error["leg"], error["code"]) == (Leg.DECODE, 502)
    assert error["cause"] == Cause.REQUEST_FAILED
    assert lines[-1] == "[DONE]"
    assert upstreams.releases() == [], "the decode engine had the KV: it sent a token"


@pytest.mark.parametrize(
    "prefill",
    [
        lambda request: httpx.Response(
            200, json={"choices": [{"text": "", "finish_reason": "error"}], "kv_transfer_params": HELD}
        ),
        lambda request: httpx.Response(500, json=VLLM_FAILED),
    ],
    ids=["finish-error", "vllm-500"],
)
async def test_a_prefill_server_that_ends_the_request_with_an_error_is_a_502_for_the_prefill_leg(
    prefill: Callable[[httpx.Request], httpx.Response],
) -> None:
    upstreams = Recorded(prefill_fails=prefill)
    async with asgi_client(proxy_app(upstreams)) as client:
        answer = await client.post("/v1/completions", content=request(False))
    assert answer.status_code == 502, answer.text
    error = error_of(answer)
    assert (error["leg"], error["cause"]) == (Leg.PREFILL, Cause.REQUEST_FAILED)
    assert upstreams.completions(DECODE) == []


# ---- 9. models, headers, the legs' bodies --------------------------------------------------------


async def test_v1_models_is_the_decode_servers_answer() -> None:
    cards = {"object": "list", "data": [{"id": "decode-model", "max_model_len": 4096}]}

    def servers(request: httpx.Request) -> httpx.Response:
        if str(request.url).startswith(DECODE):
            return httpx.Response(200, json=cards)
        return httpx.Response(200, json={"object": "list", "data": [{"id": "prefill-model"}]})

    async with asgi_client(proxy_app(servers)) as client:
        answer = await client.get("/v1/models")
    assert answer.status_code == 200
    assert answer.json() == cards


async def test_authorization_and_x_request_id_reach_both_legs_and_the_release() -> None:
    upstreams = Recorded(decode_status=503)
    headers = {"authorization": "Bearer secret", "x-request-id": "request-7"}
    async with asgi_client(proxy_app(upstreams)) as client:
        answer = await client.post("/v1/completions", content=request(False), headers=headers)
    assert answer.status_code == 503
    assert answer.headers["x-request-id"] == "request-7"
    sent = upstreams.completions()
    assert [str(one.url).startswith(PREFILL) for one in sent] == [True, False, True], (
        "prefill, decode, release"
    )
    assert tickets.RELEASE in json.loads(sent[2].content)["kv_transfer_params"]
    for one in sent:
        assert (one.headers.get("authorization"), one.headers.get("x-request-id")) == (
            "Bearer secret",
            "request-7",
        ), one.url


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_without_x_request_id_gets_one_on_both_legs_and_its_answer(stream: bool) -> None:
    upstreams = Recorded()
    async with asgi_client(proxy_app(upstreams)) as client:
        answer = await client.post("/v1/completions", content=request(stream))
    assert answer.status_code == 200
    request_id = answer.headers.get("x-request-id")
    assert request_id
    sent = upstreams.completions()
    assert len(sent) == 2
    assert [one.headers.get("x-request-id") for one in sent] == [request_id, request_id]


async def test_the_prefill_leg_drops_what_it_cannot_take_and_the_decode_leg_gets_it_all() -> None:
    upstreams = Recorded()
    given = {
        "model": "m", "prompt": "p", "max_tokens": 8, "max_completion_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}, "min_tokens": 2, "min_completion_tokens": 3,
    }  # fmt: skip
    async with asgi_client(proxy_app(upstreams)) as client:
        answer = await client.post("/v1/completions", content=json.dumps(given).encode())
    assert answer.status_code == 200, answer.text
    (prefill_body,) = [json.loads(one.content) for one in upstreams.completions(PREFILL)]
    (decode_body,) = [json.loads(one.content) for one in upstreams.completions(DECODE)]
    assert not {"stream_options", "min_tokens", "min_completion_tokens"} & prefill_body.keys()
    assert (prefill_body["max_tokens"], prefill_body["max_completion_tokens"], prefill_body["stream"]) == (
        1,
        1,
        False,
    )
    assert {name: decode_body[name] for name in given} == given
    assert decode_body["kv_transfer_params"] == tickets.decode_leg_params(HELD)
    assert tickets.RELEASE_TAG not in decode_body["kv_transfer_params"]


# ---- 10. several servers per leg ---------------------------------------------------------------


async def test_a_request_goes_to_the_decode_server_with_the_fewest_requests_in_flight() -> None:
    gate = Gate()
    upstreams = Recorded(decode_fails=gate.answer)
    app = proxy_app(upstreams, [P1, P2], [D1, D2])
    async with (
        served_proxy(app) as port,
        client_of(port) as client,
        client.stream("POST", "/v1/completions", content=request(True)) as held,
    ):
        assert held.status_code == 200
        (streamed,) = [str(one.url) for one in upstreams.completions(DECODE)]
        plain = [await client.post("/v1/completions", content=request(False)) for _ in range(2)]
        assert [answer.status_code for answer in plain] == [200, 200]
        gate.go.set()
        await held.aread()
    decoded = [str(one.url) for one in upstreams.completions(DECODE)]
    other = D2 if streamed.startswith(D1) else D1
    assert [url.startswith(other) for url in decoded[1:]] == [True, True], decoded
    assert {str(one.url).split("/v1")[0] for one in upstreams.completions(PREFILL)} == {P1, P2}


async def test_an_unreachable_prefill_server_is_passed_over_and_another_serves_the_request() -> None:
    def prefill(request: httpx.Request) -> httpx.Response:
        return refused_connection(request) if str(request.url).startswith(P1) else prefilled()

    upstreams = Recorded(prefill_fails=prefill)
    async with asgi_client(proxy_app(upstreams, [P1, P2], DECODE)) as client:
        answers = [await client.post("/v1/completions", content=request(False)) for _ in range(3)]
    assert [answer.status_code for answer in answers] == [200, 200, 200], answers[0].text
    tried = [str(one.url).split("/v1")[0] for one in upstreams.completions(PREFILL)]
    assert tried.count(P1) == 1, f"passed over once it refused: {tried}"
    assert tried.count(P2) == 3


async def test_a_held_ticket_goes_back_to_the_prefill_server_that_issued_it() -> None:
    issued = {P1: held_ticket("vllm-p1"), P2: held_ticket("vllm-p2")}

    def prefill(request: httpx.Request) -> httpx.Response:
        return prefilled(issued[str(request.url).split("/v1")[0]])

    upstreams = Recorded(decode_status=503, prefill_fails=prefill)
    async with asgi_client(proxy_app(upstreams, [P1, P2], DECODE)) as client:
        for _ in range(4):
            assert (await client.post("/v1/completions", content=request(False))).status_code == 503
    released = [
        (str(one.url).split("/v1")[0], json.loads(one.content)["kv_transfer_params"])
        for one in upstreams.completions(PREFILL)
        if tickets.RELEASE in json.loads(one.content)["kv_transfer_params"]
    ]
    assert len(released) == 4
    assert {server for server, _ in released} == {P1, P2}
    for server, ticket in released:
        handoff_id = tickets.read_held(KEY, issued[server]).handoff_id
        assert tickets.read_held(KEY, ticket).handoff_id == handoff_id, server


# ---- 11. /health ---------------------------------------------------------------------------------


def health(statuses: dict[str, int | None]) -> Callable[[httpx.Request], httpx.Response]:
    """Servers that answer /health with their status in `statuses` (None: a refused connection)."""

    def answer(request: httpx.Request) -> httpx.Response:
        status = statuses[str(request.url).split("/health")[0]]
        return refused_connection(request) if status is None else httpx.Response(status)

    return answer


async def test_health_is_200_when_one_server_of_each_leg_answers_200() -> None:
    app = build_app([P1, P2], [D1, D2], client=mock(health({P1: None, P2: 200, D1: 500, D2: 200})))
    async with asgi_client(app) as client:
        answer = await client.get("/health")
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    ("decode", "statuses"),
    [([D1, D2], {P1: 200, D1: None, D2: 500}), ([D1], {P1: 200, D1: 500})],
    ids=["all-decode-servers-fail", "the-only-decode-server-answers-500"],
)
async def test_health_is_503_naming_the_leg_none_of_whose_servers_is_healthy(
    decode: list[str], statuses: dict[str, int | None]
) -> None:
    async with asgi_client(build_app(P1, decode, client=mock(health(statuses)))) as client:
        answer = await client.get("/health")
    assert answer.status_code == 503, answer.text
    error = error_of(answer)
    assert error["leg"] == Leg.DECODE
    assert all(server in error["message"] for server in decode)


# ---- 12. ProxyLimits and main's flags -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_body_bytes", 0), ("max_body_bytes", -1), ("max_body_bytes", 1.5), ("max_body_bytes", True),
        ("max_body_bytes", "4096"), ("max_head_bytes", 0), ("upstream_connections", 0),
        ("max_streams_per_client", -3), ("receive_timeout_s", 0), ("receive_timeout_s", -1.0),
        ("head_timeout_s", math.nan), ("pool_timeout_s", math.inf), ("write_timeout_s", True),
        ("max_stream_s", "60"), ("connect_timeout_s", None), ("trust_forwarded_for", 1),
        ("trust_forwarded_for", "yes"),
    ],
)  # fmt: skip
def test_proxy_limits_refuse_a_bad_value(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        ProxyLimits(**{name: value})


def test_proxy_limits_take_whole_seconds_and_true_or_false() -> None:
    limits = ProxyLimits(receive_timeout_s=2, max_stream_s=0.25, max_body_bytes=1, trust_forwarded_for=True)
    assert (limits.receive_timeout_s, limits.max_stream_s, limits.max_body_bytes) == (2, 0.25, 1)


@pytest.fixture
def servers_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The uvicorn servers `main` runs, kept instead of run."""
    ran: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: ran.append(self))
    return ran


def test_main_takes_each_limit_as_a_flag(servers_run: list[Any]) -> None:
    proxy.main(
        ["--prefill", P1, "--prefill", P2, "--decode", D1, "--host", "0.0.0.0", "--port", "8123",
         "--max-body-bytes", "1234", "--receive-timeout-s", "2.5", "--head-timeout-s", "3",
         "--max-head-bytes", "2048", "--upstream-connections", "7", "--pool-timeout-s", "1",
         "--max-streams-per-client", "4", "--write-timeout-s", "9", "--trust-forwarded-for"]
    )  # fmt: skip
    (server,) = servers_run
    config = server.config
    limits = config.app.state.limits
    assert limits == ProxyLimits(
        max_body_bytes=1234, receive_timeout_s=2.5, head_timeout_s=3.0, max_head_bytes=2048,
        upstream_connections=7, pool_timeout_s=1.0, max_streams_per_client=4, write_timeout_s=9.0,
        trust_forwarded_for=True,
    )  # fmt: skip
    assert config.app.state.servers == {Leg.PREFILL: (P1, P2), Leg.DECODE: (D1,)}
    assert (config.host, config.port, config.h11_max_incomplete_event_size) == ("0.0.0.0", 8123, 2048)


@pytest.mark.parametrize(
    ("flags", "trusted"),
    [
        ([], False),
        (["--trust-forwarded-for"], True),
        (["--trust-forwarded-for", "--no-trust-forwarded-for"], False),
    ],
)
def test_main_trusts_x_forwarded_for_only_when_told(
    servers_run: list[Any], flags: list[str], trusted: bool
) -> None:
    proxy.main(["--prefill", P1, "--decode", D1, *flags])
    assert servers_run[0].config.app.state.limits.trust_forwarded_for is trusted


def test_main_refuses_a_bad_limit(servers_run: list[Any]) -> None:
    with pytest.raises(ConfigError, match="max_body_bytes"):
        proxy.main(["--prefill", P1, "--decode", D1, "--max-body-bytes", "0"])
    with pytest.raises(SystemExit):
        proxy.main(["--prefill", P1, "--decode", D1, "--max-body-bytes", "1.5"])
    assert servers_run == []
