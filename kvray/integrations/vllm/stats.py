"""kvray's figures on vLLM's own metrics, through vLLM's connector stats interface
(`vllm/distributed/kv_transfer/kv_connector/v1/metrics.py`):

    worker     `KvrayConnector.get_kv_connector_stats`: what the agent recorded of
               `kvray.metrics.OPERATOR_METRICS` since the last call (`ConnectorWorker.figures`)
               as `KvrayConnectorStats`, or None when nothing was
    engine     vLLM adds up its workers' stats of a step (`aggregate`) and sends `to_dict()` on
    front-end  `build_kv_connector_stats` rebuilds them, summed over the log interval into one
               log line (`reduce`); `KvrayPromMetrics` (`build_prom_metrics`) moves `vllm:kvray_*`
               on /metrics with vLLM's labels (model_name, engine) and the metric's kind tags.
               Ray Serve LLM's engines log through Ray's metrics API instead: the same metrics,
               exported as `ray_vllm_kvray_*` with a ReplicaId tag.

The payload is plain data, for vLLM to pickle and msgpack: `{"counters": {metric: {key: sum}},
"observations": {metric: {key: [value, ...]}}, "gauges": {metric: {key: level}}}`, by kvray
metric name, where a key is the values of the metric's kind tags joined by `KEY_SEPARATOR`
("whole|ok"; "" for a metric without kind tags). Kind tags' values are enum values and error
class names: none holds the separator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvray.metrics import (
    BLOCKS_HELD,
    BYTES_PUSHED,
    BYTES_RECEIVED,
    FAILURES,
    INTEGRITY_CHECKS,
    LEASES_EXPIRED,
    OPERATOR_METRICS,
    TRANSFER_SECONDS,
    TRANSFERS,
    WAIT_SECONDS,
    Figures,
    IntegrityCheck,
    IntervalSink,
    MetricKind,
    MetricSpec,
    Outcome,
    PushCall,
    kind_tags,
)

COUNTERS = "counters"
OBSERVATIONS = "observations"
GAUGES = "gauges"
KEY_SEPARATOR = "|"


def vllm_name(spec: MetricSpec) -> str:
    """A kvray metric's name on vLLM's /metrics (vLLM's prefix; a counter gains `_total` there)."""
    return f"vllm:{spec.name}"


def _key(values: tuple[str, ...]) -> str:
    return KEY_SEPARATOR.join(values)


def _values(key: str, spec: MetricSpec) -> tuple[str, ...]:
    """The kind tags' values a payload key holds (`_key` undone)."""
    return tuple(key.split(KEY_SEPARATOR)) if kind_tags(spec) else ()


@dataclass
class KvrayConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """kvray's figures over an interval (a step of one worker, a step of every worker, or a log
    interval), in vLLM's container; `data` is the payload of the module docstring."""

    #: By part (counters, observations, gauges), metric name and key.
    data: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {COUNTERS: {}, OBSERVATIONS: {}, GAUGES: {}}

    @classmethod
    def of(cls, figures: Figures) -> KvrayConnectorStats:
        return cls(
            data={
                COUNTERS: {
                    name: {_key(values): total for values, total in sums.items()}
                    for name, sums in figures.counters.items()
                },
                OBSERVATIONS: {
                    name: {_key(values): list(observed) for values, observed in lists.items()}
                    for name, lists in figures.observations.items()
                },
                GAUGES: {
                    name: {_key(values): level for values, level in levels.items()}
                    for name, levels in figures.gauges.items()
                },
            }
        )

    @classmethod
    def build(cls, data: Mapping[str, Any] | None) -> KvrayConnectorStats:
        """Stats from a payload (`to_dict()`, after vLLM carried it), as a copy: aggregating
        the rebuilt stats never changes the payload it came from."""
        stats = cls()
        stats._add(data or {})
        return stats

    def aggregate(self, other: KVConnectorStats) -> KvrayConnectorStats:
        self._add(other.data)
        return self

    def _add(self, data: Mapping[str, Any]) -> None:
        """Counters add, observations join, and a gauge keeps the higher level: vLLM aggregates
        the tensor-parallel ranks of one step, which hold the same blocks (one level, not one per
        rank), and the steps of a log interval, whose highest level is the one worth a line."""
        for name, sums in data.get(COUNTERS, {}).items():
            totals = self.data[COUNTERS].setdefault(name, {})
            for key, total in sums.items():
                totals[key] = totals.get(key, 0) + total
        for name, lists in data.get(OBSERVATIONS, {}).items():
            observed = self.data[OBSERVATIONS].setdefault(name, {})
            for key, values in lists.items():
                observed.setdefault(key, []).extend(values)
        for name, levels in data.get(GAUGES, {}).items():
            highest = self.data[GAUGES].setdefault(name, {})
            for key, level in levels.items():
                highest[key] = max(highest.get(key, level), level)

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in (COUNTERS, OBSERVATIONS, GAUGES))

    def counter(self, spec: MetricSpec, **kinds: str) -> float:
        """`spec`'s sum over every key whose kind tags match `kinds`."""
        totals = self.data[COUNTERS].get(spec.name, {})
        return float(sum(total for key, total in totals.items() if _matches(spec, key, kinds)))

    def observed(self, spec: MetricSpec, **kinds: str) -> list[float]:
        """`spec`'s observations under every key whose kind tags match `kinds`."""
        lists = self.data[OBSERVATIONS].get(spec.name, {})
        return [value for key, values in lists.items() if _matches(spec, key, kinds) for value in values]

    def reduce(self) -> dict[str, int | float]:
        """The interval as vLLM's log line "KV Transfer metrics: ..." shows it."""
        ok = Outcome.OK.value
        whole, finish = PushCall.WHOLE.value, PushCall.FINISH.value
        # A layer-wise request's `finish` spans its layers: with whole pushes, the requests pushed.
        pushed = self.counter(TRANSFERS, push=whole, outcome=ok) + self.counter(
            TRANSFERS, push=finish, outcome=ok
        )
        failed = self.counter(TRANSFERS, outcome=Outcome.FAILED.value) + self.counter(
            TRANSFERS, outcome=Outcome.TIMED_OUT.value
        )
        push_s = self.observed(TRANSFER_SECONDS, push=whole) + self.observed(TRANSFER_SECONDS, push=finish)
        wait_s = self.observed(WAIT_SECONDS)
        figures: dict[str, int | float] = {
            "Requests pushed": int(pushed),
            "Push calls failed": int(failed),
            "MB pushed": round(self.counter(BYTES_PUSHED) / 2**20, 3),
            "MB received": round(self.counter(BYTES_RECEIVED) / 2**20, 3),
            "Avg push ms": _milliseconds(_mean(push_s)),
            "P90 push ms": _milliseconds(_percentile(push_s, 0.9)),
            "Avg KV wait ms": _milliseconds(_mean(wait_s)),
            "P90 KV wait ms": _milliseconds(_percentile(wait_s, 0.9)),
            "Failures": int(self.counter(FAILURES)),
            "Integrity mismatches": int(self.counter(INTEGRITY_CHECKS, result=IntegrityCheck.MISMATCH.value)),
            "Leases expired": int(self.counter(LEASES_EXPIRED)),
        }
        held = self.data[GAUGES].get(BLOCKS_HELD.name, {})
        if held:
            figures["Blocks held (max)"] = int(max(held.values()))
        return figures


