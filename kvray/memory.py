"""Backings and regions: one buffer per worker holding every layer (second step of the data flow).

A backing over-allocates by one alignment unit and places its region, aligned in start and
length, inside the allocation (invariant 1): the region never reaches a byte the worker does
not own, and it covers every byte of every layer view, K and V halves alike. Layer views are
typed torch tensors over that region, which is what the model reads and writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import mmap
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import msgspec
import numpy as np
import torch

from kvray.config import Settings, check_alignment
from kvray.errors import LayoutError, MetadataError, RegionError
from kvray.layout import (
    BlockOrder,
    KVLayout,
    LayerPlacement,
    align_down,
    align_up,
    per_layer_placement,
)
from kvray.owned import create_owned_file, is_owned_name, open_owned_file, remove_owned
from kvray.validation import check_layers_disjoint
from kvray.wire import EngineInfo, RegionDescriptor, Role, TransportKind

TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


#: The device work that produced the bytes a write is about to read, when the caller knows it
#: better than "whatever the current stream has queued": a CUDA event (`torch.cuda.Event`)
#: recorded on the stream that wrote them (an engine's compute stream, right after a layer's
#: attention). A push hands it to the transport's write (`KVAgent.push_layer(..., ready=)`);
#: transports that copy from GPU memory order their copies after it, and after the calling
#: thread's current stream where it is None. CPU transports have nothing to order.
SourceReady: TypeAlias = Any


#: Transports whose writers name a region by its virtual address in the owner's process (an
#: RDMA WRITE's remote address); every other one reaches a region by offset.
_WRITES_BY_ADDRESS = frozenset({TransportKind.VERBS})


class MemoryKind(enum.Enum):
    CPU = "cpu"
    SHM = "shm"
    CUDA = "cuda"


@dataclass(frozen=True)
class RegionSpan:
    """An aligned span of addresses and the allocation it lies in."""

    start: int
    nbytes: int
    alloc_start: int
    alloc_nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    @property
    def offset_in_allocation(self) -> int:
        return self.start - self.alloc_start


def place_region(alloc_start: int, alloc_nbytes: int, needed_nbytes: int, alignment: int) -> RegionSpan:
    """Place an aligned region of at least `needed_nbytes` inside an allocation, or refuse.

    The region starts at the first aligned address at or after the allocation's start and its
    length is `needed_nbytes` rounded up to the alignment. An allocation of
    `align_up(needed_nbytes) + alignment` bytes always fits one; a smaller one may not, and then this
    raises rather than reaching outside the allocation.
    """
    alignment = check_alignment(alignment)
    if needed_nbytes <= 0:
        raise RegionError(f"a region needs a positive size, got {needed_nbytes}", nbytes=needed_nbytes)
    region_start = align_up(alloc_start, alignment)
    region_nbytes = align_up(needed_nbytes, alignment)
    alloc_end = alloc_start + alloc_nbytes
    if alloc_start < 0 or region_start + region_nbytes > alloc_end:
        raise RegionError(
            f"an aligned region of {region_nbytes} bytes does not fit in the allocation "
            f"[{alloc_start:#x}, {alloc_end:#x}) (alignment {alignment}); allocate at least "
            f"{align_up(needed_nbytes, alignment) + alignment} bytes",
            alloc_start=alloc_start,
            alloc_nbytes=alloc_nbytes,
            needed_nbytes=needed_nbytes,
            alignment=alignment,
        )
    return RegionSpan(region_start, region_nbytes, alloc_start, alloc_nbytes)


def cover_region(
    alloc_start: int, alloc_nbytes: int, data_start: int, data_nbytes: int, alignment: int
) -> RegionSpan:
    """The aligned region covering `data_nbytes` at `data_start`, if it lies inside the allocation.

    This is the path for caller-owned tensors: the data cannot move, so the region is the
    data rounded outwards to the alignment, and if that reaches outside the allocation the
    answer is an error, never a region over someone else's memory.
    """
    alignment = check_alignment(alignment)
    if data_nbytes <= 0:
        raise RegionError(f"a region needs a positive size, got {data_nbytes}", nbytes=data_nbytes)
    region_start = align_down(data_start, alignment)
    region_end = align_up(data_start + data_nbytes, alignment)
    alloc_end = alloc_start + alloc_nbytes
    if data_start < alloc_start or data_start + data_nbytes > alloc_end:
        raise RegionError(
            f"data [{data_start:#x}, {data_start + data_nbytes:#x}) is not inside its allocation "
            f"[{alloc_start:#x}, {alloc_end:#x})",
            data_start=data_start,
            alloc_start=alloc_start,
        )
    if region_start < alloc_start or region_end > alloc_end:
        raise RegionError(
            f"the {alignment}-aligned region [{region_start:#x}, {region_end:#x}) around this tensor "
            f"would reach outside its allocation [{alloc_start:#x}, {alloc_end:#x}); allocate the "
            f"tensor with kvray.Backing or pad its storage by {alignment} bytes on each side",
            region_start=region_start,
            region_end=region_end,
            alloc_start=alloc_start,
            alloc_end=alloc_end,
            alignment=alignment,
        )
    return RegionSpan(region_start, region_end - region_start, alloc_start, alloc_nbytes)


@dataclass(frozen=True)
class MemoryRegion:
    """A registered-to-be span of a worker's memory, as the worker itself sees it."""

    index: int
    kind: MemoryKind
    span: RegionSpan
    #: uint8 tensor of exactly the region's bytes.
    tensor: torch.Tensor
    #: Shared-memory file holding the allocation (the region starts span.offset_in_allocation in).
    shm_path: str | None = None
    #: uint8 tensor of the whole allocation the region lies in (region plus slack).
    allocation: torch.Tensor | None = None

    @property
    def address(self) -> int:
        return self.span.start

    @property
    def nbytes(self) -> int:
        return self.span.nbytes

    @property
    def device(self) -> torch.device:
        return self.tensor.device


