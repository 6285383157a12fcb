"""What the coordinator holds stays bounded, and nothing it holds outlives what vouches for it:
an entry registered outside any actor leaves when its lease runs out (heartbeats renew it);
registrations carry ids of bounded length; the memory of departed incarnations is kept per
engine id, so re-registering one engine cannot make the coordinator forget another's
departures; and a registration wakes only the lookups waiting for its engine.

The coordinator runs in this process, its methods called directly (no Ray)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

import kvray.coordinator as coordinator_module
from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.coordinator import (
    DEPARTED_PER_ENGINE,
    MAX_DEPARTED_ENGINES,
    MAX_ENDPOINT_CHARS,
    MAX_ID_CHARS,
    Coordinator,
)
from kvray.errors import MetadataError, UnknownEngineError, WireDecodeError
from kvray.layout import llama_gqa
from kvray.wire import (
    MAX_ENDPOINTS,
    MAX_ENGINE_INFO_BYTES,
    MAX_LAYERS,
    MAX_REGIONS,
    EngineInfo,
    Role,
    VerbsEndpoint,
    encode,
)

#: The review's engine id: 2 MiB.
HUGE = 2 * 1024 * 1024


@pytest.fixture
async def info() -> AsyncIterator[EngineInfo]:
    """A real engine's info (one region, two layers), from an agent that registers nowhere."""
    agent = KVAgent("bounds-p0", Role.PREFILL, llama_gqa(8, num_layers=2), use_coordinator=False)
    published = await agent.start()
    yield published
    await agent.close()


def _secret() -> bytes:
    return secrets.token_bytes(32)


def _as(info: EngineInfo, engine_id: str | None = None, incarnation: int | None = None) -> EngineInfo:
    """`info` under another engine id and/or incarnation, its regions with it."""
    engine_id = info.engine_id if engine_id is None else engine_id
    incarnation = info.incarnation if incarnation is None else incarnation
    regions = tuple(
        msgspec.structs.replace(region, engine_id=engine_id, incarnation=incarnation)
        for region in info.regions
    )
    return msgspec.structs.replace(info, engine_id=engine_id, incarnation=incarnation, regions=regions)


async def _has_left(coordinator: Coordinator, engine_id: str, incarnation: int) -> bool:
    """True when a lookup naming the incarnation fails at once because it left; False when the
    lookup would wait for it (it does not wait here)."""
    try:
        await coordinator.lookup(engine_id, 0.0, incarnation)
    except UnknownEngineError as error:
        return "has left" in str(error)
    return False


# ---- leases -----------------------------------------------------------------------------------


async def test_an_entry_nothing_renews_leaves_when_its_lease_runs_out(info: EngineInfo) -> None:
    """A driver registers (no actor to watch) and stops heartbeating, as one that died would:
    once the lease has run out the engine is no longer listed, its incarnation counts as
    departed (a lookup naming it fails at once), and its agent, if it was only late, is told it
    is not registered and registers again."""
    coordinator = Coordinator(lapse_s=0.2)
    secret = _secret()
    info_bytes = encode(info)
    await coordinator.register(info_bytes, None, secret)
    assert (await coordinator.lookup(info.engine_id, 0.0))[0] == info_bytes

    await asyncio.sleep(0.5)
    assert await coordinator.engines() == []
    with pytest.raises(UnknownEngineError, match="is not registered"):
        await coordinator.lookup(info.engine_id, 0.0)
    async with asyncio.timeout(2.0):  # a departed incarnation is not waited for
        with pytest.raises(UnknownEngineError, match="has left"):
            await coordinator.lookup(info.engine_id, 30.0, info.incarnation)
    assert await coordinator.departed([(info.engine_id, info.incarnation)]) == [
        (info.engine_id, info.incarnation)
    ]
    stats = await coordinator.stats()
    assert stats["expired"] == 1 and stats["engines"] == 0

    # The registrant was only late: its heartbeat says "not registered", and it registers again.
    assert await coordinator.heartbeat(info.engine_id, info.incarnation, secret) is None
    await coordinator.register(info_bytes, None, secret)
    assert (await coordinator.lookup(info.engine_id, 0.0, info.incarnation))[0] == info_bytes


