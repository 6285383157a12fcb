"""CUDA-resident KV staged through pinned host memory, for the `ray` transport (sixth step, across
nodes on GPUs without RDMA): the writer gathers a plan's ops on its GPU, chunk by chunk, into
reused pinned buffers and hands chunk k to Ray while chunk k+1's device-to-host copy runs; the
receiver, after every check, copies a delivered payload into a pinned buffer, moves it to its GPU
and scatters it there.

    chunk_nbytes, chunk_ops  pure: a plan's ops cut at op boundaries into chunks of about a layer
                             (ops longer than a chunk split first)
    send_in_order            the writer's double buffering, over any `Gathers` (what queues a
                             chunk's copy and waits for it)
    PinnedSlots              reused pinned host buffers per GPU, each with a device staging buffer
                             once a kernel needs one; a slot is handed out again only once the
                             event of its last copy has completed
    DeviceGathers            the writer's copies, on a copy stream ordered after the model's: a
                             kernel gathers a chunk into device staging and one copy moves it to
                             pinned memory; chunks of few ops (all of them without Triton) are
                             copied op by op
    receive_payload          the receiver's copies: payload into pinned memory, one host-to-device
                             copy, a kernel scatters it (op by op for few ops or without Triton);
                             returns once the bytes are in place

The kernels are the `cuda_ipc` transport's (`launch_copy`); its package is imported only when a
GPU copy is first queued.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from kvray.errors import TransportError, WriteFailedError
from kvray.layout import Int64Array, ceil_div
from kvray.memory import Backing, SourceReady
from kvray.plan import OpTable, split_ops
from kvray.transport.cpu_copy import scatter_copy_async

ByteArray = npt.NDArray[np.uint8]

#: A chunk holds about one layer of the plan, but no less than this (few, larger deliveries for a
#: small plan: each costs a Ray call) ...
MIN_CHUNK_NBYTES = 1 << 20
#: ... and no more than this (two chunks of a write are staged at once, in pinned memory).
MAX_CHUNK_NBYTES = 64 << 20
#: Chunks of at most this many ops are copied op by op (one async copy each); more go through a
#: kernel and device staging.
PER_OP_COPIES = 4
#: Gathers queued at once per write: 2, double buffering.
STAGED_CHUNKS = 2
#: Pinned slots kept per GPU, and the smallest one made (sizes are powers of two above it).
KEPT_SLOTS = 4
MIN_SLOT_NBYTES = 1 << 20


# ---- chunks (pure) ------------------------------------------------------------------------------


def chunk_nbytes(total_nbytes: int, layers: int) -> int:
    """The chunk size for a plan of `total_nbytes` over `layers` layers: one layer's share,
    within [MIN_CHUNK_NBYTES, MAX_CHUNK_NBYTES]."""
    layer_nbytes = ceil_div(total_nbytes, max(1, layers))
    return max(MIN_CHUNK_NBYTES, min(MAX_CHUNK_NBYTES, layer_nbytes))


def chunk_ops(ops: OpTable, chunk_nbytes: int) -> list[OpTable]:
    """`ops`, in order, cut into consecutive non-empty chunks at op boundaries: every op longer
    than `chunk_nbytes` is split into pieces of at most `chunk_nbytes` first, then a chunk ends
    at the last op that ends at or before each multiple of `chunk_nbytes`. So each chunk holds
    less than twice `chunk_nbytes`, and a plan of equal layers (one op or many each) is cut at
    its layer boundaries."""
    if chunk_nbytes <= 0:
        raise ValueError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
    if len(ops) == 0:
        return []
    if int(ops.nbytes.max()) > chunk_nbytes:
        ops = _split(ops, chunk_nbytes)
    ends = np.cumsum(ops.nbytes)
    marks = np.arange(chunk_nbytes, int(ends[-1]), chunk_nbytes, dtype=np.int64)
    # Each op is at most one chunk long, so some op ends between two marks: no chunk is empty.
    cuts = np.searchsorted(ends, marks, side="right")
    bounds = np.unique(np.concatenate(([0], cuts, [len(ops)])))
    return [_op_rows(ops, start, stop) for start, stop in itertools.pairwise(bounds.tolist())]


def packed_offsets(nbytes: Int64Array) -> Int64Array:
    """Where each op's bytes start in a payload that holds them back to back."""
    return np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)


