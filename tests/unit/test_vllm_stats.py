"""kvray's figures through vLLM's connector stats interface (`kvray.integrations.vllm.stats`):
what a worker hands vLLM, how vLLM adds ranks and intervals up, the payload carried between its
processes and rebuilt, its log line, and the Prometheus metrics it moves (on a registry of the
test's own: no server)."""

from __future__ import annotations

import functools
import pickle
import types
from typing import Any, ClassVar

import msgspec
import pytest

pytest.importorskip("vllm", reason="the connector module needs vllm: pip install -e '.[vllm]'")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvray.errors import TransferTimeoutError
from kvray.integrations.vllm.connector import KvrayConnector
from kvray.integrations.vllm.stats import KvrayConnectorStats, KvrayPromMetrics, take_stats, vllm_name
from kvray.metrics import (
    BLOCKS_HELD,
    BYTES_PUSHED,
    BYTES_RECEIVED,
    LEASES_EXPIRED,
    OPERATOR_METRICS,
    TRANSFER_SECONDS,
    TRANSFERS,
    EngineMetrics,
    IntegrityCheck,
    IntervalSink,
    MetricKind,
    NullSink,
    Outcome,
    PushCall,
)

LABELS = ["model_name", "engine"]
ENGINES: dict[int, list[object]] = {0: ["m", "0"], 1: ["m", "1"]}


def recorder() -> tuple[EngineMetrics, IntervalSink]:
    """An engine's metrics with what a connector worker taps of them."""
    figures = IntervalSink()
    metrics = EngineMetrics("e", "prefill", NullSink())
    metrics.tap(figures)
    return metrics, figures


def carried(stats: KvrayConnectorStats) -> dict[str, Any]:
    """The payload as vLLM carries it: pickled from worker to engine core, msgpack to the front-end."""
    payload = pickle.loads(pickle.dumps(stats)).to_dict()
    decoded: dict[str, Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(payload))
    return decoded


def one_step() -> KvrayConnectorStats:
    """A prefill rank's step: two whole pushes, a layer push that timed out, 3 MiB, 2 blocks held."""
    metrics, figures = recorder()
    metrics.transfer(PushCall.WHOLE, Outcome.OK, "shm", "d", 0.010)
    metrics.transfer(PushCall.WHOLE, Outcome.OK, "ray", "d2", 0.030)
    metrics.transfer(PushCall.LAYER, Outcome.TIMED_OUT, "shm", "d", error=TransferTimeoutError("late"))
    metrics.bytes_pushed("shm", "d", 1 << 20)
    metrics.bytes_pushed("ray", "d2", 2 << 20)
    metrics.blocks_held(2)
    stats = take_stats(figures)
    assert stats is not None
    return stats


def test_a_worker_hands_over_what_was_recorded_since_it_last_did() -> None:
    metrics, figures = recorder()
    assert take_stats(figures) is None  # nothing recorded: no stats for vLLM to carry
    metrics.wait(Outcome.OK, 0.004)
    metrics.received("p", 4096)
    metrics.integrity("p", IntegrityCheck.MISMATCH, wrong_layers=2, seconds=0.001)
    stats = take_stats(figures)
    assert stats is not None and not stats.is_empty()
    assert stats.counter(BYTES_RECEIVED) == 4096
    assert stats.counter(TRANSFERS) == 0
    assert stats.reduce()["Integrity mismatches"] == 1
    assert stats.reduce()["Avg KV wait ms"] == 4.0
    assert take_stats(figures) is None  # handed over once


def test_stats_rebuild_from_the_payload_vllm_carries() -> None:
    stats = one_step()
    payload = carried(stats)
    rebuilt = KvrayConnector.build_kv_connector_stats(payload)
    assert isinstance(rebuilt, KvrayConnectorStats)
    assert rebuilt.data == stats.data
    rebuilt.aggregate(one_step())
    assert rebuilt.counter(BYTES_PUSHED) == 6 << 20
    assert carried(stats) == payload  # rebuilt from a copy: aggregating it changed nothing
    assert KvrayConnector.build_kv_connector_stats(None).is_empty()
    assert KvrayConnector.build_kv_connector_stats({}).is_empty()


def test_aggregate_adds_counters_joins_observations_and_keeps_the_higher_level() -> None:
    first, second = one_step(), one_step()
    metrics, figures = recorder()
    metrics.blocks_held(5)
    metrics.lease_expired()
    third = take_stats(figures)
    assert third is not None
    total = first.aggregate(second).aggregate(third)
    assert total is first
    assert total.counter(TRANSFERS, push="whole", outcome="ok") == 4
    assert total.counter(TRANSFERS, outcome="timed_out") == 2
    assert total.counter(BYTES_PUSHED) == 6 << 20
    assert total.counter(LEASES_EXPIRED) == 1
    assert sorted(total.observed(TRANSFER_SECONDS)) == [0.01, 0.01, 0.03, 0.03]
    assert total.data["gauges"][BLOCKS_HELD.name] == {"": 5}
    line = total.reduce()
    assert line["Requests pushed"] == 4 and line["Push calls failed"] == 2 and line["Failures"] == 2
    assert line["MB pushed"] == 6.0 and line["Leases expired"] == 1 and line["Blocks held (max)"] == 5
    assert line["Avg push ms"] == 20.0 and line["P90 push ms"] == 30.0
    total.reset()
    assert total.is_empty() and total.reduce()["Requests pushed"] == 0


