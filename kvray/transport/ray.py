"""`ray` transport: anywhere Ray runs, no special hardware. The writer gathers every op's bytes
into one numpy buffer (numpy, not torch views, which would pickle their whole storage) and
hands it with a `WriteOps` header to the actor hosting the peer's agent; the peer checks every
op against its own region and scatters (`apply_write`).

KV on a GPU is staged through pinned host memory (`kvray.transport.cuda_staging`): a CUDA writer
sends a plan in chunks of about a layer, each gathered on its GPU into a pinned buffer and
delivered while the next one's device-to-host copy runs; a CUDA receiver moves each payload to
its GPU and scatters it there, after the same checks, before it answers. So GPU engines on two
nodes need no NIC support, and either side may be on the CPU."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvray.config import Settings
from kvray.content import staged_content
from kvray.errors import (
    BoundsError,
    KvrayError,
    StaleIncarnationError,
    TransportError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.layout import Int64Array
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.metrics import EngineMetrics
from kvray.placement import NOTHING, Stored, ranges_digest, region_salt
from kvray.plan import OpTable, TransferPlan, check_ops
from kvray.transport.base import OpsCheck, Peer, Reach, Receiver, Transport, check_write
from kvray.transport.cpu_copy import Hashing, StagingBuffers, scatter_copy_async
from kvray.transport.cuda_staging import (
    PinnedSlots,
    chunk_nbytes,
    chunk_ops,
    device_gathers,
    packed_offsets,
    receive_payload,
    send_in_order,
)
from kvray.wire import EngineInfo, TransportKind, WriteOps, decode_write_ops, encode

if TYPE_CHECKING:
    import ray

CANCEL_RETRY_S = 0.5

#: Engines whose regions these transports registered (the registry's, one per kind of memory)
#: run their agent behind a Ray actor that takes deliveries, and are written by offset; an engine
#: registered through another (`loopback`: in process, no actor) is not.
_DELIVERABLE = frozenset({TransportKind.RAY, TransportKind.SHM, TransportKind.CUDA_IPC})


def _ray_missing() -> str | None:
    """Why Ray does not import here (None: it does)."""
    try:
        import ray  # noqa: F401
    except ImportError as error:
        return f"Ray does not import ({error}); install it: pip install 'ray>=2.60,<3'"
    return None


class RayTransport(Transport):
    kind = TransportKind.RAY
    needs = "only Ray, which kvray starts or joins"
    reach = Reach.ANYWHERE
    source_kinds = frozenset({MemoryKind.CPU, MemoryKind.SHM, MemoryKind.CUDA})
    #: A CUDA destination's regions are published by `cuda_ipc` (which registers CUDA backings);
    #: this transport ignores their handles and writes through the peer's agent, by offset.
    destination_kinds = frozenset({MemoryKind.CPU, MemoryKind.SHM, MemoryKind.CUDA})
    registers = frozenset({MemoryKind.CPU})

    def __init__(self, settings: Settings, metrics: EngineMetrics | None = None) -> None:
        super().__init__(settings, metrics)
        self._transfers = 0
        self._staging = StagingBuffers()
        #: Pinned buffers for GPU writes and deliveries into GPU memory.
        self._pinned = PinnedSlots()
        # Deliveries given up on that may still be parked at their peer, and the task that keeps
        # cancelling them until each one has ended.
        self._abandoned: set[ray.ObjectRef[Any]] = set()
        self._canceller: asyncio.Task[None] | None = None

    @classmethod
    def accepts(cls, peer: EngineInfo) -> bool:
        return all(region.transport in _DELIVERABLE for region in peer.regions)

    @classmethod
    def unavailable_reason(cls, settings: Settings) -> str | None:
        missing = _ray_missing()
        if missing is not None:
            return missing
        import ray

        if not ray.is_initialized():
            return "Ray is not initialized in this process (call ray.init or run inside a Ray actor)"
        return None

    @classmethod
    def machine_unavailable_reason(cls, settings: Settings) -> str | None:
        # Whether Ray runs in the asking process says nothing of the machine: kvray starts a
        # local Ray or joins a cluster wherever it runs engines, so Ray importing is enough.
        return _ray_missing()

    def hashes(self, local: Backing, peer: Peer) -> bool:
        # The receiver hashes what it scatters (or, into a GPU, the payload it uploads).
        return local.kind is not MemoryKind.CUDA

    async def write(
        self, plan: TransferPlan, local: Backing, peer: Peer, *, ready: SourceReady = None
    ) -> Stored:
        if peer.host is None:
            raise TransportError(
                f"engine {peer.info.engine_id!r} has no Ray actor to deliver to; the ray transport "
                "needs the peer's agent inside a Ray actor",
                engine_id=peer.info.engine_id,
            )
        check_write(plan, local, peer)
        if local.kind is MemoryKind.CUDA:
            await self._write_from_device(plan, local, peer, ready)
            return NOTHING  # the receiver's scatter reports what it stored (`Receiver.landed`)
        ops = plan.ops
        payload = self._staging.take(ops.total_nbytes)
        payload_offset = packed_offsets(ops.nbytes)
        for index in np.unique(ops.local_region).tolist():
            source = local.regions[index].tensor
            select = ops.local_region == index
            await scatter_copy_async(
                int(payload.ctypes.data),
                source.data_ptr(),
                payload_offset[select],
                ops.local_offset[select],
                ops.nbytes[select],
                self.settings.copy_threads,
            )
        header = self._header(plan, ops, self._next_transfer_id(plan))
        delivery = peer.host.kvray_deliver.remote(encode(header), payload)
        # Submitting the call copied the payload into Ray's object store: the buffer is free.
        self._staging.give_back(payload)
        try:
            await delivery
        except asyncio.CancelledError:
            # Past its deadline (or cancelled): the write must not land later, and its payload
            # must not stay queued at a slow peer. Best effort; the peer also refuses writes for
            # requests it no longer expects.
            self._abandon(delivery)
            raise
        except Exception as error:
            failure = _delivery_failure(error, ops.total_nbytes, peer)
            if failure is error:
                raise
            raise failure from error
        return NOTHING  # the receiver's scatter reports what it stored (`Receiver.landed`)

    async def _write_from_device(
        self, plan: TransferPlan, local: Backing, peer: Peer, ready: SourceReady
    ) -> None:
        """A CUDA source: the plan's ops in chunks of about a layer, each gathered on the GPU into
        a pinned buffer and delivered while the next chunk's copy runs; every delivery is
        awaited before this returns (and abandoned, as a whole write is, when it fails or is
        cancelled)."""
        ops = plan.ops
        chunks = chunk_ops(ops, chunk_nbytes(ops.total_nbytes, len(plan.layers)))
        if not chunks:
            return
        transfer_id = self._next_transfer_id(plan)
        deliveries: list[Any] = []

        def submit(chunk: OpTable, payload: npt.NDArray[np.uint8]) -> None:
            header = self._header(plan, chunk, f"{transfer_id}.{len(deliveries)}")
            delivery = peer.host.kvray_deliver.remote(encode(header), payload)
            # An in-process stand-in's call runs from now on, as a Ray call would.
            deliveries.append(asyncio.ensure_future(delivery) if inspect.iscoroutine(delivery) else delivery)

        try:
            await send_in_order(chunks, device_gathers(local, ops, self._pinned, ready), submit)
            for delivery in deliveries:
                await delivery
        except asyncio.CancelledError:
            for delivery in deliveries:
                self._abandon(delivery)
            raise
        except Exception as error:
            # The write has failed: its other chunks must not land later either.
            for delivery in deliveries:
                self._abandon(delivery)
            failure = _delivery_failure(error, ops.total_nbytes, peer)
            if failure is error:
                raise
            raise failure from error

    def _next_transfer_id(self, plan: TransferPlan) -> str:
        self._transfers += 1
        return f"{plan.src_engine}:{plan.src_incarnation}:w{self._transfers}"

    @staticmethod
    def _header(plan: TransferPlan, ops: OpTable, transfer_id: str) -> WriteOps:
        return WriteOps(
            transfer_id=transfer_id,
            dst_engine=plan.dst_engine,
            dst_incarnation=plan.dst_incarnation,
            regions=ops.remote_region.tolist(),
            remote_offsets=ops.remote_offset.tolist(),
            nbytes=ops.nbytes.tolist(),
            request_id=plan.request_id,
            token=plan.token,
            # Named only where the request is checked: the receiver then hashes what it stores.
            src_regions=ops.local_region.tolist() if plan.hashed else [],
            src_offsets=ops.local_offset.tolist() if plan.hashed else [],
        )

    def _abandon(self, delivery: ray.ObjectRef[Any]) -> None:
        """Cancel a delivery, and keep cancelling it until it has ended.

        Ray drops a cancel that reaches the peer between the call's arrival and the start of its
        coroutine, so one `ray.cancel` is not enough to guarantee that no payload stays parked at
        a slow peer."""
        import ray

        if isinstance(delivery, asyncio.Future):  # an in-process stand-in's call, running here
            delivery.cancel()
            return
        if not isinstance(delivery, ray.ObjectRef):  # an in-process stand-in: cancelled with us
            return
        _cancel(delivery)
        self._abandoned.add(delivery)
        loop = asyncio.get_running_loop()

        def ended(_: object) -> None:  # on a Ray thread
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(self._abandoned.discard, delivery)

        delivery.future().add_done_callback(ended)
        if self._canceller is None or self._canceller.done():
            self._canceller = asyncio.get_running_loop().create_task(self._keep_cancelling())

    async def _keep_cancelling(self) -> None:
        while self._abandoned:
            await asyncio.sleep(CANCEL_RETRY_S)
            for delivery in list(self._abandoned):
                _cancel(delivery)

    async def deliver(self, receiver: Receiver, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        """A write arriving at the decode engine: it must name the engine's incarnation, a
        request the engine expects and that request's token (`Receiver.admit`), and every op
        must lie inside its region and inside the request's blocks; then it is scattered."""
        info = receiver.info
        message = read_header(header, info.engine_id, info.incarnation)
        async with receiver.admit(message.request_id, message.token) as within:

            def landed(stored: Stored) -> None:
                receiver.landed(message.request_id, stored)

            return await apply_ops(
                receiver.backing,
                info.engine_id,
                message,
                payload,
                within=within,
                slots=self._pinned,
                landed=landed,
            )

    async def close(self) -> None:
        if self._canceller is not None:
            self._canceller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._canceller
        self._abandoned.clear()
        self._pinned.clear()


