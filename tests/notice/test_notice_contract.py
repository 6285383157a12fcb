"""The notice channel contract, run against every channel kvray ships (`kvray.notice.NoticeKind`):
a decode engine's receiving end listens and publishes its endpoints; a writer's end reaches the
engine through them, delivers each notice whole and in order, passes over what it cannot reach
without sending a byte, hears the engine's refusal where the channel carries answers, and keeps
working after `forget`. No Ray cluster: the `actor` channel calls an in-process stand-in for the
actor hosting the engine's agent, as `AgentHost.kvray_notify` does."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from kvray.config import Settings
from kvray.errors import KvrayError, NotExpectedError, StaleIncarnationError, TransportError
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.metrics import DropReason
from kvray.notice import NoticeChannel, NoticeKind, channel_class
from kvray.notice.base import refusal
from kvray.notice.loopback import LoopbackChannel, NoticeNetwork
from kvray.transport.base import Peer
from kvray.wire import EngineInfo, Role, TransferDone, decode_notice, encode

LAYOUT = KVLayout(
    layers=(LayerSpec(name="layer0", geometry=Geometry(block_size=4, entry_shape=(8,), dtype="uint8")),),
    num_blocks=4,
)
NODE = "node-a"

#: Channels whose notices carry no answer back (a datagram): a refusal is counted at the engine,
#: never raised at the writer.
UNANSWERED = frozenset({NoticeKind.LOCAL})


@dataclass
class Engine:
    """A decode engine's receiving side as channels see it (the `NoticeReceiver` protocol)."""

    engine_id: str = "decode-0"
    incarnation: int = field(default_factory=lambda: secrets.randbits(62) or 1)
    node_address: str | None = "127.0.0.1"
    answer: DropReason | None = None
    notices: list[bytes] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def receive(self, message: bytes, /) -> DropReason | None:
        self.notices.append(message)
        self.arrived.set()
        return self.answer

    async def arrivals(self, count: int) -> list[bytes]:
        async with asyncio.timeout(5):
            while len(self.notices) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.notices


class _Remote:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def remote(self, message: bytes) -> None:
        request_id = decode_notice(message).request_id
        refused = refusal(self._engine.receive(message), self._engine.engine_id, request_id)
        if refused is not None:
            raise refused


class Host:
    """Stands in for the Ray actor hosting the decode engine's agent."""

    def __init__(self, engine: Engine) -> None:
        self.kvray_notify = _Remote(engine)


@dataclass
class ChannelUnderTest:
    kind: NoticeKind
    engine: Engine
    #: The decode engine's channel (its receiving end) and the writer's.
    receiving: NoticeChannel
    writing: NoticeChannel
    peer: Peer

    def notice(self, request_id: str, nbytes: int = 1) -> TransferDone:
        return TransferDone(
            transfer_id=f"{request_id}@p",
            request_id=request_id,
            src_engine="prefill-0",
            src_incarnation=1,
            dst_engine=self.engine.engine_id,
            dst_incarnation=self.engine.incarnation,
            token=7,
            nbytes=nbytes,
        )

    async def send(self, notice: TransferDone) -> bool:
        return await self.writing.send(self.peer, notice, encode(notice))


def _open(kind: NoticeKind, settings: Settings, network: NoticeNetwork) -> NoticeChannel:
    if kind is NoticeKind.LOOPBACK:
        return LoopbackChannel(network, settings)
    return channel_class(kind)(settings)


@pytest_asyncio.fixture(params=list(NoticeKind), ids=lambda kind: kind.value, loop_scope="function")
async def channel(request: Any, tmp_path: Path) -> AsyncIterator[ChannelUnderTest]:
    kind: NoticeKind = request.param
    settings = Settings(shm_dir=str(tmp_path), notify_timeout_s=2.0, notice_host="127.0.0.1")
    network = NoticeNetwork()
    engine = Engine()
    receiving = _open(kind, settings, network)
    writing = _open(kind, settings, network)
    receiving.node_id = writing.node_id = NODE
    await receiving.listen(engine)
    info = EngineInfo(
        engine_id=engine.engine_id,
        incarnation=engine.incarnation,
        role=Role.DECODE,
        node_id=NODE,
        layout=LAYOUT,
        regions=(),
        placements={},
        endpoints=receiving.publish(),
    )
    under_test = ChannelUnderTest(kind, engine, receiving, writing, Peer(info, Host(engine)))
    try:
        yield under_test
    finally:
        writing.close()
        receiving.close()


