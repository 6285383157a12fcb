"""The parts of GPU staging for the `ray` transport that need no GPU (`kvray.transport.cuda_staging`):
how a plan's ops are cut into chunks, the writer's double buffering (chunk k submitted while chunk
k+1's copy runs, no buffer reused while its copy may run, nothing submitted after a failure or a
cancellation, which waits for the queued copies), and when a pinned slot is handed out again."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.plan import OpTable
from kvray.transport import cuda_staging
from kvray.transport.cuda_staging import (
    PinnedSlot,
    PinnedSlots,
    chunk_nbytes,
    chunk_ops,
    packed_offsets,
    send_in_order,
)


def table(nbytes: Sequence[int], *, regions: Sequence[int] | None = None) -> OpTable:
    sizes = np.asarray(nbytes, dtype=np.int64)
    starts = packed_offsets(sizes) * 3  # sparse, in order
    local_region = np.asarray(regions if regions is not None else [0] * sizes.size, dtype=np.int64)
    return OpTable(local_region, starts, local_region[::-1].copy(), starts + 7, sizes)


def concatenated(chunks: Sequence[OpTable]) -> OpTable:
    return OpTable(*(np.concatenate([getattr(c, f) for c in chunks]) for f in OpTable.__dataclass_fields__))


def bytes_named(ops: OpTable) -> list[tuple[int, int, int, int]]:
    """Every (local region, local byte, remote region, remote byte) the ops name, in order."""
    named = []
    for local_region, local_offset, remote_region, remote_offset, count in ops.rows():
        named += [(local_region, local_offset + i, remote_region, remote_offset + i) for i in range(count)]
    return named


# ---- chunks ----------------------------------------------------------------------------------------


def test_a_chunk_is_a_layer_within_bounds() -> None:
    layer = 5 * cuda_staging.MIN_CHUNK_NBYTES
    assert chunk_nbytes(61 * layer, 61) == layer
    assert chunk_nbytes(1000, 1) == cuda_staging.MIN_CHUNK_NBYTES
    assert chunk_nbytes(2**40, 2) == cuda_staging.MAX_CHUNK_NBYTES
    assert chunk_nbytes(0, 0) == cuda_staging.MIN_CHUNK_NBYTES


@pytest.mark.parametrize("ops_per_layer", [1, 3, 64])
def test_equal_layers_are_cut_at_their_boundaries(ops_per_layer: int) -> None:
    layers, op_nbytes = 7, 4096
    ops = table([op_nbytes] * (layers * ops_per_layer))
    chunks = chunk_ops(ops, ops_per_layer * op_nbytes)
    assert [len(chunk) for chunk in chunks] == [ops_per_layer] * layers


def test_a_long_op_is_split_and_a_short_plan_is_one_chunk() -> None:
    chunks = chunk_ops(table([10, 100, 10]), 40)
    assert [chunk.nbytes.tolist() for chunk in chunks] == [[10], [40], [40, 20, 10]]
    assert chunks[1].local_offset[0] + 40 == chunks[2].local_offset[0]
    assert chunks[1].remote_offset[0] + 40 == chunks[2].remote_offset[0]
    assert len(chunk_ops(table([10, 20]), 1 << 20)) == 1
    assert chunk_ops(table([]), 40) == []
    with pytest.raises(ValueError, match="positive"):
        chunk_ops(table([10]), 0)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    regions=st.data(),
    size=st.integers(1, 500),
)
def test_chunks_name_every_byte_once_in_order_and_are_bounded(
    sizes: list[int], regions: st.DataObject, size: int
) -> None:
    """Concatenated, the chunks name exactly the plan's bytes, in its order, with the same
    regions; no chunk is empty; every chunk holds less than twice `size` bytes."""
    region_ids = regions.draw(st.lists(st.integers(0, 2), min_size=len(sizes), max_size=len(sizes)))
    ops = table(sizes, regions=region_ids)
    chunks = chunk_ops(ops, size)
    assert all(len(chunk) > 0 for chunk in chunks)
    assert all(chunk.total_nbytes < 2 * size for chunk in chunks)
    assert all(int(chunk.nbytes.max()) <= size for chunk in chunks)
    assert bytes_named(concatenated(chunks)) == bytes_named(ops)


# ---- the writer's double buffering -------------------------------------------------------------


@dataclass(eq=False)
class FakeGather:
    index: int
    data: np.ndarray
    over: bool = False


@dataclass
class FakeGathers:
    """Gathers on the CPU whose copies are over once `wait` has seen them (after one loop turn),
    or when the test opens `hold[index]`. Records what happened in `log`."""

    source: np.ndarray
    hold: dict[int, asyncio.Event] = field(default_factory=dict)
    fail_start_at: int | None = None
    log: list[tuple[str, int]] = field(default_factory=list)
    started: list[FakeGather] = field(default_factory=list)
    queued_at_most: int = 0

    def start(self, chunk: OpTable) -> FakeGather:
        index = len(self.started)
        if index == self.fail_start_at:
            raise RuntimeError(f"start {index} failed")
        data = np.concatenate(
            [
                self.source[offset : offset + count]
                for offset, count in zip(chunk.local_offset, chunk.nbytes, strict=True)
            ]
        )
        gather = FakeGather(index, data)
        self.started.append(gather)
        self.log.append(("start", index))
        queued = sum(1 for g in self.started if ("release", g.index) not in self.log)
        self.queued_at_most = max(self.queued_at_most, queued)
        return gather

    async def wait(self, gathers: Sequence[FakeGather]) -> None:
        self.log.append(("wait", len(gathers)))
        try:
            for gather in gathers:
                if gather.index in self.hold and not gather.over:
                    await self.hold[gather.index].wait()
                await asyncio.sleep(0)
                gather.over = True
        except asyncio.CancelledError:
            for gather in gathers:  # a copy cannot be stopped: it ends, then the cancel goes on
                gather.over = True
            raise

    def payload(self, gather: FakeGather) -> np.ndarray:
        assert gather.over, "a payload was read before its copy was over"
        return gather.data

    def release(self, gather: FakeGather) -> None:
        assert gather.over, f"buffer {gather.index} was given back while its copy may run"
        assert ("release", gather.index) not in self.log, f"buffer {gather.index} given back twice"
        self.log.append(("release", gather.index))


def _plan(count: int, op_nbytes: int = 16) -> tuple[np.ndarray, list[OpTable]]:
    source = np.arange(count * op_nbytes * 3, dtype=np.int64).astype(np.uint8)
    ops = table([op_nbytes] * count)
    return source, chunk_ops(ops, op_nbytes)


async def test_every_chunk_is_submitted_in_order_while_the_next_copy_runs() -> None:
    source, chunks = _plan(6)
    gathers = FakeGathers(source)
    submitted: list[tuple[int, bytes]] = []

    def submit(chunk: OpTable, payload: np.ndarray) -> None:
        submitted.append((int(chunk.local_offset[0]), payload.tobytes()))
        gathers.log.append(("submit", len(submitted) - 1))

    await send_in_order(chunks, gathers, submit)

    expected = [
        (int(c.local_offset[0]), source[c.local_offset[0] : c.local_offset[0] + 16].tobytes()) for c in chunks
    ]
    assert submitted == expected
    log = gathers.log
    for k in range(len(chunks) - 1):
        assert log.index(("start", k + 1)) < log.index(("submit", k)), (
            "no copy ran while a chunk was submitted"
        )
    for k in range(len(chunks)):
        assert log.index(("submit", k)) < log.index(("release", k))
    assert gathers.queued_at_most == 2


async def test_a_cancelled_write_submits_nothing_more_and_outlasts_its_copies() -> None:
    source, chunks = _plan(6)
    gathers = FakeGathers(source, hold={2: asyncio.Event()})
    submitted: list[int] = []
    sending = asyncio.ensure_future(
        send_in_order(chunks, gathers, lambda c, p: submitted.append(len(submitted)))
    )
    for _ in range(50):
        await asyncio.sleep(0)
    assert submitted == [0, 1]
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sending
    assert submitted == [0, 1]
    # Chunks 2 and 3 were queued: both waited for before the cancel went on, both given back.
    assert all(gather.over for gather in gathers.started)
    assert sorted(i for what, i in gathers.log if what == "release") == [0, 1, 2, 3]
    assert len(gathers.started) == 4


async def test_a_failed_submit_stops_the_write_after_its_copies() -> None:
    source, chunks = _plan(5)
    gathers = FakeGathers(source)

    def submit(chunk: OpTable, payload: np.ndarray) -> None:
        if chunk.local_offset[0] == chunks[1].local_offset[0]:
            raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError, match="peer gone"):
        await send_in_order(chunks, gathers, submit)
    assert all(gather.over for gather in gathers.started)
    assert sorted(i for what, i in gathers.log if what == "release") == [0, 1, 2]


async def test_a_failed_start_waits_for_the_copies_already_queued() -> None:
    source, chunks = _plan(5)
    gathers = FakeGathers(source, fail_start_at=3)
    submitted: list[int] = []
    with pytest.raises(RuntimeError, match="start 3 failed"):
        await send_in_order(chunks, gathers, lambda c, p: submitted.append(1))
    assert len(submitted) == 2  # chunk 3 was to be queued after chunk 1's submit
    assert all(gather.over for gather in gathers.started)
    assert sorted(i for what, i in gathers.log if what == "release") == [0, 1, 2]


# ---- pinned slots ------------------------------------------------------------------------------


class _Event:
    def __init__(self) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done


class CpuSlots(PinnedSlots):
    """Slots in plain CPU memory with a settable event (the pool's rules need no GPU)."""

    def _new(self, capacity: int, device: torch.device) -> PinnedSlot:
        return PinnedSlot(torch.empty(capacity, dtype=torch.uint8), None, _Event())  # type: ignore[arg-type]

    def _new_staging(self, capacity: int, device: torch.device) -> torch.Tensor:
        return torch.empty(capacity, dtype=torch.uint8)


GPU = torch.device("cuda", 0)


def test_a_slot_is_reused_only_once_its_copy_is_over() -> None:
    slots = CpuSlots()
    first = slots.take(1000, GPU, staged=False)
    assert first.capacity == cuda_staging.MIN_SLOT_NBYTES
    first.used.done = False  # type: ignore[attr-defined]  # a copy into it is queued
    slots.give_back(first, GPU)
    second = slots.take(1000, GPU, staged=False)
    assert second is not first
    first.used.done = True  # type: ignore[attr-defined]
    slots.give_back(second, GPU)
    assert slots.take(1000, GPU, staged=False) in (first, second)


def test_slots_are_per_gpu_sized_in_powers_of_two_and_staged_on_demand() -> None:
    slots = CpuSlots(keep=2)
    big = slots.take(3 * cuda_staging.MIN_SLOT_NBYTES, GPU, staged=False)
    assert big.capacity == 4 * cuda_staging.MIN_SLOT_NBYTES and big.device is None
    slots.give_back(big, GPU)
    assert slots.take(10, torch.device("cuda", 1), staged=False) is not big
    again = slots.take(10, GPU, staged=True)
    assert again is big and again.device is not None and again.device.numel() == again.capacity
    for _ in range(3):
        slots.give_back(slots.take(10, GPU, staged=False), GPU)
    slots.give_back(CpuSlots()._new(1 << 20, GPU), GPU)
    slots.give_back(CpuSlots()._new(1 << 20, GPU), GPU)
    slots.give_back(CpuSlots()._new(1 << 20, GPU), GPU)
    assert len(slots._free[GPU]) == 2