def test_vllms_log_line_reads_the_kvray_figures() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    config = KVTransferConfig(
        kv_connector="KvrayConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvray.integrations.vllm.connector",
    )
    logging = KVConnectorLogging(config)
    logging.observe(carried(one_step()))
    logging.observe(carried(one_step()))
    lines: list[str] = []
    logging.log(lambda message, *args: lines.append(message % args))
    assert len(lines) == 1
    assert "Requests pushed=4" in lines[0] and "MB pushed=6.0" in lines[0] and "Failures=2" in lines[0]


def prom_metrics(registry: CollectorRegistry) -> KvrayPromMetrics:
    """kvray's metrics as vLLM's front-end builds them, on `registry`."""
    types_ = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = types.SimpleNamespace(kv_transfer_config=None)
    built = KvrayConnector.build_prom_metrics(config, types_, LABELS, ENGINES)
    assert isinstance(built, KvrayPromMetrics)
    return built


def test_prometheus_metrics_move_per_engine() -> None:
    registry = CollectorRegistry()
    prom = prom_metrics(registry)
    engine1 = {"model_name": "m", "engine": "1"}
    assert registry.get_sample_value("vllm:kvray_bytes_pushed_total", engine1) == 0  # absent is not zero
    prom.observe(carried(one_step()), engine_idx=1)
    prom.observe(carried(one_step()), engine_idx=1)
    ok = {**engine1, "push": "whole", "outcome": "ok"}
    assert registry.get_sample_value("vllm:kvray_transfers_total", ok) == 4
    timed_out = {**engine1, "push": "layer", "outcome": "timed_out"}
    assert registry.get_sample_value("vllm:kvray_transfers_total", timed_out) == 2
    failures = {**engine1, "call": "layer", "cause": "TransferTimeoutError"}
    assert registry.get_sample_value("vllm:kvray_failures_total", failures) == 2
    assert registry.get_sample_value("vllm:kvray_bytes_pushed_total", engine1) == 6 << 20
    seconds = {**engine1, "push": "whole"}
    assert registry.get_sample_value("vllm:kvray_transfer_seconds_count", seconds) == 4
    assert registry.get_sample_value("vllm:kvray_transfer_seconds_sum", seconds) == pytest.approx(0.08)
    assert registry.get_sample_value("vllm:kvray_transfer_seconds_bucket", {**seconds, "le": "0.01"}) == 2
    assert registry.get_sample_value("vllm:kvray_blocks_held", engine1) == 2
    # The other engine's figures stay where they were.
    assert registry.get_sample_value("vllm:kvray_bytes_pushed_total", {"model_name": "m", "engine": "0"}) == 0


def test_every_operator_metric_is_on_vllms_metrics_with_its_kind_tags() -> None:
    registry = CollectorRegistry()
    prom_metrics(registry)
    kinds = {MetricKind.COUNTER: "counter", MetricKind.GAUGE: "gauge", MetricKind.HISTOGRAM: "histogram"}
    families = {family.name: family.type for family in registry.collect()}
    for spec in OPERATOR_METRICS:
        assert families.get(vllm_name(spec)) == kinds[spec.kind], spec.name


def test_metrics_and_payloads_kvray_does_not_know_are_left_out() -> None:
    registry = CollectorRegistry()
    prom = prom_metrics(registry)
    payload = carried(one_step())
    payload["counters"]["kvray_from_a_later_version"] = {"": 1}
    prom.observe(payload, engine_idx=0)
    assert (
        registry.get_sample_value("vllm:kvray_bytes_pushed_total", {"model_name": "m", "engine": "0"})
        == 3 << 20
    )


class _OnceLabelled:
    """A metric as Ray's wrappers behave (`vllm.v1.metrics.ray_wrappers`): `labels` once, on the
    unlabelled metric only."""

    made: ClassVar[list[_OnceLabelled]] = []

    def __init__(self, name: str, documentation: str, labelnames: list[str], **options: Any) -> None:
        self.labelnames = labelnames
        self.labelled: list[tuple[object, ...]] = []
        self.is_child = False
        self.calls: list[tuple[str, float]] = []
        _OnceLabelled.made.append(self)

    def labels(self, *values: object) -> _OnceLabelled:
        if self.is_child:
            raise ValueError("labels() cannot be called on an already-labeled metric.")
        assert len(values) == len(self.labelnames)
        self.labelled.append(values)
        child = _OnceLabelled.__new__(_OnceLabelled)
        child.labelnames, child.labelled, child.is_child, child.calls = self.labelnames, [], True, self.calls
        return child

    def inc(self, value: float = 1.0) -> None:
        self.calls.append(("inc", value))

    def set(self, value: float) -> None:
        self.calls.append(("set", value))

    def observe(self, value: float) -> None:
        self.calls.append(("observe", value))


def test_each_labelled_child_is_made_once_as_rays_wrappers_require() -> None:
    _OnceLabelled.made = []
    types_ = {kind: _OnceLabelled for kind in (Counter, Gauge, Histogram)}
    prom = KvrayPromMetrics(types.SimpleNamespace(kv_transfer_config=None), types_, LABELS, ENGINES)
    for _ in range(3):
        prom.observe(carried(one_step()), engine_idx=0)
    for metric in _OnceLabelled.made:
        assert len(metric.labelled) == len(set(metric.labelled)), metric.labelled
    transfers = prom.metrics[TRANSFERS.name]
    assert ("m", "0", "whole", "ok") in transfers.labelled
    assert sum(value for _, value in transfers.calls) == 9  # three steps of three push calls
