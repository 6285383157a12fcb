"""The loop every contender runs in: per case, every contender is set up, then run after run
each contender takes its turn (the order rotating), so a noisy machine slows all of them
alike instead of whichever happened to run during the noise.

A contender is a small driver-side object around its actors (`Contender`): `setup` a case,
`run` once (scrub the destination, time one transfer, verify every destination byte),
`teardown` the case, `close` at the end. A run that raises fails its row for that case (the
remaining runs of that row are skipped), like a wrong byte does.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvray.bench.results import CaseResult, describe
from kvray.bench.verify import Verdict, failed
from kvray.bench.workload import Workload
from kvray.progress import Progress


@dataclass
class Run:
    """One run of one contender: its time, its verdict, facts worth keeping."""

    seconds: float
    verdict: Verdict
    #: Facts of the row (op counts ...), the same every run.
    facts: dict[str, Any] = field(default_factory=dict)
    #: Other times of this run (e.g. the sender's own view); kept per timed run.
    extra_seconds: dict[str, float] = field(default_factory=dict)


class Contender(abc.ABC):
    """A family of rows measured by one set of actors (e.g. kvray's two transports)."""

    #: Family name, as `--only` takes it.
    family: str
    #: The rows this family measures, as the table names them.
    names: tuple[str, ...]
    #: Where each row's clock runs (the table's note).
    timed: ClassVar[Mapping[str, str]]
    #: The actors `start` created: `teardown` calls each one's `teardown`, `close` kills them.
    actors: tuple[Any, ...] = ()

    def start(self) -> str | None:
        """Create the actors; None when ready, else why this family cannot run here."""
        return None

    @abc.abstractmethod
    def setup(self, workload: Workload) -> None:
        """Allocate and fill both sides for one case."""

    @abc.abstractmethod
    def run(self, name: str, run: int) -> Run:
        """Scrub the destination, time one transfer of row `name`, verify the destination."""

    def teardown(self) -> None:
        """Release the case's memory."""
        if self.actors:
            import ray

            ray.get([actor.teardown.remote() for actor in self.actors])

    def close(self) -> None:
        """Kill the actors."""
        if self.actors:
            import ray

            for actor in self.actors:
                ray.kill(actor)


def run_cases(
    contenders: list[Contender],
    cases: list[Workload],
    warmup: int,
    repeats: dict[str, int],
    progress: Progress,
    settle_s: float = 0.0,
) -> list[CaseResult]:
    """Every case, every contender, run by run; `settle_s` of quiet before each run lets the
    previous run's asynchronous clean-up (freed object-store buffers, actor replies) finish
    instead of landing in the next contender's timing."""
    results: list[CaseResult] = []
    for workload in cases:
        rows: dict[tuple[int, str], CaseResult] = {}
        ready: list[Contender] = []
        for index, contender in enumerate(contenders):
            for name in contender.names:
                rows[index, name] = CaseResult(
                    name, contender.family, workload.key, workload.nbytes, timed=contender.timed[name]
                )
            try:
                contender.setup(workload)
                ready.append(contender)
            except Exception as error:
                for name in contender.names:
                    rows[index, name].error = f"setup: {describe(error)}"
        turns = [(contenders.index(c), name) for c in ready for name in c.names]
        for run in range(warmup + repeats[workload.key]):
            shift = run % max(1, len(turns))
            for index, name in turns[shift:] + turns[:shift]:
                row = rows[index, name]
                progress.step(f"{name} / {workload.key} run {run + 1}")
                if row.error is not None:
                    continue
                time.sleep(settle_s)
                try:
                    outcome = contenders[index].run(name, run)
                except Exception as error:
                    row.error = describe(error)
                    row.verdicts.append(failed(row.error))
                    continue
                row.verdicts.append(outcome.verdict)
                row.facts.update(outcome.facts)
                if run >= warmup:
                    row.seconds.append(outcome.seconds)
                    for key, value in outcome.extra_seconds.items():
                        row.facts.setdefault(key, []).append(value)
        for contender in ready:
            try:
                contender.teardown()
            except Exception as error:
                for name in contender.names:
                    index = contenders.index(contender)
                    rows[index, name].error = rows[index, name].error or f"teardown: {describe(error)}"
        results += rows.values()
    return results
