"""Push (plan, write, notify: steps five to seven on the prefill side): a request's blocks go
into the blocks a decode engine reserved for it, whole (`push`) or a layer at a time as the
forward pass produces them (`push_layer`, then `finish`).

Every push runs under a deadline and a bounded slot (`max_concurrent_transfers` running,
`max_queued_transfers` waiting, more are refused with `BackpressureError`). A push takes its
slot once its peer is known: a lookup that waits (an engine not registered yet) holds no slot,
so it cannot hold up pushes to other engines. A push that fails
once its peer is known tells the peer in the background (`TransferFailed`, naming the
incarnation it planned against) after its last byte has stopped moving, so the decode side
frees the request's blocks at once instead of at its deadline; a failed layer-wise push
refuses its later layers until it is finished or aborted.

Into a decode engine on this node over `shm`, a routine whole push is one C call (`_push_rows`,
`kvray._copy_pool.start_rows`): the copy plans from the pair's rows and the request's block ids
(checked first by the planner's C check), claims the request's slot, copies, hashes and sends the
notice from the thread that copies the last byte. A pair or request that call does not take
(regions of several, head slices, a request sampled for checksums, a checked one whose held
digests do not cover it, a slot the engine is closing) goes the usual way: plan, claim, write,
notify, step by step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvray.agent.directory import Directory
from kvray.agent.engine import Blocks, Engine, landed_in
from kvray.agent.lane import MAX_ASK_BLOCKS, PARK_S, PrefillLane
from kvray.agent.lane import available as lane_available
from kvray.agent.transports import TransportSet
from kvray.content import (
    HeldDigests,
    Stretches,
    StretchRows,
    held_parts,
    held_rows,
    pair_salts,
    region_seed,
    stretch_rows,
)
from kvray.content import pair_salt as content_pair_salt
from kvray.errors import (
    BackpressureError,
    KvrayError,
    MetadataError,
    NotExpectedError,
    PlanError,
    StaleIncarnationError,
    TransferTimeoutError,
    TransportError,
    WriteFailedError,
)
from kvray.integrity import THREAD_MIN_BYTES, Checksums, regions_of, sampled, writer_checksums
from kvray.layout import Int64Array
from kvray.memory import MemoryKind, SourceReady
from kvray.metrics import NO_TRANSPORT, FailureNotice, Outcome, PushCall
from kvray.notice import NoticeSet, QuickNotice
from kvray.notice.base import Receipt
from kvray.notice.claims import ClaimClient
from kvray.notice.local import PUSH_ENDPOINT, DatagramNotice
from kvray.placement import MASK64, NOTHING, PLACEHOLDER, Stored, region_salt
from kvray.plan import OffsetCache, Pairing, PartRows, TransferPlan, block_ids, paired_ids, plan_transfer
from kvray.tensor_parallel import shared_heads
from kvray.transport import Peer, Transport
from kvray.transport.base import PeerCache
from kvray.transport.cpu_copy import copy_threads, notice_patch, rows_native
from kvray.transport.shm import ShmTransport
from kvray.wire import Reservation, Role, TransferDone, TransferFailed, TransportKind, encode

log = logging.getLogger("kvray.push")

#: Stretch rows kept per pusher (one entry per decode engine incarnation and layer list).
_KEPT_STRETCH_ROWS = 256
#: The lane's copies: pieces a pool thread takes, and the largest copy its own thread makes.
_LANE_PIECE = 1 << 20
_LANE_INLINE_MAX = 4 << 20
_LANE_PARK_S = PARK_S
#: A hold of at most this many bytes is hashed on the agent's loop (tens of microseconds), not
#: handed to a thread (a hop that costs the loop about as much).
_INLINE_HOLD_NBYTES = 256 << 10


@dataclass(frozen=True)
class PushResult:
    """What one push (or one finished layer-wise push) moved."""

    request_id: str
    transfer_id: str
    dst_engine: str
    dst_incarnation: int
    transport: TransportKind
    nbytes: int
    ops: int
    unmerged_ops: int
    #: Planning, writing and notifying (layer-wise: summed over the layers, plus the finish).
    seconds: float


@dataclass
class _Layerwise:
    reservation: Reservation
    #: The reservation's block ids as an array, converted once for every layer.
    remote_ids: npt.NDArray[np.int64]
    transfer_id: str
    transport: TransportKind
    #: Seconds spent planning and writing, summed over the layers pushed so far.
    busy_s: float = 0.0
    nbytes: int = 0
    ops: int = 0
    unmerged_ops: int = 0
    #: Proofs of arrival the layers' writes give the decode side (`Transport.arrival_proofs`).
    arrival_proofs: int = 0
    layers: set[str] = field(default_factory=set)
    #: The layers' checksums so far (`kvray.integrity`), when the request is checked.
    checksums: Checksums | None = None
    #: The layers pushed so far (indices into the decode engine's layout), what their writes'
    #: executors reported (`kvray.placement.Stored`) and, when the request's content is
    #: checked, the writer's own digest of them (`kvray.content.Stretches`).
    layer_indices: tuple[int, ...] = ()
    stored: Stored = NOTHING
    reference: int | None = None
    #: The landed digest of the layers so far (`kvray.content.landed_digest`), where their copy
    #: does not hash and the request is checked.
    landed: int | None = None
    #: When the first layer's push call began (`time.perf_counter`).
    started: float = 0.0
    #: Layer writes in progress, and an event set whenever there are none.
    writing: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: The notice `finish` sends for the layers pushed so far, and its bytes: made as each
    #: layer's push ends, so that `finish` only sends.
    notice: TransferDone | None = None
    message: bytes = b""
    #: How `finish` sends it at once (`NoticeSet.quick`), kept for the peer it was made for.
    quick: QuickNotice | None = None

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass
class _Attempt:
    """How far one push got: the peer it planned against (whose incarnation a failure notice
    names) and its transfer id, once known."""

    reservation: Reservation
    layerwise: bool = False
    peer: Peer | None = None
    transfer_id: str | None = None
    transport: TransportKind | None = None
    #: When the call began (`time.perf_counter`); finish: when the request's first layer's did.
    started: float = 0.0
    #: Holding one of the slots (until then, counted among the transfers waiting for one).
    slotted: bool = False


@dataclass
class _RowPush:
    """A decode engine incarnation this engine pushes into with one C call (`Pusher._push_rows`):
    both sides keep their cache in one region, on one node, the `shm` transport between them.
    The copy plans itself from the pair's rows and the request's paired block ids, and claims
    the request's slot through a claim board client of its own."""

    peer: Peer
    transport: ShmTransport
    pairing: Pairing
    #: Five int64 columns of one row per (layer, part): this engine's start and block stride,
    #: the decode engine's start and block stride, the row's bytes (`cpu_copy.copy_rows`).
    rows: Int64Array
    #: The bytes of one block pair, every layer.
    block_nbytes: int
    board: ClaimClient
    layer_indices: tuple[int, ...]
    stretch_rows: StretchRows
    #: What to let go of before the board closes (the pair's place in this engine's lane).
    lane_release: Callable[[], None] | None = None
    #: Whether this engine's lane was open when the pair was last offered to it.
    lane_offered: bool = False


def _ids(reservation: Reservation) -> npt.NDArray[np.int64]:
    """A reservation's block ids as the array the planner takes (it checks them)."""
    return np.fromiter(reservation.blocks, dtype=np.int64, count=len(reservation.blocks))


