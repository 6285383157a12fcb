"""kvray's metrics as Prometheus sees them: real transfers between worker actors on a local Ray
(and a prefill engine's hand-off holding requests nobody asks for), read back from the node's
metrics agent (Ray's Prometheus endpoint), where Ray exports them with a `ray_` prefix (counters
with a `_total` suffix)."""

from __future__ import annotations

import re
import socket
import time
import types
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
from ray_starts import start_local_ray

from kvray.agent.handoff import Handoff, LoadSpec, SendSpec
from kvray.agent.kvagent import KVAgent
from kvray.config import Settings
from kvray.layout import mixed
from kvray.wire import Role
from kvray.workers import DecodeActor, PrefillActor

pytestmark = pytest.mark.usefixtures("own_ray")

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def metrics_url() -> Iterator[str]:
    """A local Ray whose metrics agent serves Prometheus text on a known port, reporting often."""
    port = _free_port()
    start_local_ray(num_cpus=4, _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 500})
    yield f"http://127.0.0.1:{port}/metrics"
    ray.shutdown()


def _scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"].startswith(("ray_kvray_", "ray_vllm_kvray_")):
            labels = dict(_LABEL.findall(match["labels"] or ""))
            samples.append(Sample(match["name"], labels, float(match["value"])))
    return samples


def _total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _scrape_until(
    url: str, expected: dict[tuple[str, tuple[tuple[str, str], ...]], float]
) -> dict[Any, float]:
    """Each sample sum of `expected` (by name and labels) as scraped once they are all in, or at
    a deadline (each worker reports every 500 ms)."""
    deadline = time.monotonic() + 90
    while True:
        samples = _scrape(url)
        seen = {key: _total(samples, key[0], **dict(key[1])) for key in expected}
        if seen == expected or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def test_transfers_show_up_in_prometheus(metrics_url: str) -> None:
    layout = mixed(16)
    prefill = PrefillActor.remote("metrics-p", layout)
    ray_prefill = PrefillActor.remote("metrics-p-ray", layout, Settings.from_env(transport="ray"))
    decode = DecodeActor.remote("metrics-d", layout)
    ray.get([actor.start.remote() for actor in (prefill, ray_prefill, decode)])

    pushed = {"shm": 0, "ray": 0}
    for index, (source, transport) in enumerate([(prefill, "shm"), (prefill, "shm"), (ray_prefill, "ray")]):
        request = f"metrics-{index}"
        ray.get(source.allocate.remote(request, 2))
        reservation = ray.get(decode.reserve.remote(request, 2))
        waiting = decode.wait.remote(request, 30.0)
        result = ray.get(source.push.remote(reservation, timeout=30.0))
        ray.get(waiting)
        assert result.transport.value == transport
        pushed[transport] += result.nbytes
    # One request keeps its blocks on the decode side; the others are released.
    ray.get([decode.release.remote(f"metrics-{index}") for index in (0, 1)])

    expected = {
        ("ray_kvray_bytes_pushed_total", "metrics-p", "shm"): pushed["shm"],
        ("ray_kvray_bytes_pushed_total", "metrics-p-ray", "ray"): pushed["ray"],
        ("ray_kvray_transfers_total", "metrics-p", "shm"): 2,
        ("ray_kvray_transfers_total", "metrics-p-ray", "ray"): 1,
        ("ray_kvray_transfer_seconds_count", "metrics-p", "shm"): 2,
    }
    # Each worker reports every 500 ms: scrape until the figures are in (bounded by a deadline).
    deadline = time.monotonic() + 90
    while True:
        samples = _scrape(metrics_url)
        seen = {
            key: _total(samples, key[0], engine=key[1], transport=key[2], peer="metrics-d")
            for key in expected
        }
        received = _total(samples, "ray_kvray_bytes_received_total", engine="metrics-d")
        in_use = _total(samples, "ray_kvray_blocks_in_use", engine="metrics-d", role="decode")
        waits = _total(samples, "ray_kvray_waits_total", engine="metrics-d", outcome="ok")
        complete = seen == expected and received == sum(pushed.values()) and waits == 3 and in_use == 2
        if complete or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert seen == expected
    assert received == sum(pushed.values())
    assert waits == 3
    assert in_use == 2
    assert _total(samples, "ray_kvray_blocks_total", engine="metrics-d") == layout.num_blocks
    assert _total(samples, "ray_kvray_transfers_total", engine="metrics-p", outcome="failed") == 0
    assert _total(samples, "ray_kvray_failures_total", engine="metrics-p") == 0
    ok = _total(samples, "ray_kvray_transfers_total", engine="metrics-p", push="whole", outcome="ok")
    assert ok == 2


