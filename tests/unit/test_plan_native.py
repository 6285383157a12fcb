"""The planner's C loops (`kvray._plan`) against their numpy twins in kvray/plan.py.

Both must give the same plan, op for op, and the same error, word for word: the twin runs
where the C module is not built, and whenever a C check fails (so that the numpy code alone
raises and words every error). The twin is forced here by setting `kvray.plan._native` to None.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvray.plan as plan_module
from kvray.errors import BlockIdError
from kvray.layout import DTYPE_ITEMSIZE, BlockOrder, Geometry, KVLayout, LayerSpec
from kvray.memory import Backing
from kvray.plan import OffsetCache, OpTable, PartRows, check_ops, check_rows, merge_ops, plan_transfer
from kvray.wire import EngineInfo, Role

pytestmark = pytest.mark.skipif(not plan_module.native(), reason="kvray._plan (the C extension) is not built")

NATIVE = plan_module._native
COLUMNS = ("local_region", "local_offset", "remote_region", "remote_offset", "nbytes")


def both_ways(call: Callable[[], Any]) -> tuple[Any, Any]:
    """`call()` with the C loops, then with the numpy twin: each a result or the exception."""
    outcomes = []
    for native in (NATIVE, None):
        saved, plan_module._native = plan_module._native, native
        try:
            outcomes.append(call())
        except Exception as error:
            outcomes.append(error)
        finally:
            plan_module._native = saved
    return outcomes[0], outcomes[1]


def same_table(a: OpTable, b: OpTable) -> None:
    for column in COLUMNS:
        left, right = getattr(a, column), getattr(b, column)
        assert left.dtype == right.dtype == np.int64, column
        assert np.array_equal(left, right), column


def same_error(a: object, b: object) -> None:
    assert isinstance(a, Exception) and isinstance(b, Exception), (a, b)
    assert (type(a), str(a)) == (type(b), str(b))


geometries = st.builds(
    Geometry,
    block_size=st.integers(1, 4),
    entry_shape=st.lists(st.integers(1, 8), min_size=1, max_size=2).map(tuple),
    dtype=st.sampled_from(sorted(DTYPE_ITEMSIZE)),
    parts=st.sampled_from([1, 2]),
)


def infos(data: st.DataObject, make_info: Callable[..., EngineInfo]) -> tuple[EngineInfo, EngineInfo]:
    layer_geometries = data.draw(st.lists(geometries, min_size=1, max_size=4), label="geometries")
    layers = tuple(LayerSpec(name=f"layer{index}", geometry=g) for index, g in enumerate(layer_geometries))
    sides = []
    for role in (Role.PREFILL, Role.DECODE):
        layout = KVLayout(
            layers=layers,
            num_blocks=data.draw(st.integers(1, 24), label=f"{role.value} blocks"),
            block_order=data.draw(st.sampled_from(list(BlockOrder)), label=f"{role.value} order"),
        )
        backing = Backing.allocate(layout)
        sides.append(make_info(backing, f"{role.value}-0", 1, role))
        backing.close()
    return sides[0], sides[1]


@settings(max_examples=300)
@given(data=st.data())
def test_the_same_plan_both_ways(data: st.DataObject, make_info: Callable[..., EngineInfo]) -> None:
    local, remote = infos(data, make_info)
    count = data.draw(st.integers(1, min(local.layout.num_blocks, remote.layout.num_blocks)))
    local_ids = data.draw(st.permutations(range(local.layout.num_blocks)))[:count]
    remote_ids = data.draw(st.permutations(range(remote.layout.num_blocks)))[:count]
    names = list(local.layout.layer_names)
    layers = data.draw(st.sampled_from([None, names[: data.draw(st.integers(1, len(names)))]]))
    as_array = data.draw(
        st.sampled_from([list, lambda ids: np.asarray(ids, dtype=np.int32), lambda ids: np.asarray(ids)])
    )
    # A cache that has seen the pair plans in one C call (`plan_ids`); a new one step by step.
    warm = data.draw(st.booleans(), label="warm cache")
    native, twin = both_ways(
        lambda: plan_transfer(
            local,
            remote,
            as_array(local_ids),
            as_array(remote_ids),
            layers,
            cache=cache(local, remote, layers, warm),
        )
    )
    same_table(native.ops, twin.ops)
    same_table(native.unmerged, twin.unmerged)
    assert native.layer_starts == twin.layer_starts
    for layer in native.layers:
        same_table(native.layer_ops(layer), twin.layer_ops(layer))


def cache(local: EngineInfo, remote: EngineInfo, layers: Sequence[str] | None, warm: bool) -> OffsetCache:
    """A new offset cache; `warm`: one that has derived this pair's rows already."""
    fresh = OffsetCache()
    if warm:
        fresh.pairing(local, remote, layers)
    return fresh


