"""Faults over HTTP on Ray Serve LLM's P/D application with kvray (one prefill, two decode
replicas): a decode replica killed under load fails only its own requests, with a 5xx, while the
others answer exactly; Serve's replacement registers and serves. A prefill replica killed under
load fails its requests within the transfer deadline (or they are served exactly, before it died
or by its replacement), none hangs, and its replacement serves.

Skipped where vLLM, the model's package or pyarrow (which `ray.serve.llm` imports) is missing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serve_llm_clients import serving
from vllm_installed import require_vllm

require_vllm()
pytest.importorskip("pyarrow", reason="ray.serve.llm needs pyarrow: pip install -e '.[vllm]'")

import httpx  # noqa: E402 - after the check that they are installed
import ray  # noqa: E402 - after the check that they are installed
from ray import serve  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed

pytestmark = pytest.mark.usefixtures("own_ray", "vllm_ready")

#: Long enough that every request is still decoding when a replica is killed.
NEW_TOKENS = 384
DEADLINE_S = 20.0
#: How long a burst of requests may take to reach the replicas (each then runs for seconds).
ARRIVE_S = 60.0
#: Longest any request may take here, failures and waits for a replacement included: nothing hangs.
NEVER_HANG_S = 240.0


@pytest.fixture(scope="module")
def app() -> Iterator[dict[str, Any]]:
    extra = {"transfer_timeout_s": DEADLINE_S, "notify_timeout_s": 5.0, "lease_s": 30.0}
    yield from serving(None, extra, num_cpus=12, decode_replicas=2)


def replicas(deployment: str) -> list[str]:
    """Names of the live Serve replica actors of a deployment ("Prefill" or "Decode")."""
    return sorted(
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and f"#{deployment}:" in actor["name"]
    )


def complete(url: str, prompt: str) -> tuple[int, str, float]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    started = time.monotonic()
    try:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=NEVER_HANG_S)
    except httpx.HTTPError as error:  # the connection itself failed: counted as a server error
        return 599, repr(error), time.monotonic() - started
    text = reply.json()["choices"][0]["text"] if reply.status_code == 200 else reply.text
    return reply.status_code, text, time.monotonic() - started


def ongoing(replica: str) -> int:
    """How many requests a Serve replica is handling now, as Serve counts them (its replica
    actor answers on a thread of its own, whatever the replica is doing)."""
    actor = ray.get_actor(replica, namespace="serve")
    return int(ray.get(actor.get_num_ongoing_requests.remote(), timeout=30))


def under_load(
    app: dict[str, Any], prompts: list[str], kill: str, *, on_replicas: int
) -> tuple[str, dict[str, int], list[tuple[int, str, float]]]:
    """`prompts` sent at once; once `on_replicas` of them are on replicas of `kill` (the first
    requests of an app take a while to get there), the replica handling the most of them is
    killed (Serve may route them all to one replica): (its name, each replica's requests at
    that moment, the answers)."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as clients:
        answers = [clients.submit(complete, app["url"], prompt) for prompt in prompts]
        deadline = time.monotonic() + ARRIVE_S
        while True:
            load = {replica: ongoing(replica) for replica in replicas(kill)}
            if sum(load.values()) >= on_replicas or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        victim = max(load, key=lambda replica: load[replica])
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return victim, load, [answer.result(timeout=NEVER_HANG_S + 30) for answer in answers]


def running(deployment: str, count: int, gone: str, timeout_s: float = 300.0) -> None:
    """Wait until the replica `gone` has left the deployment and Serve reports at least `count`
    replicas of it running (engines up): every running replica is then one started after `gone`
    died or one that was running beside it (Serve may bring up `gone`'s replacement meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = serve.status().applications["default"].deployments[f"{deployment}:smollm2"]
        names = replicas(deployment)
        if gone not in names and states.replica_states.get("RUNNING", 0) >= count:
            return
        assert time.monotonic() < deadline, f"{gone} not replaced: {states}, replicas {names}"
        time.sleep(2.0)


def test_a_killed_decode_replica_fails_only_its_requests_and_is_replaced(app: dict[str, Any]) -> None:
    prompts = load_prompts()[:8]
    alone = [g.text for g in ray.get(app["reference"].generate.remote(prompts, NEW_TOKENS))]
    before = replicas("Decode")
    assert len(before) == 2
    victim, load, answers = under_load(app, prompts, "Decode", on_replicas=len(prompts))
    assert load[victim] > 0, load
    for (status, text, seconds), expected in zip(answers, alone, strict=True):
        assert seconds < NEVER_HANG_S
        assert (status == 200 and text == expected) or 500 <= status < 600, (status, text[:200])
    assert any(status >= 500 for status, _, _ in answers), (
        f"no request failed with the killed replica: {load}"
    )
    # The other replica's requests all answered, exactly (above).
    surviving = sum(count for replica, count in load.items() if replica != victim)
    assert sum(status == 200 for status, _, _ in answers) >= surviving, (load, [a[0] for a in answers])
    # The replacement registers and serves: once it runs, the other original replica goes too,
    # and every later request is the replacement's.
    running("Decode", 2, gone=victim)
    (survivor,) = set(before) - {victim}
    ray.kill(ray.get_actor(survivor, namespace="serve"), no_restart=True)
    # Seen gone: the replacement serves, alone or beside the survivor's own replacement.
    running("Decode", 1, gone=survivor, timeout_s=180.0)
    later = load_prompts()[8:12]
    expected = [g.text for g in ray.get(app["reference"].generate.remote(later, NEW_TOKENS))]
    with ThreadPoolExecutor(max_workers=4) as clients:
        assert [a[:2] for a in clients.map(lambda p: complete(app["url"], p), later)] == [
            (200, text) for text in expected
        ]


def test_a_killed_prefill_replica_fails_its_requests_within_the_deadline(app: dict[str, Any]) -> None:
    prompts = load_prompts()[12:16]
    alone = [g.text for g in ray.get(app["reference"].generate.remote(prompts, NEW_TOKENS))]
    victim, _, answers = under_load(app, prompts, "Prefill", on_replicas=1)
    for (status, text, seconds), expected in zip(answers, alone, strict=True):
        assert seconds < NEVER_HANG_S, seconds
        if status == 200:
            # Its KV had arrived, or Serve sent its prefill leg to the replacement once that
            # ran (a wait for the replacement, not for a deadline).
            assert text == expected, text[:200]
        else:
            # A failure comes once the request's deadline has passed, never much later, as a
            # JSON error; one whose KV did not load is a 502 naming the decode leg and the cause
            # (never a 200 with finish_reason "error").
            assert status >= 400 and seconds < DEADLINE_S + 60, (status, seconds, text[:200])
            if status != 599:
                error = json.loads(text)["error"]
                assert error["message"], text[:200]
                if status == 502:
                    assert (error.get("leg"), error.get("cause")) == ("decode", "kv_load_failed"), error
    print("answers with the prefill replica killed:", sorted(status for status, _, _ in answers))
    running("Prefill", 1, gone=victim)
    status, text, _ = complete(app["url"], prompts[0])
    assert (status, text) == (200, alone[0])
