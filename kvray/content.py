"""Content digests: one number for the bytes a transfer moved and where each went, computed by
the executor as it copies them (the C copy pool for shm and loopback, the ray receiver's
scatter) and, independently, by the writer from its own blocks and the two engines' layouts
(`reference`), never from its plan or offset cache. The decode side takes a request only when
the two agree (and its placement digest, `kvray.placement`, does too).

The definition, over 32-bit little-endian words of a source region:
- a source byte at offset o of region s adds `byte << 8 * (o % 4)` times `weight(s, o // 4)`,
  an odd 32-bit value mixed from the word's index and the region's seed: so a bit flipped,
  a byte zeroed or two words swapped changes the sum (a flipped bit by an odd multiple of a
  power of two below 2**64, never zero);
- the sum of a stretch of bytes bound for one place is multiplied by an odd 64-bit factor of
  (source region, destination region, destination offset - source offset): bytes that went to
  another place than the layouts say (a block moved, two blocks swapped) count differently;
- all of it is added mod 2**64, so executors may split, merge and spread ops over threads and
  the sums still add up; a stretch of bytes, and any set of them, is the sum of its parts.

Not a defence against a forger (the notice's channel authenticates the writer): a checksum
against faults. Structured corruptions that defeat plain sums (+1 -2 +1 patterns, equal-sum
blocks swapped) are caught because every word has its own pseudo-random weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from kvray.errors import PlanError
from kvray.layout import Int64Array, KVLayout, LayerPlacement
from kvray.placement import MASK64
from kvray.tensor_parallel import head_runs, shared_heads

_hash_ranges: Callable[..., bytes] | None
try:
    from kvray._copy_pool import hash_ranges as _hash_ranges
except ImportError:  # a source checkout without a build: numpy computes the same
    _hash_ranges = None

_M1: Final = 0xBF58476D1CE4E5B9
_M2: Final = 0x94D049BB133111EB


def mix64(value: int) -> int:
    """SplitMix64's finalizer (what the C executor's `mix64` computes)."""
    z = value & MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def region_seed(region: int) -> int:
    """The 32-bit seed of a source region's word weights."""
    return mix64(0xC0FFEE + region) & 0xFFFFFFFF


def pair_salt(src_region: int, dst_region: int) -> int:
    """The salt of destination factors between two regions."""
    return mix64(((src_region + 1) << 32) | (dst_region + 1))


def destination_factor(salt: int, delta: int) -> int:
    """The odd factor of bytes moved `delta` bytes (destination offset - source offset)."""
    return mix64(salt ^ (delta & MASK64)) | 1


# ---- word weights, numpy (the C executor's `word_weight`) -------------------------------------