def _close_row_push(entry: tuple[Peer, _RowPush | None]) -> None:
    if entry[1] is not None:
        if entry[1].lane_release is not None:
            entry[1].lane_release()  # no lane copy uses the board or the mapping after this
        entry[1].board.close()


@dataclass
class _CudaLanePair:
    """A decode engine incarnation this engine's GPU lane pushes into (`Pusher._lane_cuda_pair`):
    the copies captured for it and the claim board client its lane copies claim slots through;
    `copies` None where the pair takes no lane."""

    lane: PrefillLane | None = None
    incarnation: int = 0
    copies: Any = None  # kvray.transport.cuda_ipc.lane.LaneCopies (imported with torch)
    board: ClaimClient | None = None
    added: bool = False

    def close(self) -> None:
        """Let go of the pair once no lane copy into it runs (the lane waits for them)."""
        if self.lane is not None and self.added:
            self.lane.remove_pair(self.incarnation)
            self.added = False
        if self.board is not None:
            self.board.close()
            self.board = None
        self.copies = None


def _pair_rows(local: PartRows, remote: PartRows) -> Int64Array:
    """Both sides' rows as the C copy and the lane take them (5 x R: this engine's start and
    block stride, the decode engine's start and block stride, the row's bytes)."""
    return np.ascontiguousarray(
        np.stack([local.base, local.block_stride, remote.base, remote.block_stride, local.nbytes]),
        dtype=np.int64,
    )


async def _settled(task: asyncio.Task[Any]) -> None:
    """`task` cancelled unless it is done and waited for, its outcome retrieved (a hash still
    running on a worker thread only reads this engine's backing, which outlives it)."""
    if not task.done():
        task.cancel()
        await asyncio.wait([task])
    if not task.cancelled():
        task.exception()


