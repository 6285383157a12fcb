"""Layout arithmetic: geometry sizes, validation, and where every (layer, part, block) lands."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.errors import LayoutError, UnknownLayerError
from kvray.layout import (
    DTYPE_ITEMSIZE,
    READY_LAYOUTS,
    SEGMENT_ALIGNMENT,
    BlockOrder,
    Geometry,
    KVLayout,
    LayerPlacement,
    LayerSpec,
    align_up,
    ceil_div,
    deepseek_v3,
    llama_gqa,
    per_layer_placement,
)

MLA = Geometry(block_size=64, entry_shape=(576,), dtype="bfloat16")
INDEXER = Geometry(block_size=64, entry_shape=(132,), dtype="uint8")
LLAMA_KV = Geometry(block_size=16, entry_shape=(8, 128), dtype="float16", parts=2)


# ---- rounding -------------------------------------------------------------------------------


@given(st.integers(0, 2**70), st.integers(1, 2**40))
def test_ceil_div_and_align_up_are_exact(value: int, divisor: int) -> None:
    quotient = ceil_div(value, divisor)
    assert quotient - 1 < Fraction(value, divisor) <= quotient
    aligned = align_up(value, divisor)
    assert aligned % divisor == 0 and value <= aligned < value + divisor


# ---- geometry sizes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("geometry", "entry_nbytes", "part_nbytes", "block_nbytes"),
    [
        (MLA, 576 * 2, 64 * 576 * 2, 73728),
        (INDEXER, 132, 64 * 132, 8448),
        (LLAMA_KV, 8 * 128 * 2, 16 * 8 * 128 * 2, 2 * 16 * 8 * 128 * 2),
        (Geometry(block_size=3, entry_shape=(5, 7), dtype="float32"), 140, 420, 420),
        (Geometry(block_size=2, entry_shape=(3,), dtype="float8_e4m3fn", parts=2), 3, 6, 12),
    ],
    ids=["mla", "indexer", "llama-kv", "float32-2d", "fp8-kv"],
)
def test_geometry_sizes(geometry: Geometry, entry_nbytes: int, part_nbytes: int, block_nbytes: int) -> None:
    assert geometry.entry_nbytes == entry_nbytes
    assert geometry.part_nbytes == part_nbytes
    assert geometry.block_nbytes == block_nbytes
    assert geometry.itemsize == DTYPE_ITEMSIZE[geometry.dtype]


def test_mla_block_is_73728_bytes() -> None:
    assert MLA.block_nbytes == 73728


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named", "fact"),
    [
        ({"block_size": 0}, "block_size", "block_size"),
        ({"block_size": -16}, "block_size", "block_size"),
        ({"entry_shape": ()}, "entry_shape", "entry_shape"),
        ({"entry_shape": (8, 0)}, "entry_shape", "entry_shape"),
        ({"entry_shape": (-1,)}, "entry_shape", "entry_shape"),
        ({"dtype": "float13"}, "float13", "dtype"),
        ({"dtype": "torch.bfloat16"}, "torch.bfloat16", "dtype"),
        ({"parts": 257}, "parts", "parts"),
        ({"parts": 0}, "parts", "parts"),
    ],
)
def test_bad_geometry_raises_layout_error(kwargs: dict[str, object], named: str, fact: str) -> None:
    fields: dict[str, object] = {"block_size": 16, "entry_shape": (8, 128), "dtype": "float16", "parts": 2}
    fields.update(kwargs)
    with pytest.raises(LayoutError, match=named) as caught:
        Geometry(**fields)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError)
    assert caught.value.facts[fact] == kwargs[fact]


def test_empty_layout_raises() -> None:
    with pytest.raises(LayoutError, match="at least one layer"):
        KVLayout(layers=(), num_blocks=4)


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_non_positive_num_blocks_raises(num_blocks: int) -> None:
    layers = (LayerSpec(name="l0", geometry=MLA),)
    with pytest.raises(LayoutError, match="num_blocks") as caught:
        KVLayout(layers=layers, num_blocks=num_blocks)
    assert caught.value.num_blocks == num_blocks


def test_duplicate_layer_names_raise() -> None:
    layers = (
        LayerSpec(name="dense0", geometry=MLA),
        LayerSpec(name="dense1", geometry=MLA),
        LayerSpec(name="dense0", geometry=INDEXER),
    )
    with pytest.raises(LayoutError, match="dense0") as caught:
        KVLayout(layers=layers, num_blocks=4)
    assert caught.value.layers == ["dense0"]


def test_empty_layer_name_raises() -> None:
    with pytest.raises(LayoutError, match="name"):
        LayerSpec(name="", geometry=MLA)


@pytest.mark.parametrize("field", ["region", "offset", "part_stride", "block_stride"])
def test_negative_placement_raises(field: str) -> None:
    fields = {
        "region": 0,
        "offset": 0,
        "part_stride": 4096,
        "block_stride": 64,
        "part_nbytes": 64,
        "parts": 2,
    }
    LayerPlacement(**fields)  # the unchanged fields are valid
    fields[field] = -64
    with pytest.raises(LayoutError, match=field) as caught:
        LayerPlacement(**fields)
    assert caught.value.facts == {field: -64}


@pytest.mark.parametrize(("part_nbytes", "parts"), [(0, 1), (-64, 1), (64, 0), (64, 257)])
def test_placement_needs_positive_part_and_a_bounded_number_of_parts(part_nbytes: int, parts: int) -> None:
    with pytest.raises(LayoutError):
        LayerPlacement(
            region=0, offset=0, part_stride=64, block_stride=64, part_nbytes=part_nbytes, parts=parts
        )


def test_unknown_layer_lookup_raises_unknown_layer_error() -> None:
    layout = llama_gqa(num_blocks=4, num_layers=2)
    with pytest.raises(UnknownLayerError) as caught:
        layout.layer("model.layers.2.self_attn.kv")
    assert caught.value.layer == "model.layers.2.self_attn.kv"
    with pytest.raises(UnknownLayerError):
        layout.tensor_shape("nope")


# ---- placements: property over random layouts -----------------------------------------------

geometries = st.builds(
    Geometry,
    block_size=st.integers(1, 64),
    entry_shape=st.lists(st.integers(1, 24), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from(sorted(DTYPE_ITEMSIZE)),
    parts=st.sampled_from([1, 2]),
)


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    layer_geometries = draw(st.lists(geometries, min_size=1, max_size=6))
    layers = tuple(
        LayerSpec(name=f"model.layers.{index}", geometry=geometry)
        for index, geometry in enumerate(layer_geometries)
    )
    return KVLayout(
        layers=layers,
        num_blocks=draw(st.integers(1, 20)),
        block_order=draw(st.sampled_from(list(BlockOrder))),
    )


def segments(layout: KVLayout) -> list[tuple[int, int, str, int, int]]:
    """(start, end, layer, part, block) of every segment, from the layout's placements."""
    placements = layout.placements()
    found = []
    for spec in layout.layers:
        placement = placements[spec.name]
        for part in range(spec.geometry.parts):
            for block in range(layout.num_blocks):
                start = placement.byte_offset(part, block)
                found.append((start, start + placement.part_nbytes, spec.name, part, block))
    return found


