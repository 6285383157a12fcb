"""The prefill side of the hand-off (between the scheduler's finished requests and the push): a
finished request is held under its hand-off id until a decode engine's push request takes it
(or its lease ends); a push request that comes first is parked; a request whose forward runs
while its decode engine waits is pushed layer by layer. See `kvray.agent.handoff` for the
protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvray.agent.handoff.events import HandoffEvent, Moved
from kvray.agent.handoff.side import Side, Wiring, reason_of
from kvray.agent.handoff.specs import (
    NO_BLOCK,
    BlockTable,
    HandoffStep,
    LayerwiseSpec,
    SendSpec,
    one_group,
    rank_engine_id,
    table_blocks,
)
from kvray.agent.lane import Answer, LanePush, PrefillLane, hold_key
from kvray.agent.push import PushResult
from kvray.errors import BackpressureError, KvrayError, NotExpectedError
from kvray.layout import Int64Array
from kvray.memory import SourceReady
from kvray.metrics import DropReason, Outcome, PushCall
from kvray.wire import (
    EngineInfo,
    PushRequest,
    PushWithdrawn,
    Reservation,
    TransportKind,
    decode_engine_info,
    decode_push_message,
)

log = logging.getLogger("kvray.handoff")

#: How long a push waits before asking again while the agent's transfer queue is full.
BACKPRESSURE_RETRY_S = 0.01

#: Why a push request for a dropped hand-off is refused.
_ENDED_WITHOUT_KV = "the prefill request ended without its KV"
_OTHER_ENGINE = "its ticket names another decode engine"


@dataclass
class _Held:
    """A finished request held for a decode engine, until every rank of the decode engine has
    answered (each pushed into, or withdrew) or its lease ends. A decode engine of one rank
    answers once."""

    spec: SendSpec
    lease_ends: float
    #: The request's blocks (`table_blocks` of its table), as the agent takes them.
    blocks: Int64Array
    #: Decode ranks whose push is under way.
    pushing: set[int] = field(default_factory=set)
    #: Decode ranks that have answered: pushed into (or refused), or withdrew.
    answered: set[int] = field(default_factory=set)
    #: The decode engine's number of ranks, from its first message (0: none came yet).
    ranks: int = 0
    #: An ask through this engine's native lane may take it (`kvray.agent.lane`).
    in_lane: bool = False

    def admits(self, message: PushRequest | PushWithdrawn) -> bool:
        """Whether a decode rank's message is one this request still waits for: a rank that
        has not answered, of as many ranks as the others said."""
        if self.ranks not in (0, message.decode_ranks) or message.decode_rank >= message.decode_ranks:
            return False
        return message.decode_rank not in self.answered and message.decode_rank not in self.pushing

    @property
    def settled(self) -> bool:
        """Every decode rank has answered and no push is under way: the blocks may go."""
        return self.ranks > 0 and not self.pushing and len(self.answered) >= self.ranks


@dataclass
class _Layered:
    """A request pushed layer by layer during its forward."""

    spec: LayerwiseSpec
    #: Layers the forward has saved so far, in order, each with what says its KV is written
    #: (`kvray.memory.SourceReady`; None: the bytes are ready when the layer is saved).
    saved: list[tuple[str, SourceReady]] = field(default_factory=list)
    #: The decode engine's push request, once it has come, and the blocks it takes.
    request: PushRequest | None = None
    #: Those blocks per group (`_taken_blocks`).
    groups: BlockTable = ()
    pushes: list[asyncio.Task[int]] = field(default_factory=list)
    #: When the forward saved the last layer (`time.perf_counter`).
    last_saved: float = 0.0

    @property
    def blocks(self) -> tuple[int, ...]:
        """The blocks the decode engine's push request takes, in its reservation's order."""
        return table_blocks(self.groups)


class PrefillSide(Side):
    """The prefill side of one engine's hand-offs: holds, push requests and pushes. `lease_s`:
    how long a held request waits for its push request, a parked push request for its request,
    and a spent hand-off id is refused."""

    def __init__(self, wiring: Wiring, *, lease_s: float) -> None:
        super().__init__(wiring)
        self.lease_s = lease_s
        #: Requests held for a decode engine, by hand-off id.
        self._held: dict[str, _Held] = {}
        #: The blocks of the requests held (`_held_changed`).
        self._blocks_held = 0
        #: Decode ranks' messages (push requests, and withdrawals from engines of several ranks)
        #: that came before their request was held, with when they came.
        self._parked: dict[str, list[tuple[PushRequest | PushWithdrawn, float]]] = {}
        #: Requests pushed layer by layer (by hand-off id), and those whose forward runs in
        #: this step.
        self._layered: dict[str, _Layered] = {}
        self._this_step: list[_Layered] = []
        #: Hand-off ids that will never have KV here, until when a push request for one is
        #: refused at once.
        self._spent: dict[str, float] = {}
        #: The decode engines' infos push requests carried, as sent and as decoded (a decode
        #: engine sends the same bytes with every request of one incarnation).
        self._decoded: OrderedDict[bytes, EngineInfo] = OrderedDict()
        #: The native lane's holds (by their lane key), once the lane is open (`_lane`).
        self._lane_keys: dict[bytes, str] = {}
        self._lane_open: PrefillLane | None = None
        self._lane_tried = False
        # Push requests and withdrawals reach this engine through its agent: its host, and the
        # push-request mailbox the agent opens on each notice channel when it starts.
        self.agent.serve_push_requests(self.take)

    def parked(self) -> int:
        """How many push requests wait for their request here."""
        return len(self._parked)

    def step(self, step: HandoffStep) -> None:
        """This side's part of a step: sends to hold, hand-offs that will never have KV
        (`dropped`) and held requests whose decode leg failed (`released`)."""
        for spec in step.sends.values():
            self.hold(spec)
        for key in step.dropped:
            self.drop(key)
        for key in step.released:
            self.release(key)

    def hold(self, spec: SendSpec) -> None:
        """Hold a finished request for its decode engine, unless its hand-off id is taken:
        a second request under one id ends at once and never replaces the first."""
        key = spec.handoff
        layered = self._layered.get(key)
        if layered is not None and layered.spec.request_id == spec.request_id:
            del self._layered[key]
            if layered.request is not None:
                self._unpark(key)  # pushed layer by layer: never the lane's
                self._spawn(self._finish_layered(layered, spec))
                return
            if key in self._spent:  # the decode engine withdrew while the forward ran
                self.wiring.reports.sent(spec.request_id)
                return
        elif layered is not None or key in self._held or key in self._spent:
            log.warning("kvray: hand-off %s is taken; request %s is not held", key, spec.request_id)
            self.wiring.reports.sent(spec.request_id)
            self._unpark(key)
            return
        if spec.failed:
            self.wiring.reports.sent(spec.request_id)
            self.drop(key)
            return
        blocks = table_blocks(spec.block_ids)
        held = self._held[key] = _Held(
            spec, time.monotonic() + self.lease_s, np.fromiter(blocks, dtype=np.int64, count=len(blocks))
        )
        self._held_changed(held, began=True)
        # The content digests of its blocks (`KVAgent.hold_digests`), taken while no decode
        # engine has asked yet: its push then reads no block to check what it moves. They are
        # dropped when the hold ends (`_held_changed`).
        self._spawn(self._hold_digests(key, held))
        for message, _ in self._parked.pop(key, ()):
            if isinstance(message, PushRequest):
                self._spawn(self._push(message))
            elif held.admits(message):
                held.ranks = message.decode_ranks
                held.answered.add(message.decode_rank)
        self._settle(key, held)

    async def _hold_digests(self, key: str, held: _Held) -> None:
        if self._lane() is not None and self.agent.lane_hashes:
            # The lane takes the blocks' sums itself, on its own thread; the digests below are
            # for a push the usual way, taken only if the lane does not take the hold.
            self._offer_lane(key, held)
            if held.in_lane:
                return
        with contextlib.suppress(KvrayError):  # a push without them reads the blocks itself
            await self.agent.hold_digests(held.blocks)
        self._offer_lane(key, held)

    # ---- the native lane (`kvray.agent.lane`) ------------------------------------------------

    def _offer_lane(self, key: str, held: _Held) -> None:
        """Let an ask through the lane take a hold nothing has asked for yet: a request of one
        decode engine of one rank, any engine of the deployment's (a ticket naming its decode
        engine and an engine of several ranks keep to push requests)."""
        lane = self._lane()  # opened at the first hold, whatever becomes of it
        if (
            lane is None
            or self._held.get(key) is not held
            or held.pushing
            or held.answered
            or held.spec.decode_engine
            or len(held.spec.block_ids) != 1
            or not self.agent.lane_hold(key, held.blocks)
        ):
            self._unpark(key)  # asks waiting in the lane for it go the usual way
            return
        held.in_lane = True
        self._lane_keys[hold_key(key)] = key

    def _lane(self) -> PrefillLane | None:
        """The agent's lane, opened on first use where the deployment has a key."""
        if not self._lane_tried:
            self._lane_tried = True
            proof = self.wiring.proof
            if proof is None or not self.settings.native_lane or self.agent.layout.tp.size != 1:
                return None
            agent = self.agent
            lane = agent.open_lane(
                lambda engine, incarnation: proof.lane_key(
                    agent.engine_id, agent.incarnation, engine, incarnation
                )
            )
            if lane is not None:
                loop = asyncio.get_running_loop()
                fileno = lane.fileno()
                loop.add_reader(fileno, self._lane_done)

                def stop_reading() -> None:
                    loop.remove_reader(fileno)

                lane.on_close.append(stop_reading)
                self._lane_open = lane
        return self._lane_open

    def _from_lane(self, key: str, held: _Held) -> bool:
        """Take a hold back from the lane before anything else ends or pushes it: False while
        an ask through the lane pushes it (its end comes through `_lane_done`)."""
        if not held.in_lane:
            return True
        lane = self._lane_open
        if lane is not None and not lane.unhold(key):
            return False
        held.in_lane = False
        self._lane_keys.pop(hold_key(key), None)
        return True

    def _lane_done(self) -> None:
        """Pushes the lane ended: each held request is answered (its blocks go)."""
        lane = self._lane_open
        if lane is None:
            return
        for push in lane.done():
            key = self._lane_keys.pop(push.key, "")
            held = self._held.get(key)
            if held is None:
                continue
            held.in_lane = False
            held.ranks = 1
            held.answered.add(0)
            ok = push.answer is Answer.DONE
            metrics = self.agent.metrics
            if ok:
                metrics.bytes_pushed(lane.transport.value, push.decode_engine, push.nbytes)
            metrics.transfer(
                PushCall.WHOLE,
                Outcome.OK if ok else Outcome.FAILED,
                lane.transport.value,
                push.decode_engine,
                push.seconds,
            )
            if not ok:
                log.warning("kvray: push of %s through the lane ended incomplete", key)
            if ok and self.wiring.observer is not None:
                self._spawn(self._lane_observed(key, held, push))
            else:
                self._settle(key, held)

    async def _lane_observed(self, key: str, held: _Held, push: LanePush) -> None:
        """The observer sees a push the lane made, its blocks still held; then they go."""
        pushed = held.blocks[push.first_block : push.first_block + push.num_blocks]
        blocks = tuple(int(block) for block in pushed)
        lane = self._lane_open
        transport = TransportKind.SHM if lane is None else lane.transport
        sent = Moved(HandoffEvent.SENT, key, key, (blocks,), push.seconds, transport, False)
        try:
            await self._moved(sent)
        finally:
            self._settle(key, held)

    def drop(self, key: str) -> None:
        """Hand-off `key` will never have KV here: its parked ask is refused now, later ones
        as they come."""
        self._spend(key)
        for message, _ in self._parked.pop(key, ()):
            if isinstance(message, PushRequest):
                self._spawn(self._refuse(message, _ENDED_WITHOUT_KV))

    def release(self, key: str) -> None:
        """The decode leg of held hand-off `key` failed: free its blocks now."""
        held = self._held.get(key)
        if held is not None and not held.pushing and self._from_lane(key, held):
            del self._held[key]
            self._held_changed(held, began=False)
            self._spend(key)
            self.wiring.reports.sent(held.spec.request_id)

    def expire(self) -> None:
        """Free held requests no decode engine asked for within their lease, refuse push
        requests parked as long, and forget spent ids a lease old."""
        now = time.monotonic()
        for key, held in list(self._held.items()):
            if not held.pushing and held.lease_ends <= now and self._from_lane(key, held):
                del self._held[key]
                self._held_changed(held, began=False)
                self._spend(key)
                self.wiring.reports.sent(held.spec.request_id)
                self.agent.metrics.lease_expired()
                log.warning("kvray: no decode engine asked for %s within its lease; freed", key)
        for key, until in list(self._spent.items()):
            if until <= now:
                del self._spent[key]
        # A decode engine may ask before the prefill engine has even seen the request.
        for key, messages in list(self._parked.items()):
            if messages[0][1] + self.lease_s <= now:
                del self._parked[key]
                for message, _ in messages:
                    if isinstance(message, PushRequest):
                        self._spawn(
                            self._refuse(message, "the prefill engine holds no such finished request")
                        )

    def _held_changed(self, held: _Held, *, began: bool) -> None:
        """A hold began or ended: record the blocks held as it happens, before the end is
        reported (vLLM reads the figure as the step that hears of the end ends, maybe its last)."""
        blocks = held.blocks
        self._blocks_held += blocks.size if began else -blocks.size
        self.agent.metrics.blocks_held(self._blocks_held)
        if not began:  # the blocks go back to the engine: digests held of them are stale now
            self.agent.forget_digests(blocks)

    def _spend(self, key: str) -> None:
        """A hand-off id whose request is gone: asks and holds under it are refused a lease long."""
        self._spent[key] = time.monotonic() + self.lease_s
        self._unpark(key)

    def _unpark(self, key: str) -> None:
        """Asks waiting in the lane for hand-off `key`'s hold, which the lane will not get (or
        has now), are answered now rather than at their wait's end."""
        if self._lane_open is not None:
            self._lane_open.settle(key)

    # ---- prefill side: push requests ------------------------------------------------------

    def take(self, message: bytes) -> None:
        """A decode engine's push request or withdrawal."""
        try:
            request = decode_push_message(message)
        except KvrayError as error:
            log.warning("kvray: dropped a malformed push request: %s", error)
            return
        if self.wiring.proof is not None and not hmac.compare_digest(
            request.proof, self.wiring.proof.ask_proof(self.agent.engine_id, request.request_id)
        ):
            # Nothing is told to the reservation it names: it may be another request's.
            log.warning("kvray: dropped a push request or withdrawal without a valid proof")
            self.agent.metrics.dropped(DropReason.FORGED)
            return
        if (request.src_engine, request.src_incarnation) != (self.agent.engine_id, self.agent.incarnation):
            if isinstance(request, PushRequest):
                self._spawn(self._refuse(request, "it names another incarnation of this prefill engine"))
            return
        if isinstance(request, PushWithdrawn):
            self._withdrawn(request)
            return
        key = request.request_id
        layered = self._layered.get(key)
        if layered is not None and layered.request is None and self._one_to_one(request):
            if not bound_to(layered.spec.decode_engine, request):
                self._spawn(self._refuse(request, _OTHER_ENGINE))
                return
            self._start_layered(layered, request)
        elif key in self._held:
            self._spawn(self._push(request))
        elif key in self._spent:
            self._spawn(self._refuse(request, _ENDED_WITHOUT_KV))
        elif not self._park(request):
            self._spawn(self._refuse(request, "too many push requests wait for their requests here"))

    def _one_to_one(self, request: PushRequest) -> bool:
        """Whether the request is this engine's alone to push, to a decode engine of one rank:
        only such a request is pushed layer by layer (with tensor parallelism on either side,
        each decode rank is pushed its KV whole, once the request finished)."""
        return request.decode_ranks == 1 and self.agent.layout.tp.size == 1

    def _park(self, message: PushRequest | PushWithdrawn) -> bool:
        """Keep a decode rank's message until its request is held here (it may not have reached
        this engine yet, or its hand-over is a step behind); False when it cannot be kept: too
        many requests wait, or this rank's message for it is here already."""
        key = message.request_id
        parked = self._parked.get(key, [])
        if (
            (not parked and len(self._parked) >= self.settings.max_expected_requests)
            or message.decode_rank >= message.decode_ranks
            or any(
                earlier.decode_rank == message.decode_rank or earlier.decode_ranks != message.decode_ranks
                for earlier, _ in parked
            )
        ):
            return False
        self._parked.setdefault(key, parked).append((message, time.monotonic()))
        if isinstance(message, PushRequest):
            self._note(HandoffEvent.ASKED, key, key)
        return True

    def _withdrawn(self, message: PushWithdrawn) -> None:
        """A decode rank will not take hand-off `key` (from this engine): once every rank of the
        decode engine has answered, free it if held and not being pushed, and refuse to hold it
        (or push it) later. A decode engine of one rank answers with this alone."""
        key = message.request_id
        held = self._held.get(key)
        if held is not None:
            if held.admits(message):
                held.ranks = message.decode_ranks
                held.answered.add(message.decode_rank)
                if held.settled:
                    self._note(HandoffEvent.WITHDRAWN, key, key)
                self._settle(key, held)
            return
        layered = self._layered.get(key)
        if layered is not None and layered.request is not None:
            return  # its layers are being pushed: the decode side refuses them, and it ends
        if message.decode_ranks > 1:
            self._park(message)
            parked = self._parked.get(key, [])
            withdrawn = {earlier.decode_rank for earlier, _ in parked if isinstance(earlier, PushWithdrawn)}
            if len(withdrawn) < message.decode_ranks:
                return  # other ranks may still ask
        self._parked.pop(key, None)
        self._spend(key)
        self._note(HandoffEvent.WITHDRAWN, key, key)

    def _settle(self, key: str, held: _Held) -> None:
        """Once every decode rank has answered a held request and no push of it is under way, its
        blocks go back to the engine and its hand-off id is spent."""
        if held.settled and self._held.get(key) is held and self._from_lane(key, held):
            del self._held[key]
            self._held_changed(held, began=False)
            self._spend(key)
            self.wiring.reports.sent(held.spec.request_id)

    async def _push(self, request: PushRequest) -> None:
        key = request.request_id
        held = self._held.get(key)
        if held is None or not held.admits(request) or not self._from_lane(key, held):
            await self._refuse(request, "the request is not held here, or is already being pushed")
            return
        if not bound_to(held.spec.decode_engine, request):
            await self._refuse(request, _OTHER_ENGINE)
            return
        rank = request.decode_rank
        held.ranks = request.decode_ranks
        held.pushing.add(rank)
        reservation = request.reservation
        try:
            self._learn_peer(request)  # first: a refusal below is told to the decode engine
            taken = _taken_blocks(request, held.spec.block_ids)
            # The usual push takes every block held: the array made when the hold began.
            whole = len(taken) == 1 and len(taken[0]) == held.blocks.size
            blocks = held.blocks if whole else np.asarray(table_blocks(taken), dtype=np.int64)
            result = await self._push_when_room(reservation, blocks, held.lease_ends)
            await self._moved(_sent(result, key, taken, layerwise=False))
        except Exception as error:  # the push told the decode side, or this does
            log.warning("kvray: push of %s failed: %s", key, error)
            self._note(HandoffEvent.PUSH_FAILED, key, key, reason_of(error))
            if not isinstance(error, KvrayError) or isinstance(error, NotExpectedError):
                await self.agent.abort(reservation, reason_of(error))
        finally:
            held.pushing.discard(rank)
            held.answered.add(rank)
            self._settle(key, held)

    async def _push_when_room(self, reservation: Reservation, blocks: Int64Array, until: float) -> PushResult:
        """Push, waiting while the agent's queue of transfers is full (a batch of decode
        requests asks for many at once), up to the request's lease."""
        while True:
            try:
                return await self.agent.push(reservation, blocks)
            except BackpressureError:
                if time.monotonic() >= until:
                    raise
                await asyncio.sleep(BACKPRESSURE_RETRY_S)

    async def _refuse(self, request: PushRequest, why: str) -> None:
        """Tell the decode side at once that its request's KV will not come."""
        with contextlib.suppress(Exception):
            with contextlib.suppress(KvrayError):  # a mismatched info: tell the reservation's engine
                self._learn_peer(request)
            await self.agent.abort(request.reservation, f"push of {request.request_id!r} refused: {why}")

    def _learn_peer(self, request: PushRequest) -> None:
        """Check the decode engine's info a push request carries against its reservation, and
        take it, unless this engine has joined Ray: then the coordinator is the one to ask (it
        knows the engine's host actor, which the `ray` transport and notices from another node
        need)."""
        if not request.decode_info:
            return
        decode = self._decoded.get(request.decode_info)
        if decode is None:
            decode = decode_engine_info(request.decode_info)
            self._decoded[request.decode_info] = decode
            while len(self._decoded) > self.settings.max_cached_peers:
                self._decoded.popitem(last=False)
        else:
            self._decoded.move_to_end(request.decode_info)
        reservation = request.reservation
        if (decode.engine_id, decode.incarnation) != (reservation.engine_id, reservation.incarnation):
            raise NotExpectedError(
                "a push request's decode info does not match its reservation", request_id=request.request_id
            )
        if not self.wiring.joined:
            self.agent.add_peer(decode)

    # ---- prefill side, layer by layer -----------------------------------------------------

    def layerwise(self, specs: Mapping[str, LayerwiseSpec]) -> None:
        """This step's forward computes these requests' whole prompts (before the first layer
        is saved)."""
        self._this_step = []
        for spec in specs.values():
            if spec.key in self._layered or spec.key in self._held or spec.key in self._spent:
                log.warning(
                    "kvray: hand-off %s is taken; request %s is not pushed", spec.key, spec.request_id
                )
                continue
            layered = self._layered[spec.key] = _Layered(spec)
            self._this_step.append(layered)
            parked = self._parked.get(spec.key, [])
            if (
                len(parked) == 1
                and isinstance(parked[0][0], PushRequest)
                and self._one_to_one(parked[0][0])
                and bound_to(spec.decode_engine, parked[0][0])
            ):
                del self._parked[spec.key]
                self._start_layered(layered, parked[0][0])

    def save_layer(self, layer_name: str, ready: SourceReady = None) -> None:
        """The forward has written `layer_name`'s KV of this step's layer-wise requests; on a
        GPU, once `ready` (a CUDA event on the forward's stream) has completed: the layer's
        copies wait for it on the device, and nothing here waits for it on the host."""
        now = time.perf_counter()
        for layered in self._this_step:
            layered.saved.append((layer_name, ready))
            layered.last_saved = now
            if layered.request is not None:
                self._push_layer(layered, layer_name, ready)

    async def preempt(self, keys: Collection[str], wait_s: float) -> None:
        """The engine preempted these layer-wise requests: return once no layer copy reads
        their blocks, or after `wait_s` (the engine's thread waits for this, and a step must not
        stall). A request whose copies ended is parked again, to be pushed whole once it runs
        again and finishes; one whose copies still run when `wait_s` passes may have read its
        blocks after the engine gave them to another request, so its push is aborted once they
        end (the decode side's load fails, and it never decodes from those bytes)."""
        preempted: list[tuple[str, _Layered]] = []
        for key in keys:
            layered = self._layered.pop(key, None)
            if layered is None:
                continue
            self._note(HandoffEvent.PREEMPTED, layered.spec.request_id, key)
            if layered in self._this_step:
                self._this_step.remove(layered)
            preempted.append((key, layered))
        copies = [push for _, layered in preempted for push in layered.pushes if not push.done()]
        if copies:
            await asyncio.wait(copies, timeout=wait_s)
        for key, layered in preempted:
            if layered.request is None:
                continue
            if all(push.done() for push in layered.pushes):
                await self.agent.forget_layers(layered.request.reservation.request_id)
                self._parked[key] = [(layered.request, time.monotonic())]
            else:
                self._spend(key)
                self._spawn(self._abort_preempted(layered))

    async def _abort_preempted(self, layered: _Layered) -> None:
        """A preempted request's layer copies outlasted the engine's wait: once they end, its
        push is aborted (its blocks may have been rewritten under the copies)."""
        assert layered.request is not None
        await asyncio.gather(*layered.pushes, return_exceptions=True)
        why = "the prefill engine preempted the request while its layers were being copied"
        log.warning("kvray: layer-wise push of %s aborted: %s", layered.spec.key, why)
        self._note(HandoffEvent.PUSH_FAILED, layered.spec.request_id, layered.spec.key, why)
        with contextlib.suppress(Exception):
            await self.agent.abort(layered.request.reservation, why)

    def _start_layered(self, layered: _Layered, request: PushRequest) -> None:
        """The decode engine asked while the forward runs: push the layers saved so far now,
        the others as they are saved, and finish when the finished request is handed over."""
        try:
            layered.groups = _taken_blocks(request, layered.spec.block_ids)
            self._learn_peer(request)
        except Exception as error:
            self._spawn(self._refuse(request, reason_of(error)))
            return
        layered.request = request
        for layer_name, ready in layered.saved:
            self._push_layer(layered, layer_name, ready)

    def _push_layer(self, layered: _Layered, layer_name: str, ready: SourceReady) -> None:
        assert layered.request is not None
        push = self._layer_when_room(layered.request.reservation, layer_name, layered.blocks, ready)
        layered.pushes.append(asyncio.get_running_loop().create_task(push))

    async def _layer_when_room(
        self, reservation: Reservation, layer_name: str, blocks: Sequence[int], ready: SourceReady
    ) -> int:
        """Push one layer, waiting while the agent's queue of transfers is full (a decode engine
        that asks once many forwards have saved every layer queues each of their layers at
        once), up to a lease from now."""
        until = time.monotonic() + self.lease_s
        while True:
            try:
                return await self.agent.push_layer(reservation, layer_name, np.asarray(blocks), ready=ready)
            except BackpressureError:
                if time.monotonic() >= until:
                    raise
                await asyncio.sleep(BACKPRESSURE_RETRY_S)

    async def _finish_layered(self, layered: _Layered, spec: SendSpec) -> None:
        """Wait for the request's layer pushes, push any layer the forward did not save, and
        finish (or abort, if anything failed or the request did not finish well); then the
        request's blocks may go."""
        agent = self.agent
        request = layered.request
        assert request is not None
        reservation = request.reservation
        try:
            outcomes = await asyncio.gather(*layered.pushes, return_exceptions=True)
            failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if spec.failed:
                raise NotExpectedError(
                    f"prefill request {spec.request_id!r} did not finish", request_id=spec.request_id
                )
            if failures:
                raise failures[0]
            freed = set(layered.blocks) - set(table_blocks(spec.block_ids))
            if freed:
                # The engine let go of blocks (a window's past) while their layers were being
                # copied: another request's KV may have been read instead.
                raise NotExpectedError(
                    f"prefill request {spec.request_id!r} freed blocks {sorted(freed)[:4]} the decode "
                    "engine wants while their layers were pushed",
                    request_id=spec.request_id,
                )
            pushed = {layer_name for layer_name, _ in layered.saved}
            for layer_name in agent.layout.layer_names:
                if layer_name not in pushed:
                    await agent.push_layer(reservation, layer_name, np.asarray(layered.blocks))
            result = await agent.finish(reservation.request_id)
            # From the last layer's KV in the prefill's cache to the decode side told it may
            # decode: what the layer-wise push leaves after the forward.
            tail = time.perf_counter() - layered.last_saved
            await self._moved(_sent(result, request.request_id, layered.groups, layerwise=True, tail_s=tail))
        except Exception as error:
            log.warning("kvray: layer-wise push of %s failed: %s", request.request_id, error)
            self._note(HandoffEvent.PUSH_FAILED, request.request_id, request.request_id, reason_of(error))
            with contextlib.suppress(Exception):
                await agent.abort(reservation, reason_of(error))
        finally:
            self._spend(layered.spec.key)
            self.wiring.reports.sent(spec.request_id)


