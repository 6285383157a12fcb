"""A FAKE RDMA device for tests: the subset of pyverbs the `verbs` transport uses, in-process.

It is not pyverbs and not a NIC. It exists so the transport's logic (registration, the
handshake, QP state transitions, work requests, completions, immediates, error handling) runs
without hardware. What it enforces, as real hardware would:

- a memory region covers [address, address + length) of its protection domain and nothing else;
  an SGE outside a local MR is IBV_WC_LOC_PROT_ERR, a remote range outside the MR its rkey names,
  or in an MR without REMOTE_WRITE, or through a QP without REMOTE_WRITE, is IBV_WC_REM_ACCESS_ERR;
- a reliable connection needs both QPs connected to each other in RTR/RTS (else
  IBV_WC_RETRY_EXC_ERR), posting needs RTS, SGE count and queue depth are bounded;
- an error completion moves the QP to the error state and every later queued request completes
  as IBV_WC_WR_FLUSH_ERR (signalled or not), as does moving the QP to ERR by hand;
- a WRITE WITH IMMEDIATE consumes a posted receive of the responder (none: RNR_RETRY_EXC_ERR) and
  completes it with IBV_WC_RECV_RDMA_WITH_IMM and the immediate.

Requests are executed in order by one "NIC" thread, which moves bytes through
`kvray.transport.cpu_copy.scatter_copy` (looked up per copy, so tests that gate copies gate it too).

GPU memory is faked too (`FakeGpuDirect`, the `GpuDirect` seam of kvray.transport.verbs.gpudirect):
the "GPU memory" is the CPU memory of regions labelled CUDA, a dma-buf is the read end of a pipe
the fabric maps back to the memory it exports, and a dma-buf memory region (`FakeDmaBufMR`) is
addressed from its offset into the dma-buf, as pyverbs' is (iova = offset): the NIC translates
those addresses to the exported memory, so a write addressed as a plain MR would be refused.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import mmap
import os
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvray.errors import RegionError
from kvray.transport import cpu_copy
from kvray.transport.verbs import VerbsApi


class FakePyverbsError(Exception):
    """Stands in for pyverbs.pyverbs_error.PyverbsError."""


class FakePyverbsRDMAError(FakePyverbsError):
    """Stands in for PyverbsRDMAError (what get_device_list raises when there is no device)."""


ENUMS = SimpleNamespace(
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_WRITE_WITH_IMM=1,
    IBV_SEND_SIGNALED=2,
    IBV_QPT_RC=2,
    IBV_QPS_RESET=0,
    IBV_QPS_INIT=1,
    IBV_QPS_RTR=2,
    IBV_QPS_RTS=3,
    IBV_QPS_ERR=6,
    IBV_QP_STATE=1,
    IBV_WC_SUCCESS=0,
    IBV_WC_LOC_PROT_ERR=4,
    IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_WC_RETRY_EXC_ERR=12,
    IBV_WC_RNR_RETRY_EXC_ERR=13,
    IBV_WC_RDMA_WRITE=1,
    IBV_WC_RECV_RDMA_WITH_IMM=129,
    IBV_MTU_4096=5,
    IBV_LINK_LAYER_ETHERNET=2,
)
E = ENUMS


class FakeFabric:
    """Devices, memory regions and queue pairs of one fake network, and its NIC thread."""

    def __init__(
        self, devices: tuple[str, ...] = ("fake_rdma0",), *, max_sge: int = 4, dmabuf: bool = True
    ) -> None:
        self.device_names = devices
        self.max_sge = max_sge
        #: Whether the devices register dma-bufs (ibv_reg_dmabuf_mr).
        self.dmabuf = dmabuf
        #: Exported dma-bufs by the (st_dev, st_ino) of their descriptor: (address, length).
        self.dmabufs: dict[tuple[int, int], tuple[int, int]] = {}
        #: The GPU side of this fake node (`VerbsTransport(..., gpudirect=fabric.gpudirect)`).
        self.gpudirect = FakeGpuDirect(self)
        self.max_qp_wr = 128
        self.max_msg_sz = 2**31
        self.lock = threading.Condition()
        self.qps: dict[int, FakeQP] = {}
        self.mrs: dict[int, FakeMR] = {}
        self.work: collections.deque[tuple[FakeQP, FakeSendWR]] = collections.deque()
        self._numbers = itertools.count(0x100)
        self._keys = itertools.count(0x1000)
        self.thread: threading.Thread | None = None
        #: Every request the NIC executed: (opcode, number of SGEs, bytes, signalled).
        self.executed: list[tuple[int, int, int, bool]] = []

    def gid(self, device: str) -> str:
        index = self.device_names.index(device) + 1
        return f"0000:0000:0000:0000:0000:ffff:7f00:{index:04x}"

    def new_number(self) -> int:
        return next(self._numbers)

    def new_key(self) -> int:
        return next(self._keys)

    def api(self) -> VerbsApi:
        return VerbsApi(
            get_device_list=self.get_device_list,
            Context=lambda name: FakeContext(self, name),
            PD=FakePD,
            MR=FakeMR,
            DmaBufMR=FakeDmaBufMR,
            CQ=FakeCQ,
            QP=FakeQP,
            QPCap=FakeQPCap,
            QPInitAttr=FakeQPInitAttr,
            QPAttr=FakeQPAttr,
            AHAttr=FakeAHAttr,
            GlobalRoute=FakeGlobalRoute,
            GID=FakeGID,
            SGE=FakeSGE,
            SendWR=FakeSendWR,
            RecvWR=FakeRecvWR,
            enums=ENUMS,
            errors=(FakePyverbsError,),
        )

    def get_device_list(self) -> list[Any]:
        if not self.device_names:
            raise FakePyverbsRDMAError("Failed to get devices list")  # as pyverbs does with none
        return [SimpleNamespace(name=name.encode()) for name in self.device_names]

    # ---- the NIC ----

    def submit(self, qp: FakeQP, wr: FakeSendWR) -> None:
        with self.lock:
            self.work.append((qp, wr))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="fake-rdma-nic", daemon=True)
                self.thread.start()
            self.lock.notify()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.work:
                    self.lock.wait()
                qp, wr = self.work.popleft()
            self._execute(qp, wr)

    def _execute(self, qp: FakeQP, wr: FakeSendWR) -> None:
        with self.lock:
            qp.queued -= 1
            if qp.closed:
                return
            if qp.state == E.IBV_QPS_ERR:
                qp.complete(wr, E.IBV_WC_WR_FLUSH_ERR, always=True)
                return
            status, copy = self._check(qp, wr)
        if status == E.IBV_WC_SUCCESS and copy is not None:
            dst_base, src_addresses, dst_offsets, lengths = copy
            if lengths.size:
                cpu_copy.scatter_copy(dst_base, 0, dst_offsets, src_addresses, lengths)
        with self.lock:
            self.executed.append((wr.opcode, wr.num_sge, int(sum(s.length for s in wr.sg)), wr.signalled))
            if status != E.IBV_WC_SUCCESS:
                qp.complete(wr, status, always=True)
                qp.set_error()
                return
            if wr.opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM:
                remote = self.qps[qp.dest_qp_num]
                receive = remote.receives.popleft()
                remote.rcq.push(
                    FakeWC(
                        wr_id=receive.wr_id,
                        status=E.IBV_WC_SUCCESS,
                        opcode=E.IBV_WC_RECV_RDMA_WITH_IMM,
                        qp_num=remote.qp_num,
                        imm_data=wr.imm_data,
                        byte_len=int(sum(s.length for s in wr.sg)),
                    )
                )
            qp.complete(wr, E.IBV_WC_SUCCESS)

    def _check(self, qp: FakeQP, wr: FakeSendWR) -> tuple[int, Any]:
        """The status the request completes with and, when it may, the copy to make."""
        for sge in wr.sg:
            mr = self.mrs.get(sge.lkey)
            if mr is None or mr.pd is not qp.pd or not mr.covers(sge.addr, sge.length):
                return E.IBV_WC_LOC_PROT_ERR, None
        remote = self.qps.get(qp.dest_qp_num)
        if (
            remote is None
            or remote.closed
            or remote.state not in (E.IBV_QPS_RTR, E.IBV_QPS_RTS)
            or remote.dest_qp_num != qp.qp_num
            or remote.context.gid != qp.dgid
        ):
            return E.IBV_WC_RETRY_EXC_ERR, None
        total = int(sum(sge.length for sge in wr.sg))
        target = self.mrs.get(wr.rkey)
        if (
            target is None
            or target.pd is not remote.pd
            or not target.access & E.IBV_ACCESS_REMOTE_WRITE
            or not remote.access & E.IBV_ACCESS_REMOTE_WRITE
            or not target.covers(wr.remote_addr, total)
        ):
            return E.IBV_WC_REM_ACCESS_ERR, None
        if wr.opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM and not remote.receives:
            return E.IBV_WC_RNR_RETRY_EXC_ERR, None
        lengths = np.array([sge.length for sge in wr.sg], dtype=np.int64)
        dst_offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        src_addresses = np.array([self.mrs[sge.lkey].host_address(sge.addr) for sge in wr.sg], dtype=np.int64)
        return E.IBV_WC_SUCCESS, (target.host_address(wr.remote_addr), src_addresses, dst_offsets, lengths)


class FakeContext:
    def __init__(self, fabric: FakeFabric, name: str) -> None:
        if name not in fabric.device_names:
            raise FakePyverbsRDMAError(f"No IB device with name {name!r}")
        self.fabric = fabric
        self.name = name
        self.gid = fabric.gid(name)

    def query_port(self, port: int) -> Any:
        if port != 1:
            raise FakePyverbsRDMAError(f"Failed to query port {port}")
        return SimpleNamespace(
            state=4,
            lid=0,
            active_mtu=E.IBV_MTU_4096,
            link_layer=E.IBV_LINK_LAYER_ETHERNET,
            max_msg_sz=self.fabric.max_msg_sz,
            gid_tbl_len=2,
        )

    def query_device(self) -> Any:
        return SimpleNamespace(max_sge=self.fabric.max_sge, max_qp_wr=self.fabric.max_qp_wr, max_cqe=65536)

    def query_gid(self, port: int, index: int) -> FakeGID:
        if index == 0:
            return FakeGID("fe80:0000:0000:0000:0000:0000:0000:0001")
        if index == 1:
            return FakeGID(self.gid)
        raise FakePyverbsRDMAError(f"Failed to query gid {index}")

    def close(self) -> None:
        pass


class FakePD:
    def __init__(self, context: FakeContext) -> None:
        self.context = context

    def close(self) -> None:
        pass


class FakeMR:
    def __init__(
        self, pd: FakePD, length: int, access: int, address: int | None = None, *, host: int | None = None
    ) -> None:
        self.pd = pd
        self.access = access
        self.length = length
        self._own = None
        if address is None:
            self._own = ctypes.create_string_buffer(length)
            address = ctypes.addressof(self._own)
        #: The MR's first address as work requests name it.
        self.buf = address
        #: Where that byte is in this process's memory (the same, but for a dma-buf MR).
        self.host = address if host is None else host
        fabric = pd.context.fabric
        with fabric.lock:
            self.lkey = fabric.new_key()
            self.rkey = fabric.new_key()
            fabric.mrs[self.lkey] = self
            fabric.mrs[self.rkey] = self

    def covers(self, address: int, length: int) -> bool:
        return length >= 0 and self.buf <= address and address + length <= self.buf + self.length

    def host_address(self, address: int) -> int:
        """Where `address` of this MR (covered) is in this process's memory."""
        return self.host + (address - self.buf)

    def close(self) -> None:
        fabric = self.pd.context.fabric
        with fabric.lock:
            fabric.mrs.pop(self.lkey, None)
            fabric.mrs.pop(self.rkey, None)


