"""The `kvray` command run as a user runs it, for the end-to-end tests of its subcommands."""

from __future__ import annotations

import os
import subprocess
import sys


def run_kvray(*arguments: str) -> subprocess.CompletedProcess[str]:
    """`python -m kvray.cli ARGUMENTS` on a fresh local Ray (RAY_ADDRESS cleared), its output
    captured; five minutes at most."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    return subprocess.run(
        [sys.executable, "-m", "kvray.cli", *arguments], capture_output=True, text=True, timeout=300, env=env
    )
