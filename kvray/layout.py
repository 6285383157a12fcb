"""Layout: a model's KV cache described in bytes (first step of the data flow).

Pure arithmetic, no devices: `Geometry` says what one layer stores per token, `KVLayout`
orders the layers and blocks in one backing, and `LayerPlacement` is where a layer's bytes
sit relative to the start of the region that holds them.
"""

from __future__ import annotations

import collections
import enum
import functools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, NamedTuple, overload

import msgspec
import numpy as np
import numpy.typing as npt

from kvray.errors import LayoutError, UnknownLayerError

#: Byte offsets, byte counts or block ids, one per op or block: the array type of every table
#: kvray computes (plans, op tables, copies).
Int64Array = npt.NDArray[np.int64]

#: Bytes per element of every dtype a geometry may use.
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: Largest byte offset or size kvray accepts anywhere (far beyond any memory, far below int64's
#: limit, so sums of two never overflow).
MAX_BYTES = 2**62

#: A non-negative byte count or offset as it travels on the wire.
ByteCount = Annotated[int, msgspec.Meta(ge=0, lt=MAX_BYTES)]

#: Most blocks one layout may hold (past any real pool: 2**24 blocks of 16 tokens is 268M
#: tokens), so that nothing sized by a peer's claim grows without bound.
MAX_BLOCKS = 2**24
#: Most layers one layout may hold.
MAX_LAYERS = 1024
#: Most runs one block of one layer may be stored as (K and V; or one per KV head, where an
#: engine keeps the heads outside the blocks).
MAX_PARTS = 256

#: Most tensor-parallel ranks one model's KV heads may be split across.
MAX_TP_SIZE = 64

#: The label of the KV-head axis in `Geometry.block_layout` (as in "N16 H8 C256").
HEAD_AXIS = "H"

#: Every layer slab (layer-major) and every layer segment inside a block (block-major) starts
#: at a multiple of this many bytes, so typed views are aligned for any dtype above.
SEGMENT_ALIGNMENT = 64


@overload
def ceil_div(numerator: int, denominator: int) -> int: ...
@overload
def ceil_div(numerator: Int64Array, denominator: int) -> Int64Array: ...
def ceil_div(numerator: int | Int64Array, denominator: int) -> int | Int64Array:
    """`numerator / denominator` rounded up (a positive `denominator`), in integers only: exact
    for any byte count, where `math.ceil` of a float is not. Element-wise on an array."""
    return -(-numerator // denominator)


def align_up(value: int, alignment: int) -> int:
    return ceil_div(value, alignment) * alignment


def align_down(value: int, alignment: int) -> int:
    return (value // alignment) * alignment


class BlockOrder(enum.Enum):
    """How blocks and layers interleave in one backing."""

    #: Each layer is one contiguous slab of all its blocks (the usual paged layout).
    LAYER_MAJOR = "layer_major"
    #: Each block holds every layer, so one block of the whole model is one contiguous run.
    BLOCK_MAJOR = "block_major"


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """What one layer caches: `parts` × tokens × entry. A block of the layer is `parts` runs
    of `block_size` entries: 1 for a latent or indexer cache (or K and V within one run), 2 for
    split K and V, one per KV head where an engine keeps the heads outside the blocks.

    `block_layout` says how the bytes inside a block are ordered (the engine's axes, outer to
    inner, each a label and a size, e.g. "H8 N16 C256"; "" when the engine does not say): kvray
    moves whole blocks, so two engines only exchange a layer when they order it alike, which
    this field makes part of the geometry both sides must agree on. The axis labelled "H" is
    the KV heads: between tensor-parallel ranks that hold different heads
    (`KVLayout.tp`), kvray moves the bytes of the heads both hold (`kvray.tensor_parallel`)."""

    block_size: int
    entry_shape: tuple[int, ...]
    dtype: str
    parts: int = 1
    block_layout: Annotated[str, msgspec.Meta(max_length=256)] = ""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise LayoutError(
                f"block_size must be a positive number of tokens, got {self.block_size}",
                block_size=self.block_size,
            )
        if not self.entry_shape or any(dim <= 0 for dim in self.entry_shape):
            raise LayoutError(
                f"entry_shape must be non-empty with positive dimensions, got {self.entry_shape}",
                entry_shape=self.entry_shape,
            )
        if self.dtype not in DTYPE_ITEMSIZE:
            raise LayoutError(
                f"unknown dtype {self.dtype!r}; kvray knows {sorted(DTYPE_ITEMSIZE)}",
                dtype=self.dtype,
            )
        if not 1 <= self.parts <= MAX_PARTS:
            raise LayoutError(
                f"parts must be 1 (latent or indexer cache), 2 (split K/V) or up to {MAX_PARTS} "
                f"(one run per KV head), got {self.parts}",
                parts=self.parts,
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def entry_nbytes(self) -> int:
        """Bytes of one token's entry in one part."""
        return math.prod(self.entry_shape) * self.itemsize

    @property
    def part_nbytes(self) -> int:
        """Bytes of one part (K, V or the latent) of one block."""
        return self.block_size * self.entry_nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of this layer, all parts."""
        return self.parts * self.part_nbytes


class BlockAxis(NamedTuple):
    """One axis of a block's bytes, as `Geometry.block_layout` names it: "N16" is tokens, 16."""

    label: str
    size: int


_AXIS_TOKEN = re.compile(r"([A-Za-z_]+)([0-9]+)")
_HEAD_TOKEN = re.compile(f"{HEAD_AXIS}[0-9]+")


def block_axes(block_layout: str) -> tuple[BlockAxis, ...]:
    """The axes of a `Geometry.block_layout`, outer to inner: letters then a size per token,
    tokens separated by spaces ("KV2 N16 H8 D128"). LayoutError for a token of another shape."""
    axes: list[BlockAxis] = []
    for token in block_layout.split():
        match = _AXIS_TOKEN.fullmatch(token)
        if match is None or int(match[2]) <= 0:
            raise LayoutError(
                f"block layout {block_layout!r}: axis {token!r} is not a label of letters followed "
                "by a positive size",
                block_layout=block_layout,
            )
        axes.append(BlockAxis(match[1], int(match[2])))
    return tuple(axes)


def head_axis_size(block_layout: str) -> int | None:
    """The size of a block layout's KV-head axis (its token "H<size>"), or None when it has
    none. Only that token is read: a layout's other axes need not parse."""
    head_tokens = [token for token in block_layout.split() if _HEAD_TOKEN.fullmatch(token)]
    sizes = [int(token[len(HEAD_AXIS) :]) for token in head_tokens]
    if len(sizes) > 1:
        raise LayoutError(
            f"block layout {block_layout!r} names the KV-head axis {HEAD_AXIS!r} {len(sizes)} times",
            block_layout=block_layout,
        )
    return sizes[0] if sizes else None


class TensorParallel(msgspec.Struct, frozen=True, kw_only=True):
    """Which KV heads an engine holds: it is rank `rank` of `size` tensor-parallel ranks of a
    model with `kv_heads` KV heads in all, each rank holding an equal, consecutive share.
    `kv_heads` 0: every rank holds the whole cache (an MLA latent, which TP replicates)."""

    size: int = 1
    rank: int = 0
    kv_heads: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.size <= MAX_TP_SIZE:
            raise LayoutError(f"TP size must be in [1, {MAX_TP_SIZE}], got {self.size}", tp_size=self.size)
        if not 0 <= self.rank < self.size:
            raise LayoutError(
                f"TP rank {self.rank} is outside [0, {self.size}) for TP size {self.size}",
                tp_size=self.size,
                tp_rank=self.rank,
            )
        if self.kv_heads < 0:
            raise LayoutError(f"kv_heads must be 0 (replicated) or positive, got {self.kv_heads}")
        if self.kv_heads % self.size:
            raise LayoutError(
                f"TP size {self.size} does not divide the model's {self.kv_heads} KV heads",
                tp_size=self.size,
                kv_heads=self.kv_heads,
            )

    @property
    def sharded(self) -> bool:
        """True when the ranks split the KV heads (False: each holds the whole cache)."""
        return self.kv_heads > 0

    @property
    def local_heads(self) -> int:
        """KV heads this rank holds (0 when replicated: it holds the whole cache)."""
        return self.kv_heads // self.size

    @property
    def first_head(self) -> int:
        """The model-wide index of this rank's first KV head."""
        return self.rank * self.local_heads


class LayerSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    geometry: Geometry

    def __post_init__(self) -> None:
        if not self.name:
            raise LayoutError("a layer needs a non-empty name")


class LayerPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a layer's bytes sit: byte of (part, block) = offset + part·part_stride + block·block_stride.

    Offsets are relative to the start of region number `region` of the engine that owns them.
    """

    region: ByteCount
    offset: ByteCount
    part_stride: ByteCount
    block_stride: ByteCount
    part_nbytes: ByteCount
    parts: int

    def __post_init__(self) -> None:
        fields = {
            "region": self.region,
            "offset": self.offset,
            "part_stride": self.part_stride,
            "block_stride": self.block_stride,
        }
        out_of_range = {name: value for name, value in fields.items() if not 0 <= value < MAX_BYTES}
        if out_of_range:
            raise LayoutError(f"a layer placement needs values in [0, 2**62): {out_of_range}", **out_of_range)
        if not 0 < self.part_nbytes < MAX_BYTES or not 1 <= self.parts <= MAX_PARTS:
            raise LayoutError(
                f"a layer placement needs part_nbytes > 0 and 1 to {MAX_PARTS} parts, "
                f"got part_nbytes={self.part_nbytes}, parts={self.parts}",
                part_nbytes=self.part_nbytes,
                parts=self.parts,
            )

    def byte_offset(self, part: int, block: int) -> int:
        return self.offset + part * self.part_stride + block * self.block_stride

    def end(self, num_blocks: int) -> int:
        """One past the last byte any of the layer's `num_blocks` blocks can touch."""
        return self.byte_offset(self.parts - 1, num_blocks - 1) + self.part_nbytes


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """An ordered list of layers sharing `num_blocks` block ids, in one block order; `tp` says
    which of the model's KV heads they hold."""

    layers: Annotated[tuple[LayerSpec, ...], msgspec.Meta(max_length=MAX_LAYERS)]
    num_blocks: int
    block_order: BlockOrder = BlockOrder.LAYER_MAJOR
    tp: TensorParallel = TensorParallel()

    def __post_init__(self) -> None:
        if not self.layers:
            raise LayoutError("a layout needs at least one layer")
        if len(self.layers) > MAX_LAYERS:
            raise LayoutError(
                f"a layout holds at most {MAX_LAYERS} layers, got {len(self.layers)}",
                num_layers=len(self.layers),
            )
        if not 0 < self.num_blocks <= MAX_BLOCKS:
            raise LayoutError(
                f"num_blocks must be in [1, {MAX_BLOCKS}], got {self.num_blocks}", num_blocks=self.num_blocks
            )
        names = [layer.name for layer in self.layers]
        duplicates = sorted(name for name, count in collections.Counter(names).items() if count > 1)
        if duplicates:
            raise LayoutError(f"layer names must be unique, repeated: {duplicates}", layers=duplicates)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    def names_at(self, indices: Iterable[int]) -> list[str]:
        """The names of the layers at `indices` (`layer_names` builds its tuple on each access:
        once here, not once per index)."""
        names = self.layer_names
        return [names[index] for index in indices]

    def layer(self, name: str) -> LayerSpec:
        for spec in self.layers:
            if spec.name == name:
                return spec
        raise UnknownLayerError(
            f"layer {name!r} is not in this layout (it has {len(self.layers)} layers, "
            f"first {self.layer_names[:3]})",
            layer=name,
        )

    @property
    def block_stride(self) -> int:
        """Block-major: bytes from one block of the whole model to the next."""
        return _shared_placements(self)[1]

    @property
    def nbytes(self) -> int:
        """Bytes the whole layout spans in one shared backing."""
        return _shared_placements(self)[2]

    def placements(self) -> dict[str, LayerPlacement]:
        """Every layer's placement inside one shared region that starts at the layout's byte 0."""
        return dict(_shared_placements(self)[0])

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of a layer's view: [num_blocks, block_size, *entry], or [parts, num_blocks, ...]
        for a layer of several parts."""
        geometry = self.layer(name).geometry
        block_shape = (self.num_blocks, geometry.block_size, *geometry.entry_shape)
        return (geometry.parts, *block_shape) if geometry.parts > 1 else block_shape

    def layer_nbytes(self, name: str) -> int:
        """Bytes of one layer's own contiguous tensor (the non-shared, per-layer path)."""
        return self.num_blocks * self.layer(name).geometry.block_nbytes


@functools.lru_cache(maxsize=256)
def _shared_placements(layout: KVLayout) -> tuple[tuple[tuple[str, LayerPlacement], ...], int, int]:
    """(placements, block_stride, total bytes) of a layout in one shared region."""
    placements: list[tuple[str, LayerPlacement]] = []
    cursor = 0
    if layout.block_order is BlockOrder.LAYER_MAJOR:
        for spec in layout.layers:
            geometry = spec.geometry
            slab_start = align_up(cursor, SEGMENT_ALIGNMENT)
            placements.append(
                (
                    spec.name,
                    LayerPlacement(
                        region=0,
                        offset=slab_start,
                        part_stride=layout.num_blocks * geometry.part_nbytes,
                        block_stride=geometry.part_nbytes,
                        part_nbytes=geometry.part_nbytes,
                        parts=geometry.parts,
                    ),
                )
            )
            cursor = slab_start + layout.num_blocks * geometry.block_nbytes
        return tuple(placements), 0, cursor

    segment_starts: list[int] = []
    for spec in layout.layers:
        segment_start = align_up(cursor, SEGMENT_ALIGNMENT)
        segment_starts.append(segment_start)
        cursor = segment_start + spec.geometry.block_nbytes
    block_stride = align_up(cursor, SEGMENT_ALIGNMENT)
    for spec, segment_start in zip(layout.layers, segment_starts, strict=True):
        geometry = spec.geometry
        placements.append(
            (
                spec.name,
                LayerPlacement(
                    region=0,
                    offset=segment_start,
                    part_stride=geometry.part_nbytes,
                    block_stride=block_stride,
                    part_nbytes=geometry.part_nbytes,
                    parts=geometry.parts,
                ),
            )
        )
    return tuple(placements), block_stride, block_stride * layout.num_blocks


def per_layer_placement(layout: KVLayout, name: str, region: int) -> LayerPlacement:
    """Placement of a layer that owns its region (its own contiguous layer-major tensor)."""
    geometry = layout.layer(name).geometry
    return LayerPlacement(
        region=region,
        offset=0,
        part_stride=layout.num_blocks * geometry.part_nbytes,
        block_stride=geometry.part_nbytes,
        part_nbytes=geometry.part_nbytes,
        parts=geometry.parts,
    )


# ---- ready-made layouts -------------------------------------------------------------------


def deepseek_v3(num_blocks: int = 64, block_order: BlockOrder = BlockOrder.LAYER_MAJOR) -> KVLayout:
    """DeepSeek-V3(.2)-style: 61 MLA layers (576 bf16 latent per token) + an indexer cache."""
    mla = Geometry(block_size=64, entry_shape=(576,), dtype="bfloat16")
    indexer = Geometry(block_size=64, entry_shape=(132,), dtype="uint8")
    layers = [LayerSpec(name=f"model.layers.{i}.self_attn.mla", geometry=mla) for i in range(61)]
    layers.append(LayerSpec(name="model.indexer.k_cache", geometry=indexer))
    return KVLayout(layers=tuple(layers), num_blocks=num_blocks, block_order=block_order)


def llama_gqa(
    num_blocks: int = 64,
    block_order: BlockOrder = BlockOrder.LAYER_MAJOR,
    num_layers: int = 32,
) -> KVLayout:
    """Llama-style GQA: split K/V of 8 KV heads × 128, fp16, 16 tokens per block."""
    kv = Geometry(block_size=16, entry_shape=(8, 128), dtype="float16", parts=2)
    layers = tuple(LayerSpec(name=f"model.layers.{i}.self_attn.kv", geometry=kv) for i in range(num_layers))
    return KVLayout(layers=layers, num_blocks=num_blocks, block_order=block_order)


def mixed(num_blocks: int = 64, block_order: BlockOrder = BlockOrder.LAYER_MAJOR) -> KVLayout:
    """A hybrid model: MLA layers, split K/V layers and an indexer, interleaved, 16 tokens a block."""
    mla = Geometry(block_size=16, entry_shape=(576,), dtype="bfloat16")
    kv = Geometry(block_size=16, entry_shape=(4, 64), dtype="float16", parts=2)
    indexer = Geometry(block_size=16, entry_shape=(132,), dtype="uint8")
    layers: list[LayerSpec] = []
    for i in range(8):
        geometry = mla if i % 2 == 0 else kv
        kind = "mla" if i % 2 == 0 else "kv"
        layers.append(LayerSpec(name=f"model.layers.{i}.{kind}", geometry=geometry))
    layers.insert(4, LayerSpec(name="model.indexer.k_cache", geometry=indexer))
    return KVLayout(layers=tuple(layers), num_blocks=num_blocks, block_order=block_order)


READY_LAYOUTS = {"deepseek-v3": deepseek_v3, "llama": llama_gqa, "mixed": mixed}
