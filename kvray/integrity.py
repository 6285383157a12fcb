"""Integrity: the decode side's check, before a request may decode, that every layer's bytes
landed as the writer read them.

The writer hashes each layer's bytes as it reads them for the push (`writer_checksums`) and
sends the values in its completion notice (`TransferDone.checksums`). The decode engine hashes
the bytes as they sit in its own blocks (`landed_checksums`) and takes the request only when
every layer agrees; otherwise the request fails with `KVIntegrityError` naming the layers.

What one layer's value covers: the bytes the transfer moves into the request's blocks of that
layer, in the order of their place in the decode engine's memory (region, then offset). The
writer reads its own blocks in that order (its plan's ops, sorted by destination); the decode
side finds the places from its own layout and reservation, never from the writer's plan. So a
plan that writes a layer over another (the seed bug), a byte flipped on the way, or a write
that never landed all fail the check alike.

The hash is XXH3-64 (the xxHash library, `xxhash` on PyPI) over those bytes as one stream: it
reads 15-20 GB/s on one core here and releases the GIL, so large checks run on a worker thread.
Memory on a GPU is gathered to the host first (`_host_bytes`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import torch

from kvray.errors import KVIntegrityError, MetadataError
from kvray.layout import Int64Array, KVLayout, TensorParallel
from kvray.memory import Backing
from kvray.plan import TransferPlan
from kvray.tensor_parallel import head_runs, shared_heads

#: The one algorithm: what `TransferDone.checksum` names.
XXH3_64: Final = "xxh3_64"
#: Checks of at least this many bytes run on a worker thread (below it the hop costs more).
THREAD_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Pieces:
    """Byte ranges of one layer in one engine's regions, in the order they are hashed."""

    region: Int64Array
    offset: Int64Array
    nbytes: Int64Array

    @property
    def total(self) -> int:
        return int(self.nbytes.sum())


@dataclass(frozen=True)
class Checksums:
    """A transfer's values: per layer (its index in the decode engine's layout), one hash."""

    layers: tuple[int, ...]
    values: tuple[int, ...]
    algorithm: Literal["xxh3_64"] = XXH3_64


def sampled(request_id: str, rate: float) -> bool:
    """Whether the request is checked at sampling `rate` (0 to 1): decided by its id alone, so
    every layer and every rank of a request decide alike."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    return zlib.crc32(request_id.encode()) < rate * 2**32


# ---- the writer's side ---------------------------------------------------------------------


def writer_pieces(plan: TransferPlan) -> list[Pieces]:
    """Per layer of `plan`: the local ranges its ops read, in the order of where they land."""
    layers: list[Pieces] = []
    rows = plan.rows
    if rows is not None:
        for index in range(len(plan.layers)):
            first, stop = rows.local.layer_starts[index], rows.local.layer_starts[index + 1]
            local = slice(first, stop)
            local_start = (
                rows.local.base[local, None] + rows.local_ids[None, :] * rows.local.block_stride[local, None]
            )
            remote_start = (
                rows.remote.base[local, None]
                + rows.remote_ids[None, :] * rows.remote.block_stride[local, None]
            )
            blocks = rows.local_ids.size
            local_region = np.repeat(rows.local.region[local], blocks)
            remote_region = np.repeat(rows.remote.region[local], blocks)
            nbytes = np.repeat(rows.local.nbytes[local], blocks)
            order = np.lexsort((remote_start.ravel(), remote_region))
            layers.append(Pieces(local_region[order], local_start.ravel()[order], nbytes[order]))
        return layers
    unmerged = plan.unmerged
    starts = plan.layer_starts
    for index in range(len(plan.layers)):
        span = slice(starts[index], starts[index + 1])
        order = np.lexsort((unmerged.remote_offset[span], unmerged.remote_region[span]))
        layers.append(
            Pieces(
                unmerged.local_region[span][order],
                unmerged.local_offset[span][order],
                unmerged.nbytes[span][order],
            )
        )
    return layers


def writer_checksums(plan: TransferPlan, backing: Backing, dst_layout: KVLayout) -> Checksums:
    """The values a writer sends for `plan`: each layer's bytes as read from `backing`."""
    names = dst_layout.layer_names
    indices = tuple(names.index(layer) for layer in plan.layers)
    values = tuple(hash_pieces(backing, pieces) for pieces in writer_pieces(plan))
    return Checksums(indices, values)


# ---- the decode side -------------------------------------------------------------------------


def landed_pieces(
    layout: KVLayout,
    placements: Sequence[tuple[int, int, int, int, int, int]],
    blocks: Int64Array,
    layer: str,
    heads: tuple[int, int] | None,
) -> Pieces:
    """The ranges of `layer` a transfer fills in the reservation's `blocks`, found from the
    decode engine's own layout: `placements` gives each layer's (region, offset, part_stride,
    block_stride, part_nbytes, parts) in layout order; `heads`: the model-wide (first, count) of
    the KV heads the writer holds when it holds only some of this rank's (`shared_heads`)."""
    index = layout.layer_names.index(layer)
    region, offset, part_stride, block_stride, part_nbytes, parts = placements[index]
    if heads is None:
        runs = [(part, 0, part_nbytes) for part in range(parts)]
    else:
        first, count = heads
        geometry = layout.layers[index].geometry
        runs = [
            (run.part, run.offset, run.nbytes)
            for run in head_runs(geometry, first - layout.tp.first_head, count)
        ]
    run_start = np.array([offset + part * part_stride + at for part, at, _ in runs], dtype=np.int64)
    run_bytes = np.array([nbytes for _, _, nbytes in runs], dtype=np.int64)
    starts = (run_start[:, None] + np.sort(blocks)[None, :] * block_stride).T.ravel()
    nbytes = np.tile(run_bytes, blocks.size)
    order = np.argsort(starts, kind="stable")
    return Pieces(np.full(starts.size, region, dtype=np.int64), starts[order], nbytes[order])


