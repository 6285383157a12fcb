"""The notice listener a decode engine opens for writers on other nodes (`kvray.notice.tcp`):
nothing a connection sends reaches the engine before it proves the engine's key; a forged,
replayed, reordered or oversized notice closes the connection unread; a listener that cannot
prove the key gets no notice; each notice is answered with the engine's verdict. What a
connection may hold at the listener is bounded: idle connections neither keep writers out nor
stay past the handshake bound, and a writer that does not read its verdicts stalls only itself."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
from event_loops import loop_params, run_on

from kvray.errors import MetadataError, TransportError, TransportUnavailableError
from kvray.metrics import DropReason, EngineMetrics
from kvray.notice import tcp as completion_tcp
from kvray.notice.tcp import (
    HANDSHAKE_S,
    KEY_NBYTES,
    MAC_NBYTES,
    MAGIC,
    MAX_NOTICE_NBYTES,
    MAX_UNPROVEN,
    NONCE_NBYTES,
    NoticeConnection,
    NoticeListener,
    Verdict,
    _mac,
    _notice_tag,
    _session_key,
    _verdict_tag,
    parse_address,
    parse_key,
)

FRAME = struct.Struct(">I16s")
VERDICT = struct.Struct(">QB16s")


class Engine:
    """Records the notices the listener hands over and answers with a set verdict."""

    def __init__(self) -> None:
        self.notices: list[bytes] = []
        self.answer: DropReason | None = None
        self.metrics = EngineMetrics.detached()

    @property
    def stats(self) -> Counter[str]:
        return self.metrics.counts

    def take(self, body: bytes) -> DropReason | None:
        self.notices.append(body)
        return self.answer


async def with_listener(
    check: Callable[[NoticeListener, Engine], Awaitable[None]], handshake_s: float = 0.5
) -> None:
    engine = Engine()
    listener = await NoticeListener.open(
        "127.0.0.1", 0, engine.take, handshake_s=handshake_s, metrics=engine.metrics
    )
    try:
        await check(listener, engine)
    finally:
        listener.close()


def host_port(listener: NoticeListener) -> tuple[str, int]:
    return parse_address(listener.address)


async def until(condition: object, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """True once the other end closes (reads to the end within a second)."""
    async with asyncio.timeout(1.0):
        while await reader.read(4096):
            pass
    return True


async def proven(
    listener: NoticeListener, receive_nbytes: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A raw connection that has proved the key: (reader, writer, session key); with
    `receive_nbytes`, its socket's receive buffer is that small."""
    sock = socket.socket()
    if receive_nbytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_nbytes)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, host_port(listener))
    reader, writer = await asyncio.open_connection(sock=sock)
    greeting = await reader.readexactly(len(MAGIC) + NONCE_NBYTES)
    listener_nonce, nonce = greeting[len(MAGIC) :], os.urandom(NONCE_NBYTES)
    writer.write(MAGIC + nonce + _mac(listener.key, b"writer", listener_nonce, nonce))
    proof = await reader.readexactly(MAC_NBYTES)
    assert proof == _mac(listener.key, b"listener", listener_nonce, nonce)
    return reader, writer, _session_key(listener.key, listener_nonce, nonce)


def frame(session: bytes, sequence: int, body: bytes) -> bytes:
    return FRAME.pack(len(body), _notice_tag(session, sequence, body)) + body


async def notices_arrive_whole_in_order_with_the_engines_verdicts(
    listener: NoticeListener, engine: Engine
) -> None:
    channel = await NoticeConnection.open(*host_port(listener), listener.key, "d")
    bodies = [os.urandom(n) for n in (1, 100, 5000, MAX_NOTICE_NBYTES)]
    verdicts = [await channel.send(body) for body in bodies]
    assert engine.notices == bodies
    assert verdicts == [Verdict.TAKEN] * len(bodies)
    for reason, verdict in [
        (DropReason.UNKNOWN, Verdict.UNKNOWN),
        (DropReason.FORGED, Verdict.FORGED),
        (DropReason.STALE, Verdict.STALE),
        (DropReason.MALFORMED, Verdict.MALFORMED),
    ]:
        engine.answer = reason
        assert await channel.send(b"x") is verdict
    # Many at once: one connection, answered in order.
    engine.answer = None
    many = await asyncio.gather(*(channel.send(str(n).encode()) for n in range(200)))
    assert many == [Verdict.TAKEN] * 200
    assert engine.notices[-200:] == [str(n).encode() for n in range(200)]
    assert engine.stats["notices_received_tcp"] == len(engine.notices)
    channel.close()


