"""`verbs` transport: RDMA NICs through pyverbs (sixth step of the data flow, across nodes).

    device     one RDMA device per process, by name or by locality (`Settings.verbs_device`),
               one protection domain, two completion queues (sends, receives) and one thread
               that polls them and hands completions to the event loop
    regions    a decode engine's regions are memory regions with REMOTE_WRITE | LOCAL_WRITE and
               nothing else; a prefill engine's are local-only (no access flag at all); GPU
               memory is registered through dma-buf, or refused with a clear error
    handshake  one reliable-connected queue pair per (writer incarnation, decode incarnation):
               the writer creates its QP, sends `VerbsConnect` (its GID, QPN, PSN, MTU) to the
               actor hosting the decode agent (`AgentHost.kvray_connect`), which creates the
               facing QP, posts receives, takes it INIT -> RTR -> RTS and answers `VerbsAccept`
               (its QPN, PSN and each region's address, length and rkey); the writer then
               takes its own QP INIT -> RTR -> RTS. The static half of both ends (device, port,
               GID, LID, MTU) is also published in `EngineInfo.verbs`.
    write      the plan's ops become RDMA WRITEs with scatter-gather lists (`_verbs_wr`), every
               Nth signalled, posted in a window no deeper than the queue pair; the last is a
               WRITE WITH IMMEDIATE carrying the transfer's tag. A failed work completion is a
               `WriteFailedError` naming the peer and the op; a write that fails or is cancelled
               moves its QP to the error state and returns only once every posted request has
               completed (or been flushed), so no request outlives the call.
    receive    the decode side matches each immediate against the transfers it expects
               (`expect_transfer`) and counts them per writer; a decode agent completes a
               request only once the writer's completion notice has come AND as many
               immediates as it names (`arrivals`). Immediates on unknown or retired queue
               pairs, for an old incarnation or for a request nobody expects are dropped and
               counted.

pyverbs is reached through `VerbsApi`, one seam the tests fill with a fake device.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import secrets
import threading
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvray.config import Settings
from kvray.errors import (
    BackpressureError,
    KvrayError,
    MetadataError,
    PlanError,
    RegionError,
    StaleIncarnationError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.memory import Backing, MemoryKind
from kvray.plan import TransferPlan
from kvray.transport._verbs_wr import (
    DeviceLimits,
    RegisteredRegion,
    WriteRequest,
    build_write_requests,
    transfer_tag,
)
from kvray.transport.base import Peer, Transport, check_write
from kvray.wire import (
    EngineInfo,
    RegionDescriptor,
    Role,
    TransportKind,
    VerbsAccept,
    VerbsConnect,
    VerbsEndpoint,
    VerbsRegionKey,
    decode_verbs_handshake,
    encode,
)

#: Receives posted on each accepted queue pair (each WRITE WITH IMMEDIATE consumes one).
RECV_DEPTH = 64
#: Entries of each completion queue.
CQ_ENTRIES = 4096
#: Longest the polling thread sleeps between polls while work may complete (seconds).
_IDLE_POLL_S = 0.001
_PORT_ACTIVE = 4
_LINK_LAYER_ETHERNET = 2


@dataclass(frozen=True)
class VerbsApi:
    """The part of pyverbs the transport uses. `load_pyverbs` fills it from pyverbs; tests fill
    it from a fake device (tests/transport/fake_verbs.py)."""

    get_device_list: Callable[[], Sequence[Any]]
    Context: Any
    PD: Any
    MR: Any
    DmaBufMR: Any
    CQ: Any
    QP: Any
    QPCap: Any
    QPInitAttr: Any
    QPAttr: Any
    AHAttr: Any
    GlobalRoute: Any
    GID: Any
    SGE: Any
    SendWR: Any
    RecvWR: Any
    #: pyverbs.libibverbs_enums: IBV_* constants.
    enums: Any
    #: What pyverbs raises (PyverbsError and its subclasses).
    errors: tuple[type[BaseException], ...]


def load_pyverbs() -> VerbsApi:
    """pyverbs, imported now; an ImportError or OSError says it is missing or cannot load."""
    import pyverbs.libibverbs_enums as enums
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR, DmaBufMR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR

    return VerbsApi(
        get_device_list=get_device_list,
        Context=Context,
        PD=PD,
        MR=MR,
        DmaBufMR=DmaBufMR,
        CQ=CQ,
        QP=QP,
        QPCap=QPCap,
        QPInitAttr=QPInitAttr,
        QPAttr=QPAttr,
        AHAttr=AHAttr,
        GlobalRoute=GlobalRoute,
        GID=GID,
        SGE=SGE,
        SendWR=SendWR,
        RecvWR=RecvWR,
        enums=enums,
        errors=(PyverbsError,),
    )


# ---- devices ------------------------------------------------------------------------------------


def _name(device: Any) -> str:
    name = device.name
    return name.decode() if isinstance(name, bytes) else str(name)


def list_devices(api: VerbsApi) -> list[str]:
    """Names of the RDMA devices pyverbs sees; none is an empty list (pyverbs raises then)."""
    try:
        return [_name(device) for device in api.get_device_list()]
    except api.errors:
        return []


def _numa_node(device: str) -> int:
    try:
        with open(f"/sys/class/infiniband/{device}/device/numa_node") as file:
            return int(file.read().strip())
    except (OSError, ValueError):
        return -1


def _local_numa_nodes() -> set[int]:
    """NUMA nodes of the CPUs this process may run on."""
    cpus = os.sched_getaffinity(0)
    nodes = set()
    with contextlib.suppress(OSError):
        for entry in os.listdir("/sys/devices/system/node"):
            if not entry.startswith("node") or not entry[4:].isdigit():
                continue
            with open(f"/sys/devices/system/node/{entry}/cpulist") as file:
                if cpus & _parse_cpulist(file.read()):
                    nodes.add(int(entry[4:]))
    return nodes


def _parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _candidates(api: VerbsApi, settings: Settings) -> list[str]:
    """Devices to try, best first; raises TransportUnavailableError when there is none."""
    names = list_devices(api)
    if not names:
        raise TransportUnavailableError("pyverbs sees no RDMA device on this machine", transport="verbs")
    if settings.verbs_device != "auto":
        if settings.verbs_device not in names:
            raise TransportUnavailableError(
                f"RDMA device {settings.verbs_device!r} (KVRAY_VERBS_DEVICE) is not on this machine "
                f"(have: {', '.join(names)})",
                transport="verbs",
            )
        return [settings.verbs_device]
    local = _local_numa_nodes()
    return sorted(names, key=lambda name: (_numa_node(name) not in local, name))


class _Device:
    """An opened RDMA device: context, protection domain, port, completion queues."""

    def __init__(self, api: VerbsApi, settings: Settings) -> None:
        self.api = api
        reasons = []
        for name in _candidates(api, settings):
            context = api.Context(name=name)
            port = context.query_port(settings.verbs_port)
            if port.state == _PORT_ACTIVE:
                break
            reasons.append(f"{name} port {settings.verbs_port} is not active (state {port.state})")
            context.close()
        else:
            raise TransportUnavailableError(f"no active RDMA port: {'; '.join(reasons)}", transport="verbs")
        self.name = name
        self.context = context
        self.port_num = settings.verbs_port
        self.port = port
        self.attr = context.query_device()
        gid_index = settings.verbs_gid_index
        if gid_index < 0:
            gid_index = _pick_gid_index(context, settings.verbs_port, port.gid_tbl_len)
        self.gid_index = gid_index
        gid = str(context.query_gid(settings.verbs_port, gid_index))
        self.endpoint = VerbsEndpoint(
            device=name,
            port=settings.verbs_port,
            gid=gid,
            gid_index=gid_index,
            lid=port.lid,
            mtu=port.active_mtu,
            link_layer=port.link_layer,
        )
        self.pd = api.PD(context)
        self.send_cq = api.CQ(context, CQ_ENTRIES)
        self.recv_cq = api.CQ(context, CQ_ENTRIES)
        # The buffer receives point at: a WRITE WITH IMMEDIATE consumes a receive, writes nothing.
        self.recv_mr = api.MR(self.pd, 64, api.enums.IBV_ACCESS_LOCAL_WRITE)

    def limits(self, settings: Settings) -> DeviceLimits:
        return DeviceLimits(
            max_sge=max(1, min(self.attr.max_sge, 30)),
            max_message_nbytes=self.port.max_msg_sz,
            # A chunk of unsignalled requests must fit the send queue.
            signal_every=min(settings.verbs_signal_every, self.queue_depth(settings)),
        )

    def queue_depth(self, settings: Settings) -> int:
        return max(1, min(settings.verbs_queue_depth, int(self.attr.max_qp_wr)))

    def close(self) -> None:
        for resource in (self.recv_mr, self.send_cq, self.recv_cq, self.pd, self.context):
            with contextlib.suppress(*self.api.errors):
                resource.close()


def _pick_gid_index(context: Any, port: int, table_length: int) -> int:
    """An IPv4-mapped GID (RoCE v2 over IPv4) if the port has one, else the first non-zero GID."""
    first_nonzero = None
    for index in range(table_length):
        try:
            gid = str(context.query_gid(port, index))
        except Exception:  # an empty or invalid table entry
            continue
        if gid.replace(":", "").strip("0") == "":
            continue
        if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return index
        if first_nonzero is None:
            first_nonzero = index
    return first_nonzero if first_nonzero is not None else 0


_probe_lock = threading.Lock()
_probed: dict[tuple[str, int, int], str | None] = {}


def probe(settings: Settings, api: VerbsApi | None = None) -> str | None:
    """None when the verbs transport can run here, else one sentence saying why not (not cached)."""
    try:
        api = api or load_pyverbs()
    except ImportError as error:
        if "pyverbs" in str(error) and "No module named" in str(error):
            return "pyverbs is not installed (pip install 'kvray[rdma]', see the README's RDMA section)"
        return f"pyverbs cannot load its libraries ({error}); see the README's RDMA section"
    except OSError as error:
        return f"pyverbs cannot load its libraries ({error}); see the README's RDMA section"
    try:
        device = _Device(api, settings)
    except TransportUnavailableError as error:
        return str(error)
    except api.errors as error:
        return f"the RDMA device cannot be opened ({error})"
    device.close()
    return None


# ---- memory registration -----------------------------------------------------------------------


@dataclass
class _Registration:
    """The memory regions of one backing (one per region of it)."""

    backing: weakref.ReferenceType[Backing]
    mrs: list[Any]
    #: Per region: where the MR's address space puts the region's first byte.
    addresses: list[int]
    remote_writable: bool

    def close(self, errors: tuple[type[BaseException], ...]) -> None:
        for mr in self.mrs:
            with contextlib.suppress(*errors):
                mr.close()
        self.mrs.clear()


def _cuda_dmabuf_fd(address: int, nbytes: int) -> int:
    """A dma-buf file descriptor for [address, address + nbytes) of GPU memory (CUDA driver API)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        get_handle = libcuda.cuMemGetHandleForAddressRange
    except (OSError, AttributeError) as error:
        raise RegionError(
            f"GPU memory is registered for RDMA through dma-buf, but the CUDA driver here has no "
            f"cuMemGetHandleForAddressRange ({error}); use a CUDA 11.7+ driver or a CPU backing"
        ) from error
    fd = ctypes.c_int(-1)
    dma_buf_fd_type = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    result = get_handle(
        ctypes.byref(fd),
        ctypes.c_uint64(address),
        ctypes.c_size_t(nbytes),
        ctypes.c_int(dma_buf_fd_type),
        ctypes.c_ulonglong(0),
    )
    if result != 0:
        raise RegionError(
            f"the CUDA driver refused a dma-buf for GPU memory at {address:#x} (+{nbytes}): CUresult "
            f"{result}; dma-buf needs an open kernel module (nvidia-open) and a page-aligned region, "
            "else use a CPU backing"
        )
    return fd.value


