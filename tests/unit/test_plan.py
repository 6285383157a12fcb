"""Planning: ops move exactly the requested blocks, per layer, inside both regions (invariants 2-4)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.errors import (
    BlockIdError,
    BoundsError,
    GeometryMismatchError,
    KvrayError,
    MetadataError,
    PlanError,
    UnknownLayerError,
    WireDecodeError,
)
from kvray.layout import (
    DTYPE_ITEMSIZE,
    READY_LAYOUTS,
    BlockOrder,
    Geometry,
    KVLayout,
    LayerSpec,
    llama_gqa,
)
from kvray.memory import TORCH_DTYPES, Backing
from kvray.plan import (
    OffsetCache,
    OffsetKey,
    OpTable,
    PartRows,
    TransferPlan,
    block_ids,
    check_bounds,
    check_compatible,
    check_ops,
    check_row_bounds,
    plan_transfer,
    split_ops,
)
from kvray.validation import validate_engine_info
from kvray.wire import EngineInfo, Role, TransportKind, decode_engine_info, encode

MakeInfo = Callable[..., EngineInfo]


# ---- helpers --------------------------------------------------------------------------------


def fill_random(backing: Backing, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for region in backing.regions:
        region.tensor.numpy()[:] = rng.integers(0, 256, region.nbytes, dtype=np.uint8)


def snapshot(backing: Backing) -> list[np.ndarray]:
    return [region.tensor.numpy().copy() for region in backing.regions]


def apply_ops(ops: OpTable, src: Backing, dst: Backing) -> None:
    """What a transport does: copy each op's bytes from the source region to the destination's."""
    src_regions = [region.tensor.numpy() for region in src.regions]
    dst_regions = [region.tensor.numpy() for region in dst.regions]
    for local_region, local_offset, remote_region, remote_offset, nbytes in ops.rows():
        source = src_regions[local_region][local_offset : local_offset + nbytes]
        dst_regions[remote_region][remote_offset : remote_offset + nbytes] = source


def block_bytes(backing: Backing, layer: str, blocks: Sequence[int]) -> torch.Tensor:
    """The selected blocks of a layer's view, as bytes (bf16 random bytes hold NaNs)."""
    view = backing.view(layer).view(torch.uint8)
    index = torch.as_tensor(list(blocks), dtype=torch.long)
    return view[:, index] if backing.layout.layer(layer).geometry.parts == 2 else view[index]


def written_mask(backing: Backing, layers: Sequence[str], blocks: Sequence[int]) -> list[np.ndarray]:
    """Per region, True at every byte of the given blocks of the given layers."""
    masks = [np.zeros(region.nbytes, dtype=bool) for region in backing.regions]
    for layer in layers:
        placement = backing.placements[layer]
        for part in range(placement.parts):
            for block in blocks:
                start = placement.byte_offset(part, block)
                masks[placement.region][start : start + placement.part_nbytes] = True
    return masks


def check_transfer(
    local: Backing,
    remote: Backing,
    local_info: EngineInfo,
    remote_info: EngineInfo,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    layers: Sequence[str] | None = None,
    cache: OffsetCache | None = None,
    seed: int = 0,
) -> TransferPlan:
    """Plan, copy the ops, and check every selected block arrived and nothing else changed."""
    fill_random(local, seed)
    fill_random(remote, seed + 1)
    local_before, remote_before = snapshot(local), snapshot(remote)
    plan = plan_transfer(local_info, remote_info, local_ids, remote_ids, layers, cache)
    apply_ops(plan.ops, local, remote)

    names = tuple(local.layout.layer_names if layers is None else layers)
    assert plan.layers == names
    for layer in names:
        sent = block_bytes(local, layer, local_ids)
        arrived = block_bytes(remote, layer, remote_ids)
        assert torch.equal(sent, arrived), f"layer {layer!r} did not arrive intact"

    masks = written_mask(remote, names, remote_ids)
    for before, after, mask in zip(remote_before, snapshot(remote), masks, strict=True):
        assert np.array_equal(before[~mask], after[~mask]), "a byte outside the written blocks changed"
    for before, after in zip(local_before, snapshot(local), strict=True):
        assert np.array_equal(before, after), "the source changed"
    assert plan.nbytes == sum(int(mask.sum()) for mask in masks)
    assert plan.nbytes == plan.unmerged.total_nbytes
    assert (plan.src_engine, plan.dst_engine) == (local_info.engine_id, remote_info.engine_id)
    assert (plan.src_incarnation, plan.dst_incarnation) == (local_info.incarnation, remote_info.incarnation)
    return plan


def padded_layer_tensors(layout: KVLayout, alignment: int = 4096) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in layout.layer_names:
        nbytes = layout.layer_nbytes(name)
        storage = torch.empty(nbytes + 3 * alignment, dtype=torch.uint8)
        start = (-storage.data_ptr()) % alignment + alignment + 128
        dtype = TORCH_DTYPES[layout.layer(name).geometry.dtype]
        tensors[name] = storage[start : start + nbytes].view(dtype).view(layout.tensor_shape(name))
    return tensors


