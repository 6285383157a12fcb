"""Ray Serve LLM's prefill/decode application (`ray.serve.llm.build_pd_openai_app`) with kvray as
its connector back-end, over real HTTP on this CPU machine: the decode replica's orchestrator
binds the prefill replica first, both requests run at once, the decode engine finds the prefill
engine through kvray's coordinator and the KV is pushed into its blocks, layer by layer where
the prefill's forward had not started. Completions (plain, streamed, 8 clients at once) and
chat completions equal a single engine's greedy answers, and the KV of sampled requests has
equal per-layer digests as sent and as received.

Then the serving boundary, tried as a careless or hostile client would: one `request_id` from
several clients, decode legs the decode engine refuses, clients that hang up at any moment, and
a decode engine so small that long generations preempt each other. Every answer is exact or a
clean 4xx/5xx, and afterwards no KV cache block is held on any replica. One app serves every
test of the module (starting one takes minutes here).

Skipped where vLLM, the model's package or pyarrow (which `ray.serve.llm` imports) is missing."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from handoff_logs import by_request, failures
from serve_llm_clients import (
    MODEL_ID,
    exported,
    exported_total,
    hang_up,
    kv_cache_usage,
    serving,
    wait_until_nothing_held,
)
from vllm_installed import require_vllm

require_vllm()
pytest.importorskip("pyarrow", reason="ray.serve.llm needs pyarrow: pip install -e '.[vllm]'")

import httpx  # noqa: E402 - after the check that they are installed
import ray  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed

pytestmark = pytest.mark.usefixtures("own_ray", "vllm_ready")

NEW_TOKENS = 32
LONG_TOKENS = 96
#: The decode engine's KV cache: 20 blocks of 128 tokens (vLLM keeps one back; 2048 tokens, the
#: longest request, must fit in the rest), so that a few long generations at once
#: run out of blocks and vLLM preempts some of them.
DECODE_BLOCKS = 20


#: How long a prefill engine holds a finished request's blocks for a decode engine.
LEASE_S = 60.0


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    # Every request's digests: ids are random.
    extra = {"transfer_timeout_s": 60.0, "lease_s": LEASE_S, "digest_every": 1}
    yield from serving(
        tmp_path_factory.mktemp("serve-llm"),
        extra,
        decode_options={"num_gpu_blocks_override": DECODE_BLOCKS},
    )


def complete(url: str, prompt: str) -> str:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def test_completions_equal_a_single_engine_and_the_kv_arrives_intact(app: dict[str, Any]) -> None:
    prompts = load_prompts()[:12]
    alone = [g.text for g in ray.get(app["reference"].generate.remote(prompts, NEW_TOKENS))]
    served = [complete(app["url"], prompt) for prompt in prompts]
    logs = app["logs"]
    assert served == alone, failures(logs / "p.jsonl", logs / "d.jsonl")
    sent = by_request(logs / "p.jsonl", "sent")
    received = by_request(logs / "d.jsonl", "received")
    assert len(sent) >= len(prompts) and set(sent) == set(received)
    assert any(r["layerwise"] for r in sent.values()), "no request was pushed layer by layer"
    sampled = [key for key, r in sent.items() if r["layers"]]
    assert sampled
    for key in sampled:
        assert sent[key]["layers"] == received[key]["layers"], key
    # kvray's figures on Ray Serve LLM's own metrics (its engines' vLLM Ray stat logger): every
    # request pushed, and checked (the tests check every request's KV) with no mismatch.
    deadline = time.monotonic() + 60.0
    while True:
        pushed = exported_total("ray_vllm_kvray_transfers_total", outcome="ok")
        checked = exported_total("ray_vllm_kvray_integrity_checks_total", result="ok")
        if (pushed >= len(prompts) and checked >= len(prompts)) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert pushed >= len(prompts) and checked >= len(prompts), (pushed, checked)
    assert exported_total("ray_vllm_kvray_integrity_checks_total", result="mismatch") == 0


def test_streamed_completions_and_chat_equal_a_single_engine(app: dict[str, Any]) -> None:
    url, prompt = app["url"], load_prompts()[12]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "stream": True}
    pieces = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    assert len(pieces) > 1
    assert "".join(pieces) == ray.get(app["reference"].generate.remote([prompt], NEW_TOKENS))[0].text

    # Chat through the OpenAI client, as the README shows it.
    from openai import OpenAI

    conversation = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model=MODEL_ID,
        messages=conversation,
        max_tokens=NEW_TOKENS,
        temperature=0.0,  # type: ignore[arg-type]
    )
    answer = reply.choices[0].message.content
    assert answer == ray.get(app["reference"].chat.remote([conversation], NEW_TOKENS))[0]
    assert "Paris" in answer


def test_eight_clients_at_once(app: dict[str, Any]) -> None:
    prompts = load_prompts()[13:21]
    alone = [g.text for g in ray.get(app["reference"].generate.remote(prompts, NEW_TOKENS))]
    with ThreadPoolExecutor(max_workers=8) as clients:
        served = list(clients.map(lambda prompt: complete(app["url"], prompt), prompts))
    assert served == alone, failures(app["logs"] / "p.jsonl", app["logs"] / "d.jsonl")


def test_clients_that_hang_up_leave_no_block_held_on_either_side(app: dict[str, Any]) -> None:
    """Clients go away before the prompt's KV has arrived (at several moments of the prefill,
    the push and the first token) and while tokens stream; once they are gone every KV block
    of both engines is free again, and the app answers the next request exactly."""
    prompts = load_prompts()
    long_prompt = " ".join(prompts[:30])  # ~1700 tokens: a prefill of seconds here, the push after it
    with ThreadPoolExecutor(max_workers=9) as clients:
        moments = (0.05, 0.3, 0.8, 1.5, 3.0)
        hung_up = [clients.submit(hang_up, app["url"], long_prompt, after_s=seconds) for seconds in moments]
        hung_up += [
            clients.submit(hang_up, app["url"], prompt, after_chunks=chunks)
            for prompt, chunks in zip(prompts[40:44], (1, 2, 8, 40), strict=True)
        ]
        # While they run the gauge shows blocks held: the reading below is live, not a constant.
        held = 0.0
        while not all(client.done() for client in hung_up):
            held = max([held, *kv_cache_usage().values()])
            time.sleep(1.0)
        for client in hung_up:
            client.result()
    assert held > 0, "the KV cache usage gauge never showed a block held while requests ran"
    # The next request is served exactly, and the steps that serve it record each engine's
    # usage once the hung-up requests are gone: nothing is held on either side.
    prompt = prompts[44]
    alone = ray.get(app["reference"].generate.remote([prompt], NEW_TOKENS))[0].text
    assert complete(app["url"], prompt) == alone
    # A hang-up that races the hand-off (the decode leg cancelled while the prefill leg still
    # computes) may leave the prefill engine holding the prompt's blocks for a decode engine
    # that never asks: they are freed when the lease ends, and never later.
    wait_until_nothing_held(timeout_s=LEASE_S + 15.0)


def post(url: str, prompt: str, max_tokens: int, **extra: Any) -> tuple[int, str]:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
    if reply.status_code == 200:
        return 200, str(reply.json()["choices"][0]["text"])
    assert "error" in reply.text.lower(), reply.text  # a clean error: a JSON error body
    return reply.status_code, reply.text


def test_one_request_id_from_several_clients_never_mixes_their_kv(app: dict[str, Any]) -> None:
    url, reference = app["url"], app["reference"]
    # Refused decode legs first (more new tokens than the context): before this was fixed their
    # prefill legs ran and held the prompt's KV under a key derived from the request id, and a
    # later request with that id was answered from it.
    for _ in range(2):
        status, text = post(url, "The capital of France is", 100000, request_id="dup-big")
        assert status == 400, text
    colors = "Write a list of three primary colors:"
    expected = ray.get(reference.generate.remote([colors], 16))[0].text
    assert post(url, colors, 16, request_id="dup-big") == (200, expected)
    # Several clients, one request id, at once and back to back.
    prompts = load_prompts()[:6]
    alone = [g.text for g in ray.get(reference.generate.remote(prompts, NEW_TOKENS))]
    with ThreadPoolExecutor(max_workers=6) as clients:
        served = list(clients.map(lambda p: post(url, p, NEW_TOKENS, request_id="dup-2"), prompts))
    assert served == [(200, text) for text in alone], failures(
        app["logs"] / "p.jsonl", app["logs"] / "d.jsonl"
    )
    assert [post(url, p, NEW_TOKENS, request_id="dup-3") for p in prompts[:3]] == [
        (200, t) for t in alone[:3]
    ]
    wait_until_nothing_held()


def test_eight_clients_mixing_duplicate_ids_refusals_hang_ups_and_preemption(app: dict[str, Any]) -> None:
    url, reference = app["url"], app["reference"]
    prompts = load_prompts()
    short = prompts[10:18]
    # About 700 tokens each: three at once with their generations need more than the decode
    # engine's 20 blocks.
    long = [" ".join(prompts[20 + 3 * i : 32 + 3 * i]) for i in range(4)]
    alone_short = [g.text for g in ray.get(reference.generate.remote(short, NEW_TOKENS))]
    alone_long = [g.text for g in ray.get(reference.generate.remote(long, LONG_TOKENS, ignore_eos=True))]
    before = sum(exported("ray_vllm_num_preemptions_total").values())
    chance = random.Random(28)
    plans = []
    for client in range(8):
        kinds = ["long", "dup", "refused", "hang"]
        chance.shuffle(kinds)
        plans.append([(kind, client, chance.uniform(0.05, 2.0), chance.randint(1, 8)) for kind in kinds])

    def act(kind: str, client: int, seconds: float, chunks: int) -> tuple[str, int, int, str]:
        if kind == "long":
            index = client % len(long)
            status, text = post(url, long[index], LONG_TOKENS, ignore_eos=True, request_id="shared")
            return kind, index, status, text
        if kind == "dup":
            status, text = post(url, short[client], NEW_TOKENS, request_id="shared")
            return kind, client, status, text
        if kind == "refused":
            status, text = post(url, short[client], 100000, request_id="shared")
            return kind, client, status, text
        if client % 2:
            hang_up(url, long[client % len(long)], after_s=seconds)
        else:
            hang_up(url, short[client], after_chunks=chunks)
        return kind, client, 0, ""

    def run(plan: list[tuple[str, int, float, int]]) -> list[tuple[str, int, int, str]]:
        return [act(*step) for step in plan]

    # The clients' timing decides whether three long requests meet in the decode engine: on a
    # machine busy enough to spread them out, the round runs again (at most three times).
    preempted = 0
    for _ in range(3):
        with ThreadPoolExecutor(max_workers=8) as clients:
            outcomes = [outcome for done in clients.map(run, plans) for outcome in done]
        why = failures(app["logs"] / "p.jsonl", app["logs"] / "d.jsonl")
        for kind, index, status, text in outcomes:
            if kind == "refused":
                assert status == 400, text
            elif kind == "long":
                assert (status, text) == (200, alone_long[index]), (index, status, text[:200], why)
            elif kind == "dup":
                assert (status, text) == (200, alone_short[index]), (index, status, text[:200], why)
        deadline = time.monotonic() + 5  # Ray's metrics agent exports within a second or two
        while preempted == 0 and time.monotonic() < deadline:
            preempted = sum(exported("ray_vllm_num_preemptions_total").values()) - before
            time.sleep(0.5)
        if preempted:
            break
    assert preempted > 0, "the decode engine never preempted a request: the test did not test it"
    # The next request is exact, and every replica's engine then holds no block.
    status, text = post(url, short[0], NEW_TOKENS)
    assert (status, text) == (200, alone_short[0])
    wait_until_nothing_held()