# ---- connections ----------------------------------------------------------------------------------


@dataclass
class _Chunk:
    """Posted work requests whose last one is signalled: done when its completion arrives."""

    first_wr_id: int
    last_wr_id: int
    requests: list[WriteRequest]
    first_index: int
    total: int
    future: asyncio.Future[None]


@dataclass
class _Connection:
    """The writer's end of a reliable connection to one decode engine incarnation."""

    engine_id: str
    incarnation: int
    qp: Any
    regions: tuple[VerbsRegionKey, ...]
    #: Chunks posted and not yet completed, oldest first.
    in_flight: list[_Chunk] = field(default_factory=list)
    broken: str | None = None
    retired: bool = False

    @property
    def qp_num(self) -> int:
        return int(self.qp.qp_num)


@dataclass(frozen=True)
class VerbsArrival:
    """A transfer's immediate, received and matched on the decode side."""

    request_id: str
    src_engine: str
    src_incarnation: int
    tag: int


@dataclass
class _Expected:
    """A request the decode side expects over RDMA: its immediates counted per writer."""

    request_id: str
    first: asyncio.Future[VerbsArrival]
    counts: Counter[tuple[str, int]] = field(default_factory=Counter)
    waiters: list[tuple[tuple[str, int], int, asyncio.Future[None]]] = field(default_factory=list)