def _bad_ids(pool: int) -> st.SearchStrategy[Any]:
    ids = st.integers(-3, pool + 3)
    return st.one_of(
        st.lists(ids, min_size=0, max_size=pool + 2),
        st.lists(ids, min_size=1, max_size=4).map(lambda values: [values, values]),  # 2-D
        st.just([1.5, 2.0]),
        st.just(np.array([2**63 + 1, 0], dtype=np.uint64)),
        st.just(np.array([0, 1], dtype=np.uint8)),
        st.just(["a", "b"]),
    )


@settings(max_examples=300)
@given(data=st.data())
def test_the_same_error_both_ways(data: st.DataObject, make_info: Callable[..., EngineInfo]) -> None:
    local, remote = infos(data, make_info)
    local_ids = data.draw(_bad_ids(local.layout.num_blocks), label="local ids")
    remote_ids = data.draw(_bad_ids(remote.layout.num_blocks), label="remote ids")
    warm = data.draw(st.booleans(), label="warm cache")
    native, twin = both_ways(
        lambda: plan_transfer(local, remote, local_ids, remote_ids, cache=cache(local, remote, None, warm))
    )
    if isinstance(twin, Exception):
        same_error(native, twin)
    else:
        same_table(native.ops, twin.ops)


def _ops(draw: Callable[..., Any], size: int) -> OpTable:
    """Ops that often continue each other on one side or both (so some merge), in any order."""
    ints = lambda low, high: st.lists(st.integers(low, high), min_size=size, max_size=size)  # noqa: E731
    local_region, remote_region = draw(ints(0, 1)), draw(ints(0, 1))
    nbytes, start, shift = draw(ints(1, 4)), draw(ints(0, 12)), draw(ints(0, 1))
    remote_start = [offset + 16 * moved for offset, moved in zip(start, shift, strict=True)]
    order = draw(st.permutations(range(size)))
    columns = (local_region, start, remote_region, remote_start, nbytes)
    return OpTable(*(np.asarray(values, dtype=np.int64)[order] for values in columns))


@settings(max_examples=300)
@given(data=st.data())
def test_the_same_merge_both_ways(data: st.DataObject) -> None:
    ops = _ops(data.draw, data.draw(st.integers(0, 40)))
    in_order = data.draw(st.sampled_from([None, False]))
    native, twin = both_ways(lambda: merge_ops(ops, in_order))
    same_table(native, twin)
    assert native.total_nbytes == ops.total_nbytes


big = st.integers(-(2**63), 2**63 - 1)
edgy = st.sampled_from([-(2**63), -1, 0, 1, 7, 8, 2**62, 2**63 - 1])


@settings(max_examples=400)
@given(data=st.data())
def test_the_same_bounds_check_both_ways(data: st.DataObject) -> None:
    """No op outside its region passes either way, even with offsets and sizes near int64's
    ends (an end computed as offset + nbytes would overflow there)."""
    size = data.draw(st.integers(1, 6))
    values = st.one_of(edgy, big, st.integers(-2, 20))
    region, offset, nbytes = (
        np.asarray(data.draw(st.lists(st.one_of(st.integers(-1, 2), edgy), min_size=size, max_size=size)))
        if column == "region"
        else np.asarray(data.draw(st.lists(values, min_size=size, max_size=size)), dtype=np.int64)
        for column in ("region", "offset", "nbytes")
    )
    region = region.astype(np.int64)
    lengths = data.draw(st.lists(st.one_of(st.integers(0, 24), edgy.filter(lambda v: v >= 0)), max_size=3))
    native, twin = both_ways(lambda: check_ops(region, offset, nbytes, lengths, side="remote", engine_id="d"))
    if isinstance(twin, Exception):
        same_error(native, twin)
    else:
        assert native is None
    inside = [
        0 <= r < len(lengths) and 0 < n <= lengths[r] and 0 <= o <= lengths[r] - n
        for r, o, n in zip(region.tolist(), offset.tolist(), nbytes.tolist(), strict=True)
    ]
    assert (twin is None) == all(inside)