def _fmix32(h: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _weights(seed: int, words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    high = _fmix32((np.uint32(seed) ^ (words >> np.uint64(32)).astype(np.uint32)) ^ np.uint32(0x9E3779B9))
    low = words.astype(np.uint32)
    return (_fmix32(low ^ high) | np.uint32(1)).astype(np.uint64)


def hash_bytes(data: npt.NDArray[np.uint8], offset: int, seed: int) -> int:
    """The sum of `data`, the bytes at `offset` onwards of a region whose seed is `seed`."""
    if data.size == 0:
        return 0
    at = np.arange(offset, offset + data.size, dtype=np.uint64)
    shifted = data.astype(np.uint64) << ((at & np.uint64(3)) * np.uint64(8))
    with np.errstate(over="ignore"):
        return int((shifted * _weights(seed, at >> np.uint64(2))).sum(dtype=np.uint64))


def hash_ranges(
    region: npt.NDArray[np.uint8],
    offsets: Int64Array,
    nbytes: Int64Array,
    seed: int,
    logical: Int64Array | None = None,
) -> list[int]:
    """Each range's sum, over a buffer's bytes (a 1-D uint8 array): the C routine when it is
    built (GIL released), else numpy. `logical`: the offsets the ranges' bytes are hashed at,
    when the buffer is a staged copy of them (default: where they are)."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
    at = offsets if logical is None else np.ascontiguousarray(logical, dtype=np.int64)
    if _hash_ranges is not None:
        sums = _hash_ranges(int(region.ctypes.data), offsets, nbytes, seed, at)
        return [int(value) for value in np.frombuffer(sums, dtype=np.uint64).tolist()]
    return [
        hash_bytes(region[start : start + length], logical_start, seed)
        for start, logical_start, length in zip(offsets.tolist(), at.tolist(), nbytes.tolist(), strict=True)
    ]


def staged_content(
    payload: npt.NDArray[np.uint8],
    payload_offsets: Int64Array,
    src_regions: Int64Array,
    src_offsets: Int64Array,
    dst_regions: Int64Array,
    dst_offsets: Int64Array,
    nbytes: Int64Array,
) -> int:
    """The content digest of ops whose bytes sit staged in `payload` (for a copy that cannot
    hash as it goes, e.g. into a GPU): each op's bytes as at its source offset, bound for its
    destination."""
    total = 0
    for source in np.unique(src_regions).tolist():
        select = src_regions == source
        seed = region_seed(source)
        sums = hash_ranges(payload, payload_offsets[select], nbytes[select], seed, src_offsets[select])
        deltas = (dst_offsets[select] - src_offsets[select]).tolist()
        for target, delta, value in zip(dst_regions[select].tolist(), deltas, sums, strict=True):
            total += destination_factor(pair_salt(source, target), delta) * value
    return total & MASK64


# ---- the writer's reference -------------------------------------------------------------------


def reference(
    regions: Sequence[npt.NDArray[np.uint8]],
    layout: KVLayout,
    placements: Mapping[str, LayerPlacement],
    dst_layout: KVLayout,
    dst_placement: Callable[[str], LayerPlacement],
    layers: Sequence[str],
    local_blocks: Int64Array,
    remote_blocks: Int64Array,
) -> int:
    """The content digest a transfer of `layers` from the writer's `local_blocks` into the
    decode engine's `remote_blocks` must report: from the writer's bytes (`regions`, host
    memory) where its own layout keeps them, each stretch bound for where the decode engine's
    layout keeps it; no plan, no offset cache."""
    heads = shared_heads(layout.tp, dst_layout.tp, "the writer", "the decode engine")
    src_region: list[Int64Array] = []
    src_start: list[Int64Array] = []
    dst_region: list[Int64Array] = []
    dst_start: list[Int64Array] = []
    sizes: list[Int64Array] = []
    for layer in layers:
        local = placements[layer]
        remote = dst_placement(layer)
        for local_at, remote_at, length in _paired_runs(layout, dst_layout, local, remote, layer, heads):
            src_start.append(local.offset + local_at + local_blocks * local.block_stride)
            dst_start.append(remote.offset + remote_at + remote_blocks * remote.block_stride)
            src_region.append(np.full(local_blocks.size, local.region, dtype=np.int64))
            dst_region.append(np.full(local_blocks.size, remote.region, dtype=np.int64))
            sizes.append(np.full(local_blocks.size, length, dtype=np.int64))
    if not sizes:
        return 0
    source, start = np.concatenate(src_region), np.concatenate(src_start)
    target, place, nbytes = np.concatenate(dst_region), np.concatenate(dst_start), np.concatenate(sizes)
    total = 0
    for index in np.unique(source).tolist():
        select = source == index
        sums = hash_ranges(regions[index], start[select], nbytes[select], region_seed(index))
        deltas = (place[select] - start[select]).tolist()
        for dst, delta, value in zip(target[select].tolist(), deltas, sums, strict=True):
            total += destination_factor(pair_salt(index, dst), delta) * value
    return total & MASK64


def _paired_runs(
    layout: KVLayout,
    dst_layout: KVLayout,
    local: LayerPlacement,
    remote: LayerPlacement,
    layer: str,
    heads: tuple[int, int] | None,
) -> list[tuple[int, int, int]]:
    """(offset in the writer's block, offset in the decode engine's block, nbytes) of each run a
    transfer of `layer` moves per block: every part, or the runs of the shared heads."""
    if heads is None:
        return [
            (part * local.part_stride, part * remote.part_stride, local.part_nbytes)
            for part in range(local.parts)
        ]
    first, count = heads
    mine = head_runs(layout.layer(layer).geometry, first - layout.tp.first_head, count)
    theirs = head_runs(dst_layout.layer(layer).geometry, first - dst_layout.tp.first_head, count)
    if [run.nbytes for run in mine] != [run.nbytes for run in theirs]:
        raise PlanError(
            f"layer {layer!r}: the shared heads' runs differ between the engines' block layouts",
            layer=layer,
        )
    return [
        (a.part * local.part_stride + a.offset, b.part * remote.part_stride + b.offset, a.nbytes)
        for a, b in zip(mine, theirs, strict=True)
    ]
