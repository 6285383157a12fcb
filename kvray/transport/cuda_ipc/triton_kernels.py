"""The `cuda_ipc` transport's Triton kernels, defined at module level as Triton requires of the
functions a kernel calls. Imported only through `kvray.transport.cuda_ipc.kernels`, on first
use: importing this module imports Triton.

The content digest's arithmetic (`kvray.content`) is here too, computed by the copy as it
moves the bytes: each 32-bit word of a source region times its weight (a 32-bit table value,
recomputed here by its mixer rather than loaded, times its 4 KiB page's 64-bit factor), a
stretch's sum times its destination factor, all mod 2**64; and, beside it, the placement
digest (`kvray.placement`) of the ranges each program stored to.
"""
# mypy: ignore-errors

from __future__ import annotations

import triton
import triton.language as tl

#: Slots a write's programs add their sums into (spread, so that few add to the same one).
SLOTS: tl.constexpr = tl.constexpr(1024)


@triton.jit
def _mix64(z):
    """SplitMix64's finalizer (`kvray.content.mix64`)."""
    z = (z ^ (z >> 30)) * tl.full((), 0xBF58476D1CE4E5B9, tl.uint64)
    z = (z ^ (z >> 27)) * tl.full((), 0x94D049BB133111EB, tl.uint64)
    return z ^ (z >> 31)


@triton.jit
def _page_factor(seed, page):
    return _mix64(seed * tl.full((), 0x9E3779B97F4A7C15, tl.uint64) + page) | 1