class Backing:
    """One worker's KV memory: its regions, each layer's placement and typed view.

    Build one with `allocate` (kvray owns the memory), `in_buffer` (a region inside a uint8
    buffer the caller owns) or `adopt` (the caller's per-layer tensors, one region per storage
    they live in). Every `alignment` is a power of two of at least the page size (`ConfigError`
    otherwise); left out, it is the settings' (`gpu_alignment` for CUDA memory).
    """

    def __init__(
        self,
        layout: KVLayout,
        kind: MemoryKind,
        alignment: int,
        regions: list[MemoryRegion],
        placements: dict[str, LayerPlacement],
        views: dict[str, torch.Tensor],
    ) -> None:
        self.layout = layout
        self.kind = kind
        self.alignment = alignment
        self.regions = regions
        self.placements = placements
        self.views = views
        self._closed = False
        #: The private CUDA memory pool a `allocate`d CUDA backing lives in (see `cuda_pool_buffer`).
        self.cuda_pool: object | None = None

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def allocate(
        cls,
        layout: KVLayout,
        kind: MemoryKind = MemoryKind.CPU,
        *,
        settings: Settings | None = None,
        alignment: int | None = None,
        device: torch.device | str | None = None,
    ) -> Backing:
        """Allocate one shared backing for `layout` (CPU, shared-memory file or CUDA)."""
        settings = settings or Settings()
        if alignment is None:
            alignment = settings.gpu_alignment if kind is MemoryKind.CUDA else settings.alignment
        alignment = check_alignment(alignment)
        # One extra alignment unit guarantees an aligned start inside the allocation.
        alloc_nbytes = align_up(layout.nbytes, alignment) + alignment
        shm_path: str | None = None
        pool: object | None = None
        if kind is MemoryKind.CPU:
            buffer = torch.empty(alloc_nbytes, dtype=torch.uint8)
            _advise_huge_pages(buffer.data_ptr(), alloc_nbytes)
        elif kind is MemoryKind.SHM:
            shm_path, buffer = create_shm_buffer(settings.shm_dir, alloc_nbytes)
        else:
            if not torch.cuda.is_available():
                raise RegionError("a CUDA backing needs a CUDA device, and torch sees none")
            buffer, pool = cuda_pool_buffer(alloc_nbytes, device or "cuda")
        try:
            backing = cls.in_buffer(layout, buffer, alignment=alignment, kind=kind, shm_path=shm_path)
            backing.cuda_pool = pool
            return backing
        except BaseException:
            if shm_path is not None:
                remove_owned(shm_path)
            raise

    @classmethod
    def in_buffer(
        cls,
        layout: KVLayout,
        buffer: torch.Tensor,
        *,
        alignment: int,
        kind: MemoryKind | None = None,
        shm_path: str | None = None,
    ) -> Backing:
        """A shared backing whose region lies inside `buffer`, a 1-D uint8 tensor the caller owns."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise RegionError(
                f"a backing buffer must be a contiguous 1-D uint8 tensor, got "
                f"{tuple(buffer.shape)} {buffer.dtype}"
            )
        alignment = check_alignment(alignment)
        if kind is None:
            kind = MemoryKind.CUDA if buffer.is_cuda else MemoryKind.CPU
        span = place_region(buffer.data_ptr(), buffer.numel(), layout.nbytes, alignment)
        region_tensor = buffer[span.offset_in_allocation : span.offset_in_allocation + span.nbytes]
        region = MemoryRegion(
            index=0, kind=kind, span=span, tensor=region_tensor, shm_path=shm_path, allocation=buffer
        )
        placements = layout.placements()
        views = {
            name: _layer_view(layout, name, region_tensor, placement)
            for name, placement in placements.items()
        }
        return cls(layout, kind, alignment, [region], placements, views)

    @classmethod
    def adopt(
        cls,
        layout: KVLayout,
        tensors: Mapping[str, torch.Tensor],
        *,
        settings: Settings | None = None,
        alignment: int | None = None,
        shm_path: str | None = None,
        strides: Mapping[str, BlockStrides] | None = None,
    ) -> Backing:
        """The caller's own per-layer tensors: one region per storage they live in.

        `shm_path`: the tensors are views of one storage that maps a shared-memory file kvray
        made (`kvray.owned.create_owned_file`) from its first byte; the region is then
        described by that file, so same-node writers can map it, and closing the backing
        removes the file.

        Engines often carve every layer out of one pool (views of one storage, packed back to
        back); rounding each layer's bytes out to the alignment on its own would make
        neighbouring regions overlap. So the layers of one storage share one region: the
        aligned span around all of their bytes (K and V halves alike), which must stay inside
        that storage. Every tensor must have its layer's shape and dtype and be contiguous, and
        no two layers may share a byte.

        `strides`: layers an engine lays out otherwise (its KV heads outside the blocks, or
        every layer's block side by side): the bytes from one part, and from one block, to the
        next, counted from the tensor's first element (part 0 of block 0). Such a tensor may
        have any shape of its layer's dtype; its layer's view is then rebuilt over the same
        bytes as [parts, num_blocks, block_size, *entry], and no (layer, part, block) segment
        may share a byte with another (`kvray.validation.check_layers_disjoint`).
        """
        strides = strides or {}
        if layout.block_order is not BlockOrder.LAYER_MAJOR:
            raise LayoutError("per-layer tensors can only hold a layer-major layout")
        missing = [name for name in layout.layer_names if name not in tensors]
        extra = [name for name in tensors if name not in layout.layer_names]
        if missing or extra:
            raise LayoutError(
                f"adopted tensors must match the layout's layers: missing {missing}, unknown {extra}",
                missing=missing,
                unknown=extra,
            )
        unknown_strided = sorted(set(strides) - set(layout.layer_names))
        if unknown_strided:
            raise LayoutError(f"strides name layers the layout does not have: {unknown_strided[:3]}")
        for name in layout.layer_names:
            tensor = tensors[name]
            expected_shape = layout.tensor_shape(name)
            expected_dtype = TORCH_DTYPES[layout.layer(name).geometry.dtype]
            if name in strides:
                if tensor.dtype != expected_dtype:
                    raise LayoutError(
                        f"layer {name!r} must be {expected_dtype}, got {tensor.dtype}", layer=name
                    )
                continue
            if tuple(tensor.shape) != expected_shape or tensor.dtype != expected_dtype:
                raise LayoutError(
                    f"layer {name!r} must be {expected_shape} {expected_dtype}, got "
                    f"{tuple(tensor.shape)} {tensor.dtype}",
                    layer=name,
                )
            if not tensor.is_contiguous():
                raise LayoutError(f"layer {name!r} must be contiguous", layer=name)
        kinds = {MemoryKind.CUDA if tensors[name].is_cuda else MemoryKind.CPU for name in layout.layer_names}
        if len(kinds) != 1:
            raise LayoutError("adopted tensors must all live on the same kind of device")
        kind = kinds.pop()
        if shm_path is not None:
            if kind is not MemoryKind.CPU or not is_owned_name(os.path.basename(shm_path)):
                raise RegionError(
                    f"{shm_path!r} is not a kvray shared-memory file holding CPU tensors; make it "
                    "with kvray.owned.create_owned_file and map it from its first byte",
                    path=shm_path,
                )
            kind = MemoryKind.SHM
        settings = settings or Settings()
        if alignment is None:
            alignment = settings.gpu_alignment if kind is MemoryKind.CUDA else settings.alignment
        alignment = check_alignment(alignment)
        # Where each layer's bytes sit, from its first one (the region is not known yet).
        own = {name: _strided_placement(layout, name, strides.get(name)) for name in layout.layer_names}
        extent = {name: own[name].end(layout.num_blocks) for name in layout.layer_names}
        if strides:
            check_adopted_disjoint(layout, tensors, strides)
        layer_spans = sorted(
            (tensors[name].data_ptr(), tensors[name].data_ptr() + extent[name], name)
            for name in layout.layer_names
            if name not in strides
        )
        for (_, end, first), (start, _, second) in itertools.pairwise(layer_spans):
            if start < end:
                raise LayoutError(
                    f"layers {first!r} and {second!r} share memory; every layer needs its own bytes",
                    layers=[first, second],
                )

        # Layers grouped by the storage they are views of, in layer order.
        storages: dict[tuple[torch.device, int, int], list[str]] = {}
        for name in layout.layer_names:
            storage = tensors[name].untyped_storage()
            key = (tensors[name].device, storage.data_ptr(), storage.nbytes())
            storages.setdefault(key, []).append(name)
        if shm_path is not None and len(storages) != 1:
            raise RegionError(
                f"tensors adopted from {shm_path!r} must be views of one storage (the file's "
                f"mapping), not {len(storages)}",
                path=shm_path,
            )
        regions: list[MemoryRegion] = []
        placements: dict[str, LayerPlacement] = {}
        for index, names in enumerate(storages.values()):
            storage = tensors[names[0]].untyped_storage()
            device = tensors[names[0]].device
            data_start = min(tensors[name].data_ptr() for name in names)
            data_end = max(tensors[name].data_ptr() + extent[name] for name in names)
            span = cover_region(
                storage.data_ptr(), storage.nbytes(), data_start, data_end - data_start, alignment
            )
            region_tensor = torch.empty(0, dtype=torch.uint8, device=device)
            region_tensor.set_(storage, span.offset_in_allocation, (span.nbytes,), (1,))
            allocation = torch.empty(0, dtype=torch.uint8, device=device)
            allocation.set_(storage, 0, (storage.nbytes(),), (1,))
            regions.append(
                MemoryRegion(
                    index=index,
                    kind=kind,
                    span=span,
                    tensor=region_tensor,
                    allocation=allocation,
                    shm_path=shm_path,
                )
            )
            for name in names:
                placements[name] = msgspec.structs.replace(
                    own[name], region=index, offset=tensors[name].data_ptr() - span.start
                )
        by_address = sorted(regions, key=lambda region: region.address)
        for lower, upper in itertools.pairwise(by_address):
            if upper.address < lower.span.end:
                raise RegionError(
                    f"regions {lower.index} and {upper.index} overlap: two of the adopted tensors' "
                    "storages cover the same memory; give kvray views of one storage instead",
                    regions=[lower.index, upper.index],
                )
        views = {
            name: _layer_view(layout, name, regions[placements[name].region].tensor, placements[name])
            if name in strides
            else tensors[name]
            for name in layout.layer_names
        }
        return cls(layout, kind, alignment, regions, placements, views)

    # ---- description -------------------------------------------------------------------

    def region_descriptors(
        self,
        engine_id: str,
        incarnation: int,
        transport: TransportKind,
        *,
        remote_writable: bool,
    ) -> tuple[RegionDescriptor, ...]:
        """Descriptors of this backing's regions as a transport with no handle of its own
        (shared memory: the file and the region's offset in it) would publish them. Only a
        transport that writes by virtual address (`verbs`) publishes where a region lies in
        this process; the others reach it by offset (into the file, or through the owner),
        and their descriptors say address 0."""
        by_address = transport in _WRITES_BY_ADDRESS
        return tuple(
            RegionDescriptor(
                engine_id=engine_id,
                incarnation=incarnation,
                transport=transport,
                index=region.index,
                address=region.address if by_address else 0,
                length=region.nbytes,
                handle=(region.shm_path or "").encode(),
                handle_offset=region.span.offset_in_allocation,
                remote_writable=remote_writable,
            )
            for region in self.regions
        )

    def engine_info(
        self,
        engine_id: str,
        incarnation: int,
        role: Role,
        node_id: str,
        regions: tuple[RegionDescriptor, ...],
        endpoints: dict[str, str] | None = None,
    ) -> EngineInfo:
        """What an engine owning this backing publishes: layout, regions, per-layer placements."""
        return EngineInfo(
            engine_id=engine_id,
            incarnation=incarnation,
            role=role,
            node_id=node_id,
            layout=self.layout,
            regions=regions,
            placements=dict(self.placements),
            endpoints=dict(endpoints or {}),
        )

    # ---- use ---------------------------------------------------------------------------

    def view(self, name: str) -> torch.Tensor:
        """The typed tensor of one layer ([num_blocks, block_size, *entry] or [2, ...])."""
        self.layout.layer(name)
        return self.views[name]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the backing; a shared-memory file is unlinked (mappings die with their tensors)."""
        if self._closed:
            return
        self._closed = True
        for region in self.regions:
            if region.shm_path is not None:
                remove_owned(region.shm_path)
        self.views = {}

    def __enter__(self) -> Backing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BlockStrides(NamedTuple):
    """How an engine's own tensor lays out a layer's blocks (`Backing.adopt`), in bytes."""

    #: From one part of a block (K to V, or one KV head to the next) to the next.
    part_stride: int
    #: From one block to the next.
    block_stride: int


def check_adopted_disjoint(
    layout: KVLayout, tensors: Mapping[str, torch.Tensor], strides: Mapping[str, BlockStrides]
) -> None:
    """No (layer, part, block) segment of the tensors, laid out as `strides` say (contiguous where
    they say nothing), shares a byte with another (`LayoutError` otherwise): a write into one
    layer would land in the other."""
    at_address = {
        name: msgspec.structs.replace(
            _strided_placement(layout, name, strides.get(name)), offset=tensors[name].data_ptr()
        )
        for name in layout.layer_names
    }
    try:
        check_layers_disjoint("this engine", layout, at_address)
    except MetadataError as error:
        raise LayoutError(f"adopted layers share memory: {error}") from None


def _strided_placement(layout: KVLayout, name: str, strides: BlockStrides | None) -> LayerPlacement:
    """A layer's placement from its tensor's first byte: contiguous (`per_layer_placement`), or
    as `strides` say."""
    placement = per_layer_placement(layout, name, 0)
    if strides is None:
        return placement
    return msgspec.structs.replace(
        placement, part_stride=strides.part_stride, block_stride=strides.block_stride
    )


def _layer_view(
    layout: KVLayout, name: str, region_tensor: torch.Tensor, placement: LayerPlacement
) -> torch.Tensor:
    geometry = layout.layer(name).geometry
    itemsize = geometry.itemsize
    typed = region_tensor.view(TORCH_DTYPES[geometry.dtype])
    token_elems = geometry.entry_nbytes // itemsize
    entry_strides: list[int] = []
    stride = 1
    for dim in reversed(geometry.entry_shape):
        entry_strides.insert(0, stride)
        stride *= dim
    block_dims = (layout.num_blocks, geometry.block_size, *geometry.entry_shape)
    block_strides = (placement.block_stride // itemsize, token_elems, *entry_strides)
    if geometry.parts > 1:
        shape: tuple[int, ...] = (geometry.parts, *block_dims)
        strides: tuple[int, ...] = (placement.part_stride // itemsize, *block_strides)
    else:
        shape, strides = block_dims, block_strides
    return typed.as_strided(shape, strides, typed.storage_offset() + placement.offset // itemsize)


def cuda_pool_buffer(nbytes: int, device: torch.device | str) -> tuple[torch.Tensor, object | None]:
    """`nbytes` of device memory in a CUDA allocation of their own: torch's caching allocator
    would otherwise carve other tensors of this process out of the same allocation, and a
    peer that opens the backing's IPC handle can reach the whole allocation, not only the
    exported bytes. A private memory pool that only ever serves this tensor keeps anything
    else out of it. Returns the tensor and the pool, which must live as long as the backing."""
    pool_class = getattr(torch.cuda, "MemPool", None)
    use_pool = getattr(torch.cuda, "use_mem_pool", None)
    if pool_class is None or use_pool is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None
    target = torch.device(device)
    if target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    pool = pool_class()
    with use_pool(pool, device=target):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=target)
    return buffer, pool


def create_shm_buffer(shm_dir: str, nbytes: int) -> tuple[str, torch.Tensor]:
    """A fresh kvray shared-memory file in `shm_dir` of `nbytes` zero bytes, and a uint8 tensor
    mapping all of it (shared): its path and the tensor.

    The file is sized and mapped through the descriptor that created it, never reopened by
    name (another process of this user could rename a file of its own over the name in
    between). It is kept until `kvray.owned.remove_owned(path)` or this process's exit; the
    mapping lives as long as any view of the tensor, and once this process is gone, even
    killed, the next kvray file made in `shm_dir` sweeps the file away."""
    path = create_owned_file(shm_dir)
    try:
        fd = open_owned_file(path)
        try:
            os.ftruncate(fd, nbytes)
            mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # The numpy array holds the mapping open (an exported buffer) for as long as the tensor,
        # or any view of it, lives: it cannot be unmapped under a view.
        buffer = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8))
    except Exception as error:
        remove_owned(path)
        if isinstance(error, OSError):
            raise RegionError(
                f"cannot size and map the shared-memory file {path} to {nbytes} bytes: {error}",
                path=path,
            ) from error
        raise
    return path, buffer


#: Linux's MADV_HUGEPAGE.
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 * 1024 * 1024


def huge_page_span(address: int, nbytes: int) -> tuple[int, int] | None:
    """The 2 MiB-aligned (start, length) inside [address, address + nbytes), or None when the
    allocation holds no whole huge page."""
    start = align_up(address, _HUGE_PAGE)
    length = (address + nbytes - start) // _HUGE_PAGE * _HUGE_PAGE
    return (start, length) if length > 0 else None


def _advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask Linux to back a large, not yet touched CPU allocation with transparent huge pages
    (best effort; nothing happens elsewhere or when refused). Scattered KV blocks touch a new
    4 KiB page every few kilobytes; huge pages spare the copy most of those TLB misses, as numpy
    already does for its own large arrays."""
    span = huge_page_span(address, nbytes)
    if not sys.platform.startswith("linux") or span is None:
        return
    start, length = span
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), ctypes.c_int(_MADV_HUGEPAGE))