@settings(max_examples=150)
@given(layouts())
def test_placements_are_disjoint_aligned_and_inside_the_layout(layout: KVLayout) -> None:
    placements = layout.placements()
    assert list(placements) == list(layout.layer_names)
    for spec in layout.layers:
        placement = placements[spec.name]
        assert placement.region == 0
        assert placement.parts == spec.geometry.parts
        assert placement.part_nbytes == spec.geometry.part_nbytes
        assert placement.offset % SEGMENT_ALIGNMENT == 0
        assert placement.end(layout.num_blocks) <= layout.nbytes

    found = sorted(segments(layout))
    assert len(found) == layout.num_blocks * sum(spec.geometry.parts for spec in layout.layers)
    itemsizes = {spec.name: spec.geometry.itemsize for spec in layout.layers}
    for start, end, name, _part, _block in found:
        assert 0 <= start < end <= layout.nbytes
        assert start % itemsizes[name] == 0
    for (_, previous_end, *previous), (start, _, *current) in itertools.pairwise(found):
        assert previous_end <= start, f"{previous} overlaps {current}"

    data_nbytes = sum(end - start for start, end, *_ in found)
    assert data_nbytes == sum(layout.layer_nbytes(name) for name in layout.layer_names)
    # Padding is only ever the rounding of segment starts to SEGMENT_ALIGNMENT.
    padding_units = len(layout.layers) * (
        layout.num_blocks if layout.block_order is BlockOrder.BLOCK_MAJOR else 1
    )
    assert layout.nbytes - data_nbytes < SEGMENT_ALIGNMENT * padding_units


