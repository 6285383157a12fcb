"""A plan's op table copied by the `cuda_ipc` transport: uploaded from reused pinned buffers, then
ONE kernel launch per region pair on the destination GPU, or gathered, moved and scattered
between two GPUs without peer access.
"""

from __future__ import annotations

import numpy as np
import torch

from kvray.errors import TransportError
from kvray.layout import Int64Array
from kvray.plan import split_ops
from kvray.transport.cuda_ipc.kernels import MAX_PIECE_NBYTES, UNIT_DTYPES, copy_kernel, pick_unit
from kvray.transport.cuda_ipc.streams import copy_stream, follow_current, peer_reads

#: Pinned host buffers kept per device for op tables (each reused once its upload is done).
_KEPT_TABLE_BUFFERS = 8
_table_buffers: dict[int, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}


def upload_table(device: torch.device, *columns: Int64Array) -> torch.Tensor:
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
        table = upload_table(dst.device, src_offsets, dst_offsets, nbytes)
        copy_kernel()[(nbytes.size,)](
            src.view(UNIT_DTYPES[unit]),
            dst.view(UNIT_DTYPES[unit]),
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
    target_stream = copy_stream(target_device)
    follow_current(source_device, target_stream)
    if direct and peer_reads(target_device, source_device):
        with torch.cuda.stream(target_stream):
            launch_copy(dst, src, dst_offsets, src_offsets, nbytes)
    else:
        total = int(nbytes.sum())
        staged = np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
        source_stream = copy_stream(source_device)
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