class FakeDmaBufMR(FakeMR):
    """A dma-buf memory region, as pyverbs' `DmaBufMR(pd, length, access, dmabuf=fd, offset=...)`:
    it covers [offset, offset + length) of the dma-buf, and work requests address it from
    `offset` (iova = offset). The descriptor may be closed once it is registered."""

    def __init__(
        self, pd: FakePD, length: int, access: int, dmabuf: Any = None, offset: int = 0, **_: Any
    ) -> None:
        fabric = pd.context.fabric
        if not fabric.dmabuf:
            raise FakePyverbsRDMAError("the fake device has no dma-buf support")
        if not isinstance(dmabuf, int):
            raise FakePyverbsError("the fake device registers dma-bufs by file descriptor only")
        try:
            status = os.fstat(dmabuf)
        except OSError as error:
            raise FakePyverbsRDMAError(f"Failed to register a dma-buf MR ({error})") from error
        exported = fabric.dmabufs.get((status.st_dev, status.st_ino))
        if exported is None or offset < 0 or offset + length > exported[1]:
            raise FakePyverbsRDMAError("Failed to register a dma-buf MR (not a dma-buf, or past its end)")
        super().__init__(pd, length, access, address=offset, host=exported[0] + offset)
        self.offset = offset


class FakeGpuDirect:
    """FAKE GPUDirect (the `GpuDirect` seam): GPUs that do or do not export dma-buf (`dmabuf`, one
    entry per GPU), the NVIDIA open kernel module, a peer-memory module. A dma-buf descriptor is
    the read end of a pipe, registered with the fabric; whether kvray closed it shows as a write to
    the pipe failing (`descriptors_closed`). Driver questions are recorded in `calls`."""

    def __init__(self, fabric: FakeFabric) -> None:
        self.fabric = fabric
        self.dmabuf: tuple[bool, ...] = (True,)
        self.open_module = True
        self.peer_memory: str | None = None
        #: The GPU every address belongs to.
        self.device = 0
        #: Addresses the "driver" refuses a dma-buf for.
        self.refused: set[int] = set()
        self.calls: list[str] = []
        #: (read end, write end) of every dma-buf handed out.
        self.exported: list[tuple[int, int]] = []

    def device_count(self) -> int:
        self.calls.append("device_count")
        return len(self.dmabuf)

    def device_of(self, address: int) -> int:
        self.calls.append("device_of")
        return self.device

    def dmabuf_supported(self, device: int) -> bool:
        self.calls.append("dmabuf_supported")
        if not 0 <= device < len(self.dmabuf):
            raise RegionError(f"the fake CUDA driver has no GPU {device}")
        return self.dmabuf[device]

    def dmabuf_fd(self, address: int, nbytes: int) -> int:
        self.calls.append("dmabuf_fd")
        if address % mmap.PAGESIZE or nbytes % mmap.PAGESIZE or address in self.refused:
            raise RegionError(f"the fake CUDA driver refused a dma-buf for {address:#x} (+{nbytes})")
        read_end, write_end = os.pipe()
        status = os.fstat(read_end)
        self.fabric.dmabufs[(status.st_dev, status.st_ino)] = (address, nbytes)
        self.exported.append((read_end, write_end))
        return read_end

    def open_kernel_module(self) -> bool:
        return self.open_module

    def peer_memory_module(self) -> str | None:
        return self.peer_memory

    def descriptors_closed(self) -> list[bool]:
        """Per dma-buf handed out: whether every descriptor of its read end is closed."""
        closed = []
        for _, write_end in self.exported:
            try:
                os.write(write_end, b"x")
            except BrokenPipeError:
                closed.append(True)
            else:
                closed.append(False)
        return closed

    def close(self) -> None:
        for _, write_end in self.exported:
            os.close(write_end)
        self.exported.clear()