def _delivery_failure(error: Exception, nbytes: int, peer: Peer) -> Exception:
    """What a failed delivery raises: the receiver's kvray error as it raised it (Ray wraps it),
    else a `WriteFailedError` naming the peer."""
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, TransportError | StaleIncarnationError | BoundsError):
        return cause
    if isinstance(cause, KvrayError) and cause is error:
        return error
    return WriteFailedError(
        f"delivering {nbytes} bytes to engine {peer.info.engine_id!r} failed: "
        f"{type(cause).__name__}: {cause}",
        engine_id=peer.info.engine_id,
    )


def _cancel(delivery: ray.ObjectRef[Any]) -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.cancel(delivery)


async def apply_write(
    backing: Backing, engine_id: str, incarnation: int, header: bytes, payload: npt.NDArray[np.uint8]
) -> int:
    """The receiving half: check a `WriteOps` against this engine and its regions, then scatter.

    Nothing is written unless every op lies inside its region and the payload holds exactly
    the ops' bytes. Returns the number of bytes written.
    """
    return await apply_ops(backing, engine_id, read_header(header, engine_id, incarnation), payload)


def read_header(header: bytes, engine_id: str, incarnation: int) -> WriteOps:
    """A write's header, decoded (msgspec, never pickle) and checked to name this engine incarnation."""
    message = decode_write_ops(header)
    if message.dst_engine != engine_id or message.dst_incarnation != incarnation:
        raise StaleIncarnationError(
            f"write for engine {message.dst_engine!r} incarnation {message.dst_incarnation} reached "
            f"engine {engine_id!r} incarnation {incarnation}; the writer must look the engine up again",
            engine_id=engine_id,
            incarnation=incarnation,
            stale_incarnation=message.dst_incarnation,
        )
    return message


