"""Verification: every contender's destination bytes against what the source held.

The source blocks are filled with a seeded pattern that makes every row (one block of one
segment) unique: random bytes from a seeded pad, stamped at both ends with the row's number,
so a row written to the wrong block, the wrong layer, shifted, cut short or left stale
differs from what is expected. Before each run the destination is scrubbed with a constant
byte, so stale bytes from an earlier run cannot pass; after each run the destination's
request blocks are compared, byte for byte, with the expected rows. A mismatch is reported,
never repaired: the harness marks the row FAILED and the command exits non-zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvray.bench.workload import ByteArray, Workload, segment_rows

#: Pad the pattern draws its rows from: longer than any row (at most 1 MiB here), odd-sized so
#: row starts do not repeat with the block strides.
_PAD_NBYTES = 4 * 2**20 + 4093 * 8
#: Byte a destination is scrubbed with before a run, changed per run.
_SCRUB_BASE = 0xA5


@functools.lru_cache(maxsize=4)
def _pad(seed: int) -> ByteArray:
    words = np.random.default_rng(seed).integers(0, 2**63, _PAD_NBYTES // 8, dtype=np.uint64)
    return words.view(np.uint8)


def pattern_rows(seed: int, first_row: int, count: int, row_nbytes: int) -> ByteArray:
    """Rows `first_row` .. `first_row + count - 1` of the pattern, as a [count, row_nbytes] array."""
    pad = _pad(seed)
    if row_nbytes > pad.size // 2:
        raise ValueError(f"pattern rows are at most {pad.size // 2} bytes, not {row_nbytes}")
    starts_available = pad.size - row_nbytes + 1
    rows = np.arange(first_row, first_row + count, dtype=np.int64)
    starts = (rows * 7919 * 64 + seed) % starts_available
    windows = np.lib.stride_tricks.as_strided(pad, shape=(starts_available, row_nbytes), strides=(1, 1))
    out = windows[starts]
    if row_nbytes >= 16:
        tags = (rows.astype(np.uint64) << np.uint64(20)) ^ np.uint64(seed & 0xFFFFF)
        tag_bytes = tags.astype("<u8").view(np.uint8).reshape(count, 8)
        out[:, :8] = tag_bytes
        out[:, -8:] = tag_bytes
    return out


def expected_rows(workload: Workload, segment_index: int) -> ByteArray:
    """The pattern rows of one segment, [blocks, segment nbytes], in request order."""
    segment = workload.segments[segment_index]
    return pattern_rows(workload.seed, segment_index * workload.blocks, workload.blocks, segment.nbytes)


def expected_payload(workload: Workload) -> ByteArray:
    """The request's bytes in `gather` order (segment by segment, block by block)."""
    out = np.empty(workload.nbytes, dtype=np.uint8)
    start = 0
    for index, segment in enumerate(workload.segments):
        stop = start + workload.blocks * segment.nbytes
        out[start:stop] = expected_rows(workload, index).reshape(-1)
        start = stop
    return out


def fill_source(pool: ByteArray, workload: Workload) -> None:
    """Write the pattern into the request's source blocks."""
    src = workload.src_ids()
    for index, segment in enumerate(workload.segments):
        segment_rows(pool, segment, workload.layout.num_blocks)[src] = expected_rows(workload, index)


def scrub(pool: ByteArray, run: int) -> None:
    """Overwrite a whole destination pool with a constant byte (a different one per run)."""
    pool.fill((_SCRUB_BASE + run) & 0xFF)


@dataclass(frozen=True)
class Mismatch:
    """The first wrong row: which segment, which request position, which blocks."""

    segment: str
    position: int
    src_block: int
    dst_block: int
    #: First wrong byte inside the row.
    byte: int


@dataclass(frozen=True)
class Verdict:
    """The outcome of one comparison."""

    ok: bool
    checked_nbytes: int
    bad_rows: int = 0
    first: Mismatch | None = None
    #: Why the check could not even compare (wrong size, the run raised).
    error: str | None = None

    @property
    def detail(self) -> str:
        if self.error is not None:
            return self.error
        if self.ok:
            return f"{self.checked_nbytes} bytes equal"
        first = self.first
        assert first is not None
        return (
            f"{self.bad_rows} wrong rows; first: segment {first.segment}, request block {first.position} "
            f"(source block {first.src_block} -> destination block {first.dst_block}), byte {first.byte}"
        )


def failed(reason: str) -> Verdict:
    """A run that produced nothing to compare (it raised, or timed out)."""
    return Verdict(ok=False, checked_nbytes=0, error=reason)


def compare_payload(payload: ByteArray, workload: Workload) -> Verdict:
    """Check a request's bytes in `gather` order (a received payload, a contiguous copy)."""
    payload = np.asarray(payload).reshape(-1)
    if payload.dtype != np.uint8 or payload.size != workload.nbytes:
        return failed(f"got {payload.size} bytes of {payload.dtype}, expected {workload.nbytes} uint8")
    starts = np.cumsum([0] + [workload.blocks * s.nbytes for s in workload.segments])
    return _check(
        workload,
        lambda index: payload[starts[index] : starts[index + 1]].reshape(workload.blocks, -1),
    )


def verify_destination(pool: ByteArray, workload: Workload) -> Verdict:
    """Check the request's destination blocks in `pool`, one segment at a time."""
    if pool.size < workload.region_nbytes:
        return failed(f"destination pool has {pool.size} bytes, the layout needs {workload.region_nbytes}")
    dst = workload.dst_ids()
    num_blocks = workload.layout.num_blocks
    return _check(workload, lambda index: segment_rows(pool, workload.segments[index], num_blocks)[dst])


def _check(workload: Workload, rows_of: Callable[[int], ByteArray]) -> Verdict:
    """Compare every segment's actual rows (`rows_of(segment index)`, [blocks, nbytes]) with the
    pattern; count the wrong rows and describe the first."""
    bad_rows = 0
    first: Mismatch | None = None
    for index, segment in enumerate(workload.segments):
        got = rows_of(index)
        want = expected_rows(workload, index)
        if _equal(got.reshape(-1), want.reshape(-1)):
            continue
        wrong = got != want
        rows = np.flatnonzero(wrong.any(axis=1))
        bad_rows += int(rows.size)
        if rows.size and first is None:
            position = int(rows[0])
            first = Mismatch(
                segment=segment.name,
                position=position,
                src_block=workload.src_blocks[position],
                dst_block=workload.dst_blocks[position],
                byte=int(np.flatnonzero(wrong[position])[0]),
            )
    return Verdict(ok=bad_rows == 0, checked_nbytes=workload.nbytes, bad_rows=bad_rows, first=first)


def _equal(a: ByteArray, b: ByteArray) -> bool:
    # Word-wise compare (np.array_equal on bytes is several times slower).
    if a.size % 8 == 0 and a.ctypes.data % 8 == 0 and b.ctypes.data % 8 == 0:
        return bool(np.array_equal(a.view(np.uint64), b.view(np.uint64)))
    return bool(np.array_equal(a, b))
