"""The coordinator as a directory: engines register and are looked up, a dead engine's actor
drops it, a closed agent deregisters, one registered outside any actor leaves once it stops
heartbeating, and after a coordinator restart every agent registers again on its own. An entry
belongs to its registrant: no other caller replaces or removes it while the registrant lives,
and an incarnation's contents never change."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import ray
from process_probes import wait_until

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.coordinator import LAPSED_HEARTBEATS, Coordinator, get_or_create_coordinator
from kvray.errors import RegistrationRefusedError, UnknownEngineError
from kvray.layout import llama_gqa
from kvray.wire import EngineInfo, Role, decode_engine_info, encode
from kvray.workers import DecodeActor, PrefillActor

SETTINGS = Settings(heartbeat_s=0.3, lookup_timeout_s=1.0, coordinator_name="kvray-coordinator-tests")


def kill_and_see_dropped(coordinator: Any, actor: Any, engine_id: str) -> None:
    """Kill the actor hosting `engine_id`: the coordinator drops the engine (one more
    `dropped_dead`) without any deregistration, and a lookup no longer finds it."""
    dead_before = ray.get(coordinator.stats.remote())["dropped_dead"]
    ray.kill(actor)
    wait_until(
        lambda: ray.get(coordinator.stats.remote())["dropped_dead"] == dead_before + 1,
        "the dead engine dropped",
    )
    with pytest.raises(UnknownEngineError, match=engine_id):
        ray.get(coordinator.lookup.remote(engine_id, 0.5))


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
    kill_and_see_dropped(coordinator, decode, "dir-d0")


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
    assert ray.get(actor.stats.remote()).get("directory_events_reregistered", 0) == 0

    kill_and_see_dropped(coordinator, actor, "plain-p0")


def test_agents_register_again_after_a_coordinator_restart(local_ray: None) -> None:
    coordinator = get_or_create_coordinator(SETTINGS)
    layout = llama_gqa(8, num_layers=2)
    decode = DecodeActor.remote("restart-d0", layout, SETTINGS)
    prefill = PrefillActor.remote("restart-p0", layout, SETTINGS)
    ray.get([decode.start.remote(), prefill.start.remote()])
    epoch = ray.get(coordinator.stats.remote())["epoch"]

    ray.kill(coordinator, no_restart=False)  # Ray restarts it (max_restarts=-1), empty
    wait_until(lambda: ray.get(coordinator.stats.remote())["epoch"] != epoch, "a restarted coordinator")
    wait_until(lambda: ray.get(coordinator.stats.remote())["engines"] >= 2, "both engines registered again")
    assert ray.get(decode.stats.remote())["directory_events_reregistered"] >= 1

    # And transfers work again, through the new directory.
    blocks = ray.get(prefill.allocate.remote("after-restart", 2))
    ray.get(prefill.fill_random.remote("after-restart", 3))
    expected = ray.get(prefill.read_blocks.remote(blocks))
    reservation = ray.get(decode.reserve.remote("after-restart", 2))
    dst = list(reservation.blocks)
    waiting = decode.wait.remote("after-restart", 20)
    ray.get(prefill.push.remote(reservation))
    ray.get(waiting)
    landed = ray.get(decode.read_blocks.remote(dst))
    assert all((landed[k] == expected[k]).all() for k in expected)
    ray.kill(decode)
    ray.kill(prefill)


def _elsewhere(info: EngineInfo) -> bytes:
    """`info` with other contents under the same engine id and incarnation."""
    return encode(msgspec.structs.replace(info, node_id=f"{info.node_id}-elsewhere"))


@pytest.fixture
async def driver_info() -> AsyncIterator[EngineInfo]:
    """A real engine's info, from an agent that registers nowhere (no Ray needed)."""
    agent = KVAgent("own-p0", Role.PREFILL, llama_gqa(8, num_layers=2), use_coordinator=False)
    info = await agent.start()
    yield info
    await agent.close()


