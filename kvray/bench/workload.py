"""Benchmark workloads: which bytes move, described once for every contender.

A workload is a KV layout (the same byte layout on both sides), a request's source and
destination block ids (scattered), and the layout's segments: one per (layer, part), each a
run of `nbytes` bytes per block at `offset + block * block_stride`. kvray plans its own ops from
the layout; the other contenders gather and scatter the same segments the way a user of theirs
would (numpy fancy indexing, one descriptor per block and segment).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvray.layout import BlockOrder, Geometry, Int64Array, KVLayout, LayerSpec, ceil_div, deepseek_v3

ByteArray = npt.NDArray[np.uint8]

KIB = 2**10
MIB = 2**20


@dataclass(frozen=True)
class Segment:
    """One (layer, part) of a layout: block b's bytes are [offset + b·block_stride, … + nbytes)."""

    name: str
    offset: int
    block_stride: int
    nbytes: int


@dataclass(frozen=True)
class Workload:
    """One benchmark case: a layout and a request's scattered blocks on both sides."""

    #: Short key for JSON and the command line ("a", "b-2k", "c-4KiB").
    key: str
    #: Which workload family: "a" (64 MiB in 16 KiB blocks), "b" (DeepSeek-V3), "c" (sweep).
    family: str
    title: str
    layout: KVLayout
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    #: Seeds the source pattern (see `verify.pattern_rows`).
    seed: int

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        segments = []
        for name, placement in self.layout.placements().items():
            for part in range(placement.parts):
                segments.append(
                    Segment(
                        name=name if placement.parts == 1 else f"{name}[{part}]",
                        offset=placement.offset + part * placement.part_stride,
                        block_stride=placement.block_stride,
                        nbytes=placement.part_nbytes,
                    )
                )
        return tuple(segments)

    @property
    def blocks(self) -> int:
        return len(self.src_blocks)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one request block over every segment (what one block id carries)."""
        return sum(segment.nbytes for segment in self.segments)

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_nbytes

    @property
    def region_nbytes(self) -> int:
        """Bytes of one side's whole pool (every block of every layer)."""
        return self.layout.nbytes

    @property
    def descriptors(self) -> int:
        """Copies a per-block transfer layer issues: one per block and segment."""
        return self.blocks * len(self.segments)

    def src_ids(self) -> Int64Array:
        return np.asarray(self.src_blocks, dtype=np.int64)

    def dst_ids(self) -> Int64Array:
        return np.asarray(self.dst_blocks, dtype=np.int64)


def segment_rows(pool: ByteArray, segment: Segment, num_blocks: int) -> ByteArray:
    """A [num_blocks, nbytes] view of a segment's bytes inside a pool (no copy)."""
    if segment.offset + (num_blocks - 1) * segment.block_stride + segment.nbytes > pool.size:
        raise ValueError(f"segment {segment.name} reaches past the pool's {pool.size} bytes")
    return np.lib.stride_tricks.as_strided(
        pool[segment.offset :], shape=(num_blocks, segment.nbytes), strides=(segment.block_stride, 1)
    )


def gather(
    pool: ByteArray, workload: Workload, blocks: Int64Array, out: ByteArray | None = None
) -> ByteArray:
    """The request's bytes, segment by segment, block by block, in one contiguous buffer: what a
    user without kvray sends (numpy fancy indexing, one `np.take` per segment)."""
    if out is None:
        out = np.empty(workload.nbytes, dtype=np.uint8)
    start = 0
    for segment in workload.segments:
        stop = start + blocks.size * segment.nbytes
        rows = segment_rows(pool, segment, workload.layout.num_blocks)
        np.take(rows, blocks, axis=0, out=out[start:stop].reshape(blocks.size, segment.nbytes))
        start = stop
    return out


def scatter(pool: ByteArray, workload: Workload, blocks: Int64Array, payload: ByteArray) -> None:
    """The receiving half of `gather`: each segment's rows into the destination blocks."""
    start = 0
    for segment in workload.segments:
        stop = start + blocks.size * segment.nbytes
        rows = segment_rows(pool, segment, workload.layout.num_blocks)
        rows[blocks] = payload[start:stop].reshape(blocks.size, segment.nbytes)
        start = stop


def _scattered(pool_blocks: int, count: int, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    src = rng.permutation(pool_blocks)[:count]
    dst = rng.permutation(pool_blocks)[:count]
    return tuple(int(b) for b in src), tuple(int(b) for b in dst)


def uniform(key: str, family: str, total_nbytes: int, block_nbytes: int, seed: int) -> Workload:
    """`total_nbytes` as blocks of `block_nbytes` scattered over a pool twice the request."""
    tokens = 16
    geometry = Geometry(block_size=tokens, entry_shape=(block_nbytes // tokens,), dtype="uint8")
    count = total_nbytes // block_nbytes
    layout = KVLayout(layers=(LayerSpec(name="kv", geometry=geometry),), num_blocks=2 * count)
    src, dst = _scattered(2 * count, count, seed)
    title = f"{_size(total_nbytes)} as {count} x {_size(block_nbytes)} scattered blocks"
    return Workload(
        key=key, family=family, title=title, layout=layout, src_blocks=src, dst_blocks=dst, seed=seed
    )


def deepseek_request(tokens: int, seed: int, block_order: BlockOrder = BlockOrder.LAYER_MAJOR) -> Workload:
    """A DeepSeek-V3-style request (61 MLA layers + indexer, 64 tokens a block), scattered over a
    pool half as large again (an 8k-token request is 550 MB, its pool 825 MB a side)."""
    count = ceil_div(tokens, 64)
    pool = count + max(1, count // 2)
    layout = deepseek_v3(pool, block_order)
    src, dst = _scattered(pool, count, seed)
    label = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
    title = f"DeepSeek-V3 request, {label} tokens: 61 MLA + indexer, {count} scattered blocks of 64"
    return Workload(
        key=f"b-{label}", family="b", title=title, layout=layout, src_blocks=src, dst_blocks=dst, seed=seed
    )


def sweep_sizes(quick: bool) -> Sequence[int]:
    return (4 * KIB, 256 * KIB) if quick else (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB)


def workloads(quick: bool) -> list[Workload]:
    """The cases of one run: (a), (b) at two lengths, (c) the block-size sweep.

    (a) doubles as the sweep's 16 KiB point (same bytes, same block size), so it is run once.
    """
    total = 8 * MIB if quick else 64 * MIB
    cases = [uniform("a", "a", total, 16 * KIB, seed=1)]
    for tokens in (256,) if quick else (2048, 8192):
        cases.append(deepseek_request(tokens, seed=2 + tokens))
    for size in sweep_sizes(quick):
        if size != 16 * KIB:
            cases.append(uniform(f"c-{_size(size).replace(' ', '')}", "c", total, size, seed=3 + size))
    return cases


def _size(nbytes: int) -> str:
    if nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    return f"{nbytes // KIB} KiB"
