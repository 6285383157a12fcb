"""A writer lets go of peers that are gone: after the coordinator drops a decode engine (it
closed, died or restarted), the prefill agent's next heartbeat forgets it and unmaps its shared
memory; and no more than `max_cached_peers` peers stay mapped at once. A push into an engine
incarnation that left fails at once, and a push waiting for a peer's lookup holds no slot.

The coordinator runs in this process (its methods called the way an actor handle's are), so no
Ray is needed; the mappings are read from /proc/self/maps."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import torch
from process_probes import mappings_of, until

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.coordinator import Coordinator
from kvray.errors import ConfigError, UnknownEngineError
from kvray.layout import BlockOrder, mixed
from kvray.wire import Reservation, Role

LAYOUT = mixed(8, BlockOrder.LAYER_MAJOR)


class InProcess:
    """An object called the way a Ray actor handle is (`handle.method.remote(...)`, awaited)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> SimpleNamespace:
        method: Callable[..., Coroutine[Any, Any, Any]] = getattr(self._target, name)
        return SimpleNamespace(remote=method)


@pytest_asyncio.fixture(loop_scope="function")
async def directory(tmp_path: Path) -> AsyncIterator[tuple[InProcess, Settings]]:
    settings = Settings(
        shm_dir=str(tmp_path),
        transport="shm",
        heartbeat_s=0.05,
        lookup_timeout_s=2.0,
        notify_timeout_s=2.0,
        max_timeout_s=2.0,
        transfer_timeout_s=2.0,
        max_cached_peers=2,
    )
    yield InProcess(Coordinator()), settings


async def _push_into(prefill: KVAgent, decode: KVAgent, request_id: str) -> None:
    reservation = decode.expect(request_id, [1, 2])
    await prefill.push(reservation, [3, 4], timeout=2.0)
    await decode.wait_for_kv(request_id, timeout=2.0)
    await decode.release(request_id)


async def test_the_next_heartbeat_forgets_decode_engines_that_left(
    directory: tuple[InProcess, Settings],
) -> None:
    coordinator, settings = directory
    settings = msgspec.structs.replace(settings, max_cached_peers=8)
    prefill = KVAgent("dp-p", Role.PREFILL, LAYOUT, settings=settings, coordinator=coordinator)
    await prefill.start()
    decodes = [
        KVAgent(f"dp-d{i}", Role.DECODE, LAYOUT, settings=settings, coordinator=coordinator) for i in range(3)
    ]
    paths = []
    own = {}
    try:
        for index, decode in enumerate(decodes):
            await decode.start()
            path = decode.backing.regions[0].shm_path
            assert path is not None
            paths.append(path)
            own[path] = mappings_of(path)
            await _push_into(prefill, decode, f"r{index}")
            assert mappings_of(path) == own[path] + 1, "the prefill maps the decode engine's region"
        for decode in decodes:
            await decode.close()
        await until(
            lambda: all(mappings_of(path) <= own[path] for path in paths),
            "the prefill still maps departed decode engines' memory",
        )
        assert prefill.stats["directory_events_peer_departed"] == 3
        for decode in decodes:
            with pytest.raises(UnknownEngineError):
                await prefill.peer(decode.engine_id, wait_s=0.0)
    finally:
        for decode in decodes:
            await decode.close()
        await prefill.close()
    for path in paths:
        assert not os.path.exists(path)


async def test_a_restarted_peer_is_forgotten_and_the_new_life_looked_up(
    directory: tuple[InProcess, Settings],
) -> None:
    coordinator, settings = directory
    prefill = KVAgent("rs-p", Role.PREFILL, LAYOUT, settings=settings, coordinator=coordinator)
    old = KVAgent("rs-d", Role.DECODE, LAYOUT, settings=settings, coordinator=coordinator)
    new = KVAgent("rs-d", Role.DECODE, LAYOUT, settings=settings, coordinator=coordinator)
    await prefill.start()
    await old.start()
    try:
        await _push_into(prefill, old, "before")
        old_path = old.backing.regions[0].shm_path
        assert old_path is not None
        await old.close()
        await new.start()
        assert new.incarnation != old.incarnation
        await until(lambda: mappings_of(old_path) <= 1, "the old life's memory is still mapped")
        await _push_into(prefill, new, "after")
    finally:
        await new.close()
        await prefill.close()


def _block(agent: KVAgent, layer: str, block: int) -> Any:
    """One block of one layer (both parts of a split K/V layer), as bytes."""
    view = agent.backing.view(layer)
    picked = view[:, block] if agent.layout.layer(layer).geometry.parts == 2 else view[block]
    return picked.view(torch.uint8)


def _filled(agent: KVAgent, blocks: list[int], value: int) -> None:
    """Every byte of every layer 0xAB (a canary), but `blocks`' bytes `value`."""
    for layer in agent.layout.layer_names:
        agent.backing.view(layer).view(torch.uint8).fill_(0xAB)
        for block in blocks:
            _block(agent, layer, block).fill_(value)


