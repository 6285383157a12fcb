"""The parts of the cuda_ipc transport that need no GPU: element width, handle encoding,
availability (when `auto` picks it: tests/unit/test_transport_choice.py)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvray.config import Settings
from kvray.transport import availability
from kvray.transport.cuda_ipc import pick_unit, streams, wait_for_events
from kvray.wire import CudaIpcHandle, TransportKind


def test_pick_unit_is_the_widest_common_divisor() -> None:
    a = np.array([0, 64, 4096], dtype=np.int64)
    assert pick_unit(a, a) == 16
    assert pick_unit(a, np.array([8], dtype=np.int64)) == 8
    assert pick_unit(a, bases=(2,)) == 2
    assert pick_unit(np.array([3], dtype=np.int64)) == 1


def test_handle_round_trips_through_msgspec() -> None:
    import msgspec

    handle = CudaIpcHandle(
        device_uuid="GPU-1",
        handle=b"\x01" * 64,
        storage_size=1 << 30,
        storage_offset=4096,
        ref_counter_handle=b"ref",
        ref_counter_offset=8,
        event_handle=b"",
        event_sync_required=False,
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=CudaIpcHandle) == handle


def test_unavailable_without_a_gpu_says_why() -> None:
    reason = availability(Settings())[TransportKind.CUDA_IPC]
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert reason is not None and "CUDA" in reason


class _Event:
    """Stands in for a torch.cuda.Event: done after `polls` queries, or when synchronized."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.queries = 0
        self.synchronized_on: list[int] = []

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.polls

    def synchronize(self) -> None:
        self.synchronized_on.append(threading.get_ident())
        self.polls = 0


async def test_a_write_polls_its_copy_events_from_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "POLL_FLOOR_S", 30.0)  # a loaded machine cannot run out the window
    events = [_Event(polls=3), _Event(polls=0)]
    await wait_for_events(events, nbytes=2**20)  # type: ignore[arg-type]
    assert [e.synchronized_on for e in events] == [[], []], "a thread waited for a copy that was quick"
    assert events[0].queries == 4


async def test_writes_in_flight_share_one_poller(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sixteen writes waiting at once are polled by one task, and each returns once its copy has."""
    monkeypatch.setattr(streams, "POLL_FLOOR_S", 30.0)
    events = [_Event(polls=index * 3) for index in range(16)]
    before = {task for task in asyncio.all_tasks() if "_poll" in repr(task)}
    writes = [asyncio.create_task(wait_for_events([event], nbytes=0)) for event in events]  # type: ignore[list-item]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    pollers = {task for task in asyncio.all_tasks() if "_poll" in repr(task)} - before
    assert len(pollers) == 1
    await asyncio.gather(*writes)
    assert all(event.queries > event.polls for event in events)
    assert all(not event.synchronized_on for event in events)


async def test_a_copy_running_past_the_poll_window_is_waited_for_on_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(streams, "POLL_FLOOR_S", 0.0)
    slow = _Event(polls=10**9)
    await wait_for_events([slow], nbytes=0)  # type: ignore[list-item]
    assert len(slow.synchronized_on) == 1 and slow.synchronized_on[0] != threading.get_ident()


async def test_a_cancelled_write_returns_only_once_its_copies_are_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(streams, "POLL_FLOOR_S", 60.0)  # would poll for a minute
    running = _Event(polls=10**9)
    task = asyncio.create_task(wait_for_events([running], nbytes=0))  # type: ignore[list-item]
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(running.synchronized_on) == 1, "the write was cancelled with its copy still running"


# ---- an exporter's claimed sizes are checked against the allocation the driver knows -------------


@given(
    st.integers(0, 2**40),
    st.integers(1, 2**30),
    st.integers(-(2**31), 2**31),
    st.integers(1, 2**31),
)
def test_inside_allocation_is_exactly_containment(
    allocation_start: int, allocation_nbytes: int, offset: int, region_nbytes: int
) -> None:
    from kvray.errors import RegionError
    from kvray.transport.cuda_ipc.allocation import check_inside_allocation

    inside = offset >= 0 and offset + region_nbytes <= allocation_nbytes
    region_start = allocation_start + offset
    if inside:
        check_inside_allocation(
            region_start, region_nbytes, (allocation_start, allocation_nbytes), engine_id="d", region=0
        )
    else:
        with pytest.raises(RegionError, match="did not export") as raised:
            check_inside_allocation(
                region_start, region_nbytes, (allocation_start, allocation_nbytes), engine_id="d", region=0
            )
        assert raised.value.engine_id == "d" and raised.value.allocation_nbytes == allocation_nbytes


def test_a_claim_of_twice_the_allocation_is_refused() -> None:
    from kvray.errors import RegionError
    from kvray.transport.cuda_ipc.allocation import check_inside_allocation

    allocation = (0x7F0000000000, 512 * 1024)
    check_inside_allocation(allocation[0], 512 * 1024, allocation, engine_id="d", region=0)
    for start, nbytes in [
        (allocation[0], 2 * 512 * 1024),  # twice its size
        (allocation[0], 64 * 512 * 1024),
        (allocation[0] + 4096, 512 * 1024),  # shifted past the end
        (allocation[0] - 4096, 4096),  # before the start
    ]:
        with pytest.raises(RegionError):
            check_inside_allocation(start, nbytes, allocation, engine_id="d", region=0)
