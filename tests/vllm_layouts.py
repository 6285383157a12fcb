"""vLLM's KV cache tensors without vLLM: one int8 allocation viewed per layer the way vLLM's model
runners do it, on any device, for the connector's tests (CPU in CI, CUDA in tests/gpu).

    vLLM 0.32+  every layer a [B, H, N, C] view of the one allocation, in one of vLLM's
                `KVCacheLayout`s (a stride permutation of [L, B, H, N, C]; C = K and V
                content, in the cache's dtype): `layout_views`. `tests/unit/test_vllm_layouts.py`
                checks these against vLLM's own `create_kv_cache_views` where vLLM is installed.
    earlier     per-layer tensors carved from the allocation layer after layer: FlashAttention
                [2, B, N, H, D], FlashInfer [B, 2, N, H, D] (either in NHD or HND order) and
                MLA [B, N, 576]: `legacy_views`.

`block_of(tensor, block)` is what block `block` of a layer holds, in a canonical order, to
compare across layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: vLLM's `KVCacheLayout`: the logical axes [L, B, H, N, C] in memory order, outer to inner.
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

#: Earlier backends' per-layer shapes (logical axes) and, per order name, their memory order.
LEGACY_SHAPES: dict[str, tuple[str, ...]] = {
    "flash_attn": ("KV", "B", "N", "H", "D"),
    "flashinfer": ("B", "KV", "N", "H", "D"),
    "mla": ("B", "N", "D"),
}


@dataclass(frozen=True)
class CacheShape:
    """A model's KV cache as vLLM sizes it."""

    layers: int
    num_blocks: int
    block_size: int
    heads: int
    #: Elements per (head, token): K and V together (2 x head_dim), or MLA's 576.
    content: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.layers * self.num_blocks * self.heads * self.block_size * self.content * itemsize

    def names(self) -> list[str]:
        return [f"model.layers.{index}.self_attn.attn" for index in range(self.layers)]


def layout_views(buffer: torch.Tensor, shape: CacheShape, layout: str) -> dict[str, torch.Tensor]:
    """Every layer's [B, H, N, C] view of `buffer` (1-D int8, at least `shape.nbytes`), strided as
    vLLM's `compute_layout_strides` makes them for `layout` (no padding)."""
    itemsize = torch.empty(0, dtype=shape.dtype).element_size()
    logical = (shape.layers, shape.num_blocks, shape.heads, shape.block_size, shape.content * itemsize)
    strides = [0] * 5
    step = 1
    for axis in reversed(KV_CACHE_LAYOUTS[layout]):
        strides[axis] = step
        step *= logical[axis]
    whole = torch.as_strided(buffer, logical, strides, buffer.storage_offset())
    return {name: whole[index].view(shape.dtype) for index, name in enumerate(shape.names())}


def legacy_views(
    buffer: torch.Tensor, shape: CacheShape, backend: str, order: str = "NHD"
) -> dict[str, torch.Tensor]:
    """Per-layer tensors of an earlier vLLM backend, carved from `buffer` layer after layer:
    `backend` one of `LEGACY_SHAPES`; `order` "HND" keeps heads outside tokens in memory."""
    axes = LEGACY_SHAPES[backend]
    head_dim = shape.content if backend == "mla" else shape.content // 2
    sizes = {"KV": 2, "B": shape.num_blocks, "N": shape.block_size, "H": shape.heads, "D": head_dim}
    logical = tuple(sizes[axis] for axis in axes)
    memory = list(axes)
    if order == "HND" and "H" in memory:
        n, h = memory.index("N"), memory.index("H")
        memory[n], memory[h] = memory[h], memory[n]
    typed = buffer.view(shape.dtype)
    per_layer = math.prod(logical)
    views = {}
    for index, name in enumerate(shape.names()):
        physical = typed[index * per_layer : (index + 1) * per_layer].view(*(sizes[axis] for axis in memory))
        views[name] = physical.permute(*(memory.index(axis) for axis in axes))
    return views


def block_of(tensor: torch.Tensor, block: int, *, kv_axis_first: bool = False) -> torch.Tensor:
    """Block `block` of one layer's tensor (the block axis first, or second after K/V), as a
    contiguous tensor in the tensor's logical order."""
    return (tensor[:, block] if kv_axis_first else tensor[block]).contiguous()
