"""Two agents on two "nodes" of this process: the writer moves a request with the `ray` transport
(through an in-process stand-in for the decode engine's actor) and sends its completion over the
decode engine's notice listener (`kvray.notice.tcp`), not through the actor. A listener the
writer cannot reach or that cannot prove the published key leaves the notice to the actor; a
refusal comes back as the same kvray error a Ray call would raise."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch
from test_contract import ready_layout

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import NotExpectedError
from kvray.layout import BlockOrder
from kvray.notice.tcp import ADDRESS_ENDPOINT, KEY_ENDPOINT, KEY_NBYTES
from kvray.wire import EngineInfo, Role, TransportKind


class _Method:
    def __init__(self, function: Any) -> None:
        self.remote = function


class DecodeActorStandIn:
    """IN-PROCESS STAND-IN for the Ray actor hosting the decode agent (`AgentHost`): `ray`
    writes and notices, called directly; it counts the notices that came this way."""

    def __init__(self, agent: KVAgent) -> None:
        self.notices = 0

        async def deliver(header: bytes, payload: np.ndarray) -> int:
            received = np.array(payload, copy=True)
            received.flags.writeable = False
            return await agent.deliver(header, received)

        async def notify(message: bytes) -> None:
            self.notices += 1
            await agent.notify(message)

        self.kvray_deliver = _Method(deliver)
        self.kvray_notify = _Method(notify)


class TwoNodes(NamedTuple):
    prefill: KVAgent
    decode: KVAgent
    actor: DecodeActorStandIn


@pytest_asyncio.fixture(loop_scope="function")
async def nodes(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TwoNodes]:
    from kvray.transport.ray import RayTransport

    # As inside a Ray actor: the `ray` transport reaches the other node.
    monkeypatch.setattr(RayTransport, "unavailable_reason", classmethod(lambda cls, settings: None))
    settings = Settings(notice_host="127.0.0.1", notify_timeout_s=4.0, transfer_timeout_s=10.0)
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    prefill = KVAgent("p", Role.PREFILL, layout, settings=settings, use_coordinator=False)
    decode = KVAgent("d", Role.DECODE, layout, settings=settings, use_coordinator=False)
    prefill.node_id, decode.node_id = "node-a", "node-b"
    await decode.start()
    await prefill.start()
    actor = DecodeActorStandIn(decode)
    prefill.add_peer(decode.info, actor)
    source = prefill.backing.regions[0].tensor.numpy()
    source[:] = np.random.default_rng(5).integers(0, 256, source.size, dtype=np.uint8)
    try:
        yield TwoNodes(prefill, decode, actor)
    finally:
        await prefill.close()
        await decode.close()


def snapshot(agent: KVAgent) -> tuple[int, np.ndarray]:
    """(region offset inside its allocation, copy of the whole allocation)."""
    region = agent.backing.regions[0]
    assert region.allocation is not None
    return region.span.offset_in_allocation, region.allocation.cpu().numpy().copy()


def layer_blocks(agent: KVAgent, ids: list[int]) -> list[np.ndarray]:
    """Blocks `ids` of every layer (both parts of a split K/V layer)."""
    out = []
    for layer in agent.layout.layers:
        view = agent.backing.view(layer.name)
        picked = view[:, ids] if layer.geometry.parts == 2 else view[ids]
        out.append(picked.contiguous().view(torch.uint8).numpy().copy())
    return out


async def test_a_request_completes_over_the_listener_not_the_actor(nodes: TwoNodes, canary_mask: Any) -> None:
    prefill, decode, actor = nodes
    assert decode.info.endpoints[ADDRESS_ENDPOINT].startswith("127.0.0.1:")
    region = decode.backing.regions[0]
    assert region.allocation is not None
    region.allocation.numpy()[:] = 0xA5  # canary
    offset, before = snapshot(decode)
    reservation = decode.expect("whole", [3, 9, 4])
    result = await prefill.push(reservation, [1, 2, 7], timeout=10)
    completion = await decode.wait_for_kv("whole", timeout=10)
    assert result.transport is TransportKind.RAY and completion.nbytes == result.nbytes
    for sent, landed in zip(layer_blocks(prefill, [1, 2, 7]), layer_blocks(decode, [3, 9, 4]), strict=True):
        assert np.array_equal(sent, landed)
    _, after = snapshot(decode)
    mask = canary_mask(decode.info, offset, before.size, [([3, 9, 4], None)])
    assert np.array_equal(before[~mask], after[~mask]), "a byte outside the request's blocks changed"
    await decode.release("whole")

    # Layer by layer, then the finish alone over the listener.
    layered = decode.expect("layered", [5, 6])
    for layer in decode.layout.layer_names:
        await prefill.push_layer(layered, layer, [8, 10], timeout=10)
    await prefill.finish("layered", timeout=10)
    await decode.wait_for_kv("layered", timeout=10)
    await decode.release("layered")

    assert decode.stats["notices_received_tcp"] == 2 and sent_by_tcp(prefill) == 2
    assert actor.notices == 0


async def test_the_first_request_finds_the_listener_connected(nodes: TwoNodes) -> None:
    """The writer connects to the listener while the first layers move, so even the first
    request's finish sends its notice at once over an open connection."""
    prefill, decode, actor = nodes
    reservation = decode.expect("first", [1, 2])
    for layer in decode.layout.layer_names:
        await prefill.push_layer(reservation, layer, [3, 4], timeout=10)
    # Layers moved in this process take less time than the handshake; on a GPU or across
    # nodes they take longer. No notice has been sent: only connecting ahead opens it.
    await until(lambda: prefill.stats["notice_connections_opened"] == 1)
    await prefill.finish("first", timeout=10)
    await decode.wait_for_kv("first", timeout=10)
    assert prefill.stats["notices_sent_tcp_at_once"] == 1 and actor.notices == 0, dict(prefill.stats)


