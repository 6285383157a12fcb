"""Failure notices, agent to agent in one process (no Ray): a push that fails tells the decode
side at once, naming the incarnation it planned against; a layer-wise request whose layer failed
refuses its later layers (the decode side may already have freed the blocks); and a notice
never reaches a newer incarnation of the engine that has the same request id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from agent_pair import agent_pair

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import BlockIdError, PlanError, WriteFailedError
from kvray.layout import BlockOrder, mixed
from kvray.wire import Role

LAYOUT = mixed(8, BlockOrder.LAYER_MAJOR)


@pytest_asyncio.fixture(loop_scope="function")
async def agents(tmp_path: Path) -> AsyncIterator[tuple[KVAgent, KVAgent, Settings]]:
    settings = Settings(shm_dir=str(tmp_path), transport="shm", notify_timeout_s=5.0)
    async with agent_pair("notice", LAYOUT, settings) as (prefill, decode):
        yield prefill, decode, settings


def _allocation(agent: KVAgent) -> np.ndarray:
    allocation = agent.backing.regions[0].allocation
    assert allocation is not None
    return allocation.numpy()


async def test_failed_layer_refuses_later_layers_and_tells_the_decode_side(
    agents: tuple[KVAgent, KVAgent, Settings], figures: Callable[[str], None]
) -> None:
    prefill, decode, _ = agents
    first, second, third = LAYOUT.layer_names[:3]
    reservation = decode.expect("r", [2, 3])
    waiting = asyncio.ensure_future(decode.wait_for_kv("r", timeout=30.0))
    await prefill.push_layer(reservation, first, [0, 1])
    with pytest.raises(BlockIdError):
        await prefill.push_layer(reservation, second, [1, 1])
    # The decode side learns now, not at its 30 s deadline.
    with pytest.raises(WriteFailedError, match="r"):
        await asyncio.wait_for(waiting, 10.0)
    before = _allocation(decode).copy()
    with pytest.raises(PlanError, match="already failed"):
        await prefill.push_layer(reservation, third, [0, 1])
    assert np.array_equal(before, _allocation(decode)), "a layer of a failed request was written"
    with pytest.raises(WriteFailedError):
        await prefill.finish("r")
    # After finish (or abort) here and release there, the request id is free again.
    await decode.release("r")
    reservation = decode.expect("r", [5], [first])
    await prefill.push_layer(reservation, first, [0])
    await prefill.finish("r")
    completion = await decode.wait_for_kv("r", timeout=10.0)
    assert completion.nbytes == LAYOUT.layer(first).geometry.block_nbytes
    figures(
        "[kvray notices] layer-wise request with a failed layer: decode told at once "
        f"(failure notices sent {prefill.stats['failure_notices_sent']}), later layers refused, "
        "0 bytes written after the failure"
    )


async def test_a_failure_notice_never_reaches_a_newer_incarnation(
    agents: tuple[KVAgent, KVAgent, Settings],
) -> None:
    prefill, old, settings = agents
    # The old life reserved the request's blocks, then ended.
    old_reservation = old.expect("r", [4])
    await old.release("r")
    await old.close()
    new = KVAgent("notice-d", Role.DECODE, LAYOUT, settings=settings, use_coordinator=False)
    await new.start()
    try:
        prefill.add_peer(new.info)  # the directory now names the new life
        reservation = new.expect("r", [4])
        assert reservation.incarnation != old_reservation.incarnation
        waiting = asyncio.ensure_future(new.wait_for_kv("r", timeout=30.0))
        await prefill.abort(old_reservation, "blocks of the old life")
        assert prefill.stats["failure_notices_stale"] == 1
        await prefill.push(reservation, [1])
        completion = await asyncio.wait_for(waiting, 10.0)
        assert completion.request_id == "r"
        assert new.stats["completions_failed"] == 0
    finally:
        await new.close()


async def test_releasing_a_request_fails_its_wait_with_a_kvray_error(tmp_path: Path) -> None:
    """A router that gives up on a request releases its blocks while `wait` is pending: the wait
    ends with a kvray error, and the blocks are freed once."""
    from kvray.errors import KvrayError
    from kvray.workers import DecodeWorker

    worker = DecodeWorker("notice-release", LAYOUT, Settings(shm_dir=str(tmp_path)))
    await worker.start()
    try:
        await worker.reserve("r", 3)
        waiting = asyncio.ensure_future(worker.wait("r", 30.0))
        await asyncio.sleep(0)
        await worker.release("r")
        with pytest.raises(KvrayError, match="cancelled"):
            await asyncio.wait_for(waiting, 10.0)
        assert worker.pool.free_count == LAYOUT.num_blocks
    finally:
        await worker.close()
