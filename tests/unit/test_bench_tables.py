"""`kvray bench`'s tables: every column of figures names its unit in its header, so a GB/s
minimum never reads as milliseconds beside a median in ms."""

from __future__ import annotations

import re

from kvray.bench.control import format_completion, format_plan
from kvray.bench.results import BASELINE, CaseResult, format_case, summary_rows
from kvray.bench.verify import Verdict
from kvray.bench.workload import KIB, uniform

#: What a column of bare numbers may be in: time, throughput, or a count of runs.
UNITS = {"ms", "us", "GB/s", "runs"}


def assert_every_figure_names_its_unit(table: str, first_column: str) -> list[str]:
    """Check the table whose header starts with `first_column` (columns two or more spaces
    apart); return its header's cells."""
    lines = table.splitlines()
    at = next(index for index, line in enumerate(lines) if line.strip().startswith(first_column))
    header = re.split(r"\s{2,}", lines[at].strip())
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[at + 2 :]]
    rows = [row for row in rows if len(row) == len(header)]
    assert rows, f"no row of the table lines up with its header {header}"
    for row in rows:
        for label, cell in zip(header, row, strict=True):
            if re.fullmatch(r"-?\d+(\.\d+)?", cell):
                assert UNITS & set(label.split()), f"column {label!r} shows {cell} with no unit"
    return header


def test_the_case_table_names_the_unit_of_every_figure() -> None:
    workload = uniform("a", "a", 256 * KIB, 16 * KIB, seed=1)
    verdict = Verdict(ok=True, checked_nbytes=workload.nbytes)
    results = [
        CaseResult(name, "test", workload.key, workload.nbytes, seconds=seconds, verdicts=[verdict] * 3)
        for name, seconds in ((BASELINE, [0.004, 0.005, 0.006]), ("kvray shm", [0.002, 0.003, 0.0045]))
    ]
    table = format_case(summary_rows(results, workload), workload, 0, 3)
    header = assert_every_figure_names_its_unit(table, "contender")
    assert header[1:5] == ["median ms", "median GB/s", "min GB/s", "max GB/s"]


def test_the_plan_and_completion_tables_name_the_unit_of_every_figure() -> None:
    plan = {
        "request": "DeepSeek-V3, 8192 tokens",
        "repeat": 3,
        "rows": [
            {
                "order": "layer_major",
                "case": "cached",
                "median_us": 7.0,
                "min_us": 6.0,
                "max_us": 9.0,
                "vs_naive": 60.0,
            },
            {
                "order": "layer_major",
                "case": "ops",
                "unmerged": 10,
                "merged_scattered": 5,
                "merged_contiguous": 1,
            },
        ],
    }
    assert_every_figure_names_its_unit(format_plan(plan), "order")
    latency = {"same node": [0.000255, 0.000300, 0.000410], "other node": []}
    assert_every_figure_names_its_unit(format_completion(latency), "path")