@dataclass
class _Accepted:
    """The decode side's end of a reliable connection from one writer incarnation."""

    src_engine: str
    src_incarnation: int
    dst_engine: str
    dst_incarnation: int
    qp: Any
    retired: bool = False


class VerbsTransport(Transport):
    kind = TransportKind.VERBS
    same_node_only = False
    destination_kinds = frozenset({MemoryKind.CPU, MemoryKind.SHM, MemoryKind.CUDA})

    def __init__(self, settings: Settings, *, api: VerbsApi | None = None) -> None:
        super().__init__(settings)
        self._api = api
        self._device_handle: _Device | None = None
        self._registrations: dict[int, _Registration] = {}
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._connecting: dict[tuple[str, int], asyncio.Future[_Connection]] = {}
        self._accepted: dict[int, _Accepted] = {}
        #: Expected transfers per (decode engine, incarnation), by transfer tag.
        self._expected: dict[tuple[str, int], dict[int, _Expected]] = {}
        self._chunks: dict[int, tuple[_Connection, _Chunk]] = {}
        self._wr_ids = itertools.count(1)
        self.stats: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = False
        self._failed: str | None = None

    # ---- availability and the device ----

    @classmethod
    def unavailable_reason(cls, settings: Settings) -> str | None:
        key = (settings.verbs_device, settings.verbs_port, settings.verbs_gid_index)
        with _probe_lock:
            if key not in _probed:
                _probed[key] = probe(settings)
            return _probed[key]

    @property
    def api(self) -> VerbsApi:
        if self._api is None:
            self._api = load_pyverbs()
        return self._api

    @property
    def device(self) -> _Device:
        if self._device_handle is None:
            self._device_handle = _Device(self.api, self.settings)
        return self._device_handle

    @property
    def endpoint(self) -> VerbsEndpoint:
        """This process's RDMA port, as `EngineInfo.verbs` publishes it."""
        return self.device.endpoint

    def _start_poller(self) -> None:
        loop = asyncio.get_running_loop()
        if self._failed is not None:
            raise TransportError(f"the verbs transport on {self.device.name} is out of order: {self._failed}")
        if self._poller is not None:
            if self._loop is not loop:
                raise TransportError("a verbs transport serves one event loop; open one per loop")
            return
        self._loop = loop
        device = self.device
        self._poller = threading.Thread(
            target=self._poll, args=(device, loop), name="kvray-verbs-cq", daemon=True
        )
        self._poller.start()

    def _poll(self, device: _Device, loop: asyncio.AbstractEventLoop) -> None:
        """The completion thread: drains both CQs and hands each completion to the loop. It
        polls while sends are in flight or connections are accepted, else waits to be woken."""
        while not self._stop:
            try:
                _, sends = device.send_cq.poll(64)
                _, receives = device.recv_cq.poll(64)
            except Exception as error:
                if not self._stop:
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(self._poller_failed, error)
                return
            if sends or receives:
                with contextlib.suppress(RuntimeError):  # the loop closed under us
                    loop.call_soon_threadsafe(self._on_completions, sends, receives)
                continue
            if self._chunks or self._accepted:
                self._wake.wait(_IDLE_POLL_S)
            else:
                self._wake.wait()
            self._wake.clear()

    def _poller_failed(self, error: Exception) -> None:
        """Polling a completion queue failed: nothing can complete any more on this device."""
        self._failed = f"polling the completion queues failed: {type(error).__name__}: {error}"
        for connection, chunk in list(self._chunks.values()):
            connection.broken = self._failed
            self._finish_chunk(connection, chunk, self._broken_error(connection))

    def _on_completions(self, sends: list[Any], receives: list[Any]) -> None:
        for wc in sends:
            self._on_send(wc)
        for wc in receives:
            self._on_receive(wc)

    # ---- registration ----

    def register(
        self, backing: Backing, engine_id: str, incarnation: int, *, remote_writable: bool
    ) -> tuple[RegionDescriptor, ...]:
        registration = self._registration(backing, remote_writable=remote_writable)
        descriptors = super().register(backing, engine_id, incarnation, remote_writable=remote_writable)
        if not remote_writable:
            return descriptors
        return tuple(
            msgspec.structs.replace(descriptor, key=int(mr.rkey), remote_writable=True)
            for descriptor, mr in zip(descriptors, registration.mrs, strict=True)
        )

    def _registration(self, backing: Backing, *, remote_writable: bool) -> _Registration:
        """The backing's memory regions, registered now if they are not yet: REMOTE_WRITE |
        LOCAL_WRITE for a decode engine's, no access flag for a prefill engine's."""
        existing = self._registrations.get(id(backing))
        if existing is not None and existing.backing() is backing and existing.mrs:
            if remote_writable and not existing.remote_writable:
                raise RegionError(
                    "this backing is registered for RDMA as local-only (a prefill engine's); it "
                    "cannot also take remote writes"
                )
            return existing
        if backing.closed:
            raise RegionError("cannot register a closed backing for RDMA")
        enums = self.api.enums
        access = enums.IBV_ACCESS_REMOTE_WRITE | enums.IBV_ACCESS_LOCAL_WRITE if remote_writable else 0
        key = id(backing)
        registration = _Registration(
            weakref.ref(backing, lambda _: self._drop_registration(key)), [], [], remote_writable
        )
        try:
            for region in backing.regions:
                if region.kind is MemoryKind.CUDA:
                    fd = _cuda_dmabuf_fd(region.address, region.nbytes)
                    try:
                        mr = self.api.DmaBufMR(self.device.pd, region.nbytes, access, dmabuf=fd, offset=0)
                    finally:
                        os.close(fd)
                    registration.addresses.append(0)  # a dma-buf MR's addresses start at its offset
                else:
                    mr = self.api.MR(self.device.pd, region.nbytes, access, address=region.address)
                    registration.addresses.append(region.address)
                registration.mrs.append(mr)
        except self.api.errors as error:
            registration.close(self.api.errors)
            raise RegionError(
                f"registering {backing.kind.value} memory for RDMA on {self.device.name} failed: {error}"
            ) from error
        except BaseException:
            registration.close(self.api.errors)
            raise
        self._registrations[key] = registration
        return registration

    def _drop_registration(self, key: int) -> None:
        """The backing is gone: deregister its memory (no peer may write into it any more)."""
        registration = self._registrations.get(key)
        if registration is not None and registration.backing() is None:
            del self._registrations[key]
            registration.close(self.api.errors)

    # ---- writer side ----

    async def write(self, plan: TransferPlan, local: Backing, peer: Peer) -> None:
        check_write(plan, local, peer)
        info = peer.info
        self._start_poller()
        connection = await self._connect(peer, plan.src_engine, plan.src_incarnation)
        registration = self._registration(local, remote_writable=False)
        local_regions = [
            RegisteredRegion(address, region.nbytes, int(mr.lkey))
            for address, region, mr in zip(
                registration.addresses, local.regions, registration.mrs, strict=True
            )
        ]
        remote_regions = [RegisteredRegion(key.address, key.length, key.rkey) for key in connection.regions]
        requests = build_write_requests(
            plan.ops,
            local_regions,
            remote_regions,
            self.device.limits(self.settings),
            immediate=transfer_tag(plan.request_id),
            local_engine=plan.src_engine,
            remote_engine=info.engine_id,
        )
        await self._post(connection, requests)
        self.stats["writes"] += 1
        self.stats["work_requests"] += len(requests)

    async def _post(self, connection: _Connection, requests: list[WriteRequest]) -> None:
        """Post `requests` in chunks that each end in a signalled one, at most a queue pair's
        depth outstanding; on failure or cancellation, flush and wait for every posted one."""
        depth = self.device.queue_depth(self.settings)
        ours: list[_Chunk] = []
        #: Chunks of this write not yet awaited, oldest first, and their work requests.
        window: list[_Chunk] = []
        outstanding = 0
        try:
            start = 0
            while start < len(requests):
                if connection.broken is not None:
                    raise self._broken_error(connection)
                stop = start + 1
                while stop < len(requests) and not requests[stop - 1].signalled:
                    stop += 1
                while window and outstanding + (stop - start) > depth:
                    oldest = window.pop(0)
                    await oldest.future
                    outstanding -= len(oldest.requests)
                chunk = self._post_chunk(connection, requests, start, stop)
                ours.append(chunk)
                window.append(chunk)
                outstanding += stop - start
                start = stop
            for chunk in window:
                await chunk.future
        except BaseException:
            await self._drain(connection, ours)
            raise

    def _post_chunk(
        self, connection: _Connection, requests: list[WriteRequest], start: int, stop: int
    ) -> _Chunk:
        api = self.api
        enums = api.enums
        assert self._loop is not None
        chunk_requests = requests[start:stop]
        first_wr_id = next(self._wr_ids)
        wr_ids = [first_wr_id] + [next(self._wr_ids) for _ in chunk_requests[1:]]
        chunk = _Chunk(
            wr_ids[0], wr_ids[-1], chunk_requests, start, len(requests), self._loop.create_future()
        )
        connection.in_flight.append(chunk)
        self._chunks[chunk.last_wr_id] = (connection, chunk)
        last = len(chunk_requests) - 1
        try:
            for position, (wr_id, request) in enumerate(zip(wr_ids, chunk_requests, strict=True)):
                sges = [api.SGE(sge.address, sge.length, sge.lkey) for sge in request.sges]
                with_immediate = request.immediate is not None
                wr = api.SendWR(
                    wr_id=wr_id,
                    opcode=enums.IBV_WR_RDMA_WRITE_WITH_IMM if with_immediate else enums.IBV_WR_RDMA_WRITE,
                    num_sge=len(sges),
                    imm_data=request.immediate or 0,
                    sg=sges,
                    send_flags=enums.IBV_SEND_SIGNALED if request.signalled or position == last else 0,
                )
                wr.set_wr_rdma(request.rkey, request.remote_address)
                connection.qp.post_send(wr)
        except api.errors as error:
            # Posting failed (queue full, QP not ready): what was posted still completes, the
            # rest never will. Mark the connection broken and let the completions settle it.
            connection.broken = f"posting a work request failed: {error}"
            self._set_error(connection)
            if position == 0:
                self._finish_chunk(connection, chunk, self._broken_error(connection))
        self._wake.set()
        return chunk

    def _on_send(self, wc: Any) -> None:
        enums = self.api.enums
        entry = self._chunks.get(wc.wr_id)
        if wc.status != enums.IBV_WC_SUCCESS:
            self.stats["send_errors"] += 1
            connection, chunk = self._chunk_of(wc.wr_id)
            if connection is None or chunk is None:
                return
            request = chunk.requests[wc.wr_id - chunk.first_wr_id]
            index = chunk.first_index + wc.wr_id - chunk.first_wr_id
            status = _status_name(wc.status)
            if connection.broken is None:
                connection.broken = status
            self._set_error(connection)
            error = WriteFailedError(
                f"RDMA WRITE {index + 1} of {chunk.total} to engine {connection.engine_id!r} "
                f"(incarnation {connection.incarnation}) failed: {status} (vendor error "
                f"{wc.vendor_err:#x}); it wrote {request.nbytes} bytes at remote region "
                f"{request.remote_region} address {request.remote_address:#x} from op "
                f"{request.first_op}",
                engine_id=connection.engine_id,
                op=request.first_op,
                work_request=index,
                status=int(wc.status),
            )
            self._finish_chunk(connection, chunk, error)
            return
        if entry is not None:
            self._finish_chunk(entry[0], entry[1], None)

    def _chunk_of(self, wr_id: int) -> tuple[_Connection | None, _Chunk | None]:
        for connection, chunk in self._chunks.values():
            if chunk.first_wr_id <= wr_id <= chunk.last_wr_id:
                return connection, chunk
        return None, None

    def _finish_chunk(self, connection: _Connection, chunk: _Chunk, error: BaseException | None) -> None:
        self._chunks.pop(chunk.last_wr_id, None)
        with contextlib.suppress(ValueError):
            connection.in_flight.remove(chunk)
        if not chunk.future.done():
            if error is None:
                chunk.future.set_result(None)
            else:
                chunk.future.set_exception(error)
        if connection.retired and not connection.in_flight:
            self._close_qp(connection.qp)

    def _broken_error(self, connection: _Connection) -> WriteFailedError:
        return WriteFailedError(
            f"the RDMA connection to engine {connection.engine_id!r} (incarnation "
            f"{connection.incarnation}) broke: {connection.broken}; it is dropped and the next "
            "write connects again",
            engine_id=connection.engine_id,
        )

    def _set_error(self, connection: _Connection) -> None:
        """Move the QP to the error state: everything still queued completes as flushed."""
        self._connections.pop((connection.engine_id, connection.incarnation), None)
        attr = self.api.QPAttr()
        attr.qp_state = self.api.enums.IBV_QPS_ERR
        with contextlib.suppress(*self.api.errors):
            connection.qp.modify(attr, self.api.enums.IBV_QP_STATE)

    async def _drain(self, connection: _Connection, chunks: list[_Chunk]) -> None:
        """After a failure or cancellation: flush the QP and wait until no posted request of
        this write can still move a byte."""
        pending = [chunk.future for chunk in chunks if not chunk.future.done()]
        for chunk in chunks:
            if chunk.future.done() and not chunk.future.cancelled():
                chunk.future.exception()  # retrieved: the first failure is what the caller sees
        if not pending:
            return
        if connection.broken is None:
            connection.broken = "a write on it was cancelled or failed"
        self._set_error(connection)
        self._wake.set()
        waiting = asyncio.gather(*pending, return_exceptions=True)
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await asyncio.shield(waiting)
        except TimeoutError as error:
            raise TransportError(
                f"work requests to engine {connection.engine_id!r} were neither completed nor "
                f"flushed within {self.settings.notify_timeout_s} s of moving the queue pair to the "
                "error state; the device is not answering",
                engine_id=connection.engine_id,
            ) from error
        except asyncio.CancelledError:
            await waiting  # cancelled again: still wait for the flush
            raise

    async def _connect(self, peer: Peer, src_engine: str, src_incarnation: int) -> _Connection:
        info = peer.info
        self._used(info.engine_id)
        key = (info.engine_id, info.incarnation)
        connection = self._connections.get(key)
        if connection is not None and connection.broken is None:
            return connection
        pending = self._connecting.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        self._forget_other_incarnations(info.engine_id, info.incarnation)
        assert self._loop is not None
        future: asyncio.Future[_Connection] = self._loop.create_future()
        self._connecting[key] = future
        try:
            connection = await self._handshake(peer, src_engine, src_incarnation)
        except BaseException as error:
            future.set_exception(error)
            future.exception()
            raise
        finally:
            self._connecting.pop(key, None)
        self._connections[key] = connection
        future.set_result(connection)
        return connection

    async def _handshake(self, peer: Peer, src_engine: str, src_incarnation: int) -> _Connection:
        info = peer.info
        if peer.host is None:
            raise TransportError(
                f"engine {info.engine_id!r} has no host actor to connect through; the verbs "
                "transport needs the peer's agent in an AgentHost actor",
                engine_id=info.engine_id,
            )
        qp = self._create_qp(access=0)
        psn = secrets.randbits(24)
        request = VerbsConnect(
            src_engine=src_engine,
            src_incarnation=src_incarnation,
            dst_engine=info.engine_id,
            dst_incarnation=info.incarnation,
            endpoint=self.device.endpoint,
            qp_num=int(qp.qp_num),
            psn=psn,
        )
        try:
            try:
                async with asyncio.timeout(self.settings.notify_timeout_s):
                    reply_bytes = await peer.host.kvray_connect.remote(encode(request))
            except TimeoutError as error:
                raise TransferTimeoutError(
                    f"engine {info.engine_id!r} did not answer an RDMA connection request within "
                    f"{self.settings.notify_timeout_s} s",
                    engine_id=info.engine_id,
                    timeout_s=self.settings.notify_timeout_s,
                ) from error
            except Exception as error:
                cause = getattr(error, "cause", None) or error
                if isinstance(cause, KvrayError):
                    raise cause from error
                raise TransportError(
                    f"engine {info.engine_id!r} refused an RDMA connection: {type(cause).__name__}: {cause}",
                    engine_id=info.engine_id,
                ) from error
            reply = decode_verbs_handshake(reply_bytes)
            if not isinstance(reply, VerbsAccept):
                raise WireDecodeError("expected verbs_accept", field="$.type")
            _check_reply(reply, info)
            self._ready(qp, reply.endpoint, reply.qp_num, rq_psn=reply.psn, sq_psn=psn)
        except BaseException:
            self._close_qp(qp)
            raise
        return _Connection(info.engine_id, info.incarnation, qp, reply.regions)

    def _create_qp(self, *, access: int) -> Any:
        api = self.api
        enums = api.enums
        device = self.device
        depth = device.queue_depth(self.settings)
        cap = api.QPCap(
            max_send_wr=depth,
            max_recv_wr=RECV_DEPTH,
            max_send_sge=device.limits(self.settings).max_sge,
            max_recv_sge=1,
        )
        init_attr = api.QPInitAttr(
            qp_type=enums.IBV_QPT_RC, scq=device.send_cq, rcq=device.recv_cq, cap=cap, sq_sig_all=0
        )
        try:
            qp = api.QP(device.pd, init_attr)
            attr = api.QPAttr(port_num=device.port_num)
            attr.qp_access_flags = access
            attr.pkey_index = 0
            qp.to_init(attr)
        except api.errors as error:
            raise TransportError(f"creating an RDMA queue pair on {device.name} failed: {error}") from error
        return qp

    def _ready(self, qp: Any, remote: VerbsEndpoint, remote_qp_num: int, *, rq_psn: int, sq_psn: int) -> None:
        """INIT -> RTR -> RTS, facing the remote queue pair."""
        api = self.api
        device = self.device
        attr = api.QPAttr(port_num=device.port_num, path_mtu=min(device.endpoint.mtu, remote.mtu))
        attr.dest_qp_num = remote_qp_num
        attr.rq_psn = rq_psn
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        routed = remote.link_layer == _LINK_LAYER_ETHERNET or remote.lid == 0
        route = api.GlobalRoute(dgid=api.GID(remote.gid), sgid_index=device.gid_index) if routed else None
        attr.ah_attr = api.AHAttr(
            dlid=remote.lid, is_global=1 if routed else 0, port_num=device.port_num, gr=route
        )
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.sq_psn = sq_psn
        attr.max_rd_atomic = 1
        try:
            qp.to_rtr(attr)
            qp.to_rts(attr)
        except api.errors as error:
            raise TransportError(
                f"connecting an RDMA queue pair to {remote.device} ({remote.gid}) failed: {error}"
            ) from error

    def _close_qp(self, qp: Any) -> None:
        with contextlib.suppress(*self.api.errors):
            qp.close()

    def _forget_other_incarnations(self, engine_id: str, incarnation: int) -> None:
        for key in [k for k in self._connections if k[0] == engine_id and k[1] != incarnation]:
            self._retire(self._connections.pop(key))

    def _retire(self, connection: _Connection) -> None:
        connection.retired = True
        if not connection.in_flight:
            self._close_qp(connection.qp)

    def forget(self, engine_id: str) -> None:
        self._peers_used.pop(engine_id, None)
        for key in [k for k in self._connections if k[0] == engine_id]:
            self._retire(self._connections.pop(key))

    # ---- decode side ----

    async def accept(
        self,
        request: bytes,
        backing: Backing,
        info: EngineInfo,
        registered: Callable[[str, int], Awaitable[EngineInfo]],
    ) -> bytes:
        """Answer a writer's `VerbsConnect` for the engine `info` describes (whose backing is
        `backing`): a queue pair facing the writer's, ready to receive, and the regions' keys.

        A queue pair is a standing permission to write, so it is made only for a writer that is
        a registered prefill engine at the incarnation it claims: `registered(engine_id,
        incarnation)` returns that engine's current registration (looked up afresh when what is
        known is another incarnation) or raises. At most `max_cached_peers` writers hold one
        at a time; a writer connecting again replaces its own."""
        message = decode_verbs_handshake(request)
        if not isinstance(message, VerbsConnect):
            raise WireDecodeError("expected verbs_connect", field="$.type")
        if (message.dst_engine, message.dst_incarnation) != (info.engine_id, info.incarnation):
            raise StaleIncarnationError(
                f"an RDMA connection request for engine {message.dst_engine!r} incarnation "
                f"{message.dst_incarnation} reached engine {info.engine_id!r} incarnation "
                f"{info.incarnation}; the writer must look the engine up again",
                engine_id=info.engine_id,
                incarnation=info.incarnation,
                stale_incarnation=message.dst_incarnation,
            )
        if info.role is not Role.DECODE or not all(region.remote_writable for region in info.regions):
            raise RegionError(
                f"engine {info.engine_id!r} ({info.role.value}) exposes no writable region and takes "
                "no RDMA connections",
                engine_id=info.engine_id,
            )
        await self._check_writer(message, registered)
        reconnecting = any(
            accepted.src_engine == message.src_engine and accepted.dst_engine == info.engine_id
            for accepted in self._accepted.values()
        )
        if not reconnecting and len(self._accepted) >= self.settings.max_cached_peers:
            raise BackpressureError(
                f"engine {info.engine_id!r} already holds RDMA connections from "
                f"{len(self._accepted)} writers (max_cached_peers); {message.src_engine!r} must "
                "wait until one closes, or raise max_cached_peers",
                engine_id=info.engine_id,
                src_engine=message.src_engine,
                limit=self.settings.max_cached_peers,
            )
        self._start_poller()
        registration = self._registration(backing, remote_writable=True)
        qp = self._create_qp(access=self.api.enums.IBV_ACCESS_REMOTE_WRITE)
        psn = secrets.randbits(24)
        try:
            for _ in range(RECV_DEPTH):
                self._post_recv(qp)
            self._ready(qp, message.endpoint, message.qp_num, rq_psn=message.psn, sq_psn=psn)
        except BaseException:
            self._close_qp(qp)
            raise
        for qp_num, accepted in list(self._accepted.items()):
            if accepted.src_engine == message.src_engine and accepted.dst_engine == info.engine_id:
                self._accepted.pop(qp_num)
                self._close_qp(accepted.qp)
        self._accepted[int(qp.qp_num)] = _Accepted(
            message.src_engine, message.src_incarnation, info.engine_id, info.incarnation, qp
        )
        self._wake.set()
        self.stats["connections_accepted"] += 1
        return encode(
            VerbsAccept(
                dst_engine=info.engine_id,
                dst_incarnation=info.incarnation,
                endpoint=self.device.endpoint,
                qp_num=int(qp.qp_num),
                psn=psn,
                regions=tuple(
                    VerbsRegionKey(index=index, address=address, length=region.nbytes, rkey=int(mr.rkey))
                    for index, (address, region, mr) in enumerate(
                        zip(registration.addresses, backing.regions, registration.mrs, strict=True)
                    )
                ),
            )
        )

    @staticmethod
    async def _check_writer(
        message: VerbsConnect, registered: Callable[[str, int], Awaitable[EngineInfo]]
    ) -> None:
        """Refuse a connection request whose claimed writer is not a registered prefill engine
        at the incarnation it names."""
        writer = await registered(message.src_engine, message.src_incarnation)
        if writer.engine_id != message.src_engine or writer.role is not Role.PREFILL:
            raise MetadataError(
                f"an RDMA connection request names writer {message.src_engine!r}, which is "
                f"registered as a {writer.role.value} engine; only prefill engines write",
                engine_id=message.src_engine,
            )
        if writer.incarnation != message.src_incarnation:
            raise StaleIncarnationError(
                f"an RDMA connection request names incarnation {message.src_incarnation} of "
                f"writer {message.src_engine!r}, which is registered at incarnation "
                f"{writer.incarnation}; the writer must register before it connects",
                engine_id=message.src_engine,
                incarnation=writer.incarnation,
                stale_incarnation=message.src_incarnation,
            )

    def _post_recv(self, qp: Any) -> None:
        api = self.api
        mr = self.device.recv_mr
        qp.post_recv(api.RecvWR(wr_id=0, num_sge=1, sg=[api.SGE(mr.buf, 64, mr.lkey)]))

    def expect_transfer(
        self, engine_id: str, incarnation: int, request_id: str
    ) -> asyncio.Future[VerbsArrival]:
        """Start counting the immediates of `request_id`'s transfers into this engine
        incarnation; the future resolves at the first. Two expected requests whose tags collide
        are refused."""
        expected = self._expected.setdefault((engine_id, incarnation), {})
        tag = transfer_tag(request_id)
        held = expected.get(tag)
        if held is not None:
            if held.request_id == request_id:
                return held.first
            raise PlanError(
                f"requests {held.request_id!r} and {request_id!r} share the 32-bit RDMA transfer tag "
                f"{tag:#x}; give one of them another id",
                request_id=request_id,
            )
        held = _Expected(request_id, asyncio.get_running_loop().create_future())
        expected[tag] = held
        return held.first

    async def arrivals(
        self,
        engine_id: str,
        incarnation: int,
        request_id: str,
        *,
        src_engine: str,
        src_incarnation: int,
        count: int,
    ) -> None:
        """Return once `count` immediates of `request_id` from that writer incarnation have
        arrived. On a reliable connection an immediate completes after every write posted
        before it has landed, so this is the decode side's own proof that the bytes are there.
        The caller bounds the wait (its `wait_for_kv` deadline)."""
        held = self._expected.get((engine_id, incarnation), {}).get(transfer_tag(request_id))
        if held is None or held.request_id != request_id:
            raise PlanError(
                f"engine {engine_id!r} does not expect RDMA writes for request {request_id!r}",
                request_id=request_id,
                engine_id=engine_id,
            )
        writer = (src_engine, src_incarnation)
        if held.counts[writer] >= count:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held.waiters.append((writer, count, waiter))
        await waiter

    def cancel_transfer(self, engine_id: str, incarnation: int, request_id: str) -> None:
        expected = self._expected.get((engine_id, incarnation), {})
        tag = transfer_tag(request_id)
        held = expected.get(tag)
        if held is None or held.request_id != request_id:
            return
        del expected[tag]
        if not held.first.done():
            held.first.cancel()
        for _, _, waiter in held.waiters:
            if not waiter.done():
                waiter.cancel()

    def _on_receive(self, wc: Any) -> None:
        enums = self.api.enums
        accepted = self._accepted.get(wc.qp_num)
        if wc.status != enums.IBV_WC_SUCCESS:
            self.stats["receives_flushed"] += 1
            return
        if accepted is None or accepted.retired:
            self.stats["immediates_dropped_unknown_connection"] += 1
            return
        with contextlib.suppress(*self.api.errors):
            self._post_recv(accepted.qp)
        if wc.opcode != enums.IBV_WC_RECV_RDMA_WITH_IMM:
            self.stats["receives_unexpected_opcode"] += 1
            return
        expected = self._expected.get((accepted.dst_engine, accepted.dst_incarnation))
        held = expected.get(wc.imm_data) if expected is not None else None
        if held is None:
            self.stats["immediates_dropped_unknown"] += 1
            return
        self.stats["immediates_matched"] += 1
        writer = (accepted.src_engine, accepted.src_incarnation)
        held.counts[writer] += 1
        if not held.first.done():
            held.first.set_result(VerbsArrival(held.request_id, *writer, wc.imm_data))
        waiting = []
        for entry in held.waiters:
            entry_writer, needed, waiter = entry
            if entry_writer == writer and held.counts[writer] >= needed:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                waiting.append(entry)
        held.waiters = waiting

    # ---- closing ----

    async def close(self) -> None:
        for connection in list(self._connections.values()):
            self._close_qp(connection.qp)
        self._connections.clear()
        for accepted in self._accepted.values():
            self._close_qp(accepted.qp)
        self._accepted.clear()
        for expected in self._expected.values():
            for held in expected.values():
                held.first.cancel()
                for _, _, waiter in held.waiters:
                    waiter.cancel()
        self._expected.clear()
        self._stop = True
        self._wake.set()
        if self._poller is not None:
            await asyncio.to_thread(self._poller.join, self.settings.notify_timeout_s)
            self._poller = None
        for registration in self._registrations.values():
            registration.close(self.api.errors if self._api is not None else ())
        self._registrations.clear()
        if self._device_handle is not None:
            self._device_handle.close()
            self._device_handle = None