def pair(
    make_info: MakeInfo,
    local_layout: KVLayout,
    remote_layout: KVLayout,
    *,
    remote_incarnation: int = 1,
) -> tuple[Backing, Backing, EngineInfo, EngineInfo]:
    local = Backing.allocate(local_layout)
    remote = Backing.allocate(remote_layout)
    local_info = make_info(local, "prefill-0", 1, Role.PREFILL)
    remote_info = make_info(remote, "decode-0", remote_incarnation, Role.DECODE)
    return local, remote, local_info, remote_info


# ---- (a) ops move exactly the requested blocks -----------------------------------------------


@pytest.mark.parametrize("remote_order", list(BlockOrder))
@pytest.mark.parametrize("local_order", list(BlockOrder))
@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
def test_ops_copy_exactly_the_selected_blocks(
    name: str, local_order: BlockOrder, remote_order: BlockOrder, make_info: MakeInfo
) -> None:
    build = READY_LAYOUTS[name]
    local, remote, local_info, remote_info = pair(
        make_info, build(num_blocks=5, block_order=local_order), build(num_blocks=7, block_order=remote_order)
    )
    rng = np.random.default_rng(sum(map(ord, name)))
    local_ids = rng.permutation(5)[:3].tolist()
    remote_ids = rng.permutation(7)[:3].tolist()
    check_transfer(local, remote, local_info, remote_info, local_ids, remote_ids)


@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
def test_ops_from_adopted_per_layer_tensors(name: str, make_info: MakeInfo) -> None:
    layout = READY_LAYOUTS[name](num_blocks=4)
    local = Backing.adopt(layout, padded_layer_tensors(layout), alignment=4096)
    remote = Backing.allocate(READY_LAYOUTS[name](num_blocks=6, block_order=BlockOrder.BLOCK_MAJOR))
    local_info = make_info(local, "prefill-0", 1, Role.PREFILL)
    remote_info = make_info(remote, "decode-0", 1, Role.DECODE)
    plan = check_transfer(local, remote, local_info, remote_info, [0, 1, 2, 3], [5, 0, 1, 2])
    # Layers live in different local regions, so no op may span two of them.
    assert len(plan.ops) >= len(layout.layers)
    assert set(plan.ops.local_region.tolist()) == set(range(len(layout.layers)))


geometries = st.builds(
    Geometry,
    block_size=st.integers(1, 8),
    entry_shape=st.lists(st.integers(1, 12), min_size=1, max_size=2).map(tuple),
    dtype=st.sampled_from(sorted(DTYPE_ITEMSIZE)),
    parts=st.sampled_from([1, 2]),
)


@settings(max_examples=200)
@given(data=st.data())
def test_ops_copy_exactly_the_selected_blocks_property(data: st.DataObject, make_info: MakeInfo) -> None:
    layer_geometries = data.draw(st.lists(geometries, min_size=1, max_size=5), label="geometries")
    layers = tuple(LayerSpec(name=f"layer{index}", geometry=g) for index, g in enumerate(layer_geometries))
    local_blocks = data.draw(st.integers(1, 12), label="local num_blocks")
    remote_blocks = data.draw(st.integers(1, 12), label="remote num_blocks")
    local_layout = KVLayout(
        layers=layers, num_blocks=local_blocks, block_order=data.draw(st.sampled_from(list(BlockOrder)))
    )
    remote_layout = KVLayout(
        layers=layers, num_blocks=remote_blocks, block_order=data.draw(st.sampled_from(list(BlockOrder)))
    )
    count = data.draw(st.integers(1, min(local_blocks, remote_blocks)), label="count")
    local_ids = data.draw(st.permutations(range(local_blocks)), label="local ids")[:count]
    remote_ids = data.draw(st.permutations(range(remote_blocks)), label="remote ids")[:count]
    names = [spec.name for spec in layers]
    subset = data.draw(st.permutations(names), label="layers")[: data.draw(st.integers(1, len(names)))]
    chosen = data.draw(st.sampled_from([None, subset]), label="layers argument")

    local = Backing.allocate(local_layout)
    remote = Backing.allocate(remote_layout)
    local_info = make_info(local, "prefill-0", 1, Role.PREFILL)
    remote_info = make_info(remote, "decode-0", 1, Role.DECODE)
    plan = check_transfer(local, remote, local_info, remote_info, local_ids, remote_ids, chosen)
    parts = sum(local_layout.layer(name).geometry.parts for name in plan.layers)
    assert len(plan.unmerged) == parts * count
    assert 1 <= len(plan.ops) <= len(plan.unmerged)
    for layer in plan.layers:
        layer_ops = plan.layer_ops(layer)
        assert layer_ops.total_nbytes == count * local_layout.layer(layer).geometry.block_nbytes


