"""The `kvray` command run as a user runs it, for the end-to-end tests of its subcommands."""

from __future__ import annotations

import os
import subprocess
import sys


def run_kvray(*arguments: str, defaults: bool = False) -> subprocess.CompletedProcess[str]:
    """`python -m kvray.cli ARGUMENTS` on a fresh local Ray (RAY_ADDRESS cleared), its output
    captured; five minutes at most. `defaults`: without the tests' integrity sampling (every
    request's checksums, `tests/conftest.py`), as a user runs it."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    if defaults:
        env.pop("KVRAY_INTEGRITY_SAMPLE_RATE", None)
    return subprocess.run(
        [sys.executable, "-m", "kvray.cli", *arguments], capture_output=True, text=True, timeout=300, env=env
    )
