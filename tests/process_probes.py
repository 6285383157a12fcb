"""What tests read off their own process: its memory mappings of a file, and a bounded wait
for a condition that background tasks (heartbeats, releases) make true."""

from __future__ import annotations

import asyncio
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