async def a_writer_without_the_key_is_closed_before_a_notice_is_read(
    listener: NoticeListener, engine: Engine
) -> None:
    with pytest.raises(TransportError):
        async with asyncio.timeout(2):
            await NoticeConnection.open(*host_port(listener), os.urandom(KEY_NBYTES), "d")
    # The same with a raw writer that sends a notice right behind its wrong proof.
    reader, writer = await asyncio.open_connection(*host_port(listener))
    greeting = await reader.readexactly(len(MAGIC) + NONCE_NBYTES)
    nonce, wrong = os.urandom(NONCE_NBYTES), os.urandom(KEY_NBYTES)
    session = _session_key(wrong, greeting[len(MAGIC) :], nonce)
    writer.write(
        MAGIC + nonce + _mac(wrong, b"writer", greeting[len(MAGIC) :], nonce) + frame(session, 0, b"done")
    )
    assert await closed_by_peer(reader)
    writer.close()
    assert engine.notices == []
    assert engine.stats["notice_connections_closed_unproven"] == 2


async def garbage_and_silence_are_closed_unread(listener: NoticeListener, engine: Engine) -> None:
    reader, writer = await asyncio.open_connection(*host_port(listener))
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"A" * 64)
    assert await closed_by_peer(reader)
    writer.close()
    # A connection that never proves the key is closed at the handshake deadline (0.5 s here).
    reader, writer = await asyncio.open_connection(*host_port(listener))
    assert await reader.readexactly(len(MAGIC) + NONCE_NBYTES)
    async with asyncio.timeout(3):
        assert await reader.read() == b""
    writer.close()
    assert engine.notices == []
    assert engine.stats["notice_connections_closed_slow"] == 1
    await until(lambda: listener.connections == 0)


async def forged_replayed_and_oversized_notices_close_the_connection_unread(
    listener: NoticeListener, engine: Engine
) -> None:
    # A body changed after it was tagged.
    reader, writer, session = await proven(listener)
    tagged = bytearray(frame(session, 0, b"done: request r1"))
    tagged[-1] ^= 1
    writer.write(bytes(tagged))
    assert await closed_by_peer(reader)
    writer.close()
    # A notice sent again: the second copy carries the first one's sequence number.
    reader, writer, session = await proven(listener)
    writer.write(frame(session, 0, b"first"))
    assert await reader.readexactly(25)
    writer.write(frame(session, 0, b"first"))
    assert await closed_by_peer(reader)
    writer.close()
    # Out of order: the second notice first.
    reader, writer, session = await proven(listener)
    writer.write(frame(session, 1, b"second"))
    assert await closed_by_peer(reader)
    writer.close()
    # A length past the largest notice, before any of its bytes.
    reader, writer, session = await proven(listener)
    writer.write(FRAME.pack(MAX_NOTICE_NBYTES + 1, bytes(16)))
    assert await closed_by_peer(reader)
    writer.close()
    assert engine.notices == [b"first"]
    assert engine.stats["notice_connections_closed_forged"] == 3
    assert engine.stats["notice_connections_closed_oversized"] == 1


async def idle_connections_do_not_keep_a_writer_out(listener: NoticeListener, engine: Engine) -> None:
    held = [await asyncio.open_connection(*host_port(listener)) for _ in range(MAX_UNPROVEN)]
    for reader, _ in held:
        await reader.readexactly(len(MAGIC) + NONCE_NBYTES)
    # Every unproven place is taken, and the idle connections have seconds left to prove the
    # key: a writer still gets in now, and its notice through.
    async with asyncio.timeout(1):
        channel = await NoticeConnection.open(*host_port(listener), listener.key, "d")
        assert await channel.send(b"done") is Verdict.TAKEN
    assert engine.notices == [b"done"]
    # It took the place of the oldest idle connection; the others keep theirs.
    assert await closed_by_peer(held[0][0])
    assert engine.stats["notice_connections_closed_evicted"] == 1
    assert listener.connections == MAX_UNPROVEN
    for _, held_writer in held:
        held_writer.close()
    await until(lambda: listener.connections == 1)
    channel.close()