def _check_reply(reply: VerbsAccept, info: EngineInfo) -> None:
    """The decode engine answered for the incarnation the plan is for, with its published regions."""
    if (reply.dst_engine, reply.dst_incarnation) != (info.engine_id, info.incarnation):
        raise StaleIncarnationError(
            f"engine {info.engine_id!r} answered the RDMA connection as {reply.dst_engine!r} "
            f"incarnation {reply.dst_incarnation}, not incarnation {info.incarnation}; look it up again",
            engine_id=info.engine_id,
            incarnation=reply.dst_incarnation,
            stale_incarnation=info.incarnation,
        )
    published = info.regions
    keys = reply.regions
    if len(keys) != len(published) or any(
        key.index != index or key.length != region.length or (region.key and region.key != key.rkey)
        for index, (key, region) in enumerate(zip(keys, published, strict=False))
    ):
        raise MetadataError(
            f"engine {info.engine_id!r} answered the RDMA connection with regions that are not the "
            "ones it published; look it up again",
            engine_id=info.engine_id,
        )


#: enum ibv_wc_status, in order (its values are fixed by the verbs ABI).
_WC_STATUS = [
    "SUCCESS",
    "LOC_LEN_ERR",
    "LOC_QP_OP_ERR",
    "LOC_EEC_OP_ERR",
    "LOC_PROT_ERR",
    "WR_FLUSH_ERR",
    "MW_BIND_ERR",
    "BAD_RESP_ERR",
    "LOC_ACCESS_ERR",
    "REM_INV_REQ_ERR",
    "REM_ACCESS_ERR",
    "REM_OP_ERR",
    "RETRY_EXC_ERR",
    "RNR_RETRY_EXC_ERR",
    "LOC_RDD_VIOL_ERR",
    "REM_INV_RD_REQ_ERR",
    "REM_ABORT_ERR",
    "INV_EECN_ERR",
    "INV_EEC_STATE_ERR",
    "FATAL_ERR",
    "RESP_TIMEOUT_ERR",
    "GENERAL_ERR",
    "TM_ERR",
    "TM_RNDV_INCOMPLETE",
]


def _status_name(status: int) -> str:
    if 0 <= status < len(_WC_STATUS):
        return f"IBV_WC_{_WC_STATUS[status]}"
    return f"work completion status {status}"


def advertise(
    info: EngineInfo, open_transport: Callable[[TransportKind], Transport], settings: Settings
) -> EngineInfo:
    """`info` with this process's RDMA port (`EngineInfo.verbs`) when the verbs transport can
    run here (it is opened now, to answer connections); `info` unchanged otherwise."""
    if VerbsTransport.unavailable_reason(settings) is not None:
        return info
    transport = open_transport(TransportKind.VERBS)
    assert isinstance(transport, VerbsTransport)
    return msgspec.structs.replace(info, verbs=transport.endpoint)