@dataclass
class FakeWC:
    wr_id: int
    status: int
    opcode: int
    qp_num: int
    imm_data: int = 0
    byte_len: int = 0
    vendor_err: int = 0


class FakeCQ:
    def __init__(self, context: FakeContext, cqe: int) -> None:
        self.fabric = context.fabric
        self.entries: collections.deque[FakeWC] = collections.deque()

    def push(self, wc: FakeWC) -> None:
        self.entries.append(wc)

    def poll(self, num_entries: int = 1) -> tuple[int, list[FakeWC]]:
        with self.fabric.lock:
            taken = [self.entries.popleft() for _ in range(min(num_entries, len(self.entries)))]
        return len(taken), taken

    def close(self) -> None:
        pass


@dataclass
class FakeQPCap:
    max_send_wr: int = 1
    max_recv_wr: int = 10
    max_send_sge: int = 1
    max_recv_sge: int = 1


@dataclass
class FakeQPInitAttr:
    qp_type: int
    scq: FakeCQ
    rcq: FakeCQ
    cap: FakeQPCap
    sq_sig_all: int = 1


@dataclass
class FakeGlobalRoute:
    dgid: FakeGID
    sgid_index: int = 0


@dataclass
class FakeAHAttr:
    dlid: int = 0
    is_global: int = 0
    port_num: int = 1
    gr: FakeGlobalRoute | None = None


