"""`kvray demo`, the README's main command, as a user runs it: exits 0 and prints 100%."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster


def test_demo_command_passes() -> None:
    env = {**os.environ, "RAY_ADDRESS": ""}
    result = subprocess.run(
        [sys.executable, "-m", "kvray.cli", "demo", "--prompts", "10", "--max-new-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "exact match, disaggregated vs colocated  100.0% (10/10)" in result.stdout
    assert "RESULT: PASS" in result.stdout


def test_demo_command_fails_loudly_with_the_seed_bug() -> None:
    env = {**os.environ, "RAY_ADDRESS": ""}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvray.cli",
            "demo",
            "--prompts",
            "6",
            "--max-new-tokens",
            "6",
            "--inject-seed-bug",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 1
    assert "RESULT: FAIL" in result.stdout
