"""The transport contract: what every transport guarantees, run against each one kvray builds.

A write puts exactly the planned blocks' bytes into the peer's region and touches nothing else
(invariants 1 and 2); layers of one geometry land at their own addresses (invariant 3, the seed
bug); a plan that leaves a region is refused before a byte moves; a restarted peer receives
nothing meant for its old life (invariant 4); and a write that returns or is cancelled has no
copy still running behind it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from kvray.errors import BoundsError, KvrayError, RegionError, StaleIncarnationError, TransportError
from kvray.layout import READY_LAYOUTS, BlockOrder, Geometry, KVLayout, LayerSpec
from kvray.memory import TORCH_DTYPES, Backing, MemoryKind
from kvray.placement import Stored, ranges_digest
from kvray.plan import OffsetCache, OpTable, TransferPlan
from kvray.transport import cpu_copy
from kvray.wire import TransportKind

if TYPE_CHECKING:
    from conftest import CopyGuard, Engine, GatedCopies, TransportUnderTest

#: Ready layouts at a small pool size (DeepSeek-V3 at 16 blocks is already ~69 MiB).
NUM_BLOCKS = {"deepseek-v3": 16, "llama": 16, "mixed": 32}

LAYOUT_PARAMS = [
    pytest.param(name, order, id=f"{name}-{order.value}") for name in READY_LAYOUTS for order in BlockOrder
]


def ready_layout(name: str, order: BlockOrder) -> KVLayout:
    return READY_LAYOUTS[name](num_blocks=NUM_BLOCKS[name], block_order=order)


def with_ops(plan: TransferPlan, **columns: np.ndarray) -> TransferPlan:
    """`plan` with some op columns replaced (a plan no planner would make)."""
    ops = plan.ops
    fields = {name: getattr(ops, name).copy() for name in (f.name for f in dataclasses.fields(OpTable))}
    fields.update(columns)
    tampered = TransferPlan.from_ops(
        plan.src_engine,
        plan.src_incarnation,
        plan.dst_engine,
        plan.dst_incarnation,
        plan.layers,
        OpTable(**fields),
        plan.unmerged,
        plan.layer_starts,
    )
    return dataclasses.replace(tampered, request_id=plan.request_id, token=plan.token)


# ---- 1. bytes land where planned, and nowhere else ----------------------------------------------


@pytest.mark.parametrize("pattern", ["scattered", "runs"])
@pytest.mark.parametrize(("layout_name", "order"), LAYOUT_PARAMS)
async def test_planned_blocks_land_and_nothing_else_changes(
    tut: TransportUnderTest, layout_name: str, order: BlockOrder, pattern: str
) -> None:
    layout = ready_layout(layout_name, order)
    source = tut.source(layout)
    destination = tut.destination(layout)
    num_blocks = layout.num_blocks
    if pattern == "scattered":
        local, remote = tut.scattered(num_blocks, num_blocks // 2)
    else:  # long contiguous runs on both sides: few, large merged ops
        count = num_blocks - 3
        local, remote = np.arange(1, 1 + count), np.arange(3, 3 + count)
    plan = tut.plan(source, destination, local, remote)
    source_before = tut.snapshot(source)
    before = tut.snapshot(destination)

    await tut.write(plan, source, destination)

    tut.assert_landed(plan, source, destination, before, local, remote)
    tut.assert_unchanged(source, source_before, "source")


async def test_repeated_writes_overwrite_only_their_blocks(tut: TransportUnderTest) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = tut.source(layout)
    destination = tut.destination(layout)
    for _ in range(3):
        local, remote = tut.scattered(layout.num_blocks, 5)
        plan = tut.plan(source, destination, local, remote)
        before = tut.snapshot(destination)
        await tut.write(plan, source, destination)
        tut.assert_landed(plan, source, destination, before, local, remote)
        # New source bytes for the next round, so a stale copy would show.
        tut.refill(source)


# ---- 2. a subset of layers, two of one geometry (the seed bug) ----------------------------------


def first_pair_of_one_geometry(layout: KVLayout) -> tuple[str, str]:
    for first, second in zip(layout.layers, layout.layers[1:], strict=False):
        if first.geometry == second.geometry:
            return first.name, second.name
    for index, first in enumerate(layout.layers):
        for second in layout.layers[index + 1 :]:
            if first.geometry == second.geometry:
                return first.name, second.name
    raise AssertionError("layout has no two layers of one geometry")


@pytest.mark.parametrize(("layout_name", "order"), LAYOUT_PARAMS)
async def test_two_layers_of_one_geometry_land_at_their_own_addresses(
    tut: TransportUnderTest, layout_name: str, order: BlockOrder
) -> None:
    layout = ready_layout(layout_name, order)
    pair = first_pair_of_one_geometry(layout)
    if layout_name == "mixed":  # its first MLA pair has a split K/V layer between them
        assert layout.layer_names.index(pair[1]) - layout.layer_names.index(pair[0]) == 2
    source = tut.source(layout)
    destination = tut.destination(layout)
    local, remote = tut.scattered(layout.num_blocks, 4)
    cache = OffsetCache()
    # A full plan first fills the offset cache, as an agent's earlier pushes would.
    tut.plan(source, destination, local, remote, cache=cache)
    plan = tut.plan(source, destination, local, remote, layers=list(pair), cache=cache)
    assert plan.layers == pair
    before = tut.snapshot(destination)

    await tut.write(plan, source, destination)

    # Each layer holds its OWN source bytes (the two sources differ), every other layer is untouched.
    tut.assert_landed(plan, source, destination, before, local, remote)
    first, second = (destination.backing.view(name) for name in pair)
    assert not torch.equal(first.view(torch.uint8), second.view(torch.uint8))


# ---- 3. large batches: the threaded copy path -----------------------------------------------------


async def test_large_scattered_batch_splits_ops_across_threads(
    tut: TransportUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = 3  # shares of an odd byte count: cuts fall inside ops
    monkeypatch.setattr(cpu_copy, "copy_threads", lambda: threads)
    geometry = Geometry(block_size=16, entry_shape=(1000,), dtype="uint8")  # 16000-byte blocks
    layout = KVLayout(layers=(LayerSpec(name="kv", geometry=geometry),), num_blocks=2048)
    source = tut.source(layout)
    destination = tut.destination(layout)
    local, remote = tut.scattered(layout.num_blocks, 1024)
    plan = tut.plan(source, destination, local, remote)
    total = plan.nbytes
    assert total > cpu_copy._PARALLEL_THRESHOLD and len(plan.ops) > 500
    share_cuts = [total * k // threads for k in range(1, threads)]
    assert any(cut % geometry.block_nbytes for cut in share_cuts), "no share boundary falls inside an op"
    before = tut.snapshot(destination)

    await tut.write(plan, source, destination)

    tut.assert_landed(plan, source, destination, before, local, remote)


async def test_one_huge_contiguous_op(tut: TransportUnderTest) -> None:
    geometry = Geometry(block_size=16, entry_shape=(1024,), dtype="uint8")
    layout = KVLayout(
        layers=(LayerSpec(name="a", geometry=geometry), LayerSpec(name="b", geometry=geometry)),
        num_blocks=300,
        block_order=BlockOrder.BLOCK_MAJOR,
    )
    source = tut.source(layout)
    destination = tut.destination(layout)
    blocks = np.arange(10, 290)
    plan = tut.plan(source, destination, blocks, blocks)
    assert len(plan.ops) == 1 and plan.nbytes > cpu_copy._PARALLEL_THRESHOLD
    before = tut.snapshot(destination)

    await tut.write(plan, source, destination)

    tut.assert_landed(plan, source, destination, before, blocks, blocks)


# ---- several regions (caller-owned per-layer tensors) and concurrent writes ------------------------


def adopted_backing(layout: KVLayout, alignment: int = 4096) -> Backing:
    """Per-layer tensors the caller owns, each padded so its aligned region stays in its storage."""
    tensors = {}
    for spec in layout.layers:
        nbytes = layout.layer_nbytes(spec.name)
        storage = torch.empty(nbytes + 2 * alignment, dtype=torch.uint8)
        start = (-storage.data_ptr()) % alignment + 64  # deliberately not page-aligned
        flat = storage[start : start + nbytes].view(TORCH_DTYPES[spec.geometry.dtype])
        tensors[spec.name] = flat.view(layout.tensor_shape(spec.name))
    return Backing.adopt(layout, tensors, alignment=alignment)


@pytest.mark.parametrize("adopt_destination", [False, True], ids=["shared-dst", "per-layer-dst"])
async def test_per_layer_source_regions(tut: TransportUnderTest, adopt_destination: bool) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    if adopt_destination and MemoryKind.CPU not in tut.transport.destination_kinds:
        pytest.skip(
            f"{tut.kind.value} writes only into {sorted(k.value for k in tut.transport.destination_kinds)}"
        )
    source = tut.source(layout, backing=adopted_backing(layout))
    assert len(source.backing.regions) == len(layout.layers)
    destination = tut.destination(layout, backing=adopted_backing(layout) if adopt_destination else None)
    local, remote = tut.scattered(layout.num_blocks, 7)
    plan = tut.plan(source, destination, local, remote)
    before = tut.snapshot(destination)

    await tut.write(plan, source, destination)

    tut.assert_landed(plan, source, destination, before, local, remote)


async def test_concurrent_writes_to_one_peer(
    tut: TransportUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_copy, "_PARALLEL_THRESHOLD", 64 * 1024)  # both writes take the threaded path
    layout = ready_layout("mixed", BlockOrder.BLOCK_MAJOR)
    source = tut.source(layout)
    destination = tut.destination(layout)
    order = tut.rng.permutation(layout.num_blocks)
    remote_halves = order[:12], order[12:24]
    local_halves = tut.rng.permutation(layout.num_blocks)[:12], tut.rng.permutation(layout.num_blocks)[:12]
    plans = [
        tut.plan(source, destination, lo, re) for lo, re in zip(local_halves, remote_halves, strict=True)
    ]
    before = tut.snapshot(destination)

    await asyncio.gather(*(tut.write(plan, source, destination) for plan in plans))

    first = plans[0]
    both = TransferPlan.from_ops(
        first.src_engine,
        first.src_incarnation,
        first.dst_engine,
        first.dst_incarnation,
        first.layers,
        OpTable(
            *(np.concatenate([getattr(p.ops, f.name) for p in plans]) for f in dataclasses.fields(OpTable))
        ),
        OpTable(
            *(
                np.concatenate([getattr(p.unmerged, f.name) for p in plans])
                for f in dataclasses.fields(OpTable)
            )
        ),
        first.layer_starts,
    )
    tut.assert_landed(
        both, source, destination, before, np.concatenate(local_halves), np.concatenate(remote_halves)
    )


# ---- 4a. plans that leave a region are refused before a byte moves --------------------------------


def _end_past_region(plan: TransferPlan, destination: Engine, source: Engine) -> dict[str, np.ndarray]:
    # One byte past the region's end: without the check it lands in the allocation's slack.
    remote_offset = plan.ops.remote_offset.copy()
    remote_offset[-1] = destination.info.regions[0].length - plan.ops.nbytes[-1] + 1
    return {"remote_offset": remote_offset}


def _negative_offset(plan: TransferPlan, destination: Engine, source: Engine) -> dict[str, np.ndarray]:
    remote_offset = plan.ops.remote_offset.copy()
    remote_offset[0] = -64
    return {"remote_offset": remote_offset}


def _offset_overflow(plan: TransferPlan, destination: Engine, source: Engine) -> dict[str, np.ndarray]:
    # offset + nbytes wraps around int64 to a negative number, which is "not past the end".
    remote_offset = plan.ops.remote_offset.copy()
    remote_offset[0] = 2**63 - 8
    return {"remote_offset": remote_offset}


def _negative_nbytes(plan: TransferPlan, destination: Engine, source: Engine) -> dict[str, np.ndarray]:
    nbytes = plan.ops.nbytes.copy()
    nbytes[0] = -nbytes[0]
    return {"nbytes": nbytes}


def _region_past_last(plan: TransferPlan, destination: Engine, source: Engine) -> dict[str, np.ndarray]:
    remote_region = plan.ops.remote_region.copy()
    remote_region[0] = len(destination.info.regions)
    return {"remote_region": remote_region}


def _region_negative(plan: TransferPlan, destination: Engine, source: Engine) -> dict[str, np.ndarray]:
    # Python would read regions[-1] as the last region: the write must not land there.
    remote_region = plan.ops.remote_region.copy()
    remote_region[0] = -1
    return {"remote_region": remote_region}


def _local_past_region(plan: TransferPlan, destination: Engine, source: Engine) -> dict[str, np.ndarray]:
    # Reads a few bytes past the end of the local region, still inside the local allocation (safe
    # to run): without a check those bytes of the sender's memory would reach the peer.
    region = source.backing.regions[0]
    trailing_slack = region.span.alloc_nbytes - region.span.offset_in_allocation - region.nbytes
    assert trailing_slack >= 8
    local_offset = plan.ops.local_offset.copy()
    local_offset[-1] = region.nbytes - plan.ops.nbytes[-1] + 8
    return {"local_offset": local_offset}


TAMPERS: dict[str, Callable[[TransferPlan, Engine, Engine], dict[str, np.ndarray]]] = {
    "end-past-region": _end_past_region,
    "negative-offset": _negative_offset,
    "offset-overflow": _offset_overflow,
    "negative-nbytes": _negative_nbytes,
    "region-past-last": _region_past_last,
    "region-negative": _region_negative,
    "local-past-region": _local_past_region,
}

#: Known kvray bugs: transports that do not refuse these plans with a BoundsError.


@pytest.mark.parametrize("tamper", list(TAMPERS))
async def test_plan_leaving_a_region_is_refused_and_writes_nothing(
    tut: TransportUnderTest, tamper: str, request: pytest.FixtureRequest, guard: CopyGuard
) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = tut.source(layout)
    destination = tut.destination(layout)
    local, remote = tut.scattered(layout.num_blocks, 6)
    plan = tut.plan(source, destination, local, remote)
    bad_plan = with_ops(plan, **TAMPERS[tamper](plan, destination, source))
    before = tut.snapshot(destination)
    source_before = tut.snapshot(source)

    with pytest.raises(BoundsError):
        await tut.write(bad_plan, source, destination)

    tut.assert_unchanged(destination, before)
    tut.assert_unchanged(source, source_before, "source")


async def test_block_ids_changed_after_planning_are_checked_again(
    tut: TransportUnderTest, guard: CopyGuard
) -> None:
    # Planning checked the ids it was given; ids changed since (here one past every region) are
    # no longer those, and the writer checks them itself.
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = tut.source(layout)
    destination = tut.destination(layout)
    local, remote = tut.scattered(layout.num_blocks, 6)
    plan = tut.plan(source, destination, local, remote)
    assert plan.rows is not None and plan.rows.checked is not None
    plan.rows.remote_ids[-1] = layout.num_blocks * 64
    before = tut.snapshot(destination)
    source_before = tut.snapshot(source)

    with pytest.raises(BoundsError):
        await tut.write(plan, source, destination)

    tut.assert_unchanged(destination, before)
    tut.assert_unchanged(source, source_before, "source")


# ---- 5. least privilege -----------------------------------------------------------------------------


async def test_region_not_remotely_writable_is_refused(
    tut: TransportUnderTest, request: pytest.FixtureRequest
) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = tut.source(layout)
    destination = tut.destination(layout, remote_writable=False)
    local, remote = tut.scattered(layout.num_blocks, 3)
    plan = tut.plan(source, destination, local, remote)
    before = tut.snapshot(destination)

    with pytest.raises(RegionError):
        await tut.write(plan, source, destination)

    tut.assert_unchanged(destination, before)


# ---- 6. incarnations --------------------------------------------------------------------------------


@pytest.mark.parametrize("forget_first", [False, True], ids=["republished", "forgotten"])
async def test_restarted_peer_gets_writes_in_its_new_backing(
    tut: TransportUnderTest, forget_first: bool
) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = tut.source(layout)
    old = tut.destination(layout, engine_id="decode-0")
    local, remote = tut.scattered(layout.num_blocks, 5)
    await tut.write(tut.plan(source, old, local, remote), source, old)
    old_after_first_write = tut.snapshot(old)

    new = tut.destination(layout, engine_id="decode-0")  # same engine, new memory, new incarnation
    assert new.incarnation != old.incarnation
    if forget_first:
        tut.transport.forget("decode-0")
    tut.refill(source)
    plan = tut.plan(source, new, local, remote)
    before = tut.snapshot(new)

    await tut.write(plan, source, new)

    tut.assert_landed(plan, source, new, before, local, remote)
    tut.assert_unchanged(old, old_after_first_write, "old incarnation's backing")


async def test_plan_for_an_old_incarnation_is_refused(
    tut: TransportUnderTest, request: pytest.FixtureRequest
) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = tut.source(layout)
    old = tut.destination(layout, engine_id="decode-0")
    local, remote = tut.scattered(layout.num_blocks, 5)
    stale_plan = tut.plan(source, old, local, remote)
    new = tut.destination(layout, engine_id="decode-0")
    old_before, new_before = tut.snapshot(old), tut.snapshot(new)

    with pytest.raises(StaleIncarnationError):
        await tut.write(stale_plan, source, new)

    tut.assert_unchanged(new, new_before, "new incarnation's backing")
    tut.assert_unchanged(old, old_before, "old incarnation's backing")


async def test_stale_peer_info_never_reaches_the_new_incarnation(tut: TransportUnderTest) -> None:
    """The writer still holds the old EngineInfo; the peer restarted and freed its old memory."""
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = tut.source(layout)
    old = tut.destination(layout, engine_id="decode-0")
    old.backing.close()  # the old life's shared-memory file is gone
    new = tut.destination(layout, engine_id="decode-0")
    local, remote = tut.scattered(layout.num_blocks, 5)
    stale_plan = tut.plan(source, old, local, remote)
    # The old info, but whatever now answers for the engine is the new incarnation.
    peer = tut.peer(new, info=old.info)
    new_before = tut.snapshot(new)

    with pytest.raises(KvrayError) as raised:
        await tut.transport.write(stale_plan, source.backing, peer)

    assert isinstance(raised.value, TransportError | StaleIncarnationError)
    tut.assert_unchanged(new, new_before, "new incarnation's backing")


# ---- a write that returns, fails or is cancelled has no copy left running ------------------------------


async def test_cancelled_write_leaves_no_copy_running(
    tut: TransportUnderTest, gated: GatedCopies, request: pytest.FixtureRequest
) -> None:
    if not tut.in_process_copies:
        pytest.skip(f"{tut.kind.value}: the device moves the bytes, there is no copy in this process to hold")
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = tut.source(layout)
    destination = tut.destination(layout)
    local, remote = tut.scattered(layout.num_blocks, 8)
    plan = tut.plan(source, destination, local, remote)

    task = asyncio.create_task(tut.write(plan, source, destination))
    gated.write_task = task
    assert await asyncio.to_thread(gated.entered.wait, 10)
    task.cancel()
    asyncio.get_running_loop().call_later(0.2, gated.gate.set)
    with pytest.raises(asyncio.CancelledError):
        await task
    await gated.drained()

    assert gated.late == [], (
        f"{len(gated.late)} copies ({sum(gated.late)} bytes) ran after write() was cancelled"
    )


# ---- write_then: the hook runs once, after the last byte ----------------------------------------


@pytest.mark.parametrize("size", ["small", "threaded"])
async def test_write_then_calls_its_hook_once_after_the_last_byte(tut: TransportUnderTest, size: str) -> None:
    """`then` (the agent's early completion notice) runs exactly once, and only when every
    planned byte is in the peer's memory: at that moment the destination already reads as it
    does once the write has returned."""
    if size == "small":
        layout = ready_layout("mixed", BlockOrder.BLOCK_MAJOR)
        count = 8
    else:  # above the size copied by pool threads, which call the hook themselves
        geometry = Geometry(block_size=16, entry_shape=(1024,), dtype="uint8")
        layout = KVLayout(layers=(LayerSpec(name="kv", geometry=geometry),), num_blocks=1024)
        count = 512
    source = tut.source(layout)
    destination = tut.destination(layout)
    local, remote = tut.scattered(layout.num_blocks, count)
    plan = tut.plan(source, destination, local, remote)
    if size == "threaded":
        assert plan.nbytes > cpu_copy._PARALLEL_THRESHOLD
    before = tut.snapshot(destination)
    seen: list[list[np.ndarray]] = []
    told: list[Stored] = []

    def then(stored: Stored) -> None:
        seen.append(tut.snapshot(destination))
        told.append(stored)

    stored = await tut.transport.write_then(plan, source.backing, tut.peer(destination), then)

    assert len(seen) == 1, f"the hook ran {len(seen)} times"
    # The hook is told what the write returns: the placement digest of the plan's ranges where
    # the writer's executor stores them (the ray transport's receiver reports its own instead).
    planned = ranges_digest(plan.ops.remote_region, plan.ops.remote_offset, plan.ops.nbytes)
    assert told == [stored] and stored.placement == (0 if tut.kind is TransportKind.RAY else planned)
    tut.assert_landed(plan, source, destination, before, local, remote)
    tut.assert_unchanged(destination, seen[0], "destination between the hook and the write's return")