async def test_heartbeats_renew_the_lease(info: EngineInfo) -> None:
    """An entry heartbeated more often than its lease stays for many leases; it leaves within
    about one lease of its last heartbeat."""
    lapse_s = 0.2
    coordinator = Coordinator(lapse_s=lapse_s)
    secret = _secret()
    await coordinator.register(encode(info), None, secret)
    for _ in range(15):  # 0.75 s: almost four leases
        await asyncio.sleep(lapse_s / 4)
        assert await coordinator.heartbeat(info.engine_id, info.incarnation, secret) is not None
    await asyncio.sleep(lapse_s * 2.5)
    assert await _has_left(coordinator, info.engine_id, info.incarnation)


async def test_an_agent_outside_any_actor_stays_registered_by_its_own_heartbeat() -> None:
    """A `KVAgent` on a driver renews its entry with the heartbeat it already sends: across many
    leases it is never dropped nor registers again, and closing it removes it at once."""
    settings = Settings(heartbeat_s=0.05, lookup_timeout_s=2.0, notify_timeout_s=2.0)
    coordinator = Coordinator(lapse_s=settings.heartbeat_s * coordinator_module.LAPSED_HEARTBEATS)
    agent = KVAgent(
        "bounds-agent", Role.PREFILL, llama_gqa(8, num_layers=2), settings=settings, coordinator=coordinator
    )
    info = await agent.start()
    try:
        await asyncio.sleep(1.0)  # four leases
        assert (await coordinator.lookup("bounds-agent", 0.0, info.incarnation))[0] == encode(info)
        assert (await coordinator.stats())["expired"] == 0
        assert agent.stats.get("directory_events_reregistered", 0) == 0
    finally:
        await agent.close()
    assert await _has_left(coordinator, "bounds-agent", info.incarnation)


# ---- sizes ------------------------------------------------------------------------------------


def _long_engine_id(info: EngineInfo, length: int) -> EngineInfo:
    return _as(info, engine_id="e" * length)


def _long_node_id(info: EngineInfo, length: int) -> EngineInfo:
    return msgspec.structs.replace(info, node_id="n" * length)


def _long_layer_name(info: EngineInfo, length: int) -> EngineInfo:
    """The first layer renamed, in the layout and in the placements alike."""
    first = info.layout.layers[0]
    name = "l" * length
    layers = (msgspec.structs.replace(first, name=name), *info.layout.layers[1:])
    placements = {name if key == first.name else key: value for key, value in info.placements.items()}
    return msgspec.structs.replace(
        info, layout=msgspec.structs.replace(info.layout, layers=layers), placements=placements
    )


def _long_endpoint_name(info: EngineInfo, length: int) -> EngineInfo:
    return msgspec.structs.replace(info, endpoints={"k" * length: "127.0.0.1:1"})


def _long_endpoint_value(info: EngineInfo, length: int) -> EngineInfo:
    return msgspec.structs.replace(info, endpoints={"completion_tcp": "v" * length})


def _long_rdma_device(info: EngineInfo, length: int) -> EngineInfo:
    verbs = VerbsEndpoint(device="d" * length, port=1, gid="fe80::1", gid_index=0, lid=0, mtu=5, link_layer=2)
    return msgspec.structs.replace(info, verbs=verbs)


LONG_STRINGS: list[tuple[Callable[[EngineInfo, int], EngineInfo], str, int]] = [
    (_long_engine_id, "engine id", MAX_ID_CHARS),
    (_long_node_id, "node id", MAX_ID_CHARS),
    (_long_layer_name, "layer name", MAX_ID_CHARS),
    (_long_endpoint_name, "endpoint name", MAX_ID_CHARS),
    (_long_endpoint_value, "value of endpoint", MAX_ENDPOINT_CHARS),
    (_long_rdma_device, "RDMA device name", MAX_ID_CHARS),
]


