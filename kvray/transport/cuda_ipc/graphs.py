"""A plan's rows copied by the `cuda_ipc` transport: a row table kept on the GPU, and CUDA graphs
captured once per row table, source, target and size (fetch the block ids from a pinned buffer,
then the row kernel), replayed for every request with two driver calls.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvray.content import Stretches, StretchRows, pair_salts, region_seeds
from kvray.layout import Int64Array
from kvray.memory import SourceReady
from kvray.placement import REGION_SHIFT, Stored
from kvray.plan import RequestRows
from kvray.transport.cuda_ipc import ops
from kvray.transport.cuda_ipc.digests import DigestCell, give_back, take_cell
from kvray.transport.cuda_ipc.driver import (
    EVENT_RECORD_EXTERNAL,
    EVENT_WAIT_EXTERNAL,
    driver_calls,
    driver_check,
)
from kvray.transport.cuda_ipc.kernels import (
    FETCH_BLOCK,
    HASH_MAX_UNIT,
    HASH_STEP_NBYTES,
    MAX_PIECE_NBYTES,
    UNIT_DTYPES,
    Digests,
    fetch_kernel,
    pick_unit,
    rows_kernel,
)
from kvray.transport.cuda_ipc.ops import upload_table
from kvray.transport.cuda_ipc.streams import capture_stream, copy_stream, follow_current, record_after_source

#: Fewest block pairs a captured row copy is sized for; sizes go up in powers of two from here.
_MIN_CAPACITY = 16
#: The writer's reference's row tables kept per transport (`StretchTables`).
_KEPT_STRETCH_TABLES = 64
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
    #: Where the graph's fold writes its digests (`DigestCell`; None: it reports none).
    cell: DigestCell | None = None
    #: A replay's digest not read yet: the graph is not replayed again until it is.
    held: bool = False


@dataclass(frozen=True)
class RowTable:
    """A pair of `PartRows` (local and remote) as the row kernel reads them, on one GPU: built
    once per pair of engine incarnations and layer list, then reused by every request, with the
    row copies captured for it. Its eight columns: `rows_kernel`'s five, then each row's source
    region seed and pair salt (`kvray.content`) and destination region salt
    (`kvray.placement`), read by a copy that reports digests."""

    table: torch.Tensor
    num_rows: int
    #: Bitwise OR of every base, stride and size: with the two data pointers, the copy width.
    combined: int
    #: Pieces of the longest row (a grid dimension).
    pieces: int
    #: The one local and one remote region every row lies in; None when the rows span several.
    regions: tuple[int, int] | None = None
    #: Captured row copies by (source address, source bytes, target address, target bytes,
    #: capacity, digests).
    graphs: dict[tuple[int, int, int, int, int, Digests], list[RowGraph]] = field(default_factory=dict)


def row_table(rows: RequestRows, device: torch.device) -> RowTable:
    local, remote = rows.local, rows.remote
    columns = (local.base, remote.base, local.block_stride, remote.block_stride, local.nbytes)
    combined = 0
    for column in columns:
        if column.size:
            combined |= int(np.bitwise_or.reduce(column))
    hashing = hash_columns(local.region, remote.region)
    table = torch.from_numpy(np.concatenate((*columns, *hashing))).to(device)
    pieces = -(-int(local.nbytes.max()) // MAX_PIECE_NBYTES)
    regions = None
    if local.region.size:
        local_index, remote_index = int(local.region[0]), int(remote.region[0])
        if not (local.region != local_index).any() and not (remote.region != remote_index).any():
            regions = (local_index, remote_index)
    return RowTable(table, int(local.base.size), combined, pieces, regions)


def hash_columns(
    local_region: npt.NDArray[np.int64], remote_region: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Each row's source region seed and pair salt (`kvray.content`) and its destination region's
    salt (`kvray.placement`), as int64 bit patterns."""
    places = (remote_region.astype(np.uint64) + np.uint64(1)) << np.uint64(REGION_SHIFT)
    return (
        region_seeds(local_region).view(np.int64),
        pair_salts(local_region, remote_region).view(np.int64),
        places.view(np.int64),
    )