def test_sort_blocks_orders_by_local_id_and_refuses_bad_ids() -> None:
    local, remote = np.array([5, 0, 3], dtype=np.int64), np.array([1, 7, 2], dtype=np.int64)
    out_local, out_remote = np.empty(3, dtype=np.int64), np.empty(3, dtype=np.int64)
    assert NATIVE.sort_blocks(local, remote, 6, 8, out_local, out_remote) == (1, 7)
    assert out_local.tolist() == [0, 3, 5] and out_remote.tolist() == [7, 2, 1]
    for bad_local, bad_remote, pools in (
        ([5, 0, 5], [1, 7, 2], (6, 8)),  # a repeated local id
        ([5, 0, 3], [1, 2, 2], (6, 8)),  # a repeated remote id
        ([5, 0, 6], [1, 7, 2], (6, 8)),  # past the local pool
        ([5, 0, 3], [1, 7, 2], (6, 7)),  # past the remote pool
        ([5, -1, 3], [1, 7, 2], (6, 8)),
        ([5, 0, 3], [1, -7, 2], (6, 8)),
    ):
        refused = NATIVE.sort_blocks(
            np.array(bad_local, dtype=np.int64),
            np.array(bad_remote, dtype=np.int64),
            *pools,
            out_local,
            out_remote,
        )
        assert refused is None, (bad_local, bad_remote, pools)


def test_the_c_loops_take_only_int64_arrays_of_one_length() -> None:
    int64 = np.zeros(4, dtype=np.int64)
    with pytest.raises(TypeError, match="int64"):
        NATIVE.first_outside(np.zeros(4, dtype=np.int32), int64, int64, int64)
    with pytest.raises(ValueError, match="lengths"):
        NATIVE.first_outside(int64, int64, np.zeros(3, dtype=np.int64), int64)
    with pytest.raises(ValueError, match="permutation"):
        NATIVE.merge_ops(*[int64] * 5, np.array([0, 1, 2, 9], dtype=np.int64), *[np.empty(4, np.int64)] * 5)
    read_only = np.zeros(4, dtype=np.int64)
    read_only.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        NATIVE.merge_ops(*[int64] * 5, None, read_only, *[np.empty(4, np.int64)] * 4)


def test_columns_of_other_integer_types_are_merged_and_checked_by_the_twin() -> None:
    columns: Sequence[np.ndarray] = [
        np.asarray(v, dtype=np.int32) for v in ([0, 0], [0, 4], [0, 0], [8, 12], [4, 4])
    ]
    merged = merge_ops(OpTable(*columns))
    assert merged.rows() == [(0, 0, 0, 8, 8)]
    check_ops(columns[0], columns[1], columns[4], [16], side="local", engine_id="p")
    with pytest.raises(Exception, match="leaves region"):
        check_ops(columns[0], columns[1], columns[4], [6], side="local", engine_id="p")


