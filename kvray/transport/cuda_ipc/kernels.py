"""The `cuda_ipc` transport's Triton kernels (compiled on first use: Triton is imported only
there) and the element width they copy at: the arithmetic on the GPU of step six.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from kvray.layout import Int64Array

#: Bytes one kernel program copies at most (longer ops are cut into pieces of this size).
MAX_PIECE_NBYTES = 256 * 1024


def pick_unit(*arrays: Int64Array, bases: tuple[int, ...] = ()) -> int:
    """The widest element size (16..1 bytes) that divides every offset, size and base address."""
    combined = 0
    for array in arrays:
        if array.size:
            combined |= int(np.bitwise_or.reduce(array))
    for base in bases:
        combined |= base
    for unit in (16, 8, 4, 2):
        if combined % unit == 0:
            return unit
    return 1


@functools.cache
def copy_kernel() -> Any:
    """The copy kernel, compiled on first use (Triton is imported only here). It runs on the
    destination's GPU; the source may sit on another GPU, read over NVLink through peer access.
    Program i copies op i of `table` (source offsets, then target offsets, then sizes, in
    bytes; each a multiple of the element width 2**SHIFT)."""
    import triton
    import triton.language as tl

    def copy_pieces(  # type: ignore[no-untyped-def]
        src, dst, table, count, SHIFT: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr
    ):
        piece = tl.program_id(0)
        source = tl.load(table + piece) >> SHIFT
        target = tl.load(table + count + piece) >> SHIFT
        length = tl.load(table + 2 * count + piece) >> SHIFT
        if VEC > 1:
            # Every offset is a multiple of VEC elements: lets the compiler use 16-byte accesses.
            source = tl.multiple_of(source, VEC)
            target = tl.multiple_of(target, VEC)
            length = tl.multiple_of(length, VEC)
        for start in tl.range(0, length, BLOCK):
            index = start + tl.arange(0, BLOCK)
            mask = index < length
            values = tl.load(src + source + index, mask=mask)
            tl.store(dst + target + index, values, mask=mask)

    return triton.jit(copy_pieces)


@functools.cache
def rows_kernel() -> Any:
    """The copy kernel for a plan's rows (`kvray.plan.RequestRows`): it expands the ops itself,
    so the host uploads only the request's block ids. Program (i, r, k) copies piece k (of
    PIECE bytes) of the op of block pair i in row r. `rows` holds five columns of `num_rows`
    (local base, remote base, local block stride, remote block stride, bytes); `ids` holds the
    number of block pairs, then `capacity` local ids, then `capacity` remote ids. The grid may
    have up to `capacity` pairs (one captured launch serves every request up to that size):
    programs past the count copy nothing. Every byte quantity is a multiple of the element
    width 2**SHIFT."""
    import triton
    import triton.language as tl

    def copy_rows(  # type: ignore[no-untyped-def]
        src,
        dst,
        rows,
        ids,
        num_rows,
        capacity,
        SHIFT: tl.constexpr,
        PIECE: tl.constexpr,
        BLOCK: tl.constexpr,
        VEC: tl.constexpr,
    ):
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
        # Whole steps unmasked, then at most one masked step for the rest: a mask on every
        # step costs the copy measurably.
        whole = length // BLOCK * BLOCK
        for start in tl.range(0, whole, BLOCK):
            index = start + tl.arange(0, BLOCK)
            values = tl.load(src + source + index)
            tl.store(dst + target + index, values)
        if whole < length:
            index = whole + tl.arange(0, BLOCK)
            mask = index < length
            values = tl.load(src + source + index, mask=mask)
            tl.store(dst + target + index, values, mask=mask)

    return triton.jit(copy_rows)


@functools.cache
def fetch_kernel() -> Any:
    """Copies `n` int64 from pinned host memory (read through the GPU's mapping of it) into a
    buffer on the GPU: a captured row copy's block ids, fetched by a kernel because a graph's
    kernel node starts its successor sooner than a host-to-device copy node does."""
    import triton
    import triton.language as tl

    def fetch_ids(host, device_ids, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = index < n
        tl.store(device_ids + index, tl.load(host + index, mask=mask), mask=mask)

    return triton.jit(fetch_ids)


#: Ids one program of `fetch_kernel` copies.
FETCH_BLOCK = 1024

#: The dtype both tensors are viewed as for a copy, by element width in bytes.
UNIT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: CUDA's limit on a grid's second and third dimensions.
MAX_GRID_YZ = 65535
