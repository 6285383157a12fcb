"""The `cuda_ipc` transport's devices, streams and events: which GPU a handle names, whether one
GPU reads another's memory, the streams kvray's copies run on (ordered after the model's), and
the wait for a copy's events from the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import weakref

import torch

from kvray.errors import TransportError
from kvray.memory import SourceReady

#: How long a write polls its copies' event from the event loop before a thread waits for it:
#: this much, plus the time the bytes take at `POLL_BYTES_PER_S` (a third of NVLink's rate).
POLL_FLOOR_S = 200e-6
POLL_BYTES_PER_S = 120e9


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_of_uuid(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise TransportError(
        f"GPU {uuid} is not visible to this process; the cuda_ipc writer must see the decode "
        "engine's GPU (check CUDA_VISIBLE_DEVICES)",
        device_uuid=uuid,
    )


@functools.cache
def copy_stream(device: int) -> torch.cuda.Stream:
    """The stream kvray's copies run on, one per device: apart from the model's streams, and
    not the legacy default stream (which would serialise with every other stream)."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


@functools.cache
def capture_stream(device: int) -> torch.cuda.Stream:
    """The stream row copies are captured on: no write's copies ever run on it."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


_thread_events = threading.local()


def follow_current(source_device: int, stream: torch.cuda.Stream, ready: SourceReady = None) -> None:
    """Order `stream` after the work that wrote the KV: `ready`, the event the write was given
    (`kvray.memory.SourceReady`: e.g. recorded on an engine's compute stream after a layer),
    else the work queued so far on `source_device`'s current stream. A wait takes the event's
    state when it is queued, so one event per thread and device serves every write; per thread,
    so no other thread records it between this record and this wait."""
    if ready is not None:
        stream.wait_event(ready)
        return
    produced = _produced_event(source_device)
    record_after_source(produced, source_device)
    stream.wait_event(produced)


def record_after_source(event: torch.cuda.Event, source_device: int, ready: SourceReady = None) -> None:
    """Record `event` after the work that wrote the KV on `source_device`: after `ready`, the
    event the write was given (`kvray.memory.SourceReady`), on kvray's copy stream, else on
    the device's current stream."""
    if ready is None:
        event.record(torch.cuda.current_stream(source_device))
        return
    ordering = copy_stream(source_device)
    ordering.wait_event(ready)
    event.record(ordering)


def _produced_event(source_device: int) -> torch.cuda.Event:
    """This thread's event for ordering kvray's streams after `source_device`'s current one."""
    events: dict[int, torch.cuda.Event] | None = getattr(_thread_events, "by_device", None)
    if events is None:
        events = _thread_events.by_device = {}
    produced = events.get(source_device)
    if produced is None:
        produced = events[source_device] = torch.cuda.Event()  # type: ignore[no-untyped-call]
    return produced


@functools.cache
def peer_reads(reader: int, owner: int) -> bool:
    """Whether kernels on GPU `reader` can load from memory of GPU `owner` (peer access),
    enabling it if the hardware allows. torch enables peer access from A to B the first time it
    copies from A to B; a one-byte copy does that once per pair."""
    if reader == owner:
        return True
    if not torch.cuda.can_device_access_peer(reader, owner):
        return False
    torch.empty(1, dtype=torch.uint8, device=f"cuda:{reader}").to(f"cuda:{owner}")
    torch.cuda.synchronize(reader)
    return True


async def wait_for_events(events: list[torch.cuda.Event], nbytes: int) -> None:
    """Return once every event has completed. The loop polls them between its other work for
    about as long as `nbytes` should take to copy, so the write resumes within one loop turn of
    the copy's end; a copy that runs past that (a busy or slow link) is waited for on a thread.
    A thread alone costs a wake-up on the way back: a pool thread, then the loop. One task per
    event loop polls every write's events (`_EventPoller`): many writes in flight cost one poll
    per loop turn, not one task switch each."""
    deadline = time.perf_counter() + POLL_FLOOR_S + nbytes / POLL_BYTES_PER_S
    try:
        pending = [event for event in events if not event.query()]  # type: ignore[no-untyped-call]
        if pending:
            poller = _EventPoller.of(asyncio.get_running_loop())
            await asyncio.gather(*(poller.watch(event, deadline) for event in pending))
    except asyncio.CancelledError:
        # The GPU cannot be stopped mid-copy: let the cancellation through only once nothing
        # writes into the peer's memory any more (the copies are bounded, so this wait is too).
        finishing = asyncio.ensure_future(asyncio.to_thread(_synchronize_all, events))
        while not finishing.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([finishing])
        raise


class _EventPoller:
    """The events writes of one event loop wait for: polled by one task, once per loop turn,
    each until its write's poll deadline, then handed to a thread that waits for it."""

    def __init__(self) -> None:
        self._watched: list[tuple[torch.cuda.Event, float, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        #: Threads' waits for events past their deadline (kept: a loop holds tasks weakly).
        self._waits: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _EventPoller:
        poller = _POLLERS.get(loop)
        if poller is None:
            poller = _POLLERS[loop] = cls()
        return poller

    def watch(self, event: torch.cuda.Event, deadline: float) -> asyncio.Future[None]:
        """A future resolved once `event` has completed."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._watched.append((event, deadline, done))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._poll())
        return done

    async def _poll(self) -> None:
        while self._watched:
            await asyncio.sleep(0)
            now = time.perf_counter()
            watched, self._watched = self._watched, []
            for event, deadline, done in watched:
                if done.done():  # its write was cancelled
                    continue
                if event.query():  # type: ignore[no-untyped-call]
                    done.set_result(None)
                elif now >= deadline:
                    wait = asyncio.get_running_loop().create_task(_on_thread(event, done))
                    self._waits.add(wait)
                    wait.add_done_callback(self._waits.discard)
                else:
                    self._watched.append((event, deadline, done))


_POLLERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _EventPoller] = weakref.WeakKeyDictionary()


async def _on_thread(event: torch.cuda.Event, done: asyncio.Future[None]) -> None:
    try:
        await asyncio.to_thread(event.synchronize)
    except asyncio.CancelledError:
        done.cancel()
        raise
    except Exception as error:  # the waiting write gets it
        if not done.done():
            done.set_exception(error)
        return
    if not done.done():
        done.set_result(None)


def _synchronize_all(events: list[torch.cuda.Event]) -> None:
    for event in events:
        event.synchronize()