async def an_idle_connection_is_closed_at_the_handshake_bound(
    listener: NoticeListener, engine: Engine
) -> None:
    reader, writer = await asyncio.open_connection(*host_port(listener))
    assert await reader.readexactly(len(MAGIC) + NONCE_NBYTES)
    async with asyncio.timeout(completion_tcp.HANDSHAKE_S + 1):
        assert await reader.read() == b""
    writer.close()
    assert engine.stats["notice_connections_closed_slow"] == 1
    await until(lambda: listener.connections == 0)


async def a_writer_that_does_not_read_its_verdicts_stalls_only_itself(
    listener: NoticeListener, engine: Engine
) -> None:
    # Small socket buffers on both ends (accepted sockets take the listening socket's), so that
    # unread verdicts soon queue at the listener itself.
    assert listener._server is not None
    listener._server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    reader, writer, session = await proven(listener, receive_nbytes=4096)
    notices = 20_000
    writer.write(b"".join(frame(session, sequence, b"") for sequence in range(notices)))
    taken = -1
    while taken != len(engine.notices):
        taken = len(engine.notices)
        await asyncio.sleep(0.2)
    # The listener stopped reading the writer's notices, rather than queue their verdicts.
    assert taken < notices // 2
    assert engine.stats["notice_connections_stalled"] >= 1
    # Other writers are served meanwhile.
    channel = await NoticeConnection.open(*host_port(listener), listener.key, "d")
    assert await channel.send(b"other") is Verdict.TAKEN
    channel.close()
    # Once the writer reads its verdicts, the rest of its notices are read and answered.
    async with asyncio.timeout(10):
        verdicts = await reader.readexactly(notices * VERDICT.size)
    last_sequence, last_verdict, _ = VERDICT.unpack_from(verdicts, (notices - 1) * VERDICT.size)
    assert (last_sequence, last_verdict) == (notices - 1, Verdict.TAKEN)
    assert len(engine.notices) == notices + 1
    writer.close()


