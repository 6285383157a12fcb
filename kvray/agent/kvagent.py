"""The agent: one engine's kvray side (steps three to seven of the data flow), a facade over the
modules named for each step: `directory` (registration, peers), `transports` (which one writes
where), `push` (plan, write, notify), `kvray.notice` (claims and notices to a decode engine),
`receive` (expected requests, incoming writes and notices, `wait_for_kv`). Peers reach it
through a host (`kvray.host`)."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvray.agent.directory import Directory, directory_service
from kvray.agent.engine import Blocks, Engine, node_address, node_id
from kvray.agent.lane import DecodeLane, PrefillLane
from kvray.agent.lane import available as lane_available
from kvray.agent.push import Pusher, PushResult
from kvray.agent.receive import Completion, Receiving
from kvray.agent.transports import TransportSet
from kvray.config import Settings
from kvray.errors import MetadataError, NotExpectedError, PlanError
from kvray.integrity import PlacementTable
from kvray.layout import KVLayout
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.metrics import DropReason, EngineMetrics, MetricsSink
from kvray.notice import NoticeSet
from kvray.notice.base import Mailbox, NoticeChannel
from kvray.plan import OffsetCache
from kvray.transport import Peer, Transport
from kvray.wire import EngineInfo, Reservation, Role, TransportKind


class KVAgent:
    """One engine's kvray side: its backing, its published info, its transfers.

    It lives inside any Ray actor or Serve replica (or a plain process, wired by hand):

        agent = KVAgent("decode-0", Role.DECODE, layout)
        await agent.start()                              # register regions, publish EngineInfo
        reservation = agent.expect("req-1", blocks)      # decode: the request's blocks are reserved
        await prefill.push(reservation, local_blocks)    # prefill: plan + write + notify
        await agent.wait_for_kv("req-1", timeout=5)      # decode: the bytes are there
        await agent.release("req-1")                     # decode: no write of it can land now
        await agent.close()

    Layer-wise: `push_layer` per layer as the forward pass produces it, then `finish`; the
    decode side sees one completion. The actor hosting an agent mixes in `kvray.host.AgentHost`.

    Arguments: give a `layout` (kvray allocates the backing, in `memory`: shared memory for a
    decode engine, CPU memory for a prefill engine by default) or a `backing` of your own.
    `coordinator`: a Ray actor handle of `kvray.coordinator.Coordinator`, or any
    `DirectoryService`; by default the named one is found or created when Ray is up
    (`use_coordinator=False`: none; wire peers with `add_peer`). `transports`: transports to
    use instead of the registry's of the same kind, and before them (e.g.
    `kvray.transport.loopback.LoopbackTransport`); `notices`: notice channels to try before
    the registry's (e.g. `kvray.notice.loopback.LoopbackChannel`); the agent closes both when
    it closes.
    `offset_cache` may be shared between agents of one process; `metrics_sink` receives the
    agent's metrics (Ray's metrics API when Ray is up); `transport_hook` sees each transport
    the agent opens or is given, once, before its first use (`kvray.faults` corrupts writes
    through it).
    """

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
        transports: Sequence[Transport] = (),
        notices: Sequence[NoticeChannel] = (),
        transport_hook: Callable[[Transport], None] | None = None,
    ) -> None:
        if (layout is None) == (backing is None):
            raise PlanError("give a KVAgent either a layout (kvray allocates) or a backing, not both")
        settings = settings or Settings.from_env()
        if backing is None:
            assert layout is not None
            default = MemoryKind.SHM if role is Role.DECODE else MemoryKind.CPU
            backing = Backing.allocate(layout, memory or default, settings=settings)
        self._engine = Engine(
            engine_id,
            role,
            settings,
            backing,
            node_id(),
            EngineMetrics(engine_id, role.value, metrics_sink),
        )
        self._use_coordinator = use_coordinator
        self._cache = offset_cache if offset_cache is not None else OffsetCache()
        self._transports = TransportSet(
            settings, backing.kind, transports, self._engine.metrics, hook=transport_hook
        )
        self._notices = NoticeSet(settings, self._engine.metrics, notices)
        self._notices.node_id = self._engine.node_id
        # Its own figures: the agent's notice counters count completion notices alone.
        self._push_mail = NoticeSet(settings, mailbox=Mailbox.PUSH_REQUESTS)
        self._push_mail.node_id = self._engine.node_id
        service = directory_service(coordinator) if coordinator is not None else None
        self._directory = Directory(engine_id, settings, service, self._engine.metrics, self._forget)
        self._pusher = Pusher(self._engine, self._directory, self._notices, self._transports, self._cache)
        self._receiving = Receiving(
            self._engine, self._directory, self._transports, self._notices, self._cache
        )

    # ---- what it is -------------------------------------------------------------------

    @property
    def engine_id(self) -> str:
        return self._engine.engine_id

    @property
    def role(self) -> Role:
        return self._engine.role

    @property
    def settings(self) -> Settings:
        return self._engine.settings

    @property
    def backing(self) -> Backing:
        return self._engine.backing

    @property
    def layout(self) -> KVLayout:
        return self._engine.backing.layout

    @property
    def incarnation(self) -> int:
        return self._engine.incarnation

    @property
    def node_id(self) -> str:
        return self._engine.node_id

    @node_id.setter
    def node_id(self, value: str) -> None:
        """Where the engine says it runs (set before `start`; tests place engines on nodes)."""
        self._engine.node_id = value
        self._notices.node_id = value
        self._push_mail.node_id = value

    @property
    def stats(self) -> Counter[str]:
        """What the agent did and refused so far: every counter of its metrics, by
        `kvray.metrics.count_key` (`transfers_whole_ok`, `messages_dropped_stale`, ...; a copy)."""
        self._receiving.record_completions()
        return self._engine.metrics.counts

    @property
    def metrics(self) -> EngineMetrics:
        """Prometheus metrics (through Ray's metrics API when Ray is up; see kvray.metrics)."""
        return self._engine.metrics

    @property
    def info(self) -> EngineInfo:
        """What the engine published (`AgentNotRunningError` before `start`)."""
        return self._engine.info

    @property
    def started(self) -> bool:
        return self._engine.running

    @property
    def quarantined(self) -> dict[str, asyncio.Event]:
        """Requests this decode agent could not release yet (a writer still held their claim),
        each with an event set once it is released after all."""
        return self._receiving.quarantined

    @property
    def layerwise_requests(self) -> set[str]:
        """Requests with a layer-wise push begun and not yet finished or aborted."""
        return self._pusher.layerwise_requests

    @property
    def registrant_secret(self) -> bytes:
        """What proves to the coordinator that this agent registered its engine (only the holder
        may replace or remove the entry); never published."""
        return self._directory.secret

    # ---- life cycle -------------------------------------------------------------------

    async def start(self, *, endpoints: Mapping[str, str] | None = None) -> EngineInfo:
        """Take a fresh incarnation, register regions, publish this engine's info (with
        `endpoints`: channels of the embedding engine's own its peers need, e.g. an inbox)."""
        engine = self._engine
        if engine.published is not None:
            return engine.published
        engine.incarnation = secrets.randbits(62) or 1
        decode = engine.role is Role.DECODE
        regions = self._transports.registrar().register(
            engine.backing, engine.engine_id, engine.incarnation, remote_writable=decode
        )
        endpoints = dict(endpoints or {})
        receiving = self._receiving
        if decode:
            endpoints.update(await receiving.start())
        if self._push_requests is not None:
            mailbox = _PushRequestMailbox(
                engine.engine_id, engine.incarnation, node_address(), self._push_requests
            )
            endpoints.update(await self._push_mail.listen(mailbox))
        info = engine.backing.engine_info(
            engine.engine_id, engine.incarnation, engine.role, engine.node_id, regions, endpoints
        )
        engine.published = info
        for transport in self._transports.start_receiving(decode):
            engine.published = transport.publish(engine.published, receiving)
        if self._use_coordinator and self._directory.service is None:
            import ray

            if ray.is_initialized():
                from kvray.coordinator import get_or_create_coordinator

                self._directory.attach(
                    directory_service(get_or_create_coordinator(engine.settings)), by_name=True
                )
        await self._directory.register(engine.published)
        return engine.published

    async def close(self) -> None:
        """Deregister, fail whatever still waits, release transports and memory."""
        engine = self._engine
        if engine.closed.is_set():
            return
        engine.closed.set()
        for task in list(engine.background):
            task.cancel()
        await self._directory.deregister()
        self._receiving.close()
        self._push_mail.close()
        self._pusher.close()
        await self._transports.close()
        self._notices.close()
        engine.backing.close()
        self._receiving.record_completions()
        engine.metrics.flush()

    async def wait_closed(self) -> None:
        """Return once the agent has closed."""
        await self._engine.closed.wait()

    # ---- peers ------------------------------------------------------------------------

    def add_peer(self, info: EngineInfo, host: Any = None) -> None:
        """Wire a peer by hand (no coordinator): its info and the object hosting its agent."""
        self._directory.add(Peer(info, host))

    async def peer(self, engine_id: str, *, wait_s: float | None = None) -> Peer:
        """The engine's published info and host: cached, else asked of the coordinator, which
        waits up to `wait_s` (default `lookup_timeout_s`) for the engine to register."""
        return await self._directory.peer(engine_id, wait_s=wait_s)

    async def departed(self, peers: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Which of `peers` (engine id, incarnation) the coordinator no longer lists: they
        closed, died or restarted. None without a coordinator."""
        return await self._directory.departed(list(peers))

    def forget_peer(self, engine_id: str) -> None:
        """Drop everything cached for a peer (its info, offsets, mappings, connections); a
        write still in flight keeps what it uses until it ends."""
        self._directory.forget(engine_id)

    def _forget(self, engine_id: str) -> None:
        self._cache.forget(engine_id)
        self._notices.forget(engine_id)
        self._push_mail.forget(engine_id)
        self._transports.forget(engine_id)

    def choose_transport(self, peer: Peer) -> TransportKind:
        """The transport a push into `peer` takes (see `kvray.transport.choose_transport`)."""
        return self._transports.choose(peer.info, self.node_id).kind

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
        return await self._pusher.push(reservation, local_blocks, layers, timeout=timeout)

    async def hold_digests(self, local_blocks: Blocks) -> None:
        """Take the content digests of `local_blocks` now (every layer's parts), as their KV is
        produced or held, so that the next push of them checks its copy against these instead
        of reading the bytes on its own path (`kvray.content.HeldDigests`). The push uses them
        once. Call it only once the blocks hold the KV that push will send: a block written
        again between the two fails that push's check (the request is refused, never decoded
        from the new bytes under the old digest)."""
        await self._pusher.hold_digests(local_blocks)

    def open_lane(self, key_of: Callable[[str, int], bytes]) -> PrefillLane | None:
        """This prefill engine's native hand-off lane (`kvray.agent.lane`), opened beside its
        push-request inbox on first call; None where it cannot have one. `key_of(decode
        engine, incarnation)`: the 16 bytes that key that engine's asks."""
        return self._pusher.open_lane(key_of)

    @property
    def lane_hashes(self) -> bool:
        """Whether this engine's lane takes its holds' content sums itself: a hold then needs
        no `hold_digests` before `lane_hold` (a push of it the usual way hashes its blocks)."""
        return self._pusher.lane_hashes

    def lane_hold(self, handoff: str, blocks: npt.NDArray[np.int64]) -> bool:
        """Let an ask through the lane take hand-off `handoff`'s `blocks` (after `hold_digests`
        of them); False where it cannot."""
        return self._pusher.lane_hold(handoff, blocks)

    def decode_lane(self, key_of: Callable[[str, int], bytes]) -> DecodeLane | None:
        """What asks prefill engines' lanes for this decode engine (`kvray.agent.lane`), on the
        caller's own thread; None where this engine cannot take a lane's copy (not started,
        not in one region of shared memory or of a GPU, tensor parallelism). `key_of(prefill engine,
        incarnation)`: the 16 bytes that key asks to it."""
        engine = self._engine
        backing = engine.backing
        board = self._receiving.board
        if (
            not lane_available()
            or board is None
            or backing.kind not in (MemoryKind.SHM, MemoryKind.CUDA)
            or len(backing.regions) != 1
            or engine.info.layout.tp.size != 1
        ):
            return None
        layout = backing.layout
        table = PlacementTable(layout, backing.placements, tuple(range(len(layout.layers))), None)
        settings = engine.settings
        return DecodeLane(
            engine.engine_id,
            engine.incarnation,
            board,
            table.digest,
            key_of,
            settings.shm_dir,
            checked=settings.integrity,
            timeout_s=settings.transfer_timeout_s,
        )

    def forget_digests(self, local_blocks: Blocks) -> None:
        """Drop the digests `hold_digests` took of `local_blocks` (and any it is still taking):
        the blocks go back to the engine, which may write them again."""
        self._pusher.forget_digests(local_blocks)

    async def push_layer(
        self,
        reservation: Reservation,
        layer: str,
        local_blocks: Blocks,
        *,
        timeout: float | None = None,
        ready: SourceReady = None,
    ) -> int:
        """Write one layer of a request now (as prefill produces it); `finish` completes it.
        `ready`: what says the layer's KV is written, where the caller knows it better than the
        calling thread's current stream (`kvray.memory.SourceReady`: a CUDA event recorded on the
        engine's compute stream after the layer); the write's copies wait for it on the device.

        Once one layer of a request has failed, its later layers are refused (the decode side
        has been told and may have freed the blocks): `finish` or `abort` the request."""
        return await self._pusher.push_layer(reservation, layer, local_blocks, ready, timeout=timeout)

    async def finish(self, request_id: str, *, timeout: float | None = None) -> PushResult:
        """Complete a layer-wise push: the decode side's `wait_for_kv` resolves."""
        return await self._pusher.finish(request_id, timeout=timeout)

    async def forget_layers(self, request_id: str) -> None:
        """Drop a request's layer-wise push without a word to the decode engine, once no layer
        write of it is in progress (its blocks were preempted: a whole push follows later)."""
        await self._pusher.forget_layers(request_id)

    async def abort(self, reservation: Reservation, reason: str) -> None:
        """Tell the decode side a request's KV will not come (best effort, bounded).

        The notice names the incarnation the request's blocks belong to; an engine that has
        since restarted is not told about its old life. It never waits for an engine to register."""
        await self._pusher.abort(reservation, reason)

    # ---- decode side ------------------------------------------------------------------

    def expect(self, request_id: str, blocks: Blocks, layers: Sequence[str] | None = None) -> Reservation:
        """The request's blocks are reserved here and its KV may come: a `Reservation` to hand
        to the writer (it names this engine incarnation, the blocks and a fresh secret token).
        The KV must cover `layers` (default: every layer of this engine), no fewer: a transfer
        that names other layers fails the request."""
        return self._receiving.expect(request_id, blocks, layers)

    async def wait_for_kv(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait until the request's KV is written (or failed, or the deadline passes).

        However the wait ends, the request stays reserved until `release(request_id)`, which
        returns once no write for it can land any more."""
        return await self._receiving.wait_for_kv(request_id, timeout)

    async def release(self, request_id: str) -> None:
        """Stop expecting a request, and return once no write for it can still land: its
        blocks may then go back to the pool. A late completion for it is dropped and counted.

        Raises `TransferTimeoutError` if a writer still holds the request's claim after
        `transfer_timeout_s` (a writer's own deadline): the blocks must then stay out of the
        pool; the agent lists the request in `quarantined` and keeps trying in the background."""
        await self._receiving.release(request_id)

    def cancel(self, request_id: str) -> None:
        """Stop expecting a request now (its wait ends with `RequestCancelledError`); `release`
        it before its blocks go back to the pool."""
        self._receiving.cancel(request_id)

    # ---- what peers call (`kvray.host.calls.PeerCall`, through the agent's host) --------

    #: What takes the push requests peers send (`serve_push_requests`); None: refused.
    _push_requests: Callable[[bytes], None] | None = None

    async def deliver(self, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        """A `ray`-transport write arriving (checked by the transport and `Receiver.admit`)."""
        if self.role is not Role.DECODE:
            raise MetadataError(f"engine {self.engine_id!r} is not a decode engine and takes no writes")
        ray_transport = self._transports.get(TransportKind.RAY, to_write=False)
        return await ray_transport.deliver(self._receiving, header, payload)

    async def notify(self, message: bytes) -> None:
        """A completion or failure notice arriving through Ray: one this engine does not take
        (malformed, stale, unknown request, wrong token) raises, so its sender learns the
        request was not completed."""
        self._receiving.receive(message, strict=True)

    async def claim(self, message: bytes) -> None:
        """A writer on another node claims a request before its first one-sided write (`verbs`)."""
        self._receiving.claim(message)

    async def accept_connection(self, request: bytes) -> bytes:
        """A writer's RDMA connection request (`verbs`), answered by a queue pair of this engine
        if the writer is a registered prefill engine at the incarnation it claims."""
        return await self._transports.get(TransportKind.VERBS).accept(self._receiving, request)

    async def request_push(self, message: bytes) -> None:
        """A decode engine asks this prefill engine to push a request's KV
        (`kvray.wire.PushRequest`): handed to what `serve_push_requests` named, else refused."""
        if self._push_requests is None:
            raise NotExpectedError(
                f"engine {self.engine_id!r} takes no push requests", engine_id=self.engine_id
            )
        self._push_requests(message)

    def serve_push_requests(self, handler: Callable[[bytes], None]) -> None:
        """Hand the push requests and withdrawals peers send this engine to `handler`, called on
        the agent's loop; the engine answers each with the push itself, or a refusal. They come
        through the engine's host (`request_push`) and, when this is called before `start`,
        through the push-request mailbox the agent then opens on each notice channel (an inbox
        for engines on this node, a TCP listener for others), whose endpoints it publishes."""
        self._push_requests = handler

    @property
    def push_requests(self) -> NoticeSet:
        """The push-request mailboxes' channels: `send` carries a push request or withdrawal to
        a prefill engine (`Peer`) through the first that reaches it, `listening` tells whether
        its inbox is still read."""
        return self._push_mail


@dataclass(frozen=True)
class _PushRequestMailbox:
    """The engine the push-request mailbox's channels serve (`NoticeReceiver`), as it starts:
    each message goes to the handler `KVAgent.serve_push_requests` named. A refusal goes to the
    reservation the message names, never back along the channel, so every message reads as
    taken."""

    engine_id: str
    incarnation: int
    node_address: str | None
    handler: Callable[[bytes], None]

    def receive(self, message: bytes, /) -> DropReason | None:
        self.handler(message)
        return None
