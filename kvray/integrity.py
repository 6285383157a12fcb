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

Placement, on every transfer: the notice also carries the placement digest of the ranges the
writer's executor stored to (`kvray.placement`), and the decode side compares it with the digest
of where its own layout puts the named layers' parts of the reservation's blocks
(`PlacementTable`): O(ops), no byte read, so it is never sampled. It catches a layer written over
another, a block written twice or not at all, and an executor that stored elsewhere than its plan
said; the checksums below are what catch wrong bytes in the right places.

Two algorithms, named in the notice; the writer picks the one its memory hashes fastest and
the decode side computes the same, wherever its own memory is:
- `xxh3_64` for host memory: XXH3-64 (the xxHash library, `xxhash` on PyPI) over the bytes as one
  stream. It reads 15-20 GB/s on one core here and releases the GIL, so large checks run on a
  worker thread.
- `wsum64` for GPU memory: a position-weighted sum of the stream's 32-bit words, computed on the
  device by reduction kernels (`wsum64`), so only eight bytes per layer cross to the host. Any
  one flipped bit of a stream shorter than 8 GiB changes it, and so does a block moved to
  another place; it is a checksum against faults, not a defence against a forger (the notice's
  channel is what the writer is checked by).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvray.errors import KVIntegrityError, MetadataError
from kvray.layout import Int64Array, KVLayout, LayerPlacement, TensorParallel
from kvray.memory import Backing
from kvray.placement import runs_digest
from kvray.plan import TransferPlan
from kvray.tensor_parallel import head_runs, shared_heads

#: The algorithms: what `TransferDone.checksum` names.
XXH3_64: Final = "xxh3_64"
WSUM64: Final = "wsum64"
Algorithm = Literal["xxh3_64", "wsum64"]
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
    algorithm: Algorithm = XXH3_64


#: How the hand-off names the part of a request one tensor-parallel rank pushes.
_TP_PART = "#tp"


