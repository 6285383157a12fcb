"""Workers with faults a test switches on: copies held mid-transfer, a decode engine that takes
its writes slowly. They run in Ray actors; `workers_by_value` (conftest) ships them by value."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvray.workers import DecodeWorker, PrefillWorker


class CopyGate:
    """Stands in front of the batched copies the copy threads run (the C copy pool's claims of a
    few ops, through its test hook; without the C extension, `kvray.transport.cpu_copy`'s
    `scatter_copy` on Python threads): the first `pass_calls` copies run, later ones wait at a
    gate, in the copy threads, so the actor's event loop still answers while a transfer is stuck
    halfway."""

    def __init__(self, pass_calls: int) -> None:
        self.pass_calls = pass_calls
        self.calls = 0
        self.held = 0
        self.gate = threading.Event()
        self.lock = threading.Lock()

    def admit(self, *_: Any) -> bool:
        with self.lock:
            self.calls += 1
            hold = self.calls > self.pass_calls
            if hold:
                self.held += 1
        if hold:
            self.gate.wait(120)  # the test opens it, or kills this process
        return True

    def wrap(self, original: Any) -> Any:
        def copy(*args: Any) -> Any:
            self.admit()
            return original(*args)

        return copy


class HoldingPrefill(PrefillWorker):
    """A prefill worker whose transfers can be stopped halfway (to kill it, or its peer, there)."""

    _gate: CopyGate | None = None

    async def hold_copies(self, pass_calls: int) -> None:
        """From now on every batch is copied by two threads; after `pass_calls` copies, hold."""
        from kvray.transport import cpu_copy

        self._gate = CopyGate(pass_calls)
        cpu_copy._PARALLEL_THRESHOLD = 1
        cpu_copy.copy_threads = lambda: 2
        if cpu_copy.native():
            import kvray._copy_pool

            # Ops cut into 64-byte pieces, claimed 4 at a time: however few ops a request has,
            # the first claim passes and the rest of the transfer waits.
            cpu_copy._CLAIM_NBYTES = 64
            kvray._copy_pool.set_worker_hook(self._gate.admit)
        else:
            cpu_copy.scatter_copy = self._gate.wrap(cpu_copy.scatter_copy)

    async def held(self) -> int:
        return self._gate.held if self._gate is not None else 0

    async def release_copies(self) -> None:
        if self._gate is not None:
            self._gate.gate.set()

    async def pid(self) -> int:
        return os.getpid()


class SlowDecode(DecodeWorker):
    """A decode worker whose `ray`-transport deliveries wait at a gate before kvray sees them: a
    slow consumer. It counts the deliveries it holds at once (each one holds a payload)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open = asyncio.Event()
        self._open.set()
        self._stubborn = False
        self.arrived = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.cancelled = 0

    async def close_gate(self, stubborn: bool = False) -> None:
        """Hold deliveries; `stubborn`: held ones ignore cancellation (as one already past the
        point where a cancel reaches it would)."""
        self._open.clear()
        self._stubborn = stubborn

    async def open_gate(self) -> None:
        self._open.set()

    async def kvray_deliver(self, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        self.arrived += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            while not self._open.is_set():
                try:
                    await self._open.wait()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    if not self._stubborn:
                        raise
            return await super().kvray_deliver(header, payload)
        finally:
            self.in_flight -= 1

    async def deliveries(self) -> dict[str, int]:
        return {
            "arrived": self.arrived,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "cancelled": self.cancelled,
        }

    async def pid(self) -> int:
        return os.getpid()


class PlainDecode(DecodeWorker):
    async def pid(self) -> int:
        return os.getpid()
