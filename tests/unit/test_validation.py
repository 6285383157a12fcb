"""`validate_engine_info` on placements a peer makes up: its verdict on every (layer, part,
block) segment matches enumerating them, and a few hundred bytes of `EngineInfo` claiming
millions of blocks cost the coordinator microseconds and kilobytes, not an enumeration."""

from __future__ import annotations

import contextlib
import itertools
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.errors import BoundsError, MetadataError
from kvray.layout import MAX_BLOCKS, Geometry, KVLayout, LayerPlacement, LayerSpec
from kvray.validation import validate_engine_info
from kvray.wire import EngineInfo, RegionDescriptor, Role, TransportKind, decode_engine_info, encode

PART = 64


def info_with(
    placed: list[tuple[int, int]], num_blocks: int, parts: int = 1, part_stride: int = 0
) -> EngineInfo:
    """One layer of `parts` parts of `PART` bytes per (offset, block stride) in `placed`, in
    one region long enough for all of them."""
    geometry = Geometry(block_size=1, entry_shape=(PART,), dtype="uint8", parts=parts)
    names = [f"layer{i}" for i in range(len(placed))]
    length = max(
        offset + (parts - 1) * part_stride + (num_blocks - 1) * stride + PART for offset, stride in placed
    )
    return EngineInfo(
        engine_id="decode-0",
        incarnation=1,
        role=Role.DECODE,
        node_id="node",
        layout=KVLayout(
            layers=tuple(LayerSpec(name=name, geometry=geometry) for name in names), num_blocks=num_blocks
        ),
        regions=(
            RegionDescriptor(
                engine_id="decode-0",
                incarnation=1,
                transport=TransportKind.SHM,
                index=0,
                address=1 << 20,
                length=length,
                remote_writable=True,
            ),
        ),
        placements={
            name: LayerPlacement(
                region=0,
                offset=offset,
                part_stride=part_stride,
                block_stride=stride,
                part_nbytes=PART,
                parts=parts,
            )
            for name, (offset, stride) in zip(names, placed, strict=True)
        },
    )


def enumerated_overlap(info: EngineInfo) -> bool:
    """Whether two (layer, part, block) segments share a byte, by listing every one of them."""
    segments = sorted(
        (placement.byte_offset(part, block), placement.byte_offset(part, block) + placement.part_nbytes)
        for placement in info.placements.values()
        for part in range(placement.parts)
        for block in range(info.layout.num_blocks)
    )
    return any(following[0] < previous[1] for previous, following in itertools.pairwise(segments))


# ---- a tiny message claiming millions of blocks -----------------------------------------------


CRAFTED = [
    # Two rows of one stride, one shifted by a stride and a half: disjoint, but not within one
    # window of the first row's base (the old check enumerated 2**22 segments to see it).
    pytest.param([(0, 2 * PART), (3 * PART, 2 * PART)], None, id="one-stride-disjoint"),
    # The same rows, the second a thousand blocks on: its segments land on the first row's.
    pytest.param([(0, 2 * PART), (2000 * PART, 2 * PART)], "same bytes", id="one-stride-overlap"),
    # Different strides interleaved over the same bytes: refused, whatever an enumeration says.
    pytest.param([(0, 3 * PART), (PART, 5 * PART)], "different block strides", id="two-strides"),
]


@pytest.mark.parametrize(("placed", "refused"), CRAFTED)
def test_a_tiny_irregular_engine_info_is_judged_without_enumerating_blocks(
    placed: list[tuple[int, int]], refused: str | None
) -> None:
    data = encode(info_with(placed, num_blocks=MAX_BLOCKS // 8))
    assert len(data) < 1024
    info = decode_engine_info(data)
    with contextlib.suppress(MetadataError):
        validate_engine_info(info)  # warm: imports, caches
    tracemalloc.start()
    started = time.perf_counter()
    try:
        validate_engine_info(info)
    except MetadataError as error:
        outcome: str | None = str(error)
    else:
        outcome = None
    finally:
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert (outcome is None) == (refused is None), outcome
    if refused is not None:
        assert outcome is not None and refused in outcome
    assert elapsed < 0.05, f"{elapsed * 1000:.0f} ms to validate {len(data)} bytes"
    assert peak < 1 << 20, f"{peak >> 20} MiB to validate {len(data)} bytes"


# ---- the verdict is the enumeration's --------------------------------------------------------


@st.composite
def one_stride_placements(draw: st.DrawFn) -> EngineInfo:
    """A few layers sharing one block stride, at any offsets (K and V at any distance)."""
    num_blocks = draw(st.integers(1, 6))
    stride = PART * draw(st.integers(1, 6)) + draw(st.sampled_from([0, 0, 8, 40]))
    parts = draw(st.integers(1, 2))
    part_stride = draw(st.integers(0, 8 * stride))
    offsets = draw(st.lists(st.integers(0, 12 * stride), min_size=1, max_size=5))
    return info_with([(offset, stride) for offset in offsets], num_blocks, parts, part_stride)


@st.composite
def any_placements(draw: st.DrawFn) -> EngineInfo:
    num_blocks = draw(st.integers(1, 5))
    placed = draw(
        st.lists(st.tuples(st.integers(0, 40 * PART), st.integers(0, 8 * PART)), min_size=1, max_size=5)
    )
    return info_with(placed, num_blocks)


def verdict(info: EngineInfo) -> bool:
    """True when `validate_engine_info` accepts `info` (every layer fits its region)."""
    try:
        validate_engine_info(info)
    except BoundsError:
        raise
    except MetadataError:
        return False
    return True


@settings(max_examples=400)
@given(one_stride_placements())
def test_one_stride_placements_are_accepted_exactly_when_disjoint(info: EngineInfo) -> None:
    assert verdict(info) == (not enumerated_overlap(info))


@settings(max_examples=400)
@given(any_placements())
def test_no_overlapping_placement_is_ever_accepted(info: EngineInfo) -> None:
    if enumerated_overlap(info):
        assert not verdict(info)
