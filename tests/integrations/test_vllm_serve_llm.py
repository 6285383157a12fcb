"""Ray Serve LLM's prefill/decode application (`ray.serve.llm.build_pd_openai_app`) with kvray as
its connector back-end, over real HTTP on this CPU machine: the decode replica's orchestrator
binds the prefill replica first, both requests run at once, the decode engine finds the prefill
engine through kvray's coordinator and the KV is pushed into its blocks, layer by layer where
the prefill's forward had not started. Completions (plain, streamed, 8 clients at once) and
chat completions equal a single engine's greedy answers, and the KV of sampled requests has
equal per-layer digests as sent and as received.

Skipped where vLLM, the model's package or pyarrow (which `ray.serve.llm` imports) is missing."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from handoff_logs import by_request, failures
from serve_llm_clients import MODEL_ID, hang_up, kv_cache_usage, serving, wait_until_nothing_held
from vllm_installed import require_vllm

require_vllm()
pytest.importorskip("pyarrow", reason="ray.serve.llm needs pyarrow: pip install -e '.[vllm]'")

import httpx  # noqa: E402 - after the check that they are installed
import ray  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed

pytestmark = pytest.mark.cluster

NEW_TOKENS = 32


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    extra = {"transfer_timeout_s": 60.0, "digest_every": 1}  # every request's digests: ids are random
    yield from serving(tmp_path_factory.mktemp("serve-llm"), extra)


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
    wait_until_nothing_held()
