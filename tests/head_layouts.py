"""A KV layout whose blocks hold KV heads the way vLLM's CPU cache does (heads, then tokens, then
K and V of one head), one rank's share of them, for the tests of tensor-parallel code (a module of
its own name: several test folders each have a conftest)."""

from __future__ import annotations

from kvray.layout import Geometry, KVLayout, LayerSpec, TensorParallel


def head_layout(tp: TensorParallel, *, tokens: int, content: int, layers: int, num_blocks: int) -> KVLayout:
    """`layers` float32 layers of `num_blocks` blocks, each block `tp.local_heads` heads of
    `tokens` tokens of `content` values (K and V of one head, one token)."""
    heads = tp.local_heads
    geometry = Geometry(
        block_size=tokens,
        entry_shape=(heads * content,),
        dtype="float32",
        block_layout=f"H{heads} N{tokens} C{content}",
    )
    return KVLayout(
        layers=tuple(LayerSpec(name=f"layer{i}", geometry=geometry) for i in range(layers)),
        num_blocks=num_blocks,
        tp=tp,
    )
