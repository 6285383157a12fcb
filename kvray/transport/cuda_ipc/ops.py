"""A plan's op table copied by the `cuda_ipc` transport: uploaded from reused pinned buffers, then
ONE kernel launch per region pair on the destination GPU, or gathered, moved and scattered
between two GPUs without peer access.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvray.content import pair_salt, region_seed
from kvray.errors import TransportError
from kvray.layout import Int64Array
from kvray.memory import SourceReady
from kvray.placement import MASK64, region_salt
from kvray.plan import split_ops
from kvray.transport.cuda_ipc.digests import DigestCell, give_back, take_cell
from kvray.transport.cuda_ipc.kernels import (
    HASH_MAX_UNIT,
    HASH_STEP_NBYTES,
    MAX_PIECE_NBYTES,
    UNIT_DTYPES,
    copy_kernel,
    pick_unit,
)
from kvray.transport.cuda_ipc.streams import copy_stream, follow_current, peer_reads, wait_for_events

#: Faults only (`kvray.faults.executor_offset_bug`): the copies store the last op (block pair)
#: of a write of two or more over the one before it, under a correct plan.
executor_fault = False


def set_executor_fault(on: bool) -> None:
    """Faults only: make every `cuda_ipc` copy store its last op over the one before it."""
    global executor_fault
    executor_fault = on


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


class Hashing(NamedTuple):
    """What a copy that reports digests needs beyond its ops: where its programs add their
    sums, the source and destination regions' indices (for the seed and salts), whether it
    hashes the content too, and where each op's bytes count as bound when the copy only stages
    them (default: its targets)."""

    cell: DigestCell
    src_region: int
    dst_region: int
    content: bool = True
    #: The landed digest (`kvray.content.landed_digest`): each word weighed as at the place it
    #: is bound for, in `dst_region`'s seed, with no factor for moving it (`bound` required).
    at_bound: bool = False
    #: Where each op's bytes count as bound and stored (`kvray.placement`) when the copy only
    #: stages them (default: its targets).
    bound: Int64Array | None = None

    def parameters(self) -> Int64Array:
        """The source seed, the pair salt and the destination region's salt (`kvray.placement`)
        as int64 bit patterns (the op table's last three entries)."""
        seeded = self.dst_region if self.at_bound else self.src_region
        values = np.array(
            [
                region_seed(seeded),
                pair_salt(seeded, self.dst_region),
                region_salt(self.dst_region),
            ],
            dtype=np.uint64,
        )
        return values.view(np.int64)


def launch_copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    hashing: Hashing | None = None,
    *,
    store: bool = True,
) -> None:
    """One kernel launch on `dst`'s GPU, on that GPU's current stream, copying every
    (dst_offset, src_offset, nbytes) op between two uint8 tensors. `src` is on the same GPU or
    on one whose memory `dst`'s GPU can read (`peer_reads`). With `hashing`, the programs add
    their digests into its cell's slots (the caller folds them); without `store`, they only
    hash. Bounds are the caller's job (kvray checks every op before it gets here)."""
    if nbytes.size == 0:
        return
    reader, owner = dst.device.index or 0, src.device.index or 0
    if not peer_reads(reader, owner):
        raise TransportError(
            f"GPU {reader} cannot read GPU {owner}'s memory (no peer access between them)",
            reader=reader,
            owner=owner,
        )
    bound = dst_offsets if hashing is None or hashing.bound is None else hashing.bound
    unit = pick_unit(dst_offsets, src_offsets, nbytes, bound, bases=(dst.data_ptr(), src.data_ptr()))
    if hashing is None:
        vector = 2 if unit == 16 else 1
        unit = min(8, unit)
        # Remote loads need more bytes in flight per program than local ones.
        block, warps = (4096, 16) if reader != owner else (2048, 8)
    else:
        vector = max(1, unit // HASH_MAX_UNIT)
        unit = min(HASH_MAX_UNIT, unit)
        block, warps = HASH_STEP_NBYTES // unit, 8
    if int(nbytes.max()) > MAX_PIECE_NBYTES:
        # Long ops are cut so that no program copies much more than the others.
        if hashing is not None:
            bound, _, _ = split_ops(bound, src_offsets, nbytes, MAX_PIECE_NBYTES)
        dst_offsets, src_offsets, nbytes = split_ops(dst_offsets, src_offsets, nbytes, MAX_PIECE_NBYTES)
    with torch.cuda.device(dst.device):
        if hashing is None:
            table = upload_table(dst.device, src_offsets, dst_offsets, nbytes)
        else:
            table = upload_table(dst.device, src_offsets, dst_offsets, nbytes, bound, hashing.parameters())
        copy_kernel()[(nbytes.size,)](
            src.view(UNIT_DTYPES[unit]),
            dst.view(UNIT_DTYPES[unit]),
            table,
            table if hashing is None else hashing.cell.slots,
            nbytes.size,
            SHIFT=unit.bit_length() - 1,
            BLOCK=block,
            VEC=vector,
            DIGESTS=hashing is not None,
            CONTENT=hashing is not None and hashing.content,
            AT_BOUND=hashing is not None and hashing.at_bound,
            STORE=store,
            num_warps=warps,
        )


def reading_device(dst: torch.Tensor, src: torch.Tensor, *, direct: bool = True) -> torch.device:
    """The GPU whose kernel reads the source in `copy_ops` (where a hashing copy's cell lives)."""
    if direct and peer_reads(dst.device.index or 0, src.device.index or 0):
        return dst.device
    return src.device


def copy_ops(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_offsets: Int64Array,
    src_offsets: Int64Array,
    nbytes: Int64Array,
    *,
    direct: bool = True,
    hashing: Hashing | None = None,
    ready: SourceReady = None,
) -> torch.cuda.Event:
    """Copy the ops from `src` into `dst`, on one GPU or across two, and return an event that
    completes when every byte is in `dst`. The copies wait for `ready`
    (`kvray.memory.SourceReady`), else for the work already queued on the source GPU's current
    stream (the model that wrote the KV).

    One GPU, or two GPUs with peer access (NVLink) and `direct`: one kernel on the destination
    GPU, loading the source over the link. That is a pull by the writer's own process into
    memory it opened through IPC; the decode process takes no part. Otherwise: a kernel gathers
    the ops into one staging buffer on the source GPU, one device-to-device copy moves it, and a
    kernel on the destination GPU scatters it into place. With `hashing`, the kernel that reads
    the source adds the content digest of the ops into its cell (on `reading_device`'s GPU)
    and folds it there: the cell holds the digest once the returned event has completed.
    """
    source_device = src.device.index or 0
    target_device = dst.device.index or 0
    target_stream = copy_stream(target_device)
    follow_current(source_device, target_stream, ready)
    if executor_fault and dst_offsets.size >= 2:
        dst_offsets = dst_offsets.copy()
        dst_offsets[-1] = dst_offsets[-2]
    if direct and peer_reads(target_device, source_device):
        with torch.cuda.stream(target_stream):
            launch_copy(dst, src, dst_offsets, src_offsets, nbytes, hashing)
            if hashing is not None:
                with torch.cuda.device(dst.device):
                    hashing.cell.fold()
    else:
        total = int(nbytes.sum())
        staged = np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
        source_stream = copy_stream(source_device)
        follow_current(source_device, source_stream, ready)
        with torch.cuda.stream(source_stream):
            outgoing = torch.empty(total, dtype=torch.uint8, device=src.device)
            gathering = None if hashing is None else hashing._replace(bound=dst_offsets)
            launch_copy(outgoing, src, staged, src_offsets, nbytes, gathering)
            if hashing is not None:
                with torch.cuda.device(src.device):
                    hashing.cell.fold()
        with torch.cuda.stream(source_stream), torch.cuda.stream(target_stream):
            incoming = torch.empty(total, dtype=torch.uint8, device=dst.device)
            # torch copies on the source GPU's current stream and orders the target's after it.
            incoming.copy_(outgoing, non_blocking=True)
            launch_copy(dst, incoming, dst_offsets, staged, nbytes)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(target_stream)
    return done


async def landed_digest(
    tensors: Sequence[torch.Tensor],
    src_region: Int64Array,
    src_offset: Int64Array,
    dst_region: Int64Array,
    dst_offset: Int64Array,
    nbytes: Int64Array,
    ready: SourceReady = None,
) -> int:
    """The landed digest (`kvray.content.landed_digest`) of bytes in GPU memory: the bytes at
    `src_offset` of `tensors[src_region]` as if they sat at `dst_offset` of region `dst_region`
    (a writer's blocks as they must land; a decode engine's own, `src` = `dst`), hashed by the
    op kernel storing nothing, on kvray's copy stream after `ready` (a writer's, as its write
    takes it), else after the work queued on each GPU."""
    cells: list[DigestCell] = []
    events = []
    pairs = np.unique(np.stack([src_region, dst_region]), axis=1).T.tolist() if nbytes.size else []
    for source, target in pairs:
        select = (src_region == source) & (dst_region == target)
        tensor = tensors[source]
        device = tensor.device.index or 0
        stream = copy_stream(device)
        follow_current(device, stream, ready)
        cells.append(take_cell(tensor.device))
        hashing = Hashing(cells[-1], source, target, at_bound=True, bound=dst_offset[select])
        with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
            launch_copy(
                tensor, tensor, src_offset[select], src_offset[select], nbytes[select], hashing, store=False
            )
            cells[-1].fold()
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        events.append(done)
    # A cell whose hash did not complete is not given back (its slots may hold a sum).
    await wait_for_events(events, int(nbytes.sum()))
    total = 0
    for cell in cells:
        total += cell.value().content or 0
        give_back(cell)
    return total & MASK64
