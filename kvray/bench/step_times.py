"""Where one hand-off's time goes: the hand-off's steps wrapped to record when each starts and
ends (`time.perf_counter`, one clock for every process of a machine), in whichever processes
install it, and a timeline of median offsets from the decode engine's step that began each
hand-off (`timeline`). Instrumentation for benchmarks (`benchmarks/bench_gpu_connector.py
--breakdown`); nothing in kvray installs it.

    decode   begin (the step's hand-offs handed over), step (on the agent's loop), expect
             (blocks reserved), mail (the push request sent), wait (until the KV is in),
             release, loaded (reported to the engine)
    prefill  take (the push request read), push, plan, write
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

#: Every stamp recorded in this process: (step and ">" start or "<" end, seconds).
STAMPS: list[tuple[str, float]] = []


def _wrap(owner: Any, name: str, label: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)
    if getattr(original, "kvray_step", None):
        return
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def stamped_async(*args: Any, **kwargs: Any) -> Any:
            STAMPS.append((label + ">", time.perf_counter()))
            try:
                return await original(*args, **kwargs)
            finally:
                STAMPS.append((label + "<", time.perf_counter()))

        stamped: Callable[..., Any] = stamped_async
    else:

        @functools.wraps(original)
        def stamped_sync(*args: Any, **kwargs: Any) -> Any:
            STAMPS.append((label + ">", time.perf_counter()))
            try:
                return original(*args, **kwargs)
            finally:
                STAMPS.append((label + "<", time.perf_counter()))

        stamped = stamped_sync
    stamped.kvray_step = True  # type: ignore[attr-defined]
    setattr(owner, name, stamped)


def install() -> None:
    """Record the hand-off's steps in this process from now on."""
    from kvray.agent import handoff, kvagent, push
    from kvray.agent.handoff import decode, prefill
    from kvray.integrations.vllm import worker

    for owner, name, label in [
        (worker.ConnectorWorker, "begin", "begin"),
        (handoff.Handoff, "step", "step"),
        (kvagent.KVAgent, "expect", "expect"),
        (decode.DecodeSide, "ask", "mail"),
        (decode.DecodeSide, "_wait_while_prefill_lives", "wait"),
        (kvagent.KVAgent, "release", "release"),
        (worker._Results, "loaded", "loaded"),
        (prefill.PrefillSide, "take", "take"),
        (push.Pusher, "push", "push"),
        (push.Pusher, "_plan", "plan"),
        (push.Pusher, "_write", "write"),
    ]:
        _wrap(owner, name, label)


def taken() -> list[tuple[str, float]]:
    """This process's stamps so far, and none kept."""
    stamps = list(STAMPS)
    STAMPS.clear()
    return stamps


def timeline(
    decode: Sequence[tuple[str, float]], prefill: Iterable[tuple[str, float]], skip: int = 2
) -> list[tuple[str, float]]:
    """Median offset (ms) of each step's first start and end after the decode engine's `begin`,
    over the hand-offs (each from one `begin` to the next, the first `skip` left out). Only for
    hand-offs run one at a time: with several in flight the steps of one are not told apart."""
    events = sorted(
        [("D " + name, at) for name, at in decode]
        + [("P " + name, at) for name, at in prefill if not name.startswith(("begin", "step"))],
        key=lambda event: event[1],
    )
    runs: list[list[tuple[str, float]]] = []
    for name, at in events:
        if name == "D begin>":
            runs.append([])
        if runs:
            runs[-1].append((name, at))
    offsets: dict[str, list[float]] = defaultdict(list)
    for run in runs[skip:]:
        start = run[0][1]
        seen: set[str] = set()
        for name, at in run:
            if name not in seen:
                seen.add(name)
                offsets[name].append((at - start) * 1e3)
    medians = [(name, statistics.median(values)) for name, values in offsets.items()]
    return sorted(medians, key=lambda item: item[1])
