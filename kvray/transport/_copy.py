"""Batched CPU copies shared by the CPU transports: every op of a plan in a few C calls."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

_scatter_copy: Callable[..., Any] | None
try:
    from kvray._copy import scatter_copy as _scatter_copy
except ImportError:  # built by `pip install`; a source checkout without a build falls back
    _scatter_copy = None

Int64Array = npt.NDArray[np.int64]

#: Ops smaller than this many bytes in total are copied on the calling thread.
_PARALLEL_THRESHOLD = 4 * 2**20
#: Threads sharing a batch claim at most this many bytes at a time (longer ops are split).
_CLAIM_NBYTES = 2**20

_executor: ThreadPoolExecutor | None = None
#: The most threads one copy uses.
_MAX_THREADS = 4


def copy_threads() -> int:
    """Threads a copy uses unless told (`Settings.copy_threads`): every core, 1 to 4. On this
    project's 2-core machine two threads beat one when the machine is otherwise quiet (a 64 MiB
    push of 16 KiB blocks: 6.35-6.53 ms against 7.48 ms) and lose when it is busy; engines that
    share their cores with a model's compute may want fewer."""
    return max(1, min(_MAX_THREADS, os.cpu_count() or 1))


def native() -> bool:
    """True when the C batched copy is built (else a slower per-op ctypes loop runs)."""
    return _scatter_copy is not None


def scatter_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    cursor: Int64Array | None = None,
) -> bool | None:
    """Copy nbytes[i] bytes from src_base + src_offsets[i] to dst_base + dst_offsets[i].

    With `cursor` (C copy only), several threads share the ops (see `kvray/_copy.c`); the call
    returns True in the thread that completed the batch.
    """
    dst_offsets = np.ascontiguousarray(dst_offsets, dtype=np.int64)
    src_offsets = np.ascontiguousarray(src_offsets, dtype=np.int64)
    nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
    if _scatter_copy is not None:
        if cursor is not None:
            return bool(_scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes, cursor))
        _scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes)
        return None
    if cursor is not None:
        raise ValueError("a shared cursor needs the C copy (kvray._copy)")
    if (dst_offsets < 0).any() or (src_offsets < 0).any() or (nbytes < 0).any():
        raise ValueError("scatter_copy got a negative offset or length")
    for dst, src, count in zip(
        (dst_base + dst_offsets).tolist(), (src_base + src_offsets).tolist(), nbytes.tolist(), strict=True
    ):
        ctypes.memmove(dst, src, count)
    return None


