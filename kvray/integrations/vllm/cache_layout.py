"""vLLM's KV cache as kvray reads it, at start-up: tokens per block, blocks and KV cache groups
(`cache_config_of`), KV heads and this worker's rank (`kv_heads_of`, `tp_rank`) from vLLM's
configuration, and the layout of vLLM's real
per-layer cache tensors (their shapes, strides and KV cache groups) as kvray layers
(`layout_of`, `block_runs`). Whatever kvray cannot move is refused here, naming the layer or
the setting."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvray.errors import ConfigError, LayoutError
from kvray.layout import HEAD_AXIS, MAX_PARTS, Geometry, KVLayout, LayerSpec, TensorParallel
from kvray.memory import TORCH_DTYPES, BlockStrides, check_adopted_disjoint

_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class CacheConfig:
    """What vLLM's configuration says of its KV cache, read once at start-up (`cache_config_of`)."""

    #: Tokens per block (`block_size_of`).
    block_size: int
    #: Blocks per layer (0: not said; the registered tensors then say it).
    num_blocks: int = 0
    #: Each KV cache group's layer names (none known: one group of every layer).
    group_layers: tuple[tuple[str, ...], ...] = ()


def cache_config_of(vllm_config: Any, kv_cache_config: Any) -> CacheConfig:
    """The KV cache vLLM configured for this engine (`kv_cache_config` may be None); a model
    whose cache keeps more than attention KV is refused (`check_attention_only`)."""
    check_attention_only(kv_cache_config)
    return CacheConfig(
        block_size=block_size_of(kv_cache_config, int(vllm_config.cache_config.block_size)),
        num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0),
        group_layers=tuple(
            tuple(group.layer_names) for group in getattr(kv_cache_config, "kv_cache_groups", None) or ()
        ),
    )


def check_attention_only(kv_cache_config: Any) -> None:
    """Refuse KV cache groups that keep something other than attention KV: a recurrent state
    (vLLM's `MambaSpec`: Mamba, Mamba2, Gated DeltaNet, short convolutions) is one slot per
    request, rewritten as tokens come, not blocks of tokens; kvray does not move it yet, and a
    decode engine would generate from a state that never arrived. Attention of every kind
    (full, sliding window, MLA, ...) derives from vLLM's `AttentionSpec`."""
    refused = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = getattr(group, "kv_cache_spec", None)
        if spec is None:
            continue
        specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one per layer
        inner = list(specs.values()) if specs else [spec]
        kinds = sorted({type(each).__name__ for each in inner if not _attention(each)})
        if kinds:
            layers = list(group.layer_names)
            refused.append(f"group {index} ({', '.join(kinds)}: {layers[0]}, ... {len(layers)} layers)")
    if refused:
        raise ConfigError(
            f"this model's KV cache keeps recurrent state kvray does not move yet, in KV cache "
            f"{'; '.join(refused)}: a decode engine would generate from a state that never arrived. "
            "Serve it without kvray's connector (a single engine)",
            groups=refused,
        )


def _attention(spec: Any) -> bool:
    return any(cls.__name__ == "AttentionSpec" for cls in type(spec).__mro__)


def block_size_of(kv_cache_config: Any, configured: int) -> int:
    """Tokens per block, as the engine's KV cache groups have it (the platform may choose
    another size than the one configured, e.g. 16 or 128 for MLA on a CPU). kvray pairs the two
    sides' blocks position by position in every group: groups of different block sizes are
    refused here, at start-up."""
    sizes = {
        int(group.kv_cache_spec.block_size)
        for group in getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if getattr(getattr(group, "kv_cache_spec", None), "block_size", None)
    }
    if len(sizes) > 1:
        raise ConfigError(
            f"the model's KV cache groups have blocks of {sorted(sizes)} tokens; kvray moves KV cache "
            "groups of one block size",
            block_sizes=sorted(sizes),
        )
    return sizes.pop() if sizes else configured


def kv_heads_of(vllm_config: Any) -> int:
    """The model's KV heads as kvray's `TensorParallel.kv_heads` has them (0: every rank caches
    the whole KV, an MLA latent), after refusing, at start-up, the parallel configurations
    kvray does not move: pipeline or context parallelism, and tensor-parallel sizes that do not
    divide the KV heads (vLLM would replicate heads across ranks)."""
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    tp_size = int(parallel.tensor_parallel_size)
    unsupported = {
        "pipeline_parallel_size": int(getattr(parallel, "pipeline_parallel_size", 1)),
        "prefill_context_parallel_size": int(getattr(parallel, "prefill_context_parallel_size", 1)),
        "decode_context_parallel_size": int(getattr(parallel, "decode_context_parallel_size", 1)),
    }
    beyond = {name: size for name, size in unsupported.items() if size != 1}
    if beyond:
        raise ConfigError(
            f"KvrayConnector moves KV between engines with tensor parallelism only; this engine has "
            f"{', '.join(f'{name}={size}' for name, size in beyond.items())}: run it with 1",
            **beyond,
        )
    if model is None or getattr(model, "use_mla", False):
        return 0
    kv_heads = int(model.get_total_num_kv_heads())
    if kv_heads % tp_size:
        raise ConfigError(
            f"tensor_parallel_size {tp_size} does not divide the model's {kv_heads} KV heads (vLLM "
            "would replicate heads across ranks); kvray moves KV split evenly by heads: use a "
            f"size that divides {kv_heads}",
            tensor_parallel_size=tp_size,
            kv_heads=kv_heads,
        )
    return kv_heads


