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
Memory on a GPU is gathered to the host first (`DeviceRegions`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvray.errors import KVIntegrityError, MetadataError
from kvray.layout import Int64Array, KVLayout, LayerPlacement, TensorParallel
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
    unmerged = plan.unmerged
    starts = plan.layer_starts
    layers: list[Pieces] = []
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


def writer_checksums(plan: TransferPlan, regions: RegionBytes, dst_layout: KVLayout) -> Checksums:
    """The values a writer sends for `plan`: each layer's bytes as read from its `regions`."""
    names = dst_layout.layer_names
    indices = tuple(names.index(layer) for layer in plan.layers)
    values = tuple(hash_pieces(regions, pieces) for pieces in writer_pieces(plan))
    return Checksums(indices, values)


# ---- the decode side -------------------------------------------------------------------------


def landed_pieces(
    layout: KVLayout,
    placement: LayerPlacement,
    blocks: Int64Array,
    layer: str,
    heads: tuple[int, int] | None,
) -> Pieces:
    """The ranges of `layer` (at `placement` in the decode engine's own layout) that a transfer
    fills in the reservation's `blocks`; `heads`: the model-wide (first, count) of the KV heads
    the writer holds where it holds only some of this rank's (`shared_heads`)."""
    if heads is None:
        runs = [(part, 0, placement.part_nbytes) for part in range(placement.parts)]
    else:
        first, count = heads
        geometry = layout.layer(layer).geometry
        shared = head_runs(geometry, first - layout.tp.first_head, count)
        runs = [(run.part, run.offset, run.nbytes) for run in shared]
    run_start = np.array(
        [placement.offset + part * placement.part_stride + at for part, at, _ in runs], dtype=np.int64
    )
    run_bytes = np.array([nbytes for _, _, nbytes in runs], dtype=np.int64)
    # Block after block, each block's runs in order: then sorted by where they sit.
    starts = (run_start[None, :] + blocks[:, None] * placement.block_stride).ravel()
    nbytes = np.tile(run_bytes, blocks.size)
    order = np.argsort(starts, kind="stable")
    return Pieces(np.full(starts.size, placement.region, dtype=np.int64), starts[order], nbytes[order])


def landed_checksums(
    regions: RegionBytes,
    layout: KVLayout,
    placements: Mapping[str, LayerPlacement],
    blocks: Int64Array,
    layers: Sequence[int],
    writer_tp: TensorParallel | None,
) -> tuple[int, ...]:
    """The values of `layers` (indices into the decode engine's `layout`) over the bytes as
    they sit in its `blocks` (see `landed_pieces`)."""
    heads = None if writer_tp is None else shared_heads(writer_tp, layout.tp, "the writer", "this engine")
    names = layout.layer_names
    return tuple(
        hash_pieces(regions, landed_pieces(layout, placements[names[index]], blocks, names[index], heads))
        for index in layers
    )


def check(
    expected: Checksums,
    regions: RegionBytes,
    layout: KVLayout,
    placements: Mapping[str, LayerPlacement],
    blocks: Int64Array,
    writer_tp: TensorParallel | None,
    *,
    request_id: str,
    engine_id: str,
    writer: str,
) -> None:
    """`KVIntegrityError` naming every layer whose landed bytes differ from `expected`;
    `MetadataError` for checksums that do not describe this engine's layers."""
    if len(expected.layers) != len(expected.values) or len(set(expected.layers)) != len(expected.layers):
        raise MetadataError(
            f"the checksums of {request_id!r} from {writer!r} name {len(expected.layers)} layers "
            f"for {len(expected.values)} values, or a layer twice",
            request_id=request_id,
            engine_id=engine_id,
        )
    if any(not 0 <= index < len(layout.layers) for index in expected.layers):
        raise MetadataError(
            f"the checksums of {request_id!r} from {writer!r} name a layer engine {engine_id!r} lacks",
            request_id=request_id,
            engine_id=engine_id,
        )
    landed = landed_checksums(regions, layout, placements, blocks, expected.layers, writer_tp)
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


# ---- reading and hashing ------------------------------------------------------------------------


class RegionBytes(Protocol):
    """An engine's regions as the hash reads them."""

    def read(self, region: Int64Array, offset: Int64Array, nbytes: Int64Array) -> Iterator[memoryview]:
        """The bytes of each range in order (several ranges may come as one buffer)."""
        ...


class HostRegions:
    """Regions in host memory: each a buffer of its bytes, read in place."""

    def __init__(self, regions: Sequence[npt.NDArray[np.uint8]]) -> None:
        self._views = [region.reshape(-1).view(np.uint8).data for region in regions]

    def read(self, region: Int64Array, offset: Int64Array, nbytes: Int64Array) -> Iterator[memoryview]:
        views = self._views
        for r, start, length in zip(region.tolist(), offset.tolist(), nbytes.tolist(), strict=True):
            yield views[r][start : start + length]


class DeviceRegions:
    """Regions on a GPU: the ranges are gathered on the device and copied to the host."""

    def __init__(self, regions: Sequence[torch.Tensor]) -> None:
        self._tensors = list(regions)

    def read(self, region: Int64Array, offset: Int64Array, nbytes: Int64Array) -> Iterator[memoryview]:
        parts = [
            self._tensors[r][start : start + length]
            for r, start, length in zip(region.tolist(), offset.tolist(), nbytes.tolist(), strict=True)
        ]
        if parts:
            yield torch.cat(parts).cpu().numpy().data


def regions_of(backing: Backing) -> RegionBytes:
    """How the hash reads `backing`'s regions."""
    tensors = [region.tensor for region in backing.regions]
    if any(tensor.device.type != "cpu" for tensor in tensors):
        return DeviceRegions(tensors)
    return HostRegions([tensor.numpy() for tensor in tensors])


def hash_pieces(regions: RegionBytes, pieces: Pieces) -> int:
    """XXH3-64 of the pieces' bytes as one stream (ranges that follow each other in memory are
    read as one)."""
    import xxhash

    digest = xxhash.xxh3_64()
    for data in regions.read(*_merged(pieces)):
        digest.update(data)
    return digest.intdigest()


def _merged(pieces: Pieces) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The pieces with each run of back-to-back ranges (same region) joined into one."""
    region, offset, nbytes = pieces.region, pieces.offset, pieces.nbytes
    if region.size <= 1:
        return region, offset, nbytes
    joins = (region[1:] == region[:-1]) & (offset[:-1] + nbytes[:-1] == offset[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return region[starts], offset[starts], np.add.reduceat(nbytes, starts)
