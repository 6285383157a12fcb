"""Metrics: what an agent and its block pool record about transfers, as Prometheus metrics.

Every metric kvray exports is defined here (`METRICS`, names prefixed `kvray_`). Agents record
through an `EngineMetrics` bound to their engine; the sink behind it writes to Ray's metrics API
(`ray.util.metrics`, exported by each node's metrics agent with a `ray_` prefix) when Ray is
initialised in this process, and does nothing otherwise (kvray without Ray, a GPU machine
without Ray). `MemorySink` keeps records in memory, for tests and for code that scrapes nothing.
"""

from __future__ import annotations

import enum
import logging
import sys
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class MetricKind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Outcome(enum.Enum):
    """How a push call (`push`, `push_layer`, `finish`) or a `wait_for_kv` ended."""

    OK = "ok"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    #: Refused at once: too many transfers already queued (`BackpressureError`).
    REJECTED = "rejected"
    CANCELLED = "cancelled"


class PushCall(enum.Enum):
    """Which push call a transfer metric describes."""

    WHOLE = "whole"
    LAYER = "layer"
    FINISH = "finish"


class DropReason(enum.Enum):
    """Why a decode engine dropped a message or refused a write addressed to it."""

    #: Names another engine or an old incarnation of this one.
    STALE = "stale"
    #: A completion for a request this engine does not expect (any more).
    UNKNOWN = "unknown"
    MALFORMED = "malformed"
    #: A write sent where a completion was expected.
    MISROUTED = "misrouted"
    #: A `ray`-transport write for a request this engine does not expect (any more).
    UNEXPECTED_WRITE = "unexpected_write"
    #: A write or notice without the token of the request's reservation.
    FORGED = "forged"


#: Tag value of a transport not chosen yet (the push failed before planning).
NO_TRANSPORT = "none"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: MetricKind
    description: str
    tag_keys: tuple[str, ...]
    #: Histogram bucket upper bounds.
    boundaries: tuple[float, ...] = ()


#: Seconds, from 100 µs to 60 s (the default transfer deadline).
_LATENCY_BOUNDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

BYTES_PUSHED = MetricSpec(
    "kvray_bytes_pushed",
    MetricKind.COUNTER,
    "Bytes a prefill engine wrote into decode engines' regions",
    ("engine", "transport", "peer"),
)
TRANSFERS = MetricSpec(
    "kvray_transfers",
    MetricKind.COUNTER,
    "Push calls ended, by call (whole, layer, finish) and outcome (ok, failed, timed_out, rejected, "
    "cancelled)",
    ("engine", "transport", "peer", "push", "outcome"),
)
TRANSFER_SECONDS = MetricSpec(
    "kvray_transfer_seconds",
    MetricKind.HISTOGRAM,
    "Seconds a successful push call took, waiting for a slot included (finish: the whole "
    "layer-wise request, from its first layer's call)",
    ("engine", "transport", "peer", "push"),
    _LATENCY_BOUNDS,
)
BYTES_RECEIVED = MetricSpec(
    "kvray_bytes_received",
    MetricKind.COUNTER,
    "Bytes of completed transfers into a decode engine, by the prefill engine that sent them",
    ("engine", "peer"),
)
WAITS = MetricSpec(
    "kvray_waits",
    MetricKind.COUNTER,
    "wait_for_kv calls ended, by outcome (ok, failed, timed_out, cancelled)",
    ("engine", "outcome"),
)
WAIT_SECONDS = MetricSpec(
    "kvray_wait_seconds",
    MetricKind.HISTOGRAM,
    "Seconds wait_for_kv waited for KV that arrived",
    ("engine",),
    _LATENCY_BOUNDS,
)
MESSAGES_DROPPED = MetricSpec(
    "kvray_messages_dropped",
    MetricKind.COUNTER,
    "Completions, failure notices and writes a decode engine dropped or refused, by reason "
    "(stale, unknown, malformed, misrouted, unexpected_write, forged)",
    ("engine", "reason"),
)
BLOCKS_IN_USE = MetricSpec(
    "kvray_blocks_in_use",
    MetricKind.GAUGE,
    "Blocks of a worker's pool held by requests",
    ("engine", "role"),
)
BLOCKS_TOTAL = MetricSpec(
    "kvray_blocks_total",
    MetricKind.GAUGE,
    "Blocks in a worker's pool",
    ("engine", "role"),
)

METRICS: tuple[MetricSpec, ...] = (
    BYTES_PUSHED,
    TRANSFERS,
    TRANSFER_SECONDS,
    BYTES_RECEIVED,
    WAITS,
    WAIT_SECONDS,
    MESSAGES_DROPPED,
    BLOCKS_IN_USE,
    BLOCKS_TOTAL,
)


