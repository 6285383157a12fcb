"""A plan's ops copied between two CPU buffers, for the CPU transports (shm, ray, loopback): by
the C copy pool (`kvray._copy_pool`) when it is built, else by a per-op ctypes loop on Python
threads; every op of a plan in a few calls either way. Each copy returns the placement digest
(`kvray.placement`) of the destination ranges it stored to, taken from the addresses it used,
and, when asked, the content digest of what it copied (`kvray.content`), taken in the same pass."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import select
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import numpy as np
import numpy.typing as npt

from kvray.content import destination_factor, hash_bytes, pair_salt, region_seed
from kvray.layout import Int64Array, ceil_div
from kvray.placement import (
    CONTENT_TAIL,
    MASK64,
    NOTHING,
    PLACEHOLDER_BYTES,
    REGION_SHIFT,
    Stored,
    ranges_digest,
)
from kvray.plan import split_ops

if TYPE_CHECKING:
    from kvray._copy_pool import CopyJob

_scatter_copy: Callable[..., Any] | None
_start_copy: Callable[..., Any] | None
_start_rows: Callable[..., Any] | None
_set_executor_fault: Callable[[bool], None] | None
try:
    from kvray._copy_pool import scatter_copy as _scatter_copy
    from kvray._copy_pool import set_executor_fault as _set_executor_fault
    from kvray._copy_pool import start_copy as _start_copy
    from kvray._copy_pool import start_rows as _start_rows
except ImportError:  # built by `pip install`; a source checkout without a build falls back
    _scatter_copy = _start_copy = _start_rows = _set_executor_fault = None

#: Faults only (`kvray.faults.ExecutorOffsetBug`): the Python fallback's copy of the C flag.
_executor_fault = False


def set_executor_fault(on: bool) -> None:
    """Faults only: make every CPU copy executor store the last op of a batch of two or more
    over the op before it, as an executor with a wrong offset would under a correct plan."""
    global _executor_fault
    _executor_fault = on
    if _set_executor_fault is not None:
        _set_executor_fault(on)


class Datagram(Protocol):
    """A `then` the C pool's thread can send itself, without Python, once the last byte is
    copied (`kvray.notice.local.DatagramNotice`): the socket, the inbox path and the message;
    `sent` records whether it went."""

    sent: bool

    def datagram(self) -> tuple[int, bytes, bytes]: ...

    def __call__(self, stored: Stored) -> None: ...


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
#: The machine's cores, read once (`os.cpu_count` reads a file each time).
_CORES = os.cpu_count() or 1


def copy_threads() -> int:
    """Threads a copy uses unless told (`Settings.copy_threads`): every core, 1 to 4. A further
    thread speeds a large copy only while a core is idle for it; engines that share their cores
    with a model's compute may want fewer."""
    return max(1, min(_MAX_THREADS, _CORES))


def rows_native() -> bool:
    """True when the C copy can take a request's rows and block ids itself (`copy_rows`)."""
    return native() and _start_rows is not None


def native() -> bool:
    """True when the C batched copy and its thread pool are built (else a slower per-op ctypes
    loop runs on Python threads)."""
    return _scatter_copy is not None and _start_copy is not None


class Hashing(NamedTuple):
    """What a copy needs to hash what it copies (`kvray.content`): the source region's seed, the
    (source, destination) regions' salt and, for bytes copied from a staging buffer, each op's
    offset in its source region (None: the copy's source offsets are those)."""

    seed: int
    pair_salt: int
    offsets: Int64Array | None = None

    @staticmethod
    def between(src_region: int, dst_region: int, offsets: Int64Array | None = None) -> Hashing:
        return Hashing(region_seed(src_region), pair_salt(src_region, dst_region), offsets)


