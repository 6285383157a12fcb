"""`kvray bench --quick`, as CI runs it: every contender that can run here runs, every run is
verified, the table and the JSON come out. No timing is asserted (the numbers live in the
benchmark's output and docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from kvray_command import run_kvray

pytestmark = pytest.mark.usefixtures("own_ray")


def test_bench_quick_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run_kvray("bench", "--quick", "--json", str(out_json), "--plot", str(out_png))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RESULT: PASS" in result.stdout
    for contender in ("memcpy, 1 thread", "kvray shm", "kvray ray transport", "Ray object store"):
        assert contender in result.stdout
    assert "(a) 8 MiB as 512 x 16 KiB scattered blocks" in result.stdout
    assert "completion latency" in result.stdout
    document = json.loads(out_json.read_text())
    assert document["machine"]["cpu_count"] == os.cpu_count()
    assert not document["failures"]
    rows = document["results"]
    assert {row["case"] for row in rows} == {case["key"] for case in document["cases"]}
    for row in rows:
        assert row["status"] == "ok"
        assert row["verified_runs"] == row["checked_runs"] > 0
        assert row["median_gb_s"] > 0
    # NIXL and matplotlib are optional: each is either used or skipped with a reason.
    names = {row["contender"] for row in rows}
    nixl_ran = any(name.startswith("NIXL") for name in names)
    nixl_skipped = any(skip["family"] == "nixl" for skip in document["skipped"])
    assert nixl_ran != nixl_skipped
    assert (document["plot"] is not None) == out_png.exists()
    assert document["plot"] is not None or document["plot_skipped"]