@triton.jit
def _weigh(values, element, first, seed, SHIFT: tl.constexpr):
    """The weighted words of `values`, the elements at indices `element` (of 2**SHIFT bytes,
    at most 4) of a source region whose seed is `seed`; `first`, the index of the step's first
    element: a step spans at most two 4 KiB pages (callers keep it to 4 KiB)."""
    at = element.to(tl.uint64) << SHIFT
    word = at >> 2
    if SHIFT == 0:
        unsigned = values.to(tl.uint8, bitcast=True).to(tl.uint64)
    elif SHIFT == 1:
        unsigned = values.to(tl.uint16, bitcast=True).to(tl.uint64)
    else:
        unsigned = values.to(tl.uint32, bitcast=True).to(tl.uint64)
    unsigned = unsigned << ((at & 3) * 8)
    h = (word & 1023).to(tl.uint32) * tl.full((), 0x9E3779B9, tl.uint32) + tl.full((), 0x7F4A7C15, tl.uint32)
    h = h ^ (h >> 16)
    h = h * tl.full((), 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full((), 0xC2B2AE35, tl.uint32)
    h = (h ^ (h >> 16)) | 1
    page = (first.to(tl.uint64) << SHIFT) >> 12
    near = _page_factor(seed, page)
    far = _page_factor(seed, page + 1)
    return unsigned * h.to(tl.uint64) * tl.where((word >> 10) == page, near, far)


@triton.jit
def _factor(salt, delta):
    """A stretch's destination factor (`kvray.content.destination_factor`)."""
    return _mix64(salt ^ delta.to(tl.uint64, bitcast=True)) | 1


@triton.jit
def _deposit(slots, program, total):
    if total != 0:
        tl.atomic_add(slots + program % SLOTS, total.to(tl.int64, bitcast=True))


@triton.jit
def _place(slots, program, salt, start, nbytes):
    """A stored range's placement digest (`kvray.placement`) into the slots after the content's."""
    begin = start.to(tl.uint64, bitcast=True)
    worth = _mix64(salt ^ (begin + nbytes.to(tl.uint64, bitcast=True))) - _mix64(salt ^ begin)
    _deposit(slots + SLOTS, program, worth)


@triton.jit
def copy_pieces(
    src,
    dst,
    table,
    slots,
    count,
    SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    DIGESTS: tl.constexpr,
    CONTENT: tl.constexpr,
    STORE: tl.constexpr,
    AT_BOUND: tl.constexpr = False,
):
    """Program i copies op i of `table` (see `kernels.copy_kernel`); with AT_BOUND its content
    digest weighs each word as at the place its bytes are bound for, and that place is its
    stretch's delta of 0 (a landed digest, `kvray.content.landed_digest`)."""
    piece = tl.program_id(0)
    source = tl.load(table + piece) >> SHIFT
    target = tl.load(table + count + piece) >> SHIFT
    length = tl.load(table + 2 * count + piece) >> SHIFT
    if VEC > 1:
        # Every offset is a multiple of VEC elements: lets the compiler use 16-byte accesses.
        source = tl.multiple_of(source, VEC)
        target = tl.multiple_of(target, VEC)
        length = tl.multiple_of(length, VEC)
    seed = tl.load(table + 4 * count).to(tl.uint64, bitcast=True) if CONTENT else 0
    weighed = (tl.load(table + 3 * count + piece) >> SHIFT) if AT_BOUND else source
    acc = tl.zeros((BLOCK,), tl.uint64)
    for start in tl.range(0, length, BLOCK):
        index = start + tl.arange(0, BLOCK)
        mask = index < length
        values = tl.load(src + source + index, mask=mask, other=0)
        if STORE:
            tl.store(dst + target + index, values, mask=mask)
        if CONTENT:
            acc += _weigh(values, weighed + index, weighed + start, seed, SHIFT)
    if DIGESTS:
        bound = tl.load(table + 3 * count + piece)
        if CONTENT:
            salt = tl.load(table + 4 * count + 1).to(tl.uint64, bitcast=True)
            moved = (bound - bound) if AT_BOUND else (bound - tl.load(table + piece))
            total = tl.sum(acc, axis=0) * _factor(salt, moved)
            _deposit(slots, piece, total)
        region = tl.load(table + 4 * count + 2).to(tl.uint64, bitcast=True)
        _place(slots, piece, region, bound, length << SHIFT)


@triton.jit
def copy_rows(
    src,
    dst,
    rows,
    ids,
    slots,
    num_rows,
    capacity,
    SHIFT: tl.constexpr,
    PIECE: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    DIGESTS: tl.constexpr,
    CONTENT: tl.constexpr,
    STORE: tl.constexpr,
):
    """Program (i, r, k) copies piece k of block pair i's op in row r (see `kernels.rows_kernel`)."""
    pair = tl.program_id(0)
    row = tl.program_id(1)
    skip = tl.program_id(2).to(tl.int64) * PIECE
    live = pair < tl.load(ids)
    local_id = tl.load(ids + 1 + pair, mask=live, other=0)
    remote_id = tl.load(ids + 1 + capacity + pair, mask=live, other=0)
    local_base = tl.load(rows + row)
    remote_base = tl.load(rows + num_rows + row)
    local_stride = tl.load(rows + 2 * num_rows + row)
    remote_stride = tl.load(rows + 3 * num_rows + row)
    nbytes = tl.load(rows + 4 * num_rows + row)
    # A row shorter than the longest has pieces past its end: they copy nothing.
    length = tl.minimum(nbytes - skip, PIECE) >> SHIFT
    length = tl.where(live, length, 0)
    source = (local_base + local_id * local_stride + skip) >> SHIFT
    target = (remote_base + remote_id * remote_stride + skip) >> SHIFT
    if VEC > 1:
        source = tl.multiple_of(source, VEC)
        target = tl.multiple_of(target, VEC)
        length = tl.multiple_of(length, VEC)
    seed = tl.load(rows + 5 * num_rows + row).to(tl.uint64, bitcast=True) if CONTENT else 0
    acc = tl.zeros((BLOCK,), tl.uint64)
    # Whole steps unmasked, then at most one masked step for the rest: a mask on every step
    # costs the copy measurably.
    whole = length // BLOCK * BLOCK
    for start in tl.range(0, whole, BLOCK):
        index = start + tl.arange(0, BLOCK)
        values = tl.load(src + source + index)
        if STORE:
            tl.store(dst + target + index, values)
        if CONTENT:
            acc += _weigh(values, source + index, source + start, seed, SHIFT)
    if whole < length:
        index = whole + tl.arange(0, BLOCK)
        mask = index < length
        values = tl.load(src + source + index, mask=mask, other=0)
        if STORE:
            tl.store(dst + target + index, values, mask=mask)
        if CONTENT:
            acc += _weigh(values, source + index, source + whole, seed, SHIFT)
    if DIGESTS:
        program = (pair * tl.num_programs(1) + row) * tl.num_programs(2) + tl.program_id(2)
        if CONTENT:
            salt = tl.load(rows + 6 * num_rows + row).to(tl.uint64, bitcast=True)
            total = tl.sum(acc, axis=0) * _factor(salt, (target - source) << SHIFT)
            _deposit(slots, program, total)
        region = tl.load(rows + 7 * num_rows + row).to(tl.uint64, bitcast=True)
        _place(slots, program, region, target << SHIFT, length << SHIFT)


@triton.jit
def hash_blocks(
    src,
    rows,
    ids,
    sums,
    num_rows,
    count,
    SHIFT: tl.constexpr,
    PIECE: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    """Program (i, r, k) adds the content sum (no destination factor) of piece k of block
    `ids[i]`'s bytes in row r into `sums[r * count + i]` (see `kernels.blocks_kernel`)."""
    block = tl.program_id(0)
    row = tl.program_id(1)
    skip = tl.program_id(2).to(tl.int64) * PIECE
    block_id = tl.load(ids + block)
    start = tl.load(rows + row)
    stride = tl.load(rows + num_rows + row)
    nbytes = tl.load(rows + 2 * num_rows + row)
    seed = tl.load(rows + 3 * num_rows + row).to(tl.uint64, bitcast=True)
    # A row shorter than the longest has pieces past its end: they hash nothing.
    length = tl.maximum(tl.minimum(nbytes - skip, PIECE), 0) >> SHIFT
    source = (start + block_id * stride + skip) >> SHIFT
    if VEC > 1:
        source = tl.multiple_of(source, VEC)
        length = tl.multiple_of(length, VEC)
    acc = tl.zeros((BLOCK,), tl.uint64)
    whole = length // BLOCK * BLOCK
    for step in tl.range(0, whole, BLOCK):
        index = step + tl.arange(0, BLOCK)
        acc += _weigh(tl.load(src + source + index), source + index, source + step, seed, SHIFT)
    if whole < length:
        index = whole + tl.arange(0, BLOCK)
        values = tl.load(src + source + index, mask=index < length, other=0)
        acc += _weigh(values, source + index, source + whole, seed, SHIFT)
    total = tl.sum(acc, axis=0)
    if total != 0:
        tl.atomic_add(sums + row * count + block, total.to(tl.int64, bitcast=True))


@triton.jit
def fold(slots, out, SLOTS: tl.constexpr):
    """`out[0]`, `out[1]` := the sums of the content's and the placement's slots (mod 2**64);
    the slots are zeroed for the next write."""
    index = tl.arange(0, SLOTS)
    for half in tl.static_range(2):
        values = tl.load(slots + half * SLOTS + index).to(tl.uint64, bitcast=True)
        tl.store(out + half, tl.sum(values, axis=0).to(tl.int64, bitcast=True))
        tl.store(slots + half * SLOTS + index, tl.zeros((SLOTS,), tl.int64))


@triton.jit
def fetch_ids(host, device_ids, n, BLOCK: tl.constexpr):
    """`device_ids[:n]` := `host[:n]` (see `kernels.fetch_kernel`)."""
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n
    tl.store(device_ids + index, tl.load(host + index, mask=mask), mask=mask)
