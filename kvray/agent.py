"""Agent: the embeddable engine (steps 3 to 7 of the data flow in one object).

A `KVAgent` lives inside any Ray actor or Serve replica (or a plain process, wired by hand):

    agent = KVAgent("decode-0", Role.DECODE, layout)
    await agent.start()                          # register regions, publish EngineInfo
    agent.expect("req-1")                        # decode: a request's blocks are reserved
    await agent.push("req-1", blocks, "decode-0", remote_blocks)   # prefill: plan + write + done
    await agent.wait_for_kv("req-1", timeout=5)  # decode: resolves after the bytes are written
    await agent.close()

Layer-wise: `push_layer` per layer as the forward pass produces it, then `finish`; the decode
side sees one completion. The actor hosting an agent mixes in `AgentHost`, which gives peers
and the coordinator the three entry points they call (`kvray_deliver`, `kvray_notify`,
`kvray_watch`).

Failures: every push runs under a deadline and a bounded slot (`max_concurrent_transfers`
running, `max_queued_transfers` waiting, more are refused with `BackpressureError`). A push
that fails once its peer is known tells the peer in the background (`TransferFailed`, naming
the incarnation it planned against), after its last byte has stopped moving, so the decode
side frees the request's blocks at once instead of at its deadline; a failed layer-wise push
refuses its later layers. A decode agent takes `ray`-transport writes only for requests it
still expects, and a failed `wait_for_kv` returns only after every write it admitted has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from kvray.claims import BOARD_NAME, ClaimBoard, ClaimClient
from kvray.claims import ENDPOINT as CLAIMS_ENDPOINT
from kvray.completion import ENDPOINT as COMPLETION_ENDPOINT
from kvray.completion import CompletionInbox, CompletionOutbox, DatagramNotice
from kvray.config import Settings
from kvray.errors import (
    BackpressureError,
    KvrayError,
    MetadataError,
    NotExpectedError,
    PlanError,
    StaleIncarnationError,
    TransferTimeoutError,
    TransportError,
    UnknownEngineError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.layout import KVLayout
from kvray.memory import Backing, MemoryKind
from kvray.metrics import NO_TRANSPORT, DropReason, EngineMetrics, MetricsSink, Outcome, PushCall
from kvray.plan import OffsetCache, TransferPlan, block_ids, check_ops_within, plan_transfer, request_spans
from kvray.transport import Peer, Transport, open_transport, transport_class
from kvray.transport.ray import apply_ops, read_header
from kvray.wire import (
    EngineInfo,
    Reservation,
    Role,
    TransferDone,
    TransferFailed,
    TransportKind,
    WriteClaim,
    WriteOps,
    decode_engine_info,
    decode_message,
    decode_write_claim,
    encode,
)

if TYPE_CHECKING:
    from kvray.transport.verbs import VerbsTransport

Blocks = Sequence[int] | npt.NDArray[np.integer]

#: The transport whose descriptors an engine publishes, by where its backing lives.
_REGISTERING_TRANSPORT = {
    MemoryKind.SHM: TransportKind.SHM,
    MemoryKind.CUDA: TransportKind.CUDA_IPC,
    MemoryKind.CPU: TransportKind.RAY,
}


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


@dataclass(frozen=True)
class Completion:
    """What the decode side learns when a request's KV has arrived."""

    request_id: str
    transfer_id: str
    src_engine: str
    nbytes: int


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
    #: Layers written over `verbs`, each ending in one WRITE WITH IMMEDIATE.
    immediates: int = 0
    layers: set[str] = field(default_factory=set)
    #: When the first layer's push call began (`time.perf_counter`).
    started: float = 0.0
    #: Layer writes in progress, and an event set whenever there are none.
    writing: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass
class _Expectation:
    """A request a decode agent expects: what its writer must show, and where it may write."""

    future: asyncio.Future[Completion]
    token: int
    #: Its slot in the claim board (-1: the agent has no board, e.g. it never started an inbox).
    slot: int
    blocks: npt.NDArray[np.int64]
    #: (region, start, end) byte spans of the request's blocks, built at its first `ray` write.
    spans: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None
    #: A writer on another node that claimed the request (`verbs`), and an event set once its
    #: notice (done or failed) has arrived: until then its one-sided writes may still land.
    writer: tuple[str, int] | None = None
    writer_done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Attempt:
    """How far one push got: the peer it planned against (whose incarnation a failure notice
    names) and its transfer id, once known."""

    request_id: str
    reservation: Reservation | None = None
    layerwise: bool = False
    peer: Peer | None = None
    transfer_id: str | None = None
    transport: TransportKind | None = None
    #: When the call began (`time.perf_counter`); finish: when the request's first layer's did.
    started: float = 0.0


def _ids(reservation: Reservation) -> npt.NDArray[np.int64]:
    """A reservation's block ids as the array the planner takes (it checks them)."""
    return np.fromiter(reservation.blocks, dtype=np.int64, count=len(reservation.blocks))


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # outside a Ray worker: the host name is the node
        pass
    return socket.gethostname()