async def apply_ops(
    backing: Backing,
    engine_id: str,
    message: WriteOps,
    payload: npt.NDArray[np.uint8],
    within: OpsCheck | None = None,
    slots: PinnedSlots | None = None,
    landed: Callable[[Stored], None] | None = None,
) -> int:
    """`apply_write` after `read_header`: check every op and the payload, then scatter.
    `within(regions, offsets, nbytes)`, when given, raises for ops outside what the write's
    request may change (its blocks), after the region checks and before any byte moves. Into a
    CUDA backing the bytes go through a pinned buffer of `slots` (a fresh one if None) and the
    GPU; either way this returns once they are all in place, after `landed(stored)` is told
    what the scatter stored (`kvray.placement.Stored`: with a content digest where the header
    names each op's source, `WriteOps.src_regions` and `src_offsets`)."""
    regions = np.asarray(message.regions, dtype=np.int64)
    offsets = np.asarray(message.remote_offsets, dtype=np.int64)
    nbytes = np.asarray(message.nbytes, dtype=np.int64)
    if not (regions.size == offsets.size == nbytes.size) or regions.size == 0:
        raise WireDecodeError(
            "write_ops needs regions, offsets and sizes of one non-zero length", field="$.nbytes"
        )
    payload = np.asarray(payload)
    if payload.dtype != np.uint8 or payload.ndim != 1 or not payload.flags.c_contiguous:
        raise WireDecodeError("write payload must be a contiguous 1-D uint8 array", field="payload")
    check_ops(
        regions,
        offsets,
        nbytes,
        [region.nbytes for region in backing.regions],
        side="remote",
        engine_id=engine_id,
    )
    if within is not None:
        within(regions, offsets, nbytes)
    # Every size is below 2**62 and there are fewer than 2**32 of them: the sum cannot overflow.
    if int(nbytes.sum()) != payload.size:
        raise BoundsError(
            f"write_ops names {int(nbytes.sum())} bytes but the payload has {payload.size}",
            engine_id=engine_id,
        )
    if backing.kind is MemoryKind.CUDA:
        targets = [region.tensor for region in backing.regions]
        await receive_payload(targets, regions, offsets, nbytes, payload, slots or PinnedSlots())
        if landed is not None:  # the device's copies took the table and the payload whole
            named = _sources(message, regions.size)
            content = None
            if named is not None:
                staged = packed_offsets(nbytes)
                content = staged_content(payload, staged, named[0], named[1], regions, offsets, nbytes)
            landed(Stored(ranges_digest(regions, offsets, nbytes), content))
        return int(payload.size)
    payload_offset = packed_offsets(nbytes)
    sources = _sources(message, regions.size)
    stored = NOTHING if sources is not None else Stored(0)
    for index in np.unique(regions).tolist():
        select = regions == index
        if sources is None:
            stored = stored.plus(
                await _scatter(backing, index, payload, offsets, payload_offset, nbytes, select)
            )
            continue
        src_regions, src_offsets = sources
        for source in np.unique(src_regions[select]).tolist():
            picked = select & (src_regions == source)
            stored = stored.plus(
                await _scatter(
                    backing, index, payload, offsets, payload_offset, nbytes, picked, source, src_offsets
                )
            )
    if landed is not None:
        landed(stored)
    return int(payload.size)


