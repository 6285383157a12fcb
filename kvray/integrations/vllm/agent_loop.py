"""The agent's event loop inside a vLLM worker: an asyncio loop on a daemon thread of its own,
free to run on every core the engine's threads may use.

vLLM's CPU worker binds its main thread to one core (its OpenMP threads to the rank's others),
and that main thread spins on its input queue between steps. A thread started from it inherits
the one core: the agent's loop and the copy threads it starts (`kvray._copy_pool`) would share
it with the spinning thread, and a push copied at a fraction of the memory's speed. The loop's
thread takes instead the union of the cores the process's threads are allowed (the rank's
cores); threads it starts inherit that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("kvray.vllm")

T = TypeVar("T")

#: Where Linux lists a process's threads.
TASKS = Path("/proc/self/task")


def parse_cpu_list(text: str) -> set[int]:
    """The cores of a kernel CPU list ("0-3,8,10-11")."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def process_cores(tasks: Path = TASKS) -> set[int]:
    """The cores any thread of this process may run on (empty where that cannot be read)."""
    cores: set[int] = set()
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return cores
    for thread in threads:
        try:
            status = (thread / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cores |= parse_cpu_list(line.partition(":")[2])
    return cores


def spread_this_thread(tasks: Path = TASKS) -> set[int] | None:
    """Let the calling thread run on every core of `process_cores` (where it may run on fewer);
    the cores it now has, or None where it was left as it was."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = process_cores(tasks)
    mine = os.sched_getaffinity(0)
    if not cores or cores <= mine:
        return None
    try:
        os.sched_setaffinity(0, cores)
    except OSError as error:  # a core offline since, or a cpuset that forbids it
        log.debug("kvray: the agent's loop keeps cores %s: %s", sorted(mine), error)
        return None
    return cores


class AgentLoop:
    """An asyncio event loop on a daemon thread of its own, for the agent (see the module)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        #: The cores the loop's thread took (None: it kept those it started with).
        self.cores: set[int] | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        try:
            self.cores = spread_this_thread()
        finally:
            started.set()
        self.loop.run_forever()

    def submit(self, work: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def run(self, work: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `work` on the loop and wait for it here (set-up and shut-down only)."""
        return self.submit(work).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            # Releases the loop's selector and self-pipe; a loop whose thread did not stop in
            # time is left to that daemon thread.
            self.loop.close()