def _split(ops: OpTable, piece_nbytes: int) -> OpTable:
    pieces = ceil_div(ops.nbytes, piece_nbytes)
    remote_offset, local_offset, nbytes = split_ops(
        ops.remote_offset, ops.local_offset, ops.nbytes, piece_nbytes
    )
    return OpTable(
        np.repeat(ops.local_region, pieces),
        local_offset,
        np.repeat(ops.remote_region, pieces),
        remote_offset,
        nbytes,
    )


def _op_rows(ops: OpTable, start: int, stop: int) -> OpTable:
    return OpTable(
        ops.local_region[start:stop],
        ops.local_offset[start:stop],
        ops.remote_region[start:stop],
        ops.remote_offset[start:stop],
        ops.nbytes[start:stop],
    )


# ---- the writer's double buffering --------------------------------------------------------------

G = TypeVar("G")


class Gathers(Protocol[G]):
    """Copies of chunks into host memory, as `send_in_order` drives them."""

    def start(self, chunk: OpTable) -> G:
        """Queue the chunk's bytes (its ops' local side, back to back) into a host buffer of its own."""
        ...

    async def wait(self, gathers: Sequence[G]) -> None:
        """Return once these gathers' copies are over; cancelled, raise only once they are over."""
        ...

    def payload(self, gather: G) -> ByteArray:
        """A finished gather's bytes."""
        ...

    def release(self, gather: G) -> None:
        """Nobody reads the gather's bytes any more: its buffer may be reused once its copy is over."""
        ...


async def send_in_order(
    chunks: Sequence[OpTable],
    gathers: Gathers[G],
    submit: Callable[[OpTable, ByteArray], None],
    depth: int = STAGED_CHUNKS,
) -> None:
    """Gather every chunk into host memory and call `submit(chunk, payload)` for each, in order,
    once its bytes are there; `submit` must be done with the bytes when it returns (Ray copies a
    call's arguments when the call is submitted). Up to `depth` gathers are queued at once, so
    chunk k is submitted while chunk k+1's copy runs.

    Returns once every chunk was submitted. On a failure or cancellation it raises only once no
    copy it queued still runs: the caller may then free the source and reuse the buffers."""
    queued: deque[tuple[OpTable, G]] = deque()
    following = iter(chunks)

    def queue_next() -> None:
        chunk = next(following, None)
        if chunk is not None:
            queued.append((chunk, gathers.start(chunk)))

    try:
        for _ in range(depth):
            queue_next()
        while queued:
            chunk, gather = queued[0]
            await gathers.wait([gather])
            queued.popleft()
            try:
                submit(chunk, gathers.payload(gather))
            finally:
                gathers.release(gather)
            queue_next()
    except BaseException:
        try:
            await gathers.wait([pending for _, pending in queued])
        finally:
            for _, pending in queued:
                gathers.release(pending)
        raise


# ---- pinned buffers -----------------------------------------------------------------------------


@dataclass(eq=False)
class PinnedSlot:
    """A pinned host buffer, the device staging buffer of the same size kernels copy through
    (made when first needed), and the event recorded after the last copy that touched either."""

    host: torch.Tensor
    device: torch.Tensor | None
    used: torch.cuda.Event

    @property
    def capacity(self) -> int:
        return int(self.host.numel())

    def idle(self) -> bool:
        return bool(self.used.query())  # type: ignore[no-untyped-call]


class PinnedSlots:
    """Pinned slots kept for reuse, per GPU. Pinning host memory costs more host time than the
    copy it serves, so slots are kept; a slot is handed out again only once its last copy has
    completed (a write cancelled mid-copy gives its slots back as they are). At most `keep` per GPU
    are kept; a slot dropped while its copy runs stays allocated to that copy (torch's caching
    allocators record the copy's stream)."""

    def __init__(self, keep: int = KEPT_SLOTS) -> None:
        self._free: dict[torch.device, list[PinnedSlot]] = {}
        self._keep = keep

    def take(self, nbytes: int, device: torch.device, *, staged: bool) -> PinnedSlot:
        """An idle slot of at least `nbytes` for copies on `device`, with device staging if
        `staged`: a kept one, else a new one."""
        kept = self._free.setdefault(device, [])
        fitting = [slot for slot in kept if slot.capacity >= nbytes and slot.idle()]
        if fitting:
            slot = min(
                fitting, key=lambda candidate: (candidate.capacity, staged != (candidate.device is not None))
            )
            # By identity: dataclass(eq=False) compares slots by identity.
            kept.remove(slot)
        else:
            slot = self._new(max(MIN_SLOT_NBYTES, 1 << (max(nbytes, 1) - 1).bit_length()), device)
        if staged and slot.device is None:
            slot.device = self._new_staging(slot.capacity, device)
        return slot

    def give_back(self, slot: PinnedSlot, device: torch.device) -> None:
        kept = self._free.setdefault(device, [])
        kept.append(slot)
        if len(kept) > self._keep:
            kept.pop(0)

    def clear(self) -> None:
        self._free.clear()

    def _new(self, capacity: int, device: torch.device) -> PinnedSlot:
        host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        return PinnedSlot(host, None, torch.cuda.Event())  # type: ignore[no-untyped-call]

    def _new_staging(self, capacity: int, device: torch.device) -> torch.Tensor:
        from kvray.transport.cuda_ipc.streams import copy_stream

        # Made on the copy stream, the only one that uses it: the allocator may reuse its memory
        # for that stream's later work once it is dropped.
        with torch.cuda.stream(copy_stream(_index(device))):
            return torch.empty(capacity, dtype=torch.uint8, device=device)


