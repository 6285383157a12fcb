"""`kvray demo`, the README's main command, as a user runs it: exits 0 and prints 100%."""

from __future__ import annotations

import pytest
from kvray_command import run_kvray

pytestmark = pytest.mark.usefixtures("own_ray")


def test_demo_command_passes() -> None:
    result = run_kvray("demo", "--prompts", "10", "--max-new-tokens", "6")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "exact match, disaggregated vs colocated  100.0% (10/10)" in result.stdout
    assert "RESULT: PASS" in result.stdout


def test_demo_command_fails_loudly_with_the_seed_bug() -> None:
    # At the defaults (no request's checksums sampled): the placement and content digests.
    result = run_kvray("demo", "--prompts", "6", "--max-new-tokens", "6", "--inject-seed-bug", defaults=True)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RESULT: FAIL" in result.stdout
    # Caught before decoding: the requests with wrong KV are refused, none decoded from it.
    assert "requests refused, not decoded" in result.stdout
