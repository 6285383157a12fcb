"""Metrics: every count and measure an agent keeps about its transfers, in one system.

Every metric kvray records is defined here (`METRICS`, names prefixed `kvray_`), and every
event is recorded once, through the `EngineMetrics` of the engine it happened to. That one
record feeds both views:
- `EngineMetrics.counts` (what `KVAgent.stats` returns): each counter's running total in this
  process, under the metric's name without `kvray_` and with its kind tags' values appended
  (`kvray_transfers{push="whole", outcome="ok"}` is `transfers_whole_ok`); the engine, peer,
  transport and role tags are summed over;
- the sink: Ray's metrics API (`ray.util.metrics`, exported by each node's metrics agent with a
  `ray_` prefix) while Ray is initialised in this process, nothing otherwise; `MemorySink`
  keeps every record in memory, for tests and for code that scrapes nothing;
- taps (`EngineMetrics.tap`): sinks that see each record as it is made, beside the sink; an
  `IntervalSink` keeps those of `OPERATOR_METRICS` until a reader on another thread takes
  them (vLLM's connector stats, `kvray.integrations.vllm.stats`).

Records for Ray's sink are batched: made on an event loop, they reach Ray within `FLUSH_S`
(one call per counter and tag set, however many events), so a transfer's hot path pays a
dictionary update and a list append, not a call into Ray's API per event.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import sys
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvray.errors import KvrayError

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


class FailureNotice(enum.Enum):
    """What became of a `TransferFailed` a prefill engine owed a decode engine."""

    SENT = "sent"
    #: Not delivered (the peer did not answer in time, or is gone).
    LOST = "lost"
    #: Not sent: the decode engine restarted, nobody waits for it any more.
    STALE = "stale"


class NoticeSend(enum.Enum):
    """How a writer's notice left: after its write (`send`), or sent with it at once (`send_now`)."""

    AFTER_WRITE = "after_write"
    AT_ONCE = "at_once"


class ConnectionEvent(enum.Enum):
    """What happened to a notice connection (a writer's, or one a decode engine's listener took)."""

    #: A writer opened a connection to a listener.
    OPENED = "opened"
    #: The listener had as many proven connections as it keeps and refused one more.
    REFUSED = "refused"
    #: A writer did not read its verdicts; the listener stopped reading it.
    STALLED = "stalled"
    #: Closed by the listener: a newcomer took the place of this oldest unproven connection...
    CLOSED_EVICTED = "closed_evicted"
    #: ...it did not prove the key within the handshake's bound...
    CLOSED_SLOW = "closed_slow"
    #: ...its proof of the key was wrong...
    CLOSED_UNPROVEN = "closed_unproven"
    #: ...it sent a frame over the size limit...
    CLOSED_OVERSIZED = "closed_oversized"
    #: ...or a notice whose tag the session key does not match.
    CLOSED_FORGED = "closed_forged"


class ListenerRefusal(enum.Enum):
    """Why a writer gave up on a peer's notice listener (and notifies it another way)."""

    UNREACHABLE = "unreachable"
    #: What the peer published is not an address and a key.
    MALFORMED = "malformed"


class DirectoryEvent(enum.Enum):
    """What an engine's directory saw of the coordinator and its peers."""

    #: The coordinator no longer knew this engine (it restarted): registered again.
    REREGISTERED = "reregistered"
    HEARTBEAT_FAILED = "heartbeat_failed"
    #: The coordinator actor died: its successor was found or created by name.
    COORDINATOR_REPLACED = "coordinator_replaced"
    #: A cached peer closed, died or restarted: forgotten with its mappings and connections.
    PEER_DEPARTED = "peer_departed"


class IntegrityCheck(enum.Enum):
    """What a decode engine's check of a transfer's checksums found (`kvray.integrity`)."""

    #: Every layer's bytes as landed hash to what the writer read.
    OK = "ok"
    #: At least one layer differs: the request is failed, never decoded.
    MISMATCH = "mismatch"
    #: Not checked: the writer sent no checksums (integrity off or not sampled there).
    UNCHECKED = "unchecked"


