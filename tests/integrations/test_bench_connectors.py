"""The connector benchmark (`benchmarks/bench_connectors.py`) in small, on the MLA model (`kvray
model tiny-deepseek`: MLA + MoE; SmolLM2 goes through Serve LLM in `test_vllm_serve_llm.py`): a
single Serve LLM engine, then the Serve LLM P/D app with `KvrayConnector` (and with vLLM's
`NixlConnector` where NIXL is installed), the same token-id prompts on each. Every P/D answer's
token ids equal the single engine's or part from them at a near tie of the model's (vLLM's MLA
arithmetic), and every request's hand-off was timed on both engines.

Skipped where vLLM, the model's package or pyarrow (which `ray.serve.llm` imports) is missing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_installed import require_vllm

require_vllm()
pytest.importorskip("pyarrow", reason="ray.serve.llm needs pyarrow: pip install -e '.[vllm]'")

# Extended tier (`pytest -m extended`): a benchmark's smoke run, five engines in three Serve apps;
# the MLA model's P/D path is tested in test_vllm_models_pd.py and Serve LLM's in
# test_vllm_serve_llm.py.
pytestmark = [pytest.mark.usefixtures("own_ray", "vllm_ready"), pytest.mark.extended]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_connectors.py"
MODEL = "tiny-deepseek"
REQUESTS = 2
RUN_S = 600


def contenders() -> list[str]:
    names = ["kvray-shm"]
    if importlib.util.find_spec("nixl") is not None:
        names.append("nixl")
    return names


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One small run of the benchmark (it starts and stops its own Ray and Serve)."""
    out = tmp_path_factory.mktemp("bench-connectors") / "report.json"
    command = [sys.executable, str(SCRIPT), "--model", MODEL, "--lengths", "128", "--clients", "2"]
    command += ["--requests", str(REQUESTS)]
    command += ["--new-tokens", "8", "--contenders", *contenders(), "--check-transport", "--json", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=RUN_S)
    assert out.exists(), f"no report (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(out.read_text())
    report["returncode"] = run.returncode
    report["stdout"] = run.stdout
    return report


def test_every_contender_ran_and_the_benchmark_passed(report: dict[str, Any]) -> None:
    ran = {line["contender"] for line in report["lines"]}
    assert ran == {"single", *contenders()}
    assert report["returncode"] == 0, report["stdout"][-3000:]
    assert all(line["status"] == "ok" for line in report["lines"]), report["lines"]


def test_every_answer_agrees_with_the_single_engines_tokens(report: dict[str, Any]) -> None:
    # Equal, or parted first at a near tie of the model's: where the single engine's top two
    # logprobs were within `near_tie` (vLLM's MLA kernels compute a decode engine's first token
    # by another path), never where it was sure.
    for line in report["lines"]:
        if line["contender"] != "single":
            assert line["equal"] + line["near_ties"] == REQUESTS, line
    runs = {run["name"]: run for run in report["runs"]}
    expected = runs["single"]["rows"][0]["results"]
    assert all(len(result["tokens"]) == len(result["gaps"]) == 8 for result in expected)
    for name in contenders():
        for mine, theirs in zip(runs[name]["rows"][0]["results"], expected, strict=True):
            assert len(mine["tokens"]) == 8, (name, mine)
            parted = [
                i for i, (a, b) in enumerate(zip(mine["tokens"], theirs["tokens"], strict=True)) if a != b
            ]
            if parted:
                assert theirs["gaps"][parted[0]] <= report["near_tie"], (name, mine, theirs)


def test_every_hand_off_was_timed_on_both_engines(report: dict[str, Any]) -> None:
    for line in report["lines"]:
        if line["contender"] != "single":
            assert line["transfers_timed"] == REQUESTS, line
            assert line["transfer_s"]["max"] < 60.0


def test_kvrays_pushes_took_the_transport_asked_for(report: dict[str, Any]) -> None:
    [line] = [line for line in report["lines"] if line["contender"] == "kvray-shm"]
    assert line["transports"] == {"shm": REQUESTS}
