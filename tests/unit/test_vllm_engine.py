"""How `Engine` binds a tensor-parallel engine's CPU workers to cores: one share of the allowed
cores per rank, set only while vLLM starts, never over the user's own binding (no vLLM needed:
the platform is a stand-in)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from kvray.integrations.vllm.pd import THREADS_BIND_VARIABLE, _cpu_threads_bound, cpu_thread_binding


@pytest.mark.parametrize(
    ("ranks", "cpus", "binding"),
    [
        (2, [0, 1], "0|1"),
        (2, [1, 0], "0|1"),
        (1, [0, 1], "0,1"),
        (2, [4, 5, 6, 7, 8], "4,5,6|7,8"),
        (4, [2, 3, 4, 5], "2|3|4|5"),
        # Fewer cores than ranks: they take turns.
        (3, [0, 1], "0|1|0"),
    ],
)
def test_each_rank_gets_its_share_of_the_cores(ranks: int, cpus: list[int], binding: str) -> None:
    assert cpu_thread_binding(ranks, cpus) == binding


def test_the_default_cores_are_this_process_s() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert cpu_thread_binding(1) == ",".join(map(str, allowed))


def test_no_ranks_or_no_cores_is_refused() -> None:
    with pytest.raises(ValueError):
        cpu_thread_binding(0, [0, 1])
    with pytest.raises(ValueError):
        cpu_thread_binding(2, [])


def on_platform(monkeypatch: pytest.MonkeyPatch, *, cpu: bool) -> None:
    platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=platform))


def test_several_ranks_on_a_cpu_are_bound_while_vllm_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    on_platform(monkeypatch, cpu=True)
    monkeypatch.delenv(THREADS_BIND_VARIABLE, raising=False)
    with _cpu_threads_bound(2):
        assert os.environ[THREADS_BIND_VARIABLE] == cpu_thread_binding(2)
    # A later engine of this process, of one rank, must not inherit a list per rank of two.
    assert THREADS_BIND_VARIABLE not in os.environ


@pytest.mark.parametrize(("ranks", "cpu"), [(1, True), (2, False)])
def test_one_rank_or_another_platform_is_left_to_vllm(
    ranks: int, cpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_platform(monkeypatch, cpu=cpu)
    monkeypatch.delenv(THREADS_BIND_VARIABLE, raising=False)
    with _cpu_threads_bound(ranks):
        assert THREADS_BIND_VARIABLE not in os.environ


def test_the_users_binding_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    on_platform(monkeypatch, cpu=True)
    monkeypatch.setenv(THREADS_BIND_VARIABLE, "nobind")
    with _cpu_threads_bound(2):
        assert os.environ[THREADS_BIND_VARIABLE] == "nobind"
    assert os.environ[THREADS_BIND_VARIABLE] == "nobind"
