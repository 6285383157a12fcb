"""Checks on what an engine publishes (its `EngineInfo`, after `kvray.wire` decoded it): the
coordinator runs them on every registration, a writer on every peer before its first plan.
Pure code: no Ray, no devices.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from kvray.errors import BoundsError, MetadataError, WireDecodeError
from kvray.layout import Geometry, LayerPlacement
from kvray.wire import MAX_REGIONS, EngineInfo, writer_target

#: Most (layer, part, block) segments enumerated to prove an irregular placement disjoint;
#: the placements kvray and the engines it serves publish are checked in closed form instead.
MAX_ENUMERATED_SEGMENTS = 2**22


class _Row(NamedTuple):
    """The segments of one (layer, part): `nbytes` at `base + b * stride` for every block b."""

    region: int
    base: int
    stride: int
    nbytes: int
    layer: str


def validate_engine_info(info: EngineInfo) -> None:
    """Check that `info` describes memory it can honestly be written through.

    Regions belong to this engine incarnation and are numbered 0..n-1, and no two of them share
    a byte, neither by address nor in what a same-node writer opens (`wire.writer_target`);
    every layer of the layout has a placement consistent with its geometry; every byte any
    block of any layer can touch lies inside its region; and no two (layer, part, block)
    segments overlap, which is the shape the seed bug had on the wire (two layers at one
    address). The work grows with the number of layers, not of blocks: rows whose byte ranges
    do not meet are disjoint at once, and rows interleaved block by block (block-major, or K
    and V within a block) are checked within one block.
    """
    engine = info.engine_id
    if len(info.regions) > MAX_REGIONS:
        raise MetadataError(
            f"engine {engine!r} publishes {len(info.regions)} regions, more than the {MAX_REGIONS} "
            "kvray accepts",
            engine_id=engine,
            regions=len(info.regions),
        )
    address_spans: list[tuple[int, int, int]] = []
    target_spans: dict[bytes, list[tuple[int, int, int]]] = {}
    for index, region in enumerate(info.regions):
        if region.index != index or region.engine_id != engine or region.incarnation != info.incarnation:
            raise MetadataError(
                f"engine {engine!r}: region {index} is described as region {region.index} of "
                f"{region.engine_id!r} incarnation {region.incarnation}",
                engine_id=engine,
                region=index,
            )
        if region.length <= 0:
            raise MetadataError(
                f"engine {engine!r}: region {index} has length {region.length}",
                engine_id=engine,
                region=index,
            )
        address_spans.append((region.address, region.address + region.length, index))
        try:
            target = writer_target(region)
        except WireDecodeError as error:
            raise MetadataError(
                f"engine {engine!r}: region {index} has a malformed handle: {error}",
                engine_id=engine,
                region=index,
            ) from None
        if target is not None:
            opened, start = target
            target_spans.setdefault(opened, []).append((start, start + region.length, index))
    for spans, where in [(address_spans, "in memory")] + [
        (spans, "in the memory its handle names") for spans in target_spans.values()
    ]:
        overlap = _first_overlap(spans)
        if overlap is not None:
            first, second = overlap
            raise MetadataError(
                f"engine {engine!r}: regions {first[2]} and {second[2]} overlap {where}; one byte must "
                "belong to one region (two layers at one address is the bug kvray exists to stop)",
                engine_id=engine,
                region=second[2],
            )
    layer_names = set(info.layout.layer_names)
    stray = sorted(set(info.placements) - layer_names)
    if stray:
        raise MetadataError(
            f"engine {engine!r} places layers its layout does not have: {stray[:3]}",
            engine_id=engine,
            layers=stray,
        )
    rows: list[_Row] = []
    for spec in info.layout.layers:
        placement = info.placement(spec.name)
        _check_placement(info, spec.name, spec.geometry, placement)
        for part in range(placement.parts):
            part_start = placement.offset + part * placement.part_stride
            rows.append(
                _Row(placement.region, part_start, placement.block_stride, placement.part_nbytes, spec.name)
            )
    _check_segments_disjoint(info, rows)


def _first_overlap(spans: list[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...] | None:
    """Two of the half-open `(start, end, label)` spans that share a byte, if any (Python ints:
    nothing wraps)."""
    ordered = sorted(spans)
    for previous, following in itertools.pairwise(ordered):
        if following[0] < previous[1]:
            return previous, following
    return None


def _segment_overlap(info: EngineInfo, region: int, first: int, second: int) -> MetadataError:
    return MetadataError(
        f"engine {info.engine_id!r} places two KV segments over the same bytes: region "
        f"{region} offsets {first} and {second}",
        engine_id=info.engine_id,
        region=region,
        offset=second,
    )


def _check_segments_disjoint(info: EngineInfo, rows: list[_Row]) -> None:
    """No two (layer, part, block) segments share a byte (every row is already inside its region).

    Rows are grouped into clusters whose byte ranges `[base, base + (n-1)·stride + nbytes)`
    meet; a cluster of one row is disjoint from all others. Within a cluster whose rows share
    one stride and fit, block for block, in one window of that stride (block-major blocks, K
    and V interleaved by block), segments of different blocks lie in different windows, so the
    rows are disjoint exactly when their segments in block 0 are. Anything else is enumerated,
    up to `MAX_ENUMERATED_SEGMENTS`."""
    num_blocks = info.layout.num_blocks
    for row in rows:
        if num_blocks > 1 and row.stride < row.nbytes:
            raise _segment_overlap(info, row.region, row.base, row.base + row.stride)
    extents = sorted(
        (row.region, row.base, row.base + (num_blocks - 1) * row.stride + row.nbytes, number)
        for number, row in enumerate(rows)
    )
    cluster: list[_Row] = []
    cluster_region, cluster_end = -1, 0
    for region, start, end, number in extents:
        if region != cluster_region or start >= cluster_end:
            _check_cluster(info, cluster, num_blocks)
            cluster, cluster_region, cluster_end = [], region, end
        cluster.append(rows[number])
        cluster_end = max(cluster_end, end)
    _check_cluster(info, cluster, num_blocks)


def _check_cluster(info: EngineInfo, cluster: list[_Row], num_blocks: int) -> None:
    if len(cluster) < 2:
        return
    region = cluster[0].region
    if num_blocks == 1:
        first, second = sorted(cluster)[:2]
        raise _segment_overlap(info, region, first.base, second.base)
    window_start = min(row.base for row in cluster)
    stride = cluster[0].stride
    if all(row.stride == stride and row.base - window_start + row.nbytes <= stride for row in cluster):
        overlap = _first_overlap([(row.base, row.base + row.nbytes, 0) for row in cluster])
        if overlap is not None:
            raise _segment_overlap(info, region, overlap[0][0], overlap[1][0])
        return
    if len(cluster) * num_blocks > MAX_ENUMERATED_SEGMENTS:
        raise MetadataError(
            f"engine {info.engine_id!r} interleaves {len(cluster)} layer parts of region {region} "
            f"irregularly over {num_blocks} blocks; kvray proves such placements disjoint only up to "
            f"{MAX_ENUMERATED_SEGMENTS} segments (give interleaved parts one block stride)",
            engine_id=info.engine_id,
            region=region,
        )
    blocks = np.arange(num_blocks, dtype=np.int64)
    # Every segment lies inside its region (< 2**62 bytes), so no start or end wraps.
    starts = np.concatenate([row.base + blocks * row.stride for row in cluster])
    ends = np.concatenate([row.base + blocks * row.stride + row.nbytes for row in cluster])
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    overlapping = np.flatnonzero(starts[1:] < np.maximum.accumulate(ends)[:-1])
    if overlapping.size:
        at = int(overlapping[0])
        raise _segment_overlap(info, region, int(starts[at]), int(starts[at + 1]))


def _check_placement(info: EngineInfo, layer: str, geometry: Geometry, placement: LayerPlacement) -> None:
    engine = info.engine_id
    if placement.parts != geometry.parts or placement.part_nbytes != geometry.part_nbytes:
        raise MetadataError(
            f"engine {engine!r} layer {layer!r}: placement has {placement.parts} parts of "
            f"{placement.part_nbytes} bytes, its geometry {geometry.parts} of {geometry.part_nbytes}",
            engine_id=engine,
            layer=layer,
        )
    if placement.region >= len(info.regions):
        raise MetadataError(
            f"engine {engine!r} layer {layer!r} names region {placement.region}, "
            f"but the engine has {len(info.regions)}",
            engine_id=engine,
            layer=layer,
        )
    region_length = info.regions[placement.region].length
    layer_end = placement.end(info.layout.num_blocks)
    if layer_end > region_length:
        raise BoundsError(
            f"engine {engine!r} layer {layer!r} reaches byte {layer_end} of region "
            f"{placement.region}, which has {region_length}",
            engine_id=engine,
            layer=layer,
            offset=layer_end,
            region_length=region_length,
        )
