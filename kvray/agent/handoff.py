"""The P/D hand-off between two engines' agents, the same for every engine integration: a decode
engine asks a prefill engine to push a request the prefill engine holds (push requests are the
decode-to-prefill half of kvray's push; the KV and the completion notice are the other).

    decode   `load`: reserve the blocks the engine allocated (`KVAgent.expect`), send the
             prefill engine a `PushRequest` (fenced by both incarnations, carrying the
             reservation's token), wait for the KV (failing early once the prefill engine is
             seen gone: `PushRequestMail.gone`), release, report (`HandoffReports.loaded`).
             `cancel`: the engine ended the request meanwhile: the wait ends, the prefill engine
             is told (`PushWithdrawn`). `withdraw`: a load that never began, told the same way.
    prefill  `hold`: a finished request's blocks, under its hand-off id, until a push request
             takes them (one push, then `HandoffReports.sent`: the blocks may go) or `lease_s`
             passes. `take`: a push request or a withdrawal. A push request that comes before
             its request is held is parked for a lease (at most `max_expected_requests` of
             them); one that cannot be answered is refused at once (the decode side's wait
             fails). `layerwise` and `save_layer`: a request whose forward runs while its decode
             engine waits has each layer pushed as the forward saves it, once asked; `preempt`:
             its layer copies end and the ask is parked again, to push the request whole when it
             finishes. `drop` and `release`: the request will have no KV, or its decode leg
             failed.

A hand-off id whose request is gone (pushed, dropped, released, withdrawn, or its lease ended)
is spent for a lease: push requests and holds under it are refused at once, so a second request
under one id never replaces the first. Messages go through `PushRequestMail`, the one seam
between the hand-off and how its messages travel. An engine integration hands over its
scheduler's decisions (the specs below), calls `expire` now and then, hears back through
`HandoffReports`, and may install a `HandoffObserver` (`kvray.bench.handoff_log`). Everything
here runs on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import functools
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvray.agent.kvagent import KVAgent
from kvray.agent.push import PushResult
from kvray.errors import (
    BackpressureError,
    KvrayError,
    NotExpectedError,
    StaleIncarnationError,
    TransportError,
)
from kvray.memory import Backing, source_ready
from kvray.metrics import DropReason
from kvray.notice.local import CompletionInbox, CompletionOutbox
from kvray.tensor_parallel import source_ranks
from kvray.wire import (
    EngineInfo,
    PushRequest,
    PushWithdrawn,
    Reservation,
    TransportKind,
    decode_engine_info,
    decode_push_message,
    encode,
)

log = logging.getLogger("kvray.handoff")

#: Key of a prefill engine's push-request inbox in its `EngineInfo.endpoints`.
PUSH_ENDPOINT = "push_requests"

#: How long a push waits before asking again while the agent's transfer queue is full.
BACKPRESSURE_RETRY_S = 0.01


# ---- what an engine's scheduler decides ----------------------------------------------------

#: A request's blocks on one side: one tuple of block ids per KV cache group of the engine (one
#: group for most models; e.g. sliding-window and full-attention layers make two), position by
#: position, `NO_BLOCK` where the engine keeps none (a sliding window's past). The groups share
#: their memory: a block id names the same bytes of every layer the agent moves, so the KV of
#: a request is its blocks of every group.
BlockTable = tuple[tuple[int, ...], ...]
#: A position of a block table that holds no block here.
NO_BLOCK = -1


def one_group(block_ids: Sequence[int]) -> BlockTable:
    """The block table of an engine with one KV cache group."""
    return (tuple(block_ids),)


def table_blocks(table: BlockTable) -> tuple[int, ...]:
    """A block table's blocks, group after group, in position order (`NO_BLOCK` left out)."""
    return tuple(block for group in table for block in group if block != NO_BLOCK)