@settings(max_examples=400)
@given(data=st.data())
def test_the_same_row_check_both_ways(data: st.DataObject) -> None:
    """The row check (each row's ops at its smallest and largest block id) passes exactly when
    every op of every row lies inside its region, both ways, and fails with the same error;
    strides and bases near int64's ends make the offsets overflow."""
    size = data.draw(st.integers(1, 5))
    values = st.one_of(edgy, big, st.integers(-64, 4096))
    columns = [st.integers(-1, 2), values, values, values]
    region, base, stride, nbytes = (
        np.asarray(data.draw(st.lists(column, min_size=size, max_size=size)), dtype=np.int64)
        for column in columns
    )
    rows = PartRows(("layer",), region, base, stride, nbytes, (0, size))
    ids = np.unique(
        np.asarray(data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=6)), dtype=np.int64)
    )
    lengths = data.draw(st.lists(st.one_of(st.integers(0, 8192), edgy.filter(lambda v: v >= 0)), max_size=3))
    native, twin = both_ways(lambda: check_rows(rows, ids, lengths, side="local", engine_id="p"))
    if isinstance(twin, Exception) or isinstance(native, Exception):
        same_error(native, twin)
    else:
        assert native is None and twin is None
    inside = [
        0 <= r < len(lengths) and 0 < n <= lengths[r] and 0 <= b + i * s <= lengths[r] - n
        for r, b, s, n in zip(region.tolist(), base.tolist(), stride.tolist(), nbytes.tolist(), strict=True)
        for i in ids.tolist()
    ]
    assert (native is None) == all(inside)


@settings(max_examples=400)
@given(data=st.data())
def test_plan_ids_passes_exactly_what_the_step_by_step_checks_pass(data: st.DataObject) -> None:
    """`plan_ids` (ids sorted and checked, then both sides' rows at their ends, in one call)
    passes a request exactly when `sort_blocks` and `check_rows` on each side pass it, and then
    writes the same pairs; rows and lengths near int64's ends included."""
    pools = (
        data.draw(st.integers(1, 12), label="local pool"),
        data.draw(st.integers(1, 12), label="remote pool"),
    )
    count = data.draw(st.integers(1, 6))
    local_ids = np.asarray(
        data.draw(st.lists(st.integers(-1, pools[0]), min_size=count, max_size=count)), np.int64
    )
    remote_ids = np.asarray(
        data.draw(st.lists(st.integers(-1, pools[1]), min_size=count, max_size=count)), np.int64
    )
    values = st.one_of(edgy, big, st.integers(-64, 4096))
    sides = []
    for side in ("local", "remote"):
        size = data.draw(st.integers(1, 4))
        columns = [
            np.asarray(
                data.draw(st.lists(column, min_size=size, max_size=size), label=f"{side} {name}"), np.int64
            )
            for name, column in zip(
                ("region", "base", "stride", "bytes"),
                [st.integers(-1, 2), values, values, values],
                strict=True,
            )
        ]
        lengths = data.draw(
            st.lists(st.one_of(st.integers(0, 8192), edgy.filter(lambda v: v >= 0)), max_size=3),
            label=f"{side} lengths",
        )
        sides.append((PartRows(("layer",), *columns, (0, size)), lengths))
    (local_rows, local_lengths), (remote_rows, remote_lengths) = sides

    def table(rows: PartRows) -> np.ndarray:
        return np.ascontiguousarray(np.stack([rows.region, rows.base, rows.block_stride, rows.nbytes]))

    out = np.empty((2, count), dtype=np.int64)
    passed = NATIVE.plan_ids(
        local_ids,
        remote_ids,
        out,
        *pools,
        table(local_rows),
        np.asarray(local_lengths, np.int64),
        table(remote_rows),
        np.asarray(remote_lengths, np.int64),
    )
    sorted_local, paired_remote = np.empty(count, np.int64), np.empty(count, np.int64)
    span = NATIVE.sort_blocks(local_ids, remote_ids, *pools, sorted_local, paired_remote)
    step_by_step = span is not None
    for rows, ids, lengths, ends in (
        (local_rows, sorted_local, local_lengths, (int(sorted_local[0]), int(sorted_local[-1]))),
        (remote_rows, paired_remote, remote_lengths, span),
    ):
        if step_by_step:
            try:
                check_rows(rows, ids, lengths, side="local", engine_id="p", span=ends)
            except Exception:
                step_by_step = False
    assert passed is step_by_step
    if passed:
        assert out[0].tolist() == sorted_local.tolist() and out[1].tolist() == paired_remote.tolist()