def _sources(message: WriteOps, count: int) -> tuple[Int64Array, Int64Array] | None:
    """Each op's source region and offset in the writer's region, when the header names them
    (then the scatter hashes what it stores); `WireDecodeError` for lists of the wrong length."""
    if not message.src_regions and not message.src_offsets:
        return None
    src_regions = np.asarray(message.src_regions, dtype=np.int64)
    src_offsets = np.asarray(message.src_offsets, dtype=np.int64)
    if src_regions.size != count or src_offsets.size != count:
        raise WireDecodeError("write_ops names sources for some ops but not all", field="$.src_offsets")
    return src_regions, src_offsets


async def _scatter(
    backing: Backing,
    index: int,
    payload: npt.NDArray[np.uint8],
    offsets: Int64Array,
    payload_offset: Int64Array,
    nbytes: Int64Array,
    select: npt.NDArray[np.bool_],
    source: int | None = None,
    src_offsets: Int64Array | None = None,
) -> Stored:
    """The selected ops scattered into region `index`: what they stored, hashed (as the writer's
    region `source` would, at the ops' source offsets) where a source is named."""
    # The payload's bytes are hashed as the bytes at their offsets in the writer's region.
    hashing = None
    if source is not None and src_offsets is not None:
        hashing = Hashing.between(source, index, src_offsets[select])
    return await scatter_copy_async(
        backing.regions[index].tensor.data_ptr(),
        int(payload.ctypes.data),
        offsets[select],
        payload_offset[select],
        nbytes[select],
        salt=region_salt(index),
        hashing=hashing,
    )