@dataclass
class FakeQPAttr:
    qp_state: int = E.IBV_QPS_INIT
    port_num: int = 1
    path_mtu: int = 3
    qp_access_flags: int = 0
    pkey_index: int = 0
    dest_qp_num: int = 0
    rq_psn: int = 0
    sq_psn: int = 0
    max_dest_rd_atomic: int = 0
    max_rd_atomic: int = 0
    min_rnr_timer: int = 0
    timeout: int = 0
    retry_cnt: int = 0
    rnr_retry: int = 0
    ah_attr: FakeAHAttr | None = None


class FakeGID:
    def __init__(self, val: str | None = None) -> None:
        self.value = val or "0000:0000:0000:0000:0000:0000:0000:0000"

    def __str__(self) -> str:
        return self.value


@dataclass
class FakeSGE:
    addr: int
    length: int
    lkey: int


@dataclass
class FakeRecvWR:
    wr_id: int = 0
    num_sge: int = 0
    sg: list[FakeSGE] | None = None


@dataclass
class FakeSendWR:
    wr_id: int = 0
    opcode: int = E.IBV_WR_RDMA_WRITE
    num_sge: int = 0
    imm_data: int = 0
    sg: list[FakeSGE] = field(default_factory=list)
    send_flags: int = E.IBV_SEND_SIGNALED
    rkey: int = 0
    remote_addr: int = 0

    def __post_init__(self) -> None:
        if self.num_sge < 1 or len(self.sg) != self.num_sge:
            raise FakePyverbsError("A WR needs at least one SGE")

    @property
    def signalled(self) -> bool:
        return bool(self.send_flags & E.IBV_SEND_SIGNALED)

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey = rkey
        self.remote_addr = addr