# ---- (b) merging ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
def test_block_major_contiguous_blocks_are_one_op(name: str, make_info: MakeInfo) -> None:
    build = READY_LAYOUTS[name]
    _, _, local_info, remote_info = pair(
        make_info,
        build(num_blocks=8, block_order=BlockOrder.BLOCK_MAJOR),
        build(num_blocks=8, block_order=BlockOrder.BLOCK_MAJOR),
    )
    plan = plan_transfer(local_info, remote_info, [2, 3, 4], [5, 6, 7])
    layout = local_info.layout
    assert len(plan.ops) == 1
    assert plan.ops.rows() == [
        (0, 2 * layout.block_stride, 0, 5 * layout.block_stride, 3 * layout.block_stride)
    ]
    assert len(plan.unmerged) == 3 * sum(spec.geometry.parts for spec in layout.layers)


@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
def test_layer_major_contiguous_blocks_are_one_op_per_part(name: str, make_info: MakeInfo) -> None:
    build = READY_LAYOUTS[name]
    _, _, local_info, remote_info = pair(make_info, build(num_blocks=8), build(num_blocks=8))
    plan = plan_transfer(local_info, remote_info, [1, 2, 3, 4], [3, 4, 5, 6])
    parts = [spec.geometry.parts for spec in local_info.layout.layers]
    assert len(plan.ops) == sum(parts)
    assert len(plan.unmerged) == 4 * sum(parts)
    for spec in local_info.layout.layers:
        layer_ops = plan.layer_ops(spec.name)
        assert len(layer_ops) == spec.geometry.parts
        assert layer_ops.nbytes.tolist() == [4 * spec.geometry.part_nbytes] * spec.geometry.parts


def test_llama_layer_major_is_two_ops_per_layer(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(make_info, llama_gqa(num_blocks=8), llama_gqa(num_blocks=8))
    plan = plan_transfer(local_info, remote_info, [0, 1, 2], [4, 5, 6])
    assert len(plan.ops) == 2 * 32
    assert len(plan.unmerged) == 2 * 32 * 3


def test_scattered_blocks_do_not_merge(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=8, num_layers=2), llama_gqa(num_blocks=8, num_layers=2)
    )
    plan = plan_transfer(local_info, remote_info, [0, 1, 2], [6, 3, 0])
    assert len(plan.ops) == len(plan.unmerged) == 2 * 2 * 3
    # Contiguous on one side only is not contiguous.
    plan = plan_transfer(local_info, remote_info, [0, 2, 4], [1, 2, 3])
    assert len(plan.ops) == 2 * 2 * 3


def test_whole_layer_major_pool_merges_across_parts_and_layers(make_info: MakeInfo) -> None:
    layout = llama_gqa(num_blocks=4, num_layers=3)
    _, _, local_info, remote_info = pair(make_info, layout, layout)
    plan = plan_transfer(local_info, remote_info, [0, 1, 2, 3], [0, 1, 2, 3])
    assert plan.ops.rows() == [(0, 0, 0, 0, layout.nbytes)]


@given(
    st.lists(
        st.tuples(st.integers(0, 10**9), st.integers(0, 10**9), st.integers(1, 300_000)),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([4096, 65536, 100_000]),
)
def test_split_ops_cover_exactly_the_ops(ops: list[tuple[int, int, int]], piece_nbytes: int) -> None:
    dst = np.array([o[0] for o in ops], dtype=np.int64)
    src = np.array([o[1] for o in ops], dtype=np.int64)
    nbytes = np.array([o[2] for o in ops], dtype=np.int64)
    piece_dst, piece_src, piece_n = split_ops(dst, src, nbytes, piece_nbytes)
    assert (piece_n > 0).all() and (piece_n <= piece_nbytes).all()
    assert int(piece_n.sum()) == int(nbytes.sum())
    expected = {(d + k, s + k) for d, s, n in ops for k in range(0, n, piece_nbytes)}
    assert set(zip(piece_dst.tolist(), piece_src.tolist(), strict=True)) == expected


# ---- (c) the seed bug's shape: same geometry, different layers --------------------------------


def test_layers_of_one_geometry_get_their_own_remote_bytes(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=8, num_layers=4), llama_gqa(num_blocks=8, num_layers=4)
    )
    first, second = remote_info.layout.layer_names[:2]
    assert remote_info.layout.layer(first).geometry == remote_info.layout.layer(second).geometry
    cache = OffsetCache()  # one cache for both, as in the seed connector
    plan_first = plan_transfer(local_info, remote_info, [1, 2], [3, 4], [first], cache)
    plan_second = plan_transfer(local_info, remote_info, [1, 2], [3, 4], [second], cache)
    assert set(plan_first.unmerged.remote_offset.tolist()).isdisjoint(
        plan_second.unmerged.remote_offset.tolist()
    )

    def remote_bytes(plan: TransferPlan) -> set[int]:
        touched: set[int] = set()
        for _, _, _, offset, nbytes in plan.ops.rows():
            touched.update(range(offset, offset + nbytes))
        return touched

    assert remote_bytes(plan_first).isdisjoint(remote_bytes(plan_second))
    assert cache.key(remote_info, first) != cache.key(remote_info, second)


