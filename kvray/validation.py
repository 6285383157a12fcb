"""Checks on what an engine publishes (its `EngineInfo`, after `kvray.wire` decoded it): the
coordinator runs them on every registration, a writer on every peer before its first plan.
Pure code: no Ray, no devices.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Mapping
from typing import NamedTuple

from kvray.errors import BoundsError, LayoutError, MetadataError, WireDecodeError
from kvray.layout import Geometry, KVLayout, LayerPlacement, head_axis_size
from kvray.wire import MAX_REGIONS, EngineInfo, writer_target


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
    a byte, neither by address (where one is published: 0 says the transport writes by offset)
    nor in what a same-node writer opens (`wire.writer_target`);
    every layer of the layout has a placement consistent with its geometry, and holds the
    KV heads its TP rank holds (`KVLayout.tp`) where its block layout names them; every byte any
    block of any layer can touch lies inside its region; and no two (layer, part, block)
    segments overlap, which is the shape the seed bug had on the wire (two layers at one
    address). The work grows with the number of layers, never with the number of blocks a peer
    claims: rows whose byte ranges do not meet are disjoint at once, and rows interleaved block
    by block (block-major, or K and V within a block) are decided by arithmetic on their bases
    and their one block stride (`_check_one_stride`).
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
        if region.address:  # 0: the transport reaches the region by offset, not by address
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
    for spec in info.layout.layers:
        _check_placement(info, spec.name, spec.geometry, info.placement(spec.name))
    placements = {name: info.placement(name) for name in info.layout.layer_names}
    check_layers_disjoint(engine, info.layout, placements)
    _check_heads(info)


def _check_heads(info: EngineInfo) -> None:
    """A rank of a model whose KV heads TP splits holds its share of them in every layer that
    says where its heads are: a planner slices its blocks by that count."""
    tp = info.layout.tp
    if not tp.sharded:
        return
    for spec in info.layout.layers:
        try:
            heads = head_axis_size(spec.geometry.block_layout)
        except LayoutError as error:
            raise MetadataError(
                f"engine {info.engine_id!r} layer {spec.name!r}: {error}",
                engine_id=info.engine_id,
                layer=spec.name,
            ) from None
        if heads is not None and heads != tp.local_heads:
            raise MetadataError(
                f"engine {info.engine_id!r} layer {spec.name!r} holds {heads} KV heads a block, but as "
                f"TP rank {tp.rank} of {tp.size} of a model with {tp.kv_heads} KV heads it holds "
                f"{tp.local_heads}",
                engine_id=info.engine_id,
                layer=spec.name,
                heads=heads,
                local_heads=tp.local_heads,
            )


def check_layers_disjoint(engine: str, layout: KVLayout, placements: Mapping[str, LayerPlacement]) -> None:
    """No two (layer, part, block) segments of `placements` share a byte (`MetadataError`
    naming the region and offsets otherwise): the seed bug's shape, two layers at one address.
    Each placement is taken as lying inside its region; `validate_engine_info` checks that."""
    rows: list[_Row] = []
    for spec in layout.layers:
        placement = placements[spec.name]
        for part in range(placement.parts):
            part_start = placement.offset + part * placement.part_stride
            rows.append(
                _Row(placement.region, part_start, placement.block_stride, placement.part_nbytes, spec.name)
            )
    _check_segments_disjoint(engine, layout.num_blocks, rows)


def _first_overlap(spans: list[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...] | None:
    """Two of the half-open `(start, end, label)` spans that share a byte, if any (Python ints:
    nothing wraps)."""
    ordered = sorted(spans)
    for previous, following in itertools.pairwise(ordered):
        if following[0] < previous[1]:
            return previous, following
    return None


def _segment_overlap(engine: str, region: int, first: int, second: int) -> MetadataError:
    return MetadataError(
        f"engine {engine!r} places two KV segments over the same bytes: region "
        f"{region} offsets {first} and {second}",
        engine_id=engine,
        region=region,
        offset=second,
    )


def _check_segments_disjoint(engine: str, num_blocks: int, rows: list[_Row]) -> None:
    """No two (layer, part, block) segments share a byte (every row is already inside its region).

    Arithmetic on each row's base, stride and extent, never one segment at a time. Rows are
    grouped into clusters whose byte ranges `[base, base + (n-1)·stride + nbytes)` meet; a
    cluster of one row is disjoint from all others. The rows of a larger cluster must share one
    block stride (`_check_one_stride` decides those exactly); rows of different strides
    interleaved over the same bytes are refused, since no placement kvray or an engine it
    serves publishes looks like that."""
    for row in rows:
        if num_blocks > 1 and row.stride < row.nbytes:
            raise _segment_overlap(engine, row.region, row.base, row.base + row.stride)
    extents = sorted(
        (row.region, row.base, row.base + (num_blocks - 1) * row.stride + row.nbytes, number)
        for number, row in enumerate(rows)
    )
    cluster: list[_Row] = []
    cluster_region, cluster_end = -1, 0
    for region, start, end, number in extents:
        if region != cluster_region or start >= cluster_end:
            _check_cluster(engine, cluster, num_blocks)
            cluster, cluster_region, cluster_end = [], region, end
        cluster.append(rows[number])
        cluster_end = max(cluster_end, end)
    _check_cluster(engine, cluster, num_blocks)


def _check_cluster(engine: str, cluster: list[_Row], num_blocks: int) -> None:
    if len(cluster) < 2:
        return
    region = cluster[0].region
    if num_blocks == 1:
        first, second = sorted(cluster)[:2]
        raise _segment_overlap(engine, region, first.base, second.base)
    strides = sorted({row.stride for row in cluster})
    if len(strides) > 1:
        raise MetadataError(
            f"engine {engine!r} interleaves layer parts of region {region} with different "
            f"block strides ({strides[0]} and {strides[1]} bytes) over the same bytes; kvray proves "
            "interleaved parts disjoint only when they share one block stride",
            engine_id=engine,
            region=region,
            strides=strides[:2],
        )
    _check_one_stride(engine, cluster, num_blocks)


class _Piece(NamedTuple):
    """Bytes [start, end) of every window from `first_window` to `last_window` (windows of one
    block stride): all of a row's segments, or the parts of them that cross into the next
    window. The segment in window w is the row's block `w - block0_window`."""

    start: int
    end: int
    first_window: int
    last_window: int
    block0_window: int
    row: _Row


