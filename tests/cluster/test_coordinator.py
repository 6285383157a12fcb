"""The coordinator as a directory: engines register and are looked up, a dead engine's actor
drops it, a closed agent deregisters, and after a coordinator restart every agent registers
again on its own."""

from __future__ import annotations

import time

import pytest
import ray

from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import UnknownEngineError
from kvray.layout import llama_gqa
from kvray.wire import Role, decode_engine_info
from kvray.workers import DecodeActor, PrefillActor

pytestmark = pytest.mark.cluster

SETTINGS = Settings(heartbeat_s=0.3, lookup_timeout_s=1.0, coordinator_name="kvray-coordinator-tests")


def _wait_until(predicate: object, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return
        except ray.exceptions.RayError:  # e.g. the coordinator is restarting
            pass
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def test_lookup_register_deregister_and_death(local_ray: None) -> None:
    coordinator = get_or_create_coordinator(SETTINGS)
    layout = llama_gqa(8, num_layers=2)
    decode = DecodeActor.remote("dir-d0", layout, SETTINGS)
    prefill = PrefillActor.remote("dir-p0", layout, SETTINGS)
    # A lookup issued before the engine exists waits for it (within its deadline).
    pending = coordinator.lookup.remote("dir-d0", 20.0)
    started = ray.get([decode.start.remote(), prefill.start.remote()])
    info = decode_engine_info(ray.get(pending)[0])
    assert (info.engine_id, info.incarnation, info.role) == ("dir-d0", started[0]["incarnation"], Role.DECODE)
    assert (
        info.regions[0].remote_writable
        and not decode_engine_info(ray.get(coordinator.lookup.remote("dir-p0", 5.0))[0])
        .regions[0]
        .remote_writable
    )
    assert len(ray.get(coordinator.engines.remote("decode"))) >= 1

    # Closing an agent deregisters it.
    ray.get(prefill.close.remote())
    with pytest.raises(UnknownEngineError, match="dir-p0"):
        ray.get(coordinator.lookup.remote("dir-p0", 0.5))

    # A killed actor is dropped by the coordinator, without any deregistration.
    dead_before = ray.get(coordinator.stats.remote())["dropped_dead"]
    ray.kill(decode)
    _wait_until(lambda: ray.get(coordinator.stats.remote())["dropped_dead"] == dead_before + 1)
    with pytest.raises(UnknownEngineError, match="dir-d0"):
        ray.get(coordinator.lookup.remote("dir-d0", 0.5))


def test_an_agent_in_a_plain_actor_stays_listed_until_its_actor_dies(local_ray: None) -> None:
    """An agent embedded in an actor of the user's own (not an `AgentHost`): the coordinator has
    no call to hold open on it, so it probes the actor. The engine stays registered across
    heartbeats (no drop, no re-registration, its peer cache kept) and leaves once killed."""
    from kvray.agent import KVAgent

    class UserActor:
        async def start(self, settings: Settings) -> None:
            self.agent = KVAgent("plain-p0", Role.PREFILL, llama_gqa(8, num_layers=2), settings=settings)
            await self.agent.start()

        async def stats(self) -> dict[str, int]:
            return dict(self.agent.stats)

    coordinator = get_or_create_coordinator(SETTINGS)
    actor = ray.remote(UserActor).remote()
    ray.get(actor.start.remote(SETTINGS))
    dead_before = ray.get(coordinator.stats.remote())["dropped_dead"]
    time.sleep(SETTINGS.heartbeat_s * 6)
    assert decode_engine_info(ray.get(coordinator.lookup.remote("plain-p0", 0.5))[0]).engine_id == "plain-p0"
    assert ray.get(coordinator.stats.remote())["dropped_dead"] == dead_before
    assert ray.get(actor.stats.remote()).get("reregistered", 0) == 0

    ray.kill(actor)
    _wait_until(lambda: ray.get(coordinator.stats.remote())["dropped_dead"] == dead_before + 1)
    with pytest.raises(UnknownEngineError, match="plain-p0"):
        ray.get(coordinator.lookup.remote("plain-p0", 0.5))


def test_agents_register_again_after_a_coordinator_restart(local_ray: None) -> None:
    coordinator = get_or_create_coordinator(SETTINGS)
    layout = llama_gqa(8, num_layers=2)
    decode = DecodeActor.remote("restart-d0", layout, SETTINGS)
    prefill = PrefillActor.remote("restart-p0", layout, SETTINGS)
    ray.get([decode.start.remote(), prefill.start.remote()])
    epoch = ray.get(coordinator.stats.remote())["epoch"]

    ray.kill(coordinator, no_restart=False)  # Ray restarts it (max_restarts=-1), empty
    _wait_until(lambda: ray.get(coordinator.stats.remote())["epoch"] != epoch)
    _wait_until(lambda: ray.get(coordinator.stats.remote())["engines"] >= 2)
    assert ray.get(decode.stats.remote())["reregistered"] >= 1

    # And transfers work again, through the new directory.
    blocks = ray.get(prefill.allocate.remote("after-restart", 2))
    ray.get(prefill.fill_random.remote("after-restart", 3))
    expected = ray.get(prefill.read_blocks.remote(blocks))
    dst, incarnation = ray.get(decode.reserve.remote("after-restart", 2))
    waiting = decode.wait.remote("after-restart", 20)
    ray.get(prefill.push.remote("after-restart", "restart-d0", dst, incarnation))
    ray.get(waiting)
    landed = ray.get(decode.read_blocks.remote(dst))
    assert all((landed[k] == expected[k]).all() for k in expected)
    ray.kill(decode)
    ray.kill(prefill)