def test_pushing_layer_by_layer_equals_pushing_all_layers(make_info: MakeInfo) -> None:
    layout = READY_LAYOUTS["mixed"](num_blocks=6)
    local, remote, local_info, remote_info = pair(make_info, layout, layout)
    fill_random(local, 3)
    fill_random(remote, 4)
    cache = OffsetCache()
    for layer in layout.layer_names:
        apply_ops(plan_transfer(local_info, remote_info, [5, 0], [1, 4], [layer], cache).ops, local, remote)
    for layer in layout.layer_names:
        assert torch.equal(block_bytes(local, layer, [5, 0]), block_bytes(remote, layer, [1, 4]))


# ---- (d) the offset cache -------------------------------------------------------------------


def test_offset_cache_key_is_engine_incarnation_layer_geometry(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info,
        llama_gqa(num_blocks=4, num_layers=2),
        llama_gqa(num_blocks=4, num_layers=2),
        remote_incarnation=9,
    )
    cache = OffsetCache()
    layer = remote_info.layout.layer_names[1]
    key = cache.key(remote_info, layer)
    assert key == OffsetKey("decode-0", 9, layer, remote_info.layout.layer(layer).geometry)
    assert cache.placement(remote_info, layer) == remote_info.placements[layer]
    with pytest.raises(UnknownLayerError):
        cache.key(remote_info, "model.layers.7.self_attn.kv")
    with pytest.raises(UnknownLayerError):
        cache.placement(remote_info, "model.layers.7.self_attn.kv")

    plan_transfer(local_info, remote_info, [0], [1], cache=cache)
    assert len(cache) == 4  # two layers on each of two engines
    assert (cache.hits, cache.misses) == (0, 2)
    plan_transfer(local_info, remote_info, [1], [2], cache=cache)
    assert (cache.hits, cache.misses) == (2, 2)


@pytest.mark.parametrize(
    "restarted",
    [
        lambda: llama_gqa(num_blocks=8, num_layers=3, block_order=BlockOrder.BLOCK_MAJOR),
        lambda: llama_gqa(num_blocks=12, num_layers=3),
    ],
    ids=["new-block-order", "new-num-blocks"],
)
def test_new_incarnation_is_planned_with_new_offsets(
    make_info: MakeInfo, restarted: Callable[[], KVLayout]
) -> None:
    local, old_remote, local_info, old_info = pair(
        make_info, llama_gqa(num_blocks=8, num_layers=3), llama_gqa(num_blocks=8, num_layers=3)
    )
    cache = OffsetCache()
    old_plan = check_transfer(local, old_remote, local_info, old_info, [0, 1, 5], [2, 3, 7], cache=cache)

    new_remote = Backing.allocate(restarted())
    new_info = make_info(new_remote, "decode-0", 2, Role.DECODE)
    new_plan = check_transfer(local, new_remote, local_info, new_info, [0, 1, 5], [2, 3, 7], cache=cache)
    fresh_plan = plan_transfer(local_info, new_info, [0, 1, 5], [2, 3, 7])
    assert new_plan.ops.rows() == fresh_plan.ops.rows()
    assert new_plan.ops.rows() != old_plan.ops.rows()
    assert new_plan.dst_incarnation == 2


def test_same_incarnation_with_different_contents_is_refused(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=8, num_layers=2), llama_gqa(num_blocks=8, num_layers=2)
    )
    cache = OffsetCache()
    plan_transfer(local_info, remote_info, [0], [1], cache=cache)
    # The same description arriving again (a new object, equal) is fine.
    plan_transfer(local_info, decode_engine_info(encode(remote_info)), [0], [1], cache=cache)

    other = Backing.allocate(llama_gqa(num_blocks=8, num_layers=2, block_order=BlockOrder.BLOCK_MAJOR))
    impostor = make_info(other, "decode-0", remote_info.incarnation, Role.DECODE)
    with pytest.raises(MetadataError) as caught:
        plan_transfer(local_info, impostor, [0], [1], cache=cache)
    assert caught.value.engine_id == "decode-0"
    assert caught.value.incarnation == remote_info.incarnation

    cache.forget("decode-0")
    assert len(cache) == 2  # only the local engine's layers are left
    plan = plan_transfer(local_info, impostor, [0], [1], cache=cache)
    assert plan.ops.rows() == plan_transfer(local_info, impostor, [0], [1]).ops.rows()
    cache.forget("nobody")  # forgetting an unknown engine is harmless


def test_forget_drops_every_entry_of_the_engine(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=4, num_layers=3), llama_gqa(num_blocks=4, num_layers=3)
    )
    cache = OffsetCache()
    plan_transfer(local_info, remote_info, [0], [1], cache=cache)
    assert len(cache) == 6
    cache.forget("prefill-0")
    cache.forget("decode-0")
    assert len(cache) == 0
    misses = cache.misses
    plan_transfer(local_info, remote_info, [0], [1], cache=cache)
    assert cache.misses == misses + 2


def test_rows_are_per_layer_and_part(make_info: MakeInfo) -> None:
    _, _, _, remote_info = pair(
        make_info, llama_gqa(num_blocks=4, num_layers=2), llama_gqa(num_blocks=4, num_layers=2)
    )
    names = remote_info.layout.layer_names
    rows = OffsetCache().rows(remote_info, (names[1], names[0]))
    assert isinstance(rows, PartRows)
    assert rows.layer_starts == (0, 2, 4)
    second, first = remote_info.placements[names[1]], remote_info.placements[names[0]]
    assert rows.base.tolist() == [
        second.offset,
        second.offset + second.part_stride,
        first.offset,
        first.offset + first.part_stride,
    ]