def _actor_died(error: BaseException) -> bool:
    """True when a Ray call failed because the actor it went to is dead."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # no Ray, no actors
        return False
    return isinstance(error, RayActorError)


def _current_actor() -> Any:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().current_actor
    except Exception:  # the driver, or no Ray: no host actor
        pass
    return None


class KVAgent:
    """One engine's kvray side: its backing, its published info, its transfers."""

    def __init__(
        self,
        engine_id: str,
        role: Role,
        layout: KVLayout | None = None,
        *,
        backing: Backing | None = None,
        memory: MemoryKind | None = None,
        settings: Settings | None = None,
        coordinator: Any = None,
        use_coordinator: bool = True,
        offset_cache: OffsetCache | None = None,
        metrics_sink: MetricsSink | None = None,
    ) -> None:
        if (layout is None) == (backing is None):
            raise PlanError("give a KVAgent either a layout (kvray allocates) or a backing, not both")
        self.engine_id = engine_id
        self.role = role
        self.settings = settings or Settings.from_env()
        if backing is None:
            assert layout is not None
            default = MemoryKind.SHM if role is Role.DECODE else MemoryKind.CPU
            backing = Backing.allocate(layout, memory or default, settings=self.settings)
        self.backing = backing
        self.layout = backing.layout
        self.incarnation = 0
        self.node_id = _node_id()
        self.stats: Counter[str] = Counter()
        #: Prometheus metrics (through Ray's metrics API when Ray is up; see kvray.metrics).
        self.metrics = EngineMetrics(engine_id, role.value, metrics_sink)
        self._info: EngineInfo | None = None
        self._coordinator = coordinator
        self._use_coordinator = use_coordinator
        self._epoch: int | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._transports: dict[TransportKind, Transport] = {}
        #: Peers looked up or added, least recently used first (at most `max_cached_peers`).
        self._peers: OrderedDict[str, Peer] = OrderedDict()
        self._cache = offset_cache if offset_cache is not None else OffsetCache()
        self._slots = asyncio.Semaphore(self.settings.max_concurrent_transfers)
        self._waiting = 0
        self._pending: dict[str, _Expectation] = {}
        #: Requests being released (their writers may still send their notice).
        self._releasing: dict[str, _Expectation] = {}
        #: Requests this decode agent could not release yet (a writer still held their claim),
        #: each with an event set once it is released after all.
        self.quarantined: dict[str, asyncio.Event] = {}
        self._layerwise: dict[str, _Layerwise] = {}
        #: Layer-wise requests that failed (why), until `finish` or `abort`: later layers are refused.
        self._failed_layerwise: dict[str, str] = {}
        self._transfer_count = 0
        self._closed = asyncio.Event()
        self._started = False
        self._inbox: CompletionInbox | None = None
        self._board: ClaimBoard | None = None
        #: Claim boards of same-node decode engines this agent writes into, per incarnation.
        self._claims: dict[tuple[str, int], ClaimClient] = {}
        #: Requests (id, token) a decode engine on another node holds for this writer (`verbs`).
        self._remote_claims: set[tuple[str, int]] = set()
        self._outbox: CompletionOutbox | None = None
        self._coordinator_by_name = False
        #: Failure notices on their way to peers.
        self._background: set[asyncio.Task[None]] = set()
        #: `ray`-transport writes being scattered, per request (a failed wait outlasts them).
        self._writing: Counter[str] = Counter()
        self._writes_done = asyncio.Condition()

    # ---- life cycle -------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise KvrayError(f"agent {self.engine_id!r} has not started; await agent.start() first")
        return self._info

    @property
    def started(self) -> bool:
        return self._started and not self._closed.is_set()

    async def start(self) -> EngineInfo:
        """Take a fresh incarnation, register regions, publish this engine's info."""
        if self._started:
            return self.info
        self.incarnation = secrets.randbits(62) or 1
        writable = self.role is Role.DECODE
        kind = _REGISTERING_TRANSPORT[self.backing.kind]
        # Registering only describes memory; whether the transport can also write from this
        # process (e.g. Ray is up) is checked when a write needs it.
        registrar = self._transports.get(kind) or transport_class(kind)(self.settings)
        self._transports[kind] = registrar
        regions = registrar.register(self.backing, self.engine_id, self.incarnation, remote_writable=writable)
        endpoints: dict[str, str] = {}
        if self.role is Role.DECODE:
            self._inbox = CompletionInbox(self.settings.shm_dir, self._receive)
            endpoints[COMPLETION_ENDPOINT] = self._inbox.path
            self._board = ClaimBoard(self._inbox.folder, self.settings.max_expected_requests)
            endpoints[CLAIMS_ENDPOINT] = self._board.path
        self._info = self.backing.engine_info(
            self.engine_id, self.incarnation, self.role, self.node_id, regions, endpoints
        )
        if writable and self.settings.transport in ("auto", "verbs"):
            from kvray.transport.verbs import advertise

            self._info = advertise(self._info, self._transport, self.settings)
        if self._use_coordinator and self._coordinator is None:
            import ray

            if ray.is_initialized():
                from kvray.coordinator import get_or_create_coordinator

                self._coordinator = get_or_create_coordinator(self.settings)
                self._coordinator_by_name = True
        if self._coordinator is not None:
            await self._register()
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        self._started = True
        return self._info

    async def close(self) -> None:
        """Deregister, fail whatever still waits, release transports and memory."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for task in list(self._background):
            task.cancel()
        if self._coordinator is not None and self._info is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.settings.notify_timeout_s):
                    await self._coordinator.deregister.remote(
                        self.engine_id, self.incarnation, self._registrant_secret
                    )
        for request_id, expectation in list(self._pending.items()):
            if not expectation.future.done():
                expectation.future.set_exception(
                    KvrayError(f"agent {self.engine_id!r} closed while {request_id!r} waited for KV")
                )
        self._pending.clear()
        for transport in self._transports.values():
            await transport.close()
        self._transports.clear()
        for claims in self._claims.values():
            claims.close()
        self._claims.clear()
        if self._board is not None:
            self._board.dispose()
        if self._inbox is not None:
            self._inbox.close()
        if self._outbox is not None:
            self._outbox.close()
        self.backing.close()

    #: Proves to the coordinator that this agent registered its engine entry (only the holder
    #: may replace or remove it); sent to the coordinator alone, never published.
    _registrant_secret = b""

    async def _register(self) -> None:
        if not self._registrant_secret:
            self._registrant_secret = secrets.token_bytes(32)
        # A coordinator that was just created is a fresh process still starting: allow it as long
        # as a lookup may wait.
        try:
            async with asyncio.timeout(self.settings.lookup_timeout_s):
                self._epoch = await self._coordinator.register.remote(
                    encode(self.info), _current_actor(), self._registrant_secret
                )
        except TimeoutError as error:
            raise MetadataError(
                f"the coordinator did not answer the registration of {self.engine_id!r} within "
                f"{self.settings.lookup_timeout_s} s",
                engine_id=self.engine_id,
            ) from error

    async def _beat(self) -> None:
        """Re-register whenever the coordinator no longer knows this incarnation (it restarted)."""
        while not self._closed.is_set():
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                async with asyncio.timeout(self.settings.heartbeat_s * 5):
                    epoch = await self._coordinator.heartbeat.remote(
                        self.engine_id, self.incarnation, self._registrant_secret
                    )
                    if epoch is None:
                        await self._register()
                        self.stats["reregistered"] += 1
                        for engine_id in list(self._peers):
                            self.forget_peer(engine_id)
                    elif self._peers:
                        await self._forget_departed()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # coordinator restarting: try again next beat
                self.stats["heartbeat_failed"] += 1
                if self._coordinator_by_name and _actor_died(error):
                    # Gone for good (killed, or it died with its owner): find or create its
                    # successor by name; the next beat registers this engine there.
                    with contextlib.suppress(Exception):
                        from kvray.coordinator import get_or_create_coordinator

                        self._coordinator = get_or_create_coordinator(self.settings)
                        self.stats["coordinator_replaced"] += 1

    async def _forget_departed(self) -> None:
        """Forget the cached peers whose incarnation the coordinator no longer lists (they closed,
        died or restarted): their mappings, handles and connections hold memory until then."""
        known = [(engine_id, peer.info.incarnation) for engine_id, peer in self._peers.items()]
        for engine_id, incarnation in await self._coordinator.departed.remote(known):
            peer = self._peers.get(engine_id)
            if peer is not None and peer.info.incarnation == incarnation:  # not looked up anew since
                self.forget_peer(engine_id)
                self.stats["peers_departed"] += 1

    # ---- peers ------------------------------------------------------------------------

    def add_peer(self, info: EngineInfo, host: Any = None) -> None:
        """Wire a peer by hand (no coordinator): its info and the object hosting its agent."""
        self._remember_peer(Peer(info, host))

    async def peer(self, engine_id: str, *, wait_s: float | None = None) -> Peer:
        """The engine's published info and host: cached, else asked of the coordinator, which
        waits up to `wait_s` (default `lookup_timeout_s`) for the engine to register."""
        peer = self._peers.get(engine_id)
        if peer is not None:
            self._peers.move_to_end(engine_id)
            return peer
        if self._coordinator is None:
            raise UnknownEngineError(
                f"engine {engine_id!r} is unknown to agent {self.engine_id!r} and there is no "
                "coordinator to ask (start Ray, or add_peer() it)",
                engine_id=engine_id,
            )
        wait = self.settings.deadline(wait_s, self.settings.lookup_timeout_s, "wait_s", allow_zero=True)
        # The coordinator bounds its own wait; this bounds a coordinator that does not answer.
        bound = wait + self.settings.notify_timeout_s
        try:
            async with asyncio.timeout(bound):
                info_bytes, host = await self._coordinator.lookup.remote(engine_id, wait)
        except KvrayError:
            raise
        except TimeoutError as error:
            raise MetadataError(
                f"the coordinator did not answer a lookup of engine {engine_id!r} within {bound} s",
                engine_id=engine_id,
            ) from error
        except Exception as error:  # a dead or restarting coordinator
            raise MetadataError(
                f"cannot look engine {engine_id!r} up: the coordinator is unreachable "
                f"({type(error).__name__})",
                engine_id=engine_id,
            ) from error
        peer = Peer(decode_engine_info(info_bytes), host)
        self._remember_peer(peer)
        return peer

    def _remember_peer(self, peer: Peer) -> None:
        """Cache a peer; past `max_cached_peers`, the least recently used one is forgotten."""
        engine_id = peer.info.engine_id
        if self._peers.get(engine_id) not in (None, peer):
            self.forget_peer(engine_id)  # replaced: what was opened for the old info goes with it
        self._peers[engine_id] = peer
        self._peers.move_to_end(engine_id)
        while len(self._peers) > self.settings.max_cached_peers:
            self.forget_peer(next(iter(self._peers)))

    def forget_peer(self, engine_id: str) -> None:
        """Drop everything cached for a peer (its info, offsets, mappings, connections); a
        write still in flight keeps what it uses until it ends."""
        self._peers.pop(engine_id, None)
        self._cache.forget(engine_id)
        for key in [key for key in self._claims if key[0] == engine_id]:
            self._claims.pop(key).close()
        for transport in self._transports.values():
            transport.forget(engine_id)

    def _transport(self, kind: TransportKind) -> Transport:
        transport = self._transports.get(kind)
        if transport is None:
            transport = open_transport(kind, self.settings)
            self._transports[kind] = transport
        return transport

    def choose_transport(self, peer: Peer) -> TransportKind:
        """`auto`: on one node, cuda_ipc between GPU backings and shm into a shared-memory
        backing; across nodes, verbs where both ends have an RDMA device; ray otherwise."""
        if self.settings.transport != "auto":
            return TransportKind(self.settings.transport)
        same_node = peer.info.node_id == self.node_id
        kinds = {region.transport for region in peer.info.regions}
        handles = all(region.handle for region in peer.info.regions)
        if same_node and handles and kinds == {TransportKind.CUDA_IPC}:
            if self.backing.kind is MemoryKind.CUDA:
                return TransportKind.CUDA_IPC
        elif (
            same_node
            and handles
            and kinds == {TransportKind.SHM}
            and self.backing.kind is not MemoryKind.CUDA
        ):
            return TransportKind.SHM
        verbs = transport_class(TransportKind.VERBS)
        if not same_node and peer.info.verbs is not None and verbs.unavailable_reason(self.settings) is None:
            return TransportKind.VERBS
        return TransportKind.RAY

    # ---- prefill side -----------------------------------------------------------------

    async def push(
        self,
        reservation: Reservation,
        local_blocks: Blocks,
        layers: Sequence[str] | None = None,
        *,
        timeout: float | None = None,
    ) -> PushResult:
        """Write the request's blocks into the blocks the decode engine reserved for it
        (`reservation`, from its `expect`), then tell it they are there."""
        request_id = reservation.request_id
        async with self._transfer(reservation, timeout, call=PushCall.WHOLE) as attempt:
            started = time.perf_counter()
            peer, transport, plan = await self._plan(attempt, local_blocks, _ids(reservation), layers)
            transfer_id = attempt.transfer_id = self._next_transfer_id(request_id)
            notice = TransferDone(
                transfer_id=transfer_id,
                request_id=request_id,
                src_engine=self.engine_id,
                src_incarnation=self.incarnation,
                dst_engine=peer.info.engine_id,
                dst_incarnation=peer.info.incarnation,
                nbytes=plan.nbytes,
                immediates=int(transport.kind is TransportKind.VERBS),
                token=reservation.token,
            )
            try:
                async with self._claim(peer, reservation, transport.kind):
                    early = self._early_notice(peer, notice)
                    await self._write(reservation, peer, transport, plan, then=early)
                    if early is None or not early.sent:
                        await self._send(peer, notice)
            finally:
                self._remote_claims.discard((request_id, reservation.token))
            self.stats["pushes_ok"] += 1
            self.stats["bytes_pushed"] += plan.nbytes
            self.metrics.bytes_pushed(transport.kind.value, peer.info.engine_id, plan.nbytes)
            return PushResult(
                request_id,
                transfer_id,
                peer.info.engine_id,
                peer.info.incarnation,
                transport.kind,
                plan.nbytes,
                len(plan.ops),
                len(plan.unmerged),
                time.perf_counter() - started,
            )

    async def push_layer(
        self,
        reservation: Reservation,
        layer: str,
        local_blocks: Blocks,
        *,
        timeout: float | None = None,
    ) -> int:
        """Write one layer of a request now (as prefill produces it); `finish` completes it.

        Once one layer of a request has failed, its later layers are refused (the decode side
        has been told and may have freed the blocks): `finish` or `abort` the request."""
        request_id = reservation.request_id
        remote_engine = reservation.engine_id
        async with self._transfer(reservation, timeout, call=PushCall.LAYER) as attempt:
            started = time.perf_counter()
            state = self._layerwise.get(request_id)
            if state is not None and state.reservation != reservation:
                raise PlanError(
                    f"request {request_id!r} is being pushed layer-wise into {state.reservation.engine_id!r} "
                    f"incarnation {state.reservation.incarnation} under another reservation; finish or "
                    "abort it first",
                    request_id=request_id,
                    engine_id=remote_engine,
                )
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
            elif state.reservation != reservation:
                raise PlanError(
                    f"request {request_id!r} is being pushed layer-wise under another reservation",
                    request_id=request_id,
                    engine_id=remote_engine,
                )
            attempt.transfer_id = state.transfer_id
            if layer in state.layers:
                raise PlanError(f"layer {layer!r} of {request_id!r} was already pushed", layer=layer)
            failed = self._failed_layerwise.get(request_id)
            if failed is not None:
                # A PlanError: the peer is fine, the request is not (finish or abort it).
                raise PlanError(
                    f"request {request_id!r} already failed ({failed}); its layers are no longer written",
                    request_id=request_id,
                    engine_id=remote_engine,
                )
            # From here to the write's start nothing awaits but the claim: a failure recorded
            # meanwhile is seen by the failure notice, which waits for this write to end.
            state.writing += 1
            state.idle.clear()
            try:
                async with self._claim(peer, reservation, transport.kind):
                    await self._write(reservation, peer, transport, plan)
            finally:
                state.writing -= 1
                if state.writing == 0:
                    state.idle.set()
            state.layers.add(layer)
            state.immediates += int(transport.kind is TransportKind.VERBS)
            state.nbytes += plan.nbytes
            state.ops += len(plan.ops)
            state.unmerged_ops += len(plan.unmerged)
            state.busy_s += time.perf_counter() - started
            self.stats["bytes_pushed"] += plan.nbytes
            self.metrics.bytes_pushed(transport.kind.value, peer.info.engine_id, plan.nbytes)
            return plan.nbytes

    async def finish(self, request_id: str, *, timeout: float | None = None) -> PushResult:
        """Complete a layer-wise push: the decode side's `wait_for_kv` resolves."""
        state = self._layerwise.pop(request_id, None)
        failed = self._failed_layerwise.pop(request_id, None)
        if failed is not None:
            raise WriteFailedError(
                f"layer-wise push of {request_id!r} failed: {failed}", request_id=request_id
            )
        if state is None:
            raise PlanError(f"request {request_id!r} has no layer-wise push to finish", request_id=request_id)
        reservation = state.reservation
        async with self._transfer(reservation, timeout, call=PushCall.FINISH) as attempt:
            attempt.transfer_id = state.transfer_id
            attempt.transport = state.transport
            attempt.started = state.started
            started = time.perf_counter()
            peer = await self.peer(reservation.engine_id)
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
            missing = sorted(set(self.layout.layer_names) - state.layers)
            if missing:
                self.stats["layerwise_partial"] += 1
            notice = TransferDone(
                transfer_id=state.transfer_id,
                request_id=request_id,
                src_engine=self.engine_id,
                src_incarnation=self.incarnation,
                dst_engine=reservation.engine_id,
                dst_incarnation=reservation.incarnation,
                nbytes=state.nbytes,
                immediates=state.immediates,
                token=reservation.token,
            )
            # Under the claim: a request its decode engine stopped expecting is not reported done.
            try:
                async with self._claim(peer, reservation):
                    await self._send(peer, notice)
            finally:
                self._remote_claims.discard((request_id, reservation.token))
            self.stats["pushes_ok"] += 1
            return PushResult(
                request_id,
                state.transfer_id,
                reservation.engine_id,
                reservation.incarnation,
                state.transport,
                state.nbytes,
                state.ops,
                state.unmerged_ops,
                state.busy_s + time.perf_counter() - started,
            )

    async def abort(self, reservation: Reservation, reason: str) -> None:
        """Tell the decode side a request's KV will not come (best effort, bounded).

        The notice names the incarnation the request's blocks belong to; an engine that has
        since restarted is not told about its old life. It never waits for an engine to register."""
        request_id = reservation.request_id
        state = self._layerwise.pop(request_id, None)
        self._failed_layerwise.pop(request_id, None)
        self._remote_claims.discard((request_id, reservation.token))
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.notify_timeout_s):
                peer = await self.peer(reservation.engine_id, wait_s=0.0)
            if peer.info.incarnation != reservation.incarnation:
                self.stats["failure_notices_stale"] += 1
                return
            transfer_id = state.transfer_id if state else self._next_transfer_id(request_id)
            await self._notify_failure(peer, reservation, transfer_id, reason, state)

    def _abort_soon(self, attempt: _Attempt, reason: str) -> None:
        """`abort` for a push that failed, in the background, so the caller's error is not held
        up by a peer that does not answer (the notice has its own deadline)."""
        state = self._layerwise.get(attempt.request_id)
        if attempt.layerwise or state is not None:
            self._failed_layerwise.setdefault(attempt.request_id, reason)
        peer = attempt.peer
        reservation = attempt.reservation
        if peer is None or reservation is None or self._closed.is_set():
            return
        transfer_id = attempt.transfer_id or (
            state.transfer_id if state is not None else self._next_transfer_id(attempt.request_id)
        )
        task = asyncio.get_running_loop().create_task(
            self._notify_failure(peer, reservation, transfer_id, reason, state)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _notify_failure(
        self, peer: Peer, reservation: Reservation, transfer_id: str, reason: str, state: _Layerwise | None
    ) -> None:
        """Send `TransferFailed` once no layer of the request is still being written: the peer
        frees the blocks when it reads it, so no byte may arrive after."""
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                if state is not None:
                    await state.idle.wait()
            await self._send(
                peer,
                TransferFailed(
                    transfer_id=transfer_id,
                    request_id=reservation.request_id,
                    src_engine=self.engine_id,
                    src_incarnation=self.incarnation,
                    dst_engine=peer.info.engine_id,
                    dst_incarnation=peer.info.incarnation,
                    reason=reason,
                    token=reservation.token,
                ),
            )
            self.stats["failure_notices_sent"] += 1
        except Exception:  # best effort: a peer that is gone has nobody waiting
            self.stats["failure_notices_lost"] += 1

    @contextlib.asynccontextmanager
    async def _transfer(
        self, reservation: Reservation, timeout: float | None, *, call: PushCall
    ) -> AsyncIterator[_Attempt]:
        """A bounded slot and a deadline for one transfer; failures are kvray errors, and once
        the peer is known it is told (in the background) so it does not wait for its deadline.
        Every call that gets this far is counted once in the metrics, by outcome."""
        if not self.started:
            raise KvrayError(f"agent {self.engine_id!r} is not running; await agent.start() first")
        if not isinstance(reservation, Reservation):
            raise PlanError(
                f"push into a decode engine's Reservation (what its expect() returned), not "
                f"{type(reservation).__name__}"
            )
        request_id = reservation.request_id
        remote_engine = reservation.engine_id
        if self._waiting >= self.settings.max_queued_transfers:
            self.stats["rejected_backpressure"] += 1
            self.metrics.transfer(call, Outcome.REJECTED, NO_TRANSPORT, remote_engine)
            raise BackpressureError(
                f"agent {self.engine_id!r} already has {self._waiting} transfers waiting "
                f"(max_queued_transfers={self.settings.max_queued_transfers})",
                request_id=request_id,
            )
        deadline = self.settings.deadline(timeout, self.settings.transfer_timeout_s, "timeout")
        attempt = _Attempt(request_id, reservation, call is PushCall.LAYER, started=time.perf_counter())
        outcome = Outcome.FAILED
        try:
            async with asyncio.timeout(deadline):
                self._waiting += 1
                try:
                    await self._slots.acquire()
                finally:
                    self._waiting -= 1
                try:
                    yield attempt
                except TransportError as error:
                    await self._raise_if_restarted(attempt, error)
                    raise
                finally:
                    self._slots.release()
            outcome = Outcome.OK
        except KvrayError as error:
            if isinstance(error, TransferTimeoutError):
                outcome = Outcome.TIMED_OUT
            self.stats["pushes_failed"] += 1
            if isinstance(error, TransportError | MetadataError) and not isinstance(error, NotExpectedError):
                self.forget_peer(remote_engine)
            self._abort_soon(attempt, f"{type(error).__name__}: {error}")
            raise
        except TimeoutError as error:
            outcome = Outcome.TIMED_OUT
            self.stats["pushes_timed_out"] += 1
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
            self.stats["pushes_failed"] += 1
            self.forget_peer(remote_engine)
            self._abort_soon(attempt, f"{type(error).__name__}: {error}")
            raise WriteFailedError(
                f"transfer of {request_id!r} to {remote_engine!r} failed: {type(error).__name__}: {error}",
                request_id=request_id,
                engine_id=remote_engine,
            ) from error
        finally:
            transport = attempt.transport.value if attempt.transport is not None else NO_TRANSPORT
            seconds = time.perf_counter() - attempt.started
            self.metrics.transfer(call, outcome, transport, remote_engine, seconds)

    async def _raise_if_restarted(self, attempt: _Attempt, error: TransportError) -> None:
        """After a transport failure, ask the directory whether the peer has a new incarnation
        by now: then the push was aimed at a life that is over, and that is the error to report."""
        peer = attempt.peer
        if peer is None or self._coordinator is None or isinstance(error, BackpressureError):
            return
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await self._coordinator.check.remote(peer.info.engine_id, peer.info.incarnation)
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
        assert reservation is not None
        remote_engine = reservation.engine_id
        remote_incarnation = reservation.incarnation
        peer = await self.peer(remote_engine)
        if peer.info.incarnation != remote_incarnation:
            # Our directory entry may be old: look again before refusing.
            self.forget_peer(remote_engine)
            peer = await self.peer(remote_engine)
            if peer.info.incarnation != remote_incarnation:
                raise StaleIncarnationError(
                    f"engine {remote_engine!r} is incarnation {peer.info.incarnation}, but the blocks "
                    f"were reserved in incarnation {remote_incarnation}",
                    engine_id=remote_engine,
                    incarnation=peer.info.incarnation,
                    stale_incarnation=remote_incarnation,
                )
        if peer.info.role is not Role.DECODE or not all(r.remote_writable for r in peer.info.regions):
            raise MetadataError(
                f"engine {remote_engine!r} ({peer.info.role.value}) exposes no writable region; "
                "push into decode engines only",
                engine_id=remote_engine,
            )
        attempt.peer = peer
        plan = plan_transfer(self.info, peer.info, local_blocks, remote_ids, layers, self._cache)
        transport = self._transport(self.choose_transport(peer))
        attempt.transport = transport.kind
        return peer, transport, plan

    @contextlib.asynccontextmanager
    async def _claim(
        self, peer: Peer, reservation: Reservation, kind: TransportKind | None = None
    ) -> AsyncIterator[None]:
        """Make sure the decode engine still expects the request, and keeps its blocks, while
        the body writes and notifies; a request it no longer expects is refused before a byte
        moves. On its node: hold the request's slot in its claim board (see `kvray.claims`).
        Over `verbs`: ask it once per request to hold the blocks until this writer's notice.
        Over `ray` its receiver checks each write itself."""
        path = peer.info.endpoints.get(CLAIMS_ENDPOINT)
        if not path or peer.info.node_id != self.node_id:
            if kind is TransportKind.VERBS:
                await self._claim_remote(peer, reservation)
            yield
            return
        key = (peer.info.engine_id, peer.info.incarnation)
        claims = self._claims.get(key)
        if claims is None:
            self._check_board_path(peer, path)
            claims = self._claims[key] = ClaimClient(path, peer.info.engine_id)
        async with claims.hold(
            reservation.request_id, reservation.slot, reservation.token, self.settings.notify_timeout_s
        ):
            yield

    def _check_board_path(self, peer: Peer, path: str) -> None:
        """A peer's claim board must sit in its completion inbox's folder, which the outbox
        checks is a private kvray folder of this user in the shared-memory folder."""
        inbox = peer.info.endpoints.get(COMPLETION_ENDPOINT, "")
        if not inbox or path != os.path.join(os.path.dirname(inbox), BOARD_NAME):
            raise MetadataError(
                f"engine {peer.info.engine_id!r} publishes its claim board at {path!r}, not beside its "
                "completion inbox; kvray opens only the boards it creates",
                engine_id=peer.info.engine_id,
                path=path,
            )
        self._outbox_here().check_inbox(inbox)

    def _outbox_here(self) -> CompletionOutbox:
        if self._outbox is None:
            self._outbox = CompletionOutbox(self.settings.shm_dir)
        return self._outbox

    async def _claim_remote(self, peer: Peer, reservation: Reservation) -> None:
        key = (reservation.request_id, reservation.token)
        if key in self._remote_claims:
            return
        claim = WriteClaim(
            request_id=reservation.request_id,
            token=reservation.token,
            src_engine=self.engine_id,
            src_incarnation=self.incarnation,
            dst_engine=reservation.engine_id,
            dst_incarnation=reservation.incarnation,
        )
        await self._call_host(peer, f"the claim of {reservation.request_id!r}", "kvray_claim", encode(claim))
        self._remote_claims.add(key)

    async def _call_host(self, peer: Peer, what: str, method: str, message: bytes) -> None:
        """One call to the actor hosting a peer's agent, within `notify_timeout_s`: a kvray error
        the peer raised comes back as itself, a timeout as `TransferTimeoutError`, anything
        else (its actor died) as `TransportError`."""
        if peer.host is None:
            raise TransportError(
                f"engine {peer.info.engine_id!r} has no host to send {what} to; its agent must run in "
                "an AgentHost actor (or be added with a host)",
                engine_id=peer.info.engine_id,
            )
        try:
            async with self._notify_deadline(peer, what):
                await getattr(peer.host, method).remote(message)
        except KvrayError:
            raise
        except Exception as error:  # e.g. the peer's actor died
            cause = getattr(error, "cause", None)
            if isinstance(cause, KvrayError):
                raise cause from error
            raise TransportError(
                f"could not send {what} to engine {peer.info.engine_id!r}: {type(error).__name__}",
                engine_id=peer.info.engine_id,
            ) from error

    async def _write(
        self,
        reservation: Reservation,
        peer: Peer,
        transport: Transport,
        plan: TransferPlan,
        then: Callable[[], None] | None = None,
    ) -> None:
        # The request id and token travel with `ray`-transport writes: the receiver takes
        # writes only for requests it still expects, from the holder of their reservation.
        plan = replace(plan, request_id=reservation.request_id, token=reservation.token)
        if then is None:
            await transport.write(plan, self.backing, peer)
        else:
            await transport.write_then(plan, self.backing, peer, then)

    def _early_notice(self, peer: Peer, notice: TransferDone) -> DatagramNotice | None:
        """A completion notice the transport may send from its copy thread the moment the last
        byte lands (same node, through the peer's inbox; see `Transport.write_then`)."""
        inbox = self._inbox_here(peer)
        if inbox is None:
            return None
        return DatagramNotice(self._outbox_here(), inbox, encode(notice))

    @contextlib.asynccontextmanager
    async def _notify_deadline(self, peer: Peer, what: str) -> AsyncIterator[None]:
        """`notify_timeout_s` for one message to a peer; passing it is `TransferTimeoutError`."""
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                yield
        except TimeoutError as error:
            if isinstance(error, KvrayError):  # the peer's own timeout, already worded
                raise
            raise TransferTimeoutError(
                f"engine {peer.info.engine_id!r} did not take {what} within "
                f"{self.settings.notify_timeout_s} s",
                engine_id=peer.info.engine_id,
                timeout_s=self.settings.notify_timeout_s,
            ) from error

    def _inbox_here(self, peer: Peer) -> str | None:
        """The peer's completion inbox, when it is on this node (else notices go through Ray)."""
        inbox = peer.info.endpoints.get(COMPLETION_ENDPOINT)
        return inbox if inbox and peer.info.node_id == self.node_id else None

    async def _send(self, peer: Peer, message: TransferDone | TransferFailed) -> None:
        what = f"a {type(message).__name__} notice"
        inbox = self._inbox_here(peer)
        if inbox is None:
            await self._call_host(peer, what, "kvray_notify", encode(message))
            return
        async with self._notify_deadline(peer, what):
            try:
                await self._outbox_here().send(inbox, encode(message))
            except TransportError as error:
                raise TransportError(
                    f"could not notify engine {peer.info.engine_id!r}: {error}",
                    engine_id=peer.info.engine_id,
                    path=inbox,
                ) from error

    def _next_transfer_id(self, request_id: str) -> str:
        self._transfer_count += 1
        return f"{request_id}@{self.engine_id}:{self.incarnation:x}:{self._transfer_count}"

    # ---- decode side ------------------------------------------------------------------

    def expect(self, request_id: str, blocks: Blocks) -> Reservation:
        """The request's blocks are reserved here and its KV may come: a `Reservation` to hand
        to the writer (it names this engine incarnation, the blocks and a fresh secret token)."""
        if self.role is not Role.DECODE:
            raise PlanError(f"engine {self.engine_id!r} is not a decode engine and expects no KV")
        if not self.started:
            raise KvrayError(f"agent {self.engine_id!r} is not running; await agent.start() first")
        if request_id in self._pending:
            raise PlanError(f"request {request_id!r} is already expected", request_id=request_id)
        ids = block_ids(blocks, self.layout.num_blocks, "decode", self.engine_id)
        token = secrets.randbits(62) or 1
        slot = self._board.open(token) if self._board is not None else -1
        rdma = self._rdma()
        if rdma is not None:
            rdma.expect_transfer(self.engine_id, self.incarnation, request_id)
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Expectation(future, token, slot, ids)
        return Reservation(
            request_id=request_id,
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            blocks=tuple(ids.tolist()),
            token=token,
            slot=max(slot, 0),
        )

    async def release(self, request_id: str) -> None:
        """Stop expecting a request, and return once no write for it can still land: its
        blocks may then go back to the pool. A late completion for it is dropped and counted.

        Raises `TransferTimeoutError` if a writer still holds the request's claim after
        `transfer_timeout_s` (a writer's own deadline): the blocks must then stay out of the
        pool; the agent lists the request in `quarantined` and keeps trying in the background."""
        expectation = self._pending.pop(request_id, None)
        if expectation is None:
            return
        if not expectation.future.done():
            expectation.future.cancel()
        # A claiming writer's notice may still come: it ends the claim (see `_receive`).
        self._releasing[request_id] = expectation
        try:
            await self._end_writes(request_id, expectation)
        finally:
            if self._releasing.get(request_id) is expectation:
                del self._releasing[request_id]

    async def _end_writes(self, request_id: str, expectation: _Expectation) -> None:
        await self._wait_writes_end(request_id)
        if await self._writes_ended(request_id, expectation):
            return
        self.quarantined[request_id] = asyncio.Event()
        self.stats["releases_quarantined"] += 1
        task = asyncio.get_running_loop().create_task(self._release_later(request_id, expectation))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        raise TransferTimeoutError(
            f"a writer still holds request {request_id!r} at {self.engine_id!r} after "
            f"{self.settings.transfer_timeout_s} s; its blocks must stay out of the pool",
            request_id=request_id,
            engine_id=self.engine_id,
            timeout_s=self.settings.transfer_timeout_s,
        )

    async def _writes_ended(self, request_id: str, expectation: _Expectation) -> bool:
        """True once no write for the request can land: a writer on another node that claimed
        it is done, and its slot in the claim board is closed (each awaited up to
        `transfer_timeout_s`)."""
        if not await self._remote_writer_done(expectation):
            return False
        board = self._board
        if (
            expectation.slot >= 0
            and board is not None
            and not await board.close(expectation.slot, self.settings.transfer_timeout_s)
        ):
            return False
        self._forget_rdma(request_id)
        return True

    async def _remote_writer_done(self, expectation: _Expectation) -> bool:
        """True once a writer on another node that claimed the request has sent its notice, or
        has left the directory (its process died: no write of it can still be issued)."""
        if expectation.writer is None or expectation.writer_done.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.transfer_timeout_s):
                await expectation.writer_done.wait()
                return True
        engine_id, incarnation = expectation.writer
        if self._coordinator is None:
            return False
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await self._coordinator.check.remote(engine_id, incarnation)
        except KvrayError:
            return True  # gone or restarted: that life issues no more writes
        except Exception:
            return False
        return False

    async def _release_later(self, request_id: str, expectation: _Expectation) -> None:
        self._releasing[request_id] = expectation
        while not self._closed.is_set():
            if await self._writes_ended(request_id, expectation):
                self._releasing.pop(request_id, None)
                self.quarantined.pop(request_id).set()
                return

    def cancel(self, request_id: str) -> None:
        """Stop expecting a request now (its wait ends with a kvray error); `release` it before
        its blocks go back to the pool."""
        expectation = self._pending.get(request_id)
        if expectation is not None and not expectation.future.done():
            expectation.future.cancel()

    def _rdma(self) -> VerbsTransport | None:
        """This decode engine's `verbs` transport, when it published an RDMA port."""
        transport = self._transports.get(TransportKind.VERBS)
        if self._info is None or self._info.verbs is None or transport is None:
            return None
        return cast("VerbsTransport", transport)

    def _forget_rdma(self, request_id: str) -> None:
        rdma = self._rdma()
        if rdma is not None:
            rdma.cancel_transfer(self.engine_id, self.incarnation, request_id)

    async def _wait_writes_end(self, request_id: str) -> None:
        """Until no `ray`-transport write admitted for the request is still being scattered."""
        if self._writing[request_id]:
            async with self._writes_done:
                await self._writes_done.wait_for(lambda: not self._writing[request_id])

    async def wait_for_kv(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait until the request's KV is written (or failed, or the deadline passes).

        However the wait ends, the request stays reserved until `release(request_id)`, which
        returns once no write for it can land any more."""
        expectation = self._pending.get(request_id)
        if expectation is None:
            raise PlanError(
                f"request {request_id!r} is not expected at {self.engine_id!r}; expect() it first",
                request_id=request_id,
                engine_id=self.engine_id,
            )
        future = expectation.future
        deadline = self.settings.deadline(timeout, self.settings.transfer_timeout_s, "timeout")
        started = time.perf_counter()
        outcome = Outcome.FAILED
        try:
            # The future itself, not a shield around it: a shield puts one more hop through the
            # loop between the completion and this task, behind whatever the completion queued
            # (a metric write). A timed-out or cancelled wait cancels the future: the request is
            # no longer expected, and later writes for it are refused.
            async with asyncio.timeout(deadline):
                completion = await future
            outcome = Outcome.OK
            return completion
        except TimeoutError:
            outcome = Outcome.TIMED_OUT
            self.stats["waits_timed_out"] += 1
            raise TransferTimeoutError(
                f"KV for request {request_id!r} did not arrive at {self.engine_id!r} within {deadline} s",
                request_id=request_id,
                engine_id=self.engine_id,
                timeout_s=deadline,
            ) from None
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED
            task = asyncio.current_task()
            if future.cancelled() and (task is None or not task.cancelling()):
                # `cancel` or `release` (the request is over), not a cancelled caller.
                raise KvrayError(
                    f"request {request_id!r} was cancelled at {self.engine_id!r} while waiting for its KV",
                    request_id=request_id,
                    engine_id=self.engine_id,
                ) from None
            raise
        finally:
            # Recorded just after the caller resumes: a metric write costs tens of microseconds
            # under Ray, on the path from the completion to the decode side's next step.
            asyncio.get_running_loop().call_soon(self.metrics.wait, outcome, time.perf_counter() - started)
            if not future.done():
                future.cancel()

    async def deliver(self, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        """A `ray`-transport write arriving: check it names this engine incarnation, a request
        it still expects and that request's token, and that every op lies inside its region and
        inside the request's blocks; then scatter."""
        if self.role is not Role.DECODE:
            raise MetadataError(f"engine {self.engine_id!r} is not a decode engine and takes no writes")
        message = read_header(header, self.engine_id, self.incarnation)
        request_id = message.request_id
        expectation = self._pending.get(request_id)
        if expectation is None or expectation.future.done():
            # Its wait ended (done, failed, timed out) or it was never reserved: its blocks may
            # belong to another request by now.
            raise self._counted(
                DropReason.UNEXPECTED_WRITE,
                "writes_refused_unexpected",
                NotExpectedError(
                    f"engine {self.engine_id!r} does not expect KV for request {request_id!r} (never "
                    "reserved, or its wait has ended); nothing was written",
                    request_id=request_id,
                    engine_id=self.engine_id,
                ),
            )
        if message.token != expectation.token:
            raise self._counted(
                DropReason.FORGED,
                "writes_refused_forged",
                NotExpectedError(
                    f"a write for request {request_id!r} did not carry its reservation's token; "
                    "nothing was written",
                    request_id=request_id,
                    engine_id=self.engine_id,
                ),
            )
        self._writing[request_id] += 1
        try:
            written = await apply_ops(
                self.backing, self.engine_id, message, payload, within=self._spans(request_id, expectation)
            )
        finally:
            self._writing[request_id] -= 1
            if not self._writing[request_id]:
                del self._writing[request_id]
                async with self._writes_done:
                    self._writes_done.notify_all()
        self.stats["bytes_received"] += written
        return written

    def _spans(
        self, request_id: str, expectation: _Expectation
    ) -> Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]], None]:
        """A check that a write's ops stay inside the request's blocks (spans built once)."""

        def check(
            regions: npt.NDArray[np.int64], offsets: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
        ) -> None:
            if expectation.spans is None:
                rows = self._cache.rows(self.info, self.layout.layer_names)
                expectation.spans = request_spans(rows, expectation.blocks)
            check_ops_within(
                expectation.spans, regions, offsets, nbytes, request_id=request_id, engine_id=self.engine_id
            )

        return check

    async def claim(self, message_bytes: bytes) -> None:
        """A writer on another node claims a request before its first one-sided write of it
        (`verbs`): refused unless the request is expected under the claim's token; the request's
        blocks are then kept (see `release`) until the writer's notice arrives."""
        try:
            claim = decode_write_claim(message_bytes)
        except WireDecodeError:
            self.stats["messages_malformed"] += 1
            self.metrics.dropped(DropReason.MALFORMED)
            raise
        if claim.dst_engine != self.engine_id or claim.dst_incarnation != self.incarnation:
            raise self._misaddressed("claim", claim.dst_engine, claim.dst_incarnation)
        expectation = self._pending.get(claim.request_id)
        if expectation is None or expectation.future.done() or expectation.token != claim.token:
            self.stats["claims_refused"] += 1
            raise NotExpectedError(
                f"engine {self.engine_id!r} does not expect request {claim.request_id!r} under this "
                "reservation; nothing may be written",
                request_id=claim.request_id,
                engine_id=self.engine_id,
            )
        writer = (claim.src_engine, claim.src_incarnation)
        if expectation.writer is not None and expectation.writer != writer:
            raise NotExpectedError(
                f"request {claim.request_id!r} is already claimed by {expectation.writer[0]!r}",
                request_id=claim.request_id,
                engine_id=self.engine_id,
            )
        expectation.writer = writer

    async def accept_connection(self, request: bytes) -> bytes:
        """A writer's RDMA connection request (`verbs`), answered by a queue pair of this engine
        if the writer is a registered prefill engine at the incarnation it claims."""
        from kvray.transport.verbs import VerbsTransport

        async def registered(engine_id: str, incarnation: int) -> EngineInfo:
            peer = await self.peer(engine_id, wait_s=0)
            if peer.info.incarnation != incarnation and self._coordinator is not None:
                self.forget_peer(engine_id)  # what is cached may be an older life of the writer
                peer = await self.peer(engine_id, wait_s=0)
            return peer.info

        transport = self._transport(TransportKind.VERBS)
        assert isinstance(transport, VerbsTransport)
        return await transport.accept(request, self.backing, self.info, registered)

    async def notify(self, message_bytes: bytes) -> None:
        """A completion or failure notice arriving through Ray (see `_receive`): one this engine
        does not take (malformed, stale, unknown request, wrong token) raises, so its sender
        learns the request was not completed."""
        self._receive(message_bytes, strict=True)

    def _misaddressed(self, what: str, engine_id: str, incarnation: int) -> StaleIncarnationError:
        return StaleIncarnationError(
            f"{what} for {engine_id!r} incarnation {incarnation} reached {self.engine_id!r} "
            f"incarnation {self.incarnation}",
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            stale_incarnation=incarnation,
        )

    def _counted(self, reason: DropReason, stat: str, error: KvrayError) -> KvrayError:
        """`error`, after counting what it refuses (in `stats` and the drop metric)."""
        self.stats[stat] += 1
        self.metrics.dropped(reason)
        return error

    def _drop(self, reason: DropReason, stat: str, strict: bool, error: KvrayError) -> None:
        self._counted(reason, stat, error)
        if strict:
            raise error

    def _receive(self, message_bytes: bytes, strict: bool = False) -> None:
        """A completion or failure notice; unknown, stale, forged or malformed ones are dropped
        and counted (`strict`: they also raise, for a caller that can be told)."""
        try:
            message = decode_message(message_bytes)
        except WireDecodeError as error:
            self._drop(DropReason.MALFORMED, "messages_malformed", strict, error)
            return
        if isinstance(message, WriteOps):
            self._drop(
                DropReason.MISROUTED,
                "messages_misrouted",
                strict,
                WireDecodeError("a write_ops header is not a notice", field="$.type"),
            )
            return
        if message.dst_engine != self.engine_id or message.dst_incarnation != self.incarnation:
            self._drop(
                DropReason.STALE,
                "completions_dropped_stale",
                strict,
                self._misaddressed("notice", message.dst_engine, message.dst_incarnation),
            )
            return
        expectation = self._pending.get(message.request_id)
        if expectation is None or expectation.future.done():
            ending = expectation or self._releasing.get(message.request_id)
            if ending is not None and ending.writer is not None and ending.token == message.token:
                # The claiming writer's last word (done or failed): its writes have ended.
                ending.writer_done.set()
            self._drop(
                DropReason.UNKNOWN,
                "completions_dropped_unknown",
                strict,
                NotExpectedError(
                    f"engine {self.engine_id!r} does not expect request {message.request_id!r} (never "
                    "reserved, or its wait has ended)",
                    request_id=message.request_id,
                    engine_id=self.engine_id,
                ),
            )
            return
        if message.token != expectation.token:
            self._drop(
                DropReason.FORGED,
                "completions_dropped_forged",
                strict,
                NotExpectedError(
                    f"a notice for request {message.request_id!r} did not carry its reservation's token",
                    request_id=message.request_id,
                    engine_id=self.engine_id,
                ),
            )
            return
        future = expectation.future
        if isinstance(message, TransferFailed) and expectation.writer is not None:
            expectation.writer_done.set()  # sent once its last write had stopped moving
        if isinstance(message, TransferDone) and message.immediates:
            # Over RDMA the notice can overtake the writes' own proof of arrival: complete once
            # the immediates have come too (wait_for_kv's deadline bounds the wait).
            task = asyncio.get_running_loop().create_task(
                self._complete_after_immediates(message, expectation)
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif isinstance(message, TransferDone):
            self._complete(message, future)
        else:
            self.stats["completions_failed"] += 1
            future.set_exception(
                WriteFailedError(
                    f"engine {message.src_engine!r} could not deliver {message.request_id!r}: "
                    f"{message.reason}",
                    request_id=message.request_id,
                    engine_id=message.src_engine,
                )
            )
            future.exception()  # retrieved here; wait_for_kv re-raises it

    def _complete(self, message: TransferDone, future: asyncio.Future[Completion]) -> None:
        self.stats["completions_ok"] += 1
        future.set_result(
            Completion(message.request_id, message.transfer_id, message.src_engine, message.nbytes)
        )
        # After the waiter's wake-up in the loop's queue (see `wait_for_kv`).
        asyncio.get_running_loop().call_soon(self.metrics.bytes_received, message.src_engine, message.nbytes)

    async def _complete_after_immediates(self, message: TransferDone, expectation: _Expectation) -> None:
        future = expectation.future
        rdma = self._rdma()
        try:
            if rdma is None:
                raise MetadataError(
                    f"engine {message.src_engine!r} wrote {message.request_id!r} over RDMA, but "
                    f"engine {self.engine_id!r} has no RDMA port",
                    request_id=message.request_id,
                    engine_id=self.engine_id,
                )
            await rdma.arrivals(
                self.engine_id,
                self.incarnation,
                message.request_id,
                src_engine=message.src_engine,
                src_incarnation=message.src_incarnation,
                count=message.immediates,
            )
        except asyncio.CancelledError:
            return  # the wait ended (deadline, cancel, close): its own path reports it
        except KvrayError as error:
            if not future.done():
                future.set_exception(error)
                future.exception()
            return
        # Every write posted before the last immediate has landed: the writer is done here.
        expectation.writer_done.set()
        if not future.done():
            self._complete(message, future)


class AgentHost:
    """Mix into a Ray actor class whose agent is `self.kvray_agent`: the calls peers and the
    coordinator make on it. Their methods are async, so the actor is an async actor."""

    kvray_agent: KVAgent

    async def kvray_deliver(self, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        return await self.kvray_agent.deliver(header, payload)

    async def kvray_notify(self, message: bytes) -> None:
        await self.kvray_agent.notify(message)

    async def kvray_connect(self, request: bytes) -> bytes:
        return await self.kvray_agent.accept_connection(request)

    async def kvray_claim(self, message: bytes) -> None:
        await self.kvray_agent.claim(message)

    async def kvray_watch(self) -> None:
        """Returns when the agent closes; fails (in the caller) when this actor dies."""
        await self.kvray_agent._closed.wait()