def tp_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


@dataclass(frozen=True)
class CacheLayout:
    """vLLM's KV cache as kvray moves it: one kvray layer per distinct per-layer tensor (vLLM's
    KV cache groups share memory: with sliding-window and full-attention groups, one tensor
    is the cache of one layer of each group, and a block id belongs to one group at a time),
    named after the first vLLM layer that uses it."""

    layout: KVLayout
    #: vLLM's tensors, by kvray layer.
    tensors: dict[str, torch.Tensor]
    #: How each tensor lays out its blocks (`Backing.adopt`).
    strides: dict[str, BlockStrides]
    #: The kvray layer of each vLLM layer.
    layer_of: dict[str, str]
    #: The vLLM layers of each kvray layer: it is pushed once the forward has saved them all.
    users: dict[str, frozenset[str]]


def layout_of(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    group_layers: Sequence[Sequence[str]] = (),
    tp: TensorParallel | None = None,
) -> CacheLayout:
    """kvray's layout of vLLM's real per-layer cache tensors (`CacheLayout`), on the CPU or a
    GPU. A block of a layer must be one contiguous run or a few runs one stride apart
    (`block_runs`); what lies inside a run is vLLM's business, since whole blocks move, but its
    order is part of the geometry. Tensors that are one another's memory (the same storage,
    offset, shape, strides and dtype) are one kvray layer; tensors that overlap otherwise are
    refused. `tp`: this worker's tensor-parallel rank of its engine. `group_layers`: each KV
    cache group's layers; every group must cover every kvray
    layer (its blocks are then moved in all of them), else the model is refused here, at
    start-up, naming the groups."""
    layers: list[LayerSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    strides: dict[str, BlockStrides] = {}
    layer_of: dict[str, str] = {}
    users: dict[str, set[str]] = {}
    by_memory: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in kv_caches.items():
        memory = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        shared = by_memory.get(memory)
        if shared is not None:
            layer_of[name] = shared
            users[shared].add(name)
            continue
        geometry, strides[name] = block_runs(name, tensor, num_blocks, block_size)
        layers.append(LayerSpec(name=name, geometry=geometry))
        tensors[name] = tensor
        by_memory[memory] = layer_of[name] = name
        users[name] = {name}
    layout = KVLayout(layers=tuple(layers), num_blocks=num_blocks, tp=tp or TensorParallel())
    _check_disjoint(layout, tensors, strides)
    _check_groups(group_layers, layer_of, list(tensors))
    return CacheLayout(
        layout,
        tensors,
        strides,
        layer_of,
        {name: frozenset(names) for name, names in users.items()},
    )


def _axis_names(rank: int, block_axis: int) -> tuple[str, ...]:
    """Names of a cache tensor's axes (for `Geometry.block_layout`): vLLM's [B, H, N, C] views
    (every KV cache layout of vLLM 0.32 and later: blocks, KV heads, tokens, K and V content),
    its earlier backends' [2, B, N, H, D] (K and V apart, FlashAttention), [B, 2, N, H, D]
    (FlashInfer) and [B, N, C] (an MLA latent); other shapes by position."""
    if rank == 4 and block_axis == 0:
        return ("B", "H", "N", "C")
    if rank == 5:
        return ("KV", "B", "N", "H", "D") if block_axis == 1 else ("B", "KV", "N", "H", "D")
    if rank == 3 and block_axis == 0:
        return ("B", "N", "C")
    return tuple(f"d{axis}" for axis in range(rank))


def block_runs(
    name: str, tensor: torch.Tensor, num_blocks: int, block_size: int
) -> tuple[Geometry, BlockStrides]:
    """A vLLM layer tensor's kvray geometry and block strides.

    The block axis is the first (`[num_blocks, ...]`, or `num_blocks` × kernel blocks that
    split each block evenly), or the second after a K/V axis of 2 (`[2, num_blocks, ...]`).
    Within a block, the innermost axes that are dense in memory make one run; the axes outside
    them must step by one stride, and they number the block's parts (K and V, or the KV heads
    of a layout that keeps the heads outside the blocks). Whatever does not fit (an element
    stride inside a run, parts at two strides) is refused here, at start-up."""
    if tensor.dtype not in _DTYPE_NAMES:
        raise ConfigError(f"layer {name!r} caches {tensor.dtype}, which kvray does not know", layer=name)
    shape, steps = list(tensor.shape), list(tensor.stride())
    split_kv = len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks
    names = list(_axis_names(len(shape), 1 if split_kv else 0))
    if shape and shape[0] == num_blocks:
        block_axis = 0
    elif split_kv:
        block_axis = 1
    elif len(shape) >= 2 and shape[0] > num_blocks and shape[0] % num_blocks == 0:
        # Kernel blocks: vLLM splits each block into `ratio` smaller ones for the kernels.
        ratio = shape[0] // num_blocks
        shape = [num_blocks, ratio, *shape[1:]]
        steps = [steps[0] * ratio, steps[0], *steps[1:]]
        names = [names[0], "K", *names[1:]]
        block_axis = 0
    else:
        raise ConfigError(
            f"vLLM's KV cache of layer {name!r} has shape {tuple(tensor.shape)}: kvray needs the "
            f"block axis ({num_blocks} blocks) first, or second after a K/V axis of 2",
            layer=name,
        )
    # The axes inside a block, outer to inner in memory (axes of one element say nothing).
    inner = sorted(
        (
            (steps[axis], shape[axis], names[axis])
            for axis in range(len(shape))
            if axis != block_axis and shape[axis] > 1
        ),
        key=lambda axis: -axis[0],
    )
    outer = list(inner)
    run_elements = 1
    while outer and outer[-1][0] == run_elements:
        run_elements *= outer.pop()[1]
    if run_elements == 1 and outer:
        raise ConfigError(
            f"vLLM's KV cache of layer {name!r} (shape {tuple(tensor.shape)}, strides "
            f"{tuple(tensor.stride())}) has no contiguous innermost axis; kvray moves blocks as runs "
            "of contiguous bytes",
            layer=name,
        )
    parts, part_step = 1, 0
    if outer:
        part_step = expected = outer[-1][0]
        for step, size, _ in reversed(outer):
            if step != expected:
                raise ConfigError(
                    f"vLLM's KV cache of layer {name!r} (shape {tuple(tensor.shape)}, strides "
                    f"{tuple(tensor.stride())}) keeps a block's parts at more than one stride; kvray "
                    "moves a block as runs one stride apart",
                    layer=name,
                )
            parts *= size
            expected = step * size
    if run_elements % block_size:
        raise ConfigError(
            f"layer {name!r}: a run of {run_elements} elements is not whole tokens of blocks of {block_size}",
            layer=name,
        )
    # A rank holding one KV head still says where its heads are (TP planning slices blocks by
    # them), at one place for every layout: its stride says nothing, and one head orders no bytes.
    holds_one_head = any(
        axis != block_axis and names[axis] == HEAD_AXIS and shape[axis] == 1 for axis in range(len(shape))
    )
    part_axes = [f"{label}{size}" for _, size, label in outer]
    run_axes = [f"{label}{size}" for _, size, label in inner[len(outer) :]]
    block_layout = " ".join([*part_axes, *([f"{HEAD_AXIS}1"] if holds_one_head else []), *run_axes])
    if parts > MAX_PARTS:
        raise ConfigError(
            f"layer {name!r}: a block is {parts} separate runs, more than the {MAX_PARTS} kvray moves",
            layer=name,
        )
    itemsize = tensor.element_size()
    geometry = Geometry(
        block_size=block_size,
        entry_shape=(run_elements // block_size,),
        dtype=_DTYPE_NAMES[tensor.dtype],
        parts=parts,
        block_layout=block_layout,
    )
    return geometry, BlockStrides(part_step * itemsize, steps[block_axis] * itemsize)


def _check_disjoint(
    layout: KVLayout, tensors: Mapping[str, torch.Tensor], strides: Mapping[str, BlockStrides]
) -> None:
    """Two kvray layers must not share a byte: a write into one would land in the other."""
    try:
        check_adopted_disjoint(layout, tensors, strides)
    except LayoutError as error:
        raise ConfigError(
            f"vLLM's KV caches of two layers overlap without being the same tensor; kvray cannot "
            f"move them apart ({error})"
        ) from None


def _check_groups(
    group_layers: Sequence[Sequence[str]], layer_of: Mapping[str, str], kvray_layers: Sequence[str]
) -> None:
    """Every KV cache group must have a layer in every kvray layer: a block id of any group is
    then moved in every kvray layer, which is that group's KV and no other's."""
    everything = set(kvray_layers)
    for index, names in enumerate(group_layers):
        unknown = sorted(set(names) - set(layer_of))
        if unknown:
            raise ConfigError(
                f"KV cache group {index} names layers vLLM registered no cache for: {unknown[:3]}",
                group=index,
            )
        covered = {layer_of[name] for name in names}
        if len(group_layers) > 1 and covered != everything:
            raise ConfigError(
                f"KV cache group {index} ({len(names)} layers) does not share its memory with the "
                f"other groups' layers ({len(everything - covered)} of {len(everything)} layer "
                "caches hold none of its blocks): kvray moves models whose KV cache groups share "
                "one cache per layer position (vLLM's hybrid KV cache manager with groups of one "
                "page size), not groups of different shapes",
                group=index,
            )
