"""The loopback transport users test with: two agents of one process push through it with the
same checks as any transport (the bytes land, nothing around them changes; writes the decode
engine does not expect, forged ones and ones outside the request's blocks move no byte)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
import pytest_asyncio

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import BoundsError, NotExpectedError, StaleIncarnationError, TransportError
from kvray.layout import mixed
from kvray.plan import TransferPlan, plan_transfer
from kvray.transport import Peer
from kvray.transport.loopback import LoopbackNetwork, LoopbackTransport
from kvray.wire import Role

LAYOUT = mixed(8)
CANARY = 0xA5
Bytes = npt.NDArray[np.uint8]


def allocation(agent: KVAgent) -> Bytes:
    """Every byte the agent's backing allocated, around its region too."""
    region = agent.backing.regions[0]
    assert region.allocation is not None
    return region.allocation.numpy()


def expected_after(prefill: KVAgent, decode: KVAgent, before: Bytes, pairs: list[tuple[int, int]]) -> Bytes:
    """The decode allocation once each (prefill block, decode block) pair is copied, layer by
    layer and part by part, computed from the published placements alone."""
    expected = before.copy()
    source = prefill.backing.regions[0].tensor.numpy()
    start = decode.backing.regions[0].span.offset_in_allocation
    for name in LAYOUT.layer_names:
        src, dst = prefill.info.placement(name), decode.info.placement(name)
        for part in range(LAYOUT.layer(name).geometry.parts):
            for local, remote in pairs:
                at = start + dst.byte_offset(part, remote)
                read = src.byte_offset(part, local)
                expected[at : at + dst.part_nbytes] = source[read : read + src.part_nbytes]
    return expected


@pytest_asyncio.fixture(loop_scope="function")
async def pair(tmp_path: Path) -> AsyncIterator[tuple[KVAgent, KVAgent, LoopbackNetwork]]:
    network = LoopbackNetwork()
    settings = Settings(shm_dir=str(tmp_path), transfer_timeout_s=5.0, notify_timeout_s=5.0)
    agents = [
        KVAgent(
            f"lb-{role.value}",
            role,
            LAYOUT,
            settings=settings,
            use_coordinator=False,
            transports=[LoopbackTransport(network)],
        )
        for role in (Role.PREFILL, Role.DECODE)
    ]
    prefill, decode = agents
    for agent in agents:
        await agent.start()
    prefill.add_peer(decode.info)
    allocation(decode)[:] = CANARY
    source = allocation(prefill)
    source[:] = np.random.default_rng(7).integers(0, 256, source.size, dtype=np.uint8)
    try:
        yield prefill, decode, network
    finally:
        for agent in agents:
            await agent.close()


async def test_a_push_lands_exactly_and_nothing_around_it_changes(
    pair: tuple[KVAgent, KVAgent, LoopbackNetwork],
) -> None:
    prefill, decode, network = pair
    before = allocation(decode).copy()
    reservation = decode.expect("r", [6, 1, 3])
    result = await prefill.push(reservation, [0, 4, 5])
    completion = await decode.wait_for_kv("r", timeout=5.0)
    await decode.release("r")
    assert result.transport.value == "loopback" and completion.nbytes == result.nbytes
    assert (network.writes, network.nbytes) == (1, result.nbytes)
    expected = expected_after(prefill, decode, before, [(0, 6), (4, 1), (5, 3)])
    assert not np.array_equal(expected, before)
    np.testing.assert_array_equal(allocation(decode), expected)


async def test_layer_wise_pushes_complete_once(pair: tuple[KVAgent, KVAgent, LoopbackNetwork]) -> None:
    prefill, decode, network = pair
    before = allocation(decode).copy()
    reservation = decode.expect("lw", [2])
    for layer in LAYOUT.layer_names:
        await prefill.push_layer(reservation, layer, [7])
    await prefill.finish("lw")
    await decode.wait_for_kv("lw", timeout=5.0)
    await decode.release("lw")
    assert network.writes == len(LAYOUT.layer_names)
    np.testing.assert_array_equal(allocation(decode), expected_after(prefill, decode, before, [(7, 2)]))


def _for(plan: TransferPlan, request_id: str, token: int) -> TransferPlan:
    return dataclasses.replace(plan, request_id=request_id, token=token)


async def test_writes_the_decode_engine_does_not_take_move_no_byte(
    pair: tuple[KVAgent, KVAgent, LoopbackNetwork],
) -> None:
    prefill, decode, network = pair
    before = allocation(decode).copy()
    reservation = decode.expect("a", [2])
    decode.expect("b", [3])
    transport = LoopbackTransport(network)
    peer = Peer(decode.info)
    into_a = plan_transfer(prefill.info, decode.info, [0], [2])
    into_b = plan_transfer(prefill.info, decode.info, [0], [3])
    with pytest.raises(NotExpectedError):  # a forged token
        await transport.write(_for(into_a, "a", reservation.token ^ 1), prefill.backing, peer)
    with pytest.raises(NotExpectedError):  # a request never reserved
        await transport.write(_for(into_a, "never", 1), prefill.backing, peer)
    with pytest.raises(BoundsError):  # request a's token, request b's block
        await transport.write(_for(into_b, "a", reservation.token), prefill.backing, peer)
    stale = Peer(msgspec.structs.replace(decode.info, incarnation=decode.incarnation + 1))
    with pytest.raises(StaleIncarnationError):  # another life of the engine
        await transport.write(_for(into_a, "a", reservation.token), prefill.backing, stale)
    np.testing.assert_array_equal(allocation(decode), before)
    assert network.writes == 0
    # What the transport was built for lands; once the engine has closed, nothing does.
    await transport.write(_for(into_a, "a", reservation.token), prefill.backing, peer)
    np.testing.assert_array_equal(allocation(decode), expected_after(prefill, decode, before, [(0, 2)]))
    await decode.close()
    with pytest.raises(TransportError, match="not on this loopback network"):
        await transport.write(_for(into_a, "a", reservation.token), prefill.backing, peer)