def launch_rows_kernel(
    dst: torch.Tensor,
    src: torch.Tensor,
    table: RowTable,
    ids: torch.Tensor,
    capacity: int,
    cell: DigestCell | None = None,
    *,
    store: bool = True,
    content: bool = True,
) -> None:
    """The row kernel on the current stream over `capacity` block pairs of `ids` (laid out as
    `rows_kernel` reads them); with a `cell`, adding the placement digest of where it stores
    and, with `content`, the content digest of what it copies into the cell's slots
    (`cell.fold` adds them up); without `store`, hashing only."""
    # One shape whether the copy hashes or not (words of at most 4 bytes, loaded 16 bytes at a
    # time where aligned, 4 KiB a step), so that a checked copy differs only by its arithmetic.
    unit = pick_unit(bases=(table.combined, dst.data_ptr(), src.data_ptr()))
    vector = max(1, unit // HASH_MAX_UNIT)
    unit = min(HASH_MAX_UNIT, unit)
    block, warps = HASH_STEP_NBYTES // unit, 8
    rows_kernel()[(capacity, table.num_rows, table.pieces)](
        src.view(UNIT_DTYPES[unit]),
        dst.view(UNIT_DTYPES[unit]),
        table.table,
        ids,
        table.table if cell is None else cell.slots,
        table.num_rows,
        capacity,
        SHIFT=unit.bit_length() - 1,
        PIECE=MAX_PIECE_NBYTES,
        BLOCK=block,
        VEC=vector,
        DIGESTS=cell is not None,
        CONTENT=cell is not None and content,
        STORE=store,
        num_warps=warps,
    )


class StretchTables:
    """The writer's reference's row tables on the GPU, by the (kept) stretch rows and source
    region they were built from (`hash_stretches`)."""

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple[int, int], tuple[StretchRows, RowTable]] = OrderedDict()

    def table(self, rows: StretchRows, source: int, device: torch.device) -> RowTable:
        key = (id(rows), source)
        kept = self._tables.get(key)
        if kept is not None and kept[0] is rows and kept[1].table.device == device:
            return kept[1]
        select = rows.src_region == source
        columns = (
            rows.src_start[select],
            rows.dst_start[select],
            rows.src_stride[select],
            rows.dst_stride[select],
            rows.nbytes[select],
        )
        combined = int(np.bitwise_or.reduce(np.concatenate(columns)))
        hashing = hash_columns(rows.src_region[select], rows.dst_region[select])
        tensor = torch.from_numpy(np.concatenate((*columns, *hashing))).to(device)
        pieces = -(-int(columns[4].max()) // MAX_PIECE_NBYTES)
        table = RowTable(tensor, int(columns[4].size), combined, pieces)
        # The rows are kept with their table, so their id stays theirs while it is kept.
        self._tables[key] = (rows, table)
        while len(self._tables) > _KEPT_STRETCH_TABLES:
            self._tables.popitem(last=False)
        return table

    def clear(self) -> None:
        self._tables.clear()


def hash_stretches(
    stretches: Stretches, regions: Sequence[torch.Tensor], tables: StretchTables, ready: SourceReady = None
) -> list[RowCopy]:
    """The writer's reference (`kvray.content.Stretches`) hashed on the GPU by the row kernel
    without storing (a captured graph replayed, as a copy's), one per source region, on kvray's
    copy stream after the work that wrote the KV (`ready`, as `start_rows` takes it): each one's
    digest is there once it is done (`RowCopy.digest`, then `release`)."""
    hashes: list[RowCopy] = []
    rows = stretches.rows
    if not stretches.local.size:
        return hashes
    for source in np.unique(rows.src_region).tolist():
        region = regions[source]
        table = tables.table(rows, source, region.device)
        hashes.append(
            start_rows(
                region,
                region,
                stretches.local,
                stretches.remote,
                table,
                digests=Digests.REFERENCE,
                ready=ready,
            )
        )
    return hashes


def launch_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    rows: RequestRows,
    table: RowTable,
    cell: DigestCell | None = None,
    *,
    content: bool = True,
) -> None:
    """One kernel launch on `dst`'s GPU, on its current stream, copying every op of `rows`
    between two uint8 tensors (`src` on the same GPU or one `dst`'s GPU reads), its block ids
    uploaded first; with a `cell`, folding its digests into it (`launch_rows_kernel`). Bounds
    are the caller's job (kvray checks every row before it gets here)."""
    count = int(rows.local_ids.size)
    ids = upload_table(dst.device, np.array([count], dtype=np.int64), rows.local_ids, rows.remote_ids)
    launch_rows_kernel(dst, src, table, ids, count, cell, content=content)
    if cell is not None:
        cell.fold()


