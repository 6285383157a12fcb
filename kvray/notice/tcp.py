"""`tcp` notice channel (completion across nodes): a writer on another node sends its notices to
the decode engine over one authenticated TCP connection, instead of a Ray actor call per notice.

The decode agent listens on its node's address and publishes `host:port` and a fresh 32-byte
key (one per incarnation) in its `EngineInfo.endpoints`. Those reach the cluster's members
through the coordinator: the same members that may call the engine's actor, the path notices
take otherwise. Nothing a connection sends reaches the engine before it proves it holds the
key, and the listener proves it too:

    listener -> writer   MAGIC | listener nonce (16 bytes)
    writer -> listener   MAGIC | writer nonce (16) | MAC(key, "writer" | both nonces)
    listener -> writer   MAC(key, "listener" | both nonces)

MAC is keyed BLAKE2b-256 (RFC 7693). Both ends then derive the connection's own key from the
two nonces. Each notice is
`length (4 bytes, big-endian) | tag (16) | body`: the body one msgspec notice (`kvray.wire`),
the tag MAC(connection key, sequence number | body) cut to 16 bytes, so a notice cannot
be forged, replayed or reordered without the key. The listener answers every notice with its
verdict (taken, or why the engine refused it), tagged the same way, so the writer learns what a
Ray call would have told it. A connection that breaks the protocol in any way is closed before
its notice reaches the engine.

What a connection may hold at the listener is bounded: it has `HANDSHAKE_S` to prove the key,
in one of `MAX_UNPROVEN` places of which a newcomer takes the oldest (so idle connections
cannot keep writers out), and once proven, it is not read while `MAX_QUEUED_VERDICTS` of its
verdicts wait (so a writer that does not read them stalls itself, not the listener).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import hashlib
import hmac
import ipaddress
import logging
import secrets
import socket
import struct
import time
from collections import OrderedDict
from typing import cast

from kvray.config import Settings
from kvray.errors import (
    MetadataError,
    TransportError,
    TransportUnavailableError,
)
from kvray.metrics import ConnectionEvent, DropReason, EngineMetrics, ListenerRefusal, NoticeSend
from kvray.notice.base import (
    Mail,
    Mailbox,
    NoticeChannel,
    NoticeHandler,
    NoticeKind,
    NoticeReceiver,
    Receipt,
    refusal,
)
from kvray.transport.base import PeerCache, Reachable
from kvray.wire import MAX_NOTICE_BYTES

log = logging.getLogger("kvray.notice")

#: Keys of the listener's address and key in `EngineInfo.endpoints`.
ADDRESS_ENDPOINT = "completion_tcp"
KEY_ENDPOINT = "completion_tcp_key"
#: Those of a prefill engine's push-request listener.
PUSH_ADDRESS_ENDPOINT = "push_tcp"
PUSH_KEY_ENDPOINT = "push_tcp_key"
#: The keys (address, key) each mailbox's listener is published under.
ENDPOINTS = {
    Mailbox.COMPLETIONS: (ADDRESS_ENDPOINT, KEY_ENDPOINT),
    Mailbox.PUSH_REQUESTS: (PUSH_ADDRESS_ENDPOINT, PUSH_KEY_ENDPOINT),
}

MAGIC = b"kvrayN1\n"
KEY_NBYTES = 32
NONCE_NBYTES = 16
MAC_NBYTES = 32
TAG_NBYTES = 16
#: Bytes of a full MAC (a session key, a handshake proof); tags keep the first `TAG_NBYTES`.
MAC_NBYTES = 32
#: The largest notice body a listener reads (the largest notice the wire decodes); a longer
#: one closes the connection.
MAX_NOTICE_NBYTES = MAX_NOTICE_BYTES
#: Seconds a connection has to prove the key, whatever the notices' own deadline: a writer
#: answers the greeting at once, and until it does its connection holds an unproven place.
HANDSHAKE_S = 3.0
#: Connections a listener keeps that have not proved the key yet; a new one past these takes
#: the place of the oldest.
MAX_UNPROVEN = 64
#: Connections a listener keeps that have proved the key (one per writer engine that notified
#: it recently); one more that proves it is closed, and its writer takes the Ray path.
MAX_PROVEN = 1024
#: Verdicts one connection may have queued at the listener (not yet written, or written but not
#: yet taken by the writer's end) before the listener stops reading its notices, until they go.
MAX_QUEUED_VERDICTS = 1024
#: Bytes a writer lets queue unsent on one connection before it calls the listener stalled.
MAX_UNSENT_NBYTES = 1024 * 1024

_GREETING_NBYTES = len(MAGIC) + NONCE_NBYTES
_HELLO_NBYTES = len(MAGIC) + NONCE_NBYTES + MAC_NBYTES
_FRAME = struct.Struct(f">I{TAG_NBYTES}s")
_VERDICT = struct.Struct(f">QB{TAG_NBYTES}s")
_SEQUENCE = struct.Struct(">Q")


class Verdict(enum.IntEnum):
    """What the decode engine did with a notice."""

    TAKEN = 0
    MALFORMED = 1
    STALE = 2
    UNKNOWN = 3
    FORGED = 4


_VERDICT_OF: dict[DropReason | None, Verdict] = {
    None: Verdict.TAKEN,
    DropReason.MALFORMED: Verdict.MALFORMED,
    DropReason.STALE: Verdict.STALE,
    DropReason.UNKNOWN: Verdict.UNKNOWN,
    DropReason.FORGED: Verdict.FORGED,
}
_REASON_OF = {verdict: reason for reason, verdict in _VERDICT_OF.items()}


def _mac(key: bytes, *parts: bytes) -> bytes:
    # Keyed BLAKE2b (RFC 7693) is a MAC of its own, computed by CPython's code: a notice pays
    # about a microsecond for each of its tags, where OpenSSL's HMAC-SHA256 costs several
    # times that, and tens of microseconds on a cold cache.
    return hashlib.blake2b(b"".join(parts), key=key, digest_size=MAC_NBYTES).digest()


def _session_key(key: bytes, listener_nonce: bytes, writer_nonce: bytes) -> bytes:
    return _mac(key, b"session", listener_nonce, writer_nonce)


def _notice_tag(session: bytes, sequence: int, body: bytes) -> bytes:
    return _mac(session, b"notice", _SEQUENCE.pack(sequence), body)[:TAG_NBYTES]


def _verdict_tag(session: bytes, sequence: int, verdict: int) -> bytes:
    return _mac(session, b"verdict", _SEQUENCE.pack(sequence), bytes((verdict,)))[:TAG_NBYTES]


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of a published `host:port` (`[v6 address]:port`): the host must be an IP
    address and the port in 1..65535, else `MetadataError`."""
    host, separator, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
        port = int(port_text) if port_text.isdigit() and len(port_text) <= 5 else 0
    except ValueError:
        port = 0
    if not separator or not 0 < port < 65536:
        raise MetadataError(
            f"{address!r} is not an IP address and port; kvray publishes its notice listener as host:port",
            address=address,
        )
    return host, port


