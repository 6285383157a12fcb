"""A live Ray Serve LLM P/D app in the tests: starting it, the engines' KV cache usage as Ray's
metrics agents export it, and streamed completions whose client goes away."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import ray

MODEL_ID = "smollm2"
#: How long the app may take to start serving (seconds).
START_S = 600.0


def exported(metric: str) -> dict[str, float]:
    """The last value of a Ray-exported metric of each Serve replica, by replica id."""
    values: dict[str, float] = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for line in httpx.get(url, timeout=10.0).text.splitlines():
            if line.startswith(metric + "{"):
                replica = re.search(r'ReplicaId="([^"]*)"', line)
                assert replica is not None, line
                values[replica.group(1)] = float(line.rsplit(" ", 1)[1])
    return values


def exported_total(metric: str, **labels: str) -> float:
    """The sum over every node and Serve replica of a Ray-exported metric's series that carry
    `labels`."""
    total = 0.0
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for line in httpx.get(url, timeout=10.0).text.splitlines():
            if line.startswith(metric + "{") and all(
                f'{key}="{value}"' in line for key, value in labels.items()
            ):
                total += float(line.rsplit(" ", 1)[1])
    return total


def kv_cache_usage() -> dict[str, float]:
    """The KV cache usage (the fraction of blocks held) that each Serve replica's vLLM engine
    last recorded, by replica id, as Ray's metrics agents export it. An engine records it as
    each of its steps ends, and a series not recorded for a while is no longer exported."""
    return exported("ray_vllm_kv_cache_usage_perc")


def wait_until_nothing_held(replicas: int = 2, timeout_s: float = 30.0) -> None:
    """Wait until every replica's engine records a KV cache usage of 0 (the caller has just
    had a request served, so each engine steps and records it)."""
    deadline = time.monotonic() + timeout_s
    usage: dict[str, float] = {}
    while len(usage) < replicas or any(usage.values()):
        assert time.monotonic() < deadline, f"KV blocks held after every client went away: {usage}"
        time.sleep(0.5)
        usage.update(kv_cache_usage())


def hang_up(url: str, prompt: str, after_s: float | None = None, after_chunks: int | None = None) -> int:
    """A streamed completion whose client goes away `after_s` seconds after sending it (whatever
    has come back by then), or once `after_chunks` chunks have arrived: the chunks it read."""
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 384, "temperature": 0.0}
    body.update(stream=True, ignore_eos=True)
    if after_s is not None:
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        with socket.create_connection((host, int(port))) as connection:
            connection.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            time.sleep(after_s)
        return 0
    chunks = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as reply:
        for line in reply.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == after_chunks:
                break
    return chunks


def serving(
    logs: Path | None,
    extra: Mapping[str, Any],
    *,
    model: str | None = None,
    num_cpus: int = 8,
    **app_options: Any,
) -> Iterator[dict[str, Any]]:
    """A local Ray of `num_cpus` logical CPUs with Ray Serve LLM's P/D app over the test model
    (SmolLM2 unless `model` names a model folder; `extra`: both sides' connector settings,
    each side's digest log in `logs` unless None, by `DigestLogConnector`; `app_options`: more
    `build_pd_app` arguments, `model_id` among them) and a reference engine without kvray:
    {"url", "reference", "logs"}. For a module fixture (vLLM must be installed)."""
    from ray import serve

    from kvray.bench.handoff_log import DIGEST_LOG_CONNECTOR
    from kvray.integrations.vllm.model import smollm2
    from kvray.integrations.vllm.pd import Engine
    from kvray.integrations.vllm.serve_llm import build_pd_app, wait_until_serving

    model = model or str(smollm2())
    # Logical CPUs: each engine takes a bundle of one, plus the replicas and the ingress.
    # Metrics each second: tests read the engines' KV cache usage from them.
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    reference = ray.remote(num_cpus=0)(Engine).remote(model, None, join_ray=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_pd_app(
            model,
            model_id=app_options.pop("model_id", MODEL_ID),
            prefill_extra={**extra, **({"digest_log": str(logs / "p.jsonl")} if logs else {})},
            decode_extra={**extra, **({"digest_log": str(logs / "d.jsonl")} if logs else {})},
            **({"connector": DIGEST_LOG_CONNECTOR} if logs else {}),
            **app_options,
        ),
        blocking=False,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(url, START_S)
    ray.get(reference.processes.remote())
    yield {"url": url, "reference": reference, "logs": logs}
    serve.shutdown()
    ray.shutdown()
