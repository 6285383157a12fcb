"""`VerbsTransport`: both halves of the `verbs` transport, put together from the device, its
registered memory, the connections, the writes in flight and the decode side's arrivals."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, ClassVar

import msgspec

from kvray.config import Settings
from kvray.errors import TransportError
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.metrics import EngineMetrics
from kvray.placement import Stored
from kvray.plan import TransferPlan
from kvray.transport.base import Peer, PeerCache, Reach, Receiver, Transport, check_write, planned_placement
from kvray.transport.verbs.connections import (
    Accepted,
    Connection,
    Writer,
    check_writer,
    connect,
    open_facing,
    read_request,
)
from kvray.transport.verbs.device import CompletionPoller, Device, VerbsApi, load_pyverbs, probe
from kvray.transport.verbs.gpudirect import GpuDirect
from kvray.transport.verbs.receive import Inbound
from kvray.transport.verbs.regions import Registrations
from kvray.transport.verbs.requests import build_write_requests, transfer_tag
from kvray.transport.verbs.write import InFlight
from kvray.wire import (
    EngineInfo,
    RegionDescriptor,
    TransferDone,
    TransportKind,
    VerbsAccept,
    VerbsEndpoint,
    encode,
)

_probe_lock = threading.Lock()
_probed: dict[tuple[str, int, int], str | None] = {}


class VerbsTransport(Transport):
    """RDMA WRITEs through pyverbs (`api`: the seam tests fill with a fake device; pyverbs by
    default). GPU memory is registered as `gpudirect` says (this node's CUDA driver and kernel
    modules by default). The device opens at first use; one transport serves one event loop.

    `stats` counts what happened on it: writes, work requests, send errors, connections
    accepted, and immediates matched or dropped (by reason)."""

    kind = TransportKind.VERBS
    needs = "pyverbs and an RDMA device on both nodes"
    reach = Reach.OTHER_NODES
    source_kinds = frozenset({MemoryKind.CPU, MemoryKind.SHM, MemoryKind.CUDA})
    destination_kinds = frozenset({MemoryKind.CPU, MemoryKind.SHM, MemoryKind.CUDA})
    # An engine's regions are described by the transport of its memory; verbs publishes a port.
    registers: ClassVar[frozenset[MemoryKind]] = frozenset()
    # Each write ends in one WRITE WITH IMMEDIATE, which the decode side counts (`complete`).
    arrival_proofs = 1
    claims_across_nodes = True

    def __init__(
        self,
        settings: Settings,
        metrics: EngineMetrics | None = None,
        *,
        api: VerbsApi | None = None,
        gpudirect: GpuDirect | None = None,
    ) -> None:
        super().__init__(settings, metrics)
        self._api = api
        self._gpudirect = gpudirect
        self._device: Device | None = None
        self._registrations: Registrations | None = None
        #: Writer ends, one per (decode engine, incarnation, writer).
        self._connections: PeerCache[Writer, Connection] = PeerCache(settings.max_cached_peers, self._retire)
        self._connecting: dict[tuple[str, int, Writer], asyncio.Future[Connection]] = {}
        self._inbound = Inbound(self.metrics)
        self._in_flight: InFlight | None = None
        self._poller: CompletionPoller | None = None
        self._failed: str | None = None

    # ---- availability and the device ----

    @classmethod
    def unavailable_reason(cls, settings: Settings) -> str | None:
        key = (settings.verbs_device, settings.verbs_port, settings.verbs_gid_index)
        with _probe_lock:
            if key not in _probed:
                _probed[key] = probe(settings)
            return _probed[key]

    @classmethod
    def accepts(cls, peer: EngineInfo) -> bool:
        return peer.verbs is not None

    @property
    def api(self) -> VerbsApi:
        if self._api is None:
            self._api = load_pyverbs()
        return self._api

    @property
    def device(self) -> Device:
        if self._device is None:
            self._device = Device(self.api, self.settings)
        return self._device

    @property
    def registrations(self) -> Registrations:
        if self._registrations is None:
            self._registrations = Registrations(self.device, self._gpudirect)
        return self._registrations

    @property
    def endpoint(self) -> VerbsEndpoint:
        """This process's RDMA port, as `EngineInfo.verbs` publishes it."""
        return self.device.endpoint

    def _start_poller(self) -> InFlight:
        """The completion thread, started for the running loop; the writes in flight."""
        loop = asyncio.get_running_loop()
        if self._failed is not None:
            raise TransportError(f"the verbs transport on {self.device.name} is out of order: {self._failed}")
        if self._poller is not None and self._in_flight is not None:
            if self._poller.loop is not loop:
                raise TransportError("a verbs transport serves one event loop; open one per loop")
            return self._in_flight
        device = self.device
        in_flight = InFlight(
            device,
            self.metrics,
            wake=self._wake,
            broken=self._drop_broken,
            drain_timeout_s=self.settings.notify_timeout_s,
        )
        self._in_flight = in_flight
        self._poller = CompletionPoller(
            device,
            loop,
            on_completions=self._on_completions,
            on_failure=self._poller_failed,
            busy=lambda: bool(in_flight) or bool(self._inbound.accepted),
        )
        return in_flight

    def _wake(self) -> None:
        if self._poller is not None:
            self._poller.wake()

    def _poller_failed(self, error: Exception) -> None:
        """Polling a completion queue failed: nothing can complete any more on this device."""
        self._failed = f"polling the completion queues failed: {type(error).__name__}: {error}"
        if self._in_flight is not None:
            self._in_flight.fail_all(self._failed)

    def _on_completions(self, sends: list[Any], receives: list[Any]) -> None:
        if self._in_flight is not None:
            for wc in sends:
                self._in_flight.on_send(wc)
        for wc in receives:
            self._inbound.on_receive(wc, self.device)

    # ---- writer half ----

    def register(
        self, backing: Backing, engine_id: str, incarnation: int, *, remote_writable: bool
    ) -> tuple[RegionDescriptor, ...]:
        """Registers the backing's memory now and names each region's rkey in its descriptor
        (the agent publishes the descriptors of its memory's transport instead, and the memory
        is registered at the first connection or write)."""
        registration = self.registrations.of(backing, remote_writable=remote_writable)
        descriptors = super().register(backing, engine_id, incarnation, remote_writable=remote_writable)
        if not remote_writable:
            return descriptors
        return tuple(
            msgspec.structs.replace(descriptor, key=int(mr.rkey), remote_writable=True)
            for descriptor, mr in zip(descriptors, registration.mrs, strict=True)
        )

    async def write(
        self, plan: TransferPlan, local: Backing, peer: Peer, *, ready: SourceReady = None
    ) -> Stored:
        check_write(plan, local, peer)
        in_flight = self._start_poller()
        connection = await self._connect(peer, (plan.src_engine, plan.src_incarnation))
        registration = self.registrations.of(local, remote_writable=False)
        requests = build_write_requests(
            plan.ops,
            registration.local(local),
            connection.remote_regions(),
            self.device.limits(),
            immediate=transfer_tag(plan.request_id),
            local_engine=plan.src_engine,
            remote_engine=peer.info.engine_id,
        )
        await in_flight.post(connection, requests)
        self.metrics.rdma_write(len(requests))
        return planned_placement(plan)

    async def _connect(self, peer: Peer, writer: Writer) -> Connection:
        """The connection from `writer` to the peer's incarnation, made now unless one is open.
        Past `max_cached_peers` peers, the least recently used one is forgotten."""
        info = peer.info
        connection = self._connections.get(info.engine_id, info.incarnation, writer)
        if connection is not None and connection.broken is None:
            return connection
        key = (info.engine_id, info.incarnation, writer)
        pending = self._connecting.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._connecting[key] = future
        try:
            connection = await connect(self.device, peer, writer, self.settings.notify_timeout_s)
        except BaseException as error:
            future.set_exception(error)
            future.exception()
            raise
        finally:
            self._connecting.pop(key, None)
        self._connections.put(info.engine_id, info.incarnation, writer, connection)
        future.set_result(connection)
        return connection

    def _retire(self, connection: Connection) -> None:
        connection.retire(self.device)

    def _drop_broken(self, connection: Connection) -> None:
        """A broken connection is dropped (the next write connects again) and retired."""
        cached = self._connections.get(connection.engine_id, connection.incarnation, connection.writer)
        if cached is connection:
            self._connections.pop(connection.engine_id, connection.incarnation, connection.writer)

    def forget(self, engine_id: str) -> None:
        self._connections.forget(engine_id)

    # ---- receiver half ----

    def publish(self, info: EngineInfo, receiver: Receiver) -> EngineInfo:
        """`info` with this process's RDMA port (`EngineInfo.verbs`), which opens the device."""
        return msgspec.structs.replace(info, verbs=self.endpoint)

    def expect(self, receiver: Receiver, request_id: str) -> None:
        """Count the immediates of `request_id`'s transfers from now on; a request whose 32-bit
        tag is another expected request's is refused (`PlanError`)."""
        self._inbound.expect(_engine(receiver), request_id)

    def release(self, receiver: Receiver, request_id: str) -> None:
        self._inbound.cancel(_engine(receiver), request_id)

    async def complete(self, receiver: Receiver, notice: TransferDone) -> None:
        """Return once as many immediates of the notice's request have come from its writer
        incarnation as the notice names proofs of arrival (at once if it names none)."""
        if not notice.arrival_proofs:
            return
        await self._inbound.arrivals(
            _engine(receiver),
            notice.request_id,
            (notice.src_engine, notice.src_incarnation),
            notice.arrival_proofs,
        )

    async def accept(self, receiver: Receiver, request: bytes) -> bytes:
        """Answer a writer's `VerbsConnect`: a queue pair facing the writer's, ready to receive,
        and the keys of the receiver's regions.

        A queue pair is a standing permission to write, so it is made only for a writer that is
        a registered prefill engine at the incarnation it claims (`receiver.writer`). At most
        `max_cached_peers` writers hold one at a time; a writer connecting again replaces its own."""
        info = receiver.info
        message = read_request(request, info)
        await check_writer(message, receiver.writer)
        self._inbound.check_room(message.src_engine, info.engine_id, self.settings.max_cached_peers)
        self._start_poller()
        device = self.device
        backing = receiver.backing
        registration = self.registrations.of(backing, remote_writable=True)
        qp, psn = open_facing(device, message)
        self._inbound.add(
            Accepted(message.src_engine, message.src_incarnation, info.engine_id, info.incarnation, qp),
            device,
        )
        self._wake()
        return encode(
            VerbsAccept(
                dst_engine=info.engine_id,
                dst_incarnation=info.incarnation,
                endpoint=device.endpoint,
                qp_num=int(qp.qp_num),
                psn=psn,
                regions=registration.remote(backing),
            )
        )

    def expected_requests(self, engine_id: str, incarnation: int) -> list[str]:
        """The requests whose immediates are being counted for that engine incarnation."""
        return self._inbound.expected((engine_id, incarnation))

    # ---- closing ----

    async def close(self) -> None:
        connections = list(self._connections.values())
        self._connections = PeerCache(self.settings.max_cached_peers, self._retire)
        for connection in connections:
            self.device.close_qp(connection.qp)
        self._inbound.close(self._device)
        if self._poller is not None:
            await self._poller.stop(self.settings.notify_timeout_s)
            self._poller = None
        if self._registrations is not None:
            self._registrations.close()
            self._registrations = None
        if self._device is not None:
            self._device.close()
            self._device = None


def _engine(receiver: Receiver) -> tuple[str, int]:
    info = receiver.info
    return info.engine_id, info.incarnation