def parse_key(text: str) -> bytes:
    """A published listener key (hex of `KEY_NBYTES` bytes), else `MetadataError`."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_NBYTES:
        raise MetadataError(
            f"a notice listener key must be {KEY_NBYTES} bytes in hex; got {len(text)} characters",
        )
    return key


# ---- the decode engine's end -----------------------------------------------------------


class NoticeListener:
    """A decode engine's TCP listener for notices from writers on other nodes.

    `handler` takes each authenticated notice on the event loop; `handshake_s` bounds how long
    a connection may take to prove the key (never more than `HANDSHAKE_S`); `metrics` counts
    connections refused and notices read.
    """

    def __init__(
        self, key: bytes, handler: NoticeHandler, handshake_s: float, metrics: EngineMetrics
    ) -> None:
        self.key = key
        self.handler = handler
        self.handshake_s = min(handshake_s, HANDSHAKE_S)
        self.metrics = metrics
        self.address = ""
        self._server: asyncio.AbstractServer | None = None
        # Oldest first: a newcomer past MAX_UNPROVEN takes the first one's place.
        self._unproven: dict[_ListenerConnection, None] = {}
        self._proven: set[_ListenerConnection] = set()

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        handler: NoticeHandler,
        *,
        handshake_s: float = HANDSHAKE_S,
        metrics: EngineMetrics,
        ports: int = 1,
    ) -> NoticeListener:
        """Listen on `host` at the first free port of `port` .. `port + ports - 1` (port 0: any
        free port), with a fresh key."""
        listener = cls(secrets.token_bytes(KEY_NBYTES), handler, handshake_s, metrics)
        loop = asyncio.get_running_loop()
        candidates = [0] if port == 0 else list(range(port, port + ports))
        for candidate in candidates:
            try:
                server = await loop.create_server(lambda: _ListenerConnection(listener), host, candidate)
                break
            except OSError as error:
                if error.errno == errno.EADDRINUSE and candidate != candidates[-1]:
                    continue
                where = format_address(host, port) if ports == 1 else f"{host} ports {port}-{candidate}"
                raise TransportUnavailableError(
                    f"cannot listen for completion notices on {where}: {error}; set KVRAY_NOTICE_PORT=0 "
                    "for any free port (or KVRAY_NOTICE_PORTS for a wider range), KVRAY_NOTICE_HOST for "
                    "another address, or KVRAY_NOTICE_TCP=0 to take notices from other nodes through "
                    "Ray calls only",
                    host=host,
                    port=port,
                ) from error
        listener._server = server
        bound_host, bound_port = server.sockets[0].getsockname()[:2]
        listener.address = format_address(str(bound_host), int(bound_port))
        return listener

    def endpoints(self, mailbox: Mailbox = Mailbox.COMPLETIONS) -> dict[str, str]:
        """What the engine publishes for writers to reach this listener (of `mailbox`)."""
        address_key, key_key = ENDPOINTS[mailbox]
        return {address_key: self.address, key_key: self.key.hex()}

    @property
    def connections(self) -> int:
        return len(self._unproven) + len(self._proven)

    def _admit(self, connection: _ListenerConnection) -> None:
        # The oldest has had the longest to prove the key: it makes room, not the newcomer, so
        # that connections holding their places without proving it cannot keep writers out.
        if len(self._unproven) >= MAX_UNPROVEN:
            oldest = next(iter(self._unproven))
            del self._unproven[oldest]
            oldest._refuse(ConnectionEvent.CLOSED_EVICTED)
        self._unproven[connection] = None

    def _proved(self, connection: _ListenerConnection) -> bool:
        self._unproven.pop(connection, None)
        if len(self._proven) >= MAX_PROVEN:
            self.metrics.notice_connection(ConnectionEvent.REFUSED)
            return False
        self._proven.add(connection)
        return True

    def _gone(self, connection: _ListenerConnection) -> None:
        self._unproven.pop(connection, None)
        self._proven.discard(connection)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in [*self._unproven, *self._proven]:
            connection.abort()


class _ListenerConnection(asyncio.Protocol):
    def __init__(self, listener: NoticeListener) -> None:
        self._listener = listener
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._nonce = secrets.token_bytes(NONCE_NBYTES)
        self._session: bytes | None = None
        self._received = 0
        self._timer: asyncio.TimerHandle | None = None
        #: Verdicts scheduled and not yet written.
        self._unanswered = 0
        #: The transport holds more unsent verdicts than it should (`pause_writing`).
        self._backlogged = False
        #: Notices are read (not paused until this connection's verdicts have gone).
        self._reading = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's, so no isinstance check here.
        stream = self._transport = cast(asyncio.Transport, transport)
        self._listener._admit(self)
        # A writer whose node vanished without closing is noticed, and its connection dropped.
        sock = stream.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        stream.set_write_buffer_limits(high=MAX_QUEUED_VERDICTS * _VERDICT.size)
        stream.write(MAGIC + self._nonce)
        self._timer = asyncio.get_running_loop().call_later(
            self._listener.handshake_s, self._refuse, ConnectionEvent.CLOSED_SLOW
        )

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if self._session is None:
            if len(buffer) < _HELLO_NBYTES:
                return
            if not self._check_hello(bytes(buffer[:_HELLO_NBYTES])):
                return
            del buffer[:_HELLO_NBYTES]
        self._read_notices()

    def _check_hello(self, hello: bytes) -> bool:
        listener = self._listener
        writer_nonce = hello[len(MAGIC) : _GREETING_NBYTES]
        proof = _mac(listener.key, b"writer", self._nonce, writer_nonce)
        if hello[: len(MAGIC)] != MAGIC or not hmac.compare_digest(hello[_GREETING_NBYTES:], proof):
            self._refuse(ConnectionEvent.CLOSED_UNPROVEN)
            return False
        if self._timer is not None:
            self._timer.cancel()
        if not listener._proved(self):
            self.abort()
            return False
        self._session = _session_key(listener.key, self._nonce, writer_nonce)
        assert self._transport is not None
        self._transport.write(_mac(listener.key, b"listener", self._nonce, writer_nonce))
        return True

    def _read_notices(self) -> None:
        buffer, session = self._buffer, self._session
        assert session is not None
        while self._reading and len(buffer) >= _FRAME.size:
            length, tag = _FRAME.unpack_from(buffer)
            if length > MAX_NOTICE_NBYTES:
                self._refuse(ConnectionEvent.CLOSED_OVERSIZED)
                return
            end = _FRAME.size + length
            if len(buffer) < end:
                return
            body = bytes(buffer[_FRAME.size : end])
            del buffer[:end]
            sequence = self._received
            if not hmac.compare_digest(tag, _notice_tag(session, sequence, body)):
                self._refuse(ConnectionEvent.CLOSED_FORGED)
                return
            self._received += 1
            verdict = _VERDICT_OF.get(self._listener.handler(body), Verdict.MALFORMED)
            # After the waiter the notice woke, which is already in the loop's queue.
            asyncio.get_running_loop().call_soon(self._answer, sequence, verdict)
            self._unanswered += 1
            self._throttle()

    def _answer(self, sequence: int, verdict: Verdict) -> None:
        self._listener.metrics.notice_received(NoticeKind.TCP.value)  # here: after the waiter
        self._unanswered -= 1
        transport, session = self._transport, self._session
        if transport is None or session is None or transport.is_closing():
            return
        transport.write(_VERDICT.pack(sequence, verdict, _verdict_tag(session, sequence, verdict)))
        self._throttle()

    def pause_writing(self) -> None:
        # The writer does not take its verdicts as fast as its notices come.
        self._listener.metrics.notice_connection(ConnectionEvent.STALLED)
        self._backlogged = True
        self._throttle()

    def resume_writing(self) -> None:
        self._backlogged = False
        self._throttle()

    def _throttle(self) -> None:
        """Stop reading notices while this connection's verdicts queue (`MAX_QUEUED_VERDICTS`
        not yet written, or the transport's unsent bytes past their limit), and read again once
        they have all gone: a writer that does not read its verdicts stalls its own connection
        and makes the listener queue nothing more."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._reading:
            if self._backlogged or self._unanswered >= MAX_QUEUED_VERDICTS:
                self._reading = False
                transport.pause_reading()
        elif not self._backlogged and self._unanswered == 0:
            self._reading = True
            transport.resume_reading()
            # Notices that arrived with the last ones read are still in the buffer.
            self._read_notices()

    def _refuse(self, why: ConnectionEvent) -> None:
        self._listener.metrics.notice_connection(why)
        self.abort()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._listener._gone(self)
        self._buffer.clear()