def scatter_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    salt: int = 0,
    hashing: Hashing | None = None,
) -> Stored:
    """Copy nbytes[i] bytes from src_base + src_offsets[i] to dst_base + dst_offsets[i], on
    the calling thread (with the GIL released); the placement digest of what it stored
    (`salt`: the destination region's, `kvray.placement.region_salt`) and, with `hashing`, the
    content digest of what it copied (source offsets are offsets in the source region)."""
    dst_offsets = np.ascontiguousarray(dst_offsets, dtype=np.int64)
    src_offsets = np.ascontiguousarray(src_offsets, dtype=np.int64)
    nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
    if _scatter_copy is not None:
        if hashing is None:
            return Stored(int(_scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes, salt)))
        named = _hash_offsets(hashing)
        placement, content = _scatter_copy(
            dst_base,
            src_base,
            dst_offsets,
            src_offsets,
            nbytes,
            salt,
            hashing.seed,
            hashing.pair_salt,
            True,
            *named,
        )
        return Stored(int(placement), int(content))
    if (dst_offsets < 0).any() or (src_offsets < 0).any() or (nbytes < 0).any():
        raise ValueError("scatter_copy got a negative offset or length")
    if _executor_fault and nbytes.size >= 2:  # as the C executor does (`set_executor_fault`)
        dst_offsets, nbytes = dst_offsets.copy(), nbytes.copy()
        dst_offsets[-1] = dst_offsets[-2]
        nbytes[-1] = min(nbytes[-1], nbytes[-2])
    content = 0
    logical = src_offsets if hashing is None or hashing.offsets is None else hashing.offsets
    for dst, src, at, count in zip(
        dst_offsets.tolist(), src_offsets.tolist(), logical.tolist(), nbytes.tolist(), strict=True
    ):
        ctypes.memmove(dst_base + dst, src_base + src, count)
        if hashing is not None and count:
            copied = np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(dst_base + dst))
            factor = destination_factor(hashing.pair_salt, dst - at)
            content += factor * hash_bytes(copied, at, hashing.seed)
    region = np.full(dst_offsets.size, (salt >> REGION_SHIFT) - 1, dtype=np.int64)
    placement = ranges_digest(region, dst_offsets, nbytes)
    return Stored(placement, None if hashing is None else content & MASK64)


def _hash_offsets(hashing: Hashing | None) -> tuple[Int64Array, ...]:
    """The C copy's optional last argument: the ops' source offsets, for a staged copy."""
    if hashing is None or hashing.offsets is None:
        return ()
    return (np.ascontiguousarray(hashing.offsets, dtype=np.int64),)


async def scatter_copy_async(
    dst_base: int,
    src_base: int,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    threads: int = 0,
    then: Callable[[Stored], None] | None = None,
    salt: int = 0,
    base: Stored = NOTHING,
    hashing: Hashing | None = None,
) -> Stored:
    """`scatter_copy` off the event loop; a large batch is copied by a few threads at once.
    Returns `base` plus the digests of what it stored (see `scatter_copy`). `then(stored)`, if
    given, is called with that sum once every byte is copied (see `Transport.write_then`); a
    `Datagram` is sent by the C pool's thread that copied the last byte, the sums written into
    the message's placeholders.

    With the C copy, the threads of its pool share the op list and each claims the next ops as
    it goes (ops longer than `_CLAIM_NBYTES` are split first), so a thread the scheduler parks
    on a busy machine does not leave its share undone; without it, the ops are cut into equal
    shares for Python threads. `threads`: how many (0: `copy_threads()`).

    Every thread is out of the copy before this returns, also when it is cancelled: whoever
    releases the memory next never races a thread still writing into it.
    """
    total = int(nbytes.sum())
    threads = min(threads or copy_threads(), _MAX_THREADS)
    staged = hashing is not None and hashing.offsets is not None
    if total < _PARALLEL_THRESHOLD or (staged and not native()):
        stored = base.plus(scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes, salt, hashing))
        if then is not None:
            then(stored)
        return stored
    if native():
        return await _pool_copy(
            dst_base, src_base, dst_offsets, src_offsets, nbytes, threads, then, salt, base, hashing
        )
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
                salt,
                hashing,
            )
            for start, stop in itertools.pairwise(bounds)
            if stop > start
        )
    )
    await _until_over(shares, shares.done)
    stored = base
    for share in shares.result():
        stored = stored.plus(share)
    if then is not None:  # equal shares: no thread knows it copied the last byte
        then(stored)
    return stored


