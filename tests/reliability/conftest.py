"""Fixtures of the reliability suite: the figures each test reports, and the faulty workers that
the kill, fencing, privilege and backpressure tests start.

Every test here states a number (cases tried, transfers moved, bytes found corrupt, blocks
leaked, ...). `figures` records one line per test; the lines are printed at the end of the
pytest run and written to `.kvray-reports/reliability.txt`, which `.ci/run` prints again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPORT_FILE = Path(__file__).resolve().parents[2] / ".kvray-reports" / "reliability.txt"
_LINES: list[str] = []


def record_figure(line: str) -> None:
    """Keep one figure line for the end of the run and the report file."""
    if not _LINES:
        REPORT_FILE.parent.mkdir(exist_ok=True)
        REPORT_FILE.write_text("")
    _LINES.append(line)
    with REPORT_FILE.open("a") as report:
        report.write(line + "\n")


@pytest.fixture(scope="session")
def figures() -> Callable[[str], None]:
    return record_figure


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _LINES:
        terminalreporter.section("kvray reliability figures")
        for line in _LINES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def workers_by_value(local_ray: None) -> Iterator[Any]:
    """`faulty_workers`, registered so Ray ships its classes to the actors by value (the test
    folder is not on the workers' import path)."""
    import faulty_workers
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(faulty_workers)
    yield faulty_workers
    ray.cloudpickle.unregister_pickle_by_value(faulty_workers)
