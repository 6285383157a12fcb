"""A prefill worker whose cuda_ipc writes can be held after their copy kernel was queued and
before the write returns (so before the completion is sent): a transfer stopped halfway, to
kill it or its peer there. It runs in a Ray actor; the GPU tests ship it by value."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from kvray.workers import PrefillWorker


class HoldingGpuPrefill(PrefillWorker):
    _gate: asyncio.Event | None = None
    _holding = 0

    async def hold_writes(self) -> None:
        """From now on every cuda_ipc write waits at a gate once its copies are queued."""
        # The name the transport's write looks up when it waits for its copies.
        from kvray.transport.cuda_ipc import transport

        gate = self._gate = asyncio.Event()
        original = transport.wait_for_events

        async def held(events: Any, nbytes: int) -> None:
            self._holding += 1
            await gate.wait()
            await original(events, nbytes)

        transport.wait_for_events = held  # type: ignore[assignment]

    async def held(self) -> int:
        return self._holding

    async def release_writes(self) -> None:
        if self._gate is not None:
            self._gate.set()

    async def pid(self) -> int:
        return os.getpid()
