"""vLLM KV connectors wrapped to record when each request's KV hand-off starts and ends, the same
way for every connector, so that connectors can be compared (`benchmarks/bench_connectors.py`).

Name this module as `kv_connector_module_path` and keep the connector's own name in
`kv_connector` (`KvrayConnector`, `DigestLogConnector`, `NixlConnector`, `MooncakeConnector`):
vLLM takes the class of that name from here, a subclass of the real connector that only adds
timestamps, so everything
that looks the connector up by name (vLLM's config checks, Ray Serve LLM's back-ends) sees it
unchanged. Each engine appends JSON lines to the file named by the `KV_HANDOFF_TIMES`
environment variable (one file per engine; no variable, no records):

    {"event": "request", "request": id, "prompt": digest, "tokens": n, "t": ns}   scheduler side
    {"event": "computed", "requests": [id, ...], "t": ns}                          worker side
    {"event": "received", "requests": [id, ...], "failed": [id, ...], "t": ns}      worker side

- `request`: the first time the scheduler sees a request: its id and a digest of its prompt's
  token ids (the prefill and the decode engine name one request differently; the prompt joins
  them).
- `computed`: the forward pass that computed these requests' last prompt tokens has ended
  (every layer's KV is in the engine's cache and the connector's `wait_for_save` returned):
  on the prefill engine, the moment the request's KV is complete there.
- `received`: the worker's `get_transfer_results` reported these requests finished receiving
  (the scheduler may now decode them); `failed` names the ones that failed.

With `KV_HANDOFF_KEEP_AFFINITY=1` the wrapper also gives the thread that built the connector
back the CPUs it had before: vLLM's NIXL connector, on a CPU platform, pins the calling thread
(the worker's main thread, which runs the forward pass) to the last core of each NUMA node,
meant for its transfers; on a small machine every engine's forward then shares that one core.
The benchmark runs NIXL both ways.

Times are `time.time_ns()`: every engine of one machine shares that clock. The KV transfer time
of a request is its `received` time at the decode engine minus its `computed` time at the
prefill engine (`handoff_times`); it can be below zero when a connector has the KV in place
before the prefill's forward returns (a layer-wise push finishing with the last layer).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The environment variable naming an engine's record file.
TIMES_ENV = "KV_HANDOFF_TIMES"
#: The environment variable that, set to 1, undoes a connector's pinning of the building thread.
KEEP_AFFINITY_ENV = "KV_HANDOFF_KEEP_AFFINITY"
#: The connectors this module wraps: name -> the module defining the real class.
CONNECTOR_MODULES = {
    "KvrayConnector": "kvray.integrations.vllm.connector",
    "DigestLogConnector": "kvray.bench.handoff_log",
    "NixlConnector": "vllm.distributed.kv_transfer.kv_connector.v1.nixl",
    "MooncakeConnector": "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector",
}
#: The attribute of a step's connector metadata listing the requests whose prompt the step
#: completes (set by the scheduler side, read by the worker side; the metadata is pickled
#: between the two processes, attributes and all).
_COMPUTED_ATTR = "handoff_computed"


def prompt_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:24]


class TimesFile:
    """Appends records to one file; each record is one `write` to a file opened O_APPEND, so
    the engine's scheduler and worker processes can share the file without tearing lines."""

    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if path else None

    def write(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        record = {"event": event, "t": time.time_ns(), **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())


class HandoffTiming:
    """The timing half of a wrapped connector; it comes first in the bases, so each method
    records and then defers to the real connector (`super()`)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        keep = os.environ.get(KEEP_AFFINITY_ENV) == "1" and hasattr(os, "sched_getaffinity")
        affinity = os.sched_getaffinity(0) if keep else None
        parent: Any = super()
        parent.__init__(vllm_config, role, kv_cache_config)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        self._times = TimesFile(os.environ.get(TIMES_ENV))
        #: Scheduler side: prompt lengths of requests whose prompt is not computed yet.
        self._prompt_tokens: dict[str, int] = {}
        self._seen: set[str] = set()

    # ---- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        if request.request_id not in self._seen:
            self._seen.add(request.request_id)
            tokens = list(request.prompt_token_ids or ())
            self._prompt_tokens[request.request_id] = len(tokens)
            self._times.write(
                "request", request=request.request_id, prompt=prompt_digest(tokens), tokens=len(tokens)
            )
        parent: Any = super()
        return parent.get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        parent: Any = super()
        meta = parent.build_connector_meta(scheduler_output)
        scheduled: Mapping[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        progress = [(new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        progress += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        computed = []
        for request_id, done in progress:
            total = self._prompt_tokens.get(request_id)
            if total is not None and done + scheduled.get(request_id, 0) >= total:
                computed.append(request_id)
                del self._prompt_tokens[request_id]
        setattr(meta, _COMPUTED_ATTR, computed)
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._prompt_tokens.pop(request.request_id, None)
        self._seen.discard(request.request_id)
        parent: Any = super()
        return parent.request_finished(request, block_ids)

    # ---- worker side ------------------------------------------------------------------

    def wait_for_save(self) -> None:
        parent: Any = super()
        parent.wait_for_save()
        if parent.has_connector_metadata():
            computed = getattr(parent._get_connector_metadata(), _COMPUTED_ATTR, None)
            if computed:
                self._times.write("computed", requests=list(computed))

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        parent: Any = super()
        results = parent.get_transfer_results(finished_req_ids)
        if results.finished_recving:
            self._times.write(
                "received",
                requests=sorted(results.finished_recving),
                failed=sorted(results.failed_recving or ()),
            )
        return results


def wrapped(name: str) -> type:
    """The timed subclass of the connector `name` (one of `CONNECTOR_MODULES`)."""
    base = getattr(importlib.import_module(CONNECTOR_MODULES[name]), name)
    return type(name, (HandoffTiming, base), {"__module__": __name__, "__qualname__": name})


_classes: dict[str, type] = {}


def __getattr__(name: str) -> type:
    # Lazily: importing the module must not import every connector's dependencies.
    if name not in CONNECTOR_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _classes:
        _classes[name] = wrapped(name)
    return _classes[name]


# ---- reading the records ---------------------------------------------------------------


@dataclass(frozen=True)
class HandoffTime:
    """One request's hand-off, joined across the two engines by its prompt."""

    prompt: str
    tokens: int
    #: Prefill engine: the forward that completed the prompt ended (ns).
    computed_ns: int
    #: Decode engine: the worker reported the KV received (ns).
    received_ns: int
    failed: bool

    @property
    def transfer_s(self) -> float:
        return (self.received_ns - self.computed_ns) / 1e9


def read_records(path: str, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records of `path` from byte `offset` on (none if the file does not exist), and the
    offset after them (a line still being written is left for the next read)."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            data = file.read()
    except FileNotFoundError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)


def handoff_times(
    prefill: Iterable[Mapping[str, Any]], decode: Iterable[Mapping[str, Any]]
) -> list[HandoffTime]:
    """Join the prefill engine's and the decode engine's records by prompt: one `HandoffTime`
    per prompt that was computed on the prefill engine and received on the decode engine (the
    first time each, should a prompt come twice)."""
    computed = _first_times(prefill, "computed")
    received = _first_times(decode, "received")
    times = []
    for prompt, (tokens, received_ns, failed) in received.items():
        if prompt in computed:
            times.append(HandoffTime(prompt, tokens, computed[prompt][1], received_ns, failed))
    return times


def _first_times(records: Iterable[Mapping[str, Any]], event: str) -> dict[str, tuple[int, int, bool]]:
    """prompt -> (tokens, first time of `event`, whether it failed) over one engine's records."""
    records = list(records)
    prompts = {
        record["request"]: (record["prompt"], record["tokens"])
        for record in records
        if record["event"] == "request"
    }
    firsts: dict[str, tuple[int, int, bool]] = {}
    for record in records:
        if record["event"] == event:
            failed = set(record.get("failed", ()))
            for request_id in record["requests"]:
                if request_id not in prompts:
                    continue
                prompt, tokens = prompts[request_id]
                firsts.setdefault(prompt, (tokens, record["t"], request_id in failed))
    return firsts
