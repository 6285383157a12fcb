"""Both hosts as Ray runs them: an actor of the user's own with `AgentHost` mixed in, and the
`ForwardingHost` a `ForwardedAgent` starts for its process. On each, Ray's handle has every peer
call of the table, and a push request (the call `AgentHost` once lacked) reaches the handler the
prefill engine gave, or is refused with a kvray error when it gave none."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import ray

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import NotExpectedError
from kvray.host import AgentHost, PeerCall
from kvray.host.forwarded import ForwardedAgent, ForwardedDirectory
from kvray.layout import BlockOrder, mixed
from kvray.wire import Role

SETTINGS = Settings(
    heartbeat_s=300.0,
    lookup_timeout_s=5.0,
    transfer_timeout_s=15.0,
    notify_timeout_s=5.0,
    coordinator_name="kvray-coordinator-hosts-on-ray-tests",
)
LAYOUT = mixed(4, BlockOrder.LAYER_MAJOR)


@pytest.fixture(scope="module")
def coordinator(local_ray: None) -> Any:
    """The coordinator, started and answering before an engine registers: on a loaded machine
    its start alone can outlast a registration's deadline."""
    actor = get_or_create_coordinator(SETTINGS)
    ray.get(actor.departed.remote([]), timeout=120)
    return actor


class Where(enum.Enum):
    ACTOR = "actor"  # the agent's process is a Ray actor of the user's own
    FORWARDED = "forwarded"  # it is not (here: the test's own process)


@ray.remote
class PrefillActor(AgentHost):
    """A user's own prefill actor: the agent is its `kvray_agent`, push requests go to a list."""

    def __init__(self, settings: Settings, takes_push_requests: bool) -> None:
        self.kvray_agent = KVAgent("actor-prefill", Role.PREFILL, LAYOUT, settings=settings)
        self.taken: list[bytes] = []
        if takes_push_requests:
            self.kvray_agent.serve_push_requests(self.taken.append)

    async def start(self) -> None:
        await self.kvray_agent.start()

    async def close(self) -> None:
        await self.kvray_agent.close()

    def push_requests(self) -> list[bytes]:
        return self.taken


class Prefill:
    """A prefill engine hosted either way: `host` is the handle peers call."""

    def __init__(self, host: Any, push_requests: Callable[[], Any], close: Callable[[], Any]) -> None:
        self.host = host
        self.push_requests = push_requests
        self.close = close


async def start_prefill(where: Where, takes_push_requests: bool) -> Prefill:
    if where is Where.ACTOR:
        actor: Any = PrefillActor.remote(SETTINGS, takes_push_requests)  # type: ignore[attr-defined]
        await actor.start.remote()

        async def push_requests() -> list[bytes]:
            taken: list[bytes] = await actor.push_requests.remote()
            return taken

        async def close() -> None:
            await actor.close.remote()
            ray.kill(actor)

        return Prefill(actor, push_requests, close)

    taken: list[bytes] = []

    def make_agent(directory: ForwardedDirectory) -> KVAgent:
        return KVAgent("forwarded-prefill", Role.PREFILL, LAYOUT, settings=SETTINGS, coordinator=directory)

    engine = await ForwardedAgent.start_agent(
        make_agent, SETTINGS, on_push_request=taken.append if takes_push_requests else None
    )

    async def forwarded_requests() -> list[bytes]:
        return taken

    return Prefill(engine.host, forwarded_requests, engine.close)


@pytest.fixture(params=list(Where), ids=lambda where: where.value)
async def where(request: pytest.FixtureRequest, coordinator: Any) -> AsyncIterator[Where]:
    yield request.param


async def test_the_handle_has_every_peer_call(where: Where) -> None:
    prefill = await start_prefill(where, takes_push_requests=False)
    try:
        for call in PeerCall:
            assert getattr(prefill.host, call.host_method) is not None  # Ray raises if absent
        assert prefill.host.kvray_watch is not None
    finally:
        await prefill.close()


async def test_a_push_request_reaches_the_prefill_engine(where: Where) -> None:
    prefill = await start_prefill(where, takes_push_requests=True)
    try:
        assert await prefill.host.kvray_request_push.remote(b"push req-1") is None
        assert await prefill.host.kvray_request_push.remote(b"push req-2") is None
        assert await prefill.push_requests() == [b"push req-1", b"push req-2"]
    finally:
        await prefill.close()


async def test_an_engine_without_a_push_handler_refuses_push_requests(where: Where) -> None:
    prefill = await start_prefill(where, takes_push_requests=False)
    try:
        with pytest.raises(NotExpectedError, match="takes no push requests"):
            await prefill.host.kvray_request_push.remote(b"push req-1")
    finally:
        await prefill.close()