def _taken_blocks(request: PushRequest, held: BlockTable) -> BlockTable:
    """The blocks of a held request that a push request's reservation takes, per group, position
    by position from `first_block` where the decode engine has a block (`table_blocks` of it:
    in the reservation's order). Refused (`NotExpectedError`) where the two sides' groups differ, the
    table does not name the reservation's blocks, or the decode engine wants a position this
    side no longer keeps."""
    first = request.first_block
    if not request.groups and len(held) == 1:
        # One group (the usual table): the reservation names the decode engine's blocks
        # (wire-checked ids, none of them NO_BLOCK), taken one to one from `first_block`.
        wanted, kept = request.reservation.blocks, held[0]
        have = kept[first : first + len(wanted)]
        if len(have) == len(wanted) and NO_BLOCK not in have:
            return (tuple(have),)
    asked = request.groups or one_group(request.reservation.blocks)
    request_id = request.request_id
    if len(asked) != len(held):
        raise NotExpectedError(
            f"request {request_id!r}: the decode engine's KV cache has {len(asked)} groups, this "
            f"engine's {len(held)}; they cannot take each other's KV",
            request_id=request_id,
        )
    if table_blocks(asked) != tuple(request.reservation.blocks):
        raise NotExpectedError(
            f"request {request_id!r}: the push request's block table does not name its reservation's blocks",
            request_id=request_id,
        )
    taken: list[tuple[int, ...]] = []
    for group, (wanted, kept) in enumerate(zip(asked, held, strict=True)):
        have = kept[first : first + len(wanted)]
        if len(have) != len(wanted):
            raise NotExpectedError(
                f"request {request_id!r} holds {len(kept)} blocks here in group {group}; the "
                f"decode engine reserved {len(wanted)} positions from block {first}",
                request_id=request_id,
            )
        ours_taken: list[int] = []
        for position, (theirs, ours) in enumerate(zip(wanted, have, strict=True)):
            if theirs == NO_BLOCK:
                continue  # the decode engine keeps nothing there
            if ours == NO_BLOCK:
                raise NotExpectedError(
                    f"request {request_id!r}: the decode engine wants block {first + position} of "
                    f"group {group}, which this engine no longer keeps (outside its window)",
                    request_id=request_id,
                )
            ours_taken.append(ours)
        taken.append(tuple(ours_taken))
    return tuple(taken)


def _sent(
    result: PushResult, handoff: str, groups: BlockTable, *, layerwise: bool, tail_s: float | None = None
) -> Moved:
    return Moved(
        HandoffEvent.SENT,
        result.request_id,
        handoff,
        groups,
        result.seconds,
        transport=result.transport,
        layerwise=layerwise,
        tail_s=tail_s,
    )


def bound_to(decode_engine: str, request: PushRequest) -> bool:
    """Whether `request`'s reservation is one of `decode_engine`'s ranks' ("": any engine's)."""
    if not decode_engine:
        return True
    return request.reservation.engine_id == rank_engine_id(decode_engine, request.decode_rank)
