"""The content sums of an engine's own blocks on its GPU, hashed when their request is held
(`kvray.content.HeldDigests`), so that the push that later moves them reads no byte to check
its copy: the block kernel per source region on kvray's copy stream, storing nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvray.content import HeldRows, region_seeds
from kvray.layout import Int64Array
from kvray.transport.cuda_ipc.kernels import (
    HASH_MAX_UNIT,
    HASH_STEP_NBYTES,
    MAX_GRID_YZ,
    MAX_PIECE_NBYTES,
    UNIT_DTYPES,
    blocks_kernel,
    pick_unit,
)
from kvray.transport.cuda_ipc.streams import copy_stream, follow_current, wait_for_events


async def held_sums(
    tensors: Sequence[torch.Tensor], rows: HeldRows, blocks: Int64Array
) -> npt.NDArray[np.uint64] | None:
    """The content sums of `blocks` (`HeldDigests.keep`'s `sums`: one per row of `rows` and
    block), hashed on the GPUs of `tensors` (an engine's regions) after the work queued on them
    so far (the model that wrote the KV); None where a layout's rows do not fit one kernel grid
    (the push then hashes its blocks itself)."""
    sums = np.zeros((rows.layer.size, blocks.size), dtype=np.uint64)
    if not blocks.size or not rows.layer.size:
        return sums
    sources, per_source = np.unique(rows.region, return_counts=True)
    if int(per_source.max()) > MAX_GRID_YZ or -(-int(rows.nbytes.max()) // MAX_PIECE_NBYTES) > MAX_GRID_YZ:
        return None
    ids = np.ascontiguousarray(blocks, dtype=np.int64)
    pending: list[tuple[npt.NDArray[np.bool_], torch.Tensor, tuple[torch.Tensor, ...]]] = []
    events = []
    for source in sources.tolist():
        select = rows.region == source
        tensor = tensors[source]
        columns = (rows.start[select], rows.stride[select], rows.nbytes[select])
        combined = int(np.bitwise_or.reduce(np.concatenate(columns)))
        unit = pick_unit(bases=(combined, tensor.data_ptr()))
        vector = max(1, unit // HASH_MAX_UNIT)
        unit = min(HASH_MAX_UNIT, unit)
        num_rows = int(select.sum())
        pieces = -(-int(columns[2].max()) // MAX_PIECE_NBYTES)
        device = tensor.device
        stream = copy_stream(device.index or 0)
        follow_current(device.index or 0, stream)
        table = np.concatenate((*columns, region_seeds(rows.region[select]).view(np.int64)))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            table_on_gpu = torch.from_numpy(table).to(device, non_blocking=True)
            ids_on_gpu = torch.from_numpy(ids).to(device, non_blocking=True)
            found = torch.zeros(num_rows * ids.size, dtype=torch.int64, device=device)
            blocks_kernel()[(ids.size, num_rows, pieces)](
                tensor.view(UNIT_DTYPES[unit]),
                table_on_gpu,
                ids_on_gpu,
                found,
                num_rows,
                ids.size,
                SHIFT=unit.bit_length() - 1,
                PIECE=MAX_PIECE_NBYTES,
                BLOCK=HASH_STEP_NBYTES // unit,
                VEC=vector,
                num_warps=8,
            )
            host = torch.empty(found.numel(), dtype=torch.int64, pin_memory=True)
            host.copy_(found, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        # The device tensors are kept until the hash is done.
        pending.append((select, host, (table_on_gpu, ids_on_gpu, found)))
        events.append(done)
    await wait_for_events(events, int(rows.nbytes.sum()) * int(ids.size))
    for select, host, _ in pending:
        sums[select] = host.numpy().view(np.uint64).reshape(-1, ids.size)
    return sums