# ---- (e) unknown layers and geometry mismatches ---------------------------------------------


def test_unknown_layer_in_the_request_raises(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=4, num_layers=2), llama_gqa(num_blocks=4, num_layers=2)
    )
    with pytest.raises(UnknownLayerError) as caught:
        plan_transfer(local_info, remote_info, [0], [0], ["model.layers.5.self_attn.kv"])
    assert caught.value.layer == "model.layers.5.self_attn.kv"


def test_remote_engine_without_the_layer_raises(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=4, num_layers=3), llama_gqa(num_blocks=4, num_layers=2)
    )
    with pytest.raises(UnknownLayerError) as caught:
        plan_transfer(local_info, remote_info, [0], [0])
    assert caught.value.engine_id == "decode-0"
    assert caught.value.layer == "model.layers.2.self_attn.kv"
    # The layers both sides have still plan.
    shared = remote_info.layout.layer_names
    assert plan_transfer(local_info, remote_info, [0], [0], shared).layers == shared


def test_geometry_mismatch_is_found_at_handshake(make_info: MakeInfo) -> None:
    local_layout = llama_gqa(num_blocks=4, num_layers=2)
    other = Geometry(block_size=16, entry_shape=(8, 128), dtype="bfloat16", parts=2)
    remote_layout = KVLayout(
        layers=(
            local_layout.layers[0],
            LayerSpec(name=local_layout.layer_names[1], geometry=other),
        ),
        num_blocks=4,
    )
    _, _, local_info, remote_info = pair(make_info, local_layout, remote_layout)
    with pytest.raises(GeometryMismatchError) as caught:
        check_compatible(local_info, remote_info)
    assert caught.value.layer == local_layout.layer_names[1]
    assert isinstance(caught.value, PlanError)
    with pytest.raises(GeometryMismatchError):
        plan_transfer(local_info, remote_info, [0], [0])
    assert check_compatible(local_info, remote_info, [local_layout.layer_names[0]]) == (
        local_layout.layer_names[0],
    )


def test_plan_layer_ops_of_an_unplanned_layer_raises(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=4, num_layers=2), llama_gqa(num_blocks=4, num_layers=2)
    )
    first, second = local_info.layout.layer_names
    plan = plan_transfer(local_info, remote_info, [0], [0], [first])
    with pytest.raises(UnknownLayerError):
        plan.layer_ops(second)


# ---- (f) bad requests are refused before any offset is computed -----------------------------


class NoOffsetsCache(OffsetCache):
    """Fails the test if planning reaches the offsets."""

    def rows(self, info: EngineInfo, layers: tuple[str, ...]) -> PartRows:
        raise AssertionError("offsets were computed for a request that should have been refused")


BAD_BLOCK_IDS = [
    pytest.param([-1, 2], [0, 1], "local", id="negative-local"),
    pytest.param([0, 1], [1, -3], "remote", id="negative-remote"),
    pytest.param([0, 8], [0, 1], "local", id="past-end-local"),
    pytest.param([0, 1], [6, 7], "remote", id="past-end-remote"),
    pytest.param([3, 3], [0, 1], "local", id="duplicate-local"),
    pytest.param([0, 1], [4, 4], "remote", id="duplicate-remote"),
    pytest.param([], [], "local", id="empty"),
    pytest.param([0, 1], [], "remote", id="empty-remote"),
    pytest.param(np.array([0.0, 1.0]), [0, 1], "local", id="float-array"),
    pytest.param([0.5, 1], [0, 1], "local", id="float-list"),
    pytest.param(np.array([True, False]), [0, 1], "local", id="bool-array"),
    pytest.param(["0", "1"], [0, 1], "local", id="strings"),
    pytest.param(np.array([[0, 1], [2, 3]]), [0, 1, 2, 3], "local", id="2-d-local"),
    pytest.param([0, 1], np.array([[0], [1]]), "remote", id="2-d-remote"),
    pytest.param(np.int64(3), [0], "local", id="scalar"),
    pytest.param(np.array([0, 2**40]), [0, 1], "local", id="huge"),
]


@pytest.mark.parametrize(("local_ids", "remote_ids", "side"), BAD_BLOCK_IDS)
def test_bad_block_ids_raise_before_any_op(
    local_ids: Any, remote_ids: Any, side: str, make_info: MakeInfo
) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=8, num_layers=2), llama_gqa(num_blocks=6, num_layers=2)
    )
    with pytest.raises(BlockIdError) as caught:
        plan_transfer(local_info, remote_info, local_ids, remote_ids, cache=NoOffsetsCache())
    assert caught.value.side == side
    assert caught.value.engine_id == ("prefill-0" if side == "local" else "decode-0")


