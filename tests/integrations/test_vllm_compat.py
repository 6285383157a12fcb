"""`kvray.integrations.vllm.compat`: a vLLM that allocates one KV cache tensor per layer (0.26)
gets them all from one buffer placed by the connector; what it cannot be told is refused."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvray.errors import ConfigError
from kvray.integrations.vllm import compat


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list[str]
    block_stride: int = 0


@dataclass
class Group:
    layer_names: list[str]


@dataclass
class KVCacheConfig:
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[Group]


def runner_class() -> Any:
    """A model runner as vLLM 0.26's: one `torch.zeros` per KV cache tensor."""

    class Runner:
        device = torch.device("cpu")
        runner_only_attn_layers: frozenset[str] = frozenset()
        allocations = 0

        def _allocate_kv_cache_tensors(self, kv_cache_config: Any) -> dict[str, torch.Tensor]:
            caches = {}
            for tensor in kv_cache_config.kv_cache_tensors:
                type(self).allocations += 1
                raw = torch.zeros(tensor.size, dtype=torch.int8, device=self.device)
                for layer in tensor.shared_by:
                    caches[layer] = raw
            return caches

    return Runner


@dataclass
class Placer:
    """A connector's allocation context: counts the buffers allocated inside it."""

    inside: list[int] = field(default_factory=list)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        original = torch.zeros

        def zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
            self.inside.append(int(size[0]))
            return original(*size, **kwargs)

        torch.zeros = zeros  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.zeros = original


def test_per_layer_tensors_come_from_one_buffer_allocated_in_the_connectors_context() -> None:
    runner = runner_class()
    placer = Placer()
    compat.place_in_one_allocation(placer.context, runner)
    # Two KV cache groups sharing tensors (vLLM's hybrid layout), sizes off the page grid.
    config = KVCacheConfig(
        [KVCacheTensor(10_000, ["full.0", "slide.0"]), KVCacheTensor(5_000, ["full.1", "slide.1"])],
        [Group(["full.0", "full.1"]), Group(["slide.0", "slide.1"])],
    )
    caches = runner()._allocate_kv_cache_tensors(config)
    assert runner.allocations == 0  # vLLM's own allocation never ran
    assert placer.inside == [compat.LAYER_ALIGNMENT * 3 + compat.LAYER_ALIGNMENT * 2]
    storage = {tensor.untyped_storage().data_ptr() for tensor in caches.values()}
    assert len(storage) == 1
    base = caches["full.0"].untyped_storage().data_ptr()
    assert caches["full.0"].data_ptr() == base and caches["full.0"].numel() == 10_000
    assert caches["full.1"].data_ptr() == base + 3 * compat.LAYER_ALIGNMENT
    assert caches["full.1"].numel() == 5_000
    assert caches["slide.0"] is caches["full.0"] and caches["slide.1"] is caches["full.1"]
    # Each layer writes its own bytes only.
    caches["full.0"].fill_(1)
    caches["full.1"].fill_(2)
    assert int(caches["full.0"].sum()) == 10_000 and int(caches["full.1"].sum()) == 10_000


def test_packed_tensors_are_left_to_vllm_and_a_layer_no_group_names_is_refused() -> None:
    runner = runner_class()
    placer = Placer()
    compat.place_in_one_allocation(placer.context, runner)
    compat.place_in_one_allocation(placer.context, runner)  # once per process is enough
    packed = KVCacheConfig([KVCacheTensor(8192, ["a"], block_stride=64)], [Group(["a"])])
    runner()._allocate_kv_cache_tensors(packed)
    assert runner.allocations == 1 and placer.inside == []
    stray = KVCacheConfig([KVCacheTensor(8192, ["a", "b"])], [Group(["a"])])
    with pytest.raises(ConfigError, match=r"\['b'\]"):
        runner()._allocate_kv_cache_tensors(stray)


def test_a_vllm_without_failed_receives_refuses_models_of_several_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("vllm")
    monkeypatch.setattr(compat, "REPORTS_FAILED_RECEIVES", False)
    compat.check_groups((("a", "b"),))
    with pytest.raises(ConfigError, match="several KV cache groups"):
        compat.check_groups((("a",), ("b",)))
    monkeypatch.setattr(compat, "REPORTS_FAILED_RECEIVES", True)
    compat.check_groups((("a",), ("b",)))
    results = compat._LocalTransferResults(finished_recving={"r"})
    assert results.finished_sending is None and results.failed_recving is None
