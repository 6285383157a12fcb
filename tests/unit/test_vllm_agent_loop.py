"""The connector's event-loop thread (`kvray.integrations.vllm.agent_loop`): started from a thread
bound to one core (as vLLM's CPU worker binds its main thread), it takes every core the
process's threads may use, and so do the threads it starts (the copy pool's, a loop's
executor's): a push is not copied on the one core the engine's spinning thread holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvray.integrations.vllm.agent_loop import parse_cpu_list, process_cores

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,4,6-7\n", {0, 1, 4, 6, 7}), ("", set())],
)
def test_a_kernel_cpu_list_is_read_as_the_cores_it_names(text: str, cores: set[int]) -> None:
    assert parse_cpu_list(text) == cores


def test_the_process_cores_are_the_union_of_its_threads(tmp_path: Path) -> None:
    for tid, allowed in (("10", "0"), ("11", "1-2"), ("12", "5")):
        (tmp_path / tid).mkdir()
        status = f"Name:\tx\nCpus_allowed:\tff\nCpus_allowed_list:\t{allowed}\n"
        (tmp_path / tid / "status").write_text(status)
    (tmp_path / "13").mkdir()  # a thread that ended while it was read
    assert process_cores(tmp_path) == {0, 1, 2, 5}
    assert process_cores(tmp_path / "missing") == set()


CHILD = textwrap.dedent(
    """
    import asyncio, json, os, threading
    from kvray.integrations.vllm.agent_loop import AgentLoop

    every = os.sched_getaffinity(0)
    stop = threading.Event()
    # An engine's worker thread (OpenMP's) keeps the rank's other cores...
    helper = threading.Thread(target=stop.wait)
    helper.start()
    # ...while its main thread is bound to the first one.
    os.sched_setaffinity(0, {min(every)})
    loop = AgentLoop("kvray-test")
    executor = loop.run(asyncio.to_thread(os.sched_getaffinity, 0), 10)
    main = os.sched_getaffinity(0)
    print(json.dumps([sorted(every), sorted(loop.cores or ()), sorted(executor), sorted(main)]))
    loop.stop()
    stop.set()
    helper.join()
    """
)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two cores",
)
def test_the_loop_started_from_a_thread_bound_to_one_core_runs_on_all_of_the_ranks() -> None:
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    every, loop_cores, executor_thread, main_thread = json.loads(child.stdout)
    assert loop_cores == every, "the loop's thread kept the one core it was started from"
    assert executor_thread == every, "a thread the loop starts inherits its cores"
    assert main_thread == [min(every)], "the engine's own thread is left bound"
