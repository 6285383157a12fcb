"""Backpressure: a flood of pushes into a decode engine that takes its writes slowly.

An agent runs at most `max_concurrent_transfers` pushes at once (each holds one gathered
payload), lets `max_queued_transfers` more wait for a slot within their deadline, and refuses
the rest at once with `BackpressureError`, so memory held for a stalled peer is bounded by
settings, not by the flood. Work past its deadline fails with `TransferTimeoutError`, the decode
side is told, and writes still on their way when that happens are refused when they arrive: no
byte lands in blocks that were freed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import ray
from process_probes import wait_until

from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import BackpressureError, KvrayError, TransferTimeoutError
from kvray.layout import llama_gqa
from kvray.wire import Reservation, decode_engine_info

FLOOD = 30
BLOCKS_PER_REQUEST = 2
RUNNING, QUEUED = 2, 3
NEVER_HANG_S = 120.0


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _late_pushes(prefill: Any, decode: Any, prefix: str, count: int, *, parked: int = 0) -> int:
    """`count` pushes into the stalled decode with a 3 s deadline: all fail with
    TransferTimeoutError, and the decode's waits for them fail (it frees their blocks).
    `parked`: that many of their deliveries reach the decode's gate first, waited for under an
    8 s deadline instead (on a loaded machine a call still queued when its push gives up is
    dropped, not delivered)."""
    late = {}
    for i in range(count):
        request_id = f"{prefix}-{i}"
        ray.get(prefill.allocate.remote(request_id, BLOCKS_PER_REQUEST))
        reservation = ray.get(decode.reserve.remote(request_id, BLOCKS_PER_REQUEST))
        late[request_id] = (decode.wait.remote(request_id, 8.0), reservation)
    deadline = 3.0 if not parked else 8.0
    pushes = [prefill.push.remote(reservation, timeout=deadline) for _, reservation in late.values()]
    if parked:
        wait_until(
            lambda: ray.get(decode.deliveries.remote())["in_flight"] == parked,
            what="the late deliveries parked at the decode",
        )
    for ref in pushes:
        with pytest.raises(TransferTimeoutError):
            ray.get(ref, timeout=NEVER_HANG_S)
    for waiting, _ in late.values():
        with pytest.raises(KvrayError):
            ray.get(waiting, timeout=NEVER_HANG_S)
    return count


def test_flood_into_a_stalled_decode_is_bounded(
    workers_by_value: Any, canary_mask: Any, figures: Callable[[str], None]
) -> None:
    settings = Settings(
        transport="ray",
        max_concurrent_transfers=RUNNING,
        max_queued_transfers=QUEUED,
        notify_timeout_s=5.0,
        lookup_timeout_s=5.0,
        coordinator_name="kvray-coordinator-backpressure",
    )
    layout = llama_gqa(FLOOD * BLOCKS_PER_REQUEST, num_layers=8)  # 512 KiB a block
    request_nbytes = BLOCKS_PER_REQUEST * sum(spec.geometry.block_nbytes for spec in layout.layers)
    prefill = ray.remote(workers_by_value.HoldingPrefill).remote("flood-p", layout, settings)
    decode = ray.remote(workers_by_value.SlowDecode).remote("flood-d", layout, settings)
    ray.get([prefill.start.remote(), decode.start.remote()])
    pids = ray.get([prefill.pid.remote(), decode.pid.remote()])
    ray.get(decode.fill_region.remote(11))
    before = ray.get(decode.snapshot.remote())[0]

    requests: dict[str, tuple[Reservation, dict[str, Any], Any]] = {}
    for i in range(FLOOD):
        request_id = f"flood-{i}"
        src = ray.get(prefill.allocate.remote(request_id, BLOCKS_PER_REQUEST))
        ray.get(prefill.fill_random.remote(request_id, i))
        expected = ray.get(prefill.read_blocks.remote(src))
        reservation = ray.get(decode.reserve.remote(request_id, BLOCKS_PER_REQUEST))
        requests[request_id] = (reservation, expected, decode.wait.remote(request_id, NEVER_HANG_S))
    rss_before = sum(_rss_mib(pid) for pid in pids)

    def push(request_id: str) -> Any:
        reservation, _, _ = requests[request_id]
        return prefill.push.remote(reservation, keep_blocks=True)

    ray.get(decode.close_gate.remote())
    flood = {request_id: push(request_id) for request_id in requests}
    expected_rejections = FLOOD - RUNNING - QUEUED
    wait_until(
        lambda: (
            ray.get(prefill.stats.remote()).get("transfers_whole_rejected", 0) == expected_rejections
            and ray.get(decode.deliveries.remote())["arrived"] == RUNNING
        ),
        what="the flood admitted, queued and refused",
    )
    rss_stalled = sum(_rss_mib(pid) for pid in pids)
    # The admitted and queued pushes cannot finish while the decode is stalled (their deadline is
    # a minute away), so the first results to come back are exactly the refused ones.
    refs = {ref: request_id for request_id, ref in flood.items()}
    ready, _ = ray.wait(list(refs), num_returns=expected_rejections, timeout=NEVER_HANG_S)
    rejected = []
    for ref in ready:
        with pytest.raises(BackpressureError):
            ray.get(ref)
        rejected.append(refs[ref])
    assert len(rejected) == expected_rejections
    held = ray.get(decode.deliveries.remote())
    assert (held["arrived"], held["in_flight"], held["peak_in_flight"]) == (RUNNING, RUNNING, RUNNING)

    # The stalled decode catches up: the admitted and queued pushes land; the refused ones are
    # retried (what a router does with BackpressureError) until every request has landed.
    ray.get(decode.open_gate.remote())
    for request_id, ref in flood.items():
        if request_id not in rejected:
            ray.get(ref, timeout=NEVER_HANG_S)
    rounds = 0
    while rejected:
        rounds += 1
        assert rounds <= 50, "retries never got through"
        retry = {request_id: push(request_id) for request_id in rejected}
        rejected = []
        for request_id, ref in retry.items():
            try:
                ray.get(ref, timeout=NEVER_HANG_S)
            except BackpressureError:
                rejected.append(request_id)
    peak = ray.get(decode.deliveries.remote())["peak_in_flight"]
    assert peak <= RUNNING, f"the decode held {peak} deliveries at once"
    for request_id, (reservation, expected, waiting) in requests.items():
        ray.get(waiting, timeout=NEVER_HANG_S)
        landed = ray.get(decode.read_blocks.remote(list(reservation.blocks)))
        for layer, data in expected.items():
            assert np.array_equal(landed[layer], data), f"{request_id} {layer}"
        ray.get(prefill.release.remote(request_id))
        ray.get(decode.release.remote(request_id))
    info = decode_engine_info(ray.get(get_or_create_coordinator(settings).lookup.remote("flood-d", 5.0))[0])
    (offset, old), new = before, ray.get(decode.snapshot.remote())[0][1]
    written = [(list(reservation.blocks), None) for reservation, *_ in requests.values()]
    mask = canary_mask(info, offset, old.size, written)
    assert np.array_equal(old[~mask], new[~mask])

    # Past the deadline: pushes stuck at the stalled decode, and one waiting for a slot, fail with
    # TransferTimeoutError; their deliveries are cancelled (no payload stays parked at the peer)
    # and the decode is told, so it frees their blocks.
    ray.get(decode.close_gate.remote())
    late = _late_pushes(prefill, decode, "late", RUNNING + 1)
    wait_until(
        lambda: ray.get(decode.deliveries.remote())["in_flight"] == 0, what="late deliveries cancelled"
    )
    cancelled = ray.get(decode.deliveries.remote())["cancelled"]
    assert ray.get(decode.free_count.remote()) == layout.num_blocks
    ray.get(decode.open_gate.remote())

    # A delivery the cancel does not reach arrives after its request failed, and is refused: no
    # byte lands in the freed blocks, now reserved by another request.
    ray.get(decode.fill_region.remote(12))
    before_late = ray.get(decode.snapshot.remote())[0][1]
    ray.get(decode.close_gate.remote(stubborn=True))
    _late_pushes(prefill, decode, "stubborn", 1, parked=1)
    reused = ray.get(decode.reserve.remote("reuses-freed-blocks", BLOCKS_PER_REQUEST))
    ray.get(decode.open_gate.remote())
    wait_until(
        lambda: ray.get(decode.stats.remote()).get("messages_dropped_unexpected_write", 0) == 1,
        what="the late write refused",
    )
    assert np.array_equal(before_late, ray.get(decode.snapshot.remote())[0][1]), (
        "a write that arrived after its request failed changed the decode's memory"
    )
    ray.get(decode.release.remote("reuses-freed-blocks"))
    assert ray.get([prefill.free_count.remote(), decode.free_count.remote()]) == [layout.num_blocks] * 2
    figures(
        f"[kvray backpressure] flood of {FLOOD} pushes ({request_nbytes / 2**20:.0f} MiB each) into a "
        f"stalled decode, max_concurrent_transfers={RUNNING} max_queued_transfers={QUEUED}: {RUNNING} "
        f"running, {QUEUED} queued, {expected_rejections} refused at once with BackpressureError; "
        f"payloads held at the decode at most {peak}; RSS of both actors grew "
        f"{rss_stalled - rss_before:+.1f} MiB while stalled (an unbounded queue would hold "
        f"{FLOOD * request_nbytes / 2**20:.0f} MiB); all {FLOOD} landed exactly after {rounds} retry "
        f"rounds; past a 3 s deadline {late} pushes failed with TransferTimeoutError, their {cancelled} "
        "parked deliveries were cancelled, and a late write that got through was refused (0 bytes "
        "into freed blocks)"
    )
    del reused
    for actor in (prefill, decode):
        ray.kill(actor)
