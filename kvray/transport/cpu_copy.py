"""A plan's ops copied between two CPU buffers, for the CPU transports (shm, ray, loopback): by
the C copy pool (`kvray._copy_pool`) when it is built, else by a per-op ctypes loop on Python
threads; every op of a plan in a few calls either way."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import select
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvray.layout import Int64Array, ceil_div
from kvray.plan import split_ops

_scatter_copy: Callable[..., Any] | None
_start_copy: Callable[..., Any] | None
try:
    from kvray._copy_pool import scatter_copy as _scatter_copy
    from kvray._copy_pool import start_copy as _start_copy
except ImportError:  # built by `pip install`; a source checkout without a build falls back
    _scatter_copy = _start_copy = None


@runtime_checkable
class Datagram(Protocol):
    """A `then` the C pool's thread can send itself, without Python, once the last byte is
    copied (`kvray.notice.local.DatagramNotice`): the socket, the inbox path and the message;
    `sent` records whether it went."""

    sent: bool

    def datagram(self) -> tuple[int, bytes, bytes]: ...

    def __call__(self) -> None: ...


def resolve_once(future: asyncio.Future[None]) -> None:
    """A reader or writer callback: resolve `future` the first time the descriptor is ready
    (the loop may call it again before the callback is removed)."""
    if not future.done():
        future.set_result(None)


#: Ops smaller than this many bytes in total are copied on the calling thread.
_PARALLEL_THRESHOLD = 4 * 2**20
#: Threads sharing a batch claim at most this many bytes at a time (longer ops are split).
_CLAIM_NBYTES = 2**20

#: The fallback's threads (without the C extension); the C copy has a pool of its own.
_executor: ThreadPoolExecutor | None = None
#: The most threads one copy uses.
_MAX_THREADS = 4


def copy_threads() -> int:
    """Threads a copy uses unless told (`Settings.copy_threads`): every core, 1 to 4. A further
    thread speeds a large copy only while a core is idle for it; engines that share their cores
    with a model's compute may want fewer."""
    return max(1, min(_MAX_THREADS, os.cpu_count() or 1))


def native() -> bool:
    """True when the C batched copy and its thread pool are built (else a slower per-op ctypes
    loop runs on Python threads)."""
    return _scatter_copy is not None and _start_copy is not None


def scatter_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
) -> None:
    """Copy nbytes[i] bytes from src_base + src_offsets[i] to dst_base + dst_offsets[i], on
    the calling thread (with the GIL released)."""
    dst_offsets = np.ascontiguousarray(dst_offsets, dtype=np.int64)
    src_offsets = np.ascontiguousarray(src_offsets, dtype=np.int64)
    nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
    if _scatter_copy is not None:
        _scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes)
        return
    if (dst_offsets < 0).any() or (src_offsets < 0).any() or (nbytes < 0).any():
        raise ValueError("scatter_copy got a negative offset or length")
    for dst, src, count in zip(
        (dst_base + dst_offsets).tolist(), (src_base + src_offsets).tolist(), nbytes.tolist(), strict=True
    ):
        ctypes.memmove(dst, src, count)


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
    `then()`, if given, is called once every byte is copied (see `Transport.write_then`); a
    `Datagram` is sent by the C pool's thread that copied the last byte.

    With the C copy, the threads of its pool share the op list and each claims the next ops as
    it goes (ops longer than `_CLAIM_NBYTES` are split first), so a thread the scheduler parks
    on a busy machine does not leave its share undone; without it, the ops are cut into equal
    shares for Python threads. `threads`: how many (0: `copy_threads()`).

    Every thread is out of the copy before this returns, also when it is cancelled: whoever
    releases the memory next never races a thread still writing into it.
    """
    total = int(nbytes.sum())
    threads = min(threads or copy_threads(), _MAX_THREADS)
    if total < _PARALLEL_THRESHOLD:
        scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes)
        if then is not None:
            then()
        return
    if native():
        await _pool_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes, threads, then)
        return
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=_MAX_THREADS, thread_name_prefix="kvray-copy")
    loop = asyncio.get_running_loop()
    share_nbytes = ceil_div(total, threads)
    if int(nbytes.max()) > share_nbytes:
        dst_offsets, src_offsets, nbytes = split_ops(dst_offsets, src_offsets, nbytes, share_nbytes)
    # Cut at op boundaries: with every op at most one share, each cut is off by less than one.
    ends = np.cumsum(nbytes)
    cuts = np.searchsorted(ends, [share_nbytes * k for k in range(1, threads)], side="left") + 1
    bounds = [0, *np.minimum(cuts, nbytes.size).tolist(), nbytes.size]
    shares = asyncio.gather(
        *(
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
        )
    )
    await _until_over(shares, shares.done)
    if then is not None:  # equal shares: no thread knows it copied the last byte
        then()


async def _pool_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    threads: int,
    then: Callable[[], None] | None,
) -> None:
    assert _start_copy is not None
    notice = then if isinstance(then, Datagram) else None
    job = _start_copy(
        dst_base,
        src_base,
        np.ascontiguousarray(dst_offsets, dtype=np.int64),
        np.ascontiguousarray(src_offsets, dtype=np.int64),
        np.ascontiguousarray(nbytes, dtype=np.int64),
        threads,
        _CLAIM_NBYTES,
        None if notice is None else notice.datagram(),
    )
    loop = asyncio.get_running_loop()
    over: asyncio.Future[None] = loop.create_future()
    fileno = job.fileno()
    try:
        loop.add_reader(fileno, resolve_once, over)
    except BaseException:
        # The threads are copying already and the caller may release the memory once this
        # raises: wait for them here (the copy is bounded) before letting the error through.
        select.select([fileno], [], [])
        raise
    try:
        await _until_over(over, lambda: bool(job.over))
    finally:
        loop.remove_reader(fileno)
    if not job.complete:
        raise RuntimeError("a copy thread left ops of the batch uncopied")
    if notice is not None:
        notice.sent = bool(job.notice_sent)
    elif then is not None:
        then()


async def _until_over(copies: asyncio.Future[Any], over: Callable[[], bool]) -> None:
    """Await `copies`; if cancelled meanwhile, first wait until `over()` (a thread cannot be
    stopped mid-copy, and the caller is about to release or hand back the memory), then let
    the cancellation through. The copies are bounded, so this wait is too."""
    try:
        await asyncio.shield(copies)
    except asyncio.CancelledError:
        while not over():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([copies])
        raise


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
