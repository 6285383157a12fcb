"""`cuda_ipc` transport: same node, GPU. The decode backing's CUDA allocation is exported once
as a CUDA IPC handle (with the region's offset inside it, in the region descriptor); the
prefill process opens it once per peer incarnation and writes a plan's ops with batched copies,
never one launch per block: ONE Triton kernel launch per region pair, on the decode engine's
GPU (each program copies one op, or one piece of a long op, with wide loads and stores). A plan
that carries its rows is written by replaying a CUDA graph captured once per row table, source,
target and size: a small kernel fetching the block ids from a pinned buffer, then a kernel that
expands the ops.
Across two GPUs with peer access (NVLink) that kernel loads the source over the link; without
peer access, a gather kernel, one device-to-device copy and a scatter kernel stage it.
Completion waits for the last event off the event loop.

Both GPUs must be visible to the writing process (the IPC handle is opened on the decode
engine's device, found by UUID); Ray GPU actors that only see their own GPU need
`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1` or a placement that shares visibility.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from kvray.config import Settings
from kvray.errors import (
    RegionError,
    TransportError,
    TransportUnavailableError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.layout import Int64Array
from kvray.memory import Backing, MemoryKind
from kvray.plan import PartRows, RequestRows, TransferPlan, split_ops
from kvray.transport.base import Peer, PeerCache, Reach, Transport, check_write, region_pairs
from kvray.wire import CudaIpcHandle, EngineInfo, RegionDescriptor, TransportKind, decode_cuda_ipc_handle

#: Bytes one kernel program copies at most (longer ops are cut into pieces of this size).
MAX_PIECE_NBYTES = 256 * 1024
#: How long a write polls its copies' event from the event loop before a thread waits for it:
#: this much, plus the time the bytes take at `POLL_BYTES_PER_S` (a third of NVLink's rate).
POLL_FLOOR_S = 200e-6
POLL_BYTES_PER_S = 120e9


_handle_encoder = msgspec.msgpack.Encoder()


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_of_uuid(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise TransportError(
        f"GPU {uuid} is not visible to this process; the cuda_ipc writer must see the decode "
        "engine's GPU (check CUDA_VISIBLE_DEVICES)",
        device_uuid=uuid,
    )


def pick_unit(*arrays: Int64Array, bases: tuple[int, ...] = ()) -> int:
    """The widest element size (16..1 bytes) that divides every offset, size and base address."""
    combined = 0
    for array in arrays:
        if array.size:
            combined |= int(np.bitwise_or.reduce(array))
    for base in bases:
        combined |= base
    for unit in (16, 8, 4, 2):
        if combined % unit == 0:
            return unit
    return 1


@functools.cache
def _kernel() -> Any:
    """The copy kernel, compiled on first use (Triton is imported only here). It runs on the
    destination's GPU; the source may sit on another GPU, read over NVLink through peer access.
    Program i copies op i of `table` (source offsets, then target offsets, then sizes, in
    bytes; each a multiple of the element width 2**SHIFT)."""
    import triton
    import triton.language as tl

    def copy_pieces(  # type: ignore[no-untyped-def]
        src, dst, table, count, SHIFT: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr
    ):
        piece = tl.program_id(0)
        source = tl.load(table + piece) >> SHIFT
        target = tl.load(table + count + piece) >> SHIFT
        length = tl.load(table + 2 * count + piece) >> SHIFT
        if VEC > 1:
            # Every offset is a multiple of VEC elements: lets the compiler use 16-byte accesses.
            source = tl.multiple_of(source, VEC)
            target = tl.multiple_of(target, VEC)
            length = tl.multiple_of(length, VEC)
        for start in tl.range(0, length, BLOCK):
            index = start + tl.arange(0, BLOCK)
            mask = index < length
            values = tl.load(src + source + index, mask=mask)
            tl.store(dst + target + index, values, mask=mask)

    return triton.jit(copy_pieces)


@functools.cache
def _rows_kernel() -> Any:
    """The copy kernel for a plan's rows (`kvray.plan.RequestRows`): it expands the ops itself,
    so the host uploads only the request's block ids. Program (i, r, k) copies piece k (of
    PIECE bytes) of the op of block pair i in row r. `rows` holds five columns of `num_rows`
    (local base, remote base, local block stride, remote block stride, bytes); `ids` holds the
    number of block pairs, then `capacity` local ids, then `capacity` remote ids. The grid may
    have up to `capacity` pairs (one captured launch serves every request up to that size):
    programs past the count copy nothing. Every byte quantity is a multiple of the element
    width 2**SHIFT."""
    import triton
    import triton.language as tl

    def copy_rows(  # type: ignore[no-untyped-def]
        src,
        dst,
        rows,
        ids,
        num_rows,
        capacity,
        SHIFT: tl.constexpr,
        PIECE: tl.constexpr,
        BLOCK: tl.constexpr,
        VEC: tl.constexpr,
    ):
        pair = tl.program_id(0)
        row = tl.program_id(1)
        skip = tl.program_id(2).to(tl.int64) * PIECE
        live = pair < tl.load(ids)
        local_id = tl.load(ids + 1 + pair, mask=live, other=0)
        remote_id = tl.load(ids + 1 + capacity + pair, mask=live, other=0)
        local_base = tl.load(rows + row)
        remote_base = tl.load(rows + num_rows + row)
        local_stride = tl.load(rows + 2 * num_rows + row)
        remote_stride = tl.load(rows + 3 * num_rows + row)
        nbytes = tl.load(rows + 4 * num_rows + row)
        # A row shorter than the longest has pieces past its end: they copy nothing.
        length = tl.minimum(nbytes - skip, PIECE) >> SHIFT
        length = tl.where(live, length, 0)
        source = (local_base + local_id * local_stride + skip) >> SHIFT
        target = (remote_base + remote_id * remote_stride + skip) >> SHIFT
        if VEC > 1:
            source = tl.multiple_of(source, VEC)
            target = tl.multiple_of(target, VEC)
            length = tl.multiple_of(length, VEC)
        # Whole steps unmasked, then at most one masked step for the rest: a mask on every
        # step costs the copy measurably.
        whole = length // BLOCK * BLOCK
        for start in tl.range(0, whole, BLOCK):
            index = start + tl.arange(0, BLOCK)
            values = tl.load(src + source + index)
            tl.store(dst + target + index, values)
        if whole < length:
            index = whole + tl.arange(0, BLOCK)
            mask = index < length
            values = tl.load(src + source + index, mask=mask)
            tl.store(dst + target + index, values, mask=mask)

    return triton.jit(copy_rows)


@functools.cache
def _fetch_kernel() -> Any:
    """Copies `n` int64 from pinned host memory (read through the GPU's mapping of it) into a
    buffer on the GPU: a captured row copy's block ids, fetched by a kernel because a graph's
    kernel node starts its successor sooner than a host-to-device copy node does."""
    import triton
    import triton.language as tl

    def fetch_ids(host, device_ids, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = index < n
        tl.store(device_ids + index, tl.load(host + index, mask=mask), mask=mask)

    return triton.jit(fetch_ids)


#: Ids one program of `_fetch_kernel` copies.
_FETCH_BLOCK = 1024

_UNIT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: CUDA's limit on a grid's second and third dimensions.
_MAX_GRID_YZ = 65535


@functools.cache
def _stream(device: int) -> torch.cuda.Stream:
    """The stream kvray's copies run on, one per device: apart from the model's streams, and
    not the legacy default stream (which would serialise with every other stream)."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


@functools.cache
def _capture_stream(device: int) -> torch.cuda.Stream:
    """The stream row copies are captured on: no write's copies ever run on it."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


_thread_events = threading.local()


def follow_current(source_device: int, stream: torch.cuda.Stream) -> None:
    """Order `stream` after the work queued so far on `source_device`'s current stream (the
    model that wrote the KV). A wait takes the event's state when it is queued, so one event
    per thread and device serves every write; per thread, so no other thread records it
    between this record and this wait."""
    produced = _produced_event(source_device)
    produced.record(torch.cuda.current_stream(source_device))
    stream.wait_event(produced)


def _produced_event(source_device: int) -> torch.cuda.Event:
    """This thread's event for ordering kvray's streams after `source_device`'s current one."""
    events: dict[int, torch.cuda.Event] | None = getattr(_thread_events, "by_device", None)
    if events is None:
        events = _thread_events.by_device = {}
    produced = events.get(source_device)
    if produced is None:
        produced = events[source_device] = torch.cuda.Event()  # type: ignore[no-untyped-call]
    return produced