class Pusher:
    """One engine's pushes into decode engines."""

    def __init__(
        self,
        engine: Engine,
        directory: Directory,
        notices: NoticeSet,
        transports: TransportSet,
        cache: OffsetCache,
    ) -> None:
        self.engine = engine
        self.directory = directory
        self.notices = notices
        self.transports = transports
        self.cache = cache
        self._slots = asyncio.Semaphore(engine.settings.max_concurrent_transfers)
        self._waiting = 0
        self._layerwise: dict[str, _Layerwise] = {}
        #: Layer-wise requests that failed (why), until `finish` or `abort`: later layers are refused.
        self._failed_layerwise: dict[str, str] = {}
        self._transfer_count = 0
        #: Content digests of this engine's blocks taken as their KV was held (`hold_digests`).
        self._held: HeldDigests | None = None
        #: The holds still hashing their blocks: a push of those blocks waits for them rather
        #: than hash the same bytes a second time.
        self._holding: dict[asyncio.Event, npt.NDArray[np.int64]] = {}
        #: The host backing's regions as arrays, for the hashes of holds (made once).
        self._host_regions: list[npt.NDArray[np.uint8]] | None = None
        #: Per (decode engine, incarnation, layers): the stretches' rows (`kvray.content`).
        self._stretch_rows: dict[tuple[str, int, tuple[str, ...]], StretchRows] = {}
        #: Per (decode engine, incarnation, layers): those layers' indices in its layout (what
        #: notices name).
        self._layer_indices: dict[tuple[str, int, tuple[str, ...]], tuple[int, ...]] = {}
        #: Per decode engine incarnation: the `Peer` the directory held and its `_RowPush`, or
        #: None where pushes into it take the usual path.
        self._row_pushes: PeerCache[None, tuple[Peer, _RowPush | None]] = PeerCache(
            engine.settings.max_cached_peers, _close_row_push
        )
        #: Per decode engine incarnation, what this engine's lane of GPU caches pushes into it with.
        self._cuda_lanes: PeerCache[None, _CudaLanePair] = PeerCache(
            engine.settings.max_cached_peers, _CudaLanePair.close
        )
        #: This engine's native hand-off lane (`open_lane`), and how it keys a decode engine.
        self.lane: PrefillLane | None = None
        self._lane_key: Callable[[str, int], bytes] | None = None

    @property
    def layerwise_requests(self) -> set[str]:
        """Requests with a layer-wise push begun (or failed) and not yet finished or aborted."""
        return set(self._layerwise) | set(self._failed_layerwise)

    async def push(
        self,
        reservation: Reservation,
        local_blocks: Blocks,
        layers: Sequence[str] | None = None,
        *,
        timeout: float | None = None,
    ) -> PushResult:
        request_id = reservation.request_id
        async with self._transfer(reservation, timeout, call=PushCall.WHOLE) as attempt:
            started = time.perf_counter()
            remote_ids = _ids(reservation)
            if layers is None:
                rows_result = await self._push_rows(attempt, local_blocks, remote_ids, started)
                if rows_result is not None:
                    return rows_result
            peer, transport, plan = await self._plan(attempt, local_blocks, remote_ids, layers)
            transfer_id = attempt.transfer_id = self._next_transfer_id(request_id)
            fused = plan.hashed
            reference = landed = None
            hashing: asyncio.Task[int] | None = None
            if fused:
                stretches = self._stretches(plan, local_blocks, remote_ids, peer)
                reference = self._held_reference(stretches)
                if reference is None:
                    taking = self._hashed_reference(stretches, transport)
                    if self._overlaps(plan):
                        # Hashed (or taken from a hold still hashing) on a thread while the
                        # copy's threads move the bytes: the notice goes once both are done.
                        hashing = asyncio.ensure_future(taking)
                    else:
                        reference = await taking
            elif self._checked(reservation):
                landed = await self._landed(plan, local_blocks, remote_ids, peer)
            checksums = await self._checksums(
                reservation,
                plan,
                peer,
                every=not fused and landed is None and self._unhashed_checked(reservation),
            )
            # The executor fills its digests in: the C copy pool's thread writes them into the
            # early notice it sends (`kvray.placement.PLACEHOLDER`).
            notice = self._done(
                reservation,
                transfer_id,
                plan.nbytes,
                transport.arrival_proofs,
                checksums,
                peer,
                self._indices(peer, plan.layers),
                Stored(PLACEHOLDER, PLACEHOLDER if fused else None),
                reference if hashing is None else 0,
                landed,
            )
            try:
                async with self._claim(peer, reservation, transport):
                    early = None if hashing is not None else self.notices.early(peer, notice)
                    stored = await self._write(reservation, peer, transport, plan, then=early)
                # Every byte is in place: the claim is let go before the notice goes, so the
                # decode engine that takes it finds the slot free when it closes it. A notice
                # writes no byte into the blocks; one for a slot closed meanwhile is dropped there.
                if early is None or not early.sent:
                    content = stored.content if fused else None
                    sent = msgspec.structs.replace(notice, placement=stored.placement, content=content)
                    if hashing is not None:
                        sent = msgspec.structs.replace(sent, reference=await hashing)
                    await self.notices.send(peer, sent)
            finally:
                self.notices.claims.end(reservation)
                if hashing is not None:
                    await _settled(hashing)
            self._count_bytes(transport.kind, peer, plan.nbytes)
            if layers is None and self.lane is not None and self.lane.cuda:
                self._lane_cuda_pair(peer, transport, plan)
            return PushResult(
                request_id,
                transfer_id,
                peer.info.engine_id,
                peer.info.incarnation,
                transport.kind,
                plan.nbytes,
                len(plan.ops),
                plan.unmerged_count,
                time.perf_counter() - started,
            )

    async def push_layer(
        self,
        reservation: Reservation,
        layer: str,
        local_blocks: Blocks,
        ready: SourceReady,
        *,
        timeout: float | None = None,
    ) -> int:
        request_id = reservation.request_id
        async with self._transfer(reservation, timeout, call=PushCall.LAYER) as attempt:
            started = time.perf_counter()
            state = self._layerwise.get(request_id)
            self._check_same_reservation(state, reservation)
            self._check_not_failed(reservation)
            remote_ids = state.remote_ids if state is not None else _ids(reservation)
            peer, transport, plan = await self._plan(attempt, local_blocks, remote_ids, [layer])
            state = self._layerwise.get(request_id)
            if state is None:
                state = _Layerwise(
                    reservation,
                    remote_ids,
                    self._next_transfer_id(request_id),
                    transport.kind,
                    started=attempt.started,
                )
                self._layerwise[request_id] = state
            self._check_same_reservation(state, reservation)
            attempt.transfer_id = state.transfer_id
            if layer in state.layers:
                raise PlanError(f"layer {layer!r} of {request_id!r} was already pushed", layer=layer)
            self._check_not_failed(reservation)  # again: it may have failed while this planned
            fused = plan.hashed and (state.reference is not None or not state.layers)
            reference = landed = None
            if fused:
                reference = await self._reference(plan, local_blocks, remote_ids, peer, transport, ready)
            elif self._checked(reservation) and (state.landed is not None or not state.layers):
                landed = await self._landed(plan, local_blocks, remote_ids, peer, ready)
            checksums = await self._checksums(
                reservation,
                plan,
                peer,
                every=not fused and landed is None and self._unhashed_checked(reservation),
            )
            # From here to the write's start nothing awaits but the claim: a failure recorded
            # meanwhile is seen by the failure notice, which waits for this write to end.
            state.writing += 1
            state.idle.clear()
            try:
                async with self._claim(peer, reservation, transport):
                    stored = await self._write(reservation, peer, transport, plan, ready=ready)
            finally:
                state.writing -= 1
                if state.writing == 0:
                    state.idle.set()
            state.layers.add(layer)
            state.layer_indices += self._indices(peer, plan.layers)
            state.stored = state.stored.plus(stored if fused else Stored(stored.placement))
            state.reference = None if reference is None else ((state.reference or 0) + reference) & MASK64
            state.landed = None if landed is None else ((state.landed or 0) + landed) & MASK64
            if checksums is not None:
                known = state.checksums or Checksums((), ())
                state.checksums = Checksums(
                    known.layers + checksums.layers, known.values + checksums.values, checksums.algorithm
                )
            state.arrival_proofs += transport.arrival_proofs
            state.nbytes += plan.nbytes
            state.ops += len(plan.ops)
            state.unmerged_ops += plan.unmerged_count
            state.busy_s += time.perf_counter() - started
            state.notice = self._layerwise_done(state, peer)
            state.message = encode(state.notice)
            if state.quick is None or state.quick.peer is not peer:
                state.quick = self.notices.quick(peer, reservation)
            self._count_bytes(transport.kind, peer, plan.nbytes)
            return plan.nbytes

    def _check_not_failed(self, reservation: Reservation) -> None:
        failed = self._failed_layerwise.get(reservation.request_id)
        if failed is not None:
            # A PlanError: the peer is fine, the request is not (finish or abort it).
            raise PlanError(
                f"request {reservation.request_id!r} already failed ({failed}); its layers are no "
                "longer written",
                request_id=reservation.request_id,
                engine_id=reservation.engine_id,
            )

    @staticmethod
    def _check_same_reservation(state: _Layerwise | None, reservation: Reservation) -> None:
        if state is not None and state.reservation != reservation:
            raise PlanError(
                f"request {reservation.request_id!r} is being pushed layer-wise into "
                f"{state.reservation.engine_id!r} incarnation {state.reservation.incarnation} under "
                "another reservation; finish or abort it first",
                request_id=reservation.request_id,
                engine_id=reservation.engine_id,
            )

    async def finish(self, request_id: str, *, timeout: float | None = None) -> PushResult:
        state = self._layerwise.pop(request_id, None)
        failed = self._failed_layerwise.pop(request_id, None)
        if failed is not None:
            raise WriteFailedError(
                f"layer-wise push of {request_id!r} failed: {failed}", request_id=request_id
            )
        if state is None:
            raise PlanError(f"request {request_id!r} has no layer-wise push to finish", request_id=request_id)
        reservation = state.reservation
        started = time.perf_counter()
        if timeout is not None:  # a bad timeout is refused the same way on every path
            settings = self.engine.settings
            settings.deadline(timeout, settings.transfer_timeout_s, "timeout")
        peer = self._current_peer(state)
        if peer is not None:
            quick = state.quick
            if quick is not None and quick.peer is peer and quick.send_now(state.message):
                # Out through what the last layer's push looked up: nothing else to wait for.
                self.notices.claims.end(reservation)
                self._record_finish(state, Outcome.OK)
                return self._finished(state, started)
            notice, message = state.notice, state.message
            if notice is None:  # no layer pushed
                notice = self._done(reservation, state.transfer_id, state.nbytes, state.arrival_proofs)
                message = encode(notice)
            receipt = self.notices.send_now(peer, reservation, notice, message)
            if receipt is not None:
                if receipt.done() and receipt.exception() is None:
                    # Taken already (an inbox needs no answer): nothing left to wait for.
                    self.notices.claims.end(reservation)
                    self._record_finish(state, Outcome.OK)
                else:
                    await self._receipt(state, peer, receipt)
                return self._finished(state, started)
        async with self._transfer(reservation, timeout, call=PushCall.FINISH) as attempt:
            attempt.transfer_id = state.transfer_id
            attempt.transport = state.transport
            attempt.started = state.started
            started = time.perf_counter()
            peer = await self.directory.peer(reservation.engine_id)
            if peer.info.incarnation != reservation.incarnation:
                raise StaleIncarnationError(
                    f"engine {reservation.engine_id!r} restarted (incarnation {peer.info.incarnation}) "
                    f"while request {request_id!r} was pushed layer-wise into incarnation "
                    f"{reservation.incarnation}",
                    request_id=request_id,
                    engine_id=reservation.engine_id,
                    incarnation=peer.info.incarnation,
                    stale_incarnation=reservation.incarnation,
                )
            attempt.peer = peer
            await self._take_slot(attempt)
            notice = self._layerwise_done(state, peer)
            # Under the claim: a request its decode engine stopped expecting is not reported done.
            try:
                async with self._claim(peer, reservation):
                    await self.notices.send(peer, notice)
            finally:
                self.notices.claims.end(reservation)
            return self._finished(state, started)

    def _current_peer(self, state: _Layerwise) -> Peer | None:
        """The decode engine `finish` may notify at once, without a slot or a lookup: cached and
        at the reservation's incarnation (None: the usual path, which looks it up, must run).
        `finish`'s notice goes out at once when nothing on its way would wait: into the engine's
        inbox on this node (the request's slot open, the inbox not full), or over the
        connection this writer keeps open to its notice listener on another node. The rest of
        the bookkeeping follows the notice, off the decode side's path."""
        engine = self.engine
        reservation = state.reservation
        if not engine.running:
            return None
        peer = self.directory.cached(reservation.engine_id)
        if peer is None or peer.info.incarnation != reservation.incarnation:
            return None
        return peer

    def _record_finish(self, state: _Layerwise, outcome: Outcome, error: BaseException | None = None) -> None:
        self.engine.metrics.transfer(
            PushCall.FINISH,
            outcome,
            state.transport.value,
            state.reservation.engine_id,
            time.perf_counter() - state.started,
            error,
        )

    async def _receipt(self, state: _Layerwise, peer: Peer, receipt: Receipt) -> None:
        """Wait (`notify_timeout_s`) for the receipt of `finish`'s notice sent at once: a refusal
        raises as the engine's own error, a receipt that does not come as a transport error or
        timeout; either way the engine is told the push failed (a failure notice after a
        completion it took is dropped there), as the usual path does."""
        engine = self.engine
        reservation = state.reservation
        engine_id = reservation.engine_id
        timeout_s = engine.settings.notify_timeout_s
        outcome = Outcome.FAILED
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await receipt
            except TimeoutError as error:
                outcome = Outcome.TIMED_OUT
                raise TransferTimeoutError(
                    f"engine {engine_id!r} did not answer the notice for {reservation.request_id!r} "
                    f"within {timeout_s} s",
                    request_id=reservation.request_id,
                    engine_id=engine_id,
                    timeout_s=timeout_s,
                ) from error
            outcome = Outcome.OK
        except KvrayError as error:
            self._tell_failed(peer, state, f"{type(error).__name__}: {error}")
            raise
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED
            self._tell_failed(peer, state, "the push was cancelled")
            raise
        finally:
            self.notices.claims.end(reservation)
            self._record_finish(state, outcome, sys.exc_info()[1])  # the error leaving, if any

    def _tell_failed(self, peer: Peer, state: _Layerwise, reason: str) -> None:
        if not self.engine.closed.is_set():
            self.engine.spawn(self._notify_failure(peer, state.reservation, state.transfer_id, reason, None))

    def _finished(self, state: _Layerwise, started: float) -> PushResult:
        """A layer-wise push whose notice is out (`started`: when its `finish` began)."""
        reservation = state.reservation
        if len(state.layers) < len(self.engine.backing.layout.layers):  # each a layer of the layout
            self.engine.metrics.layerwise_partial()
        return PushResult(
            reservation.request_id,
            state.transfer_id,
            reservation.engine_id,
            reservation.incarnation,
            state.transport,
            state.nbytes,
            state.ops,
            state.unmerged_ops,
            state.busy_s + time.perf_counter() - started,
        )

    async def forget_layers(self, request_id: str) -> None:
        """Drop a layer-wise push without telling the decode engine, once no layer write of it
        is in progress: its layers will be written again (a whole push into the same
        reservation), which alone completes the request."""
        state = self._layerwise.pop(request_id, None)
        self._failed_layerwise.pop(request_id, None)
        if state is None:
            return
        await state.idle.wait()
        self.notices.claims.end(state.reservation)

    async def abort(self, reservation: Reservation, reason: str) -> None:
        request_id = reservation.request_id
        state = self._layerwise.pop(request_id, None)
        self._failed_layerwise.pop(request_id, None)
        self.notices.claims.end(reservation)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.engine.settings.notify_timeout_s):
                peer = await self.directory.peer(reservation.engine_id, wait_s=0.0)
            if peer.info.incarnation != reservation.incarnation:
                self.engine.metrics.failure_notice(FailureNotice.STALE)
                return
            transfer_id = state.transfer_id if state else self._next_transfer_id(request_id)
            await self._notify_failure(peer, reservation, transfer_id, reason, state)

    # ---- one transfer -----------------------------------------------------------------

    def _done(
        self,
        reservation: Reservation,
        transfer_id: str,
        nbytes: int,
        proofs: int,
        checksums: Checksums | None = None,
        peer: Peer | None = None,
        layers: tuple[int, ...] = (),
        stored: Stored = NOTHING,
        reference: int | None = None,
        landed: int | None = None,
    ) -> TransferDone:
        """The completion notice; `layers`, `landed` and `placement`: see `TransferDone`."""
        info = self.engine.info
        tp = info.layout.tp
        # Which part of each block this writer wrote, where it is not the whole.
        partial = peer is not None and shared_heads(tp, peer.info.layout.tp) is not None
        if partial or (checksums is not None and peer is not None):
            return TransferDone(
                **self._header(reservation, transfer_id),
                nbytes=nbytes,
                arrival_proofs=proofs,
                checksum=checksums.algorithm if checksums is not None else "",
                checksum_layers=checksums.layers if checksums is not None else (),
                checksum_values=checksums.values if checksums is not None else (),
                src_tp=tp if partial else None,
                layers=layers,
                landed=landed,
                reference=reference,
                content=stored.content if reference is not None else None,
                placement=stored.placement,
            )
        # `_header`'s fields, spelled out: this is on the path of every completion.
        return TransferDone(
            transfer_id=transfer_id,
            request_id=reservation.request_id,
            src_engine=info.engine_id,
            src_incarnation=info.incarnation,
            dst_engine=reservation.engine_id,
            dst_incarnation=reservation.incarnation,
            token=reservation.token,
            nbytes=nbytes,
            arrival_proofs=proofs,
            layers=layers,
            landed=landed,
            reference=reference,
            content=stored.content if reference is not None else None,
            placement=stored.placement,
        )

    def _layerwise_done(self, state: _Layerwise, peer: Peer) -> TransferDone:
        """The notice of a layer-wise push's layers so far."""
        return self._done(
            state.reservation,
            state.transfer_id,
            state.nbytes,
            state.arrival_proofs,
            state.checksums,
            peer,
            state.layer_indices,
            state.stored,
            state.reference,
            state.landed,
        )

    def _indices(self, peer: Peer, layers: Sequence[str]) -> tuple[int, ...]:
        """`layers`' indices in the decode engine's layout."""
        info = peer.info
        key = (info.engine_id, info.incarnation, tuple(layers))
        indices = self._layer_indices.get(key)
        if indices is None:
            if len(self._layer_indices) >= 1024:
                self._layer_indices.clear()
            index = {name: at for at, name in enumerate(info.layout.layer_names)}
            indices = self._layer_indices[key] = tuple(index[name] for name in layers)
        return indices

    def _checked(self, reservation: Reservation) -> bool:
        """Whether the request's content is checked: this engine's setting, or its decode
        engine asks (`Reservation.integrity`)."""
        return self.engine.settings.integrity or reservation.integrity

    def _unhashed_checked(self, reservation: Reservation) -> bool:
        """Whether a request whose copy does not hash is checked by hashing every layer
        (`Settings.integrity_unhashed`)."""
        return self._checked(reservation) and self.engine.settings.integrity_unhashed

    def _fused(self, reservation: Reservation, transport: Transport, peer: Peer) -> bool:
        """Whether the request is checked through its copy's content digest (`kvray.content`)."""
        return self._checked(reservation) and transport.hashes(self.engine.backing, peer)

    async def hold_digests(self, local_blocks: Blocks) -> None:
        backing = self.engine.backing
        if backing.kind is MemoryKind.CUDA:
            from kvray.transport.cuda_staging import triton_available

            if not triton_available():
                return  # no kernel hashes them: the push's own check reads them
        blocks = block_ids(local_blocks, backing.layout.num_blocks, "local", self.engine.engine_id)
        if self._held is None:
            self._held = HeldDigests(backing.layout, backing.placements)
        held = self._held
        taken = asyncio.Event()
        self._holding[taken] = blocks
        try:
            if backing.kind is MemoryKind.CUDA:
                # Hashed by a kernel on the GPU that holds them, after the work queued there.
                from kvray.transport.cuda_ipc.held import held_sums

                epochs = held.epochs(blocks)
                sums = await held_sums([region.tensor for region in backing.regions], held.rows, blocks)
                if sums is not None:
                    held.keep(blocks, epochs, sums)
            else:
                regions = self._host_regions
                if regions is None:
                    regions = self._host_regions = [region.tensor.numpy() for region in backing.regions]
                if blocks.size * held.block_nbytes <= _INLINE_HOLD_NBYTES:
                    held.take(regions, blocks)  # sooner done here than handed to a thread
                else:
                    await asyncio.to_thread(held.take, regions, blocks)
        finally:
            del self._holding[taken]
            taken.set()

    def _stretches(
        self, plan: TransferPlan, local_blocks: Blocks, remote_ids: npt.NDArray[np.int64], peer: Peer
    ) -> Stretches:
        """The stretches of `plan`'s transfer from this engine's own blocks and both layouts
        (`kvray.content.Stretches`), their rows kept per peer incarnation and layer list."""
        local = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
        return Stretches(self._stretch_rows_of(peer, plan.layers), local, remote_ids)

    def _stretch_rows_of(self, peer: Peer, layers: tuple[str, ...]) -> StretchRows:
        """The stretches' rows of `layers` into `peer`, kept per peer incarnation and layer list."""
        backing = self.engine.backing
        info = peer.info
        key = (info.engine_id, info.incarnation, layers)
        rows = self._stretch_rows.get(key)
        if rows is None:
            if len(self._stretch_rows) >= _KEPT_STRETCH_ROWS:
                self._stretch_rows.clear()
            rows = stretch_rows(backing.layout, backing.placements, info.layout, info.placement, layers)
            self._stretch_rows[key] = rows
        return rows

    def forget_digests(self, local_blocks: Blocks) -> None:
        if self._held is not None:
            blocks = block_ids(
                local_blocks, self.engine.backing.layout.num_blocks, "local", self.engine.engine_id
            )
            self._held.forget(blocks)

    def _overlaps(self, plan: TransferPlan) -> bool:
        """Whether a reference not held is hashed while the bytes move (host memory, large
        enough to hash on a thread) rather than first: a GPU hashes on the stream that copies,
        and a small request is hashed at once, so that its notice can leave from the copy's
        own thread (`Transport.write_then`)."""
        return self.engine.backing.kind is not MemoryKind.CUDA and plan.nbytes >= THREAD_MIN_BYTES

    def _held_reference(self, stretches: Stretches) -> int | None:
        """The content digest of `stretches` from the digests held for their blocks, at once
        (`hold_digests`; None: not all are held)."""
        return None if self._held is None else self._held.digest(stretches)

    async def _reference(
        self,
        plan: TransferPlan,
        local_blocks: Blocks,
        remote_ids: npt.NDArray[np.int64],
        peer: Peer,
        transport: Transport,
        ready: SourceReady = None,
    ) -> int:
        """The content digest of `plan`'s transfer from this engine's own blocks and both
        layouts: from the digests held for them when there are, else `_hashed_reference`."""
        stretches = self._stretches(plan, local_blocks, remote_ids, peer)
        value = self._held_reference(stretches)
        if value is not None:
            return value
        return await self._hashed_reference(stretches, transport, ready)

    async def _hashed_reference(
        self, stretches: Stretches, transport: Transport, ready: SourceReady = None
    ) -> int:
        """The content digest of `stretches` whose digests are not held: from a hold still
        hashing their blocks once it is done, else by hashing them where they are
        (`Transport.reference`, after `ready`)."""
        held = self._held
        if held is not None and self._holding and ready is None:
            # A hold may be hashing these very blocks (a push asked for as its request
            # finished): its sums come sooner than a second hash of the same bytes would.
            holds = [
                taken for taken, blocks in self._holding.items() if np.isin(stretches.local, blocks).any()
            ]
            if holds:
                await asyncio.wait([asyncio.ensure_future(taken.wait()) for taken in holds])
                value = held.digest(stretches)
                if value is not None:
                    return value
        return await transport.reference(stretches, self.engine.backing, ready=ready)

    async def _landed(
        self,
        plan: TransferPlan,
        local_blocks: Blocks,
        remote_ids: npt.NDArray[np.int64],
        peer: Peer,
        ready: SourceReady = None,
    ) -> int | None:
        """For a checked transfer whose copy does not hash: the landed digest the decode engine
        must find (`kvray.content.Stretches.landed`), hashed here from this engine's memory: on
        a worker thread when large, on the GPU by the `cuda_ipc` op kernel storing nothing;
        None where that kernel cannot run (no Triton: the sampled checksums, or
        `integrity_unhashed`'s, check such a transfer)."""
        found = self._stretches(plan, local_blocks, remote_ids, peer).expanded
        return await landed_in(
            self.engine.backing,
            found.src_region,
            found.src_start,
            found.dst_region,
            found.dst_start,
            found.nbytes,
            ready,
        )

    async def _checksums(
        self, reservation: Reservation, plan: TransferPlan, peer: Peer, *, every: bool = False
    ) -> Checksums | None:
        """The checksums of the bytes `plan` reads (`kvray.integrity`), when the request is
        sampled (or `every`: its content is checked and its copy does not hash): hashed on a
        worker thread when large (the hash releases the GIL)."""
        if not every and not sampled(reservation.request_id, self.engine.settings.integrity_sample_rate):
            return None
        regions, layout = regions_of(self.engine.backing), peer.info.layout
        if plan.nbytes < THREAD_MIN_BYTES:
            return writer_checksums(plan, regions, layout)
        return await asyncio.to_thread(writer_checksums, plan, regions, layout)

    def _claim(
        self, peer: Peer, reservation: Reservation, transport: Transport | None = None
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """The claim a write (with its `transport`) or a notice holds on the request."""
        remote = transport is not None and transport.claims_across_nodes
        return self.notices.claims.hold(self.engine.info, peer, reservation, remote=remote)

    def _header(self, reservation: Reservation, transfer_id: str) -> dict[str, Any]:
        """The fields every notice about a transfer into `reservation` carries
        (`kvray.wire.TransferNotice`)."""
        info = self.engine.info
        return {
            "transfer_id": transfer_id,
            "request_id": reservation.request_id,
            "src_engine": info.engine_id,
            "src_incarnation": info.incarnation,
            "dst_engine": reservation.engine_id,
            "dst_incarnation": reservation.incarnation,
            "token": reservation.token,
        }

    def _count_bytes(self, kind: TransportKind, peer: Peer, nbytes: int) -> None:
        self.engine.metrics.bytes_pushed(kind.value, peer.info.engine_id, nbytes)

    def _abort_soon(self, attempt: _Attempt, reason: str) -> None:
        """`abort` for a push that failed, in the background, so the caller's error is not held
        up by a peer that does not answer (the notice has its own deadline)."""
        request_id = attempt.reservation.request_id
        state = self._layerwise.get(request_id)
        if attempt.layerwise or state is not None:
            self._failed_layerwise.setdefault(request_id, reason)
        peer = attempt.peer
        if peer is None or self.engine.closed.is_set():
            return
        transfer_id = attempt.transfer_id or (
            state.transfer_id if state is not None else self._next_transfer_id(request_id)
        )
        self.engine.spawn(self._notify_failure(peer, attempt.reservation, transfer_id, reason, state))

    async def _notify_failure(
        self, peer: Peer, reservation: Reservation, transfer_id: str, reason: str, state: _Layerwise | None
    ) -> None:
        """Send `TransferFailed` once no layer of the request is still being written: the peer
        frees the blocks when it reads it, so no byte may arrive after."""
        try:
            async with asyncio.timeout(self.engine.settings.notify_timeout_s):
                if state is not None:
                    await state.idle.wait()
            await self.notices.send(
                peer, TransferFailed(**self._header(reservation, transfer_id), reason=reason)
            )
            self.engine.metrics.failure_notice(FailureNotice.SENT)
        except Exception:  # best effort: a peer that is gone has nobody waiting
            self.engine.metrics.failure_notice(FailureNotice.LOST)

    @contextlib.asynccontextmanager
    async def _transfer(
        self, reservation: Reservation, timeout: float | None, *, call: PushCall
    ) -> AsyncIterator[_Attempt]:
        """A deadline for one transfer, and its place in the queue for a slot (the body takes
        the slot with `_take_slot` once its peer is known); failures are kvray errors, and once
        the peer is known it is told (in the background) so it does not wait for its deadline.
        Every call that gets this far is counted once in the metrics, by outcome."""
        engine = self.engine
        engine.check_running()
        if not isinstance(reservation, Reservation):
            raise PlanError(
                f"push into a decode engine's Reservation (what its expect() returned), not "
                f"{type(reservation).__name__}"
            )
        request_id = reservation.request_id
        remote_engine = reservation.engine_id
        settings = engine.settings
        if self._waiting >= settings.max_queued_transfers:
            engine.metrics.transfer(call, Outcome.REJECTED, NO_TRANSPORT, remote_engine)
            raise BackpressureError(
                f"agent {engine.engine_id!r} already has {self._waiting} transfers waiting "
                f"(max_queued_transfers={settings.max_queued_transfers})",
                request_id=request_id,
            )
        deadline = settings.deadline(timeout, settings.transfer_timeout_s, "timeout")
        attempt = _Attempt(reservation, call is PushCall.LAYER, started=time.perf_counter())
        outcome = Outcome.FAILED
        try:
            async with asyncio.timeout(deadline):
                self._waiting += 1
                try:
                    yield attempt
                except TransportError as error:
                    await self._raise_if_restarted(attempt, error)
                    raise
                finally:
                    if attempt.slotted:
                        self._slots.release()
                    else:
                        self._waiting -= 1
            outcome = Outcome.OK
        except KvrayError as error:
            if isinstance(error, TransferTimeoutError):
                outcome = Outcome.TIMED_OUT
            if isinstance(error, TransportError | MetadataError) and not isinstance(error, NotExpectedError):
                self.directory.forget(remote_engine)
            self._abort_soon(attempt, f"{type(error).__name__}: {error}")
            raise
        except TimeoutError as error:
            outcome = Outcome.TIMED_OUT
            self._abort_soon(attempt, f"transfer passed its {deadline} s deadline")
            raise TransferTimeoutError(
                f"transfer of {request_id!r} to {remote_engine!r} passed its {deadline} s deadline",
                request_id=request_id,
                engine_id=remote_engine,
                timeout_s=deadline,
            ) from error
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED
            self._abort_soon(attempt, "the push was cancelled")
            raise
        except Exception as error:
            self.directory.forget(remote_engine)
            self._abort_soon(attempt, f"{type(error).__name__}: {error}")
            raise WriteFailedError(
                f"transfer of {request_id!r} to {remote_engine!r} failed: {type(error).__name__}: {error}",
                request_id=request_id,
                engine_id=remote_engine,
            ) from error
        finally:
            transport = attempt.transport.value if attempt.transport is not None else NO_TRANSPORT
            seconds = time.perf_counter() - attempt.started
            # The error leaving this block, if any: the one raised above.
            engine.metrics.transfer(call, outcome, transport, remote_engine, seconds, sys.exc_info()[1])

    async def _take_slot(self, attempt: _Attempt) -> None:
        """One of the `max_concurrent_transfers` slots, for the rest of the transfer."""
        await self._slots.acquire()
        attempt.slotted = True
        self._waiting -= 1

    async def _raise_if_restarted(self, attempt: _Attempt, error: TransportError) -> None:
        """After a transport failure, ask the directory whether the peer has a new incarnation
        by now: then the push was aimed at a life that is over, and that is the error to report."""
        peer = attempt.peer
        if peer is None or self.directory.service is None or isinstance(error, BackpressureError):
            return
        try:
            await self.directory.check(peer.info.engine_id, peer.info.incarnation)
        except StaleIncarnationError as stale:
            current = getattr(stale, "cause", stale).facts.get("incarnation")
            raise StaleIncarnationError(
                f"engine {peer.info.engine_id!r} restarted: this push was aimed at incarnation "
                f"{peer.info.incarnation}, the engine is now incarnation {current} ({error})",
                engine_id=peer.info.engine_id,
                incarnation=current,
                stale_incarnation=peer.info.incarnation,
            ) from error
        except Exception:  # gone, or the coordinator is away: the transport's error stands
            return

    async def _plan(
        self,
        attempt: _Attempt,
        local_blocks: Blocks,
        remote_ids: npt.NDArray[np.int64],
        layers: Sequence[str] | None,
    ) -> tuple[Peer, Transport, TransferPlan]:
        reservation = attempt.reservation
        remote_engine = reservation.engine_id
        peer = await self.directory.current(remote_engine, reservation.incarnation)
        if peer.info.incarnation != reservation.incarnation:
            raise StaleIncarnationError(
                f"engine {remote_engine!r} is incarnation {peer.info.incarnation}, but the blocks "
                f"were reserved in incarnation {reservation.incarnation}",
                engine_id=remote_engine,
                incarnation=peer.info.incarnation,
                stale_incarnation=reservation.incarnation,
            )
        if peer.info.role is not Role.DECODE or not all(r.remote_writable for r in peer.info.regions):
            raise MetadataError(
                f"engine {remote_engine!r} ({peer.info.role.value}) exposes no writable region; "
                "push into decode engines only",
                engine_id=remote_engine,
            )
        attempt.peer = peer
        if not attempt.slotted:  # `_push_rows` may have taken it before it gave way
            await self._take_slot(attempt)
        # What the notice needs (a connection to a listener on another node) opens while the
        # bytes move.
        self.notices.prepare(peer)
        plan = plan_transfer(self.engine.info, peer.info, local_blocks, remote_ids, layers, self.cache)
        # The request id and token travel with the write: a receiver that checks writes itself
        # (`Receiver.admit`) takes them only for requests it still expects, from the holder of
        # their reservation.
        transport = self.transports.choose(peer.info, self.engine.node_id)
        hashed = self._fused(reservation, transport, peer)
        plan = replace(plan, request_id=reservation.request_id, token=reservation.token, hashed=hashed)
        attempt.transport = transport.kind
        return peer, transport, plan

    async def _write(
        self,
        reservation: Reservation,
        peer: Peer,
        transport: Transport,
        plan: TransferPlan,
        then: Callable[[Stored], None] | None = None,
        *,
        ready: SourceReady = None,
    ) -> Stored:
        """Write `plan` (its source bytes written once `ready` is: `kvray.memory.SourceReady`);
        what its executor reports (`Transport.write`)."""
        if then is None:
            return await transport.write(plan, self.engine.backing, peer, ready=ready)
        return await transport.write_then(plan, self.engine.backing, peer, then, ready=ready)

    async def _push_rows(
        self, attempt: _Attempt, local_blocks: Blocks, remote_ids: npt.NDArray[np.int64], started: float
    ) -> PushResult | None:
        """A whole push in one C call where the pair allows (`_RowPush`): the copy checks the
        paired ids' rows against both regions, claims the request's slot, copies (hashing what it
        moves when the request is checked) and sends the notice from the thread that copies the
        last byte. None, having written nothing, wherever the usual path has more to do: a pair
        or a request this path does not take (a request sampled for checksums, a checked one
        whose blocks' digests are not held, ids the one-call check refuses: the usual path says
        what is wrong), or a slot the engine is closing (the usual path waits for it)."""
        reservation = attempt.reservation
        peer = self.directory.cached(reservation.engine_id)
        if peer is None or peer.info.incarnation != reservation.incarnation:
            return None
        pair = self._row_push(peer)
        if pair is None:
            return None
        request_id = reservation.request_id
        checked = self._checked(reservation)
        if sampled(request_id, self.engine.settings.integrity_sample_rate):
            return None
        ids = paired_ids(pair.pairing, local_blocks, remote_ids)
        if ids is None:
            return None
        reference = None
        if checked:
            reference = self._held_reference(Stretches(pair.stretch_rows, ids[0], ids[1]))
            if reference is None:
                return None
        attempt.peer = peer
        attempt.transport = TransportKind.SHM
        await self._take_slot(attempt)
        transfer_id = attempt.transfer_id = self._next_transfer_id(request_id)
        nbytes = pair.block_nbytes * int(ids.shape[1])
        placeholders = Stored(PLACEHOLDER, PLACEHOLDER if checked else None)
        notice = self._done(
            reservation, transfer_id, nbytes, 0, None, peer, pair.layer_indices, placeholders, reference
        )
        early = self.notices.early(peer, notice)
        datagram = None
        if isinstance(early, DatagramNotice):
            socket_fd, path, message = early.datagram()
            datagram = (socket_fd, path, message, notice_patch(message, hashed=checked))
        written = await pair.transport.write_rows(
            peer,
            self.engine.backing,
            pair.rows,
            ids,
            nbytes,
            pair.board.copy_slot(reservation.slot, reservation.token),
            datagram,
            hashed=checked,
            request_id=request_id,
        )
        if written is None:
            return None
        stored, sent = written
        if not sent:
            # The inbox was full (or had gone): the usual send, under the claim, says which.
            content = stored.content if checked else None
            late = msgspec.structs.replace(notice, placement=stored.placement, content=content)
            try:
                async with self._claim(peer, reservation):
                    await self.notices.send(peer, late)
            finally:
                self.notices.claims.end(reservation)
        self._count_bytes(TransportKind.SHM, peer, nbytes)
        ops = int(ids.shape[1]) * int(pair.rows.shape[1])  # one per (row, block pair), before merging
        return PushResult(
            request_id,
            transfer_id,
            peer.info.engine_id,
            peer.info.incarnation,
            TransportKind.SHM,
            nbytes,
            ops,
            ops,
            time.perf_counter() - started,
        )

    def _row_push(self, peer: Peer) -> _RowPush | None:
        """`peer`'s `_RowPush`, made on first use (None where pushes into it take the usual path);
        dropped once the directory holds another `Peer` for the engine."""
        info = peer.info
        known = self._row_pushes.get(info.engine_id, info.incarnation, None)
        if known is not None and known[0] is peer:
            if known[1] is not None and not known[1].lane_offered and self.lane is not None:
                self._lane_pair(known[1])  # made before the lane opened
            return known[1]
        if known is not None:
            self._row_pushes.pop(info.engine_id, info.incarnation, None)
        pair = self._new_row_push(peer)
        self._row_pushes.put(info.engine_id, info.incarnation, None, (peer, pair))
        return pair

    def _new_row_push(self, peer: Peer) -> _RowPush | None:
        engine = self.engine
        backing, info, local = engine.backing, peer.info, engine.info
        if (
            not rows_native()
            or backing.kind is MemoryKind.CUDA
            or len(backing.regions) != 1
            or len(info.regions) != 1
            or info.role is not Role.DECODE
            or not info.regions[0].remote_writable
        ):
            return None
        transport = self.transports.choose(info, engine.node_id)
        path = self.notices.claims.board_path(peer)
        # A transport whose writes something wraps (`KVAgent`'s `transport_hook`) is written
        # through them: the usual path.
        wrapped = "write" in vars(transport) or "write_then" in vars(transport)
        if not isinstance(transport, ShmTransport) or path is None or wrapped:
            return None
        try:
            if shared_heads(local.layout.tp, info.layout.tp) is not None:
                return None  # each writer moves its heads of a block: the usual path
            pairing = self.cache.pairing(local, info, None)
        except KvrayError:
            return None  # the usual path refuses the pair, saying why (and tells the peer)
        mine, theirs = pairing.local, pairing.remote
        if mine.region.any() or theirs.region.any() or not np.array_equal(mine.nbytes, theirs.nbytes):
            return None
        rows = _pair_rows(mine, theirs)
        board = ClaimClient(path, info.engine_id, engine.settings.shm_dir)
        layers = pairing.layers
        stretches = stretch_rows(backing.layout, backing.placements, info.layout, info.placement, layers)
        indices = self._indices(peer, layers)
        pair = _RowPush(peer, transport, pairing, rows, int(mine.nbytes.sum()), board, indices, stretches)
        self._lane_pair(pair)
        return pair

    # ---- the native lane (`kvray.agent.lane`) -------------------------------------------------

    def open_lane(self, key_of: Callable[[str, int], bytes]) -> PrefillLane | None:
        """Open this engine's native hand-off lane beside its push-request inbox (None where
        it cannot have one: no C lane, a GPU or several regions, tensor parallelism, or no
        inbox); decode engines pushed into from then on are paired with it on their first
        push, keyed by `key_of(engine, incarnation)`."""
        if self.lane is not None:
            return self.lane
        engine = self.engine
        backing = engine.backing
        inbox = engine.info.endpoints.get(PUSH_ENDPOINT, "")
        if (
            not lane_available()
            or not inbox
            or len(backing.regions) != 1
            or engine.info.layout.tp.size != 1
            or (backing.kind is not MemoryKind.CUDA and not rows_native())
        ):
            return None
        cuda = None
        if backing.kind is MemoryKind.CUDA:
            cuda = self._lane_driver()
            if cuda is None:
                return None
        region = backing.regions[0]
        source = (region.tensor.data_ptr(), region.nbytes, backing.layout.num_blocks)
        settings = engine.settings
        threads = min(settings.copy_threads or copy_threads(), 8)
        self.lane = PrefillLane(
            os.path.dirname(inbox),
            engine.incarnation,
            source,
            threads,
            _LANE_PIECE,
            _LANE_INLINE_MAX,
            _LANE_PARK_S,
            cuda,
        )
        self._lane_key = key_of
        if cuda is None and settings.integrity:
            # The lane takes its holds' sums itself, on its own thread (`lane_hold`).
            rows = held_rows(backing.layout, backing.placements)
            parts = held_parts(backing.layout, backing.placements)
            self.lane.hash_rows(
                np.stack([rows.layer * parts + rows.part, rows.start, rows.stride, rows.nbytes]),
                len(backing.layout.layers) * parts,
                region_seed(0),
            )
        return self.lane

    @property
    def lane_hashes(self) -> bool:
        """Whether the lane takes its holds' content sums itself (a hold needs no
        `hold_digests` before `lane_hold`)."""
        return self.lane is not None and self.lane.hashes

    def _lane_driver(self) -> tuple[tuple[int, ...], int] | None:
        """The CUDA driver's calls and this engine's GPU context, for a lane of GPU caches;
        None where the cuda_ipc transport cannot run here."""
        try:
            from kvray.transport.cuda_ipc import CudaIpcTransport
            from kvray.transport.cuda_ipc.driver import lane_calls, primary_context

            if CudaIpcTransport.unavailable_reason(self.engine.settings) is not None:
                return None
            # This thread may have run no CUDA work: no context is current on it.
            context = primary_context(self.engine.backing.regions[0].tensor.device)
            calls = lane_calls()
        except (OSError, KvrayError) as error:
            log.warning("kvray: no native lane for this GPU cache (%s: %s)", type(error).__name__, error)
            return None
        return (calls, context) if context and all(calls) else None

    def lane_hold(self, handoff: str, blocks: npt.NDArray[np.int64]) -> bool:
        """Let a lane ask take hand-off `handoff`'s `blocks`, with the content sums held for them
        (`hold_digests`, taken before this); False where it cannot (then only push requests do).
        On a GPU its copy waits for the work queued so far on the device's current stream (what
        a push the usual way waits for)."""
        lane = self.lane
        if lane is None:
            return False
        if lane.hashes:
            return lane.hold(handoff, blocks, None, None, hashed=True)
        sums = held = None
        if self.engine.settings.integrity:
            if self._held is None:
                return False
            sums, held = self._held.rows_of(blocks)
        stream = 0
        if lane.cuda:
            import torch

            stream = int(torch.cuda.current_stream(self.engine.backing.regions[0].tensor.device).cuda_stream)
        return lane.hold(handoff, blocks, sums, held, stream)

    def _lane_cuda_pair(self, peer: Peer, transport: Transport, plan: TransferPlan) -> None:
        """After a whole push the usual way over cuda_ipc: pair the decode engine with this
        engine's GPU lane (its first push), or capture the lane's copies for larger requests
        (a push larger than they take). The push has succeeded: what goes wrong here leaves the
        pair to the usual path, said in the log."""
        lane, key_of, rows = self.lane, self._lane_key, plan.rows
        info = peer.info
        if lane is None or key_of is None or rows is None or transport.kind is not TransportKind.CUDA_IPC:
            return
        count = int(rows.local_ids.size)
        pair = self._cuda_lanes.get(info.engine_id, info.incarnation, None)
        try:
            if pair is None:
                pair = self._new_cuda_lane(lane, peer, transport, plan)
                self._cuda_lanes.put(info.engine_id, info.incarnation, None, pair)
            copies = pair.copies
            if copies is None or pair.board is None or count > MAX_ASK_BLOCKS or not copies.grow(count):
                return
            if pair.added:  # its copies grew: paired again (the lane waits for its copies first)
                lane.remove_pair(info.incarnation)
                pair.added = False
            board = pair.board.copy_slot(0, 0)
            pair.added = lane.add_cuda_pair(
                info.engine_id,
                info.incarnation,
                key_of(info.engine_id, info.incarnation),
                (
                    copies.target.numel(),
                    info.layout.num_blocks,
                    copies.context,
                    int(copies.stream.cuda_stream),
                ),
                _pair_rows(rows.local, rows.remote),
                self._lane_stretch(self._stretch_rows_of(peer, plan.layers)),
                (board.fd, board.slots, board.address),
                copies.records(),
                checked=self.engine.settings.integrity,
                release=lambda: None,  # what the pair holds goes with `_CudaLanePair.close`
            )
        except Exception as error:  # the push is done: the pair stays on the usual path
            log.warning("kvray: no lane into %s (%s: %s)", info.engine_id, type(error).__name__, error)
            if pair is not None:
                pair.close()
            self._cuda_lanes.put(info.engine_id, info.incarnation, None, _CudaLanePair())

    def _new_cuda_lane(
        self, lane: PrefillLane, peer: Peer, transport: Transport, plan: TransferPlan
    ) -> _CudaLanePair:
        """What a GPU lane pushes into `peer` with, none captured yet; no copies where the pair
        takes no lane: some of the decode engine's layers only, several regions, rows the row
        kernel cannot write directly, no claim board on this node, tensor parallelism."""
        info = peer.info
        rows = plan.rows
        path = self.notices.claims.board_path(peer)
        if (
            rows is None
            or path is None
            or len(info.regions) != 1
            or info.layout.tp.size != 1
            or self._indices(peer, plan.layers) != tuple(range(len(info.layout.layers)))
            or rows.local.region.any()
            or rows.remote.region.any()
            or not np.array_equal(rows.local.nbytes, rows.remote.nbytes)
            or not self._stretch_rows_of(peer, plan.layers).whole_parts
        ):
            return _CudaLanePair()
        from kvray.transport.cuda_ipc import CudaIpcTransport

        assert isinstance(transport, CudaIpcTransport)
        copies = transport.lane_copies(rows, self.engine.backing, peer)
        if copies is None:
            return _CudaLanePair()
        board = ClaimClient(path, info.engine_id, self.engine.settings.shm_dir)
        return _CudaLanePair(lane, info.incarnation, copies, board)

    def _lane_stretch(self, stretch: StretchRows) -> Int64Array:
        """A pair's stretches as a lane takes them (6 x S: held row, salt, source start and
        stride, destination start and stride), for the content digest its holds' sums give."""
        backing = self.engine.backing
        parts = held_parts(backing.layout, backing.placements)
        salts = (
            stretch.salts if stretch.salts is not None else pair_salts(stretch.src_region, stretch.dst_region)
        )
        return np.ascontiguousarray(
            np.stack(
                [
                    stretch.layer * parts + stretch.part,
                    np.asarray(salts).view(np.int64),
                    stretch.src_start,
                    stretch.src_stride,
                    stretch.dst_start,
                    stretch.dst_stride,
                ]
            ),
            dtype=np.int64,
        )

    def _lane_pair(self, pair: _RowPush) -> None:
        """Pair `pair`'s decode engine with this engine's lane: its region stays mapped and its
        board open until the pair is removed (`_close_row_push`), after its last lane copy."""
        lane, key_of = self.lane, self._lane_key
        info = pair.peer.info
        pair.lane_offered = lane is not None
        if lane is None or key_of is None or pair.layer_indices != tuple(range(len(info.layout.layers))):
            return  # a decode engine this engine moves only some layers into: the usual path
        if not pair.stretch_rows.whole_parts or info.layout.tp.size != 1:
            return
        columns = self._lane_stretch(pair.stretch_rows)
        mapping = pair.transport.pinned(pair.peer, 0)
        board = pair.board.copy_slot(0, 0)
        try:
            added = lane.add_pair(
                info.engine_id,
                info.incarnation,
                key_of(info.engine_id, info.incarnation),
                (mapping.address, mapping.length, info.layout.num_blocks, mapping.fd, mapping.file_end),
                pair.rows,
                columns,
                (board.fd, board.slots, board.address),
                (region_salt(0), region_seed(0), content_pair_salt(0, 0)),
                checked=self.engine.settings.integrity,
                release=mapping.release,
            )
        except BaseException:
            mapping.release()
            raise
        if not added:
            mapping.release()
            return
        pair.lane_release = lambda: lane.remove_pair(info.incarnation)

    def close(self) -> None:
        """Let go of what pushes keep per decode engine (claim boards of their own), after the
        lane's last copy."""
        if self.lane is not None:
            self.lane.close()
        self._row_pushes.clear()
        self._cuda_lanes.clear()

    def _next_transfer_id(self, request_id: str) -> str:
        self._transfer_count += 1
        return f"{request_id}@{self.engine.engine_id}:{self.engine.incarnation:x}:{self._transfer_count}"
