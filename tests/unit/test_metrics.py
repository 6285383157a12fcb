"""The metrics layer: what agents and block pools record (into an in-memory sink, no Ray), how
the Ray sink maps records onto Ray's metrics API, and that without Ray recording does nothing."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import types
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import pytest_asyncio
from agent_pair import agent_pair

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import (
    BackpressureError,
    BlockIdError,
    RequestCancelledError,
    StaleIncarnationError,
    TransferTimeoutError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.layout import BlockOrder, mixed
from kvray.metrics import (
    BLOCKS_HELD,
    BLOCKS_IN_USE,
    BYTES_PUSHED,
    FAILURES,
    METRICS,
    OPERATOR_METRICS,
    TRANSFER_SECONDS,
    TRANSFERS,
    WAITS,
    EngineMetrics,
    IntervalSink,
    MemorySink,
    MetricKind,
    NoticeSend,
    NullSink,
    Outcome,
    PushCall,
    RaySink,
    count_key,
    failure_cause,
)

LAYOUT = mixed(8, BlockOrder.LAYER_MAJOR)
SPECS = {spec.name: spec for spec in METRICS}


@pytest_asyncio.fixture(loop_scope="function")
async def agents(tmp_path: Path) -> AsyncIterator[tuple[KVAgent, KVAgent, MemorySink]]:
    sink = MemorySink()
    settings = Settings(shm_dir=str(tmp_path), transport="shm", notify_timeout_s=5.0)
    async with agent_pair("m", LAYOUT, settings, metrics_sink=sink) as (prefill, decode):
        yield prefill, decode, sink


def test_metric_names_and_tags() -> None:
    names = [spec.name for spec in METRICS]
    assert len(set(names)) == len(names)
    for spec in METRICS:
        assert spec.name.startswith("kvray_") and spec.description and "engine" in spec.tag_keys
        assert (spec.kind is MetricKind.HISTOGRAM) == bool(spec.boundaries)
        assert list(spec.boundaries) == sorted(set(spec.boundaries))


async def test_agents_record_pushes_waits_and_drops(agents: tuple[KVAgent, KVAgent, MemorySink]) -> None:
    prefill, decode, sink = agents
    first, second = LAYOUT.layer_names[:2]

    reservation = decode.expect("whole", [2, 3])
    whole = await prefill.push(reservation, [0, 1])
    await decode.wait_for_kv("whole", timeout=10.0)

    reservation = decode.expect("lw", [5], [first, second])
    for layer in (first, second):
        await prefill.push_layer(reservation, layer, [4])
    layerwise = await prefill.finish("lw")
    await decode.wait_for_kv("lw", timeout=10.0)

    # A reservation naming one decode block twice: refused while planning, no transport chosen yet.
    bad = msgspec.structs.replace(decode.expect("bad", [6, 7]), blocks=(3, 3))
    with pytest.raises(BlockIdError):
        await prefill.push(bad, [0, 1])
    await decode.release("bad")
    decode.expect("never", [6])
    with pytest.raises(TransferTimeoutError):  # nothing is ever pushed for it
        await decode.wait_for_kv("never", timeout=0.01)
    with pytest.raises(WireDecodeError):  # as a malformed datagram in its inbox would be
        await decode.notify(b"not a message")
    await asyncio.sleep(0)

    pushed = whole.nbytes + layerwise.nbytes
    assert sink.value("kvray_bytes_pushed", engine="m-p", transport="shm", peer="m-d") == pushed
    assert sink.value("kvray_bytes_received", engine="m-d", peer="m-p") == pushed
    ok = {"engine": "m-p", "transport": "shm", "peer": "m-d", "outcome": "ok"}
    assert sink.value("kvray_transfers", push="whole", **ok) == 1
    assert sink.value("kvray_transfers", push="layer", **ok) == 2
    assert sink.value("kvray_transfers", push="finish", **ok) == 1
    failed = sink.value("kvray_transfers", engine="m-p", push="whole", transport="none", outcome="failed")
    assert failed == 1
    assert len(sink.observations(TRANSFER_SECONDS.name, engine="m-p")) == 4
    # The layer-wise request's latency runs from its first layer's call to the finish.
    finish_seconds = sink.observations(TRANSFER_SECONDS.name, push="finish")
    layer_seconds = sink.observations(TRANSFER_SECONDS.name, push="layer")
    assert finish_seconds[0] >= sum(layer_seconds)
    assert sink.value(WAITS.name, engine="m-d", outcome="ok") == 2
    assert sink.value(WAITS.name, engine="m-d", outcome="timed_out") == 1
    assert len(sink.observations("kvray_wait_seconds", engine="m-d")) == 2
    assert sink.value("kvray_messages_dropped", engine="m-d", reason="malformed") == 1
    # Failures by cause: the refused push and the wait that timed out, nothing else.
    assert sink.value(FAILURES.name, engine="m-p", call="whole", cause="BlockIdError") == 1
    assert sink.value(FAILURES.name, engine="m-d", call="wait", cause="TransferTimeoutError") == 1
    assert sink.value(FAILURES.name) == 2

    # One system: each agent's stats are exactly its counter records, by count_key.
    for agent in (prefill, decode):
        totals: Counter[str] = Counter()
        for name, value, tags in sink.records:
            spec = SPECS[name]
            if spec.kind is MetricKind.COUNTER and tags["engine"] == agent.engine_id:
                totals[count_key(spec, tags)] += int(value)
        assert +agent.stats == +totals
    assert prefill.stats["transfers_whole_ok"] == 1 and prefill.stats["transfers_layer_ok"] == 2
    assert decode.stats["completions_ok"] == 2 and decode.stats["messages_dropped_malformed"] == 1


def test_failures_are_counted_by_the_kvray_error_class() -> None:
    sink = MemorySink()
    metrics = EngineMetrics("p", "prefill", sink)
    metrics.transfer(PushCall.WHOLE, Outcome.TIMED_OUT, "shm", "d", 1.0, TransferTimeoutError("late"))
    metrics.transfer(PushCall.LAYER, Outcome.FAILED, "shm", "d", None, StaleIncarnationError("old"))
    metrics.transfer(PushCall.FINISH, Outcome.FAILED, "shm", "d", None, RuntimeError("not kvray's"))
    # Refused at once (retried) and cancelled (the caller's choice): outcomes, not failures.
    metrics.transfer(PushCall.WHOLE, Outcome.REJECTED, "none", "d", error=BackpressureError("full"))
    metrics.transfer(PushCall.WHOLE, Outcome.CANCELLED, "shm", "d", error=None)
    metrics.wait(Outcome.FAILED, 0.5, WriteFailedError("the writer failed"))
    metrics.wait(Outcome.CANCELLED, 0.5, RequestCancelledError("released"))
    assert sink.value(FAILURES.name, engine="p", call="whole", cause="TransferTimeoutError") == 1
    assert sink.value(FAILURES.name, call="layer", cause="StaleIncarnationError") == 1
    assert sink.value(FAILURES.name, call="finish", cause="other") == 1
    assert sink.value(FAILURES.name, call="wait", cause="WriteFailedError") == 1
    assert sink.value(FAILURES.name) == 4
    assert metrics.counts["failures_wait_WriteFailedError"] == 1
    assert failure_cause(None) == failure_cause(ValueError()) == "other"


def test_operator_metrics_are_kvray_metrics() -> None:
    assert set(OPERATOR_METRICS) <= set(METRICS)
    assert len(set(OPERATOR_METRICS)) == len(OPERATOR_METRICS)


async def test_a_tap_sees_each_record_as_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_ray(monkeypatch, initialized=True)
    metrics = EngineMetrics("p", "prefill", RaySink())  # batched: records reach Ray later
    tap = MemorySink()
    metrics.tap(tap)
    metrics.bytes_pushed("shm", "d", 10)
    metrics.transfer(PushCall.WHOLE, Outcome.OK, "shm", "d", 0.001)
    assert _FakeMetric.made == []
    assert tap.value(BYTES_PUSHED.name, engine="p", peer="d") == 10
    assert tap.observations(TRANSFER_SECONDS.name, push="whole") == [0.001]
    metrics.flush()


def test_an_interval_sink_keeps_the_operator_figures_until_taken() -> None:
    figures = IntervalSink()
    metrics = EngineMetrics("p", "prefill", NullSink())
    metrics.tap(figures)
    metrics.transfer(PushCall.WHOLE, Outcome.OK, "shm", "d1", 0.002)
    metrics.transfer(PushCall.WHOLE, Outcome.OK, "ray", "d2", 0.004)
    metrics.transfer(PushCall.LAYER, Outcome.FAILED, "shm", "d1", error=WriteFailedError("lost"))
    metrics.bytes_pushed("shm", "d1", 100)
    metrics.bytes_pushed("ray", "d2", 50)
    metrics.notice_sent("tcp", NoticeSend.AT_ONCE)  # not an operator metric: not kept
    metrics.blocks_held(3)
    taken = figures.take()
    # By kind tags: peers and transports are summed over, as in `counts`.
    assert taken.counters[TRANSFERS.name] == {("whole", "ok"): 2.0, ("layer", "failed"): 1.0}
    assert taken.counters[BYTES_PUSHED.name] == {(): 150.0}
    assert taken.counters[FAILURES.name] == {("layer", "WriteFailedError"): 1.0}
    assert taken.observations == {TRANSFER_SECONDS.name: {("whole",): [0.002, 0.004]}}
    assert taken.gauges == {BLOCKS_HELD.name: {(): 3}}
    assert "kvray_notices_sent" not in taken.counters
    assert figures.take().empty  # taken: nothing since
    metrics.blocks_held(3)
    assert figures.take().empty  # the same level again is not news
    metrics.blocks_held(0)
    assert figures.take().gauges == {BLOCKS_HELD.name: {(): 0}}


def test_an_interval_sink_read_from_another_thread_loses_no_record() -> None:
    figures = IntervalSink()
    metrics = EngineMetrics("p", "prefill", NullSink())
    metrics.tap(figures)
    recorded = 20_000

    def record() -> None:
        for _ in range(recorded):
            metrics.bytes_pushed("shm", "d", 1)

    writer = threading.Thread(target=record)
    writer.start()
    taken = 0.0
    while writer.is_alive():
        taken += figures.take().counters.get(BYTES_PUSHED.name, {}).get((), 0.0)
    writer.join()
    taken += figures.take().counters.get(BYTES_PUSHED.name, {}).get((), 0.0)
    assert taken == recorded


def test_an_interval_sink_nobody_reads_keeps_its_latest_records() -> None:
    figures = IntervalSink(max_records=3)
    for nbytes in (1, 2, 4, 8, 16):
        figures.record(BYTES_PUSHED, nbytes, {"engine": "p", "transport": "shm", "peer": "d"})
    assert figures.take().counters == {BYTES_PUSHED.name: {(): 28.0}}


def test_count_keys_name_the_metric_and_its_kind_tags() -> None:
    tags = {"engine": "e", "transport": "shm", "peer": "d", "push": "whole", "outcome": "ok"}
    assert count_key(TRANSFERS, tags) == "transfers_whole_ok"
    assert count_key(BYTES_PUSHED, {"engine": "e", "transport": "shm", "peer": "d"}) == "bytes_pushed"
    # Two records of different kinds never share a key.
    keys = {
        count_key(spec, {key: f"{spec.name}-{key}" for key in spec.tag_keys})
        for spec in METRICS
        if spec.kind is MetricKind.COUNTER
    }
    assert len(keys) == sum(spec.kind is MetricKind.COUNTER for spec in METRICS)


def test_block_pool_records_usage() -> None:
    from kvray.workers import BlockPool

    sink = MemorySink()
    pool = BlockPool(10, metrics=EngineMetrics("d", "decode", sink))
    assert sink.value(BLOCKS_IN_USE.name, engine="d", role="decode") == 0
    assert sink.value("kvray_blocks_total", engine="d") == 10
    blocks = pool.allocate(4)
    more = pool.allocate(2)
    assert sink.value(BLOCKS_IN_USE.name, engine="d") == 6
    pool.free(blocks)
    assert sink.value(BLOCKS_IN_USE.name, engine="d") == 2
    with pytest.raises(BlockIdError):
        pool.free(blocks)
    assert sink.value(BLOCKS_IN_USE.name, engine="d") == 2
    pool.free(more)
    assert sink.value(BLOCKS_IN_USE.name, engine="d") == 0


def test_memory_sink_refuses_wrong_tags() -> None:
    with pytest.raises(ValueError, match="missing tags"):
        MemorySink().record(BYTES_PUSHED, 1, {"engine": "e"})


class _FakeMetric:
    def __init__(self, name: str, description: str = "", *args: Any) -> None:
        self.name = name
        self.args = args
        self.calls: list[tuple[str, float, dict[str, str]]] = []
        _FakeMetric.made.append(self)

    made: ClassVar[list[_FakeMetric]] = []

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("inc", value, tags))

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("set", value, tags))

    def observe(self, value: float, tags: dict[str, str]) -> None:
        if value < 0:
            raise ValueError("negative")
        self.calls.append(("observe", value, tags))


def _fake_ray(monkeypatch: pytest.MonkeyPatch, initialized: bool) -> None:
    """A `ray` module whose metrics API records calls (Ray's own needs a running node)."""
    _FakeMetric.made = []
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: initialized  # type: ignore[attr-defined]
    util = types.ModuleType("ray.util")
    metrics = types.ModuleType("ray.util.metrics")
    for name in ("Counter", "Gauge", "Histogram"):
        setattr(metrics, name, type(name, (_FakeMetric,), {}))
    util.metrics = metrics  # type: ignore[attr-defined]
    ray.util = util  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", util)
    monkeypatch.setitem(sys.modules, "ray.util.metrics", metrics)


def test_ray_sink_maps_records_onto_rays_api(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_ray(monkeypatch, initialized=True)
    metrics = EngineMetrics("p", "prefill", RaySink())
    metrics.bytes_pushed("ray", "d", 4096)
    metrics.bytes_pushed("ray", "d", 0)  # Ray's counters refuse zero increments: skipped
    metrics.blocks(3, 8)
    metrics.blocks(1, 8)
    metrics.transfer(PushCall.WHOLE, Outcome.OK, "ray", "d", 0.002)
    made = {metric.name: metric for metric in _FakeMetric.made}
    assert set(made) == {
        "kvray_bytes_pushed",
        "kvray_blocks_in_use",
        "kvray_blocks_total",
        "kvray_transfers",
        "kvray_transfer_seconds",
    }
    assert made["kvray_bytes_pushed"].calls == [
        ("inc", 4096, {"engine": "p", "transport": "ray", "peer": "d"})
    ]
    assert [call[:2] for call in made["kvray_blocks_in_use"].calls] == [("set", 3), ("set", 1)]
    histogram = made["kvray_transfer_seconds"]
    assert type(histogram).__name__ == "Histogram" and histogram.args[0] == list(TRANSFER_SECONDS.boundaries)
    assert histogram.calls[0][:2] == ("observe", 0.002)
    assert made["kvray_transfers"].calls[0][2]["outcome"] == "ok"


async def test_ray_sink_hands_records_made_on_a_loop_to_ray_in_one_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_ray(monkeypatch, initialized=True)
    monkeypatch.setattr("kvray.metrics.FLUSH_S", 0.05)
    metrics = EngineMetrics("p", "prefill", RaySink())
    for _ in range(100):
        metrics.bytes_pushed("shm", "d", 10)
        metrics.transfer(PushCall.WHOLE, Outcome.OK, "shm", "d", 0.001)
    assert _FakeMetric.made == [], "nothing reaches Ray's API on the hot path"
    await asyncio.sleep(0.2)
    made = {metric.name: metric for metric in _FakeMetric.made}
    assert made["kvray_bytes_pushed"].calls == [
        ("inc", 1000, {"engine": "p", "transport": "shm", "peer": "d"})
    ]
    assert [call[:2] for call in made["kvray_transfers"].calls] == [("inc", 100)]
    assert len(made["kvray_transfer_seconds"].calls) == 100
    assert metrics.counts["bytes_pushed"] == 1000 and metrics.counts["transfers_whole_ok"] == 100
    metrics.bytes_pushed("shm", "d", 5)
    metrics.flush()  # what an agent does as it closes: nothing is left behind
    assert made["kvray_bytes_pushed"].calls[-1][:2] == ("inc", 5)


def test_ray_sink_turns_off_when_rays_api_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_ray(monkeypatch, initialized=True)
    sink = RaySink()
    metrics = EngineMetrics("d", "decode", sink)
    with caplog.at_level(logging.WARNING, logger="kvray.metrics"):
        metrics.wait(Outcome.OK, -1.0)  # the fake histogram raises, as Ray's does on bad input
    assert not sink.active
    assert "metrics are off" in caplog.text
    metrics.wait(Outcome.OK, 1.0)
    assert sum(len(metric.calls) for metric in _FakeMetric.made) == 1  # the counter, before the failure


def test_ray_sink_is_idle_while_ray_is_not_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_ray(monkeypatch, initialized=False)
    EngineMetrics("d", "decode", RaySink()).blocks(1, 2)
    assert _FakeMetric.made == []


def test_without_ray_recording_is_a_noop() -> None:
    """kvray used without Ray: the default sink records nothing, imports neither Ray (where
    Ray is absent) nor Ray's metrics API (where Ray is installed but not started), and never fails."""
    script = (
        "import sys\n"
        "import kvray\n"
        "from kvray.metrics import RAY_SINK, DropReason, EngineMetrics\n"
        "EngineMetrics('solo', 'decode').dropped(DropReason.STALE)\n"
        "assert 'ray' not in sys.modules, 'recording imported ray'\n"
        "from kvray.agent import KVAgent\n"
        "from kvray.wire import Role\n"
        "agent = KVAgent('solo', Role.PREFILL, kvray.mixed(4), use_coordinator=False)\n"
        "assert agent.metrics.sink is RAY_SINK and not RAY_SINK.active\n"
        "agent.metrics.blocks(1, 4)\n"
        "agent.backing.close()\n"
        "assert 'ray.util.metrics' not in sys.modules, 'recording imported ray.util.metrics'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