@functools.cache
def peer_reads(reader: int, owner: int) -> bool:
    """Whether kernels on GPU `reader` can load from memory of GPU `owner` (peer access),
    enabling it if the hardware allows. torch enables peer access from A to B the first time it
    copies from A to B; a one-byte copy does that once per pair."""
    if reader == owner:
        return True
    if not torch.cuda.can_device_access_peer(reader, owner):
        return False
    torch.empty(1, dtype=torch.uint8, device=f"cuda:{reader}").to(f"cuda:{owner}")
    torch.cuda.synchronize(reader)
    return True


#: Row tables kept on the GPU per transport (one per pair of engine incarnations and layer list).
_KEPT_ROW_TABLES = 64
#: Pinned host buffers kept per device for op tables (each reused once its upload is done).
_KEPT_TABLE_BUFFERS = 8
_table_buffers: dict[int, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}


def _upload_table(device: torch.device, *columns: Int64Array) -> torch.Tensor:
    """The op table (the columns one after the other) on `device`, copied on the current stream
    from a pinned host buffer: a reused one whose last upload has finished, else a new one.
    Pinning host memory costs more host time than the upload it serves, so buffers are kept."""
    count = sum(column.size for column in columns)
    kept = _table_buffers.setdefault(device.index or 0, [])
    buffer = None
    for index, (candidate, uploaded) in enumerate(kept):
        if candidate.numel() >= count and uploaded.query():  # type: ignore[no-untyped-call]
            buffer = candidate
            del kept[index]
            break
    if buffer is None:
        buffer = torch.empty(max(count, 1 << 16), dtype=torch.int64, pin_memory=True)
    np.concatenate(columns, out=buffer.numpy()[:count])
    table = torch.empty(count, dtype=torch.int64, device=device)
    table.copy_(buffer[:count], non_blocking=True)
    uploaded = torch.cuda.Event()  # type: ignore[no-untyped-call]
    uploaded.record()
    kept.append((buffer, uploaded))
    if len(kept) > _KEPT_TABLE_BUFFERS:
        kept.pop(0)  # the oldest; the caching host allocator holds it until its copy is done
    return table