def test_plan_ids_takes_int64_rows_of_four_columns_and_an_output_of_two_rows() -> None:
    ids, rows, lengths = (
        np.array([1, 0], np.int64),
        np.array([0, 0, 8, 8], np.int64),
        np.array([64], np.int64),
    )
    assert NATIVE.plan_ids(ids, ids, np.empty((2, 2), np.int64), 4, 4, rows, lengths, rows, lengths) is True
    with pytest.raises(ValueError, match="4 columns"):
        NATIVE.plan_ids(ids, ids, np.empty((2, 2), np.int64), 4, 4, rows[:3], lengths, rows, lengths)
    with pytest.raises(ValueError, match="2 x n"):
        NATIVE.plan_ids(ids, ids, np.empty(3, np.int64), 4, 4, rows, lengths, rows, lengths)
    with pytest.raises(TypeError, match="int64"):
        NATIVE.plan_ids(
            ids.astype(np.int32), ids, np.empty((2, 2), np.int64), 4, 4, rows, lengths, rows, lengths
        )
    # Ids of another shape are left to the numpy twin.
    square = np.array([[1, 0], [2, 3]], np.int64)
    assert (
        NATIVE.plan_ids(square, square, np.empty((2, 4), np.int64), 4, 4, rows, lengths, rows, lengths)
        is False
    )
    # Ids of different counts, or none, never pass.
    assert (
        NATIVE.plan_ids(ids, ids[:1], np.empty((2, 2), np.int64), 4, 4, rows, lengths, rows, lengths) is False
    )
    empty = np.empty(0, np.int64)
    assert (
        NATIVE.plan_ids(empty, empty, np.empty((2, 0), np.int64), 4, 4, rows, lengths, rows, lengths) is False
    )


@settings(max_examples=300)
@given(data=st.data())
def test_sort_blocks_sorts_the_request_when_the_pools_dwarf_it(data: st.DataObject) -> None:
    """In pools many times the request's size the ids are sorted rather than counted over the
    pool: the same pairs, and the same refusals (an id outside its pool, or repeated)."""
    pools = (
        data.draw(st.integers(1, 2**40), label="local pool"),
        data.draw(st.integers(1, 2**40), label="remote pool"),
    )
    count = data.draw(st.integers(1, 8))
    sides = []
    for pool in pools:
        ids = st.one_of(st.integers(0, pool - 1), st.sampled_from([-1, 0, pool - 1, pool]))
        sides.append(np.asarray(data.draw(st.lists(ids, min_size=count, max_size=count)), dtype=np.int64))
    local, remote = sides
    out_local, out_remote = np.empty(count, np.int64), np.empty(count, np.int64)
    span = NATIVE.sort_blocks(local, remote, *pools, out_local, out_remote)
    valid = all(
        (ids >= 0).all() and (ids < pool).all() and np.unique(ids).size == ids.size
        for ids, pool in zip(sides, pools, strict=True)
    )
    assert (span is not None) == valid
    if valid:
        order = np.argsort(local, kind="stable")
        assert out_local.tolist() == local[order].tolist()
        assert out_remote.tolist() == remote[order].tolist()
        assert span == (int(remote.min()), int(remote.max()))


@pytest.mark.parametrize("blocks", [[5, 999_999, 3, 700_000], [0], list(range(64, 0, -1))])
def test_a_plan_in_a_pool_of_a_million_blocks_is_the_same_both_ways(
    blocks: list[int], make_info: Callable[..., EngineInfo]
) -> None:
    """A request of a few blocks in a pool of a million: planned in one C call (ids sorted, not
    counted over the pool), and by the numpy twin, the same plan."""
    layout = KVLayout(
        layers=(LayerSpec(name="layer", geometry=Geometry(block_size=1, entry_shape=(8,), dtype="uint8")),),
        num_blocks=1_000_000,
    )
    infos = []
    for role in (Role.PREFILL, Role.DECODE):
        backing = Backing.allocate(layout)
        infos.append(make_info(backing, f"{role.value}-0", 1, role))
        backing.close()
    local, remote = infos
    remote_blocks = [1_000_000 - 1 - block for block in blocks]
    native, twin = both_ways(
        lambda: plan_transfer(
            local,
            remote,
            np.asarray(blocks),
            np.asarray(remote_blocks),
            cache=cache(local, remote, None, True),
        )
    )
    same_table(native.ops, twin.ops)
    with pytest.raises(BlockIdError):
        plan_transfer(
            local, remote, [*blocks, blocks[0]], [*remote_blocks, 12], cache=cache(local, remote, None, True)
        )


