"""The `cuda_ipc` transport's Triton kernels (`triton_kernels`, imported and compiled on first
use) and the element width they copy at: the arithmetic on the GPU of step six.
"""

from __future__ import annotations

import enum
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
def _kernels() -> Any:
    from kvray.transport.cuda_ipc import triton_kernels

    return triton_kernels


def copy_kernel() -> Any:
    """The copy kernel, compiled on first use. It runs on the destination's GPU; the source may
    sit on another GPU, read over NVLink through peer access. Program i copies op i of `table`
    (source offsets, then target offsets, then sizes, in bytes; each a multiple of the element
    width 2**SHIFT). With DIGESTS, it also adds the placement digest (`kvray.placement`) of
    where each op's bytes are bound, and with CONTENT their content digest (`kvray.content`),
    into `slots`: the table then has a fourth column, where each op's bytes are bound (the
    final target where this copy stages them), and ends with the source region's seed, the
    pair's salt and the destination region's salt; without STORE it only hashes."""
    return _kernels().copy_pieces


def rows_kernel() -> Any:
    """The copy kernel for a plan's rows (`kvray.plan.RequestRows`): it expands the ops itself,
    so the host uploads only the request's block ids. Program (i, r, k) copies piece k (of
    PIECE bytes) of the op of block pair i in row r. `rows` holds five columns of `num_rows`
    (local base, remote base, local block stride, remote block stride, bytes); `ids` holds the
    number of block pairs, then `capacity` local ids, then `capacity` remote ids. The grid may
    have up to `capacity` pairs (one captured launch serves every request up to that size):
    programs past the count copy nothing. Every byte quantity is a multiple of the element
    width 2**SHIFT. With DIGESTS, it also adds the placement digest (`kvray.placement`) of
    where it stores, and with CONTENT the content digest (`kvray.content`) of what it copies,
    into `slots`: `rows` then has three more columns, each row's source region seed, pair salt
    and destination region salt; without STORE it only hashes (the writer's reference)."""
    return _kernels().copy_rows


def blocks_kernel() -> Any:
    """The held blocks' hash (`kvray.content.HeldDigests`), storing nothing: program (i, r, k)
    adds the content sum of piece k (of PIECE bytes) of block `ids[i]` in row r into
    `sums[r * count + i]`, without a destination factor (the push applies it when it knows
    where each block goes). `rows` holds four columns of `num_rows` (`kvray.content.HeldRows`'
    start, stride and bytes, then the row's source region seed); every byte quantity is a
    multiple of the element width 2**SHIFT."""
    return _kernels().hash_blocks


def fold_kernel() -> Any:
    """Adds a write's `SLOTS` sums into `out` (an int64 the host reads: pinned host memory,
    written through the GPU's mapping of it) and zeroes them for the next write."""
    return _kernels().fold


def fetch_kernel() -> Any:
    """Copies `n` int64 from pinned host memory (read through the GPU's mapping of it) into a
    buffer on the GPU: a captured row copy's block ids, fetched by a kernel because a graph's
    kernel node starts its successor sooner than a host-to-device copy node does."""
    return _kernels().fetch_ids


class Digests(enum.Enum):
    """What a copy reports of what it stored (`kvray.placement.Stored`)."""

    #: Nothing (a copy outside a transfer: benchmarks, staging).
    NONE = "none"
    #: The placement digest of the ranges it stored to.
    PLACEMENT = "placement"
    #: That, and the content digest of the bytes it moved (`kvray.content`).
    CONTENT = "placement and content"
    #: The content digest alone, storing nothing (the writer's reference, `hash_stretches`).
    REFERENCE = "content, nothing stored"

    @property
    def content(self) -> bool:
        return self in (Digests.CONTENT, Digests.REFERENCE)


#: Slots a hashing write's programs add their sums into (`triton_kernels.SLOTS`).
SLOTS = 1024
#: Bytes a hashing step covers: at most two of the digest's 4 KiB pages.
HASH_STEP_NBYTES = 4096
#: The widest element a hashing copy moves (its words are 32-bit).
HASH_MAX_UNIT = 4


#: Ids one program of `fetch_kernel` copies.
FETCH_BLOCK = 1024

#: The dtype both tensors are viewed as for a copy, by element width in bytes.
UNIT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: CUDA's limit on a grid's second and third dimensions.
MAX_GRID_YZ = 65535