async def test_a_refused_notice_raises_at_the_writer(nodes: TwoNodes) -> None:
    prefill, decode, actor = nodes
    reservation = decode.expect("gone", [1, 2])
    for layer in decode.layout.layer_names:
        await prefill.push_layer(reservation, layer, [3, 4], timeout=10)
    decode.cancel("gone")
    with pytest.raises(NotExpectedError, match="does not expect request 'gone'"):
        await prefill.finish("gone", timeout=10)
    assert decode.stats["messages_dropped_unknown"] == 1 and actor.notices == 0


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.002)


def sent_by_tcp(agent: KVAgent) -> int:
    return agent.stats["notices_sent_tcp_after_write"] + agent.stats["notices_sent_tcp_at_once"]


def published(info: EngineInfo, **endpoints: str) -> EngineInfo:
    return msgspec.structs.replace(info, endpoints={**info.endpoints, **endpoints})


@pytest.mark.parametrize(
    ("endpoints", "stat"),
    [
        ({ADDRESS_ENDPOINT: "127.0.0.1:1"}, "notice_listeners_refused_unreachable"),  # nothing listens
        ({KEY_ENDPOINT: "00" * KEY_NBYTES}, "notice_listeners_refused_unreachable"),  # not the engine's key
        ({ADDRESS_ENDPOINT: "decode-host:80"}, "notice_listeners_refused_malformed"),
        ({KEY_ENDPOINT: "not hex"}, "notice_listeners_refused_malformed"),
    ],
)
async def test_a_listener_the_writer_cannot_use_leaves_the_notice_to_the_actor(
    nodes: TwoNodes, endpoints: dict[str, str], stat: str
) -> None:
    prefill, decode, actor = nodes
    prefill.forget_peer("d")
    prefill.add_peer(published(decode.info, **endpoints), actor)
    for n in range(2):  # the second notice does not try the listener again
        reservation = decode.expect(f"r{n}", [1, 2])
        await prefill.push(reservation, [3, 4], timeout=10)
        await decode.wait_for_kv(f"r{n}", timeout=10)
        await decode.release(f"r{n}")
    assert actor.notices == 2
    assert prefill.stats[stat] == 1 and sent_by_tcp(prefill) == 0
    assert decode.stats["notices_received_tcp"] == 0


async def test_without_tcp_notices_the_actor_takes_them(nodes: TwoNodes) -> None:
    prefill, decode, actor = nodes
    off = Settings(notice_tcp=False)
    writer = KVAgent("p2", Role.PREFILL, prefill.layout, settings=off, use_coordinator=False)
    writer.node_id = "node-c"
    await writer.start()
    try:
        writer.add_peer(decode.info, actor)
        reservation = decode.expect("r", [1, 2])
        await writer.push(reservation, [3, 4], timeout=10)
        await decode.wait_for_kv("r", timeout=10)
        assert actor.notices == 1 and decode.stats["notices_received_tcp"] == 0
    finally:
        await writer.close()
    # A decode engine told not to listen publishes no listener.
    quiet = KVAgent("d2", Role.DECODE, prefill.layout, settings=off, use_coordinator=False)
    await quiet.start()
    try:
        assert ADDRESS_ENDPOINT not in quiet.info.endpoints and KEY_ENDPOINT not in quiet.info.endpoints
    finally:
        await quiet.close()