# ---- the GPU copies -----------------------------------------------------------------------------


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_kernel(ops: int) -> bool:
    """Whether a chunk of `ops` ops is gathered or scattered by a kernel through device staging
    (else op by op)."""
    return ops > PER_OP_COPIES and triton_available()


@dataclass(eq=False)
class StagedChunk:
    """A chunk's gather: the slot its bytes go to, and how many."""

    slot: PinnedSlot
    nbytes: int


class DeviceGathers:
    """`Gathers` from GPU tensors (`sources`, by local region) on one GPU. The copies run on
    kvray's copy stream for that GPU, ordered after `ready` (`kvray.memory.SourceReady`), else
    after the work queued on the GPU's current stream when this object is made (the model that
    wrote the KV)."""

    def __init__(
        self,
        sources: Sequence[torch.Tensor],
        device: torch.device,
        slots: PinnedSlots,
        ready: SourceReady = None,
    ) -> None:
        from kvray.transport.cuda_ipc.streams import copy_stream, follow_current

        self._sources = sources
        self._device = device
        self._slots = slots
        self._stream = copy_stream(_index(device))
        follow_current(_index(device), self._stream, ready)

    def start(self, chunk: OpTable) -> StagedChunk:
        nbytes = chunk.total_nbytes
        kernel = uses_kernel(len(chunk))
        slot: PinnedSlot | None = None
        try:
            slot = self._slots.take(nbytes, self._device, staged=kernel)
            with torch.cuda.stream(self._stream):
                try:
                    _gather(slot, self._sources, chunk, kernel)
                finally:
                    slot.used.record(self._stream)
        except Exception as error:
            if slot is not None:  # reused only once whatever was queued into it is over
                self._slots.give_back(slot, self._device)
            raise WriteFailedError(
                f"copying {nbytes} bytes of KV from {self._device} into pinned host memory failed: "
                f"{type(error).__name__}: {error}",
                device=str(self._device),
            ) from error
        return StagedChunk(slot, nbytes)

    async def wait(self, gathers: Sequence[StagedChunk]) -> None:
        from kvray.transport.cuda_ipc.streams import wait_for_events

        await wait_for_events([gather.slot.used for gather in gathers], sum(g.nbytes for g in gathers))

    def payload(self, gather: StagedChunk) -> ByteArray:
        payload: ByteArray = gather.slot.host[: gather.nbytes].numpy()
        return payload

    def release(self, gather: StagedChunk) -> None:
        self._slots.give_back(gather.slot, self._device)


def device_gathers(
    local: Backing, ops: OpTable, slots: PinnedSlots, ready: SourceReady = None
) -> DeviceGathers:
    """The gathers of a write from the CUDA backing `local` (whose regions the ops read), after
    `ready` (`kvray.memory.SourceReady`)."""
    sources = [region.tensor for region in local.regions]
    device = one_device(sources[index] for index in np.unique(ops.local_region).tolist())
    return DeviceGathers(sources, device, slots, ready)