async def scatter_copy_async(
    dst_base: int,
    src_base: int,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    threads: int = 0,
    then: Callable[[], None] | None = None,
) -> None:
    """`scatter_copy` off the event loop; a large batch is copied by a few threads at once.
    `then()`, if given, is called once every byte is copied, on the thread that copied the last
    one (see `Transport.write_then`).

    With the C copy, the threads share the op list and each claims the next ops as it goes
    (ops longer than `_CLAIM_NBYTES` are split first), so a thread the scheduler parks on a
    busy machine does not leave its share undone; without it, the ops are cut into equal shares.
    `threads`: how many (0: `copy_threads()`).
    """
    global _executor
    total = int(nbytes.sum())
    threads = threads or copy_threads()
    if total < _PARALLEL_THRESHOLD:
        scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes)
        if then is not None:
            then()
        return
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=_MAX_THREADS, thread_name_prefix="kvray-copy")
    threads = min(threads, _MAX_THREADS)
    loop = asyncio.get_running_loop()
    if threads == 1:
        # One thread, but off the event loop: a 64 MiB copy takes milliseconds.
        await loop.run_in_executor(
            _executor, _copy_then, then, dst_base, src_base, dst_offsets, src_offsets, nbytes
        )
        return
    if _scatter_copy is not None:
        if int(nbytes.max()) > _CLAIM_NBYTES:
            dst_offsets, src_offsets, nbytes = _split_large(dst_offsets, src_offsets, nbytes, _CLAIM_NBYTES)
        dst_offsets = np.ascontiguousarray(dst_offsets, dtype=np.int64)
        src_offsets = np.ascontiguousarray(src_offsets, dtype=np.int64)
        nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
        if (dst_offsets < 0).any() or (src_offsets < 0).any() or (nbytes < 0).any():
            raise ValueError("scatter_copy got a negative offset or length")
        if nbytes.size == 0:
            return
        cursor = np.zeros(2, dtype=np.int64)  # next op to claim, ops done
        copies: list[Awaitable[None]] = [
            loop.run_in_executor(
                _executor, _copy_then, then, dst_base, src_base, dst_offsets, src_offsets, nbytes, cursor
            )
            for _ in range(threads)
        ]
    else:
        share_nbytes = -(-total // threads)
        if int(nbytes.max()) > share_nbytes:
            dst_offsets, src_offsets, nbytes = _split_large(dst_offsets, src_offsets, nbytes, share_nbytes)
        # Cut at op boundaries: with every op at most one share, each cut is off by less than one.
        ends = np.cumsum(nbytes)
        cuts = np.searchsorted(ends, [share_nbytes * k for k in range(1, threads)], side="left") + 1
        bounds = [0, *np.minimum(cuts, nbytes.size).tolist(), nbytes.size]
        shares: list[Awaitable[bool | None]] = [
            loop.run_in_executor(
                _executor,
                scatter_copy,
                dst_base,
                src_base,
                dst_offsets[start:stop],
                src_offsets[start:stop],
                nbytes[start:stop],
            )
            for start, stop in itertools.pairwise(bounds)
            if stop > start
        ]
        # Equal shares: no thread knows it copied the last byte.
        copies = [_then_after(asyncio.gather(*shares), then)]
    # Every thread returns before the copy does, even one that starts after the last op was
    # claimed: whoever releases the memory next never races a thread still holding it.
    gathered = asyncio.gather(*copies)
    try:
        await asyncio.shield(gathered)
    except asyncio.CancelledError:
        # A thread cannot be stopped mid-copy: wait until none still writes into memory the
        # caller is about to release or hand back, then let the cancellation through. The
        # copies are bounded, so this wait is too.
        while not gathered.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([gathered])
        raise


def _copy_then(
    then: Callable[[], None] | None,
    dst_base: int,
    src_base: int,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    cursor: Int64Array | None = None,
) -> None:
    """`scatter_copy` on a pool thread, then `then()` there if this call copied the last byte
    (without a cursor, the call copies every op)."""
    finished = scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes, cursor)
    if then is not None and (cursor is None or finished):
        then()


async def _then_after(copies: Awaitable[object], then: Callable[[], None] | None) -> None:
    await copies
    if then is not None:
        then()


class StagingBuffers:
    """Reusable byte buffers for gathers whose bytes are copied out before the buffer is given
    back (the ray transport's payload: Ray copies a call's array arguments into its object
    store when the call is submitted). A fresh 64 MiB buffer costs 16k page faults, and on a
    small machine those cost as much as the gather itself; a reused one is already mapped.

    A buffer that is never given back (its push failed) is simply dropped; at most `keep`
    buffers of at most `max_nbytes` each are kept.
    """

    def __init__(self, keep: int = 2, max_nbytes: int = 2**30) -> None:
        self._free: list[npt.NDArray[np.uint8]] = []
        self._keep = keep
        self._max_nbytes = max_nbytes

    def take(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A buffer of exactly `nbytes` bytes (a view of a kept one when one is large enough)."""
        fitting = [buffer for buffer in self._free if buffer.size >= nbytes]
        if not fitting:
            return np.empty(nbytes, dtype=np.uint8)
        buffer = min(fitting, key=lambda candidate: candidate.size)
        self._drop(buffer)
        return buffer[:nbytes]

    def give_back(self, view: npt.NDArray[np.uint8]) -> None:
        """`view` (from `take`) is no longer read or written by anyone: keep it for reuse."""
        buffer = view.base if isinstance(view.base, np.ndarray) else view
        if buffer.size > self._max_nbytes:
            return
        self._free.append(buffer)
        if len(self._free) > self._keep:
            self._drop(min(self._free, key=lambda candidate: candidate.size))

    def _drop(self, buffer: npt.NDArray[np.uint8]) -> None:
        # By identity: `list.remove` compares arrays with ==, element by element.
        self._free = [candidate for candidate in self._free if candidate is not buffer]


def _split_large(
    dst_offsets: Int64Array, src_offsets: Int64Array, nbytes: Int64Array, piece: int
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The same copies with every op longer than `piece` bytes cut into pieces of at most `piece`."""
    pieces = -(-nbytes // piece)
    op = np.repeat(np.arange(nbytes.size), pieces)
    first_piece = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    delta = (np.arange(op.size) - first_piece[op]) * piece
    return (
        dst_offsets[op] + delta,
        src_offsets[op] + delta,
        np.minimum(nbytes[op] - delta, piece),
    )
