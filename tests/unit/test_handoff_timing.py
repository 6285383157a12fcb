"""The connector benchmark's timing wrapper (`kvray.bench.handoff_timing`) without
vLLM: a stand-in connector under the mixin, the records both engines write, and their join by
prompt into per-request transfer times."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvray.bench import handoff_timing
from kvray.bench.handoff_timing import HandoffTiming, handoff_times, prompt_digest, read_records


class StandInConnector:
    """The calls vLLM makes on a connector, each recorded."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        self.calls: list[str] = []
        self._meta: Any = None
        self.receiving: set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append("matched")
        return 0, False

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self.calls.append("meta")
        return SimpleNamespace()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        self.calls.append("finished")
        return False, None

    def bind_connector_metadata(self, meta: Any) -> None:
        self._meta = meta

    def has_connector_metadata(self) -> bool:
        return self._meta is not None

    def _get_connector_metadata(self) -> Any:
        return self._meta

    def wait_for_save(self) -> None:
        self.calls.append("save")

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        received, self.receiving = self.receiving, set()
        return SimpleNamespace(finished_recving=received, failed_recving=set())


class Timed(HandoffTiming, StandInConnector):
    pass


def request(request_id: str, tokens: list[int]) -> Any:
    return SimpleNamespace(request_id=request_id, prompt_token_ids=tokens)


def step(new: list[tuple[str, int]], cached: list[tuple[str, int]], scheduled: dict[str, int]) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], num_computed_tokens=[n for _, n in cached]
        ),
        num_scheduled_tokens=scheduled,
    )


def test_a_prompt_split_over_two_steps_is_computed_in_the_second_and_joined_by_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = list(range(300))
    monkeypatch.setenv(handoff_timing.TIMES_ENV, str(tmp_path / "p.jsonl"))
    prefill_scheduler, prefill_worker = Timed(None, "scheduler"), Timed(None, "worker")
    monkeypatch.setenv(handoff_timing.TIMES_ENV, str(tmp_path / "d.jsonl"))
    decode_scheduler, decode_worker = Timed(None, "scheduler"), Timed(None, "worker")

    assert prefill_scheduler.get_num_new_matched_tokens(request("p-1", prompt), 0) == (0, False)
    first = prefill_scheduler.build_connector_meta(step([("p-1", 0)], [], {"p-1": 256}))
    second = prefill_scheduler.build_connector_meta(step([], [("p-1", 256)], {"p-1": 44}))
    assert (first.handoff_computed, second.handoff_computed) == ([], ["p-1"])
    for meta in (first, second):
        prefill_worker.bind_connector_metadata(meta)
        prefill_worker.wait_for_save()
    assert prefill_worker.calls == ["save", "save"]  # the real connector's calls all happen

    decode_scheduler.get_num_new_matched_tokens(request("d-1", prompt), 0)
    decode_scheduler.get_num_new_matched_tokens(request("d-2", [7, 8]), 0)  # never received
    decode_worker.receiving = {"d-1"}
    assert decode_worker.get_transfer_results(set()).finished_recving == {"d-1"}
    decode_worker.get_transfer_results(set())  # nothing received: no record

    prefill, _ = read_records(str(tmp_path / "p.jsonl"))
    decode, _ = read_records(str(tmp_path / "d.jsonl"))
    assert [r["event"] for r in prefill] == ["request", "computed"]
    assert [r["event"] for r in decode] == ["request", "request", "received"]
    [joined] = handoff_times(prefill, decode)
    assert joined.prompt == prompt_digest(prompt) and joined.tokens == 300 and not joined.failed
    assert joined.transfer_s == (decode[-1]["t"] - prefill[-1]["t"]) / 1e9 >= 0


def test_records_are_read_from_an_offset_and_a_torn_last_line_waits(tmp_path: Path) -> None:
    path = tmp_path / "times.jsonl"
    assert read_records(str(path)) == ([], 0)
    path.write_bytes(b'{"event": "request", "t": 1}\n{"event": "comp')
    records, offset = read_records(str(path))
    assert records == [{"event": "request", "t": 1}] and offset == len(b'{"event": "request", "t": 1}\n')
    with path.open("ab") as file:
        file.write(b'uted", "t": 2}\n')
    assert read_records(str(path), offset) == ([{"event": "computed", "t": 2}], path.stat().st_size)


def test_without_the_variable_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(handoff_timing.TIMES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    scheduler = Timed(None, "scheduler")
    scheduler.get_num_new_matched_tokens(request("r", [1]), 0)
    assert list(tmp_path.iterdir()) == []


def test_only_the_known_connectors_are_wrapped() -> None:
    with pytest.raises(AttributeError, match="SomeConnector"):
        handoff_timing.SomeConnector  # noqa: B018 - the lookup is the test


class PinningConnector(StandInConnector):
    """Pins the thread that builds it to one CPU, as NIXL's connector does on a CPU platform."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})


class TimedPinning(HandoffTiming, PinningConnector):
    pass


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs"
)
@pytest.mark.parametrize("keep", [True, False])
def test_the_building_thread_gets_its_cpus_back_when_asked(
    keep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(handoff_timing.TIMES_ENV, raising=False)
    if keep:
        monkeypatch.setenv(handoff_timing.KEEP_AFFINITY_ENV, "1")
    else:
        monkeypatch.delenv(handoff_timing.KEEP_AFFINITY_ENV, raising=False)
    before = os.sched_getaffinity(0)
    try:
        TimedPinning(None, "worker")
        assert (os.sched_getaffinity(0) == before) is keep
    finally:
        os.sched_setaffinity(0, before)
