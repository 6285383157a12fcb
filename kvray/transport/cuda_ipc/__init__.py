"""`cuda_ipc` transport: same node, GPU (sixth step of the data flow, within a node).

The decode backing's CUDA allocation is exported once as a CUDA IPC handle (with the region's
offset inside it, in the region descriptor); the prefill process opens it once per peer
incarnation and writes a plan's ops with batched copies, never one launch per block.

    kernels     the Triton kernels (`triton_kernels`), compiled on first use: the op copy
                (program i copies op i, or one piece of a long op, with wide loads and stores),
                the row copy (expands a plan's rows itself from the request's block ids), the
                held blocks' hash (a sum per block and layer part), the block ids' fetch from
                pinned host memory and the digests' fold; the element width they copy at
                (`pick_unit`) and what a copy reports (`Digests`)
    triton_kernels  the kernels themselves, with the placement and content digests
                (`kvray.placement`, `kvray.content`) each copy adds up as it stores
    digests     where a copy's digests go: per-write slots on the GPU, folded into pinned
                host memory the writer reads once the copy is done
    streams     the GPU a handle names (by UUID), whether one GPU reads another's memory (peer
                access), the streams kvray's copies run on, ordered after the model's current
                stream, and the wait for a copy's events: polled from the event loop for about
                as long as the bytes take, then on a thread
    ops         a plan's op table: uploaded from reused pinned buffers, then ONE kernel launch
                per region pair on the decode engine's GPU, loading the source over NVLink when
                the GPUs have peer access; without it, a gather kernel, one device-to-device
                copy and a scatter kernel
    graphs      a plan's rows: a row table kept on the GPU, and a CUDA graph captured once per
                row table, source, target, size and digests (wait for the model's work, fetch
                the ids, the row kernel, fold its digests, record done), replayed per request
                with two driver calls; the writer's reference hashed the same way, storing
                nothing (`hash_stretches`)
    held        an engine's own blocks hashed on its GPU when their request is held
                (`kvray.content.HeldDigests`): the block kernel, storing nothing, so that the
                push checks its copy without reading its source a second time
    driver      the CUDA driver entry points called directly through ctypes
    allocation  an opened handle checked against the allocation the driver knows for it: an
                exporter's storage size and offsets are only claims
    transport   `CudaIpcTransport`: register (export handles), write (rows through graphs when
                every row lies in one region pair the destination GPU reads directly, else op
                tables), open a peer's regions once per incarnation, forget, close

Both GPUs must be visible to the writing process (the IPC handle is opened on the decode
engine's device, found by UUID); Ray GPU actors that only see their own GPU need
`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1` or a placement that shares visibility.
Importing this package imports torch; Triton is imported when a kernel is first compiled, and
the registry (`kvray.transport`) imports this package only when the transport is first used.
"""

from kvray.transport.cuda_ipc.allocation import check_inside_allocation, cuda_allocation_range
from kvray.transport.cuda_ipc.digests import DigestCell
from kvray.transport.cuda_ipc.driver import libcuda
from kvray.transport.cuda_ipc.graphs import (
    RowCopy,
    RowGraph,
    RowTable,
    StretchTables,
    capacity_for,
    capture_rows,
    copy_rows,
    hash_stretches,
    idle_graph,
    launch_rows,
    launch_rows_kernel,
    row_table,
    start_rows,
)
from kvray.transport.cuda_ipc.kernels import (
    MAX_PIECE_NBYTES,
    UNIT_DTYPES,
    Digests,
    copy_kernel,
    fetch_kernel,
    pick_unit,
    rows_kernel,
)
from kvray.transport.cuda_ipc.ops import Hashing, copy_ops, launch_copy, upload_table
from kvray.transport.cuda_ipc.streams import (
    copy_stream,
    device_of_uuid,
    device_uuid,
    follow_current,
    peer_reads,
    wait_for_events,
)
from kvray.transport.cuda_ipc.transport import CudaIpcTransport
from kvray.wire import CudaIpcHandle

__all__ = [
    "MAX_PIECE_NBYTES",
    "UNIT_DTYPES",
    "CudaIpcHandle",
    "CudaIpcTransport",
    "DigestCell",
    "Digests",
    "Hashing",
    "RowCopy",
    "RowGraph",
    "RowTable",
    "StretchTables",
    "capacity_for",
    "capture_rows",
    "check_inside_allocation",
    "copy_kernel",
    "copy_ops",
    "copy_rows",
    "copy_stream",
    "cuda_allocation_range",
    "device_of_uuid",
    "device_uuid",
    "fetch_kernel",
    "follow_current",
    "hash_stretches",
    "idle_graph",
    "launch_copy",
    "launch_rows",
    "launch_rows_kernel",
    "libcuda",
    "peer_reads",
    "pick_unit",
    "row_table",
    "rows_kernel",
    "start_rows",
    "upload_table",
    "wait_for_events",
]