def test_block_ids_name_the_offending_block(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=8, num_layers=1), llama_gqa(num_blocks=6, num_layers=1)
    )
    with pytest.raises(BlockIdError) as caught:
        plan_transfer(local_info, remote_info, [0, 1], [2, 6], cache=NoOffsetsCache())
    assert (caught.value.block, caught.value.num_blocks) == (6, 6)
    with pytest.raises(BlockIdError) as caught:
        plan_transfer(local_info, remote_info, [4, 1, 4], [0, 1, 2], cache=NoOffsetsCache())
    assert caught.value.block == 4


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 5000), min_size=1, max_size=64),
    num_blocks=st.sampled_from([64, 5001, 1 << 20]),
)
def test_a_repeated_block_id_is_named_the_same_whatever_the_pool(ids: list[int], num_blocks: int) -> None:
    """`block_ids` counts over the pool when it is small next to the request and sorts the ids
    when it is large: either way the smallest repeated id is the one named, and ids without
    repeats pass as they came."""
    ids = [block % num_blocks for block in ids]
    counts = np.bincount(ids, minlength=num_blocks)
    if counts.max() > 1:
        with pytest.raises(BlockIdError) as caught:
            block_ids(ids, num_blocks, "decode", "d")
        assert caught.value.block == int(np.flatnonzero(counts > 1)[0])
    else:
        assert block_ids(ids, num_blocks, "decode", "d").tolist() == ids


def test_different_block_counts_raise_before_any_op(make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=8, num_layers=2), llama_gqa(num_blocks=8, num_layers=2)
    )
    with pytest.raises(BlockIdError) as caught:
        plan_transfer(local_info, remote_info, [0, 1, 2], [0, 1], cache=NoOffsetsCache())
    assert (caught.value.local_count, caught.value.remote_count) == (3, 2)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint16, np.uint32, np.uint64])
def test_any_integer_dtype_is_accepted(dtype: Any, make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=8, num_layers=1), llama_gqa(num_blocks=8, num_layers=1)
    )
    plan = plan_transfer(
        local_info, remote_info, np.array([1, 2], dtype=dtype), np.array([3, 5], dtype=dtype)
    )
    assert plan.ops.rows() == plan_transfer(local_info, remote_info, [1, 2], [3, 5]).ops.rows()


@pytest.mark.parametrize("layers", [["a", "a"], [], ("model.layers.0.self_attn.kv",) * 2])
def test_repeated_or_no_layer_names_raise_plan_error(layers: list[str], make_info: MakeInfo) -> None:
    _, _, local_info, remote_info = pair(
        make_info, llama_gqa(num_blocks=4, num_layers=2), llama_gqa(num_blocks=4, num_layers=2)
    )
    with pytest.raises(PlanError) as caught:
        plan_transfer(local_info, remote_info, [0], [0], layers, cache=NoOffsetsCache())
    assert type(caught.value) is PlanError


# ---- (g) validating what an engine publishes ------------------------------------------------


def corrupt_placement(info: EngineInfo, layer: str, **changes: Any) -> EngineInfo:
    placements = dict(info.placements)
    placements[layer] = msgspec.structs.replace(placements[layer], **changes)
    return msgspec.structs.replace(info, placements=placements)


def corrupt_region(info: EngineInfo, **changes: Any) -> EngineInfo:
    regions = (msgspec.structs.replace(info.regions[0], **changes), *info.regions[1:])
    return msgspec.structs.replace(info, regions=regions)


def layer_name(info: EngineInfo, index: int) -> str:
    return info.layout.layer_names[index]


CORRUPTIONS: list[Any] = [
    pytest.param(
        lambda info: corrupt_region(info, length=info.layout.nbytes - 1),
        BoundsError,
        "layer",
        id="region-too-short",
    ),
    pytest.param(
        lambda info: corrupt_placement(
            info, layer_name(info, -1), offset=info.placements[layer_name(info, -1)].offset + 4096
        ),
        BoundsError,
        "layer",
        id="last-layer-past-region",
    ),
    pytest.param(
        lambda info: corrupt_placement(
            info, layer_name(info, 1), offset=info.placements[layer_name(info, 0)].offset
        ),
        MetadataError,
        "offset",
        id="two-layers-one-address",
    ),
    pytest.param(
        lambda info: corrupt_placement(
            info, layer_name(info, 1), offset=info.placements[layer_name(info, 0)].offset + 64
        ),
        MetadataError,
        "offset",
        id="two-layers-overlap",
    ),
    pytest.param(
        lambda info: corrupt_placement(
            info, layer_name(info, 0), part_stride=info.placements[layer_name(info, 0)].part_nbytes
        ),
        MetadataError,
        "offset",
        id="v-over-k",
    ),
    pytest.param(
        lambda info: corrupt_region(info, engine_id="decode-1"), MetadataError, "region", id="other-engine"
    ),
    pytest.param(
        lambda info: corrupt_region(info, incarnation=0), MetadataError, "region", id="other-incarnation"
    ),
    pytest.param(
        lambda info: corrupt_region(info, index=1), MetadataError, "region", id="wrong-region-index"
    ),
    pytest.param(
        lambda info: corrupt_placement(info, layer_name(info, 1), region=1),
        MetadataError,
        "layer",
        id="missing-region",
    ),
    pytest.param(
        lambda info: corrupt_placement(info, layer_name(info, 1), parts=1),
        MetadataError,
        "layer",
        id="wrong-parts",
    ),
    pytest.param(
        lambda info: corrupt_placement(info, layer_name(info, 1), part_nbytes=64),
        MetadataError,
        "layer",
        id="wrong-part-size",
    ),
    pytest.param(
        lambda info: msgspec.structs.replace(
            info, placements={k: v for k, v in info.placements.items() if k != layer_name(info, 1)}
        ),
        UnknownLayerError,
        "layer",
        id="layer-without-placement",
    ),
    pytest.param(
        lambda info: msgspec.structs.replace(
            info, placements={**info.placements, "ghost": info.placements[layer_name(info, 0)]}
        ),
        MetadataError,
        "layers",
        id="stray-placement",
    ),
    pytest.param(
        lambda info: msgspec.structs.replace(info, regions=()), MetadataError, "layer", id="no-regions"
    ),
]