@pytest.mark.parametrize(("lengthen", "what", "limit"), LONG_STRINGS, ids=[case[1] for case in LONG_STRINGS])
async def test_a_registration_with_a_string_past_its_limit_is_refused(
    info: EngineInfo, lengthen: Callable[[EngineInfo, int], EngineInfo], what: str, limit: int
) -> None:
    """At its limit a string registers; one character more, and 2 MiB (the review's engine id),
    are refused with a `MetadataError` that names the string, its length and the limit, and
    that stays short itself (it crosses Ray, and quotes the caller's id)."""
    coordinator = Coordinator()
    secret = _secret()
    await coordinator.register(encode(lengthen(info, limit)), None, secret)
    for length in (limit + 1, HUGE):
        # The registrant's own next incarnation: nothing else could refuse it.
        longer = _as(lengthen(info, length), incarnation=length)
        with pytest.raises(MetadataError, match=what) as caught:
            await coordinator.register(encode(longer), None, secret)
        assert type(caught.value) is MetadataError
        assert (caught.value.length, caught.value.limit) == (length, limit)
        assert f"at most {limit}" in str(caught.value) and len(str(caught.value)) < 400
    assert (await coordinator.stats())["engines"] == 1


async def test_a_lookup_of_an_engine_id_no_registration_could_carry_fails_at_once() -> None:
    coordinator = Coordinator()
    async with asyncio.timeout(2.0):
        with pytest.raises(UnknownEngineError, match=f"at most {MAX_ID_CHARS} characters") as caught:
            await coordinator.lookup("e" * HUGE, 30.0)
    assert len(str(caught.value)) < 400


@pytest.mark.parametrize("count", ["regions", "layers", "endpoints"])
async def test_a_registration_with_too_many_regions_layers_or_endpoints_is_refused(
    info: EngineInfo, count: str
) -> None:
    """The counts are bounded as the registration is decoded (`kvray.wire`); the error names the
    field and the bound. (Built as plain data: a layout of too many layers cannot be built.)"""
    message = msgspec.msgpack.decode(encode(info))
    if count == "regions":
        region = message["regions"][0]
        message["regions"] = [{**region, "index": index} for index in range(MAX_REGIONS + 1)]
        limit = MAX_REGIONS
    elif count == "layers":
        message["layout"]["layers"] = message["layout"]["layers"][:1] * (MAX_LAYERS + 1)
        limit = MAX_LAYERS
    else:
        message["endpoints"] = {f"endpoint-{index}": "x" for index in range(MAX_ENDPOINTS + 1)}
        limit = MAX_ENDPOINTS
    with pytest.raises(WireDecodeError, match=f"length <= {limit}") as caught:
        await Coordinator().register(msgspec.msgpack.encode(message), None, _secret())
    assert count in caught.value.field


async def test_a_registration_larger_than_the_wire_bound_is_refused_unread(info: EngineInfo) -> None:
    too_large = encode(info) + b"\x00" * MAX_ENGINE_INFO_BYTES
    with pytest.raises(WireDecodeError, match=f"larger than the {MAX_ENGINE_INFO_BYTES}"):
        await Coordinator().register(too_large, None, _secret())


# ---- the memory of departed incarnations --------------------------------------------------------


async def test_re_registering_one_engine_cannot_make_the_coordinator_forget_another_departure(
    info: EngineInfo,
) -> None:
    """One registrant re-registers its engine with a fresh incarnation more times than the
    coordinator remembers departures (each one makes the previous incarnation depart): another
    engine's incarnation that left is still known to have left, and the flood is remembered
    in a constant number of incarnations."""
    coordinator = Coordinator()
    victim = _as(info, engine_id="victim")
    victim_secret = _secret()
    await coordinator.register(encode(victim), None, victim_secret)
    assert await coordinator.deregister("victim", victim.incarnation, victim_secret)
    assert await _has_left(coordinator, "victim", victim.incarnation)

    flooder = _secret()
    for incarnation in range(1, MAX_DEPARTED_ENGINES + 2):
        flood = _as(info, engine_id="flood", incarnation=incarnation)
        await coordinator.register(encode(flood), None, flooder)
    assert await _has_left(coordinator, "victim", victim.incarnation)
    assert (await coordinator.stats())["departed"] <= 1 + DEPARTED_PER_ENGINE