class RdmaReceive(enum.Enum):
    """What a decode engine's RDMA completion poller made of one receive completion."""

    #: A WRITE WITH IMMEDIATE that proves a transfer's bytes arrived.
    MATCHED = "matched"
    #: An immediate naming no transfer this engine expects.
    UNKNOWN = "unknown"
    #: An immediate on a connection this engine no longer holds.
    UNKNOWN_CONNECTION = "unknown_connection"
    UNEXPECTED_OPCODE = "unexpected_opcode"
    #: A receive flushed by an error or a closing queue pair.
    FLUSHED = "flushed"


#: Tag value of a transport not chosen yet (the push failed before planning).
NO_TRANSPORT = "none"

#: `kvray_failures`' call tag of a failed `wait_for_kv` (push calls go by their `PushCall`).
WAIT_CALL = "wait"
#: `kvray_failures`' cause tag of a failure that is not a kvray error.
OTHER_CAUSE = "other"


def failure_cause(error: BaseException | None) -> str:
    """A failure's cause as a tag value: the kvray error's class name (a set as small as kvray's
    error tree, so the tag's values stay bounded), `OTHER_CAUSE` for anything else."""
    return type(error).__name__ if isinstance(error, KvrayError) else OTHER_CAUSE


@dataclass(frozen=True, eq=False)  # one object per metric: hashed by identity, cheaply
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

COMPLETIONS = MetricSpec(
    "kvray_completions",
    MetricKind.COUNTER,
    "Transfers a decode engine took as done (ok) or as failed by their writer (failed)",
    ("engine", "outcome"),
)
LANE_ASKS = MetricSpec(
    "kvray_lane_asks",
    MetricKind.COUNTER,
    "Loads a decode engine asked through prefill engines' native lanes, by the lane's answer "
    "(done, usual_way, refused, ...; none: the lane ended or the ask's deadline passed first)",
    ("engine", "answer"),
)
LAYERWISE_PARTIAL = MetricSpec(
    "kvray_layerwise_partial",
    MetricKind.COUNTER,
    "Layer-wise pushes a prefill engine finished without pushing every layer",
    ("engine",),
)
FAILURE_NOTICES = MetricSpec(
    "kvray_failure_notices",
    MetricKind.COUNTER,
    "Failure notices a prefill engine owed decode engines, by what became of them (sent, lost, stale)",
    ("engine", "outcome"),
)
CLAIMS_REFUSED = MetricSpec(
    "kvray_claims_refused",
    MetricKind.COUNTER,
    "Write claims a decode engine refused (the request was not expected, or released)",
    ("engine",),
)
RELEASES_QUARANTINED = MetricSpec(
    "kvray_releases_quarantined",
    MetricKind.COUNTER,
    "Released requests whose blocks a decode engine kept back because a claimed write may still land",
    ("engine",),
)
NOTICES_SENT = MetricSpec(
    "kvray_notices_sent",
    MetricKind.COUNTER,
    "Completion notices a writer sent, by channel and how (after_write, at_once)",
    ("engine", "channel", "mode"),
)
NOTICES_RECEIVED = MetricSpec(
    "kvray_notices_received",
    MetricKind.COUNTER,
    "Completion notices a decode engine's listener read, by channel",
    ("engine", "channel"),
)
NOTICE_CONNECTIONS = MetricSpec(
    "kvray_notice_connections",
    MetricKind.COUNTER,
    "Notice connections opened, refused, stalled and closed (evicted, unproven, oversized, forged)",
    ("engine", "event"),
)
NOTICE_LISTENERS_REFUSED = MetricSpec(
    "kvray_notice_listeners_refused",
    MetricKind.COUNTER,
    "Peers' notice listeners a writer gave up on (unreachable, malformed)",
    ("engine", "reason"),
)
DIRECTORY_EVENTS = MetricSpec(
    "kvray_directory_events",
    MetricKind.COUNTER,
    "Re-registrations, failed heartbeats, replaced coordinators and departed peers",
    ("engine", "event"),
)
RDMA_WRITES = MetricSpec(
    "kvray_rdma_writes",
    MetricKind.COUNTER,
    "RDMA writes a prefill engine posted (one per transfer or layer)",
    ("engine",),
)
RDMA_WORK_REQUESTS = MetricSpec(
    "kvray_rdma_work_requests",
    MetricKind.COUNTER,
    "RDMA work requests a prefill engine posted",
    ("engine",),
)
RDMA_SEND_ERRORS = MetricSpec(
    "kvray_rdma_send_errors",
    MetricKind.COUNTER,
    "RDMA send completions that reported an error",
    ("engine",),
)
RDMA_CONNECTIONS_ACCEPTED = MetricSpec(
    "kvray_rdma_connections_accepted",
    MetricKind.COUNTER,
    "RDMA queue pairs a decode engine accepted from writers",
    ("engine",),
)
RDMA_RECEIVES = MetricSpec(
    "kvray_rdma_receives",
    MetricKind.COUNTER,
    "Receive completions a decode engine polled, by what they were (matched, unknown, "
    "unknown_connection, unexpected_opcode, flushed)",
    ("engine", "outcome"),
)

