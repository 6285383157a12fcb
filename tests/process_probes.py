"""What tests read off processes: this one's memory mappings of a file, whether another is gone,
and a bounded wait for a condition that background tasks or other processes (heartbeats,
releases, a restarting coordinator) make true: `until` on an event loop, `wait_until` from a
thread that may block."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable


def mappings_of(path: str) -> int:
    """How many mappings of the file `path` (removed or not) this process has."""
    count = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().removesuffix(" (deleted)") == path:
                count += 1
    return count


async def until(predicate: Callable[[], bool], what: str, seconds: float = 60.0) -> None:
    """Poll `predicate` on the loop while other tasks run; the bound only stops a hang."""
    async with asyncio.timeout(seconds):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


def wait_until(predicate: Callable[[], object], what: str = "condition", seconds: float = 30.0) -> None:
    """Poll `predicate` (which may call Ray) until true; a Ray error counts as not yet (an actor
    or the coordinator may be restarting). The bound only turns a hang into a failure."""
    import ray

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except ray.exceptions.RayError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {seconds} s")


def pid_gone(pid: int) -> bool:
    """True once the process is gone and reaped: the next start on this node sweeps its files."""
    return not os.path.exists(f"/proc/{pid}")