class Impostor:
    """A listener that knows its own key: it proves it (if `handle_verdict`, then answers the
    first notice with a verdict tag that does not verify), or, without it, a wrong proof."""

    def __init__(
        self, server: asyncio.Server, key: bytes, received: list[bytes], served: set[asyncio.Task[None]]
    ) -> None:
        self.server, self.key, self.received, self._served = server, key, received, served

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end every connection's handler, so none outlives the test's loop
        (a handler left pending holds its socket until the loop is collected)."""
        self.server.close()
        for task in self._served:
            task.cancel()
        await asyncio.gather(*self._served, return_exceptions=True)


async def impostor(handle_verdict: bool) -> Impostor:
    key, received, served = os.urandom(KEY_NBYTES), [], set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        served.add(task)
        try:
            nonce = os.urandom(NONCE_NBYTES)
            writer.write(MAGIC + nonce)
            hello = await reader.readexactly(len(MAGIC) + NONCE_NBYTES + MAC_NBYTES)
            writer_nonce = hello[len(MAGIC) : len(MAGIC) + NONCE_NBYTES]
            if not handle_verdict:
                writer.write(os.urandom(MAC_NBYTES))
                await reader.read()
                return
            writer.write(_mac(key, b"listener", nonce, writer_nonce))
            length, _ = FRAME.unpack(await reader.readexactly(FRAME.size))
            received.append(await reader.readexactly(length))
            session = _session_key(key, nonce, writer_nonce)
            writer.write(struct.pack(">QB16s", 0, Verdict.TAKEN, _verdict_tag(session, 0, Verdict.FORGED)))
            await reader.read()
        finally:
            # The writer's end of the stream stays open after the peer's EOF until closed here.
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return Impostor(server, key, received, served)


async def a_listener_that_cannot_prove_the_key_gets_no_notice() -> None:
    fake = await impostor(handle_verdict=False)
    with pytest.raises(TransportError, match="did not prove"):
        async with asyncio.timeout(2):
            await NoticeConnection.open("127.0.0.1", fake.port, fake.key, "d")
    assert fake.received == []
    await fake.close()


async def a_verdict_that_does_not_verify_fails_the_send() -> None:
    fake = await impostor(handle_verdict=True)
    channel = await NoticeConnection.open("127.0.0.1", fake.port, fake.key, "d")
    with pytest.raises(TransportError, match="out of protocol"):
        async with asyncio.timeout(2):
            await channel.send(b"done")
    assert channel.closed and fake.received == [b"done"]
    with pytest.raises(TransportError, match="closed"):
        await channel.send(b"again")
    await fake.close()


async def a_lost_connection_fails_the_notices_waiting_for_their_verdict(
    listener: NoticeListener, engine: Engine
) -> None:
    channel = await NoticeConnection.open(*host_port(listener), listener.key, "d")
    listener.close()
    with pytest.raises(TransportError):
        async with asyncio.timeout(2):
            await channel.send(b"done")
    assert channel.closed


async def a_busy_port_is_a_clear_error(listener: NoticeListener, engine: Engine) -> None:
    host, port = host_port(listener)
    with pytest.raises(TransportUnavailableError, match="KVRAY_NOTICE_PORT"):
        await NoticeListener.open(host, port, engine.take, handshake_s=1, metrics=engine.metrics)
    # A range: the next engine takes the next free port of it.
    if port + 8 > 65535:
        return
    other = await NoticeListener.open(host, port, engine.take, handshake_s=1, metrics=engine.metrics, ports=8)
    try:
        assert port < host_port(other)[1] < port + 8
    finally:
        other.close()


@pytest.mark.parametrize(
    "address", ["", "127.0.0.1", "localhost:80", "127.0.0.1:0", "127.0.0.1:65536", "1.2.3.4:+80", "[::1]"]
)
def test_published_addresses_must_be_an_ip_and_a_port(address: str) -> None:
    with pytest.raises(MetadataError):
        parse_address(address)


def test_published_addresses_and_keys_parse() -> None:
    assert parse_address("10.1.2.3:7070") == ("10.1.2.3", 7070)
    assert parse_address("[::1]:7070") == ("::1", 7070)
    assert parse_key("ab" * KEY_NBYTES) == bytes([0xAB]) * KEY_NBYTES
    for text in ("", "ab" * (KEY_NBYTES - 1), "zz" * KEY_NBYTES):
        with pytest.raises(MetadataError):
            parse_key(text)


@pytest.mark.parametrize("new_loop", loop_params())
@pytest.mark.parametrize(
    "check",
    [
        notices_arrive_whole_in_order_with_the_engines_verdicts,
        a_writer_without_the_key_is_closed_before_a_notice_is_read,
        garbage_and_silence_are_closed_unread,
        forged_replayed_and_oversized_notices_close_the_connection_unread,
        a_writer_that_does_not_read_its_verdicts_stalls_only_itself,
        a_lost_connection_fails_the_notices_waiting_for_their_verdict,
        a_busy_port_is_a_clear_error,
    ],
)
def test_listener(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
    check: Callable[[NoticeListener, Engine], Awaitable[None]],
) -> None:
    run_on(new_loop, with_listener(check))


@pytest.mark.parametrize("new_loop", loop_params())
def test_idle_connections_do_not_keep_a_writer_out(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    # The notices' own deadline, as the agent passes it: idle connections keep their places
    # for the whole handshake bound.
    run_on(new_loop, with_listener(idle_connections_do_not_keep_a_writer_out, handshake_s=60.0))


@pytest.mark.parametrize("new_loop", loop_params())
def test_the_handshake_has_its_own_bound(
    new_loop: Callable[[], asyncio.AbstractEventLoop], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection has HANDSHAKE_S to prove the key, however long the notices' own deadline
    (the agent passes its notify_timeout_s)."""
    assert NoticeListener(bytes(KEY_NBYTES), Engine().take, 60.0, Counter()).handshake_s == HANDSHAKE_S
    monkeypatch.setattr(completion_tcp, "HANDSHAKE_S", 0.3)
    run_on(new_loop, with_listener(an_idle_connection_is_closed_at_the_handshake_bound, handshake_s=60.0))


@pytest.mark.parametrize("new_loop", loop_params())
@pytest.mark.parametrize(
    "check",
    [a_listener_that_cannot_prove_the_key_gets_no_notice, a_verdict_that_does_not_verify_fails_the_send],
)
def test_impostor(
    new_loop: Callable[[], asyncio.AbstractEventLoop], check: Callable[[], Awaitable[None]]
) -> None:
    run_on(new_loop, check())