INTEGRITY_CHECKS = MetricSpec(
    "kvray_integrity_checks",
    MetricKind.COUNTER,
    "Transfers a decode engine checked against the writer's checksums, by result (ok, mismatch, unchecked)",
    ("engine", "peer", "result"),
)
INTEGRITY_MISMATCHED_LAYERS = MetricSpec(
    "kvray_integrity_mismatched_layers",
    MetricKind.COUNTER,
    "Layers whose bytes as landed differed from what the writer read (each a wrong layer of a "
    "failed request)",
    ("engine", "peer"),
)
FAILURES = MetricSpec(
    "kvray_failures",
    MetricKind.COUNTER,
    "Push calls (whole, layer, finish) and waits for KV (wait) that failed or timed out, by cause: "
    "the kvray error's class (TransferTimeoutError, StaleIncarnationError, WriteFailedError, ...; "
    "other: not a kvray error)",
    ("engine", "call", "cause"),
)
BLOCKS_HELD = MetricSpec(
    "kvray_blocks_held",
    MetricKind.GAUGE,
    "Blocks a prefill engine holds for decode engines: finished requests, from their hold until "
    "their push or their lease ends",
    ("engine",),
)
LEASES_EXPIRED = MetricSpec(
    "kvray_leases_expired",
    MetricKind.COUNTER,
    "Requests a prefill engine held for a decode engine that did not ask within the lease "
    "(lease_s): their blocks went back unpushed",
    ("engine",),
)
INTEGRITY_SECONDS = MetricSpec(
    "kvray_integrity_seconds",
    MetricKind.HISTOGRAM,
    "Seconds a decode engine spent hashing one transfer's landed bytes",
    ("engine",),
    _LATENCY_BOUNDS,
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
    COMPLETIONS,
    LANE_ASKS,
    LAYERWISE_PARTIAL,
    FAILURE_NOTICES,
    CLAIMS_REFUSED,
    RELEASES_QUARANTINED,
    NOTICES_SENT,
    NOTICES_RECEIVED,
    NOTICE_CONNECTIONS,
    NOTICE_LISTENERS_REFUSED,
    DIRECTORY_EVENTS,
    RDMA_WRITES,
    RDMA_WORK_REQUESTS,
    RDMA_SEND_ERRORS,
    RDMA_CONNECTIONS_ACCEPTED,
    RDMA_RECEIVES,
    INTEGRITY_CHECKS,
    INTEGRITY_MISMATCHED_LAYERS,
    INTEGRITY_SECONDS,
    FAILURES,
    BLOCKS_HELD,
    LEASES_EXPIRED,
)