def _check_one_stride(engine: str, cluster: list[_Row], num_blocks: int) -> None:
    """Rows sharing one block stride (at least their longest segment): disjoint, exactly.

    Cut the region into windows of one stride. A row whose base is `window · stride + start`
    covers bytes [start, start + nbytes) of windows `window` to `window + num_blocks - 1`, and
    where that crosses a window's end, bytes [0, start + nbytes - stride) of the windows after
    them: at most two pieces, each one byte range times one window range. Two rows share a byte
    exactly when a piece of one meets a piece of the other in both ranges. A sweep over the
    byte ranges finds the first such pair: the pieces it holds open all contain the byte it is
    at, so (none having met yet) their window ranges are disjoint, and a new piece is compared
    with the open piece whose window range starts nearest below its end only."""
    stride = cluster[0].stride
    pieces: list[_Piece] = []
    for row in cluster:
        window, start = divmod(row.base, stride)
        end = start + row.nbytes
        last_window = window + num_blocks - 1
        pieces.append(_Piece(start, min(end, stride), window, last_window, window, row))
        if end > stride:
            pieces.append(_Piece(0, end - stride, window + 1, last_window + 1, window + 1, row))
    pieces.sort(key=lambda piece: piece.start)
    open_firsts: list[int] = []
    open_pieces: dict[int, _Piece] = {}
    closing: list[tuple[int, int]] = []
    for piece in pieces:
        while closing and closing[0][0] <= piece.start:
            _, first_window = heapq.heappop(closing)
            del open_firsts[bisect.bisect_left(open_firsts, first_window)]
            del open_pieces[first_window]
        below = bisect.bisect_right(open_firsts, piece.last_window)
        if below:
            neighbour = open_pieces[open_firsts[below - 1]]
            if neighbour.last_window >= piece.first_window:
                window = max(piece.first_window, neighbour.first_window)
                first, second = sorted(
                    (
                        neighbour.row.base + (window - neighbour.block0_window) * stride,
                        piece.row.base + (window - piece.block0_window) * stride,
                    )
                )
                raise _segment_overlap(engine, piece.row.region, first, second)
        bisect.insort(open_firsts, piece.first_window)
        open_pieces[piece.first_window] = piece
        heapq.heappush(closing, (piece.end, piece.first_window))


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