def landed_checksums(
    backing: Backing,
    placements: Sequence[tuple[int, int, int, int, int, int]],
    blocks: Int64Array,
    layers: Sequence[int],
    writer_tp: TensorParallel | None,
) -> tuple[int, ...]:
    """The values of `layers` (indices into the decode engine's layout) over the bytes as they
    sit in its `blocks` (see `landed_pieces`)."""
    layout = backing.layout
    heads = None if writer_tp is None else shared_heads(writer_tp, layout.tp, "the writer", "this engine")
    return tuple(
        hash_pieces(backing, landed_pieces(layout, placements, blocks, layout.layer_names[index], heads))
        for index in layers
    )


def placements_of(backing: Backing) -> list[tuple[int, int, int, int, int, int]]:
    """Each layer's placement in `backing`, in layout order, as plain numbers."""
    return [
        (p.region, p.offset, p.part_stride, p.block_stride, p.part_nbytes, p.parts)
        for p in (backing.placements[name] for name in backing.layout.layer_names)
    ]


def check(
    expected: Checksums,
    backing: Backing,
    placements: Sequence[tuple[int, int, int, int, int, int]],
    blocks: Int64Array,
    writer_tp: TensorParallel | None,
    *,
    request_id: str,
    engine_id: str,
    writer: str,
) -> None:
    """`KVIntegrityError` naming every layer whose landed bytes differ from `expected`."""
    layout = backing.layout
    if expected.algorithm != XXH3_64:
        raise MetadataError(f"checksum algorithm {expected.algorithm!r} is not one kvray knows")
    if len(expected.layers) != len(expected.values) or len(set(expected.layers)) != len(expected.layers):
        raise MetadataError(
            f"the checksums of {request_id!r} from {writer!r} name {len(expected.layers)} layers "
            f"for {len(expected.values)} values, or a layer twice"
        )
    if any(not 0 <= index < len(layout.layers) for index in expected.layers):
        raise MetadataError(f"the checksums of {request_id!r} from {writer!r} name a layer this engine lacks")
    landed = landed_checksums(backing, placements, blocks, expected.layers, writer_tp)
    wrong = [
        layout.layer_names[index]
        for index, want, got in zip(expected.layers, expected.values, landed, strict=True)
        if want != got
    ]
    if wrong:
        raise KVIntegrityError(
            f"the KV of request {request_id!r} from {writer!r} did not land as it was sent: "
            f"{len(wrong)} of {len(expected.layers)} layers differ ({', '.join(wrong[:8])}"
            f"{', ...' if len(wrong) > 8 else ''}); the request is not decoded from it",
            request_id=request_id,
            engine_id=engine_id,
            src_engine=writer,
            layers=wrong,
        )


# ---- hashing ----------------------------------------------------------------------------------


def hash_pieces(backing: Backing, pieces: Pieces) -> int:
    """XXH3-64 of the pieces' bytes of `backing` as one stream (ranges that follow each other
    in memory are read as one)."""
    import xxhash

    region, offset, nbytes = _merged(pieces)
    digest = xxhash.xxh3_64()
    if region.size and backing.regions[int(region[0])].tensor.device.type != "cpu":
        for data in _host_bytes(backing, region, offset, nbytes):
            digest.update(data)
        return digest.intdigest()
    views: dict[int, memoryview] = {}
    for r, start, length in zip(region.tolist(), offset.tolist(), nbytes.tolist(), strict=True):
        view = views.get(r)
        if view is None:
            view = views[r] = memoryview(backing.regions[r].tensor.numpy())
        digest.update(view[start : start + length])
    return digest.intdigest()


def _merged(pieces: Pieces) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The pieces with each run of back-to-back ranges (same region) joined into one."""
    region, offset, nbytes = pieces.region, pieces.offset, pieces.nbytes
    if region.size <= 1:
        return region, offset, nbytes
    joins = (region[1:] == region[:-1]) & (offset[:-1] + nbytes[:-1] == offset[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return region[starts], offset[starts], np.add.reduceat(nbytes, starts)


def _host_bytes(backing: Backing, region: Int64Array, offset: Int64Array, nbytes: Int64Array) -> list[bytes]:
    """The ranges of a GPU backing, copied to the host in order."""
    parts = [
        backing.regions[r].tensor[start : start + length]
        for r, start, length in zip(region.tolist(), offset.tolist(), nbytes.tolist(), strict=True)
    ]
    if not parts:
        return []
    gathered = torch.cat(parts).cpu().numpy()
    return [gathered.tobytes()]