#: What an operator of P/D serving watches first: what vLLM's connector stats carry to its
#: /metrics (`kvray.integrations.vllm.stats`) and docs/grafana/kvray.json charts.
OPERATOR_METRICS: tuple[MetricSpec, ...] = (
    TRANSFERS,
    BYTES_PUSHED,
    BYTES_RECEIVED,
    TRANSFER_SECONDS,
    WAITS,
    WAIT_SECONDS,
    FAILURES,
    INTEGRITY_CHECKS,
    INTEGRITY_MISMATCHED_LAYERS,
    INTEGRITY_SECONDS,
    BLOCKS_HELD,
    LEASES_EXPIRED,
    LANE_ASKS,
)

#: Outcomes `kvray_failures` counts: rejected calls (backpressure, retried) and cancelled ones
#: (their caller's choice) have their outcome counts alone.
_FAILED = frozenset({Outcome.FAILED, Outcome.TIMED_OUT})

#: Tags that say whose a record is, not what kind: `counts` sums over them.
IDENTITY_TAGS = frozenset({"engine", "role", "peer", "transport"})


def kind_tags(spec: MetricSpec) -> tuple[str, ...]:
    """The tags of `spec` that say what kind of event a record is (not whose), in order."""
    return tuple(key for key in spec.tag_keys if key not in IDENTITY_TAGS)


def count_key(spec: MetricSpec, tags: Mapping[str, str]) -> str:
    """A counter record's name in `EngineMetrics.counts`: the metric without `kvray_`, then the
    value of each kind tag in order (`kvray_transfers{push=whole,outcome=ok}`: `transfers_whole_ok`)."""
    kinds = [tags[key] for key in kind_tags(spec)]
    return "_".join([spec.name.removeprefix("kvray_"), *kinds])