def launch_copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
) -> None:
    """One kernel launch on `dst`'s GPU, on that GPU's current stream, copying every
    (dst_offset, src_offset, nbytes) op between two uint8 tensors. `src` is on the same GPU or
    on one whose memory `dst`'s GPU can read (`peer_reads`). Bounds are the caller's job
    (kvray checks every op before it gets here)."""
    if nbytes.size == 0:
        return
    reader, owner = dst.device.index or 0, src.device.index or 0
    if not peer_reads(reader, owner):
        raise TransportError(
            f"GPU {reader} cannot read GPU {owner}'s memory (no peer access between them)",
            reader=reader,
            owner=owner,
        )
    unit = pick_unit(dst_offsets, src_offsets, nbytes, bases=(dst.data_ptr(), src.data_ptr()))
    vector = 2 if unit == 16 else 1
    unit = min(8, unit)
    if int(nbytes.max()) > MAX_PIECE_NBYTES:
        # Long ops are cut so that no program copies much more than the others.
        dst_offsets, src_offsets, nbytes = split_ops(dst_offsets, src_offsets, nbytes, MAX_PIECE_NBYTES)
    # Remote loads need more bytes in flight per program than local ones.
    block, warps = (4096, 16) if reader != owner else (2048, 8)
    with torch.cuda.device(dst.device):
        table = _upload_table(dst.device, src_offsets, dst_offsets, nbytes)
        _kernel()[(nbytes.size,)](
            src.view(_UNIT_DTYPES[unit]),
            dst.view(_UNIT_DTYPES[unit]),
            table,
            nbytes.size,
            SHIFT=unit.bit_length() - 1,
            BLOCK=block,
            VEC=vector,
            num_warps=warps,
        )