@pytest.mark.parametrize(("corrupt", "error", "fact"), CORRUPTIONS)
def test_validate_engine_info_refuses_bad_descriptions(
    corrupt: Callable[[EngineInfo], EngineInfo], error: type[KvrayError], fact: str, make_info: MakeInfo
) -> None:
    layout = llama_gqa(num_blocks=4, num_layers=3)
    _, _, local_info, remote_info = pair(make_info, layout, layout)
    validate_engine_info(remote_info)  # the uncorrupted description is valid
    bad = corrupt(remote_info)
    with pytest.raises(error) as caught:
        validate_engine_info(bad)
    assert caught.value.engine_id == "decode-0"
    assert fact in caught.value.facts
    # A plan against it never exists: the cache validates before any offset is used.
    with pytest.raises(error):
        plan_transfer(local_info, bad, [0], [1])


def test_validate_block_major_stride_too_small(make_info: MakeInfo) -> None:
    layout = llama_gqa(num_blocks=4, num_layers=2, block_order=BlockOrder.BLOCK_MAJOR)
    _, _, _, info = pair(make_info, layout, layout)
    name = layer_name(info, 0)
    bad = corrupt_placement(info, name, block_stride=info.placements[name].part_nbytes)
    with pytest.raises(MetadataError):
        validate_engine_info(bad)


@pytest.mark.parametrize("order", list(BlockOrder))
@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
def test_published_backings_are_valid(name: str, order: BlockOrder, make_info: MakeInfo) -> None:
    layout = READY_LAYOUTS[name](num_blocks=3, block_order=order)
    validate_engine_info(make_info(Backing.allocate(layout), "decode-0"))


def test_an_empty_region_is_refused_when_described(make_info: MakeInfo) -> None:
    layout = llama_gqa(num_blocks=4, num_layers=3)
    _, _, _, remote_info = pair(make_info, layout, layout)
    with pytest.raises(MetadataError, match="positive length"):
        corrupt_region(remote_info, length=0)


@pytest.mark.parametrize("huge", ["region-length", "placement-offset"])
def test_absurd_wire_sizes_are_kvray_errors_not_crashes(huge: str, make_info: MakeInfo) -> None:
    """Sizes past 2**62 are refused where they enter: on construction, or on decoding."""
    layout = llama_gqa(num_blocks=4, num_layers=2)
    _, _, local_info, remote_info = pair(make_info, layout, layout)
    with pytest.raises(KvrayError):
        if huge == "region-length":
            bad = corrupt_region(remote_info, length=2**64 - 1)
        else:
            bad = corrupt_placement(remote_info, layer_name(remote_info, 1), offset=2**63 + 4096)
        bad = decode_engine_info(encode(bad))
        plan_transfer(local_info, bad, [0], [1])
    raw = msgspec.msgpack.decode(encode(remote_info))
    raw["regions"][0]["length"] = 2**64 - 1
    with pytest.raises(WireDecodeError, match="regions"):
        decode_engine_info(msgspec.msgpack.encode(raw))


# ---- (h) bounds of hand-made op tables ------------------------------------------------------


def op_table(*rows: tuple[int, int, int, int, int]) -> OpTable:
    columns = list(zip(*rows, strict=True))
    return OpTable(*(np.array(column, dtype=np.int64) for column in columns))


@pytest.fixture
def bounds_pair(make_info: MakeInfo) -> tuple[EngineInfo, EngineInfo]:
    layout = llama_gqa(num_blocks=4, num_layers=1)
    _, _, local_info, remote_info = pair(make_info, layout, layout)
    return local_info, remote_info


def test_check_bounds_accepts_ops_up_to_the_region_end(bounds_pair: tuple[EngineInfo, EngineInfo]) -> None:
    local_info, remote_info = bounds_pair
    local_length, remote_length = local_info.regions[0].length, remote_info.regions[0].length
    check_bounds(
        op_table((0, 0, 0, 0, 64), (0, local_length - 64, 0, remote_length - 64, 64)), local_info, remote_info
    )