class MetricsSink(Protocol):
    """Where records go: counters add `value`, gauges set it, histograms observe it.

    `batched`: the sink would rather have records in batches (`EngineMetrics` then sums a
    counter's records per tag set and hands them on within `FLUSH_S`); otherwise each record
    reaches it as it is made."""

    batched: bool

    def record(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None: ...


#: Seconds a record may wait before `EngineMetrics` hands it to a batched sink.
FLUSH_S = 1.0


class RaySink:
    """`ray.util.metrics`, while Ray is initialised in this process; a no-op otherwise.

    Batched: each call into Ray's API costs more than a transfer's other bookkeeping, so
    records reach it summed, within a second. Ray's metric objects are made on first use
    (importing Ray is not this module's to do). A failure inside Ray's API disables the sink
    with one warning: metrics never fail a transfer.
    """

    batched = True

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

    batched = False

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


@dataclass
class Figures:
    """The records an `IntervalSink` kept over an interval, by metric name, then by the values of
    the metric's kind tags (`kind_tags`; identity tags are summed over, as in `counts`)."""

    #: Counters' sums.
    counters: dict[str, dict[tuple[str, ...], float]] = field(default_factory=dict)
    #: Histograms' observations, in the order they were made.
    observations: dict[str, dict[tuple[str, ...], list[float]]] = field(default_factory=dict)
    #: Gauges' latest values.
    gauges: dict[str, dict[tuple[str, ...], float]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.counters or self.observations or self.gauges)


#: Records an `IntervalSink` keeps untaken: a step of a large batch of layer-wise requests makes
#: three per layer pushed (100 requests of 61 layers: ~18k); past this, nobody is reading.
MAX_INTERVAL_RECORDS = 1 << 17


class IntervalSink:
    """Keeps the records of `specs` until a reader takes them, summed by interval (`take`), for a
    view that reads figures by interval, as vLLM's connector stats do. Records come on the agent's
    loop and the reader takes them on another thread (vLLM's): a record is one append to a deque
    (thread-safe without a lock: the transfer's path pays that alone), and the reader sums
    them.
    Past `max_records` untaken records (a worker driven without a reader) the oldest are dropped."""

    batched = False

    def __init__(
        self, specs: Iterable[MetricSpec] = OPERATOR_METRICS, max_records: int = MAX_INTERVAL_RECORDS
    ) -> None:
        self._kinds = {spec: kind_tags(spec) for spec in specs}
        self._records: deque[tuple[MetricSpec, float, Mapping[str, str]]] = deque(maxlen=max_records)
        #: Each gauge's value as last taken (`take` hands on changes only).
        self._taken_gauges: dict[tuple[str, tuple[str, ...]], float] = {}

    def record(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        if spec in self._kinds:
            self._records.append((spec, value, tags))

    def take(self) -> Figures:
        """The records since the last call (one reader calls this): counters summed and histogram
        observations listed, by kind tags; gauges only where their value changed since they were
        last taken (a gauge set to the same level again is not news, and an interval without news
        is empty)."""
        figures = Figures()
        records = self._records
        while records:  # the only reader: what it saw there is there to take
            spec, value, tags = records.popleft()
            key = tuple(tags[tag] for tag in self._kinds[spec])
            if spec.kind is MetricKind.COUNTER:
                sums = figures.counters.setdefault(spec.name, {})
                sums[key] = sums.get(key, 0.0) + value
            elif spec.kind is MetricKind.GAUGE:
                figures.gauges.setdefault(spec.name, {})[key] = value
            else:
                figures.observations.setdefault(spec.name, {}).setdefault(key, []).append(value)
        changed: dict[str, dict[tuple[str, ...], float]] = {}
        for name, levels in figures.gauges.items():
            for key, value in levels.items():
                if self._taken_gauges.get((name, key)) != value:
                    self._taken_gauges[(name, key)] = value
                    changed.setdefault(name, {})[key] = value
        figures.gauges = changed
        return figures


#: The process's sink unless an agent is given another: Ray's, when Ray is up.
RAY_SINK = RaySink()


#: Tag sets an `EngineMetrics` keeps made; past this (peers come and go) it starts again.
_MAX_KNOWN_TAG_SETS = 4096


class NullSink:
    """Drops every record (parts used on their own, outside any agent, e.g. in tests)."""

    batched = False  # each record is dropped as it comes: nothing to batch or schedule

    def record(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        pass


class EngineMetrics:
    """The records one engine makes, with its engine id and role filled in: each event once,
    into `counts` and the sink (see the module docstring)."""

    def __init__(self, engine_id: str, role: str, sink: MetricsSink | None = None) -> None:
        self.engine_id = engine_id
        self.role = role
        self.sink: MetricsSink = sink if sink is not None else RAY_SINK
        self._batched = bool(getattr(self.sink, "batched", False))
        #: Records for a batched sink, not handed on yet (a list: appending needs no lock).
        self._pending: list[tuple[MetricSpec, float, Mapping[str, str]]] = []
        self._scheduled = False
        self._counts: Counter[str] = Counter()
        #: (metric, tag values) -> its count key and tags, made once per tag set.
        self._known: dict[tuple[MetricSpec, tuple[str, ...]], tuple[str, dict[str, str]]] = {}
        #: Sinks handed each record as it is made, beside `sink` (`tap`).
        self._taps: tuple[MetricsSink, ...] = ()

    @classmethod
    def detached(cls) -> EngineMetrics:
        """Metrics for a part used outside an agent: counted here, recorded nowhere."""
        return cls("", "", NullSink())

    @property
    def counts(self) -> Counter[str]:
        """Every counter's total so far, by `count_key` (a copy: absent keys read 0)."""
        return self._counts.copy()

    def tap(self, sink: MetricsSink) -> None:
        """Hand every record from now on to `sink` too, as it is made (never batched), on the
        thread that makes it: the agent's event loop."""
        self._taps = (*self._taps, sink)

    def flush(self) -> None:
        """Hand the records held back for a batched sink on now (an agent does as it closes):
        one record per counter and tag set (their sum), per gauge and tag set (the last), and
        every histogram observation."""
        self._scheduled = False
        pending, self._pending = self._pending, []
        # Keyed by the tags' identity: one dict per tag set (`_known_tags`), held by `pending`.
        sums: dict[tuple[MetricSpec, int], tuple[Mapping[str, str], float]] = {}
        for spec, value, tags in pending:
            if spec.kind is MetricKind.HISTOGRAM:
                self.sink.record(spec, value, tags)
                continue
            key = (spec, id(tags))
            if spec.kind is MetricKind.COUNTER and key in sums:
                value += sums[key][1]
            sums[key] = (tags, value)
        for (spec, _), (tags, value) in sums.items():
            self.sink.record(spec, value, tags)

    def _emit(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        for tap in self._taps:
            tap.record(spec, value, tags)
        if not self._batched:
            self.sink.record(spec, value, tags)
            return
        self._pending.append((spec, value, tags))
        if self._scheduled:
            return
        self._scheduled = True
        try:
            asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
        except RuntimeError:  # no loop in this thread: nothing would flush later
            self.flush()

    def _known_tags(self, spec: MetricSpec, values: tuple[str, ...]) -> tuple[str, dict[str, str]]:
        """The count key and the tags dict of `spec` under its tag `values` (in `spec.tag_keys`
        order), made once: sinks may key their batches by the dict's identity."""
        known = self._known.get((spec, values))
        if known is None:
            if len(self._known) >= _MAX_KNOWN_TAG_SETS:  # peers come and go: forget old ones
                self._known.clear()
            tags = dict(zip(spec.tag_keys, values, strict=True))
            known = self._known[(spec, values)] = (count_key(spec, tags), tags)
        return known

    def _count(self, spec: MetricSpec, values: tuple[str, ...], value: int = 1) -> None:
        """Add `value` to the counter `spec` under its tag `values`."""
        key, tags = self._known_tags(spec, values)
        self._counts[key] += value
        self._emit(spec, value, tags)

    # ---- a prefill engine's pushes ----

    def bytes_pushed(self, transport: str, peer: str, nbytes: int) -> None:
        self._count(BYTES_PUSHED, (self.engine_id, transport, peer), nbytes)

    def transfer(
        self,
        push: PushCall,
        outcome: Outcome,
        transport: str,
        peer: str,
        seconds: float | None = None,
        error: BaseException | None = None,
    ) -> None:
        """One push call ended; `seconds` is observed for successful calls, and a call that
        failed or timed out is counted by its `error`'s cause."""
        self._count(TRANSFERS, (self.engine_id, transport, peer, push.value, outcome.value))
        if outcome is Outcome.OK and seconds is not None:
            _, tags = self._known_tags(TRANSFER_SECONDS, (self.engine_id, transport, peer, push.value))
            self._emit(TRANSFER_SECONDS, seconds, tags)
        elif outcome in _FAILED:
            self._count(FAILURES, (self.engine_id, push.value, failure_cause(error)))

    def layerwise_partial(self) -> None:
        self._count(LAYERWISE_PARTIAL, (self.engine_id,))

    def failure_notice(self, outcome: FailureNotice) -> None:
        self._count(FAILURE_NOTICES, (self.engine_id, outcome.value))

    # ---- a decode engine's receiving ----

    def bytes_received(self, peer: str, nbytes: int) -> None:
        self._count(BYTES_RECEIVED, (self.engine_id, peer), nbytes)

    def received(self, peer: str, nbytes: int) -> None:
        """A transfer taken as done: a completion and its bytes."""
        self._count(COMPLETIONS, (self.engine_id, "ok"))
        self._count(BYTES_RECEIVED, (self.engine_id, peer), nbytes)

    def lane_ask(self, answer: str) -> None:
        """A load asked through a native lane ended (`kvray.agent.lane.Answer`, lowercase)."""
        self._count(LANE_ASKS, (self.engine_id, answer))

    def completion_failed(self) -> None:
        """A transfer its writer reported failed (`received`: one taken as done)."""
        self._count(COMPLETIONS, (self.engine_id, "failed"))

    def wait(self, outcome: Outcome, seconds: float, error: BaseException | None = None) -> None:
        """One `wait_for_kv` ended; its wait is observed when the KV arrived, and a wait that
        failed or timed out is counted by its `error`'s cause."""
        self._count(WAITS, (self.engine_id, outcome.value))
        if outcome is Outcome.OK:
            self._emit(WAIT_SECONDS, seconds, self._known_tags(WAIT_SECONDS, (self.engine_id,))[1])
        elif outcome in _FAILED:
            self._count(FAILURES, (self.engine_id, WAIT_CALL, failure_cause(error)))

    def dropped(self, reason: DropReason) -> None:
        self._count(MESSAGES_DROPPED, (self.engine_id, reason.value))

    def claim_refused(self) -> None:
        self._count(CLAIMS_REFUSED, (self.engine_id,))

    def release_quarantined(self) -> None:
        self._count(RELEASES_QUARANTINED, (self.engine_id,))

    def integrity(
        self, peer: str, result: IntegrityCheck, wrong_layers: int = 0, seconds: float = 0.0
    ) -> None:
        """One transfer's checksums checked (`seconds`: hashing the landed bytes)."""
        self._count(INTEGRITY_CHECKS, (self.engine_id, peer, result.value))
        if wrong_layers:
            self._count(INTEGRITY_MISMATCHED_LAYERS, (self.engine_id, peer), wrong_layers)
        if result is not IntegrityCheck.UNCHECKED:
            self._emit(INTEGRITY_SECONDS, seconds, self._known_tags(INTEGRITY_SECONDS, (self.engine_id,))[1])

    # ---- notices, the directory, RDMA ----

    def notice_sent(self, channel: str, mode: NoticeSend) -> None:
        self._count(NOTICES_SENT, (self.engine_id, channel, mode.value))

    def notice_received(self, channel: str) -> None:
        self._count(NOTICES_RECEIVED, (self.engine_id, channel))

    def notice_connection(self, event: ConnectionEvent) -> None:
        self._count(NOTICE_CONNECTIONS, (self.engine_id, event.value))

    def listener_refused(self, reason: ListenerRefusal) -> None:
        self._count(NOTICE_LISTENERS_REFUSED, (self.engine_id, reason.value))

    def directory(self, event: DirectoryEvent) -> None:
        self._count(DIRECTORY_EVENTS, (self.engine_id, event.value))

    def rdma_write(self, work_requests: int) -> None:
        self._count(RDMA_WRITES, (self.engine_id,))
        self._count(RDMA_WORK_REQUESTS, (self.engine_id,), work_requests)

    def rdma_send_error(self) -> None:
        self._count(RDMA_SEND_ERRORS, (self.engine_id,))

    def rdma_connection_accepted(self) -> None:
        self._count(RDMA_CONNECTIONS_ACCEPTED, (self.engine_id,))

    def rdma_receive(self, outcome: RdmaReceive) -> None:
        self._count(RDMA_RECEIVES, (self.engine_id, outcome.value))

    # ---- a prefill engine's hand-offs (`kvray.agent.handoff`) ----

    def lease_expired(self) -> None:
        self._count(LEASES_EXPIRED, (self.engine_id,))

    def blocks_held(self, count: int) -> None:
        _, tags = self._known_tags(BLOCKS_HELD, (self.engine_id,))
        self._emit(BLOCKS_HELD, count, tags)

    # ---- a worker's block pool ----

    def blocks(self, in_use: int, total: int) -> None:
        _, tags = self._known_tags(BLOCKS_IN_USE, (self.engine_id, self.role))
        self._emit(BLOCKS_IN_USE, in_use, tags)
        self._emit(BLOCKS_TOTAL, total, tags)