def copy_ops(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    *,
    direct: bool = True,
) -> torch.cuda.Event:
    """Copy the ops from `src` into `dst`, on one GPU or across two, and return an event that
    completes when every byte is in `dst`. The copies wait for the work already queued on the
    source GPU's current stream (the model that wrote the KV).

    One GPU, or two GPUs with peer access (NVLink) and `direct`: one kernel on the destination
    GPU, loading the source over the link. That is a pull by the writer's own process into
    memory it opened through IPC; the decode process takes no part. Otherwise: a kernel gathers
    the ops into one staging buffer on the source GPU, one device-to-device copy moves it, and a
    kernel on the destination GPU scatters it into place.
    """
    source_device = src.device.index or 0
    target_device = dst.device.index or 0
    target_stream = _stream(target_device)
    follow_current(source_device, target_stream)
    if direct and peer_reads(target_device, source_device):
        with torch.cuda.stream(target_stream):
            launch_copy(dst, src, dst_offsets, src_offsets, nbytes)
    else:
        total = int(nbytes.sum())
        staged = np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
        source_stream = _stream(source_device)
        follow_current(source_device, source_stream)
        with torch.cuda.stream(source_stream):
            outgoing = torch.empty(total, dtype=torch.uint8, device=src.device)
            launch_copy(outgoing, src, staged, src_offsets, nbytes)
        with torch.cuda.stream(source_stream), torch.cuda.stream(target_stream):
            incoming = torch.empty(total, dtype=torch.uint8, device=dst.device)
            # torch copies on the source GPU's current stream and orders the target's after it.
            incoming.copy_(outgoing, non_blocking=True)
            launch_copy(dst, incoming, dst_offsets, staged, nbytes)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(target_stream)
    return done


#: Fewest block pairs a captured row copy is sized for; sizes go up in powers of two from here.
_MIN_CAPACITY = 16
#: Captured row copies kept per (row table, source, target, size): one per write in flight.
_GRAPHS_PER_SHAPE = 4


def capacity_for(count: int) -> int:
    """The size of captured row copy a request of `count` block pairs uses: a power of two, so a
    few captures serve every size and a request launches at most twice the programs it needs
    (the rest stop at once)."""
    return max(_MIN_CAPACITY, 1 << (count - 1).bit_length())


@dataclass
class RowGraph:
    """A wait for `produced`, the fetch of a request's block ids (from a pinned buffer of this
    graph's own), the row kernel and a record of `done`, captured once as a CUDA graph for one
    source, target and capacity; replayed for each request after recording `produced` on the
    source GPU's current stream. `done` completes when the last replay's copy has; until then
    the pinned buffer is that request's and the graph is not replayed again. Both events are
    recorded anew by each replay (creating an event costs more host time than the replay): a
    waiter that has not seen its copy end before the next replay waits for that one too, never
    less."""

    graph: torch.cuda.CUDAGraph
    staging: npt.NDArray[np.int64]
    pinned: torch.Tensor
    ids: torch.Tensor
    produced: torch.cuda.Event
    done: torch.cuda.Event
    #: The driver's handles of the instantiated graph and of `produced` (`_replay_rows`).
    exec_handle: int = 0
    produced_handle: int = 0