async def test_notices_arrive_whole_and_in_order(channel: ChannelUnderTest) -> None:
    assert channel.writing.reaches(channel.peer)
    notices = [channel.notice(f"r{index}", nbytes=index) for index in range(20)]
    for notice in notices:
        assert await channel.send(notice)
    assert await channel.engine.arrivals(len(notices)) == [encode(notice) for notice in notices]


async def test_a_notice_sent_at_once_arrives_with_its_receipt(channel: ChannelUnderTest) -> None:
    # A channel may need a first notice to get ready (a connection): the usual send opens it.
    assert await channel.send(channel.notice("first"))
    notice = channel.notice("at-once")
    receipt = channel.writing.send_now(channel.peer, notice, encode(notice))
    if receipt is None:
        # The channel waits for everything it sends (an actor call): nothing went out.
        assert channel.kind is NoticeKind.ACTOR
        assert await channel.engine.arrivals(1) == [encode(channel.notice("first"))]
        return
    async with asyncio.timeout(5):
        await receipt
    assert (await channel.engine.arrivals(2))[-1] == encode(notice)


async def test_a_refusal_comes_back_as_the_engines_error(channel: ChannelUnderTest) -> None:
    channel.engine.answer = DropReason.UNKNOWN
    if channel.kind in UNANSWERED:
        assert await channel.send(channel.notice("unknown"))
        assert await channel.engine.arrivals(1) == [encode(channel.notice("unknown"))]
        return
    with pytest.raises(NotExpectedError, match="does not expect request 'unknown'"):
        await channel.send(channel.notice("unknown"))
    channel.engine.answer = DropReason.STALE
    with pytest.raises(StaleIncarnationError):
        await channel.send(channel.notice("stale"))
    channel.engine.answer = None
    assert await channel.send(channel.notice("taken"))
    assert len(await channel.engine.arrivals(3)) == 3


async def test_a_peer_the_channel_cannot_reach_gets_nothing(channel: ChannelUnderTest) -> None:
    """A peer that published none of the channel's endpoints (or, in process, another
    incarnation; for the actor, no host) is passed over: `reaches` says no and `send` sends no byte."""
    info = channel.peer.info
    unreachable = Peer(
        msgspec.structs.replace(info, endpoints={}, incarnation=info.incarnation + 1), host=None
    )
    assert not channel.writing.reaches(unreachable)
    notice = channel.notice("nowhere")
    assert channel.writing.send_now(unreachable, notice, encode(notice)) is None
    assert not await channel.writing.send(unreachable, notice, encode(notice))
    await asyncio.sleep(0.05)
    assert channel.engine.notices == []


async def test_forget_then_send_again(channel: ChannelUnderTest) -> None:
    assert await channel.send(channel.notice("before"))
    channel.writing.forget(channel.engine.engine_id)
    assert await channel.send(channel.notice("after"))
    assert await channel.engine.arrivals(2) == [
        encode(channel.notice("before")),
        encode(channel.notice("after")),
    ]


async def test_a_closed_engine_is_an_error_or_passed_over_never_a_hang(channel: ChannelUnderTest) -> None:
    assert await channel.send(channel.notice("before"))
    await channel.engine.arrivals(1)
    channel.receiving.close()
    if channel.kind is NoticeKind.ACTOR:
        return  # the actor's own life decides (tests/reliability/test_kill.py)
    async with asyncio.timeout(5):
        try:
            sent = await channel.send(channel.notice("after"))
        except KvrayError as error:
            assert isinstance(error, TransportError)
        else:
            assert not sent
    assert len(channel.engine.notices) == 1


async def test_only_a_listening_engine_publishes(tmp_path: Path) -> None:
    settings = Settings(shm_dir=str(tmp_path), notice_host="127.0.0.1")
    for kind in NoticeKind:
        channel = _open(kind, settings, NoticeNetwork())
        try:
            assert channel.publish() == {}
        finally:
            channel.close()