async def _pool_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    threads: int,
    then: Callable[[Stored], None] | None,
    salt: int,
    base: Stored,
    hashing: Hashing | None,
) -> Stored:
    assert _start_copy is not None
    # Duck-typed: an isinstance check against a protocol walks its members on every call.
    notice = cast(Datagram, then) if callable(getattr(then, "datagram", None)) else None
    datagram = None
    if notice is not None:
        fd, path, message = notice.datagram()
        datagram = (fd, path, message, notice_patch(message, hashed=hashing is not None))
    job = _start_copy(
        dst_base,
        src_base,
        np.ascontiguousarray(dst_offsets, dtype=np.int64),
        np.ascontiguousarray(src_offsets, dtype=np.int64),
        np.ascontiguousarray(nbytes, dtype=np.int64),
        threads,
        _CLAIM_NBYTES,
        datagram,
        salt,
        base.placement,
        hashing is not None,
        0 if hashing is None else hashing.seed,
        0 if hashing is None else hashing.pair_salt,
        base.content or 0,
        *_hash_offsets(hashing),
    )
    await job_over(job)
    if not job.complete:
        raise RuntimeError("a copy thread left ops of the batch uncopied")
    content = None if hashing is None or base.content is None else int(job.content)
    stored = Stored(int(job.placement), content)
    if notice is not None:
        notice.sent = bool(job.notice_sent)
    elif then is not None:
        then(stored)
    return stored


class ClaimSlot(NamedTuple):
    """A request's slot in its decode engine's claim board (`kvray.notice.claims`), as the C copy
    takes it: the board file's descriptor (its locks), the slot, the board's slots, the address
    of its mapping, and the token the slot must be open under."""

    fd: int
    slot: int
    slots: int
    address: int
    token: int


async def copy_rows(
    dst_base: int,
    src_base: int,
    rows: Int64Array,
    ids: Int64Array,
    src_nbytes: int,
    dst_nbytes: int,
    nbytes: int,
    *,
    threads: int,
    notice: tuple[int, bytes, bytes, int] | None,
    claim: ClaimSlot,
    salt: int,
    hashing: Hashing | None,
) -> tuple[Stored, bool] | None:
    """A request's copy planned by the C copy itself (`kvray._copy_pool.start_rows`): `rows`
    holds five int64 columns of one source and one destination region (source start and block
    stride, destination start and block stride, bytes), `ids` the local then the remote block
    ids, paired. It checks every op against both regions' lengths, takes the request's claim
    slot (`claim`) and holds it until the last byte is in place; the thread that copies that
    byte lets go of the claim and then sends `notice` (socket, path, message, `notice_patch`).
    A copy under `_PARALLEL_THRESHOLD` bytes runs on this thread (the GIL released), larger ones on the pool.

    Returns what it stored and whether the notice went; None when the engine holds the slot (it
    is closing it): nothing was written. Raises `LookupError` (nothing written) when the slot
    is not open under the token, `ValueError` when an op would leave a region."""
    assert _start_rows is not None
    threads = min(threads or copy_threads(), _MAX_THREADS)
    job = _start_rows(
        dst_base,
        src_base,
        rows,
        ids,
        src_nbytes,
        dst_nbytes,
        0 if nbytes < _PARALLEL_THRESHOLD else threads,
        _CLAIM_NBYTES,
        notice,
        tuple(claim),
        salt,
        hashing is not None,
        0 if hashing is None else hashing.seed,
        0 if hashing is None else hashing.pair_salt,
    )
    if job is None:
        return None
    await job_over(job)
    if not job.complete:
        raise RuntimeError("a copy thread left ops of the request uncopied")
    stored = Stored(int(job.placement), None if hashing is None else int(job.content))
    return stored, bool(job.notice_sent)


def notice_patch(message: bytes, *, hashed: bool) -> int:
    """What the C copy writes into a notice datagram's placeholders (`kvray.placement`): 0
    nothing, 1 the placement digest into its last 8 bytes, 2 the content digest too (where the
    message has its placeholder and the copy hashes)."""
    if not message.endswith(PLACEHOLDER_BYTES):
        return 0
    return 2 if hashed and message.endswith(CONTENT_TAIL) else 1


async def job_over(job: CopyJob) -> None:
    """Return once every thread of `job` has left it (at once for a job copied by its caller).
    Cancelled meanwhile, it first waits for the threads (a copy is bounded): the caller may
    release the memory they write the moment this raises."""
    if job.over:
        return
    loop = asyncio.get_running_loop()
    over: asyncio.Future[None] = loop.create_future()
    fileno = job.fileno()
    try:
        loop.add_reader(fileno, resolve_once, over)
    except BaseException:
        select.select([fileno], [], [])
        raise
    try:
        await _until_over(over, lambda: bool(job.over))
    finally:
        loop.remove_reader(fileno)


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