async def receive_payload(
    targets: Sequence[torch.Tensor],
    regions: Int64Array,
    offsets: Int64Array,
    nbytes: Int64Array,
    payload: ByteArray,
    slots: PinnedSlots,
    threads: int = 0,
) -> None:
    """The receiving half for a GPU destination, run after every check: scatter op i of a
    write (`nbytes[i]` bytes of `payload`, packed in order) to `offsets[i]` of `targets[regions[i]]`,
    through a pinned buffer and the GPU. Returns once every byte is in place; cancelled, it
    raises only once no copy it queued still runs (the caller's completion must not overtake
    the bytes, and the request's blocks may be freed after it)."""
    from kvray.transport.cuda_ipc.streams import copy_stream, wait_for_events

    device = one_device(targets[index] for index in np.unique(regions).tolist())
    size = int(payload.size)
    kernel = uses_kernel(int(regions.size))
    try:
        slot = slots.take(size, device, staged=kernel)
    except Exception as error:
        raise WriteFailedError(
            f"no pinned host memory for a write of {size} bytes into {device}: "
            f"{type(error).__name__}: {error}",
            device=str(device),
        ) from error
    try:
        whole = np.zeros(1, dtype=np.int64)
        await scatter_copy_async(
            slot.host.data_ptr(),
            int(payload.ctypes.data),
            whole,
            whole,
            np.array([size], dtype=np.int64),
            threads,
        )
        stream = copy_stream(_index(device))
        try:
            with torch.cuda.stream(stream):
                try:
                    _scatter(slot, targets, regions, offsets, nbytes, kernel)
                finally:
                    slot.used.record(stream)
        except Exception as error:
            raise WriteFailedError(
                f"moving {size} bytes of KV from pinned host memory into {device} failed: "
                f"{type(error).__name__}: {error}",
                device=str(device),
            ) from error
        finally:
            # Also after a failure: whatever was queued lands before the caller moves on.
            await wait_for_events([slot.used], size)
    finally:
        slots.give_back(slot, device)


def _gather(slot: PinnedSlot, sources: Sequence[torch.Tensor], chunk: OpTable, kernel: bool) -> None:
    """Queue on the current stream: the chunk's bytes, back to back, into `slot.host`."""
    size = chunk.total_nbytes
    packed = packed_offsets(chunk.nbytes)
    host = slot.host[:size]
    if kernel:
        from kvray.transport.cuda_ipc.ops import launch_copy

        assert slot.device is not None
        staged = slot.device[:size]
        for index, select in _by_region(chunk.local_region):
            launch_copy(
                staged, sources[index], packed[select], chunk.local_offset[select], chunk.nbytes[select]
            )
        host.copy_(staged, non_blocking=True)
        return
    for index, offset, start, count in zip(
        chunk.local_region.tolist(),
        chunk.local_offset.tolist(),
        packed.tolist(),
        chunk.nbytes.tolist(),
        strict=True,
    ):
        host[start : start + count].copy_(sources[index][offset : offset + count], non_blocking=True)


def _scatter(
    slot: PinnedSlot,
    targets: Sequence[torch.Tensor],
    regions: Int64Array,
    offsets: Int64Array,
    nbytes: Int64Array,
    kernel: bool,
) -> None:
    """Queue on the current stream: the bytes in `slot.host`, packed in op order, to their places."""
    size = int(nbytes.sum())
    packed = packed_offsets(nbytes)
    host = slot.host[:size]
    if kernel:
        from kvray.transport.cuda_ipc.ops import launch_copy

        assert slot.device is not None
        staged = slot.device[:size]
        staged.copy_(host, non_blocking=True)
        for index, select in _by_region(regions):
            launch_copy(targets[index], staged, offsets[select], packed[select], nbytes[select])
        return
    for index, offset, start, count in zip(
        regions.tolist(), offsets.tolist(), packed.tolist(), nbytes.tolist(), strict=True
    ):
        targets[index][offset : offset + count].copy_(host[start : start + count], non_blocking=True)


def _by_region(regions: Int64Array) -> list[tuple[int, slice | npt.NDArray[np.bool_]]]:
    """Each region the ops name, with the selector of its ops (the usual one region: no scan)."""
    if regions.size and not regions.any():
        return [(0, slice(None))]
    return [(index, regions == index) for index in np.unique(regions).tolist()]


def one_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The one GPU the given tensors live on (the staged copies run on one GPU's stream)."""
    devices = {tensor.device for tensor in tensors}
    if len(devices) != 1:
        raise TransportError(
            "the ray transport stages a write's GPU memory on one GPU, but its regions lie on "
            f"{', '.join(sorted(str(device) for device in devices)) or 'no device'}; keep an engine's "
            "KV tensors on one GPU",
            devices=sorted(str(device) for device in devices),
        )
    return devices.pop()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
