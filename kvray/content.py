"""Content digests: one number for the bytes a transfer moved and where each went, computed by
the executor as it copies them (the C copy pool for shm and loopback, the ray receiver's
scatter) and, independently, by the writer from its own blocks and the two engines' layouts
(`stretch_rows`, `Stretches`, or `HeldDigests` taken earlier), never from its plan or offset
cache. The decode
side takes a request only when the two agree (and its placement digest, `kvray.placement`,
does too).

The definition, over 32-bit little-endian words of a source region:
- a source byte at offset o of region s adds `byte << 8 * (o % 4)` times the weight of its word
  w = o // 4: an odd 32-bit value from a fixed table of 1024 (w % 1024) times an odd 64-bit
  factor mixed from the region's seed and the word's 4 KiB page (w // 1024). So a bit flipped
  changes the sum by an odd multiple of a power of two below 2**64, never zero, and a byte
  zeroed, two words swapped or a page's bytes moved change it but by chance (2**-64-ish); the
  C copy's inner loop is a table load, a multiply and an add per word;
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

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from kvray.errors import PlanError
from kvray.layout import Int64Array, KVLayout, LayerPlacement
from kvray.placement import MASK64, mix_array
from kvray.tensor_parallel import head_runs, shared_heads

_hash_ranges: Callable[..., bytes] | None
try:
    from kvray._copy_pool import hash_ranges as _hash_ranges
except ImportError:  # a source checkout without a build: numpy computes the same
    _hash_ranges = None
_held_digest: Callable[..., int | None] | None
try:
    from kvray._plan import held_digest as _held_digest
except ImportError:
    _held_digest = None

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


def region_seeds(regions: Int64Array) -> npt.NDArray[np.uint64]:
    """`region_seed` elementwise."""
    with np.errstate(over="ignore"):
        return mix_array(regions.astype(np.uint64) + np.uint64(0xC0FFEE)) & np.uint64(0xFFFFFFFF)


def pair_salts(src_regions: Int64Array, dst_regions: Int64Array) -> npt.NDArray[np.uint64]:
    """`pair_salt` elementwise."""
    keys = ((src_regions.astype(np.uint64) + np.uint64(1)) << np.uint64(32)) | (
        dst_regions.astype(np.uint64) + np.uint64(1)
    )
    return mix_array(keys)


def landed_factor(region: int) -> int:
    """What the landed digest of bytes in region `region` is multiplied by."""
    return destination_factor(pair_salt(region, region), 0)


def landed_digest(
    regions: Sequence[npt.NDArray[np.uint8]], region: Int64Array, offset: Int64Array, nbytes: Int64Array
) -> int:
    """The landed digest of ranges of a decode engine's own regions: the content digest of the
    bytes as they sit, as if each had been copied from where it is to where it is. The writer
    computes the same from its blocks (`Stretches.landed`), for a transfer whose copy does not
    hash (an RDMA NIC's writes): the decode side reads what landed once, after the last write."""
    return landed_between(regions, region, offset, region, offset, nbytes)


def landed_between(
    regions: Sequence[npt.NDArray[np.uint8]],
    src_region: Int64Array,
    src_offset: Int64Array,
    dst_region: Int64Array,
    dst_offset: Int64Array,
    nbytes: Int64Array,
) -> int:
    """The landed digest of bytes at `src_offset` of `regions[src_region]` as if they sat at
    `dst_offset` of region `dst_region` (`landed_digest`'s, wherever the bytes are now)."""
    total = 0
    pairs = np.unique(np.stack([src_region, dst_region]), axis=1).T.tolist() if nbytes.size else []
    for source, target in pairs:
        select = (src_region == source) & (dst_region == target)
        values = hash_ranges(
            regions[source], src_offset[select], nbytes[select], region_seed(target), dst_offset[select]
        )
        total += sum(values) * landed_factor(target)
    return total & MASK64


def destination_factor(salt: int, delta: int) -> int:
    """The odd factor of bytes moved `delta` bytes (destination offset - source offset)."""
    return mix64(salt ^ (delta & MASK64)) | 1


# ---- word weights, numpy (the C executor's `content_table` and `page_factor`) ----------------

#: Words of a 4 KiB page: each word's 32-bit table weight, then its page's 64-bit factor.
TABLE_WORDS: Final = 1024


def _fmix32(h: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


_TABLE: Final = (
    _fmix32(np.arange(TABLE_WORDS, dtype=np.uint32) * np.uint32(0x9E3779B9) + np.uint32(0x7F4A7C15))
    | np.uint32(1)
).astype(np.uint64)


def _weights(seed: int, words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Each word's weight: its table weight times its page's factor (mod 2**64)."""
    pages = words // np.uint64(TABLE_WORDS)
    with np.errstate(over="ignore"):
        factor = mix_array(np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + pages) | np.uint64(1)
        weights: npt.NDArray[np.uint64] = _TABLE[words % np.uint64(TABLE_WORDS)] * factor
        return weights


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
    return [int(value) for value in hash_ranges_array(region, offsets, nbytes, seed, logical).tolist()]


def hash_ranges_array(
    region: npt.NDArray[np.uint8],
    offsets: Int64Array,
    nbytes: Int64Array,
    seed: int,
    logical: Int64Array | None = None,
) -> npt.NDArray[np.uint64]:
    """`hash_ranges` as an array (no Python int per range where the C routine is built)."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
    at = offsets if logical is None else np.ascontiguousarray(logical, dtype=np.int64)
    if _hash_ranges is not None:
        sums = _hash_ranges(int(region.ctypes.data), offsets, nbytes, seed, at)
        return np.frombuffer(sums, dtype=np.uint64)
    return np.array(
        [
            hash_bytes(region[start : start + length], logical_start, seed)
            for start, logical_start, length in zip(
                offsets.tolist(), at.tolist(), nbytes.tolist(), strict=True
            )
        ],
        dtype=np.uint64,
    )


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
    sums = np.zeros(nbytes.size, dtype=np.uint64)
    for source in np.unique(src_regions).tolist():
        select = src_regions == source
        seed = region_seed(source)
        values = hash_ranges(payload, payload_offsets[select], nbytes[select], seed, src_offsets[select])
        sums[select] = np.array(values, dtype=np.uint64)
    return _weighted_total(src_regions, dst_regions, dst_offsets - src_offsets, sums)


# ---- the writer's reference -------------------------------------------------------------------


def factors(salts: npt.NDArray[np.uint64], deltas: Int64Array) -> npt.NDArray[np.uint64]:
    """`destination_factor` elementwise."""
    with np.errstate(over="ignore"):
        return mix_array(salts ^ deltas.astype(np.uint64)) | np.uint64(1)


def _weighted_total(
    src_region: Int64Array, dst_region: Int64Array, deltas: Int64Array, sums: npt.NDArray[np.uint64]
) -> int:
    """Sum of each stretch's content sum times its destination factor, mod 2**64."""
    with np.errstate(over="ignore"):
        weighted = factors(pair_salts(src_region, dst_region), deltas) * sums
    return int(weighted.sum(dtype=np.uint64))


class StretchRows(NamedTuple):
    """The stretches a transfer of some layers moves, by row, one row per (layer, run): block b
    of row r lies at src_start[r] + b * src_stride[r] in the writer's region src_region[r] and
    is bound for dst_start[r] + b' * dst_stride[r] in the decode engine's region dst_region[r]
    (b' the block it goes to), nbytes[r] long; `layer` and `part` name each row's place in the
    writer's layout, a whole part where `whole_parts` (not where the engines share only some
    heads). From the two layouts alone (no plan, no offset cache): `stretch_rows`."""

    src_region: Int64Array
    src_start: Int64Array
    src_stride: Int64Array
    dst_region: Int64Array
    dst_start: Int64Array
    dst_stride: Int64Array
    nbytes: Int64Array
    layer: Int64Array
    part: Int64Array
    whole_parts: bool
    #: `pair_salts` of each row's regions, as int64 (None: computed where needed).
    salts: Int64Array | None = None


def stretch_rows(
    layout: KVLayout,
    placements: Mapping[str, LayerPlacement],
    dst_layout: KVLayout,
    dst_placement: Callable[[str], LayerPlacement],
    layers: Sequence[str],
) -> StretchRows:
    """The rows of a transfer of `layers` from an engine of `layout` to one of `dst_layout`
    (the same for every request between the two: callers keep them)."""
    heads = shared_heads(layout.tp, dst_layout.tp, "the writer", "the decode engine")
    index = {name: at for at, name in enumerate(layout.layer_names)}
    columns: list[list[int]] = [[] for _ in range(9)]
    for layer in layers:
        local = placements[layer]
        remote = dst_placement(layer)
        runs = _paired_runs(layout, dst_layout, local, remote, layer, heads)
        for part, (local_at, remote_at, length) in enumerate(runs):
            values = (
                local.region,
                local.offset + local_at,
                local.block_stride,
                remote.region,
                remote.offset + remote_at,
                remote.block_stride,
                length,
                index[layer],
                part,
            )
            for column, value in zip(columns, values, strict=True):
                column.append(value)
    src_region, src_start, src_stride, dst_region, dst_start, dst_stride, nbytes, layer_index, run = (
        np.array(column, dtype=np.int64) for column in columns
    )
    return StretchRows(
        src_region,
        src_start,
        src_stride,
        dst_region,
        dst_start,
        dst_stride,
        nbytes,
        layer_index,
        run,
        whole_parts=heads is None,
        salts=pair_salts(src_region, dst_region).view(np.int64),
    )


class Stretches:
    """A request's stretches: `rows` (`stretch_rows`) for its block pairs, `local[i]` of the
    writer going to `remote[i]` of the decode engine; expanded into one stretch per (row,
    block pair) only where hashed on the host."""

    def __init__(self, rows: StretchRows, local: Int64Array, remote: Int64Array) -> None:
        self.rows = rows
        self.local = local
        self.remote = remote

    @property
    def nbytes_total(self) -> int:
        return int(self.rows.nbytes.sum()) * int(self.local.size)

    @functools.cached_property
    def expanded(self) -> ExpandedStretches:
        rows, count = self.rows, self.local.size
        return ExpandedStretches(
            src_region=np.repeat(rows.src_region, count),
            src_start=(rows.src_start[:, None] + self.local[None, :] * rows.src_stride[:, None]).ravel(),
            dst_region=np.repeat(rows.dst_region, count),
            dst_start=(rows.dst_start[:, None] + self.remote[None, :] * rows.dst_stride[:, None]).ravel(),
            nbytes=np.repeat(rows.nbytes, count),
            layer=np.repeat(rows.layer, count),
            part=np.repeat(rows.part, count),
            block=np.tile(self.local, rows.layer.size),
        )

    def landed(self, regions: Sequence[npt.NDArray[np.uint8]]) -> int:
        """The landed digest (`landed_digest`) the decode engine must find once every stretch
        is in place, hashing the stretches' bytes here now as at the places they go."""
        found = self.expanded
        return landed_between(
            regions, found.src_region, found.src_start, found.dst_region, found.dst_start, found.nbytes
        )

    def digest(self, regions: Sequence[npt.NDArray[np.uint8]]) -> int:
        """The content digest, hashing every stretch's bytes now."""
        stretches = self.expanded
        if stretches.nbytes.size == 0:
            return 0
        sums = np.zeros(stretches.nbytes.size, dtype=np.uint64)
        for index in np.unique(stretches.src_region).tolist():
            select = stretches.src_region == index
            values = hash_ranges(
                regions[index], stretches.src_start[select], stretches.nbytes[select], region_seed(index)
            )
            sums[select] = np.array(values, dtype=np.uint64)
        return stretches.total(sums)


class ExpandedStretches(NamedTuple):
    """One stretch per (row, block pair) of `Stretches`, as parallel arrays."""

    src_region: Int64Array
    src_start: Int64Array
    dst_region: Int64Array
    dst_start: Int64Array
    nbytes: Int64Array
    layer: Int64Array
    part: Int64Array
    block: Int64Array

    def total(self, sums: npt.NDArray[np.uint64]) -> int:
        """The content digest of stretches whose content sums are `sums`."""
        return _weighted_total(self.src_region, self.dst_region, self.dst_start - self.src_start, sums)


class HeldRows(NamedTuple):
    """What `HeldDigests` hashes of each block, one row per (layer, part) of an engine's layout:
    block b's part lies at start[r] + b * stride[r] of region region[r], nbytes[r] long."""

    layer: Int64Array
    part: Int64Array
    region: Int64Array
    start: Int64Array
    stride: Int64Array
    nbytes: Int64Array


def held_rows(layout: KVLayout, placements: Mapping[str, LayerPlacement]) -> HeldRows:
    """The rows `HeldDigests` hashes per block, for `layout`'s engine."""
    columns: list[list[int]] = [[] for _ in range(6)]
    for at, name in enumerate(layout.layer_names):
        placement = placements[name]
        for part in range(placement.parts):
            values = (
                at,
                part,
                placement.region,
                placement.offset + part * placement.part_stride,
                placement.block_stride,
                placement.part_nbytes,
            )
            for column, value in zip(columns, values, strict=True):
                column.append(value)
    return HeldRows(*(np.array(column, dtype=np.int64) for column in columns))


def held_parts(layout: KVLayout, placements: Mapping[str, LayerPlacement]) -> int:
    """Parts per layer in `HeldDigests`' sums (the most any layer has): row `layer * parts + part`
    of `HeldDigests.rows_of`."""
    return max(placements[name].parts for name in layout.layer_names)


class HeldDigests:
    """The content sums of an engine's own blocks, per (layer, part, block), taken when the
    engine says its KV is there (produced or held: `KVAgent.hold_digests`), so that a push of
    those blocks needs no read of their bytes. A push uses them once and drops them; `forget`
    drops them when the blocks go back to the engine, which may write them again (a take still
    hashing them then keeps nothing of them). Hashed here (`take`) or elsewhere, e.g. on the
    GPU that holds them: `epochs` before the hash, `keep` after it."""

    def __init__(self, layout: KVLayout, placements: Mapping[str, LayerPlacement]) -> None:
        self.layout = layout
        self.placements = placements
        self.rows = held_rows(layout, placements)
        #: Bytes of one block in all layers (what a hold of a block hashes).
        self.block_nbytes = int(self.rows.nbytes.sum())
        parts = held_parts(layout, placements)
        shape = (len(layout.layers), parts, layout.num_blocks)
        self.sums = np.zeros(shape, dtype=np.uint64)
        self.held = np.zeros(shape, dtype=bool)
        #: Per block, how often it was forgotten: a take keeps its sums only where unchanged.
        self._epoch = np.zeros(layout.num_blocks, dtype=np.int64)
        self._lock = threading.Lock()

    def epochs(self, blocks: Int64Array) -> Int64Array:
        """What `keep` needs of `blocks`, read before their bytes are hashed."""
        with self._lock:
            return self._epoch[blocks].copy()

    def keep(self, blocks: Int64Array, epochs: Int64Array, sums: npt.NDArray[np.uint64]) -> None:
        """Keep `sums` (one per row of `rows` and block of `blocks`) of the blocks not forgotten
        since `epochs` was read."""
        rows = self.rows
        with self._lock:
            kept = self._epoch[blocks] == epochs
            where = (rows.layer[:, None], rows.part[:, None], blocks[kept][None, :])
            self.sums[where] = sums[:, kept]
            self.held[where] = True

    def take(self, regions: Sequence[npt.NDArray[np.uint8]], blocks: Int64Array) -> None:
        """Hash every layer's parts of `blocks` now (C, GIL released; from any thread)."""
        rows = self.rows
        epochs = self.epochs(blocks)
        sums = np.zeros((rows.layer.size, blocks.size), dtype=np.uint64)
        for region in np.unique(rows.region).tolist():  # one C call a region, all its rows
            selected = np.flatnonzero(rows.region == region)
            starts = rows.start[selected, None] + blocks[None, :] * rows.stride[selected, None]
            nbytes = np.repeat(rows.nbytes[selected], blocks.size)
            hashed = hash_ranges_array(regions[region], starts.reshape(-1), nbytes, region_seed(region))
            sums[selected] = hashed.reshape(selected.size, blocks.size)
        self.keep(blocks, epochs, sums)

    def rows_of(self, blocks: Int64Array) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.bool_]]:
        """The sums of `blocks` and whether each is held, one row per (layer, part) (row
        `layer * parts + part`), a column per block: what a lane keeps of a hold
        (`kvray.agent.lane`), a copy that `forget` does not reach (the hold ends first)."""
        with self._lock:
            sums = self.sums[:, :, blocks].reshape(-1, blocks.size)
            held = self.held[:, :, blocks].reshape(-1, blocks.size)
        return np.ascontiguousarray(sums), np.ascontiguousarray(held)

    def forget(self, blocks: Int64Array) -> None:
        """Drop the sums of `blocks` (they go back to the engine), and any a take still makes."""
        with self._lock:
            self._epoch[blocks] += 1
            self.held[:, :, blocks] = False

    def digest(self, stretches: Stretches) -> int | None:
        """The content digest from held sums, dropping them (None: some are not held): one C
        pass over the rows and blocks (`kvray._plan.held_digest`), else numpy."""
        rows = stretches.rows
        if not rows.whole_parts:
            return None
        if _held_digest is not None:
            salts = rows.salts
            if salts is None:
                salts = pair_salts(rows.src_region, rows.dst_region).view(np.int64)
            local = np.ascontiguousarray(stretches.local, dtype=np.int64)
            remote = np.ascontiguousarray(stretches.remote, dtype=np.int64)
            with self._lock:
                return _held_digest(
                    self.sums.reshape(-1).view(np.int64),
                    self.held.reshape(-1),
                    self.held.shape[1],
                    self.held.shape[2],
                    rows.layer,
                    rows.part,
                    salts,
                    rows.src_start,
                    rows.src_stride,
                    rows.dst_start,
                    rows.dst_stride,
                    local,
                    remote,
                )
        return self.digest_numpy(stretches)

    def digest_numpy(self, stretches: Stretches) -> int | None:
        """`digest` in numpy (the C pass's twin)."""
        if not stretches.rows.whole_parts:
            return None
        expanded = stretches.expanded
        key = (expanded.layer, expanded.part, expanded.block)
        with self._lock:
            if not self.held[key].all():
                return None
            sums = self.sums[key]
            self.held[key] = False
        return expanded.total(sums)


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