@settings(max_examples=100)
@given(layouts().filter(lambda layout: layout.block_order is BlockOrder.BLOCK_MAJOR))
def test_block_major_block_is_one_contiguous_span(layout: KVLayout) -> None:
    block_stride = layout.block_stride
    assert block_stride >= sum(spec.geometry.block_nbytes for spec in layout.layers)
    assert layout.nbytes == block_stride * layout.num_blocks
    for start, end, name, part, block in segments(layout):
        span_start = block * block_stride
        assert span_start <= start and end <= span_start + block_stride, (name, part, block)
    # Same layer, next block: exactly one block stride further.
    for placement in layout.placements().values():
        assert placement.block_stride == block_stride
        assert placement.part_stride == placement.part_nbytes


@settings(max_examples=100)
@given(layouts().filter(lambda layout: layout.block_order is BlockOrder.LAYER_MAJOR))
def test_layer_major_layer_is_one_contiguous_slab(layout: KVLayout) -> None:
    by_layer: dict[str, list[tuple[int, int]]] = {}
    for start, end, name, _part, _block in segments(layout):
        by_layer.setdefault(name, []).append((start, end))
    for name, spans in by_layer.items():
        spans.sort()
        assert spans[-1][1] - spans[0][0] == layout.layer_nbytes(name)
        for (_, previous_end), (start, _) in itertools.pairwise(spans):
            assert previous_end == start
        # A layer's own tensor (the adopt path) has the same strides, starting at 0.
        shared = layout.placements()[name]
        own = per_layer_placement(layout, name, region=3)
        assert (own.region, own.offset) == (3, 0)
        assert (own.part_stride, own.block_stride) == (shared.part_stride, shared.block_stride)


@settings(max_examples=50)
@given(layouts())
def test_tensor_shape_matches_bytes(layout: KVLayout) -> None:
    for spec in layout.layers:
        shape = layout.tensor_shape(spec.name)
        geometry = spec.geometry
        expected = (layout.num_blocks, geometry.block_size, *geometry.entry_shape)
        assert shape == ((2, *expected) if geometry.parts == 2 else expected)
        elements = 1
        for dim in shape:
            elements *= dim
        assert elements * geometry.itemsize == layout.layer_nbytes(spec.name)


# ---- ready-made layouts ---------------------------------------------------------------------


@pytest.mark.parametrize("order", list(BlockOrder))
@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
def test_ready_layouts_build_in_both_orders(name: str, order: BlockOrder) -> None:
    layout = READY_LAYOUTS[name](num_blocks=8, block_order=order)
    assert layout.block_order is order
    assert layout.num_blocks == 8
    found = sorted(segments(layout))
    for (_, previous_end, *_), (start, *_) in itertools.pairwise(found):
        assert previous_end <= start
    assert found[-1][1] <= layout.nbytes


def test_deepseek_v3_has_61_mla_layers_and_one_indexer() -> None:
    layout = deepseek_v3(num_blocks=4)
    geometries = [spec.geometry for spec in layout.layers]
    assert len(geometries) == 62
    assert geometries.count(MLA) == 61
    assert geometries.count(INDEXER) == 1
    assert len(set(layout.layer_names)) == 62
    assert layout.nbytes == 4 * (61 * 73728 + 8448)


def test_llama_has_split_kv_layers() -> None:
    layout = llama_gqa(num_blocks=4)
    assert len(layout.layers) == 32
    assert all(spec.geometry == LLAMA_KV for spec in layout.layers)
    assert layout.tensor_shape(layout.layer_names[0]) == (2, 4, 16, 8, 128)


def test_equal_layouts_place_equally_and_different_orders_differ() -> None:
    layer_major = llama_gqa(num_blocks=4, num_layers=2)
    block_major = llama_gqa(num_blocks=4, num_layers=2, block_order=BlockOrder.BLOCK_MAJOR)
    assert layer_major.placements() == llama_gqa(num_blocks=4, num_layers=2).placements()
    assert layer_major.placements() != block_major.placements()
    assert layer_major.nbytes == block_major.nbytes == 2 * 4 * LLAMA_KV.block_nbytes