def sampled(request_id: str, rate: float) -> bool:
    """Whether the request is checked at sampling `rate` (0 to 1): decided by its id alone, so
    every layer of a request, and every tensor-parallel part of it (`<id>#tp<rank>`), decide
    alike. BLAKE2b of the id: a linear hash (CRC) would tie related ids' decisions together."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    request = request_id.split(_TP_PART, 1)[0]
    drawn = int.from_bytes(hashlib.blake2b(request.encode(), digest_size=8).digest(), "big")
    return drawn < rate * 2**64


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
    algorithm = regions.algorithm
    values = regions.digest_layers(writer_pieces(plan), algorithm)
    return Checksums(indices, values, algorithm)


# ---- the decode side -------------------------------------------------------------------------


class PlacementTable:
    """Where a transfer of some layers (with some heads) lands in one block of the decode
    engine: per run of bytes its region, start in block 0 and length, and the stride from one
    block to the next; `digest(blocks)` is the placement digest a transfer of those layers into
    `blocks` must report. Built once per (layers, heads) and kept by the receiving side."""

    def __init__(
        self,
        layout: KVLayout,
        placements: Mapping[str, LayerPlacement],
        layers: Sequence[int],
        heads: tuple[int, int] | None,
    ) -> None:
        names = layout.layer_names
        region: list[int] = []
        start: list[int] = []
        nbytes: list[int] = []
        stride: list[int] = []
        for index in layers:
            name = names[index]
            placement = placements[name]
            for part, at, length in _runs(layout, placement, name, heads):
                region.append(placement.region)
                start.append(placement.offset + part * placement.part_stride + at)
                nbytes.append(length)
                stride.append(placement.block_stride)
        self.region = np.array(region, dtype=np.int64)
        self.start = np.array(start, dtype=np.int64)
        self.nbytes = np.array(nbytes, dtype=np.int64)
        self.stride = np.array(stride, dtype=np.int64)

    def digest(self, blocks: Int64Array) -> int:
        return runs_digest(self.region, self.start, self.nbytes, self.stride, blocks)


def _runs(
    layout: KVLayout, placement: LayerPlacement, layer: str, heads: tuple[int, int] | None
) -> list[tuple[int, int, int]]:
    """(part, offset in the part, nbytes) of what a transfer fills in one block of `layer`:
    every part whole, or the head runs of `heads` (see `landed_pieces`)."""
    if heads is None:
        return [(part, 0, placement.part_nbytes) for part in range(placement.parts)]
    first, count = heads
    geometry = layout.layer(layer).geometry
    return [
        (run.part, run.offset, run.nbytes) for run in head_runs(geometry, first - layout.tp.first_head, count)
    ]


def writer_heads(layout: KVLayout, writer_tp: TensorParallel | None) -> tuple[int, int] | None:
    """The model-wide (first, count) of this engine's KV heads a writer of rank `writer_tp`
    holds, where it holds only some (None: all)."""
    return None if writer_tp is None else shared_heads(writer_tp, layout.tp, "the writer", "this engine")


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
    runs = _runs(layout, placement, layer, heads)
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
    algorithm: Algorithm = XXH3_64,
) -> tuple[int, ...]:
    """The `algorithm` values of `layers` (indices into the decode engine's `layout`) over the
    bytes as they sit in its `blocks` (see `landed_pieces`)."""
    heads = writer_heads(layout, writer_tp)
    names = layout.layer_names
    pieces = (
        landed_pieces(layout, placements[names[index]], blocks, names[index], heads) for index in layers
    )
    return regions.digest_layers(list(pieces), algorithm)


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
    landed = landed_checksums(
        regions, layout, placements, blocks, expected.layers, writer_tp, expected.algorithm
    )
    compared = zip(expected.layers, expected.values, landed, strict=True)
    wrong = layout.names_at(index for index, want, got in compared if want != got)
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
    """An engine's regions as the checks read them."""

    #: The algorithm this memory hashes fastest: what a writer over it sends.
    algorithm: Algorithm

    def digest(self, pieces: Pieces, algorithm: Algorithm) -> int:
        """`algorithm`'s value of the pieces' bytes as one stream."""
        ...

    def digest_layers(self, layers: Sequence[Pieces], algorithm: Algorithm) -> tuple[int, ...]:
        """`digest` of each layer's pieces."""
        ...


class HostRegions:
    """Regions in host memory: each a buffer of its bytes, read in place."""

    algorithm: Algorithm = XXH3_64

    def __init__(self, regions: Sequence[npt.NDArray[np.uint8]]) -> None:
        self._views = [region.reshape(-1).view(np.uint8).data for region in regions]

    def read(self, pieces: Pieces) -> Iterator[memoryview]:
        """The pieces' bytes in order, back-to-back ranges as one buffer."""
        views = self._views
        region, offset, nbytes = _merged(pieces)
        for r, start, length in zip(region.tolist(), offset.tolist(), nbytes.tolist(), strict=True):
            yield views[r][start : start + length]

    def digest(self, pieces: Pieces, algorithm: Algorithm) -> int:
        if algorithm == XXH3_64:
            import xxhash

            hasher = xxhash.xxh3_64()
            for data in self.read(pieces):
                hasher.update(data)
            return hasher.intdigest()
        summer = WeightedSum()
        for data in self.read(pieces):
            summer.update(np.frombuffer(data, dtype=np.uint8))
        return summer.value()

    def digest_layers(self, layers: Sequence[Pieces], algorithm: Algorithm) -> tuple[int, ...]:
        return tuple(self.digest(pieces, algorithm) for pieces in layers)


class DeviceRegions:
    """Regions on a GPU: a layer's ranges are gathered into one buffer on the device, summed
    there (`wsum64`), or copied to the host for XXH3 (a writer in host memory)."""

    algorithm: Algorithm = WSUM64

    def __init__(self, regions: Sequence[torch.Tensor]) -> None:
        self._tensors = list(regions)

    def slices(self, pieces: Pieces) -> list[torch.Tensor]:
        """The pieces' bytes as views of the regions (nothing copied), back-to-back ranges as one."""
        region, offset, nbytes = _merged(pieces)
        return [
            self._tensors[r][start : start + length]
            for r, start, length in zip(region.tolist(), offset.tolist(), nbytes.tolist(), strict=True)
        ]

    def digest(self, pieces: Pieces, algorithm: Algorithm) -> int:
        return self.digest_layers([pieces], algorithm)[0]

    def digest_layers(self, layers: Sequence[Pieces], algorithm: Algorithm) -> tuple[int, ...]:
        """Every layer gathered into one buffer on the device, then summed per layer by a few
        kernels for all the layers at once (not a set of launches per layer)."""
        parts = [self.slices(pieces) for pieces in layers]
        if algorithm == WSUM64:
            return _wsum64_parts(parts, self._tensors[0].device)
        import xxhash

        empty = torch.empty(0, dtype=torch.uint8)
        return tuple(
            xxhash.xxh3_64_intdigest((torch.cat(layer) if layer else empty).cpu().numpy().data)
            for layer in parts
        )


def regions_of(backing: Backing) -> RegionBytes:
    """How the checks read `backing`'s regions."""
    tensors = [region.tensor for region in backing.regions]
    if any(tensor.device.type != "cpu" for tensor in tensors):
        return DeviceRegions(tensors)
    return HostRegions([tensor.numpy() for tensor in tensors])


# ---- wsum64 ---------------------------------------------------------------------------------
#
# The stream's n bytes, zero-padded to whole 32-bit little-endian words w_0 .. w_(m-1):
#   A = sum(w_i),  B = sum((i + 1) * w_i),  value = B + K * A + n   (all mod 2**64, K odd).
# One flipped bit k of word i moves the value by 2**k * (i + 1 + K), which is 0 mod 2**64 only
# where i + 1 = -K mod 2**(64 - k): for K below, no i of a stream under 8 GiB. Integer sums mod
# 2**64 do not depend on the order of the additions, so a GPU reduction, torch on the CPU and
# numpy agree to the bit.

WSUM64_K: Final = 0x9E3779B97F4A7C15
_MASK64: Final = (1 << 64) - 1
#: Words summed per step: bounds the device's temporary int64 tensors (a few of 8 bytes a word).
_WSUM_CHUNK_WORDS: Final = 1 << 23


def wsum64(data: torch.Tensor) -> int:
    """`wsum64` of a 1-D uint8 tensor's bytes, computed where the tensor is (reduction kernels
    on a GPU)."""
    return wsum64_layers([data])[0]


def wsum64_layers(layers: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """`wsum64` of each 1-D uint8 tensor (all on one device), with a few kernels for them all
    (`_wsum64_parts`)."""
    if not layers:
        return ()
    return _wsum64_parts([[layer] for layer in layers], layers[0].device)


def _wsum64_parts(layers: Sequence[Sequence[torch.Tensor]], device: torch.device) -> tuple[int, ...]:
    """`wsum64` of each layer's parts (1-D uint8 tensors on `device`, read as one stream): the
    layers laid end to end in one copy (each zero-padded to whole words) and two running sums
    taken over the whole stream; a layer's sums are differences of the running sums at its ends
    (its weights counted from its own first word: sum((i - start + 1) w_i) = sum((i + 1) w_i) -
    start * sum(w_i)). No atomics, and one copy to the host at the end."""
    sizes = [sum(part.numel() for part in layer) for layer in layers]
    stream: list[torch.Tensor] = []
    for layer, size in zip(layers, sizes, strict=True):
        stream += layer
        if size % 4:
            stream.append(torch.zeros(-size % 4, dtype=torch.uint8, device=device))
    words = (torch.cat(stream) if stream else torch.empty(0, dtype=torch.uint8, device=device)).view(
        torch.int32
    )
    ends = list(itertools.accumulate(-(-size // 4) for size in sizes))
    starts = [0, *ends[:-1]]
    marks = sorted(set(ends) - {0})
    taken: list[int] = []
    plain: list[torch.Tensor] = []
    weighted: list[torch.Tensor] = []
    carry = torch.zeros(2, dtype=torch.int64, device=device)
    for first in range(0, words.numel(), _WSUM_CHUNK_WORDS):
        chunk = words[first : first + _WSUM_CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        count = chunk.numel()
        weight = torch.arange(first + 1, first + 1 + count, dtype=torch.int64, device=device)
        running = torch.stack([torch.cumsum(chunk, 0), torch.cumsum(chunk * weight, 0)]) + carry[:, None]
        inside = [mark for mark in marks if first < mark <= first + count]
        if inside:
            index = torch.tensor([mark - 1 - first for mark in inside], dtype=torch.int64, device=device)
            plain.append(running[0, index])
            weighted.append(running[1, index])
            taken += inside
        carry = running[:, -1]
    sums_a, sums_b = {0: 0}, {0: 0}
    if taken:
        sums_a.update(zip(taken, torch.cat(plain).tolist(), strict=True))
        sums_b.update(zip(taken, torch.cat(weighted).tolist(), strict=True))
    values = []
    for size, start, end in zip(sizes, starts, ends, strict=True):
        total = sums_a[end] - sums_a[start]
        weights = sums_b[end] - sums_b[start] - start * total
        values.append((weights + WSUM64_K * total + size) & _MASK64)
    return tuple(values)


class WeightedSum:
    """`wsum64` over a stream that arrives in buffers (host memory, numpy)."""

    def __init__(self) -> None:
        self._total = 0
        self._weighted = 0
        self._words = 0
        self._nbytes = 0
        self._carry = np.zeros(0, dtype=np.uint8)

    def update(self, data: npt.NDArray[np.uint8]) -> None:
        self._nbytes += data.size
        if self._carry.size:
            data = np.concatenate([self._carry, data])
        whole = data.size - data.size % 4
        self._carry = data[whole:].copy()
        for start in range(0, whole, 4 * _WSUM_CHUNK_WORDS):
            chunk = data[start : min(whole, start + 4 * _WSUM_CHUNK_WORDS)]
            self._add(np.frombuffer(chunk, dtype="<u4"))

    def _add(self, words: npt.NDArray[np.uint32]) -> None:
        wide = words.astype(np.uint64)
        index = np.arange(self._words + 1, self._words + 1 + wide.size, dtype=np.uint64)
        self._total = (self._total + int(wide.sum(dtype=np.uint64))) & _MASK64
        self._weighted = (self._weighted + int((wide * index).sum(dtype=np.uint64))) & _MASK64
        self._words += wide.size

    def value(self) -> int:
        weighted, total = self._weighted, self._total
        if self._carry.size:
            last = np.zeros(4, dtype=np.uint8)
            last[: self._carry.size] = self._carry
            word = int(last.view("<u4")[0])
            total = (total + word) & _MASK64
            weighted = (weighted + (self._words + 1) * word) & _MASK64
        return (weighted + WSUM64_K * total + self._nbytes) & _MASK64


def _merged(pieces: Pieces) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The pieces with each run of back-to-back ranges (same region) joined into one."""
    region, offset, nbytes = pieces.region, pieces.offset, pieces.nbytes
    if region.size <= 1:
        return region, offset, nbytes
    joins = (region[1:] == region[:-1]) & (offset[:-1] + nbytes[:-1] == offset[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return region[starts], offset[starts], np.add.reduceat(nbytes, starts)