class FakeQP:
    def __init__(self, pd: FakePD, init_attr: FakeQPInitAttr) -> None:
        if init_attr.qp_type != E.IBV_QPT_RC:
            raise FakePyverbsError("the fake device makes RC queue pairs only")
        self.pd = pd
        self.context = pd.context
        self.fabric = pd.context.fabric
        self.cap = init_attr.cap
        self.scq = init_attr.scq
        self.rcq = init_attr.rcq
        self.sq_sig_all = init_attr.sq_sig_all
        self.state = E.IBV_QPS_RESET
        self.access = 0
        self.dest_qp_num = -1
        self.dgid = ""
        self.receives: collections.deque[FakeRecvWR] = collections.deque()
        self.queued = 0
        self.closed = False
        with self.fabric.lock:
            self.qp_num = self.fabric.new_number()
            self.fabric.qps[self.qp_num] = self

    def to_init(self, attr: FakeQPAttr) -> None:
        if self.state != E.IBV_QPS_RESET:
            raise FakePyverbsRDMAError("Failed to modify QP state to init")
        self.access = attr.qp_access_flags
        self.state = E.IBV_QPS_INIT

    def to_rtr(self, attr: FakeQPAttr) -> None:
        if self.state != E.IBV_QPS_INIT or attr.ah_attr is None:
            raise FakePyverbsRDMAError("Failed to modify QP state to RTR")
        route = attr.ah_attr.gr
        if not attr.ah_attr.is_global or route is None:
            raise FakePyverbsRDMAError("Failed to modify QP state to RTR (RoCE needs a GRH)")
        self.dest_qp_num = attr.dest_qp_num
        self.dgid = str(route.dgid)
        self.state = E.IBV_QPS_RTR

    def to_rts(self, attr: FakeQPAttr) -> None:
        if self.state != E.IBV_QPS_RTR:
            raise FakePyverbsRDMAError("Failed to modify QP state to RTS")
        self.state = E.IBV_QPS_RTS

    def modify(self, attr: FakeQPAttr, mask: int) -> None:
        if mask != E.IBV_QP_STATE or attr.qp_state != E.IBV_QPS_ERR:
            raise FakePyverbsError("the fake device only moves queue pairs to ERR by hand")
        with self.fabric.lock:
            self.set_error()

    def set_error(self) -> None:
        """ERR: posted receives complete as flushed; queued sends do when the NIC reaches them."""
        self.state = E.IBV_QPS_ERR
        while self.receives:
            receive = self.receives.popleft()
            self.rcq.push(FakeWC(receive.wr_id, E.IBV_WC_WR_FLUSH_ERR, 0, self.qp_num))

    def complete(self, wr: FakeSendWR, status: int, *, always: bool = False) -> None:
        if always or wr.signalled or self.sq_sig_all:
            self.scq.push(FakeWC(wr.wr_id, status, E.IBV_WC_RDMA_WRITE, self.qp_num))

    def post_send(self, wr: FakeSendWR) -> None:
        if self.state != E.IBV_QPS_RTS:
            raise FakePyverbsRDMAError("Failed to post send (QP not in RTS)")
        if wr.num_sge > self.cap.max_send_sge:
            raise FakePyverbsRDMAError(f"Failed to post send ({wr.num_sge} SGEs > {self.cap.max_send_sge})")
        with self.fabric.lock:
            if self.queued >= self.cap.max_send_wr:
                raise FakePyverbsRDMAError("Failed to post send (send queue full)")
            self.queued += 1
        self.fabric.submit(self, wr)

    def post_recv(self, wr: FakeRecvWR) -> None:
        if self.state == E.IBV_QPS_RESET:
            raise FakePyverbsRDMAError("Failed to post recv")
        with self.fabric.lock:
            self.receives.append(wr)

    def close(self) -> None:
        with self.fabric.lock:
            self.closed = True
            self.fabric.qps.pop(self.qp_num, None)
