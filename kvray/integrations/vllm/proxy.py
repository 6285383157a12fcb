"""A small P/D proxy in front of `vllm serve` processes that use `KvrayConnector`: each OpenAI
completion or chat request goes first to a prefill server (one token, its KV held there), then
to a decode server with the prefill's `kv_transfer_params`, whose answer (or stream) is the
client's. Run it with

    python -m kvray.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Routes: `POST /v1/completions` and `/v1/chat/completions` (the hand-off), `GET /v1/models` (the
decode server's), `GET /health` (200 when at least one server of each leg answers 200 to its
own `/health`, else 503 naming the leg that does not).

Servers: `--prefill` and `--decode` may each be given several times. A request goes to the
server of its leg with the fewest of the proxy's requests in flight (ties in turn); one that
refuses a connection is passed over for `UNREACHABLE_SKIP_S` and the request tries the leg's
next server. A held request's ticket goes back to the prefill server that issued it. The
`Authorization` and `X-Request-Id` headers go to both legs; a request without an X-Request-Id
gets one, and every answer of the hand-off carries it.

Errors: a failure of either server is answered as that server's status with its body. A server
that cannot be reached, does not answer in time or has no free connection is a 503, one whose
answer breaks off or makes no sense a 502, each with an OpenAI-style JSON error that names the
leg (`prefill` or `decode`) and the cause (`Cause`); a stream that breaks off after its first
chunk ends with such an error as its last event. A decode server that ends the request with
finish_reason "error" before its first token (vLLM's kv_load_failure_policy "fail": the KV did
not load; vLLM answers a 500 "Internal server error", or streams it as an error event) is a 502
with cause `kv_load_failed`, and a stream is held back until its first token so that this is
still a status; a finish_reason "error" later in a stream ends it with an error event. A
prefill server that ends its request so is a 502 for leg `prefill`. The proxy refuses (400)
what the decode server would refuse although the one-token prefill leg passes, before the
prefill runs, and `n` or `best_of` above 1 (one prefill's KV is handed to one decode request).
When the decode leg fails (or the client hangs up first) it hands the prefill server its ticket
back, so the held KV is freed at once rather than at the end of its lease. The proxy adds no
state of its own, so several may run side by side. The servers must be reachable only from the
proxy: their kv_transfer_params are kvray's control plane.

Limits (`ProxyLimits`, each also a flag of `main`):

    max_body_bytes          a larger request body is a 413 (its Content-Length is checked
                            first; a body without one is read no further than past the limit)
    receive_timeout_s       a request body not received within this is a 408
    head_timeout_s          a connection that has not sent a whole request head within this
                            of its opening (or of its next request's first byte) is closed
    max_head_bytes          a larger request head is a 400
    upstream_connections    connections to each leg's servers: prefill and decode have a pool
                            each, so one leg's load does not starve the other
    pool_timeout_s          the longest a request waits for a free connection: then a 503
    connect_timeout_s       the longest a connection to a server may take to open
    upstream_timeout_s      the longest a server may take to send the next byte of its answer
    max_streams_per_client  streams one client may have open at once; more are a 429. A client
                            is its peer address, or with trust_forwarded_for (the proxy sits
                            behind a balancer it trusts) the last address of X-Forwarded-For;
                            behind a balancer without it, every client is the balancer
    write_timeout_s         a client that does not take a chunk of its stream within this is
                            cut off, and its decode stream closed (its connection to the
                            decode server freed); a client that takes nothing of any answer
                            for this long has its connection aborted
    max_stream_s            a stream still running after this ends with an error event
    keep_alive_s            an idle client connection is closed after this: longer than the
                            keep-alive of common clients (httpx's 5 s), so a client's next
                            request never races the proxy's close (uvicorn's own is 5 s)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import enum
import json
import logging
import math
import re
import socket
import struct
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from kvray.errors import ConfigError
from kvray.integrations.vllm.tickets import decode_leg_params, release_params

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("kvray.proxy")

#: How long a server may take to send the next byte of its answer (seconds); vLLM answers a
#: failed KV load itself.
UPSTREAM_TIMEOUT_S = 600.0
#: How long handing a ticket back to the prefill server may take.
RELEASE_TIMEOUT_S = 30.0
#: How long a server that refused a connection is passed over.
UNREACHABLE_SKIP_S = 5.0
#: How long a server may take to answer `/health`.
HEALTH_TIMEOUT_S = 5.0

MIB = 1024 * 1024
#: Fields of a request that the one-token prefill leg does not take (min_tokens above its
#: max_tokens of 1 would be refused there; stream_options needs a stream).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
#: The request headers both legs get.
_FORWARDED_HEADERS = ("authorization", "x-request-id")
#: How vLLM answers a request that ended with finish_reason "error" (`_raise_if_error`'s
#: GenerationError): its error's type and message.
_VLLM_FINISHED_WITH_ERROR = ("InternalServerError", "Internal server error")
#: The most of a decode stream held back while the proxy waits for its first token.
_FIRST_EVENTS_MAX_BYTES = MIB
#: The most of an SSE event the proxy gathers before it passes the bytes on unread.
_EVENT_MAX_BYTES = 16 * MIB


class Leg(enum.StrEnum):
    """Which of the two servers a request was on its way to."""

    PREFILL = "prefill"
    DECODE = "decode"


class Cause(enum.StrEnum):
    """Why a leg failed: the `cause` of the proxy's errors."""

    UNREACHABLE = "unreachable"  # no connection could be made
    TIMEOUT = "timeout"  # no answer in time
    BUSY = "busy"  # no free connection to the leg's servers within pool_timeout_s
    BROKE_OFF = "broke_off"  # the answer broke off
    BAD_ANSWER = "bad_answer"  # the answer makes no sense
    KV_LOAD_FAILED = "kv_load_failed"  # the decode server ended the request with an error first
    REQUEST_FAILED = "request_failed"  # the server ended the request with an error
    STREAM_TOO_LONG = "stream_too_long"  # the stream ran past max_stream_s