def _blocks_hold(agent: KVAgent, value: int, blocks: list[int]) -> bool:
    """`blocks` hold `value` in every layer, and every other block still the canary."""
    return all(
        bool((_block(agent, layer, block) == (value if block in blocks else 0xAB)).all())
        for layer in agent.layout.layer_names
        for block in range(agent.layout.num_blocks)
    )


@contextlib.asynccontextmanager
async def _pair(
    name: str, directory: tuple[InProcess, Settings], **changes: Any
) -> AsyncIterator[tuple[KVAgent, KVAgent]]:
    """A prefill and a decode agent registered with the directory's coordinator, under its
    settings with `changes`, closed on the way out."""
    coordinator, settings = directory
    settings = msgspec.structs.replace(settings, **changes)
    prefill = KVAgent(f"{name}-p", Role.PREFILL, LAYOUT, settings=settings, coordinator=coordinator)
    decode = KVAgent(f"{name}-d", Role.DECODE, LAYOUT, settings=settings, coordinator=coordinator)
    await prefill.start()
    await decode.start()
    try:
        yield prefill, decode
    finally:
        await decode.close()
        await prefill.close()


async def test_a_push_into_an_engine_incarnation_that_left_fails_at_once(
    directory: tuple[InProcess, Settings],
) -> None:
    # The coordinator remembers the incarnation that left, so the writer does not wait
    # `lookup_timeout_s` for an engine that cannot come back (a restart is another incarnation).
    changes = {"lookup_timeout_s": 30.0, "max_timeout_s": 60.0, "transfer_timeout_s": 30.0}
    async with _pair("gone", directory, **changes) as (prefill, decode):
        reservation = decode.expect("r", [1, 2])
        await decode.close()
        async with asyncio.timeout(10):  # the test's own guard, far below the 30 s lookup wait
            with pytest.raises(UnknownEngineError, match="has left") as caught:
                await prefill.push(reservation, [3, 4])
        assert caught.value.facts["incarnation"] == reservation.incarnation
        # Never registered: still waited for (it may be starting), up to the lookup's wait.
        with pytest.raises(UnknownEngineError, match=r"waited 0\.2 s"):
            await prefill.peer("gone-never", wait_s=0.2)


async def test_a_push_waiting_for_a_lookup_holds_up_no_push_to_another_engine(
    directory: tuple[InProcess, Settings],
) -> None:
    # One slot: a push into an engine the coordinator does not list waits for its lookup
    # without the slot, while a push into a registered engine takes it and lands.
    changes = {"max_concurrent_transfers": 1, "max_timeout_s": 4.0, "transfer_timeout_s": 4.0}
    async with _pair("slot", directory, **changes) as (prefill, decode):
        unregistered = Reservation(
            request_id="q", engine_id="slot-later", incarnation=1, blocks=(1,), token=7
        )
        waiting = asyncio.create_task(prefill.push(unregistered, [0]))
        await asyncio.sleep(0.2)  # in its lookup, which waits up to 2 s
        assert not waiting.done()
        _filled(prefill, [3, 4], 0x5C)
        _filled(decode, [], 0)
        reservation = decode.expect("r", [1, 6])
        await prefill.push(reservation, [3, 4])
        await decode.wait_for_kv("r", timeout=2.0)
        assert not waiting.done(), "the push waited for the other one's lookup"
        assert _blocks_hold(decode, 0x5C, [1, 6])
        await decode.release("r")
        with pytest.raises(UnknownEngineError, match="not registered"):
            await waiting


async def test_no_more_than_max_cached_peers_stay_mapped(directory: tuple[InProcess, Settings]) -> None:
    coordinator, settings = directory
    assert settings.max_cached_peers == 2
    prefill = KVAgent("lru-p", Role.PREFILL, LAYOUT, settings=settings, coordinator=coordinator)
    decodes = [
        KVAgent(f"lru-d{i}", Role.DECODE, LAYOUT, settings=settings, coordinator=coordinator)
        for i in range(3)
    ]
    await prefill.start()
    try:
        own = []
        for decode in decodes:
            await decode.start()
            own.append(mappings_of(decode.backing.regions[0].shm_path or ""))
        paths = [decode.backing.regions[0].shm_path or "" for decode in decodes]
        await _push_into(prefill, decodes[0], "a")
        await _push_into(prefill, decodes[1], "b")
        assert [mappings_of(p) - o for p, o in zip(paths, own, strict=True)] == [1, 1, 0]
        await _push_into(prefill, decodes[0], "c")  # d0 is now the most recently used
        await _push_into(prefill, decodes[2], "d")  # evicts d1, the least recently used
        assert [mappings_of(p) - o for p, o in zip(paths, own, strict=True)] == [1, 0, 1]
        await _push_into(prefill, decodes[1], "e")  # looked up and mapped again
        assert [mappings_of(p) - o for p, o in zip(paths, own, strict=True)] == [0, 1, 1]
    finally:
        for decode in decodes:
            await decode.close()
        await prefill.close()