@dataclass(frozen=True)
class LoadSpec:
    """What the decode side needs to receive one request."""

    request_id: str
    prefill_engine: str
    #: None: the orchestrator gave this engine the request first, naming the prefill engine
    #: alone; its current incarnation, node and inbox come from the coordinator.
    prefill_incarnation: int | None
    #: The hand-off's id at the prefill engine (minted by kvray, signed).
    prefill_request_id: str
    #: The prefill engine's Ray node and push-request inbox, as its ticket names them.
    prefill_node: str
    prefill_inbox: str
    #: The blocks the engine allocated here for the request's pushed tokens, in order, per group.
    block_ids: BlockTable
    #: Which of the prefill engine's blocks of the request (in each group) the first of them takes.
    first_block: int
    #: Why the request's ticket was refused ("": it was not): its load fails at once.
    refusal: str = ""
    #: A prefill engine of several tensor-parallel ranks: the incarnation and push-request
    #: inbox of each rank after the first (`prefill_engine` is rank 0; rank r's engine id is
    #: `rank_engine_id(prefill_engine, r)`, on the same node), as its ticket names them.
    prefill_ranks: tuple[tuple[int, str], ...] = ()

    @classmethod
    def refused(cls, request_id: str, block_ids: BlockTable, why: str) -> LoadSpec:
        return cls(request_id, "", None, "", "", "", block_ids, 0, refusal=why)


@dataclass(frozen=True)
class SendSpec:
    """A finished request the prefill side holds for a decode engine."""

    #: The engine's id of the request (reported back when its blocks may go).
    request_id: str
    block_ids: BlockTable
    #: The id decode engines ask for (the client's hand-off id); "" means `request_id`.
    key: str = ""
    #: The request did not finish well: end (abort) any push of it, send nothing.
    failed: bool = False
    #: The decode engine the request is for, where its ticket named one: only that engine's
    #: ranks' reservations are pushed into ("": any decode engine that asks).
    decode_engine: str = ""

    @property
    def handoff(self) -> str:
        return self.key or self.request_id


@dataclass(frozen=True)
class LayerwiseSpec:
    """A request whose whole prompt this step computes, for a decode engine: each layer is
    pushed as the forward saves it, if the decode engine has asked by then."""

    request_id: str
    key: str
    block_ids: BlockTable
    #: As `SendSpec.decode_engine`.
    decode_engine: str = ""


@dataclass
class HandoffStep:
    """One scheduler step's hand-off decisions: what an engine integration gathers during a step
    and hands over whole (`Handoff.step`). Empty collections are the usual case."""

    #: Decode: loads to start, by request id.
    loads: dict[str, LoadSpec] = field(default_factory=dict)
    #: Prefill: finished requests to hold for a decode engine, by request id.
    sends: dict[str, SendSpec] = field(default_factory=dict)
    #: Prefill: hand-off ids of requests that ended with no KV to push (aborted, failed): a
    #: decode engine's push request for one is refused at once, not held for the lease.
    dropped: set[str] = field(default_factory=set)
    #: Decode: requests (by id) that ended while their KV was loading: their wait ends now, and
    #: their blocks go back once no write of theirs can land.
    cancelled: set[str] = field(default_factory=set)
    #: Prefill: hand-off ids a proxy released (the decode leg failed): freed at once.
    released: set[str] = field(default_factory=set)
    #: Decode: loads of requests that ended before their blocks were allocated: their prefill
    #: engines are told not to hold them.
    withdrawn: list[LoadSpec] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.loads or self.sends or self.dropped or self.cancelled or self.released or self.withdrawn
        )

    def copy(self) -> HandoffStep:
        """A copy whose collections are its own (the caller may reuse its collections)."""
        return HandoffStep(
            loads=dict(self.loads),
            sends=dict(self.sends),
            dropped=set(self.dropped),
            cancelled=set(self.cancelled),
            released=set(self.released),
            withdrawn=list(self.withdrawn),
        )


def rank_engine_id(engine_id: str, rank: int) -> str:
    """The kvray engine id of tensor-parallel rank `rank` of engine `engine_id`: rank 0 goes by
    the engine's own id (an engine of one rank is its rank 0), the others by a suffix."""
    return engine_id if rank == 0 else f"{engine_id}-tp{rank}"


@dataclass(frozen=True)
class PrefillAddress:
    """Where a decode engine sends a push request: the prefill engine's id and incarnation,
    its Ray node and its push-request inbox on that node ("" if it has none)."""

    engine_id: str
    incarnation: int
    node_id: str
    inbox: str


# ---- what the engine hears, and what an observer sees --------------------------------------


class HandoffReports(Protocol):
    """How the hand-off tells its engine that blocks may go back to it."""

    def sent(self, request_id: str) -> None:
        """A held request's blocks are no longer read (pushed, freed, or never held)."""

    def loaded(self, spec: LoadSpec, *, failed: bool) -> None:
        """No write of a load can land any more; `failed`: its blocks hold no KV to use."""


class AskProof(Protocol):
    """What proves a decode engine's push request or withdrawal comes from an engine of the
    prefill engine's deployment (`kvray.integrations.vllm.tickets.HandoffKey`): without it,
    anyone who learnt a hand-off id could free another request's hold, or pin it with asks."""

    def ask_proof(self, prefill_engine: str, handoff: str) -> bytes: ...