@dataclass(frozen=True)
class RowTable:
    """A pair of `PartRows` (local and remote) as the row kernel reads them, on one GPU: built
    once per pair of engine incarnations and layer list, then reused by every request, with the
    row copies captured for it."""

    table: torch.Tensor
    num_rows: int
    #: Bitwise OR of every base, stride and size: with the two data pointers, the copy width.
    combined: int
    #: Pieces of the longest row (a grid dimension).
    pieces: int
    #: The one local and one remote region every row lies in; None when the rows span several.
    regions: tuple[int, int] | None = None
    #: Captured row copies by (source address, source bytes, target address, target bytes,
    #: capacity).
    graphs: dict[tuple[int, int, int, int, int], list[RowGraph]] = field(default_factory=dict)


def row_table(rows: RequestRows, device: torch.device) -> RowTable:
    local, remote = rows.local, rows.remote
    columns = (local.base, remote.base, local.block_stride, remote.block_stride, local.nbytes)
    combined = 0
    for column in columns:
        if column.size:
            combined |= int(np.bitwise_or.reduce(column))
    table = torch.from_numpy(np.concatenate(columns)).to(device)
    pieces = -(-int(local.nbytes.max()) // MAX_PIECE_NBYTES)
    regions = None
    if local.region.size:
        local_index, remote_index = int(local.region[0]), int(remote.region[0])
        if not (local.region != local_index).any() and not (remote.region != remote_index).any():
            regions = (local_index, remote_index)
    return RowTable(table, int(local.base.size), combined, pieces, regions)


def _launch_rows_kernel(
    dst: torch.Tensor, src: torch.Tensor, table: RowTable, ids: torch.Tensor, capacity: int
) -> None:
    """The row kernel on the current stream over `capacity` block pairs of `ids` (laid out as
    `_rows_kernel` reads them)."""
    unit = pick_unit(bases=(table.combined, dst.data_ptr(), src.data_ptr()))
    vector = 2 if unit == 16 else 1
    unit = min(8, unit)
    _rows_kernel()[(capacity, table.num_rows, table.pieces)](
        src.view(_UNIT_DTYPES[unit]),
        dst.view(_UNIT_DTYPES[unit]),
        table.table,
        ids,
        table.num_rows,
        capacity,
        SHIFT=unit.bit_length() - 1,
        PIECE=MAX_PIECE_NBYTES,
        BLOCK=4096,
        VEC=vector,
        num_warps=16,
    )


def launch_rows(dst: torch.Tensor, src: torch.Tensor, rows: RequestRows, table: RowTable) -> None:
    """One kernel launch on `dst`'s GPU, on its current stream, copying every op of `rows`
    between two uint8 tensors (`src` on the same GPU or one `dst`'s GPU reads), its block ids
    uploaded first. Bounds are the caller's job (kvray checks every row before it gets here)."""
    count = int(rows.local_ids.size)
    ids = _upload_table(dst.device, np.array([count], dtype=np.int64), rows.local_ids, rows.remote_ids)
    _launch_rows_kernel(dst, src, table, ids, count)


def _fetch_ids(ids: torch.Tensor, pinned: torch.Tensor) -> None:
    """`ids` (on the GPU) := `pinned` (host memory), by `_fetch_kernel` on the current stream."""
    count = pinned.numel()
    _fetch_kernel()[(-(-count // _FETCH_BLOCK),)](pinned, ids, count, BLOCK=_FETCH_BLOCK, num_warps=4)


def capture_rows(dst: torch.Tensor, src: torch.Tensor, table: RowTable, capacity: int) -> RowGraph:
    """Capture the ids' fetch and the row kernel for requests of up to `capacity` block pairs
    into `dst` from `src`, between a wait for a `produced` event of the source GPU and a record
    of `done` (both external nodes of the graph, so a replay is two driver calls: record
    `produced`, launch). The capture records from this thread only (`thread_local`), so an
    engine's other threads keep using the GPU meanwhile."""
    pinned = torch.zeros(1 + 2 * capacity, dtype=torch.int64, pin_memory=True)
    ids = torch.zeros(1 + 2 * capacity, dtype=torch.int64, device=dst.device)
    # Compiles and loads both kernels outside the capture; a count of 0 copies nothing.
    _fetch_ids(ids, pinned)
    _launch_rows_kernel(dst, src, table, ids, capacity)
    capturing = _capture_stream(dst.device.index or 0)
    # Each event recorded once on an idle stream, so that the driver's event exists (and reads
    # as completed) before the capture names it.
    with torch.cuda.device(src.device):
        produced = torch.cuda.Event()  # type: ignore[no-untyped-call]
        produced.record(_capture_stream(src.device.index or 0))
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(capturing)
    calls = _driver_calls()
    graph = torch.cuda.CUDAGraph()
    # No garbage collection during the capture: a collected object that releases CUDA memory
    # (an opened IPC handle, a pinned buffer) would call the driver in a way a capture forbids,
    # and the failure aborts the process.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(capturing):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                _driver_check(
                    "cuStreamWaitEvent",
                    calls.stream_wait_event(capturing.cuda_stream, produced.cuda_event, _EVENT_WAIT_EXTERNAL),
                )
                _fetch_ids(ids, pinned)
                _launch_rows_kernel(dst, src, table, ids, capacity)
                _driver_check(
                    "cuEventRecordWithFlags",
                    calls.event_record_with_flags(
                        done.cuda_event, capturing.cuda_stream, _EVENT_RECORD_EXTERNAL
                    ),
                )
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    return RowGraph(
        graph, pinned.numpy(), pinned, ids, produced, done, graph.raw_cuda_graph_exec(), produced.cuda_event
    )


def _idle_graph(dst: torch.Tensor, src: torch.Tensor, table: RowTable, capacity: int) -> RowGraph | None:
    """A captured row copy for this shape whose last replay has finished, captured now if fewer
    than `_GRAPHS_PER_SHAPE` exist; None when all of them are busy."""
    key = (src.data_ptr(), src.numel(), dst.data_ptr(), dst.numel(), capacity)
    graphs = table.graphs.setdefault(key, [])
    for graph in graphs:
        # A graph not replayed yet has an event never recorded, which reads as completed.
        if graph.done.query():  # type: ignore[no-untyped-call]
            return graph
    if len(graphs) >= _GRAPHS_PER_SHAPE:
        return None
    with torch.cuda.device(dst.device):
        graphs.append(capture_rows(dst, src, table, capacity))
    return graphs[-1]


def copy_rows(
    dst: torch.Tensor, src: torch.Tensor, rows: RequestRows, table: RowTable, *, replay: bool = True
) -> torch.cuda.Event:
    """`copy_ops` for a plan's rows, direct path only (one GPU, or two with peer access): the
    copy waits for the work queued on the source GPU's current stream, and the returned event
    completes when every byte is in `dst`. With `replay`, the ids go into an idle captured row
    copy's pinned buffer and that graph is replayed (no allocation, no upload, no
    kernel dispatch on the host); without, or when every captured copy of this shape is busy,
    the ids are uploaded and the kernel launched."""
    source_device = src.device.index or 0
    target_device = dst.device.index or 0
    target_stream = _stream(target_device)
    count = int(rows.local_ids.size)
    graph = _idle_graph(dst, src, table, capacity_for(count)) if replay else None
    if graph is not None:
        capacity = (graph.staging.size - 1) // 2
        graph.staging[0] = count
        graph.staging[1 : 1 + count] = rows.local_ids
        graph.staging[1 + capacity : 1 + capacity + count] = rows.remote_ids
        if source_device == target_device == torch.cuda.current_device():
            _replay_rows(graph, target_device, target_stream)
        else:
            with torch.cuda.device(src.device):
                graph.produced.record(torch.cuda.current_stream(source_device))
            with torch.cuda.device(dst.device), torch.cuda.stream(target_stream):
                graph.graph.replay()
        return graph.done
    follow_current(source_device, target_stream)
    with torch.cuda.device(dst.device), torch.cuda.stream(target_stream):
        launch_rows(dst, src, rows, table)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(target_stream)
    return done


#: Flags of a wait and a record captured as a graph's own nodes (`cudaEventWaitExternal`,
#: `cudaEventRecordExternal`), not as dependencies inside the capture.
_EVENT_WAIT_EXTERNAL = 1
_EVENT_RECORD_EXTERNAL = 1


@dataclass(frozen=True)
class _DriverCalls:
    event_record: Callable[[int, int], int]
    event_record_with_flags: Callable[[int, int, int], int]
    stream_wait_event: Callable[[int, int, int], int]
    graph_launch: Callable[[int, int], int]


@functools.cache
def _driver_calls() -> _DriverCalls:
    """The driver entry points a capture and a replay use, with their argument types declared
    (so that ctypes converts each argument without guessing, on every call)."""
    lib = _libcuda()
    pair = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    triple = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
    return _DriverCalls(
        pair(("cuEventRecord", lib)),
        triple(("cuEventRecordWithFlags", lib)),
        triple(("cuStreamWaitEvent", lib)),
        pair(("cuGraphLaunch", lib)),
    )


def _replay_rows(graph: RowGraph, device: int, stream: torch.cuda.Stream) -> None:
    """The replay step of `copy_rows` through the driver directly, for a source and target on
    the current device: record the graph's `produced` on the device's current stream (the graph
    waits for it, then records `done`), and launch the graph on `stream`. Torch's device and
    stream guards and its event and graph wrappers cost several times the driver calls they
    make."""
    calls = _driver_calls()
    current = torch._C._cuda_getCurrentRawStream(device)
    _driver_check("cuEventRecord", calls.event_record(graph.produced_handle, current))
    _driver_check("cuGraphLaunch", calls.graph_launch(graph.exec_handle, stream.cuda_stream))


def _driver_check(name: str, result: int) -> None:
    if result != 0:
        raise TransportError(f"{name} failed (CUresult {result})", result=result)


async def wait_for_events(events: list[torch.cuda.Event], nbytes: int) -> None:
    """Return once every event has completed. The loop polls them between its other work for
    about as long as `nbytes` should take to copy, so the write resumes within one loop turn of
    the copy's end; a copy that runs past that (a busy or slow link) is waited for on a thread.
    A thread alone costs a wake-up on the way back: a pool thread, then the loop."""
    deadline = time.perf_counter() + POLL_FLOOR_S + nbytes / POLL_BYTES_PER_S
    try:
        pending = [event for event in events if not event.query()]  # type: ignore[no-untyped-call]
        while pending and time.perf_counter() < deadline:
            await asyncio.sleep(0)
            pending = [event for event in pending if not event.query()]  # type: ignore[no-untyped-call]
        for event in pending:
            await asyncio.to_thread(event.synchronize)
    except asyncio.CancelledError:
        # The GPU cannot be stopped mid-copy: let the cancellation through only once nothing
        # writes into the peer's memory any more (the copies are bounded, so this wait is too).
        finishing = asyncio.ensure_future(asyncio.to_thread(_synchronize_all, events))
        while not finishing.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([finishing])
        raise


def _synchronize_all(events: list[torch.cuda.Event]) -> None:
    for event in events:
        event.synchronize()


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def cuda_allocation_range(pointer: int) -> tuple[int, int]:
    """(start, nbytes) of the CUDA allocation that holds device address `pointer`, as the driver
    knows it (`cuMemGetAddressRange`): for an opened IPC handle, the whole allocation the
    exporter shared, whatever size its handle claims."""
    start = ctypes.c_uint64()
    nbytes = ctypes.c_size_t()
    result = _libcuda().cuMemGetAddressRange_v2(
        ctypes.byref(start), ctypes.byref(nbytes), ctypes.c_uint64(pointer)
    )
    if result != 0:
        raise RegionError(
            f"the CUDA driver knows no allocation at {pointer:#x} (CUresult {result})", address=pointer
        )
    return int(start.value), int(nbytes.value)


def check_inside_allocation(
    region_start: int, region_nbytes: int, allocation: tuple[int, int], *, engine_id: str, region: int
) -> None:
    """Refuse a region that leaves the CUDA allocation it was opened in: an exporter's claimed
    storage size and offsets are only claims, and bytes past its allocation's end, or before
    its start, belong to other allocations of that process or to none."""
    allocation_start, allocation_nbytes = allocation
    offset = region_start - allocation_start
    if offset < 0 or region_nbytes > allocation_nbytes or offset > allocation_nbytes - region_nbytes:
        raise RegionError(
            f"engine {engine_id!r} describes region {region} as {region_nbytes} bytes at offset "
            f"{offset} of its CUDA allocation, which has {allocation_nbytes}; its CUDA IPC handle "
            "claims memory it did not export, refusing to write",
            engine_id=engine_id,
            region=region,
            offset=offset,
            nbytes=region_nbytes,
            allocation_nbytes=allocation_nbytes,
        )


@dataclass
class _Opened:
    storage: torch.UntypedStorage
    region: torch.Tensor


class CudaIpcTransport(Transport):
    kind = TransportKind.CUDA_IPC
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
    ) -> None:
        """`allocation_range`: (start, nbytes) of the CUDA allocation holding a device address.
        `replay_graphs`: write a plan's rows by replaying captured row copies (`copy_rows`);
        False launches the kernel through Triton for every request."""
        super().__init__(settings)
        self._allocation_range = allocation_range
        self._replay = replay_graphs
        #: The peers' regions opened here, by region index.
        self._opened: PeerCache[int, _Opened] = PeerCache(settings.max_cached_peers)
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

    async def write(self, plan: TransferPlan, local: Backing, peer: Peer) -> None:
        check_write(plan, local, peer)
        rows = plan.rows
        if rows is not None:
            direct = self._direct_rows(rows, local, peer)
            if direct is not None:
                source, opened, table = direct
                try:
                    done = copy_rows(opened.region, source, rows, table, replay=self._replay)
                except Exception as error:
                    raise WriteFailedError(
                        f"copy into engine {peer.info.engine_id!r} failed: {error}",
                        engine_id=peer.info.engine_id,
                    ) from error
                # `opened` (what the copy writes into) stays open until the copy has finished.
                await wait_for_events([done], plan.nbytes)
                return
        ops = plan.ops
        events = []
        # What the copies write into stays open until they have finished, even if the peer is
        # forgotten (it left, or fell out of the cache) meanwhile.
        in_use: list[_Opened] = []
        for (local_index, remote_index), select in region_pairs(ops.local_region, ops.remote_region):
            in_use.append(self._open(peer, remote_index))
            target = in_use[-1].region
            source = local.regions[local_index].tensor
            if not source.is_cuda:
                raise TransportError("the cuda_ipc transport copies from CUDA memory")
            try:
                events.append(
                    copy_ops(
                        target,
                        source,
                        ops.remote_offset[select],
                        ops.local_offset[select],
                        ops.nbytes[select],
                    )
                )
            except Exception as error:
                raise WriteFailedError(
                    f"copy into engine {peer.info.engine_id!r} region {remote_index} failed: {error}",
                    engine_id=peer.info.engine_id,
                ) from error
        # The bytes are in the peer's memory once every copy's event has completed.
        await wait_for_events(events, ops.total_nbytes)

    def _direct_rows(
        self, rows: RequestRows, local: Backing, peer: Peer
    ) -> tuple[torch.Tensor, _Opened, RowTable] | None:
        """The source, the opened target and the row table when the row kernel can write the
        plan: every row in one local and one remote region, the destination GPU reads the
        source directly, and the rows fit a grid; None sends the plan down the op-table path.
        The table, and what it says of the rows, is built once per (cached) pair of rows."""
        if rows.local.base.size == 0 or rows.local.base.size > _MAX_GRID_YZ:
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
        if table.regions is None or table.pieces > _MAX_GRID_YZ:
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