async def test_an_entry_without_an_actor_belongs_to_its_secret_until_its_heartbeat_lapses(
    driver_info: EngineInfo,
) -> None:
    """A registrant outside any actor (a driver) has nothing the coordinator could watch: its
    entry is its own while it heartbeats; another registrant takes the engine id only once the
    heartbeat has lapsed, and the old registrant then finds itself no longer registered."""
    lapse_s = 0.2
    coordinator = Coordinator(lapse_s=lapse_s)
    owner, other = secrets.token_bytes(32), secrets.token_bytes(32)
    info_bytes = encode(driver_info)
    epoch = await coordinator.register(info_bytes, None, owner)
    # The registrant itself: the same contents again are fine, other contents are not.
    assert await coordinator.register(info_bytes, None, owner) == epoch
    with pytest.raises(RegistrationRefusedError, match="other contents"):
        await coordinator.register(_elsewhere(driver_info), None, owner)
    # Anyone else, while the heartbeat is current: neither replace, nor remove, nor heartbeat.
    for contents in (info_bytes, _elsewhere(driver_info)):
        with pytest.raises(RegistrationRefusedError, match="registered by another agent"):
            await coordinator.register(contents, None, other)
    with pytest.raises(RegistrationRefusedError, match="registered by another agent"):
        await coordinator.deregister(driver_info.engine_id, driver_info.incarnation, other)
    assert await coordinator.heartbeat(driver_info.engine_id, driver_info.incarnation, other) is None
    # No secret, or a short one, proves nothing.
    for weak in (b"", b"short", None):
        with pytest.raises(RegistrationRefusedError, match="secret"):
            await coordinator.register(info_bytes, None, weak)  # type: ignore[arg-type]
        with pytest.raises(RegistrationRefusedError, match="secret"):
            await coordinator.deregister(driver_info.engine_id, driver_info.incarnation, weak)  # type: ignore[arg-type]
    entry_bytes, _ = await coordinator.lookup(driver_info.engine_id, 0.1)
    assert entry_bytes == info_bytes

    # The registrant goes quiet past the lapse: a successor may take the engine id.
    await asyncio.sleep(lapse_s * 2)
    assert await coordinator.register(_elsewhere(driver_info), None, other) == epoch
    assert await coordinator.heartbeat(driver_info.engine_id, driver_info.incarnation, owner) is None
    with pytest.raises(RegistrationRefusedError, match="registered by another agent"):
        await coordinator.deregister(driver_info.engine_id, driver_info.incarnation, owner)
    assert (await coordinator.lookup(driver_info.engine_id, 0.1))[0] == _elsewhere(driver_info)
    # Its own registrant removes it.
    assert await coordinator.deregister(driver_info.engine_id, driver_info.incarnation, other)
    with pytest.raises(UnknownEngineError):
        await coordinator.lookup(driver_info.engine_id, 0.01)


def test_only_the_registrant_or_its_successor_after_death_replaces_an_actors_entry(
    local_ray: None,
) -> None:
    """An engine registered from an actor: another caller naming the same actor as host still
    cannot replace, change or remove the entry while the actor lives; after its death a
    successor with its own secret registers the engine id."""
    coordinator = get_or_create_coordinator(SETTINGS)
    decode = DecodeActor.remote("own-d0", llama_gqa(8, num_layers=2), SETTINGS)
    ray.get(decode.start.remote())
    info_bytes, host = ray.get(coordinator.lookup.remote("own-d0", 5.0))
    info = decode_engine_info(info_bytes)
    intruder = secrets.token_bytes(32)
    for contents in (info_bytes, _elsewhere(info)):
        with pytest.raises(RegistrationRefusedError, match="registered by another agent"):
            ray.get(coordinator.register.remote(contents, host, intruder))
    with pytest.raises(RegistrationRefusedError):
        ray.get(coordinator.deregister.remote("own-d0", info.incarnation, intruder))
    assert ray.get(coordinator.lookup.remote("own-d0", 5.0))[0] == info_bytes
    assert ray.get(decode.stats.remote()).get("directory_events_reregistered", 0) == 0

    # Killed, its successor (a new actor, a new agent and secret) registers under the engine id,
    # right away: the registration waits for the coordinator to notice the death.
    ray.kill(decode)
    successor = DecodeActor.remote("own-d0", llama_gqa(8, num_layers=2), SETTINGS)
    incarnation = ray.get(successor.start.remote())["incarnation"]
    assert incarnation != info.incarnation
    listed = decode_engine_info(ray.get(coordinator.lookup.remote("own-d0", 5.0))[0])
    assert listed.incarnation == incarnation
    ray.get(successor.close.remote())
    with pytest.raises(UnknownEngineError):
        ray.get(coordinator.lookup.remote("own-d0", 0.1))
    ray.kill(successor)


async def test_on_ray_a_driver_stays_listed_while_it_heartbeats_and_leaves_once_it_stops(
    local_ray: None, driver_info: EngineInfo
) -> None:
    """On the coordinator actor, entries registered outside any actor: a driver's agent stays
    listed across many leases by its own heartbeat; a registrant that stops heartbeating (a
    driver that died without deregistering) leaves once the lease (`LAPSED_HEARTBEATS`
    heartbeat periods) has run out, counted as expired, and a lookup naming its incarnation
    then fails at once instead of waiting."""
    coordinator = get_or_create_coordinator(SETTINGS)
    lease_s = SETTINGS.heartbeat_s * LAPSED_HEARTBEATS
    agent = KVAgent("lease-p0", Role.PREFILL, llama_gqa(8, num_layers=2), settings=SETTINGS)
    await agent.start()
    try:
        await coordinator.register.remote(encode(driver_info), None, secrets.token_bytes(32))
        expired = (await coordinator.stats.remote())["expired"]
        await asyncio.sleep(lease_s * 3)
        listed = decode_engine_info((await coordinator.lookup.remote("lease-p0", 0.5))[0])
        assert listed.engine_id == "lease-p0"
        assert agent.stats.get("directory_events_reregistered", 0) == 0
        assert (await coordinator.stats.remote())["expired"] == expired + 1  # the silent one only
        started = time.monotonic()
        with pytest.raises(UnknownEngineError, match="has left"):
            await coordinator.lookup.remote(driver_info.engine_id, 30.0, driver_info.incarnation)
        assert time.monotonic() - started < 10.0
    finally:
        await agent.close()
