"""Kill tests on a local multi-actor cluster: the prefill actor mid-transfer, the decode actor
mid-transfer, one of two decode actors, the coordinator mid-workload. For each, the survivor
gets a kvray error within its deadline (never a hang), its blocks are back in its pool, the
directory drops the dead engine (or, for the coordinator, comes back with every engine), and
new transfers between the survivors and restarted actors land with the right bytes and touch
nothing else."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import ray
from process_probes import pid_gone, wait_until

from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import KvrayError, TransferTimeoutError, TransportError, UnknownEngineError
from kvray.layout import BlockOrder, mixed
from kvray.wire import EngineInfo, decode_engine_info
from kvray.workers import DecodeActor, PrefillActor

NUM_BLOCKS = 16
WAIT_DEADLINE_S = 5.0
PUSH_DEADLINE_S = 20.0
#: Only turns a hang into a failure: far above every deadline in play.
NEVER_HANG_S = 90.0


def _settings(transport: str, coordinator: str = "kvray-coordinator-kill") -> Settings:
    return Settings(
        transport=transport,
        heartbeat_s=0.3,
        lookup_timeout_s=5.0,
        notify_timeout_s=5.0,
        transfer_timeout_s=PUSH_DEADLINE_S,
        coordinator_name=coordinator,
    )


def kvray_type(error: BaseException) -> str:
    """The kvray class of an error that crossed Ray (which wraps it in a RayTaskError)."""
    return type(getattr(error, "cause", None) or error).__name__


def _info(settings: Settings, engine_id: str) -> EngineInfo:
    coordinator = get_or_create_coordinator(settings)
    return decode_engine_info(ray.get(coordinator.lookup.remote(engine_id, 10.0))[0])


def _dropped(settings: Settings, engine_id: str) -> Callable[[], bool]:
    coordinator = get_or_create_coordinator(settings)

    def check() -> bool:
        try:
            ray.get(coordinator.lookup.remote(engine_id, 0.1))
        except UnknownEngineError:
            return True
        return False

    return check


def _transfer_and_check(
    prefill: Any,
    decode: Any,
    decode_id: str,
    request_id: str,
    count: int,
    seed: int,
    canary_mask: Any,
    settings: Settings,
    also_written: list[list[int]] | None = None,
) -> int:
    """One push on a healthy pair: the bytes land, nothing outside the request's blocks (and
    `also_written`, blocks an earlier, interrupted transfer may have reached) changes. Returns
    the bytes moved."""
    ray.get(decode.fill_region.remote(seed))
    before = ray.get(decode.snapshot.remote())
    src = ray.get(prefill.allocate.remote(request_id, count))
    ray.get(prefill.fill_random.remote(request_id, seed))
    expected = ray.get(prefill.read_blocks.remote(src))
    reservation = ray.get(decode.reserve.remote(request_id, count))
    assert reservation.engine_id == decode_id
    dst = list(reservation.blocks)
    waiting = decode.wait.remote(request_id, 30.0)
    result = ray.get(prefill.push.remote(reservation), timeout=NEVER_HANG_S)
    ray.get(waiting, timeout=NEVER_HANG_S)
    landed = ray.get(decode.read_blocks.remote(dst))
    for layer, data in expected.items():
        assert np.array_equal(landed[layer], data), f"{request_id}: layer {layer} did not land"
    (offset, old), (_, new) = before[0], ray.get(decode.snapshot.remote())[0]
    written = [(dst, None)] + [(blocks, None) for blocks in also_written or []]
    mask = canary_mask(_info(settings, decode_id), offset, old.size, written)
    assert np.array_equal(old[~mask], new[~mask]), f"{request_id}: bytes outside its blocks changed"
    ray.get(decode.release.remote(request_id))
    return int(result.nbytes)


@pytest.mark.parametrize("transport", ["shm", "ray"])
def test_prefill_killed_mid_transfer(
    workers_by_value: Any, canary_mask: Any, figures: Callable[[str], None], transport: str
) -> None:
    settings = _settings(transport)
    layout = mixed(NUM_BLOCKS, BlockOrder.LAYER_MAJOR)
    prefill_id, decode_id = f"kill-p-{transport}", f"kill-pd-{transport}"
    holding = ray.remote(workers_by_value.HoldingPrefill)
    prefill = holding.remote(prefill_id, layout, settings)
    decode = DecodeActor.remote(decode_id, layout, settings)
    ray.get([prefill.start.remote(), decode.start.remote()])

    src = ray.get(prefill.allocate.remote("doomed", 4))
    ray.get(prefill.fill_random.remote("doomed", 1))
    reservation = ray.get(decode.reserve.remote("doomed", 4))
    assert ray.get(decode.free_count.remote()) == NUM_BLOCKS - 4
    ray.get(prefill.hold_copies.remote(1))  # the first copy lands, the second waits
    started = time.monotonic()
    waiting = decode.wait.remote("doomed", WAIT_DEADLINE_S)
    pushing = prefill.push.remote(reservation)
    wait_until(lambda: ray.get(prefill.held.remote()) >= 1, what="a copy held mid-transfer")
    ray.kill(prefill)

    # The decode side learns within its deadline, with a kvray error naming the request.
    with pytest.raises(TransferTimeoutError, match="doomed") as raised:
        ray.get(waiting, timeout=NEVER_HANG_S)
    waited = time.monotonic() - started
    assert raised.value.facts["timeout_s"] == WAIT_DEADLINE_S
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pushing, timeout=NEVER_HANG_S)
    assert ray.get(decode.free_count.remote()) == NUM_BLOCKS
    wait_until(_dropped(settings, prefill_id), what="the coordinator dropping the dead prefill")

    # A restarted prefill (same id, new incarnation) and the surviving decode work together.
    restarted = PrefillActor.remote(prefill_id, layout, settings)
    ray.get(restarted.start.remote())
    moved = _transfer_and_check(
        restarted,
        decode,
        decode_id,
        "after",
        3,
        7,
        canary_mask,
        settings,
        also_written=[list(reservation.blocks)],
    )
    assert ray.get(decode.free_count.remote()) == NUM_BLOCKS
    assert ray.get(restarted.free_count.remote()) == NUM_BLOCKS
    figures(
        f"[kvray kill] prefill killed mid-transfer ({transport}): decode got TransferTimeoutError "
        f"after {waited:.1f} s (deadline {WAIT_DEADLINE_S} s), decode free blocks "
        f"{NUM_BLOCKS}/{NUM_BLOCKS}, dead engine dropped, restarted prefill moved {moved} bytes exactly"
    )
    for actor in (restarted, decode):
        ray.kill(actor)
    del src


@pytest.mark.parametrize("transport", ["shm", "ray"])
def test_decode_killed_mid_transfer(
    workers_by_value: Any, canary_mask: Any, figures: Callable[[str], None], transport: str
) -> None:
    settings = _settings(transport)
    layout = mixed(NUM_BLOCKS, BlockOrder.BLOCK_MAJOR)
    prefill_id, decode_id = f"kill-dp-{transport}", f"kill-d-{transport}"
    holding = ray.remote(workers_by_value.HoldingPrefill)
    prefill = holding.remote(prefill_id, layout, settings)
    decode = ray.remote(workers_by_value.PlainDecode).remote(decode_id, layout, settings)
    ray.get([prefill.start.remote(), decode.start.remote()])
    decode_pid = ray.get(decode.pid.remote())

    ray.get(prefill.allocate.remote("doomed", 5))
    ray.get(prefill.fill_random.remote("doomed", 2))
    reservation = ray.get(decode.reserve.remote("doomed", 5))
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS - 5
    ray.get(prefill.hold_copies.remote(1))
    started = time.monotonic()
    pushing = prefill.push.remote(reservation)
    wait_until(lambda: ray.get(prefill.held.remote()) >= 1, what="a copy held mid-transfer")
    ray.kill(decode)
    wait_until(_dropped(settings, decode_id), what="the coordinator dropping the dead decode")
    ray.get(prefill.release_copies.remote())

    with pytest.raises(TransportError, match=decode_id) as raised:
        ray.get(pushing, timeout=NEVER_HANG_S)
    failed_after = time.monotonic() - started
    assert isinstance(raised.value, KvrayError)
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS  # freed on failure

    # A decode restarted under the same id (new incarnation, new memory) takes new pushes.
    wait_until(lambda: pid_gone(decode_pid), what="the dead decode reaped")
    restarted = DecodeActor.remote(decode_id, layout, settings)
    ray.get(restarted.start.remote())
    moved = _transfer_and_check(prefill, restarted, decode_id, "after", 4, 9, canary_mask, settings)
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS
    assert ray.get(restarted.free_count.remote()) == NUM_BLOCKS
    figures(
        f"[kvray kill] decode killed mid-transfer ({transport}): prefill got "
        f"{kvray_type(raised.value)} after {failed_after:.1f} s (deadline "
        f"{PUSH_DEADLINE_S} s), prefill free blocks {NUM_BLOCKS}/{NUM_BLOCKS}, dead engine dropped, "
        f"restarted decode took {moved} bytes exactly"
    )
    for actor in (prefill, restarted):
        ray.kill(actor)


def test_a_dead_decode_engine_holds_up_no_push_to_another(
    workers_by_value: Any, canary_mask: Any, figures: Callable[[str], None]
) -> None:
    # One prefill engine, two decode engines; one decode engine dies with requests reserved
    # that the prefill engine then pushes layer by layer. Each of those fails at once (the
    # coordinator remembers the incarnation that left; the engine's inbox is gone), not at its
    # deadline, and holds none of the prefill's two slots meanwhile: the other decode engine's
    # requests land as usual. Lookups may wait as long as a push, as with the defaults.
    settings = msgspec.structs.replace(
        _settings("shm"), max_concurrent_transfers=2, lookup_timeout_s=PUSH_DEADLINE_S
    )
    layout = mixed(NUM_BLOCKS, BlockOrder.LAYER_MAJOR)
    prefill = PrefillActor.remote("two-p", layout, settings)
    dead = ray.remote(workers_by_value.PlainDecode).remote("two-dead", layout, settings)
    live = DecodeActor.remote("two-live", layout, settings)
    ray.get([actor.start.remote() for actor in (prefill, dead, live)])
    moved = [_transfer_and_check(prefill, dead, "two-dead", "before", 1, 40, canary_mask, settings)]
    doomed = [ray.get(dead.reserve.remote(f"doomed{i}", 1)) for i in range(4)]
    for reservation in doomed:
        ray.get(prefill.allocate.remote(reservation.request_id, 1))
    ray.kill(dead)
    wait_until(_dropped(settings, "two-dead"), what="the coordinator dropping the dead decode")

    started = time.monotonic()
    pushes = [prefill.push.remote(reservation, layerwise=True) for reservation in doomed]
    moved += [
        _transfer_and_check(prefill, live, "two-live", f"live{i}", 2, 50 + i, canary_mask, settings)
        for i in range(3)
    ]
    errors = []
    for pushing in pushes:
        with pytest.raises(KvrayError) as raised:
            ray.get(pushing, timeout=NEVER_HANG_S)
        errors.append(kvray_type(raised.value))
    failed_after = time.monotonic() - started
    # Refused as a departed engine (or an inbox gone, for a push that found it cached), never
    # a push that waited for its deadline or for a slot.
    assert set(errors) <= {"UnknownEngineError", "TransportError"}, errors
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS
    figures(
        f"[kvray kill] one of two decode engines killed: its 4 pushes failed "
        f"({', '.join(sorted(set(errors)))}) within {failed_after:.1f} s (deadline "
        f"{PUSH_DEADLINE_S} s) while the other engine took 3 pushes exactly ({sum(moved)} bytes "
        "with the first)"
    )
    for actor in (prefill, live):
        ray.kill(actor)


def test_coordinator_killed_mid_workload(
    local_ray: None, canary_mask: Any, figures: Callable[[str], None]
) -> None:
    name = "kvray-coordinator-killed"
    shm_settings, ray_settings = _settings("shm", name), _settings("ray", name)
    layout = mixed(24, BlockOrder.LAYER_MAJOR)
    prefills = [
        PrefillActor.remote("coord-p-shm", layout, shm_settings, pool_seed=1),
        PrefillActor.remote("coord-p-ray", layout, ray_settings, pool_seed=2),
    ]
    decodes = [DecodeActor.remote(f"coord-d{i}", layout, shm_settings, pool_seed=3 + i) for i in range(2)]
    ray.get([actor.start.remote() for actor in prefills + decodes])
    for i, decode in enumerate(decodes):
        ray.get(decode.fill_region.remote(20 + i))
    before = [ray.get(decode.snapshot.remote())[0] for decode in decodes]
    Launched = tuple[str, int, list[int], dict[str, Any], Any, Any]

    def launch(wave: int) -> list[Launched]:
        launched = []
        for p, prefill in enumerate(prefills):
            for d, decode in enumerate(decodes):
                request_id = f"w{wave}-p{p}-d{d}"
                src = ray.get(prefill.allocate.remote(request_id, 2))
                ray.get(prefill.fill_random.remote(request_id, 100 * wave + 10 * p + d))
                expected = ray.get(prefill.read_blocks.remote(src))
                reservation = ray.get(decode.reserve.remote(request_id, 2))
                waiting = decode.wait.remote(request_id, 30.0)
                pushing = prefill.push.remote(reservation)
                launched.append((request_id, d, list(reservation.blocks), expected, pushing, waiting))
        return launched

    outcomes = {"landed": 0, "kvray_error": 0}
    reached: list[list[tuple[list[int], None]]] = [[], []]

    def settle(launched: list[Launched]) -> None:
        for request_id, d, dst, expected, pushing, waiting in launched:
            reached[d].append((dst, None))
            try:
                ray.get(pushing, timeout=NEVER_HANG_S)
                ray.get(waiting, timeout=NEVER_HANG_S)
            except KvrayError:
                outcomes["kvray_error"] += 1
                with contextlib.suppress(KvrayError):  # the decode frees the blocks when its wait fails
                    ray.get(waiting, timeout=NEVER_HANG_S)
                continue
            landed = ray.get(decodes[d].read_blocks.remote(dst))
            for layer, data in expected.items():
                assert np.array_equal(landed[layer], data), f"{request_id} {layer}"
            outcomes["landed"] += 1
            ray.get(decodes[d].release.remote(request_id))

    settle(launch(0))  # every prefill now knows both decodes
    coordinator = ray.get_actor(name, namespace=shm_settings.namespace)
    epoch = ray.get(coordinator.stats.remote())["epoch"]
    in_flight = launch(1)
    ray.kill(coordinator)  # for good: Ray does not restart it
    in_flight += launch(2)
    settle(in_flight)

    # The agents find the coordinator gone, create its successor and register there again.
    def back() -> bool:
        try:
            successor = ray.get_actor(name, namespace=shm_settings.namespace)
        except ValueError:  # no successor yet
            return False
        stats = ray.get(successor.stats.remote())
        return bool(stats["epoch"] != epoch and stats["engines"] == 4)

    wait_until(back, what="a new coordinator with all four engines")
    replaced = sum(
        ray.get(actor.stats.remote()).get("directory_events_coordinator_replaced", 0)
        for actor in prefills + decodes
    )
    assert replaced >= 1
    for d, decode in enumerate(decodes):
        (offset, old), (_, new) = before[d], ray.get(decode.snapshot.remote())[0]
        mask = canary_mask(_info(shm_settings, f"coord-d{d}"), offset, old.size, reached[d])
        assert np.array_equal(old[~mask], new[~mask]), f"coord-d{d}: bytes outside the workload's blocks"
    assert [ray.get(actor.free_count.remote()) for actor in prefills + decodes] == [24] * 4

    # New transfers: between the survivors, and into an engine that registered after the kill.
    newcomer = DecodeActor.remote("coord-d-new", layout, shm_settings)
    ray.get(newcomer.start.remote())
    moved = 0
    for p, prefill in enumerate(prefills):
        moved += _transfer_and_check(
            prefill, newcomer, "coord-d-new", f"new-{p}", 3, 50 + p, canary_mask, shm_settings
        )
        moved += _transfer_and_check(
            prefill, decodes[p], f"coord-d{p}", f"again-{p}", 2, 60 + p, canary_mask, shm_settings
        )
    assert [ray.get(actor.free_count.remote()) for actor in [*prefills, *decodes, newcomer]] == [24] * 5
    figures(
        f"[kvray kill] coordinator killed mid-workload: {outcomes['landed']} transfers landed exactly, "
        f"{outcomes['kvray_error']} failed with kvray errors, none hung; the agents replaced the "
        f"coordinator and all 4 engines registered again; afterwards {moved} bytes moved exactly "
        "(old pairs and a newcomer), every pool full"
    )
    for actor in [*prefills, *decodes, newcomer]:
        ray.kill(actor)