# --- placement digests (kvray.placement) ------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(-(2**62), 2**62),
            st.integers(0, 2**40),
            st.integers(-(2**40), 2**40),
        ),
        max_size=12,
    ),
    blocks=st.lists(st.integers(-(2**20), 2**31), max_size=9),
)
def test_the_placement_digests_equal_their_numpy_twins(
    runs: list[tuple[int, int, int, int]], blocks: list[int]
) -> None:
    import kvray.placement as placement

    region, start, nbytes, stride = (np.array([run[i] for run in runs], dtype=np.int64) for i in range(4))
    ids = np.array(blocks, dtype=np.int64)
    native = (
        placement.ranges_digest(region, start, nbytes),
        placement.runs_digest(region, start, nbytes, stride, ids),
    )
    saved, placement._native = placement._native, None
    try:
        twin = (
            placement.ranges_digest(region, start, nbytes),
            placement.runs_digest(region, start, nbytes, stride, ids),
        )
    finally:
        placement._native = saved
    assert native == twin
    assert native[0] == placement.ranges_digest_numpy(region, start, nbytes)


@settings(max_examples=300)
@given(data=st.data())
def test_the_same_digest_from_held_sums_both_ways(data: st.DataObject) -> None:
    """`HeldDigests.digest` in one C pass equals its numpy twin for any held sums, rows of any
    pair salt, start and stride (near int64's ends: offsets wrap mod 2**64 alike), and blocks;
    both answer None, changing nothing, while a sum the transfer needs is not held, and both
    drop exactly the sums they used."""
    from kvray.content import HeldDigests, Stretches, StretchRows

    layers, parts, num_blocks = (data.draw(st.integers(1, 4)) for _ in range(3))
    held = HeldDigests.__new__(HeldDigests)  # the sums alone: no layout needed to combine them
    held.sums = np.asarray(
        data.draw(
            st.lists(
                st.integers(0, 2**64 - 1),
                min_size=layers * parts * num_blocks,
                max_size=layers * parts * num_blocks,
            )
        ),
        dtype=np.uint64,
    ).reshape(layers, parts, num_blocks)
    held.held = np.ones((layers, parts, num_blocks), dtype=bool)
    held._lock = threading.Lock()
    count = data.draw(st.integers(1, num_blocks))
    local = np.asarray(data.draw(st.permutations(range(num_blocks)))[:count], dtype=np.int64)
    remote = np.asarray(data.draw(st.lists(st.integers(0, 50), min_size=count, max_size=count)), np.int64)
    size = data.draw(st.integers(1, 5))
    values = st.one_of(edgy, st.integers(-64, 1 << 20))

    def column(strategy: Any) -> np.ndarray:
        return np.asarray(data.draw(st.lists(strategy, min_size=size, max_size=size)), dtype=np.int64)

    rows = StretchRows(
        src_region=column(st.integers(0, 3)),
        src_start=column(values),
        src_stride=column(values),
        dst_region=column(st.integers(0, 3)),
        dst_start=column(values),
        dst_stride=column(values),
        nbytes=column(st.integers(1, 64)),
        layer=column(st.integers(0, layers - 1)),
        part=column(st.integers(0, parts - 1)),
        whole_parts=True,
    )
    unheld = data.draw(st.booleans())
    if unheld:
        row = data.draw(st.integers(0, size - 1))
        held.held[rows.layer[row], rows.part[row], local[data.draw(st.integers(0, count - 1))]] = False
    before = held.held.copy()
    twin = held.digest_numpy(Stretches(rows, local, remote))
    after_twin = held.held.copy()
    held.held[:] = before
    with np.errstate(over="ignore"):
        native = held.digest(Stretches(rows, local, remote))
    assert native == twin
    assert np.array_equal(held.held, after_twin)
    assert (native is None) == unheld
    if unheld:
        assert np.array_equal(held.held, before), "a digest that is not all held drops nothing"