class MetricsSink(Protocol):
    """Where records go: counters add `value`, gauges set it, histograms observe it."""

    def record(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None: ...


class RaySink:
    """`ray.util.metrics`, while Ray is initialised in this process; a no-op otherwise.

    Ray's metric objects are made on first use (importing Ray is not this module's to do). A
    failure inside Ray's API disables the sink with one warning: metrics never fail a transfer.
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {}
        self._broken = False

    @property
    def active(self) -> bool:
        ray = sys.modules.get("ray")
        return not self._broken and ray is not None and bool(ray.is_initialized())

    def record(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        if not self.active:
            return
        try:
            metric = self._metrics.get(spec.name) or self._create(spec)
            if spec.kind is MetricKind.COUNTER:
                if value > 0:  # Ray's counters refuse zero increments
                    metric.inc(value, dict(tags))
            elif spec.kind is MetricKind.GAUGE:
                metric.set(value, dict(tags))
            else:
                metric.observe(value, dict(tags))
        except Exception as error:
            self._broken = True
            logger.warning("kvray metrics are off in this process: Ray's metrics API failed: %r", error)

    def _create(self, spec: MetricSpec) -> Any:
        from ray.util import metrics

        metric: Any
        if spec.kind is MetricKind.COUNTER:
            metric = metrics.Counter(spec.name, spec.description, spec.tag_keys)
        elif spec.kind is MetricKind.GAUGE:
            metric = metrics.Gauge(spec.name, spec.description, spec.tag_keys)
        else:
            metric = metrics.Histogram(spec.name, spec.description, list(spec.boundaries), spec.tag_keys)
        self._metrics[spec.name] = metric
        return metric


class MemorySink:
    """Keeps every record in memory: counter totals, last gauge values, histogram observations."""

    def __init__(self) -> None:
        self.records: list[tuple[str, float, dict[str, str]]] = []
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self._observed: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = defaultdict(list)

    def record(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        missing = set(spec.tag_keys) - set(tags)
        extra = set(tags) - set(spec.tag_keys)
        if missing or extra:  # Ray's API refuses these too: fail here, in tests, not silently there
            raise ValueError(f"{spec.name}: missing tags {sorted(missing)}, unknown tags {sorted(extra)}")
        key = (spec.name, tuple(sorted(tags.items())))
        self.records.append((spec.name, value, dict(tags)))
        if spec.kind is MetricKind.COUNTER:
            self._values[key] += value
        elif spec.kind is MetricKind.GAUGE:
            self._values[key] = value
        else:
            self._observed[key].append(value)

    def value(self, name: str, **tags: str) -> float:
        """Counters: the sum over every tag set matching `tags`; gauges: the same over last values."""
        return sum(value for key, value in self._values.items() if _matches(key, name, tags))

    def observations(self, name: str, **tags: str) -> list[float]:
        """Histograms: every value observed under a tag set matching `tags`."""
        return [
            value for key, values in self._observed.items() if _matches(key, name, tags) for value in values
        ]


def _matches(key: tuple[str, tuple[tuple[str, str], ...]], name: str, tags: Mapping[str, str]) -> bool:
    metric, tag_items = key
    present = dict(tag_items)
    return metric == name and all(present.get(tag) == value for tag, value in tags.items())


#: The process's sink unless an agent is given another: Ray's, when Ray is up.
RAY_SINK = RaySink()


class EngineMetrics:
    """The records one engine makes, with its engine id and role filled in."""

    def __init__(self, engine_id: str, role: str, sink: MetricsSink | None = None) -> None:
        self.engine_id = engine_id
        self.role = role
        self.sink: MetricsSink = sink if sink is not None else RAY_SINK

    def bytes_pushed(self, transport: str, peer: str, nbytes: int) -> None:
        tags = {"engine": self.engine_id, "transport": transport, "peer": peer}
        self.sink.record(BYTES_PUSHED, nbytes, tags)

    def transfer(
        self, push: PushCall, outcome: Outcome, transport: str, peer: str, seconds: float | None = None
    ) -> None:
        """One push call ended; `seconds` is observed for successful calls."""
        tags = {"engine": self.engine_id, "transport": transport, "peer": peer, "push": push.value}
        self.sink.record(TRANSFERS, 1, {**tags, "outcome": outcome.value})
        if outcome is Outcome.OK and seconds is not None:
            self.sink.record(TRANSFER_SECONDS, seconds, tags)

    def bytes_received(self, peer: str, nbytes: int) -> None:
        self.sink.record(BYTES_RECEIVED, nbytes, {"engine": self.engine_id, "peer": peer})

    def wait(self, outcome: Outcome, seconds: float) -> None:
        """One `wait_for_kv` ended; its wait is observed when the KV arrived."""
        self.sink.record(WAITS, 1, {"engine": self.engine_id, "outcome": outcome.value})
        if outcome is Outcome.OK:
            self.sink.record(WAIT_SECONDS, seconds, {"engine": self.engine_id})

    def dropped(self, reason: DropReason) -> None:
        self.sink.record(MESSAGES_DROPPED, 1, {"engine": self.engine_id, "reason": reason.value})

    def blocks(self, in_use: int, total: int) -> None:
        tags = {"engine": self.engine_id, "role": self.role}
        self.sink.record(BLOCKS_IN_USE, in_use, tags)
        self.sink.record(BLOCKS_TOTAL, total, tags)