_CAUSE_STATUS = {
    Cause.UNREACHABLE: 503,
    Cause.TIMEOUT: 503,
    Cause.BUSY: 503,
    Cause.BROKE_OFF: 502,
    Cause.BAD_ANSWER: 502,
    Cause.KV_LOAD_FAILED: 502,
    Cause.REQUEST_FAILED: 502,
    Cause.STREAM_TOO_LONG: 504,
}
_STATUS_TYPE = {
    400: "BadRequestError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def _limit(help: str) -> dict[str, str]:
    return {"help": help}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProxyLimits:
    """What one client may ask of the proxy, and what the proxy asks of its servers (the module
    docstring says what each does; `main` takes each as a flag)."""

    max_body_bytes: int = dataclasses.field(default=4 * MIB, metadata=_limit("largest request body (413)"))
    receive_timeout_s: float = dataclasses.field(
        default=30.0, metadata=_limit("seconds to receive a request body (408)")
    )
    head_timeout_s: float = dataclasses.field(
        default=10.0, metadata=_limit("seconds to receive a request head, else the connection closes")
    )
    max_head_bytes: int = dataclasses.field(default=16 * 1024, metadata=_limit("largest request head (400)"))
    upstream_connections: int = dataclasses.field(
        default=100, metadata=_limit("connections to each leg's servers")
    )
    pool_timeout_s: float = dataclasses.field(
        default=5.0, metadata=_limit("seconds to wait for a free connection to a leg (503)")
    )
    connect_timeout_s: float = dataclasses.field(
        default=5.0, metadata=_limit("seconds to open a connection to a server")
    )
    upstream_timeout_s: float = dataclasses.field(
        default=UPSTREAM_TIMEOUT_S, metadata=_limit("seconds a server may take to send the next byte")
    )
    max_streams_per_client: int = dataclasses.field(
        default=32, metadata=_limit("streams one client may have open at once (429)")
    )
    trust_forwarded_for: bool = dataclasses.field(
        default=False,
        metadata=_limit("a client is the last address of X-Forwarded-For (behind a trusted balancer)"),
    )
    write_timeout_s: float = dataclasses.field(
        default=30.0, metadata=_limit("seconds a client may take to accept a chunk of its stream")
    )
    max_stream_s: float = dataclasses.field(default=3600.0, metadata=_limit("seconds a stream may run"))
    keep_alive_s: float = dataclasses.field(
        default=30.0, metadata=_limit("seconds an idle client connection stays open between requests")
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool":
                if not isinstance(value, bool):
                    raise ConfigError(
                        f"{field.name} must be true or false, got {value!r}", setting=field.name
                    )
            elif field.type == "int":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ConfigError(
                        f"{field.name} must be a positive integer, got {value!r}",
                        setting=field.name,
                        value=value,
                    )
            elif (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(
                    f"{field.name} must be a finite number of seconds above zero, got {value!r}",
                    setting=field.name,
                    value=value,
                )


def _error(status: int, message: str, **facts: str) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {
        "error": {"message": message, "type": _STATUS_TYPE.get(status, "APIError"), "code": status, **facts}
    }


def _refused(status: int, message: str) -> JSONResponse:
    """The client's request refused: a 4xx. A request the proxy stopped reading ends its
    connection (the rest of its body would be read as the next request)."""
    headers = {"connection": "close"} if status in (408, 413) else None
    return JSONResponse(_error(status, f"kvray proxy: {message}"), status_code=status, headers=headers)


def _upstream_error(
    leg: Leg, url: str, failure: httpx.HTTPError | Cause, why: str = ""
) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-style error body for the `leg` server at `url` failing: an httpx
    error, or a `Cause` with `why` (what was wrong with its answer). 503 where it could not be
    reached, had no free connection or did not answer in time, 502 where its answer broke off,
    makes no sense or failed the request."""
    if isinstance(failure, httpx.PoolTimeout):
        cause = Cause.BUSY
        why = (
            f"had no free connection ({type(failure).__name__}: every one of the proxy's connections "
            f"to the {leg} servers is in use); retry later, or raise upstream_connections"
        )
    elif isinstance(failure, httpx.ConnectError | httpx.ConnectTimeout):
        cause = Cause.UNREACHABLE
        why = (
            f"could not be reached ({type(failure).__name__}: {failure}); check that it runs at that address"
        )
    elif isinstance(failure, httpx.TimeoutException):
        cause = Cause.TIMEOUT
        why = f"did not answer in time ({type(failure).__name__}: {failure}); retry once it is less busy"
    elif isinstance(failure, httpx.HTTPError):
        cause = Cause.BROKE_OFF
        why = f"broke off its answer ({type(failure).__name__}: {failure}); check its log"
    else:
        cause = failure
    status = _CAUSE_STATUS[cause]
    message = f"kvray proxy: the {leg} server at {url} {why}"
    log.warning("%s", message)
    return status, _error(status, message, leg=str(leg), cause=str(cause))


def _upstream_failed(leg: Leg, url: str, failure: httpx.HTTPError | Cause, why: str = "") -> JSONResponse:
    status, body = _upstream_error(leg, url, failure, why)
    return JSONResponse(body, status_code=status)


def _error_event(body: dict[str, Any]) -> bytes:
    """The last events of a stream that failed."""
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


def _finished_with_error(error: object) -> bool:
    """Whether a vLLM error object is its answer to a request that ended with finish_reason
    "error"."""
    return isinstance(error, dict) and (error.get("type"), error.get("message")) == _VLLM_FINISHED_WITH_ERROR


def _has_error_finish(answer: object) -> bool:
    """Whether a completion answer (or stream event) has a choice ended by finish_reason "error"."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return isinstance(choices, list) and any(
        isinstance(choice, dict) and choice.get("finish_reason") == "error" for choice in choices
    )


class _EventKind(enum.Enum):
    """What an SSE event of the decode stream tells the proxy."""

    NOTHING_YET = enum.auto()  # a role, an empty delta, a comment: no token yet
    TOKEN = enum.auto()  # content, or a finish other than "error"
    FAILED = enum.auto()  # a choice ended by finish_reason "error"
    ERROR = enum.auto()  # an error event
    DONE = enum.auto()  # data: [DONE]


def _event_data(event: bytes) -> object:
    """The JSON of an SSE event's data lines ("[DONE]" as that string; None where it has none
    or it is not JSON)."""
    lines = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    data = b"\n".join(lines)
    if data == b"[DONE]":
        return "[DONE]"
    try:
        return json.loads(data)
    except ValueError:
        return None


def _event_kind(data: object) -> _EventKind:
    if data == "[DONE]":
        return _EventKind.DONE
    if not isinstance(data, dict):
        return _EventKind.NOTHING_YET
    if "error" in data:
        return _EventKind.ERROR
    if _has_error_finish(data):
        return _EventKind.FAILED
    choices = data.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if (
            choice.get("finish_reason") is not None
            or choice.get("text")
            or (isinstance(delta, dict) and any(value for name, value in delta.items() if name != "role"))
        ):
            return _EventKind.TOKEN
    return _EventKind.NOTHING_YET


def _event_end(pending: bytearray) -> int:
    """Where the first whole SSE event of `pending` ends (-1: none is whole yet)."""
    ends = [at + len(blank) for blank in (b"\n\n", b"\r\n\r\n") if (at := pending.find(blank)) >= 0]
    return min(ends, default=-1)


async def _sse_events(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """A byte stream as its SSE events, each with the blank line that ends it (what follows the
    last whole event, as it came)."""
    pending = bytearray()
    async for chunk in chunks:
        pending += chunk
        while (end := _event_end(pending)) >= 0:
            yield bytes(pending[:end])
            del pending[:end]
        if len(pending) > _EVENT_MAX_BYTES:
            yield bytes(pending)
            pending.clear()
    if pending:
        yield bytes(pending)


class _SlowReader(Exception):
    """The client did not take a chunk of its stream within write_timeout_s."""


class _Relay(StreamingResponse):
    """The decode server's open stream relayed to the client. Each of `settles` runs however
    the response ends: a client that leaves before the first chunk means the relay's generator
    never starts, so its own `finally` would never run. A send the client does not take within
    `write_timeout_s` ends the relay (the server closes the connection of a response left
    unfinished)."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        settle: Callable[[], None],
        write_timeout_s: float,
    ) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self.settles = [settle]
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for settle in self.settles:
                settle()

    async def stream_response(self, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            # An ASGI server's send waits while the connection's buffer is full.
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _SlowReader from None

        try:
            await super().stream_response(send_in_time)
        except _SlowReader:
            log.warning(
                "kvray proxy: a client took no chunk of its stream within %s s; its stream is cut off",
                self._write_timeout_s,
            )
        finally:
            await self._events.aclose()


def check_request(body: object, max_model_len: int | None) -> str | None:
    """Why the decode server would refuse `body` although its one-token prefill leg passes, or
    why P/D cannot serve it (None: neither, as far as the proxy can tell). Both legs are then
    refused alike."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    if body.get("stream_options") is not None and not body.get("stream"):
        return "stream_options can only be given with stream: true"
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or value != 1):
            return (
                f"{field}={value!r}: through the P/D proxy {field} must be 1 (one prefill's KV is handed "
                "to one decode request, once); send separate requests for more completions"
            )
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{field} must be a positive integer"
        if max_model_len is not None and value > max_model_len:
            return f"{field}={value} is more than the model's context of {max_model_len} tokens"
    return None


class _LegError(Exception):
    """A leg's request failed in httpx (`error`) at the server `url`."""

    def __init__(self, url: str, error: httpx.HTTPError) -> None:
        super().__init__(url, error)
        self.url = url
        self.error = error


class _Servers:
    """The servers of one leg, the client (and its pool) that reaches them, and the proxy's
    requests in flight to each: `pick` takes the server with the fewest (ties in turn), passing
    over one that refused a connection within the last `UNREACHABLE_SKIP_S`."""

    def __init__(self, leg: Leg, urls: str | Sequence[str], client: httpx.AsyncClient) -> None:
        given = (urls,) if isinstance(urls, str) else tuple(urls)
        self.urls = tuple(dict.fromkeys(url.rstrip("/") for url in given))
        if not self.urls:
            raise ConfigError(f"the proxy needs at least one {leg} server")
        self.leg = leg
        self.client = client
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._passed_over_until = dict.fromkeys(self.urls, 0.0)
        self._turn = 0

    def pick(self, tried: Collection[str] = ()) -> str:
        """The server for the next request, among those not in `tried` (some are not)."""
        untried = [url for url in self.urls if url not in tried]
        now = time.monotonic()
        candidates = [url for url in untried if self._passed_over_until[url] <= now] or untried
        fewest = min(self._in_flight[url] for url in candidates)
        for step in range(len(self.urls)):
            index = (self._turn + step) % len(self.urls)
            url = self.urls[index]
            if url in candidates and self._in_flight[url] == fewest:
                self._turn = index + 1
                return url
        raise AssertionError("a candidate has the fewest requests in flight")

    def started(self, url: str) -> None:
        self._in_flight[url] += 1

    def ended(self, url: str) -> None:
        self._in_flight[url] -= 1

    async def send(
        self, method: str, path: str, headers: dict[str, str], body: object = None, *, stream: bool = False
    ) -> tuple[str, httpx.Response]:
        """The answer of one of the leg's servers (the next one where a connection is refused),
        and its URL; `_LegError` where none answers. A streamed answer counts as in flight
        until the caller calls `ended` with that URL."""
        tried: list[str] = []
        while True:
            url = self.pick(tried)
            self.started(url)
            try:
                request = self.client.build_request(method, f"{url}{path}", json=body, headers=headers)
                answer = await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                # The request never reached that server: another of the leg's may take it.
                self.ended(url)
                self._passed_over_until[url] = time.monotonic() + UNREACHABLE_SKIP_S
                tried.append(url)
                if len(tried) == len(self.urls):
                    raise _LegError(url, error) from error
                continue
            except httpx.HTTPError as error:
                self.ended(url)
                raise _LegError(url, error) from error
            except BaseException:
                self.ended(url)
                raise
            if not stream:
                self.ended(url)
            return url, answer


def _leg_client(limits: ProxyLimits) -> httpx.AsyncClient:
    """One leg's HTTP client: its own pool of `upstream_connections`."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            limits.upstream_timeout_s, connect=limits.connect_timeout_s, pool=limits.pool_timeout_s
        ),
        limits=httpx.Limits(
            max_connections=limits.upstream_connections,
            max_keepalive_connections=limits.upstream_connections,
        ),
    )


class _Proxy:
    """The proxy's work over its two legs' servers; `build_app` routes requests to it."""

    def __init__(self, prefill: _Servers, decode: _Servers, limits: ProxyLimits) -> None:
        self.prefill = prefill
        self.decode = decode
        self.limits = limits
        self._context: dict[str, int] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._streams: collections.Counter[str] = collections.Counter()

    async def close(self) -> None:
        if self._background:  # tickets on their way back to the prefill server, streams closing
            await asyncio.wait(self._background, timeout=RELEASE_TIMEOUT_S)
        await self.prefill.client.aclose()
        if self.decode.client is not self.prefill.client:
            await self.decode.client.aclose()

    # ---- the client's side ---------------------------------------------------------------

    def _client_of(self, request: Request) -> str:
        if self.limits.trust_forwarded_for:
            forwarded = ",".join(request.headers.getlist("x-forwarded-for")).split(",")[-1].strip()
            if forwarded:
                return forwarded
        return request.client.host if request.client is not None else ""

    async def _read_body(self, request: Request) -> bytes | Response:
        """The request's body, or the answer refusing it (too large, too slow)."""
        most = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > most):
            return _refused(
                413, f"the request body may have at most {most} bytes (Content-Length: {declared})"
            )
        body = bytearray()
        try:
            async with asyncio.timeout(self.limits.receive_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > most:
                        return _refused(413, f"the request body may have at most {most} bytes")
        except TimeoutError:
            return _refused(408, f"the request body did not arrive within {self.limits.receive_timeout_s} s")
        except ClientDisconnect:
            # Nothing ran for it; the answer goes nowhere (a client that hung up mid-body).
            return Response(status_code=400)
        return bytes(body)

    async def handoff(self, path: str, request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
        headers["x-request-id"] = request_id
        answer = await self._handoff(path, request, headers)
        answer.headers["x-request-id"] = request_id
        return answer

    async def _handoff(self, path: str, request: Request, headers: dict[str, str]) -> Response:
        content = await self._read_body(request)
        if isinstance(content, Response):
            return content
        try:
            body = json.loads(content)
        except ValueError:
            return _refused(400, "the request body is not JSON")
        why = check_request(body, None)
        if why is None:
            why = check_request(body, await self._max_model_len(body.get("model"), headers))
        if why is not None:
            return _refused(400, why)
        if not body.get("stream"):
            return await self._exchange(path, body, headers)
        client = self._client_of(request)
        if self._streams[client] >= self.limits.max_streams_per_client:
            return _refused(
                429, f"a client may have {self.limits.max_streams_per_client} streams open at once"
            )
        self._streams[client] += 1
        try:
            answer = await self._exchange(path, body, headers)
        except BaseException:
            self._stream_ended(client)
            raise
        if isinstance(answer, _Relay):
            answer.settles.append(lambda: self._stream_ended(client))
        else:
            self._stream_ended(client)
        return answer

    def _stream_ended(self, client: str) -> None:
        self._streams[client] -= 1
        if self._streams[client] <= 0:
            del self._streams[client]

    # ---- the two legs ---------------------------------------------------------------------

    async def _max_model_len(self, model: object, headers: dict[str, str]) -> int | None:
        """The decode server's context length for `model` (asked until it answers)."""
        name = str(model)
        if name not in self._context:
            with contextlib.suppress(_LegError, ValueError, KeyError, TypeError, AttributeError):
                _, answer = await self.decode.send("GET", "/v1/models", headers)
                for card in answer.json()["data"]:
                    if isinstance(card.get("max_model_len"), int):
                        self._context[str(card["id"])] = card["max_model_len"]
        return self._context.get(name)

    async def _release(
        self, url: str, body: dict[str, Any], params: dict[str, Any], headers: dict[str, str]
    ) -> None:
        """Hand the prefill server at `url` its ticket back: the decode leg will not take the KV."""
        message = {"model": body.get("model"), "prompt": ".", "max_tokens": 1}
        message["kv_transfer_params"] = release_params(params)
        try:
            answer = await self.prefill.client.post(
                f"{url}/v1/completions", json=message, headers=headers, timeout=RELEASE_TIMEOUT_S
            )
            if answer.status_code != 200:
                log.warning("kvray proxy: the prefill server refused a release: %s", answer.text[:200])
        except httpx.HTTPError as error:
            log.warning("kvray proxy: could not release a held request: %s", error)

    def _soon(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _exchange(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """The prefill leg, then the decode leg, whose answer is the client's."""
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        for field in _PREFILL_DROPPED:
            first.pop(field, None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        try:
            prefill_url, prefilled = await self.prefill.send("POST", path, headers, first)
        except _LegError as failed:
            return _upstream_failed(Leg.PREFILL, failed.url, failed.error)
        try:
            answer = prefilled.json()
        except ValueError:
            answer = None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None

        def release_soon() -> None:
            if isinstance(params, dict) and params:
                self._soon(self._release(prefill_url, body, params, headers))

        if prefilled.status_code != 200:
            if isinstance(answer, dict) and _finished_with_error(answer.get("error")):
                return _upstream_failed(Leg.PREFILL, prefill_url, Cause.REQUEST_FAILED, _PREFILL_FAILED)
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        if not isinstance(answer, dict):
            return _upstream_failed(
                Leg.PREFILL,
                prefill_url,
                Cause.BAD_ANSWER,
                "answered 200 with a body that is not a JSON object",
            )
        if _has_error_finish(answer):
            release_soon()
            return _upstream_failed(Leg.PREFILL, prefill_url, Cause.REQUEST_FAILED, _PREFILL_FAILED)
        if not isinstance(params, dict) or not params:
            return _upstream_failed(
                Leg.PREFILL,
                prefill_url,
                Cause.BAD_ANSWER,
                "returned no kv_transfer_params: start it with --kv-transfer-config naming KvrayConnector",
            )
        # The decode leg's copy of the ticket cannot release it; the full one stays for a release.
        second = {**body, "kv_transfer_params": decode_leg_params(params)}
        streamed = bool(body.get("stream"))
        # Until the decode server answers 200 (and, streamed, sends its first token, which it
        # computes from the pushed KV) it may never ask for the KV: the ticket goes back then.
        try:
            decode_url, decoded = await self.decode.send("POST", path, headers, second, stream=streamed)
        except _LegError as failed:
            release_soon()
            return _upstream_failed(Leg.DECODE, failed.url, failed.error)
        except BaseException:
            release_soon()
            raise
        if streamed and decoded.status_code != 200:
            try:
                await decoded.aread()
            except httpx.HTTPError as error:
                release_soon()
                return _upstream_failed(Leg.DECODE, decode_url, error)
            finally:
                await decoded.aclose()
                self.decode.ended(decode_url)
        if not streamed or decoded.status_code != 200:
            return self._decoded(decode_url, decoded, release_soon)
        try:
            return await self._relay(decode_url, decoded, release_soon)
        except BaseException:
            release_soon()
            self.decode.ended(decode_url)
            self._soon(decoded.aclose())
            raise

    def _decoded(self, url: str, decoded: httpx.Response, release_soon: Callable[[], None]) -> Response:
        """The client's answer from the decode server's whole one."""
        try:
            answer = decoded.json()
        except ValueError:
            answer = None
        if decoded.status_code == 200:
            failed = _has_error_finish(answer)
        else:
            failed = isinstance(answer, dict) and _finished_with_error(answer.get("error"))
        if decoded.status_code != 200 or failed:
            release_soon()
        if failed:
            return _upstream_failed(Leg.DECODE, url, Cause.KV_LOAD_FAILED, _LOAD_FAILED)
        return Response(decoded.content, decoded.status_code, media_type="application/json")

    async def _relay(self, url: str, decoded: httpx.Response, release_soon: Callable[[], None]) -> Response:
        """The client's answer from the decode server's stream: its failure as a status while
        no token has come, else the stream, held back until its first token."""
        deadline = asyncio.get_running_loop().time() + self.limits.max_stream_s
        events = _sse_events(decoded.aiter_raw())
        first: list[bytes] = []
        failure: Response | None = None
        while sum(map(len, first)) <= _FIRST_EVENTS_MAX_BYTES:
            try:
                event = await anext(events, None)
            except httpx.HTTPError as error:
                failure = _upstream_failed(Leg.DECODE, url, error)
                break
            if event is None:
                break
            data = _event_data(event)
            kind = _event_kind(data)
            if kind is _EventKind.FAILED:
                failure = _upstream_failed(Leg.DECODE, url, Cause.KV_LOAD_FAILED, _LOAD_FAILED)
                break
            if kind is _EventKind.ERROR and isinstance(data, dict):
                stated = data["error"]
                if _finished_with_error(stated):
                    failure = _upstream_failed(Leg.DECODE, url, Cause.KV_LOAD_FAILED, _LOAD_FAILED)
                else:  # the decode server's own error, before any token: its status and body
                    code = stated.get("code") if isinstance(stated, dict) else None
                    status = code if isinstance(code, int) and 400 <= code < 600 else 502
                    failure = JSONResponse(data, status_code=status)
                break
            first.append(event)
            if kind in (_EventKind.TOKEN, _EventKind.DONE):
                break
        if failure is not None:
            release_soon()
            self.decode.ended(url)
            await events.aclose()
            await decoded.aclose()
            return failure
        relayed = False

        async def relay() -> AsyncGenerator[bytes, None]:
            nonlocal relayed
            relayed = True  # the response's head went out: the client is there
            for held in first:
                yield held
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        event = await anext(events, None)
                except TimeoutError:
                    _, error_body = _upstream_error(
                        Leg.DECODE, url, Cause.STREAM_TOO_LONG,
                        f"was still streaming after the proxy's max_stream_s of {self.limits.max_stream_s} s",
                    )  # fmt: skip
                    yield _error_event(error_body)
                    return
                except httpx.HTTPError as error:
                    _, error_body = _upstream_error(Leg.DECODE, url, error)
                    yield _error_event(error_body)
                    return
                if event is None:
                    return
                # Only an event that names "error" may end the request so: the rest pass unread.
                if b'"error"' in event and _event_kind(_event_data(event)) is _EventKind.FAILED:
                    _, error_body = _upstream_error(
                        Leg.DECODE, url, Cause.REQUEST_FAILED, 'ended the request with finish_reason "error"'
                    )
                    yield _error_event(error_body)
                    return
                yield event

        def settle() -> None:
            self.decode.ended(url)
            self._soon(decoded.aclose())
            if not relayed:
                release_soon()

        return _Relay(relay(), settle, self.limits.write_timeout_s)

    # ---- the other routes -------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
        try:
            _, answer = await self.decode.send("GET", "/v1/models", headers)
        except _LegError as failed:
            return _upstream_failed(Leg.DECODE, failed.url, failed.error)
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def health(self) -> Response:
        for servers in (self.prefill, self.decode):
            failed = [
                failure
                for failure in await asyncio.gather(*(self._probe(servers, url) for url in servers.urls))
                if failure is not None
            ]
            if len(failed) == len(servers.urls):
                _, body = failed[0]
                body["error"].update(
                    message=f"kvray proxy: no {servers.leg} server is healthy: "
                    + "; ".join(str(failure["error"]["message"]) for _, failure in failed),
                    type=_STATUS_TYPE[503],
                    code=503,
                )
                return JSONResponse(body, status_code=503)
        return Response(status_code=200)

    async def _probe(self, servers: _Servers, url: str) -> tuple[int, dict[str, Any]] | None:
        """None where the server at `url` answers 200 to /health, else its error."""
        try:
            answer = await servers.client.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as error:
            return _upstream_error(servers.leg, url, error)
        if answer.status_code != 200:
            return _upstream_error(
                servers.leg, url, Cause.BAD_ANSWER, f"answered {answer.status_code} to /health"
            )
        return None


_LOAD_FAILED = (
    'ended the request with finish_reason "error" before its first token: the KV did not load '
    "(kv_load_failure_policy fail); check both servers' logs"
)
_PREFILL_FAILED = 'ended the prefill with finish_reason "error"; check its log'


def build_app(
    prefill: str | Sequence[str],
    decode: str | Sequence[str],
    client: httpx.AsyncClient | None = None,
    *,
    limits: ProxyLimits | None = None,
) -> FastAPI:
    """The proxy as an ASGI app over the base URLs of its prefill and decode servers (one each,
    or several). `client`: one HTTP client for both legs instead of the proxy's own pool per
    leg (e.g. one over `httpx.MockTransport` in tests); `limits`: `ProxyLimits()` if None."""
    limits = limits or ProxyLimits()
    prefill_client = client or _leg_client(limits)
    decode_client = client or _leg_client(limits)
    proxy = _Proxy(
        _Servers(Leg.PREFILL, prefill, prefill_client), _Servers(Leg.DECODE, decode, decode_client), limits
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = FastAPI(title="kvray P/D proxy", lifespan=lifespan)
    app.state.limits = limits
    app.state.servers = {Leg.PREFILL: proxy.prefill.urls, Leg.DECODE: proxy.decode.urls}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handoff("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handoff("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    return app


#: Where a request head ends (h11's own blank line).
_HEAD_END = re.compile(b"\n\r?\n")


def _guarded_protocol(limits: ProxyLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within `head_timeout_s` of its opening or of its next request's first byte (uvicorn's own
    keep-alive timeout stops at a request's first byte and is not armed on a new connection),
    answering a head of more than `max_head_bytes` with a 400 (h11's own limit is only on a
    head still incomplete: one that arrives whole in one read passes it), and aborting a
    connection whose client has taken none of what it was sent for `write_timeout_s` (its write
    buffer stayed full: uvicorn would keep it, and what it holds, open until the client reads)."""
    head_timeout_s, max_head_bytes = limits.head_timeout_s, limits.max_head_bytes
    write_timeout_s = limits.write_timeout_s
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        #: What has come of the request head being received (and what followed it in its read).
        _head: bytearray

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head = bytearray()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_late)

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self._head_too_large(data):
                return
            super().data_received(data)
            # The client's side is IDLE until a whole head has arrived.
            if self.conn.their_state is not h11.IDLE:
                self._head.clear()
                self._stop_head_timer()
            elif self._head_timer is None:
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_late)

        def _head_too_large(self, data: bytes) -> bool:
            """Whether the head that `data` continues has more than max_head_bytes (it is then
            answered with a 400 and the connection closed)."""
            searched = max(len(self._head) - 2, 0)  # a blank line may begin in the last read
            self._head += data
            end = _HEAD_END.search(self._head, searched)
            if (len(self._head) if end is None else end.end()) <= max_head_bytes:
                return False
            self._head.clear()
            log.info(
                "kvray proxy: a client sent a request head of more than %s bytes; refused", max_head_bytes
            )
            body = json.dumps(
                _error(400, f"kvray proxy: a request head may have at most {max_head_bytes} bytes")
            ).encode()
            self.transport.write(
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            self.transport.close()
            return True

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            self._stop_write_timer()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout_s, self._write_stalled)

        def resume_writing(self) -> None:
            self._stop_write_timer()
            super().resume_writing()

        def _stop_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_stalled(self) -> None:
            self._write_timer = None
            log.warning(
                "kvray proxy: a client took nothing of its answer for %s s; its connection is aborted",
                write_timeout_s,
            )
            # Reset, not closed: a close would leave the kernel sending the client what it holds.
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info(
                    "kvray proxy: a client sent no whole request head within %s s; closed", head_timeout_s
                )
                self.transport.close()

    return HeadDeadline


def uvicorn_config(
    app: FastAPI, limits: ProxyLimits, host: str = "127.0.0.1", port: int = 8000
) -> uvicorn.Config:
    """The uvicorn configuration that serves `app` under `limits`' bounds on request heads."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=_guarded_protocol(limits),
        h11_max_incomplete_event_size=limits.max_head_bytes,
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # used as seconds
        # Who the client is (max_streams_per_client) is the proxy's to say, from trust_forwarded_for:
        # uvicorn's own default takes it from X-Forwarded-For of any peer on 127.0.0.1.
        proxy_headers=False,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--prefill", action="append", required=True, help="base URL of a prefill vllm serve (repeat for more)"
    )
    parser.add_argument(
        "--decode", action="append", required=True, help="base URL of a decode vllm serve (repeat for more)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    for field in dataclasses.fields(ProxyLimits):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=field.metadata["help"],
            )
        else:
            kind = int if field.type == "int" else float
            parser.add_argument(
                flag, type=kind, default=field.default, help=f"{field.metadata['help']} (default %(default)s)"
            )
    args = parser.parse_args(argv)
    limits = ProxyLimits(
        **{field.name: getattr(args, field.name) for field in dataclasses.fields(ProxyLimits)}
    )
    import uvicorn

    app = build_app(args.prefill, args.decode, limits=limits)
    uvicorn.Server(uvicorn_config(app, limits, args.host, args.port)).run()


if __name__ == "__main__":
    main()
