"""A plan's rows copied by the `cuda_ipc` transport: a row table kept on the GPU, and CUDA graphs
captured once per row table, source, target and size (fetch the block ids from a pinned buffer,
then the row kernel), replayed for every request with two driver calls.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from kvray.memory import source_ready
from kvray.plan import RequestRows
from kvray.transport.cuda_ipc.driver import (
    EVENT_RECORD_EXTERNAL,
    EVENT_WAIT_EXTERNAL,
    driver_calls,
    driver_check,
)
from kvray.transport.cuda_ipc.kernels import (
    FETCH_BLOCK,
    MAX_PIECE_NBYTES,
    UNIT_DTYPES,
    fetch_kernel,
    pick_unit,
    rows_kernel,
)
from kvray.transport.cuda_ipc.ops import upload_table
from kvray.transport.cuda_ipc.streams import capture_stream, copy_stream, follow_current, record_after_source

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


def launch_rows_kernel(
    dst: torch.Tensor, src: torch.Tensor, table: RowTable, ids: torch.Tensor, capacity: int
) -> None:
    """The row kernel on the current stream over `capacity` block pairs of `ids` (laid out as
    `rows_kernel` reads them)."""
    unit = pick_unit(bases=(table.combined, dst.data_ptr(), src.data_ptr()))
    vector = 2 if unit == 16 else 1
    unit = min(8, unit)
    rows_kernel()[(capacity, table.num_rows, table.pieces)](
        src.view(UNIT_DTYPES[unit]),
        dst.view(UNIT_DTYPES[unit]),
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
    ids = upload_table(dst.device, np.array([count], dtype=np.int64), rows.local_ids, rows.remote_ids)
    launch_rows_kernel(dst, src, table, ids, count)


def _fetch_ids(ids: torch.Tensor, pinned: torch.Tensor) -> None:
    """`ids` (on the GPU) := `pinned` (host memory), by `fetch_kernel` on the current stream."""
    count = pinned.numel()
    fetch_kernel()[(-(-count // FETCH_BLOCK),)](pinned, ids, count, BLOCK=FETCH_BLOCK, num_warps=4)


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
    launch_rows_kernel(dst, src, table, ids, capacity)
    capturing = capture_stream(dst.device.index or 0)
    # Each event recorded once on an idle stream, so that the driver's event exists (and reads
    # as completed) before the capture names it.
    with torch.cuda.device(src.device):
        produced = torch.cuda.Event()  # type: ignore[no-untyped-call]
        produced.record(capture_stream(src.device.index or 0))
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(capturing)
    calls = driver_calls()
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
                driver_check(
                    "cuStreamWaitEvent",
                    calls.stream_wait_event(capturing.cuda_stream, produced.cuda_event, EVENT_WAIT_EXTERNAL),
                )
                _fetch_ids(ids, pinned)
                launch_rows_kernel(dst, src, table, ids, capacity)
                driver_check(
                    "cuEventRecordWithFlags",
                    calls.event_record_with_flags(
                        done.cuda_event, capturing.cuda_stream, EVENT_RECORD_EXTERNAL
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


def idle_graph(dst: torch.Tensor, src: torch.Tensor, table: RowTable, capacity: int) -> RowGraph | None:
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
    target_stream = copy_stream(target_device)
    count = int(rows.local_ids.size)
    graph = idle_graph(dst, src, table, capacity_for(count)) if replay else None
    if graph is not None:
        capacity = (graph.staging.size - 1) // 2
        graph.staging[0] = count
        graph.staging[1 : 1 + count] = rows.local_ids
        graph.staging[1 + capacity : 1 + capacity + count] = rows.remote_ids
        if source_ready.get() is None and source_device == target_device == torch.cuda.current_device():
            _replay_rows(graph, target_device, target_stream)
        else:
            # The graph waits for `produced`, recorded after what wrote the source.
            with torch.cuda.device(src.device):
                record_after_source(graph.produced, source_device)
            with torch.cuda.device(dst.device), torch.cuda.stream(target_stream):
                graph.graph.replay()
        return graph.done
    follow_current(source_device, target_stream)
    with torch.cuda.device(dst.device), torch.cuda.stream(target_stream):
        launch_rows(dst, src, rows, table)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(target_stream)
    return done


def _replay_rows(graph: RowGraph, device: int, stream: torch.cuda.Stream) -> None:
    """The replay step of `copy_rows` through the driver directly, for a source and target on
    the current device: record the graph's `produced` on the device's current stream (the graph
    waits for it, then records `done`), and launch the graph on `stream`. Torch's device and
    stream guards and its event and graph wrappers cost several times the driver calls they
    make."""
    calls = driver_calls()
    current = torch._C._cuda_getCurrentRawStream(device)
    driver_check("cuEventRecord", calls.event_record(graph.produced_handle, current))
    driver_check("cuGraphLaunch", calls.graph_launch(graph.exec_handle, stream.cuda_stream))