@settings(max_examples=400)
@given(data=st.data())
def test_long_block_id_lists_are_checked_the_same_both_ways(data: st.DataObject) -> None:
    """`block_ids` of a list or tuple longer than the short path's: the C pass
    (`kvray._plan.check_ids`) gives the numpy twin's array, or the twin's error word for word
    (a repeat, an id outside the pool, a negative one, a bool, a float, one too large for int64)."""
    num_blocks = data.draw(st.integers(1, 4096))
    count = data.draw(st.integers(plan_module._SHORT_REQUEST + 1, plan_module._SHORT_REQUEST + 300))
    ids: list[Any] = list(np.random.default_rng(data.draw(st.integers(0, 2**32))).permutation(4096)[:count])
    ids = [int(block) for block in ids]
    spoil = data.draw(st.sampled_from(["none", "repeat", "outside", "negative", "bool", "float", "huge"]))
    at = data.draw(st.integers(0, count - 1))
    if spoil == "repeat":
        ids[at] = ids[(at + 1) % count]
    elif spoil == "outside":
        ids[at] = num_blocks + data.draw(st.integers(0, 10))
    elif spoil == "negative":
        ids[at] = -data.draw(st.integers(1, 10))
    elif spoil == "bool":
        ids[at] = True
    elif spoil == "float":
        ids[at] = float(ids[at])
    elif spoil == "huge":
        ids[at] = 2**64 + 3
    blocks = tuple(ids) if data.draw(st.booleans()) else ids
    native, twin = both_ways(lambda: plan_module.block_ids(blocks, num_blocks, "decode", "e"))
    if isinstance(twin, Exception):
        same_error(native, twin)
    else:
        assert isinstance(native, np.ndarray) and native.dtype == np.int64
        assert np.array_equal(native, twin)


def test_check_ids_takes_lists_and_tuples_of_ints_alone() -> None:
    out = np.empty(200, dtype=np.int64)
    assert NATIVE.check_ids(list(range(200)), out, 200) and out.tolist() == list(range(200))
    assert NATIVE.check_ids(tuple(range(200)), out, 200)
    assert not NATIVE.check_ids(np.arange(200), out, 200)  # arrays take numpy's way
    assert not NATIVE.check_ids([], np.empty(0, dtype=np.int64), 200)
    assert not NATIVE.check_ids(list(range(200)), np.empty(199, dtype=np.int64), 200)
    assert not NATIVE.check_ids(list(range(200)), out, 0)
    assert not NATIVE.check_ids(list(range(200)), out, 2**60)  # a claimed pool: no bitmap that large
    ids = plan_module.block_ids(list(range(200)), 2**60, "remote", "e")  # the twin takes it
    assert ids.tolist() == list(range(200))
    with pytest.raises(TypeError):
        NATIVE.check_ids(list(range(200)), np.empty(200, dtype=np.int32), 200)


@settings(max_examples=400)
@given(data=st.data())
def test_int64_block_id_arrays_are_checked_the_same_both_ways(data: st.DataObject) -> None:
    """`block_ids` of an engine's own int64 array (a hold's ids): the C pass
    (`kvray._plan.check_id_array`, pair by pair up to 64 ids, a bitmap beyond, the numpy twin
    past its pool) returns the array itself, or leaves the twin to say what is wrong."""
    num_blocks = data.draw(st.sampled_from([1, 7, 4096, 2**24, 2**24 + 1, 2**40]))
    count = data.draw(st.integers(1, 200))
    ids = np.array(
        [data.draw(st.integers(0, min(num_blocks, 10**6) - 1)) for _ in range(count)], dtype=np.int64
    )
    spoil = data.draw(st.sampled_from(["none", "repeat", "outside", "negative"]))
    at = data.draw(st.integers(0, count - 1))
    if spoil == "repeat" and count > 1:
        ids[at] = ids[(at + 1) % count]
    elif spoil == "outside":
        ids[at] = num_blocks + data.draw(st.integers(0, 10))
    elif spoil == "negative":
        ids[at] = -data.draw(st.integers(1, 10))
    native, twin = both_ways(lambda: plan_module.block_ids(ids, num_blocks, "local", "e"))
    if isinstance(twin, Exception):
        same_error(native, twin)
    else:
        assert native is ids and twin is ids  # checked, not copied
