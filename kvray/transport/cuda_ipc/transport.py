"""`CudaIpcTransport`: the `cuda_ipc` kernels, graphs and allocation checks put together behind
the transport interface (register exports handles, write copies a plan into opened handles).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from kvray.config import Settings
from kvray.content import Stretches
from kvray.errors import (
    RegionError,
    TransportError,
    TransportUnavailableError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.metrics import EngineMetrics
from kvray.placement import MASK64, NOTHING, Stored
from kvray.plan import PartRows, RequestRows, TransferPlan
from kvray.transport.base import (
    Peer,
    PeerCache,
    Reach,
    Transport,
    check_write,
    region_pairs,
)
from kvray.transport.cuda_ipc.allocation import check_inside_allocation, cuda_allocation_range
from kvray.transport.cuda_ipc.digests import DigestCell, give_back, take_cell
from kvray.transport.cuda_ipc.graphs import RowTable, StretchTables, copy_rows, hash_stretches, row_table
from kvray.transport.cuda_ipc.kernels import MAX_GRID_YZ, Digests
from kvray.transport.cuda_ipc.lane import LaneCopies, lane_copies
from kvray.transport.cuda_ipc.ops import Hashing, copy_ops, reading_device
from kvray.transport.cuda_ipc.streams import device_of_uuid, device_uuid, peer_reads, wait_for_events
from kvray.wire import CudaIpcHandle, EngineInfo, RegionDescriptor, TransportKind, decode_cuda_ipc_handle

_handle_encoder = msgspec.msgpack.Encoder()


#: Row tables kept on the GPU per transport (one per pair of engine incarnations and layer list).
_KEPT_ROW_TABLES = 64


@dataclass
class _Opened:
    storage: torch.UntypedStorage
    region: torch.Tensor


class CudaIpcTransport(Transport):
    kind = TransportKind.CUDA_IPC
    needs = "both engines on one node, a CUDA device and Triton"
    reach = Reach.SAME_NODE
    source_kinds = frozenset({MemoryKind.CUDA})
    destination_kinds = frozenset({MemoryKind.CUDA})
    registers = frozenset({MemoryKind.CUDA})

    def __init__(
        self,
        settings: Settings,
        allocation_range: Callable[[int], tuple[int, int]] = cuda_allocation_range,
        *,
        replay_graphs: bool = True,
        metrics: EngineMetrics | None = None,
    ) -> None:
        """`allocation_range`: (start, nbytes) of the CUDA allocation holding a device address.
        `replay_graphs`: write a plan's rows by replaying captured row copies (`copy_rows`);
        False launches the kernel through Triton for every request."""
        super().__init__(settings, metrics)
        self._allocation_range = allocation_range
        self._replay = replay_graphs
        #: The peers' regions opened here, by region index.
        self._opened: PeerCache[int, _Opened] = PeerCache(settings.max_cached_peers)
        #: The writer's reference's row tables on the GPU (`hash_stretches`).
        self._stretch_tables = StretchTables()
        #: Row tables on the GPU, by the identity of the (cached) rows they were built from.
        self._row_tables: OrderedDict[tuple[int, int], tuple[PartRows, PartRows, RowTable]] = OrderedDict()

    @classmethod
    def accepts(cls, peer: EngineInfo) -> bool:
        return all(region.transport is cls.kind and region.handle for region in peer.regions)

    @classmethod
    def unavailable_reason(cls, settings: Settings) -> str | None:
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "the copy kernel needs Triton, which is not installed"
        return None

    def register(
        self, backing: Backing, engine_id: str, incarnation: int, *, remote_writable: bool
    ) -> tuple[RegionDescriptor, ...]:
        if backing.kind is not MemoryKind.CUDA:
            raise RegionError(
                f"the cuda_ipc transport registers CUDA backings; engine {engine_id!r} has a "
                f"{backing.kind.value} backing",
                engine_id=engine_id,
            )
        descriptors = []
        for region in backing.regions:
            storage = region.tensor.untyped_storage()
            handle = b""
            if remote_writable:
                shared = storage._share_cuda_()  # type: ignore[no-untyped-call]
                handle = _handle_encoder.encode(
                    CudaIpcHandle(
                        device_uuid=device_uuid(region.tensor.device.index or 0),
                        handle=bytes(shared[1]),
                        storage_size=int(shared[2]),
                        storage_offset=int(shared[3]),
                        ref_counter_handle=bytes(shared[4]),
                        ref_counter_offset=int(shared[5]),
                        event_handle=bytes(shared[6] or b""),
                        event_sync_required=bool(shared[7]),
                    )
                )
            descriptors.append(
                RegionDescriptor(
                    engine_id=engine_id,
                    incarnation=incarnation,
                    transport=self.kind,
                    index=region.index,
                    address=region.address,
                    length=region.nbytes,
                    handle=handle,
                    # The region's byte offset inside the exported storage.
                    handle_offset=region.address - storage.data_ptr(),
                    remote_writable=remote_writable,
                )
            )
        return tuple(descriptors)

    def hashes(self, local: Backing, peer: Peer) -> bool:
        # Every copy is a kernel of kvray's, which hashes as it moves the bytes.
        return True

    async def reference(self, stretches: Stretches, local: Backing, *, ready: SourceReady = None) -> int:
        if local.kind is not MemoryKind.CUDA:
            return await super().reference(stretches, local)
        regions = [region.tensor for region in local.regions]
        hashes = hash_stretches(stretches, regions, self._stretch_tables, ready)
        digest = 0
        try:
            await wait_for_events([copy.done for copy in hashes], stretches.nbytes_total)
            for copy in hashes:
                digest += (copy.digest() or NOTHING).content or 0
        finally:
            for copy in hashes:
                copy.release(completed=copy.done.query())  # type: ignore[no-untyped-call]
        return digest & MASK64

    async def write(
        self, plan: TransferPlan, local: Backing, peer: Peer, *, ready: SourceReady = None
    ) -> Stored:
        # Every copy reports where it stored (its placement digest) and, for a checked request,
        # the content digest of what it moved (`kvray.content`).
        check_write(plan, local, peer)
        rows = plan.rows
        if rows is not None:
            direct = self._direct_rows(rows, local, peer)
            if direct is not None:
                source, opened, table = direct
                digests = Digests.CONTENT if plan.hashed else Digests.PLACEMENT
                try:
                    copy = copy_rows(
                        opened.region, source, rows, table, replay=self._replay, digests=digests, ready=ready
                    )
                except Exception as error:
                    raise WriteFailedError(
                        f"copy into engine {peer.info.engine_id!r} failed: {error}",
                        engine_id=peer.info.engine_id,
                    ) from error
                # `opened` (what the copy writes into) stays open until the copy has finished.
                try:
                    await wait_for_events([copy.done], plan.nbytes)
                    stored = copy.digest()
                    assert stored is not None
                    return stored
                finally:
                    copy.release(completed=copy.done.query())  # type: ignore[no-untyped-call]
        ops = plan.ops
        events = []
        cells: list[DigestCell] = []
        # What the copies write into stays open until they have finished, even if the peer is
        # forgotten (it left, or fell out of the cache) meanwhile.
        in_use: list[_Opened] = []
        for (local_index, remote_index), select in region_pairs(ops.local_region, ops.remote_region):
            in_use.append(self._open(peer, remote_index))
            target = in_use[-1].region
            source = local.regions[local_index].tensor
            if not source.is_cuda:
                raise TransportError("the cuda_ipc transport copies from CUDA memory")
            cells.append(take_cell(reading_device(target, source)))
            try:
                events.append(
                    copy_ops(
                        target,
                        source,
                        ops.remote_offset[select],
                        ops.local_offset[select],
                        ops.nbytes[select],
                        hashing=Hashing(cells[-1], local_index, remote_index, content=plan.hashed),
                        ready=ready,
                    )
                )
            except Exception as error:
                raise WriteFailedError(
                    f"copy into engine {peer.info.engine_id!r} region {remote_index} failed: {error}",
                    engine_id=peer.info.engine_id,
                ) from error
        # The bytes are in the peer's memory once every copy's event has completed.
        await wait_for_events(events, ops.total_nbytes)
        stored = NOTHING if plan.hashed else Stored(0)
        for cell in cells:
            stored = stored.plus(cell.value(content=plan.hashed))
            give_back(cell)
        return stored

    def lane_copies(self, rows: RequestRows, local: Backing, peer: Peer) -> LaneCopies | None:
        """What a native lane copies `rows`' pairs of layers into `peer` with (`LaneCopies`, none
        captured yet); None where the row kernel cannot write them directly (the lane then leaves
        the pair to the usual path)."""
        direct = self._direct_rows(rows, local, peer)
        if direct is None:
            return None
        source, opened, table = direct
        return lane_copies(opened.region, source, table, opened)

    def _direct_rows(
        self, rows: RequestRows, local: Backing, peer: Peer
    ) -> tuple[torch.Tensor, _Opened, RowTable] | None:
        """The source, the opened target and the row table when the row kernel can write the
        plan: every row in one local and one remote region, the destination GPU reads the
        source directly, and the rows fit a grid; None sends the plan down the op-table path.
        The table, and what it says of the rows, is built once per (cached) pair of rows."""
        if rows.local.base.size == 0 or rows.local.base.size > MAX_GRID_YZ:
            return None
        key = (id(rows.local), id(rows.remote))
        cached = self._row_tables.get(key)
        if cached is None or cached[0] is not rows.local or cached[1] is not rows.remote:
            device = self._open(peer, int(rows.remote.region[0])).region.device
            table = row_table(rows, device)
            # The rows are kept with their table, so their ids stay theirs while it is cached.
            cached = (rows.local, rows.remote, table)
            self._row_tables[key] = cached
            while len(self._row_tables) > _KEPT_ROW_TABLES:
                self._row_tables.popitem(last=False)
        table = cached[2]
        if table.regions is None or table.pieces > MAX_GRID_YZ:
            return None
        local_index, remote_index = table.regions
        source = local.regions[local_index].tensor
        if not source.is_cuda:
            raise TransportError("the cuda_ipc transport copies from CUDA memory")
        target = self._open(peer, remote_index)
        device = target.region.device
        if device != table.table.device or not peer_reads(device.index or 0, source.device.index or 0):
            return None
        return source, target, table

    def _open(self, peer: Peer, index: int) -> _Opened:
        info = peer.info
        opened = self._opened.get(info.engine_id, info.incarnation, index)
        if opened is not None:
            return opened
        region = info.regions[index]
        if not region.handle:
            raise TransportError(
                f"engine {info.engine_id!r} region {index} has no CUDA IPC handle; its backing is "
                "not on a GPU, or it was not registered for cuda_ipc",
                engine_id=info.engine_id,
            )
        try:
            handle = decode_cuda_ipc_handle(region.handle)
        except WireDecodeError as error:
            raise TransportError(
                f"engine {info.engine_id!r} sent a malformed CUDA IPC handle: {error}",
                engine_id=info.engine_id,
            ) from None
        if region.handle_offset + region.length > handle.storage_size:
            raise RegionError(
                f"engine {info.engine_id!r} describes region {index} beyond its exported storage",
                engine_id=info.engine_id,
            )
        device = device_of_uuid(handle.device_uuid)
        try:
            torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
            storage = torch.UntypedStorage._new_shared_cuda(
                device,
                handle.handle,
                handle.storage_size,
                handle.storage_offset,
                handle.ref_counter_handle,
                handle.ref_counter_offset,
                handle.event_handle or None,
                handle.event_sync_required,
            )
        except Exception as error:
            raise TransportUnavailableError(
                f"cannot open engine {info.engine_id!r}'s CUDA memory: {error}; cuda_ipc needs both "
                "engines on one node",
                engine_id=info.engine_id,
            ) from error
        with torch.cuda.device(device):
            allocation = self._allocation_range(storage.data_ptr())
        check_inside_allocation(
            storage.data_ptr() + region.handle_offset,
            region.length,
            allocation,
            engine_id=info.engine_id,
            region=index,
        )
        tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
        tensor.set_(storage, region.handle_offset, (region.length,), (1,))
        opened = _Opened(storage, tensor)
        self._opened.put(info.engine_id, info.incarnation, index, opened)
        return opened

    def forget(self, engine_id: str) -> None:
        self._opened.forget(engine_id)
        # Row tables are small and keyed by rows the offset cache drops with the engine.

    async def close(self) -> None:
        for index in range(torch.cuda.device_count()):
            await asyncio.to_thread(torch.cuda.synchronize, index)
        self._opened.clear()
        self._row_tables.clear()
        self._stretch_tables.clear()
