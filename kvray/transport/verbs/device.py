"""The RDMA device of the `verbs` transport: pyverbs behind one seam (`VerbsApi`), the device
chosen by name or locality, the queue pairs made on it, and the thread that polls its CQs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvray.config import Settings
from kvray.errors import TransportError, TransportUnavailableError
from kvray.transport.verbs.requests import DeviceLimits
from kvray.wire import VerbsEndpoint

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


# ---- choosing a device --------------------------------------------------------------------------


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


def probe(settings: Settings, api: VerbsApi | None = None) -> str | None:
    """None when the verbs transport can run here, else one sentence saying why not (not cached)."""
    try:
        api = api or load_pyverbs()
    except ImportError as error:
        if "pyverbs" in str(error) and "No module named" in str(error):
            return "pyverbs is not installed (pip install 'kvray[rdma]', see docs/rdma.md)"
        return f"pyverbs cannot load its libraries ({error}); see docs/rdma.md"
    except OSError as error:
        return f"pyverbs cannot load its libraries ({error}); see docs/rdma.md"
    try:
        device = Device(api, settings)
    except TransportUnavailableError as error:
        return str(error)
    except api.errors as error:
        return f"the RDMA device cannot be opened ({error})"
    device.close()
    return None


# ---- the device ---------------------------------------------------------------------------------


class Device:
    """An opened RDMA device: context, protection domain, port, completion queues (one for
    sends, one for receives), and the queue pairs made on them."""

    def __init__(self, api: VerbsApi, settings: Settings) -> None:
        self.api = api
        self.settings = settings
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

    def limits(self) -> DeviceLimits:
        return DeviceLimits(
            max_sge=max(1, min(self.attr.max_sge, 30)),
            max_message_nbytes=self.port.max_msg_sz,
            # A chunk of unsignalled requests must fit the send queue.
            signal_every=min(self.settings.verbs_signal_every, self.queue_depth()),
        )

    def queue_depth(self) -> int:
        return max(1, min(self.settings.verbs_queue_depth, int(self.attr.max_qp_wr)))

    # ---- queue pairs ----

    def create_qp(self, *, access: int) -> Any:
        """A reliable-connected queue pair in INIT, allowing `access` to its peer."""
        api = self.api
        enums = api.enums
        cap = api.QPCap(
            max_send_wr=self.queue_depth(),
            max_recv_wr=RECV_DEPTH,
            max_send_sge=self.limits().max_sge,
            max_recv_sge=1,
        )
        init_attr = api.QPInitAttr(
            qp_type=enums.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap, sq_sig_all=0
        )
        try:
            qp = api.QP(self.pd, init_attr)
            attr = api.QPAttr(port_num=self.port_num)
            attr.qp_access_flags = access
            attr.pkey_index = 0
            qp.to_init(attr)
        except api.errors as error:
            raise TransportError(f"creating an RDMA queue pair on {self.name} failed: {error}") from error
        return qp

    def connect_qp(
        self, qp: Any, remote: VerbsEndpoint, remote_qp_num: int, *, rq_psn: int, sq_psn: int
    ) -> None:
        """INIT -> RTR -> RTS, facing the remote queue pair."""
        api = self.api
        attr = api.QPAttr(port_num=self.port_num, path_mtu=min(self.endpoint.mtu, remote.mtu))
        attr.dest_qp_num = remote_qp_num
        attr.rq_psn = rq_psn
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        routed = remote.link_layer == _LINK_LAYER_ETHERNET or remote.lid == 0
        route = api.GlobalRoute(dgid=api.GID(remote.gid), sgid_index=self.gid_index) if routed else None
        attr.ah_attr = api.AHAttr(
            dlid=remote.lid, is_global=1 if routed else 0, port_num=self.port_num, gr=route
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

    def set_error(self, qp: Any) -> None:
        """Move the queue pair to the error state: everything still queued completes as flushed."""
        attr = self.api.QPAttr()
        attr.qp_state = self.api.enums.IBV_QPS_ERR
        with contextlib.suppress(*self.api.errors):
            qp.modify(attr, self.api.enums.IBV_QP_STATE)

    def post_recv(self, qp: Any) -> None:
        api = self.api
        mr = self.recv_mr
        qp.post_recv(api.RecvWR(wr_id=0, num_sge=1, sg=[api.SGE(mr.buf, 64, mr.lkey)]))

    def close_qp(self, qp: Any) -> None:
        with contextlib.suppress(*self.api.errors):
            qp.close()

    def close(self) -> None:
        for resource in (self.recv_mr, self.send_cq, self.recv_cq, self.pd, self.context):
            with contextlib.suppress(*self.api.errors):
                resource.close()


class CompletionPoller:
    """The thread that drains a device's two completion queues and hands each batch to the
    event loop it serves: `on_completions(sends, receives)` there, or `on_failure(error)` once
    if polling fails. It polls while `busy()` says work may complete, else waits for `wake`."""

    def __init__(
        self,
        device: Device,
        loop: asyncio.AbstractEventLoop,
        *,
        on_completions: Callable[[list[Any], list[Any]], None],
        on_failure: Callable[[Exception], None],
        busy: Callable[[], bool],
    ) -> None:
        self.loop = loop
        self._device = device
        self._on_completions = on_completions
        self._on_failure = on_failure
        self._busy = busy
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvray-verbs-cq", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    async def stop(self, timeout_s: float) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, timeout_s)

    def _run(self) -> None:
        loop = self.loop
        while not self._stop:
            try:
                _, sends = self._device.send_cq.poll(64)
                _, receives = self._device.recv_cq.poll(64)
            except Exception as error:
                if not self._stop:
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(self._on_failure, error)
                return
            if sends or receives:
                with contextlib.suppress(RuntimeError):  # the loop closed under us
                    loop.call_soon_threadsafe(self._on_completions, sends, receives)
                continue
            if self._busy():
                self._wake.wait(_IDLE_POLL_S)
            else:
                self._wake.wait()
            self._wake.clear()