def bound_to(decode_engine: str, request: PushRequest) -> bool:
    """Whether `request`'s reservation is one of `decode_engine`'s ranks' ("": any engine's)."""
    if not decode_engine:
        return True
    return request.reservation.engine_id == rank_engine_id(decode_engine, request.decode_rank)


class HandoffEvent(enum.Enum):
    ASKED = "asked"  # a push request parked, waiting for its request
    WITHDRAWN = "withdrawn"
    PREEMPTED = "preempted"
    SENT = "sent"
    RECEIVED = "received"
    PUSH_FAILED = "push failed"
    RECEIVE_FAILED = "receive failed"
    RECEIVE_CANCELLED = "receive cancelled"


@dataclass(frozen=True)
class Moved:
    """One side of a hand-off whose KV moved (`SENT` or `RECEIVED`)."""

    event: HandoffEvent
    #: The decode engine's id of the request (as its reservation names it).
    request_id: str
    #: The hand-off's id at the prefill engine.
    handoff: str
    #: The request's blocks on this side, per KV cache group, where both sides have one (so
    #: the two sides' tables line up): held until the observer returns.
    groups: BlockTable
    seconds: float
    transport: TransportKind | None = None
    layerwise: bool | None = None
    #: Layer-wise: from the forward saving the last layer to the decode side told.
    tail_s: float | None = None

    @property
    def blocks(self) -> tuple[int, ...]:
        """The request's blocks on this side, group after group."""
        return table_blocks(self.groups)


class HandoffObserver(Protocol):
    """Watches hand-offs (benchmarks, digest logs); installed by whoever measures."""

    def event(self, event: HandoffEvent, request_id: str, handoff: str, error: str = "") -> None: ...

    async def moved(self, moved: Moved, backing: Backing) -> None:
        """Called with the blocks still held: the observer may read them."""


# ---- the seam: how push requests travel ----------------------------------------------------


class PushRequestMail:
    """Push requests and withdrawals from decode engines to a prefill engine: a datagram
    inbox for engines on this node, else the prefill engine's host actor (engines that joined
    Ray). `take` is what a host actor hands its push requests to."""

    def __init__(self, shm_dir: str) -> None:
        self._handler: Callable[[bytes], None] | None = None
        self._inbox = CompletionInbox(shm_dir, self.take)
        self._outbox = CompletionOutbox(shm_dir)

    @property
    def endpoints(self) -> dict[str, str]:
        """What the engine publishes (`KVAgent.start`) so that decode engines find the inbox."""
        return {PUSH_ENDPOINT: self._inbox.path}

    def listen(self, handler: Callable[[bytes], None]) -> None:
        self._handler = handler

    def take(self, message: bytes) -> None:
        if self._handler is not None:
            self._handler(message)

    async def send(self, agent: KVAgent, prefill: PrefillAddress, message: bytes, *, joined: bool) -> None:
        """Send through the prefill engine's inbox on this node, else through its host actor
        (found by the coordinator, which must know this incarnation)."""
        if prefill.inbox and prefill.node_id == agent.node_id:
            await self._outbox.send(prefill.inbox, message)
            return
        if not joined:
            raise NotExpectedError(
                f"prefill engine {prefill.engine_id!r} runs on node {prefill.node_id!r} and this decode "
                f"engine on {agent.node_id!r}: engines on different nodes must both join Ray "
                "(kv_connector_extra_config ray_address)",
                engine_id=prefill.engine_id,
            )
        peer = await agent.peer(prefill.engine_id, wait_s=agent.settings.notify_timeout_s)
        if peer.info.incarnation != prefill.incarnation:
            raise StaleIncarnationError(
                f"prefill engine {prefill.engine_id!r} restarted (incarnation {peer.info.incarnation}, "
                f"the request names {prefill.incarnation}): its KV of the request is gone",
                engine_id=prefill.engine_id,
            )
        if peer.host is None:
            raise NotExpectedError(
                f"prefill engine {prefill.engine_id!r} has no host actor to take push requests",
                engine_id=prefill.engine_id,
            )
        await peer.host.kvray_request_push.remote(message)

    async def gone(self, agent: KVAgent, prefill: PrefillAddress, *, joined: bool) -> str:
        """Why the prefill engine can no longer push ("" while it may): on this node, its
        inbox has no reader; elsewhere (engines that joined Ray), the coordinator no longer
        lists its incarnation. Without an answer in time it may still push."""
        if prefill.inbox and prefill.node_id == agent.node_id:
            if self._outbox.listening(prefill.inbox):
                return ""
            return f"its push-request inbox {prefill.inbox} has no reader: the engine closed or died"
        if not joined:
            return ""
        try:
            async with asyncio.timeout(agent.settings.notify_timeout_s):
                departed = await agent.departed([(prefill.engine_id, prefill.incarnation)])
        except Exception:  # the coordinator is restarting or slow: no news
            return ""
        if departed:
            return "the coordinator no longer lists its incarnation: the engine closed, died or restarted"
        return ""

    def close(self) -> None:
        self._handler = None
        self._inbox.close()
        self._outbox.close()