def _matches(spec: MetricSpec, key: str, kinds: Mapping[str, str]) -> bool:
    present = dict(zip(kind_tags(spec), _values(key, spec), strict=True))
    return all(present.get(tag) == value for tag, value in kinds.items())


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(math.ceil(fraction * len(ordered)), 1)
    return ordered[rank - 1]


def _milliseconds(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def take_stats(figures: IntervalSink) -> KvrayConnectorStats | None:
    """A worker's stats since the last call: None when nothing was recorded, so a step without
    news carries no stats (vLLM sends a worker's connector output on only when it holds any)."""
    taken = figures.take()
    return None if taken.empty else KvrayConnectorStats.of(taken)


class KvrayPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """`OPERATOR_METRICS` as vLLM's Prometheus metrics (`vllm_name`), made with the metric classes
    vLLM hands over (prometheus_client's, or Ray's under Ray Serve LLM), labelled with vLLM's
    label names and then the metric's kind tags. Each labelled child is made once: Ray's wrappers
    label a metric only once."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics: dict[str, Any] = {}
        self._specs = {spec.name: spec for spec in OPERATOR_METRICS}
        self._children: dict[tuple[str, int, tuple[str, ...]], Any] = {}
        for spec in OPERATOR_METRICS:
            names = [*labelnames, *kind_tags(spec)]
            name, documentation = vllm_name(spec), f"kvray: {spec.description}"
            if spec.kind is MetricKind.COUNTER:
                metric = self._counter_cls(name=name, documentation=documentation, labelnames=names)
            elif spec.kind is MetricKind.GAUGE:
                metric = self._gauge_cls(
                    name=name, documentation=documentation, labelnames=names, multiprocess_mode="mostrecent"
                )
            else:
                metric = self._histogram_cls(
                    name=name, documentation=documentation, labelnames=names, buckets=list(spec.boundaries)
                )
            self.metrics[spec.name] = metric
        # Metrics without kind tags show 0 for every engine from the start: absent is not zero.
        for engine in per_engine_labelvalues:
            for spec in OPERATOR_METRICS:
                if not kind_tags(spec):
                    self._child(spec.name, engine, ())

    def _child(self, name: str, engine: int, values: tuple[str, ...]) -> Any:
        key = (name, engine, values)
        child = self._children.get(key)
        if child is None:
            labels = [*self.per_engine_labelvalues[engine], *values]
            child = self._children[key] = self.metrics[name].labels(*labels)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """One step's stats of engine `engine_idx` (a payload); metrics this kvray does not know
        (another version's) are left out."""
        for part in (COUNTERS, OBSERVATIONS, GAUGES):
            for name, by_key in transfer_stats_data.get(part, {}).items():
                spec = self._specs.get(name)
                if spec is None:
                    continue
                for key, value in by_key.items():
                    child = self._child(name, engine_idx, _values(key, spec))
                    if part == COUNTERS:
                        if value > 0:
                            child.inc(value)
                    elif part == GAUGES:
                        child.set(value)
                    else:
                        for observed in value:
                            child.observe(observed)