@pytest.mark.parametrize("wait_s", [math.nan, math.inf, -1.0, "1"], ids=repr)
async def test_a_lookup_refuses_a_bad_wait(directory: tuple[InProcess, Settings], wait_s: Any) -> None:
    coordinator, settings = directory
    prefill = KVAgent("lk-p", Role.PREFILL, LAYOUT, settings=settings, coordinator=coordinator)
    await prefill.start()
    try:
        async with asyncio.timeout(60):  # the test's own guard: an unchecked inf waits forever
            with pytest.raises(ConfigError, match="wait_s"):
                await prefill.peer("nobody", wait_s=wait_s)
    finally:
        await prefill.close()


async def test_a_huge_lookup_wait_is_clamped(directory: tuple[InProcess, Settings]) -> None:
    coordinator, settings = directory
    prefill = KVAgent("lk2-p", Role.PREFILL, LAYOUT, settings=settings, coordinator=coordinator)
    await prefill.start()
    try:
        async with asyncio.timeout(60):  # the test's own guard: unclamped, this waits forever
            with pytest.raises(UnknownEngineError) as caught:
                await prefill.peer("nobody", wait_s=1e12)
        assert caught.value.timeout_s == settings.max_timeout_s
    finally:
        await prefill.close()


# ---- without a coordinator (the vLLM connector's same-node engines) ---------------------------------


def _alone(settings: Settings, engine_id: str, role: Role) -> KVAgent:
    return KVAgent(engine_id, role, LAYOUT, settings=settings, use_coordinator=False)


async def _started_decodes(prefill: KVAgent, settings: Settings, count: int, prefix: str) -> list[KVAgent]:
    """`count` decode engines, started and wired into `prefill` by hand (no directory to ask)."""
    decodes = [_alone(settings, f"{prefix}{index}", Role.DECODE) for index in range(count)]
    for decode in decodes:
        await decode.start()
        prefill.add_peer(decode.info)
    return decodes


def _writer_mappings(decodes: list[KVAgent]) -> Callable[[], list[int]]:
    """How many mappings of each decode engine's file this process has beyond the engine's own
    (which last as long as its tensors, after it closed too): the writer's."""
    paths = [decode.backing.regions[0].shm_path or "" for decode in decodes]
    own = [mappings_of(path) for path in paths]
    return lambda: [mappings_of(path) - count for path, count in zip(paths, own, strict=True)]


async def test_without_a_coordinator_a_departed_peer_is_unmapped_at_the_next_push(
    directory: tuple[InProcess, Settings],
) -> None:
    """No heartbeat forgets a peer here, and the writer never pushes into a departed decode
    engine again: the next push into another engine lets go of its memory (an unlinked
    shared-memory file stays in RAM while anyone maps it), and so does a push into an engine
    already mapped once a heartbeat period has passed."""
    _, settings = directory
    settings = msgspec.structs.replace(settings, max_cached_peers=256, heartbeat_s=0.2)
    prefill = _alone(settings, "alone-p", Role.PREFILL)
    await prefill.start()
    decodes = await _started_decodes(prefill, settings, 4, "alone-d")
    writer_mappings = _writer_mappings(decodes)
    try:
        for index, decode in enumerate(decodes[:3]):
            await _push_into(prefill, decode, f"r{index}")
        assert writer_mappings() == [1, 1, 1, 0]
        await decodes[0].close()
        # Mapping a new peer is when a writer's memory grows: it lets go of the departed first.
        await _push_into(prefill, decodes[3], "r3")
        assert writer_mappings() == [0, 1, 1, 1]

        await decodes[1].close()
        await asyncio.sleep(settings.heartbeat_s)
        await _push_into(prefill, decodes[2], "r4")  # mapped already
        assert writer_mappings() == [0, 0, 1, 1]
    finally:
        for decode in decodes:
            await decode.close()
        await prefill.close()


async def test_a_writer_keeps_at_most_max_mapped_bytes_of_peers_mapped(
    directory: tuple[InProcess, Settings],
) -> None:
    """The bound is on bytes too, not only on engines: past `max_mapped_bytes` the least
    recently used engines' mappings go, never the one being written."""
    _, settings = directory
    decodes = [_alone(settings, f"bytes-d{index}", Role.DECODE) for index in range(3)]
    for decode in decodes:
        await decode.start()
    writer_mappings = _writer_mappings(decodes)
    region_nbytes = decodes[0].info.regions[0].length
    # Room for two engines' regions, not three.
    bound = region_nbytes * 2 + region_nbytes // 2
    bounded = msgspec.structs.replace(settings, max_cached_peers=256, max_mapped_bytes=bound)
    prefill = _alone(bounded, "bytes-p", Role.PREFILL)
    await prefill.start()
    for decode in decodes:
        prefill.add_peer(decode.info)
    try:
        await _push_into(prefill, decodes[0], "a")
        await _push_into(prefill, decodes[1], "b")
        assert writer_mappings() == [1, 1, 0]
        await _push_into(prefill, decodes[2], "c")  # over the bound: d0, the least recently used, goes
        assert writer_mappings() == [0, 1, 1]
        await _push_into(prefill, decodes[0], "d")  # mapped again; d1 goes
        assert writer_mappings() == [1, 0, 1]
    finally:
        for decode in decodes:
            await decode.close()
        await prefill.close()