# ---- one engine's hand-offs ----------------------------------------------------------------


@dataclass
class _Held:
    """A finished request held for a decode engine, until every rank of the decode engine has
    answered (each pushed into, or withdrew) or its lease ends. A decode engine of one rank
    answers once."""

    spec: SendSpec
    lease_ends: float
    #: Decode ranks whose push is under way.
    pushing: set[int] = field(default_factory=set)
    #: Decode ranks that have answered: pushed into (or refused), or withdrew.
    answered: set[int] = field(default_factory=set)
    #: The decode engine's number of ranks, from its first message (0: none came yet).
    ranks: int = 0

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
    #: (`kvray.memory.source_ready`; None: the bytes are ready when the layer is saved).
    saved: list[tuple[str, Any]] = field(default_factory=list)
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


class Handoff:
    """Both halves of one engine's hand-offs over its agent (see the module docstring).
    `joined`: the engine joined Ray, so the coordinator knows its peers and their host actors.
    `proof`: the deployment's key; with it, every push request and withdrawal this engine sends
    carries a proof, and one that comes without a valid proof is dropped unread."""

    def __init__(
        self,
        agent: KVAgent,
        mail: PushRequestMail,
        reports: HandoffReports,
        *,
        lease_s: float,
        joined: bool = False,
        observer: HandoffObserver | None = None,
        proof: AskProof | None = None,
    ) -> None:
        self.agent = agent
        self._proof = proof
        self.settings = agent.settings
        self.lease_s = lease_s
        self.joined = joined
        self.observer = observer
        self._mail = mail
        self._reports = reports
        #: Prefill: requests held for a decode engine, and push requests that came before
        #: their request (with when they came).
        self._held: dict[str, _Held] = {}
        #: Prefill: the blocks of the requests held (`_held_changed`).
        self._blocks_held = 0
        #: Prefill: decode ranks' messages (push requests, and withdrawals from engines of
        #: several ranks) that came before their request was held, with when they came.
        self._parked: dict[str, list[tuple[PushRequest | PushWithdrawn, float]]] = {}
        #: Prefill: requests pushed layer by layer (by hand-off id), and those whose forward
        #: runs in this step.
        self._layered: dict[str, _Layered] = {}
        self._this_step: list[_Layered] = []
        #: Prefill: hand-off ids that will never have KV here, until when a push request for
        #: one is refused at once.
        self._spent: dict[str, float] = {}
        #: Decode: loads still waiting, and those whose task has taken its first step.
        self._receiving: dict[str, asyncio.Task[None]] = {}
        self._loads_begun: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Prefill: the decode engines' infos push requests carried, as sent and as decoded
        #: (a decode engine sends the same bytes with every request of one incarnation).
        self._decoded: OrderedDict[bytes, EngineInfo] = OrderedDict()
        #: Decode: this engine's info and its encoding (`_encoded_info`).
        self._info_bytes: tuple[EngineInfo, bytes] | None = None
        mail.listen(self.take)

    def parked(self) -> int:
        """How many push requests wait for their request here."""
        return len(self._parked)

    def close(self) -> None:
        """Cancel what is under way (before the agent closes, which ends every wait)."""
        for task in list(self._tasks):
            task.cancel()

    # ---- the scheduler's decisions --------------------------------------------------------

    def step(self, step: HandoffStep) -> None:
        """One step's hand-offs: sends to hold, hand-offs that will never have KV (`dropped`),
        held requests whose decode leg failed (`released`), loads to start, loads no longer
        wanted (`cancelled`) and loads that ended before they began (`withdrawn`)."""
        for spec in step.sends.values():
            self.hold(spec)
        for key in step.dropped:
            self.drop(key)
        for key in step.released:
            self.release(key)
        for load in step.loads.values():
            self.load(load)
        for request_id in step.cancelled:
            self.cancel(request_id)
        for load in step.withdrawn:
            self._spawn(self.withdraw(load))

    def hold(self, spec: SendSpec) -> None:
        """Hold a finished request for its decode engine, unless its hand-off id is taken:
        a second request under one id ends at once and never replaces the first."""
        key = spec.handoff
        layered = self._layered.get(key)
        if layered is not None and layered.spec.request_id == spec.request_id:
            del self._layered[key]
            if layered.request is not None:
                self._spawn(self._finish_layered(layered, spec))
                return
            if key in self._spent:  # the decode engine withdrew while the forward ran
                self._reports.sent(spec.request_id)
                return
        elif layered is not None or key in self._held or key in self._spent:
            log.warning("kvray: hand-off %s is taken; request %s is not held", key, spec.request_id)
            self._reports.sent(spec.request_id)
            return
        if spec.failed:
            self._reports.sent(spec.request_id)
            self.drop(key)
            return
        held = self._held[key] = _Held(spec, time.monotonic() + self.lease_s)
        self._held_changed(held, began=True)
        # The content digests of its blocks (`KVAgent.hold_digests`), taken while no decode
        # engine has asked yet: its push then reads no block to check what it moves. They are
        # dropped when the hold ends (`_held_changed`).
        self._spawn(self._hold_digests(spec.block_ids))
        for message, _ in self._parked.pop(key, ()):
            if isinstance(message, PushRequest):
                self._spawn(self._push(message))
            elif held.admits(message):
                held.ranks = message.decode_ranks
                held.answered.add(message.decode_rank)
        self._settle(key, held)

    async def _hold_digests(self, table: BlockTable) -> None:
        with contextlib.suppress(KvrayError):  # a push without them reads the blocks itself
            await self.agent.hold_digests(np.asarray(table_blocks(table), dtype=np.int64))

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
        if held is not None and not held.pushing:
            del self._held[key]
            self._held_changed(held, began=False)
            self._spend(key)
            self._reports.sent(held.spec.request_id)

    def expire(self) -> None:
        """Free held requests no decode engine asked for within their lease, refuse push
        requests parked as long, and forget spent ids a lease old."""
        now = time.monotonic()
        for key, held in list(self._held.items()):
            if not held.pushing and held.lease_ends <= now:
                del self._held[key]
                self._held_changed(held, began=False)
                self._spend(key)
                self._reports.sent(held.spec.request_id)
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
        blocks = table_blocks(held.spec.block_ids)
        self._blocks_held += len(blocks) if began else -len(blocks)
        self.agent.metrics.blocks_held(self._blocks_held)
        if not began:  # the blocks go back to the engine: digests held of them are stale now
            self.agent.forget_digests(np.asarray(blocks, dtype=np.int64))

    def _spend(self, key: str) -> None:
        """A hand-off id whose request is gone: asks and holds under it are refused a lease long."""
        self._spent[key] = time.monotonic() + self.lease_s

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _note(self, event: HandoffEvent, request_id: str, handoff: str, error: str = "") -> None:
        if self.observer is not None:
            self.observer.event(event, request_id, handoff, error)

    async def _moved(self, moved: Moved) -> None:
        if self.observer is not None:
            await self.observer.moved(moved, self.agent.backing)

    # ---- prefill side: push requests ------------------------------------------------------

    def take(self, message: bytes) -> None:
        """A decode engine's push request or withdrawal."""
        try:
            request = decode_push_message(message)
        except KvrayError as error:
            log.warning("kvray: dropped a malformed push request: %s", error)
            return
        if self._proof is not None and not hmac.compare_digest(
            request.proof, self._proof.ask_proof(self.agent.engine_id, request.request_id)
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
        if held.settled and self._held.get(key) is held:
            del self._held[key]
            self._held_changed(held, began=False)
            self._spend(key)
            self._reports.sent(held.spec.request_id)

    async def _push(self, request: PushRequest) -> None:
        key = request.request_id
        held = self._held.get(key)
        if held is None or not held.admits(request):
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
            result = await self._push_when_room(reservation, table_blocks(taken), held.lease_ends)
            await self._moved(_sent(result, key, taken, layerwise=False))
        except Exception as error:  # the push told the decode side, or this does
            log.warning("kvray: push of %s failed: %s", key, error)
            self._note(HandoffEvent.PUSH_FAILED, key, key, _why(error))
            if not isinstance(error, KvrayError) or isinstance(error, NotExpectedError):
                await self.agent.abort(reservation, _why(error))
        finally:
            held.pushing.discard(rank)
            held.answered.add(rank)
            self._settle(key, held)

    async def _push_when_room(
        self, reservation: Reservation, blocks: Sequence[int], until: float
    ) -> PushResult:
        """Push, waiting while the agent's queue of transfers is full (a batch of decode
        requests asks for many at once), up to the request's lease."""
        while True:
            try:
                return await self.agent.push(reservation, np.asarray(blocks, dtype=np.int64))
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
        if not self.joined:
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

    def save_layer(self, layer_name: str, ready: Any = None) -> None:
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
            self._spawn(self._refuse(request, _why(error)))
            return
        layered.request = request
        for layer_name, ready in layered.saved:
            self._push_layer(layered, layer_name, ready)

    def _push_layer(self, layered: _Layered, layer_name: str, ready: Any) -> None:
        assert layered.request is not None
        push = self._layer_when_room(layered.request.reservation, layer_name, layered.blocks)
        # The push's copies are ordered after `ready` (the task runs in a context of its own).
        context = contextvars.copy_context()
        context.run(source_ready.set, ready)
        layered.pushes.append(asyncio.get_running_loop().create_task(push, context=context))

    async def _layer_when_room(self, reservation: Reservation, layer_name: str, blocks: Sequence[int]) -> int:
        """Push one layer, waiting while the agent's queue of transfers is full (a decode engine
        that asks once many forwards have saved every layer queues each of their layers at
        once), up to a lease from now."""
        until = time.monotonic() + self.lease_s
        while True:
            try:
                return await self.agent.push_layer(reservation, layer_name, np.asarray(blocks))
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
            self._note(HandoffEvent.PUSH_FAILED, request.request_id, request.request_id, _why(error))
            with contextlib.suppress(Exception):
                await agent.abort(reservation, _why(error))
        finally:
            self._spend(layered.spec.key)
            self._reports.sent(spec.request_id)

    # ---- decode side ----------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> None:
        """Start receiving a request (reported through `HandoffReports.loaded`)."""
        task = self._receiving[spec.request_id] = self._spawn(self._receive(spec))
        task.add_done_callback(functools.partial(self._load_ended, spec))

    def cancel(self, request_id: str) -> None:
        """The engine ended the request while its KV loads: stop waiting (its blocks are
        reported once no write of it can land)."""
        receiving = self._receiving.pop(request_id, None)
        if receiving is not None:
            receiving.cancel()

    def _load_ended(self, spec: LoadSpec, task: asyncio.Task[None]) -> None:
        """A load cancelled before its first step never ran its own reporting: report it here
        (it reserved nothing, so its blocks are simply free)."""
        if task.cancelled() and spec.request_id not in self._loads_begun:
            self._receiving.pop(spec.request_id, None)
            self._reports.loaded(spec, failed=False)
            if not spec.refusal:
                self._spawn(self.withdraw(spec))
        self._loads_begun.discard(spec.request_id)

    async def _receive(self, spec: LoadSpec) -> None:
        """Reserve the blocks, ask the prefill engine to push, wait, and report; the blocks are
        the engine's again only once no write of the request can land.

        With tensor parallelism (either side), this rank reserves its blocks once for each
        prefill rank holding heads it takes (`kvray.tensor_parallel.source_ranks`) and asks
        each to push its part; it tells every other prefill rank it takes nothing from it.
        The request has arrived once every part has."""
        agent = self.agent
        self._loads_begun.add(spec.request_id)
        ok = False
        reserved: list[str] = []
        cancelled = False
        try:
            if spec.refusal:
                raise NotExpectedError(
                    f"request {spec.request_id!r} was refused: {spec.refusal}", request_id=spec.request_id
                )
            prefills = await self._prefill_ranks(spec)
            sources = self._sources(len(prefills))
            own = agent.layout.tp
            blocks = list(table_blocks(spec.block_ids))
            asks: list[tuple[PrefillAddress, str, PushRequest]] = []
            for rank in sources:
                prefill = prefills[rank]
                part = spec.request_id if len(sources) == 1 else f"{spec.request_id}#tp{rank}"
                reservation = agent.expect(part, blocks)
                reserved.append(part)
                request = PushRequest(
                    request_id=spec.prefill_request_id,
                    src_engine=prefill.engine_id,
                    src_incarnation=prefill.incarnation,
                    reservation=reservation,
                    first_block=spec.first_block,
                    decode_info=self._encoded_info(),
                    groups=spec.block_ids if len(spec.block_ids) > 1 else (),
                    decode_rank=own.rank,
                    decode_ranks=own.size,
                    proof=self._prove(prefill.engine_id, spec.prefill_request_id),
                )
                asks.append((prefill, part, request))
            for rank, prefill in enumerate(prefills):
                if rank not in sources:
                    self._spawn(self._withdraw_from(spec, prefill))
            asked = time.perf_counter()
            # One deadline for the ask and the KV: a prefill engine busy enough to let its inbox
            # fill takes the ask late, not never (a gone one refuses the datagram at once).
            deadline = self.settings.transfer_timeout_s
            async with asyncio.timeout(deadline):
                for prefill, _, request in asks:
                    await self._mail.send(agent, prefill, encode(request), joined=self.joined)
            remaining = max(deadline - (time.perf_counter() - asked), 0.001)
            await _all_or_first_error(
                self._wait_while_prefill_lives(prefill, part, remaining) for prefill, part, _ in asks
            )
            ok = True
            waited = time.perf_counter() - asked
            await self._moved(
                Moved(
                    HandoffEvent.RECEIVED,
                    spec.prefill_request_id,
                    spec.prefill_request_id,
                    tuple(tuple(block for block in group if block != NO_BLOCK) for group in spec.block_ids),
                    waited,
                )
            )
        except asyncio.CancelledError:
            # The engine ended the request while its KV loaded: release as below, report no
            # errors, and tell the prefill engine not to keep the request for a push no one takes.
            cancelled = True
            self._spawn(self.withdraw(spec))
            self._note(HandoffEvent.RECEIVE_CANCELLED, spec.request_id, spec.prefill_request_id)
        except Exception as error:
            log.warning("kvray: KV of %s did not arrive: %s", spec.request_id, error)
            self._note(HandoffEvent.RECEIVE_FAILED, spec.request_id, spec.prefill_request_id, _why(error))
        finally:
            # From here on the load is not cancelled: a release must run to its end.
            self._receiving.pop(spec.request_id, None)
            for part in reserved:
                try:
                    await agent.release(part)
                except KvrayError as error:
                    ok = False
                    log.error("kvray: %s could not be released: %s", part, error)
                    # A writer may still write into the blocks: the engine keeps them (the
                    # request is not reported) until the agent's quarantine of it ends.
                    quarantined = agent.quarantined.get(part)
                    if quarantined is not None:
                        await quarantined.wait()
            # A cancelled request is gone: its blocks are free, not blocks to recompute.
            self._reports.loaded(spec, failed=not ok and not cancelled)

    def _sources(self, prefill_ranks: int) -> tuple[int, ...]:
        """The prefill ranks (of `prefill_ranks`) this rank takes KV from: the one rank of a
        prefill engine without tensor parallelism; else those holding heads of this rank's
        (assuming the prefill engine's model has this one's KV heads: its ranks check that
        when they plan, and refuse a decode engine of another model)."""
        own = self.agent.layout.tp
        if prefill_ranks == 1 and own.size == 1:
            return (0,)
        return source_ranks(own, prefill_ranks, own.kv_heads)

    def _prove(self, prefill_engine: str, handoff: str) -> bytes:
        return b"" if self._proof is None else self._proof.ask_proof(prefill_engine, handoff)

    def _encoded_info(self) -> bytes:
        """The agent's published info as push requests carry it, encoded once per incarnation."""
        info = self.agent.info
        if self._info_bytes is None or self._info_bytes[0] is not info:
            self._info_bytes = (info, encode(info))
        return self._info_bytes[1]

    async def _wait_while_prefill_lives(
        self, prefill: PrefillAddress, request_id: str, timeout: float
    ) -> None:
        """`wait_for_kv`, ended early with `TransportError` once the prefill engine is seen gone
        (asked every `heartbeat_s`): one that took the push request and then died would
        otherwise leave the request waiting until its deadline. The request stays reserved
        either way; the caller releases it."""
        waiting = asyncio.ensure_future(self.agent.wait_for_kv(request_id, timeout=timeout))
        try:
            while not (await asyncio.wait({waiting}, timeout=self.settings.heartbeat_s))[0]:
                why = await self._mail.gone(self.agent, prefill, joined=self.joined)
                if why and not waiting.done():
                    raise TransportError(
                        f"prefill engine {prefill.engine_id!r} went away while request {request_id!r} "
                        f"waited for its KV: {why}",
                        engine_id=prefill.engine_id,
                        request_id=request_id,
                    )
            waiting.result()
        finally:
            if not waiting.done():
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError, KvrayError):
                    await waiting

    async def _prefill_ranks(self, spec: LoadSpec) -> list[PrefillAddress]:
        """Where the prefill engine's ranks take push requests: as its own ticket names them,
        else (the request came here first) from the coordinator, which knows each rank's
        incarnation, inbox and how many ranks the engine has."""
        if spec.prefill_incarnation is not None:
            first = PrefillAddress(
                spec.prefill_engine, spec.prefill_incarnation, spec.prefill_node, spec.prefill_inbox
            )
            others = [
                PrefillAddress(
                    rank_engine_id(spec.prefill_engine, rank), incarnation, spec.prefill_node, inbox
                )
                for rank, (incarnation, inbox) in enumerate(spec.prefill_ranks, start=1)
            ]
            return [first, *others]
        if not self.joined:
            raise NotExpectedError(
                f"request {spec.request_id!r} names prefill engine {spec.prefill_engine!r} alone: only "
                "an engine that joined Ray (ray_address) can look it up; give this engine the "
                "prefill engine's kv_transfer_params instead",
                engine_id=spec.prefill_engine,
            )
        addresses: list[PrefillAddress] = []
        ranks = 1
        while len(addresses) < ranks:
            engine_id = rank_engine_id(spec.prefill_engine, len(addresses))
            peer = await self.agent.peer(engine_id, wait_s=self.settings.lookup_timeout_s)
            info = peer.info
            tp = info.layout.tp
            if not addresses:
                ranks = tp.size
            if (tp.rank, tp.size) != (len(addresses), ranks) or info.engine_id != engine_id:
                raise StaleIncarnationError(
                    f"engine {engine_id!r} is registered as rank {tp.rank} of {tp.size}, not rank "
                    f"{len(addresses)} of prefill engine {spec.prefill_engine!r}'s {ranks}",
                    engine_id=engine_id,
                )
            addresses.append(
                PrefillAddress(
                    info.engine_id, info.incarnation, info.node_id, info.endpoints.get(PUSH_ENDPOINT, "")
                )
            )
        return addresses

    async def withdraw(self, spec: LoadSpec) -> None:
        """Tell the prefill engine (each of its ranks) this engine will not take the request
        (best effort, bounded: otherwise its lease frees it)."""
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                prefills = await self._prefill_ranks(spec)
        except Exception as error:
            log.info("kvray: could not withdraw %s from its prefill engine: %s", spec.request_id, _why(error))
            return
        await asyncio.gather(*(self._withdraw_from(spec, prefill) for prefill in prefills))

    async def _withdraw_from(self, spec: LoadSpec, prefill: PrefillAddress) -> None:
        """Tell one prefill rank this rank will not take the request from it."""
        own = self.agent.layout.tp
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                withdrawn = PushWithdrawn(
                    request_id=spec.prefill_request_id,
                    src_engine=prefill.engine_id,
                    src_incarnation=prefill.incarnation,
                    decode_rank=own.rank,
                    decode_ranks=own.size,
                    proof=self._prove(prefill.engine_id, spec.prefill_request_id),
                )
                await self._mail.send(self.agent, prefill, encode(withdrawn), joined=self.joined)
        except Exception as error:
            log.info(
                "kvray: could not withdraw %s from prefill engine %s: %s",
                spec.request_id,
                prefill.engine_id,
                _why(error),
            )


async def _all_or_first_error(waits: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run `waits` together; the first to fail cancels the others, and its error is raised
    (not an exception group: one cause is the load's)."""
    try:
        async with asyncio.TaskGroup() as group:
            for wait in waits:
                group.create_task(wait)
    except BaseExceptionGroup as failed:
        first = failed.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


def _taken_blocks(request: PushRequest, held: BlockTable) -> BlockTable:
    """The blocks of a held request that a push request's reservation takes, per group, position
    by position from `first_block` where the decode engine has a block (`table_blocks` of it:
    in the reservation's order). Refused (`NotExpectedError`) where the two sides' groups differ, the
    table does not name the reservation's blocks, or the decode engine wants a position this
    side no longer keeps."""
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
    first = request.first_block
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


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


#: Why a push request for a dropped hand-off is refused.
_ENDED_WITHOUT_KV = "the prefill request ended without its KV"
_OTHER_ENGINE = "its ticket names another decode engine"