def _fetch_ids(ids: torch.Tensor, pinned: torch.Tensor) -> None:
    """`ids` (on the GPU) := `pinned` (host memory), by `fetch_kernel` on the current stream."""
    count = pinned.numel()
    fetch_kernel()[(-(-count // FETCH_BLOCK),)](pinned, ids, count, BLOCK=FETCH_BLOCK, num_warps=4)


def capture_rows(
    dst: torch.Tensor, src: torch.Tensor, table: RowTable, capacity: int, digests: Digests = Digests.NONE
) -> RowGraph:
    """Capture the ids' fetch and the row kernel for requests of up to `capacity` block pairs
    into `dst` from `src` (reporting `digests`, folded into the graph's own cell), between a
    wait for a `produced` event of the source GPU and a record
    of `done` (both external nodes of the graph, so a replay is two driver calls: record
    `produced`, launch). The capture records from this thread only (`thread_local`), so an
    engine's other threads keep using the GPU meanwhile."""
    pinned = torch.zeros(1 + 2 * capacity, dtype=torch.int64, pin_memory=True)
    ids = torch.zeros(1 + 2 * capacity, dtype=torch.int64, device=dst.device)
    cell = None if digests is Digests.NONE else DigestCell(dst.device)
    content, store = digests.content, digests is not Digests.REFERENCE
    # Compiles and loads the kernels outside the capture; a count of 0 copies nothing.
    _fetch_ids(ids, pinned)
    launch_rows_kernel(dst, src, table, ids, capacity, cell, content=content, store=store)
    if cell is not None:
        cell.fold()
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
                launch_rows_kernel(dst, src, table, ids, capacity, cell, content=content, store=store)
                if cell is not None:
                    cell.fold()
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
        graph,
        pinned.numpy(),
        pinned,
        ids,
        produced,
        done,
        graph.raw_cuda_graph_exec(),
        produced.cuda_event,
        cell,
    )


def idle_graph(
    dst: torch.Tensor, src: torch.Tensor, table: RowTable, capacity: int, digests: Digests = Digests.NONE
) -> RowGraph | None:
    """A captured row copy for this shape whose last replay has finished, captured now if fewer
    than `_GRAPHS_PER_SHAPE` exist; None when all of them are busy."""
    key = (src.data_ptr(), src.numel(), dst.data_ptr(), dst.numel(), capacity, digests)
    graphs = table.graphs.setdefault(key, [])
    for graph in graphs:
        # A graph not replayed yet has an event never recorded, which reads as completed.
        if not graph.held and graph.done.query():  # type: ignore[no-untyped-call]
            return graph
    if len(graphs) >= _GRAPHS_PER_SHAPE:
        return None
    with torch.cuda.device(dst.device):
        graphs.append(capture_rows(dst, src, table, capacity, digests))
    return graphs[-1]


class RowCopy(NamedTuple):
    """A started row copy: `done` completes when every byte is in place; then `cell` holds the
    digests it reports (`Digests`), until `release`."""

    done: torch.cuda.Event
    cell: DigestCell | None = None
    #: The replayed graph whose cell it is (held until `release`); None: a cell of its own.
    graph: RowGraph | None = None
    digests: Digests = Digests.NONE

    def digest(self) -> Stored | None:
        """The digests, once `done` has completed (None: the copy reports none)."""
        if self.cell is None:
            return None
        return self.cell.value(content=self.digests.content)

    def release(self, *, completed: bool = True) -> None:
        """Let the cell go: its graph may be replayed again, or the cell serves another copy
        (only a `completed` copy's, whose fold has zeroed its slots)."""
        if self.graph is not None:
            self.graph.held = False
        elif self.cell is not None and completed:
            give_back(self.cell)


def copy_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    rows: RequestRows,
    table: RowTable,
    *,
    replay: bool = True,
    digests: Digests = Digests.NONE,
    ready: SourceReady = None,
) -> RowCopy:
    """`copy_ops` for a plan's rows, direct path only (one GPU, or two with peer access): the
    copy waits for `ready` (`kvray.memory.SourceReady`), else for the work queued on the source
    GPU's current stream, and the returned `done`
    completes when every byte is in `dst`. With `replay`, the ids go into an idle captured row
    copy's pinned buffer and that graph is replayed (no allocation, no upload, no
    kernel dispatch on the host); without, or when every captured copy of this shape is busy,
    the ids are uploaded and the kernel launched. `digests`: what the copy reports of what it
    stores, read from the returned copy once done (`RowCopy.digest`, then `release`)."""
    remote_ids = rows.remote_ids
    if ops.executor_fault and remote_ids.size >= 2:
        remote_ids = remote_ids.copy()
        remote_ids[-1] = remote_ids[-2]
    return start_rows(
        dst, src, rows.local_ids, remote_ids, table, replay=replay, digests=digests, ready=ready
    )


def start_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    local_ids: Int64Array,
    remote_ids: Int64Array,
    table: RowTable,
    *,
    replay: bool = True,
    digests: Digests = Digests.NONE,
    ready: SourceReady = None,
) -> RowCopy:
    """`copy_rows` for block ids given as they are (`Digests.REFERENCE`: hash `src` only)."""
    source_device = src.device.index or 0
    target_device = dst.device.index or 0
    target_stream = copy_stream(target_device)
    count = int(local_ids.size)
    graph = idle_graph(dst, src, table, capacity_for(count), digests) if replay else None
    if graph is not None:
        capacity = (graph.staging.size - 1) // 2
        graph.staging[0] = count
        graph.staging[1 : 1 + count] = local_ids
        graph.staging[1 + capacity : 1 + capacity + count] = remote_ids
        if ready is None and source_device == target_device == torch.cuda.current_device():
            _replay_rows(graph, target_device, target_stream)
        else:
            # The graph waits for `produced`, recorded after what wrote the source.
            with torch.cuda.device(src.device):
                record_after_source(graph.produced, source_device, ready)
            with torch.cuda.device(dst.device), torch.cuda.stream(target_stream):
                graph.graph.replay()
        reporting = digests is not Digests.NONE
        graph.held = reporting
        return RowCopy(graph.done, graph.cell, graph if reporting else None, digests)
    follow_current(source_device, target_stream, ready)
    cell = None if digests is Digests.NONE else take_cell(dst.device)
    with torch.cuda.device(dst.device), torch.cuda.stream(target_stream):
        ids = upload_table(dst.device, np.array([count], dtype=np.int64), local_ids, remote_ids)
        launch_rows_kernel(
            dst, src, table, ids, count, cell, content=digests.content, store=digests is not Digests.REFERENCE
        )
        if cell is not None:
            cell.fold()
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(target_stream)
    return RowCopy(done, cell, None, digests)


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