# ---- the writer's end -------------------------------------------------------------------


class NoticeConnection:
    """A writer's authenticated connection to one decode engine's listener; notices go out in
    order, and each `send` returns that engine's verdict."""

    def __init__(self, connection: _WriterConnection, engine_id: str) -> None:
        self._connection = connection
        self.engine_id = engine_id

    @classmethod
    async def open(cls, host: str, port: int, key: bytes, engine_id: str) -> NoticeConnection:
        """Connect and prove the key both ways (the caller bounds the wait); `TransportError` if
        the listener cannot be reached or does not prove it holds `key`."""
        loop = asyncio.get_running_loop()
        where = format_address(host, port)
        try:
            _, connection = await loop.create_connection(lambda: _WriterConnection(key, where), host, port)
        except OSError as error:
            raise TransportError(
                f"cannot reach engine {engine_id!r}'s notice listener at {where}: {error}",
                engine_id=engine_id,
                address=where,
            ) from error
        try:
            await connection.ready
        except BaseException:
            connection.abort()
            raise
        return cls(connection, engine_id)

    @property
    def closed(self) -> bool:
        return self._connection.lost

    async def send(self, body: bytes) -> Verdict:
        """Send one notice; returns once the engine has read it, with its verdict.
        `TransportError` if the connection breaks first (the notice may or may not have been
        taken; the engine decides, and a repeat of it is dropped there as unknown)."""
        return await self._connection.send_now(body)

    def send_now(self, body: bytes) -> asyncio.Future[Verdict]:
        """`send` from the event loop's thread without awaiting: the notice is written (or
        `TransportError` raised, with nothing sent) before this returns; the future resolves to
        the verdict, or fails as `send` would."""
        return self._connection.send_now(body)

    def close(self) -> None:
        self._connection.abort()