async def test_departures_are_remembered_per_engine_for_the_engines_that_left_last(
    info: EngineInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bounds themselves: each engine's newest `DEPARTED_PER_ENGINE` incarnations, for the
    `MAX_DEPARTED_ENGINES` engine ids that lost one most recently."""
    monkeypatch.setattr(coordinator_module, "MAX_DEPARTED_ENGINES", 3)
    coordinator = Coordinator()
    churn = _secret()
    last = DEPARTED_PER_ENGINE + 2
    for incarnation in range(1, last + 1):
        await coordinator.register(encode(_as(info, engine_id="churn", incarnation=incarnation)), None, churn)
    await coordinator.deregister("churn", last, churn)
    # Incarnations 1 .. last left; the newest DEPARTED_PER_ENGINE of them are known.
    assert [await _has_left(coordinator, "churn", n) for n in range(1, last + 1)] == [False, False] + [
        True
    ] * DEPARTED_PER_ENGINE

    gone = ["gone-a", "gone-b", "gone-c"]
    for engine_id in gone:
        secret = _secret()
        await coordinator.register(encode(_as(info, engine_id=engine_id, incarnation=7)), None, secret)
        await coordinator.deregister(engine_id, 7, secret)
    # The three engine ids that lost one last are remembered; "churn", the oldest, is forgotten.
    assert [await _has_left(coordinator, engine_id, 7) for engine_id in gone] == [True] * 3
    assert not await _has_left(coordinator, "churn", last)
    assert (await coordinator.stats())["departed"] == 3


# ---- waiting lookups ------------------------------------------------------------------------------


class _CountingDict(dict[str, Any]):
    """The coordinator's engine table, counting the membership checks of waiting lookups."""

    checks = 0

    def __contains__(self, key: object) -> bool:
        self.checks += 1
        return super().__contains__(key)


async def test_a_registration_wakes_only_the_lookups_waiting_for_its_engine(info: EngineInfo) -> None:
    """With a thousand lookups waiting for other engines, registering one engine lets its own
    waiting lookup run, and no other: a woken lookup checks the table, so the checks count the
    lookups woken. (A wall-clock figure is in the change's report, not a test.)"""
    coordinator = Coordinator()
    table = _CountingDict()
    coordinator._engines = table  # type: ignore[assignment]
    others = [asyncio.ensure_future(coordinator.lookup(f"absent-{n}", 30.0)) for n in range(1000)]
    mine = asyncio.ensure_future(coordinator.lookup(info.engine_id, 30.0))
    await asyncio.sleep(0.05)
    try:
        table.checks = 0
        await coordinator.register(encode(info), None, _secret())
        async with asyncio.timeout(5.0):
            assert (await mine)[0] == encode(info)
        await asyncio.sleep(0.05)
        assert table.checks <= 2
        assert not any(lookup.done() for lookup in others)
    finally:
        for lookup in others:
            lookup.cancel()
        await asyncio.gather(*others, return_exceptions=True)


async def test_a_waiting_lookup_of_an_incarnation_that_came_and_left_stops_waiting(info: EngineInfo) -> None:
    """A lookup waits for an incarnation that has not registered yet; it registers and leaves
    again before the waiting call runs (two calls in one turn of the loop). Woken, the lookup
    finds the engine absent and that incarnation departed: it fails at once rather than waiting
    out its deadline for an engine life that cannot come back."""
    coordinator = Coordinator()
    waiting = asyncio.ensure_future(coordinator.lookup(info.engine_id, 30.0, info.incarnation))
    await asyncio.sleep(0.05)
    secret = _secret()
    await coordinator.register(encode(info), None, secret)  # neither call yields to the loop
    assert await coordinator.deregister(info.engine_id, info.incarnation, secret)
    async with asyncio.timeout(2.0):
        with pytest.raises(UnknownEngineError, match="has left"):
            await waiting