def test_failures_show_up_by_cause(metrics_url: str) -> None:
    layout = mixed(16)
    prefill = PrefillActor.remote("metrics-fail-p", layout)
    decode = DecodeActor.remote("metrics-fail-d", layout)
    ray.get([actor.start.remote() for actor in (prefill, decode)])
    # A push into a reservation its decode engine released: refused, nothing written.
    ray.get(prefill.allocate.remote("gone", 2))
    reservation = ray.get(decode.reserve.remote("gone", 2))
    ray.get(decode.release.remote("gone"))
    with pytest.raises(ray.exceptions.RayTaskError, match="NotExpectedError"):
        ray.get(prefill.push.remote(reservation, timeout=30.0))
    # A wait for KV nobody pushes.
    ray.get(decode.reserve.remote("never", 2))
    with pytest.raises(ray.exceptions.RayTaskError, match="TransferTimeoutError"):
        ray.get(decode.wait.remote("never", 0.2))

    failures = "ray_kvray_failures_total"
    expected = {
        (failures, (("engine", "metrics-fail-p"), ("call", "whole"), ("cause", "NotExpectedError"))): 1.0,
        (failures, (("engine", "metrics-fail-p"),)): 1.0,
        (failures, (("engine", "metrics-fail-d"), ("call", "wait"), ("cause", "TransferTimeoutError"))): 1.0,
        (failures, (("engine", "metrics-fail-d"),)): 1.0,
        ("ray_kvray_transfers_total", (("engine", "metrics-fail-p"), ("outcome", "failed"))): 1.0,
        ("ray_kvray_waits_total", (("engine", "metrics-fail-d"), ("outcome", "timed_out"))): 1.0,
    }
    assert _scrape_until(metrics_url, expected) == expected


@ray.remote
class LeaseHolder:
    """A prefill engine's hand-off in an actor, holding requests no decode engine asks for (the
    actor is its `HandoffReports`: a class of this module's own would not unpickle in Ray's
    workers, which cannot import a test module)."""

    def __init__(self, engine_id: str) -> None:
        self.agent = KVAgent(engine_id, Role.PREFILL, mixed(16), use_coordinator=False)
        self.handoff: Handoff | None = None

    def sent(self, request_id: str) -> None:
        pass

    def loaded(self, spec: LoadSpec, *, failed: bool) -> None:
        pass

    async def hold(self, blocks: list[int], lease_s: float) -> None:
        """Hold a request of `blocks` for `lease_s`, then check the leases."""
        if self.handoff is None:  # made on the actor's event loop, where its tasks run
            self.handoff = Handoff(self.agent, self, lease_s=lease_s)
        self.handoff.prefill.lease_s = lease_s
        self.handoff.hold(SendSpec(f"request-{blocks[0]}", (tuple(blocks),)))
        self.handoff.expire()


def test_leases_expired_and_blocks_held_show_up(metrics_url: str) -> None:
    holder = LeaseHolder.remote("metrics-lease-p")
    ray.get(holder.hold.remote([1, 2, 3], 300.0))  # held: nobody asks
    ray.get(holder.hold.remote([4, 5], 0.0))  # its lease has ended by the check
    expected = {
        ("ray_kvray_leases_expired_total", (("engine", "metrics-lease-p"),)): 1.0,
        ("ray_kvray_blocks_held", (("engine", "metrics-lease-p"),)): 3.0,
    }
    assert _scrape_until(metrics_url, expected) == expected


def test_vllm_engine_figures_as_ray_serve_llm_exports_them(metrics_url: str) -> None:
    """What Ray Serve LLM's vLLM engines do with kvray's connector stats: vLLM's Ray stat logger
    (`RayKVConnectorProm`) builds kvray's metrics with Ray's metric wrappers, and Ray exports
    them as `ray_vllm_kvray_*`."""
    ray_wrappers = pytest.importorskip("vllm.v1.metrics.ray_wrappers")
    from vllm.config import KVTransferConfig

    from kvray.integrations.vllm.stats import take_stats
    from kvray.metrics import EngineMetrics, IntervalSink, NullSink, Outcome, PushCall

    transfer = KVTransferConfig(
        kv_connector="KvrayConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvray.integrations.vllm.connector",
    )
    engines: dict[int, list[object]] = {0: ["served-model", "0"]}
    prom = ray_wrappers.RayKVConnectorProm(
        types.SimpleNamespace(kv_transfer_config=transfer), ["model_name", "engine"], engines
    )
    figures = IntervalSink()
    metrics = EngineMetrics("serve-llm-p", "prefill", NullSink())
    metrics.tap(figures)
    for _ in range(3):
        metrics.transfer(PushCall.WHOLE, Outcome.OK, "shm", "d", 0.002)
        metrics.bytes_pushed("shm", "d", 4096)
    metrics.blocks_held(7)
    stats = take_stats(figures)
    assert stats is not None
    prom.observe(stats.to_dict(), 0)

    engine = (("model_name", "served-model"), ("engine", "0"))
    expected = {
        ("ray_vllm_kvray_transfers_total", (*engine, ("push", "whole"), ("outcome", "ok"))): 3.0,
        ("ray_vllm_kvray_bytes_pushed_total", engine): 3 * 4096.0,
        ("ray_vllm_kvray_transfer_seconds_count", (*engine, ("push", "whole"))): 3.0,
        ("ray_vllm_kvray_blocks_held", engine): 7.0,
    }
    assert _scrape_until(metrics_url, expected) == expected
