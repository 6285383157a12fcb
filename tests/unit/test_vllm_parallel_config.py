"""Which parallel configurations `KvrayConnector` takes (`kv_heads_of`, at start-up): tensor
parallelism whose size divides the model's KV heads, an MLA latent at any TP size; pipeline or
context parallelism, and TP sizes vLLM would meet by replicating heads, refused with the
configuration named. Needs vLLM installed (the connector module imports its base class)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector module needs vllm: pip install -e '.[vllm]'")

from kvray.errors import ConfigError
from kvray.integrations.vllm.cache_layout import kv_heads_of


def config(tp: int = 1, kv_heads: int = 4, *, mla: bool = False, **parallel: int) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, **parallel),
        model_config=SimpleNamespace(use_mla=mla, get_total_num_kv_heads=lambda: kv_heads),
    )


@pytest.mark.parametrize(("tp", "kv_heads"), [(1, 4), (2, 4), (4, 4), (2, 2), (1, 3), (8, 8)])
def test_tp_sizes_dividing_the_kv_heads_are_taken(tp: int, kv_heads: int) -> None:
    assert kv_heads_of(config(tp, kv_heads)) == kv_heads


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_an_mla_latent_is_whole_on_every_rank(tp: int) -> None:
    assert kv_heads_of(config(tp, 1, mla=True)) == 0


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 3), (4, 2), (8, 4), (3, 4)])
def test_tp_sizes_that_would_replicate_or_split_heads_unevenly_are_refused(tp: int, kv_heads: int) -> None:
    with pytest.raises(
        ConfigError, match=f"tensor_parallel_size {tp} does not divide the model's {kv_heads}"
    ):
        kv_heads_of(config(tp, kv_heads))


@pytest.mark.parametrize(
    "parallel",
    [
        {"pipeline_parallel_size": 2},
        {"decode_context_parallel_size": 2},
        {"prefill_context_parallel_size": 2, "pipeline_parallel_size": 2},
    ],
)
def test_pipeline_and_context_parallelism_are_refused_naming_them(parallel: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="tensor parallelism only") as refused:
        kv_heads_of(config(2, 4, **parallel))
    for name, size in parallel.items():
        assert f"{name}={size}" in str(refused.value)