@pytest.mark.parametrize(
    ("row", "side", "offset"),
    [
        pytest.param(
            lambda lo, ro: (0, 0, 0, ro - 32, 64), "remote", lambda lo, ro: ro - 32, id="past-remote-end"
        ),
        pytest.param(lambda lo, ro: (0, lo, 0, 0, 1), "local", lambda lo, ro: lo, id="at-local-end"),
        pytest.param(lambda lo, ro: (0, -64, 0, 0, 64), "local", lambda lo, ro: -64, id="negative-local"),
        pytest.param(lambda lo, ro: (0, 0, 0, -1, 64), "remote", lambda lo, ro: -1, id="negative-remote"),
        pytest.param(lambda lo, ro: (0, 0, 0, 0, 0), "local", lambda lo, ro: 0, id="zero-bytes"),
        pytest.param(lambda lo, ro: (0, 0, 0, 0, -64), "local", lambda lo, ro: 0, id="negative-bytes"),
    ],
)
def test_check_bounds_refuses_ops_outside_a_region(
    bounds_pair: tuple[EngineInfo, EngineInfo], row: Any, side: str, offset: Any
) -> None:
    local_info, remote_info = bounds_pair
    lengths = (local_info.regions[0].length, remote_info.regions[0].length)
    ops = op_table((0, 0, 0, 0, 64), row(*lengths))
    with pytest.raises(BoundsError) as caught:
        check_bounds(ops, local_info, remote_info)
    assert caught.value.side == side
    assert caught.value.op == 1
    assert caught.value.offset == offset(*lengths)
    assert caught.value.engine_id == (local_info if side == "local" else remote_info).engine_id


@pytest.mark.parametrize(
    ("local_region", "remote_region", "side"), [(0, 1, "remote"), (-1, 0, "local"), (3, 0, "local")]
)
def test_check_bounds_refuses_unknown_regions(
    bounds_pair: tuple[EngineInfo, EngineInfo], local_region: int, remote_region: int, side: str
) -> None:
    local_info, remote_info = bounds_pair
    with pytest.raises(BoundsError) as caught:
        check_bounds(op_table((local_region, 0, remote_region, 0, 64)), local_info, remote_info)
    assert caught.value.side == side
    assert caught.value.op == 0


def test_every_planned_op_is_inside_both_regions(make_info: MakeInfo) -> None:
    layout = READY_LAYOUTS["mixed"](num_blocks=6)
    _, _, local_info, remote_info = pair(make_info, layout, layout)
    plan = plan_transfer(local_info, remote_info, [5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5])
    for ops in (plan.ops, plan.unmerged):
        check_bounds(ops, local_info, remote_info)
        assert (ops.local_offset + ops.nbytes).max() <= local_info.regions[0].length
        assert (ops.remote_offset + ops.nbytes).max() <= remote_info.regions[0].length
        assert ops.local_offset.min() >= 0 and ops.remote_offset.min() >= 0


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(-(2**20), 2**20), st.integers(-4096, 4096), st.integers(-8, 4096)),
        min_size=1,
        max_size=6,
    ),
    ids=st.lists(st.integers(0, 300), min_size=1, max_size=20, unique=True),
    length=st.integers(1, 2**21),
)
def test_row_bounds_check_refuses_exactly_what_the_per_op_check_refuses(
    rows: list[tuple[int, int, int]], ids: list[int], length: int
) -> None:
    """The planner checks each row's two extreme blocks instead of every op: it must refuse a
    plan if and only if some single op leaves its region."""
    part_rows = PartRows(
        layers=("x",),
        region=np.zeros(len(rows), dtype=np.int64),
        base=np.array([r[0] for r in rows], dtype=np.int64),
        block_stride=np.array([r[1] for r in rows], dtype=np.int64),
        nbytes=np.array([r[2] for r in rows], dtype=np.int64),
        layer_starts=(0, len(rows)),
    )
    block_ids = np.array(ids, dtype=np.int64)
    region = msgspec.structs.replace(_one_region_info(length).regions[0], length=length)
    info = msgspec.structs.replace(_one_region_info(length), regions=(region,))
    count = block_ids.size
    every_op = (part_rows.base[:, None] + block_ids[None, :] * part_rows.block_stride[:, None]).ravel()
    try:
        check_ops(
            np.repeat(part_rows.region, count),
            every_op,
            np.repeat(part_rows.nbytes, count),
            [length],
            side="remote",
            engine_id="e",
        )
        per_op_ok = True
    except BoundsError:
        per_op_ok = False
    if per_op_ok:
        check_row_bounds(part_rows, block_ids, info, "remote")
    else:
        with pytest.raises(BoundsError):
            check_row_bounds(part_rows, block_ids, info, "remote")


def _one_region_info(length: int) -> EngineInfo:
    layout = KVLayout(
        layers=(LayerSpec(name="x", geometry=Geometry(block_size=1, entry_shape=(1,), dtype="uint8")),),
        num_blocks=1,
    )
    backing = Backing.allocate(layout)
    info = backing.engine_info(
        "e", 1, Role.DECODE, "n", backing.region_descriptors("e", 1, TransportKind.SHM, remote_writable=True)
    )
    backing.close()
    return info