class _WriterConnection(asyncio.Protocol):
    def __init__(self, key: bytes, where: str) -> None:
        self._key = key
        self._where = where
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._nonce = secrets.token_bytes(NONCE_NBYTES)
        self._listener_nonce: bytes | None = None
        self._session: bytes | None = None
        self._sent = 0
        self._pending: OrderedDict[int, asyncio.Future[Verdict]] = OrderedDict()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if self._listener_nonce is None:
            if len(buffer) < _GREETING_NBYTES:
                return
            greeting = bytes(buffer[:_GREETING_NBYTES])
            del buffer[:_GREETING_NBYTES]
            if greeting[: len(MAGIC)] != MAGIC:
                self._fail(f"{self._where} is not a kvray notice listener")
                return
            self._listener_nonce = greeting[len(MAGIC) :]
            assert self._transport is not None
            self._transport.write(
                MAGIC + self._nonce + _mac(self._key, b"writer", self._listener_nonce, self._nonce)
            )
        if self._session is None:
            if len(buffer) < MAC_NBYTES:
                return
            proof = bytes(buffer[:MAC_NBYTES])
            del buffer[:MAC_NBYTES]
            expected = _mac(self._key, b"listener", self._listener_nonce, self._nonce)
            if not hmac.compare_digest(proof, expected):
                self._fail(f"the notice listener at {self._where} did not prove it holds the engine's key")
                return
            self._session = _session_key(self._key, self._listener_nonce, self._nonce)
            if not self.ready.done():
                self.ready.set_result(None)
        self._read_verdicts()

    def _read_verdicts(self) -> None:
        buffer, session = self._buffer, self._session
        assert session is not None
        while len(buffer) >= _VERDICT.size:
            sequence, code, tag = _VERDICT.unpack_from(buffer)
            del buffer[: _VERDICT.size]
            oldest = next(iter(self._pending), None)
            if (
                sequence != oldest
                or code not in Verdict._value2member_map_
                or not hmac.compare_digest(tag, _verdict_tag(session, sequence, code))
            ):
                self._fail(f"the notice listener at {self._where} answered out of protocol")
                return
            future = self._pending.pop(sequence)
            if not future.done():
                future.set_result(Verdict(code))

    def send_now(self, body: bytes) -> asyncio.Future[Verdict]:
        transport, session = self._transport, self._session
        if self.lost or transport is None or session is None or transport.is_closing():
            raise TransportError(f"the connection to the notice listener at {self._where} is closed")
        if transport.get_write_buffer_size() > MAX_UNSENT_NBYTES:
            self._fail(f"the notice listener at {self._where} stopped reading")
            raise TransportError(f"the notice listener at {self._where} stopped reading")
        sequence = self._sent
        self._sent += 1
        future: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._pending[sequence] = future
        transport.write(_FRAME.pack(len(body), _notice_tag(session, sequence, body)) + body)
        return future

    def _fail(self, why: str) -> None:
        error = TransportError(why, address=self._where)
        if not self.ready.done():
            self.ready.set_exception(error)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        self.abort()

    def abort(self) -> None:
        self.lost = True
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(f"the connection to the notice listener at {self._where} was lost")
        # Nobody awaits a handshake that failed after its caller gave up.
        if self.ready.done() and not self.ready.cancelled():
            self.ready.exception()


