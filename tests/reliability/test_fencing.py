"""Incarnation fencing: a decode engine restarts under the same id (new incarnation, new
memory). A prefill still holding the old life's descriptors, or only the old incarnation its
blocks were reserved in, is refused with a stale-incarnation error and writes nothing into the
new backing (canaries over the whole allocation). Completions naming the old incarnation, or a
request the engine does not expect, are dropped and counted, by Ray call and by the same-node
completion socket alike."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import ray
from process_probes import pid_gone, wait_until

from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import StaleIncarnationError, UnknownEngineError, WriteFailedError
from kvray.layout import llama_gqa
from kvray.notice.local import ENDPOINT
from kvray.wire import TransferDone, decode_engine_info, encode
from kvray.workers import DecodeActor, PrefillActor

NUM_BLOCKS = 12
NEVER_HANG_S = 90.0


def _done(request_id: str, engine: str, incarnation: int, transfer_id: str, token: int) -> bytes:
    return encode(
        TransferDone(
            transfer_id=transfer_id,
            request_id=request_id,
            src_engine="forger",
            src_incarnation=1,
            dst_engine=engine,
            dst_incarnation=incarnation,
            nbytes=1,
            token=token,
        )
    )


@pytest.mark.parametrize("transport", ["shm", "ray"])
def test_restarted_decode_refuses_its_old_life(
    workers_by_value: Any, canary_mask: Any, figures: Callable[[str], None], transport: str
) -> None:
    settings = Settings(
        transport=transport,
        heartbeat_s=0.3,
        lookup_timeout_s=5.0,
        notify_timeout_s=5.0,
        coordinator_name="kvray-coordinator-fencing",
    )
    coordinator = get_or_create_coordinator(settings)
    layout = llama_gqa(NUM_BLOCKS, num_layers=3)
    decode_id = f"fence-d-{transport}"
    holder = PrefillActor.remote(f"fence-holder-{transport}", layout, settings)
    fresh = PrefillActor.remote(f"fence-fresh-{transport}", layout, settings)
    old = ray.remote(workers_by_value.PlainDecode).remote(decode_id, layout, settings)
    ray.get([holder.start.remote(), fresh.start.remote(), old.start.remote()])

    # The holder pushes once into the old life: it now holds that life's descriptors (and, for
    # shm, a mapping of its memory).
    ray.get(holder.allocate.remote("warm", 2))
    warm = ray.get(old.reserve.remote("warm", 2))
    old_incarnation = warm.incarnation
    waiting = old.wait.remote("warm", 30.0)
    ray.get(holder.push.remote(warm), timeout=NEVER_HANG_S)
    ray.get(waiting, timeout=NEVER_HANG_S)
    # Blocks reserved in the old life, for requests whose KV is not pushed yet.
    reserved = {rid: ray.get(old.reserve.remote(rid, 3)) for rid in ("a", "b", "c")}

    old_pid = ray.get(old.pid.remote())
    ray.kill(old)

    def dropped() -> bool:
        try:
            ray.get(coordinator.lookup.remote(decode_id, 0.1))
        except UnknownEngineError:
            return True
        return False

    wait_until(dropped, what="the old incarnation leaving the directory")
    wait_until(lambda: pid_gone(old_pid), what="the old decode process reaped")
    new = DecodeActor.remote(decode_id, layout, settings)
    new_incarnation = ray.get(new.start.remote())["incarnation"]
    assert new_incarnation != old_incarnation
    ray.get(new.fill_region.remote(77))
    canaries = ray.get(new.snapshot.remote())

    refused = []
    for request_id, prefill, layerwise in (("a", holder, False), ("b", fresh, False), ("c", holder, True)):
        ray.get(prefill.allocate.remote(request_id, 3))
        ray.get(prefill.fill_random.remote(request_id, ord(request_id)))
        with pytest.raises(StaleIncarnationError) as raised:
            ray.get(prefill.push.remote(reserved[request_id], layerwise=layerwise), timeout=NEVER_HANG_S)
        assert raised.value.facts["stale_incarnation"] == old_incarnation
        refused.append(request_id)
    assert ray.get(new.snapshot.remote())[0][1].tobytes() == canaries[0][1].tobytes(), (
        "a push fenced as stale wrote into the new incarnation's backing"
    )
    assert ray.get([holder.free_count.remote(), fresh.free_count.remote()]) == [NUM_BLOCKS, NUM_BLOCKS]

    # Completions naming the old incarnation, or a request the new life does not expect, even
    # with the request's own token; or the right request without its token. Through Ray the
    # sender is told (the call raises); through the socket they are dropped silently.
    reservation = ray.get(new.reserve.remote("d", 2))
    assert reservation.incarnation == new_incarnation
    token = reservation.token
    waiting = new.wait.remote("d", 30.0)
    info = decode_engine_info(ray.get(coordinator.lookup.remote(decode_id, 5.0))[0])
    with pytest.raises(StaleIncarnationError):
        ray.get(new.kvray_notify.remote(_done("d", decode_id, old_incarnation, "stale-by-ray", token)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.sendto(
            _done("d", decode_id, old_incarnation, "stale-by-socket", token), info.endpoints[ENDPOINT]
        )
        sender.sendto(
            _done("nobody", decode_id, new_incarnation, "unknown-by-socket", token), info.endpoints[ENDPOINT]
        )
        sender.sendto(_done("d", decode_id, new_incarnation, "forged-by-socket", 0), info.endpoints[ENDPOINT])
    with pytest.raises(WriteFailedError):
        ray.get(new.kvray_notify.remote(_done("nobody", decode_id, new_incarnation, "unknown-by-ray", token)))
    with pytest.raises(WriteFailedError):
        ray.get(new.kvray_notify.remote(_done("d", decode_id, new_incarnation, "forged-by-ray", token + 1)))

    def counted() -> bool:
        stats = ray.get(new.stats.remote())
        return bool(
            stats["messages_dropped_stale"] == 2
            and stats["messages_dropped_unknown"] == 2
            and stats["messages_dropped_forged"] == 2
        )

    wait_until(counted, what="six forged completions dropped and counted")

    # The real push resolves the wait: the forged completions did not.
    ray.get(holder.allocate.remote("d", 2))
    ray.get(holder.fill_random.remote("d", 4))
    pushed = ray.get(holder.push.remote(reservation), timeout=NEVER_HANG_S)
    completion = ray.get(waiting, timeout=NEVER_HANG_S)
    assert completion.transfer_id == pushed.transfer_id
    with pytest.raises(WriteFailedError):  # a replay, token and all
        ray.get(new.kvray_notify.remote(_done("d", decode_id, new_incarnation, pushed.transfer_id, token)))
    assert ray.get(new.stats.remote())["messages_dropped_unknown"] == 3
    (offset, before), (_, after) = canaries[0], ray.get(new.snapshot.remote())[0]
    mask = canary_mask(info, offset, before.size, [(list(reservation.blocks), None)])
    assert np.array_equal(before[~mask], after[~mask])
    stats = ray.get(new.stats.remote())
    figures(
        f"[kvray fencing] {transport}: decode restarted under the same id; {len(refused)} pushes aimed "
        f"at the old incarnation refused with StaleIncarnationError (cached descriptors, reserved "
        f"incarnation only, layer-wise), 0 bytes written into the new backing; forged completions "
        f"dropped and counted: stale={stats['messages_dropped_stale']} "
        f"unknown={stats['messages_dropped_unknown']} forged={stats['messages_dropped_forged']}"
    )
    ray.get(new.release.remote("d"))
    for actor in (holder, fresh, new):
        ray.kill(actor)