# ---- the channel ------------------------------------------------------------------------

#: The share of `notify_timeout_s` a writer spends reaching a peer's notice listener before the
#: notice goes the next way (the peer's actor).
CONNECT_SHARE = 0.25
#: Seconds a writer leaves a notice listener alone after failing to reach it.
UNREACHABLE_S = 30.0


class TcpChannel(NoticeChannel):
    """Notices to decode engines that publish a notice listener, over one connection per
    engine incarnation (at most `max_cached_peers`, least recently used closed first); this
    engine's own listener, on `notice_host` or the node's address (off with `notice_tcp`). A
    push-request mailbox's listener is one more, on a port of its own."""

    kind = NoticeKind.TCP

    def __init__(
        self, settings: Settings, metrics: EngineMetrics | None = None, mailbox: Mailbox = Mailbox.COMPLETIONS
    ) -> None:
        super().__init__(settings, metrics, mailbox)
        #: Connections to listeners, each an opening task until it is up.
        self._connections: PeerCache[None, asyncio.Task[NoticeConnection]] = PeerCache(
            settings.max_cached_peers, _close_opening
        )
        #: Listeners a connection failed to recently, and until when they are left alone.
        self._unreachable: PeerCache[None, float] = PeerCache(settings.max_cached_peers)
        #: This decode engine's listener, once it listens.
        self.listener: NoticeListener | None = None

    def _target(self, peer: Reachable) -> tuple[str, str] | None:
        """(address, key) of the peer's listener, if it publishes one and this writer may use it."""
        if not self.settings.notice_tcp:
            return None
        address_key, key_key = ENDPOINTS[self.mailbox]
        address = peer.info.endpoints.get(address_key)
        key = peer.info.endpoints.get(key_key)
        return (address, key) if address and key else None

    def _left_alone(self, peer: Reachable) -> bool:
        until = self._unreachable.get(peer.info.engine_id, peer.info.incarnation, None)
        return until is not None and until > time.monotonic()

    def reaches(self, peer: Reachable) -> bool:
        return self._target(peer) is not None and not self._left_alone(peer)

    def prepare(self, peer: Reachable) -> None:
        target = self._target(peer)
        info = peer.info
        if target is None or self._left_alone(peer):
            return
        if self._connections.get(info.engine_id, info.incarnation, None) is None:
            opening = self._opening(peer, *target)
            if opening is not None:
                # Its failure is counted when a notice first needs it (`_connection`).
                opening.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def send(self, peer: Reachable, notice: Mail, message: bytes) -> bool:
        info = peer.info
        target = self._target(peer)
        # A listener closes a connection whose message is longer than it reads (a push request
        # for a long prompt may be): such a message goes the next way (the peer's host).
        if target is None or self._left_alone(peer) or len(message) > MAX_NOTICE_NBYTES:
            return False
        connection = await self._connection(peer, *target)
        if connection is None:
            return False
        try:
            verdict = await connection.send(message)
        except TransportError as error:
            self._connections.pop(info.engine_id, info.incarnation, None)
            raise TransportError(
                f"could not notify engine {info.engine_id!r}: {error}", engine_id=info.engine_id
            ) from error
        self.metrics.notice_sent(self.kind.value, NoticeSend.AFTER_WRITE)
        refused = refusal(_REASON_OF[verdict], info.engine_id, notice.request_id)
        if refused is not None:
            raise refused
        return True

    def send_now(self, peer: Reachable, notice: Mail, message: bytes) -> Receipt | None:
        """Over the connection this writer keeps open to the peer's listener; None where there
        is none open yet (`send` opens one)."""
        info = peer.info
        if self._target(peer) is None or len(message) > MAX_NOTICE_NBYTES:
            return None
        opening = self._connections.get(info.engine_id, info.incarnation, None)
        if opening is None or not opening.done() or opening.cancelled() or opening.exception() is not None:
            return None
        try:
            verdict = opening.result().send_now(message)
        except TransportError:
            return None
        self.metrics.notice_sent(self.kind.value, NoticeSend.AT_ONCE)
        return _receipt(verdict, info.engine_id, notice.request_id)

    async def _connection(self, peer: Reachable, address: str, listener_key: str) -> NoticeConnection | None:
        """The open connection to a listener, opened now if needed (None if it cannot be)."""
        info = peer.info
        opening = self._connections.get(info.engine_id, info.incarnation, None)
        # A connection that was lost (or an opening given up) is opened again; one that failed
        # to open is reported below.
        if opening is not None and opening.done() and (opening.cancelled() or _lost(opening)):
            self._connections.pop(info.engine_id, info.incarnation, None)
            opening = None
        if opening is None:
            opening = self._opening(peer, address, listener_key)
            if opening is None:
                return None
        try:
            return await asyncio.shield(opening)
        except (TransportError, TimeoutError):
            self.metrics.listener_refused(ListenerRefusal.UNREACHABLE)
            self._connections.pop(info.engine_id, info.incarnation, None)
            self._unreachable.put(info.engine_id, info.incarnation, None, time.monotonic() + UNREACHABLE_S)
            return None

    def _opening(
        self, peer: Reachable, address: str, listener_key: str
    ) -> asyncio.Task[NoticeConnection] | None:
        """Start opening a connection to a listener (None, marked unusable, if what the peer
        published is not an address and a key)."""
        info = peer.info
        try:
            host, port = parse_address(address)
            secret = parse_key(listener_key)
        except MetadataError:
            self.metrics.listener_refused(ListenerRefusal.MALFORMED)
            self._unreachable.put(info.engine_id, info.incarnation, None, float("inf"))
            return None
        opening = asyncio.ensure_future(self._open(host, port, secret, info.engine_id))
        self._connections.put(info.engine_id, info.incarnation, None, opening)
        return opening

    async def _open(self, host: str, port: int, secret: bytes, engine_id: str) -> NoticeConnection:
        async with asyncio.timeout(self.settings.notify_timeout_s * CONNECT_SHARE):
            connection = await NoticeConnection.open(host, port, secret, engine_id)
        self.metrics.notice_connection(ConnectionEvent.OPENED)
        return connection

    def forget(self, engine_id: str) -> None:
        self._connections.forget(engine_id)
        self._unreachable.forget(engine_id)

    async def listen(self, receiver: NoticeReceiver) -> None:
        settings = self.settings
        host = settings.notice_host or receiver.node_address
        if not settings.notice_tcp or not host:
            return
        try:
            self.listener = await NoticeListener.open(
                host,
                settings.notice_port,
                receiver.receive,
                handshake_s=settings.notify_timeout_s,
                metrics=self.metrics,
                ports=settings.notice_ports,
            )
        except TransportUnavailableError as error:
            if self.mailbox is Mailbox.COMPLETIONS:
                raise
            # The completion listener took the only port the settings allow: push requests
            # from other nodes take the engine's host instead, as they may anyway.
            log.warning("kvray: no TCP listener for push requests (%s); they come through Ray calls", error)

    def publish(self) -> dict[str, str]:
        return {} if self.listener is None else self.listener.endpoints(self.mailbox)

    def close(self) -> None:
        self._connections.clear()
        self._unreachable.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def _close_opening(opening: asyncio.Task[NoticeConnection]) -> None:
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _lost(opening: asyncio.Task[NoticeConnection]) -> bool:
    """An opened connection that has closed since (the task is done and not cancelled)."""
    return opening.exception() is None and opening.result().closed


def _receipt(verdict: asyncio.Future[Verdict], engine_id: str, request_id: str) -> Receipt:
    """The receipt of a notice sent at once: resolves with the engine's verdict, failing with
    its refusal (or the connection's failure) as `send` raises them."""
    receipt: Receipt = asyncio.get_running_loop().create_future()

    def answered(done: asyncio.Future[Verdict]) -> None:
        if receipt.done():
            return
        if done.cancelled():
            receipt.cancel()
            return
        error = done.exception()
        if error is not None:
            receipt.set_exception(
                TransportError(f"could not notify engine {engine_id!r}: {error}", engine_id=engine_id)
            )
            return
        refused = refusal(_REASON_OF[done.result()], engine_id, request_id)
        if refused is None:
            receipt.set_result(None)
        else:
            receipt.set_exception(refused)

    verdict.add_done_callback(answered)
    return receipt
