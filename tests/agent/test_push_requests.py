"""How a decode engine's push requests and withdrawals reach a prefill engine on another node
(`kvray.agent.handoff`, over `KVAgent.push_requests`): two agents on two "nodes" of this process
that joined "Ray" (their peers wired by hand, each with an in-process stand-in for its actor).
Where the prefill engine publishes a push-request listener, asks travel over TCP and never touch
its actor; where it publishes none, they take its actor (`PeerCall.REQUEST_PUSH`), and a refusal
there fails the load at once. The KV moves with the `ray` transport, its notice over TCP."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
import pytest_asyncio
from test_handoff import KEY, LAYOUT, Recorder, until

from kvray.agent.handoff import PUSH_ENDPOINT, Handoff, LoadSpec, SendSpec
from kvray.agent.kvagent import KVAgent
from kvray.config import Settings
from kvray.host.calls import PeerCall
from kvray.notice.base import NoticeKind
from kvray.notice.tcp import PUSH_ADDRESS_ENDPOINT, NoticeListener
from kvray.wire import Role


class ActorStandIn:
    """IN-PROCESS STAND-IN for the Ray actor hosting an agent (`AgentHost`): one `kvray_<name>`
    per peer call of the table, run on the agent as its host would; it counts the calls."""

    def __init__(self, agent: KVAgent) -> None:
        self.calls: Counter[PeerCall] = Counter()
        for call in PeerCall:
            setattr(self, call.host_method, _Method(self._forwarding(agent, call)))

    def _forwarding(self, agent: KVAgent, call: PeerCall) -> Callable[..., Coroutine[Any, Any, Any]]:
        async def forward(*args: Any) -> Any:
            self.calls[call] += 1
            # What Ray hands an actor: its own, read-only copy of each array.
            copies = [np.array(arg, copy=True) if isinstance(arg, np.ndarray) else arg for arg in args]
            for copy in copies:
                if isinstance(copy, np.ndarray):
                    copy.flags.writeable = False
            return await getattr(agent, call.agent_method)(*copies)

        return forward


class _Method:
    def __init__(self, function: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self.remote = function


class Side(NamedTuple):
    agent: KVAgent
    handoff: Handoff | None
    reports: Recorder
    actor: ActorStandIn


def fill(agent: KVAgent, values: dict[int, float]) -> None:
    for index, view in enumerate(agent.backing.views.values()):
        for block, value in values.items():
            view[block].fill_(value + 16 * index)


def block(agent: KVAgent, number: int) -> list[set[float]]:
    return [set(view[number].float().unique().tolist()) for view in agent.backing.views.values()]


def load_from(prefill: KVAgent, request_id: str, blocks: tuple[int, ...]) -> LoadSpec:
    """A load of what `prefill` holds under `KEY`, as its ticket names it (its inbox is on its
    own node, not this one)."""
    info = prefill.info
    return LoadSpec(
        request_id,
        info.engine_id,
        info.incarnation,
        KEY,
        info.node_id,
        info.endpoints.get(PUSH_ENDPOINT, ""),
        (blocks,),
        0,
    )


def push_listener(agent: KVAgent) -> NoticeListener | None:
    (tcp,) = [channel for channel in agent.push_requests.channels if channel.kind is NoticeKind.TCP]
    listener: NoticeListener | None = getattr(tcp, "listener", None)
    return listener


@pytest_asyncio.fixture(loop_scope="function")
async def nodes(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Side, Side]]:
    """A prefill engine on node-a and a decode engine on node-b. Parameters (indirect): whether
    the prefill engine listens for push requests over TCP (default: it does), and whether it
    takes push requests at all (has a hand-off; default: it does)."""
    from kvray.transport.ray import RayTransport

    listens, takes = getattr(request, "param", (True, True))
    # As inside a Ray actor: the `ray` transport reaches the other node.
    monkeypatch.setattr(RayTransport, "unavailable_reason", classmethod(lambda cls, settings: None))
    settings = Settings(
        shm_dir=str(tmp_path), notice_host="127.0.0.1", notify_timeout_s=4.0, transfer_timeout_s=20.0
    )
    prefill_settings = settings if listens else msgspec.structs.replace(settings, notice_tcp=False)
    prefill = KVAgent("p", Role.PREFILL, LAYOUT, settings=prefill_settings, use_coordinator=False)
    decode = KVAgent("d", Role.DECODE, LAYOUT, settings=settings, use_coordinator=False)
    prefill.node_id, decode.node_id = "node-a", "node-b"
    reports = Recorder(), Recorder()
    # Joined: each finds the other as the coordinator would list it (here, wired by hand).
    prefill_handoff = Handoff(prefill, reports[0], lease_s=30.0, joined=True) if takes else None
    decode_handoff = Handoff(decode, reports[1], lease_s=30.0, joined=True)
    sides: list[Side] = []
    try:
        await prefill.start()
        await decode.start()
        sides = [
            Side(prefill, prefill_handoff, reports[0], ActorStandIn(prefill)),
            Side(decode, decode_handoff, reports[1], ActorStandIn(decode)),
        ]
        prefill.add_peer(decode.info, sides[1].actor)
        decode.add_peer(prefill.info, sides[0].actor)
        yield sides[0], sides[1]
    finally:
        for handoff in (prefill_handoff, decode_handoff):
            if handoff is not None:
                handoff.close()
        await prefill.close()
        await decode.close()


async def test_a_push_request_from_another_node_travels_over_tcp_not_the_actor(
    nodes: tuple[Side, Side],
) -> None:
    prefill, decode = nodes
    assert prefill.handoff is not None and decode.handoff is not None
    assert prefill.agent.info.endpoints[PUSH_ADDRESS_ENDPOINT].startswith("127.0.0.1:")
    fill(prefill.agent, {1: 1.0, 2: 2.0})
    prefill.handoff.hold(SendSpec("r-1", ((1, 2),), key=KEY))
    decode.handoff.load(load_from(prefill.agent, "d-1", (3, 4)))
    await until(lambda: "d-1" in decode.reports.loads)
    # The decode side sees its KV, the prefill side sees its blocks go; the ask never touched
    # the prefill engine's actor.
    assert decode.reports.loads == {"d-1": False}
    assert block(decode.agent, 3) == block(prefill.agent, 1) and block(decode.agent, 4) == block(
        prefill.agent, 2
    )
    await until(lambda: prefill.reports.freed == ["r-1"])
    assert prefill.actor.calls[PeerCall.REQUEST_PUSH] == 0
    listener = push_listener(prefill.agent)
    assert listener is not None and listener.connections == 1


async def test_a_withdrawal_from_another_node_travels_over_tcp_and_frees_the_hold_at_once(
    nodes: tuple[Side, Side],
) -> None:
    prefill, decode = nodes
    assert prefill.handoff is not None and decode.handoff is not None
    prefill.handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
    await decode.handoff.withdraw(load_from(prefill.agent, "d-1", ()))
    await until(lambda: prefill.reports.freed == ["r-1"], timeout_s=5.0)
    assert prefill.handoff.parked() == 0 and prefill.actor.calls[PeerCall.REQUEST_PUSH] == 0
    # The hand-off id is spent: a hold under it now ends at once.
    prefill.handoff.hold(SendSpec("r-2", ((2,),), key=KEY))
    assert prefill.reports.freed == ["r-1", "r-2"]


@pytest.mark.parametrize("nodes", [(False, True)], indirect=True, ids=["no-listener"])
async def test_without_a_listener_push_requests_take_the_prefill_engines_actor(
    nodes: tuple[Side, Side],
) -> None:
    prefill, decode = nodes
    assert prefill.handoff is not None and decode.handoff is not None
    assert PUSH_ADDRESS_ENDPOINT not in prefill.agent.info.endpoints
    fill(prefill.agent, {5: 5.0})
    prefill.handoff.hold(SendSpec("r-1", ((5,),), key=KEY))
    decode.handoff.load(load_from(prefill.agent, "d-1", (6,)))
    await until(lambda: "d-1" in decode.reports.loads)
    assert decode.reports.loads == {"d-1": False} and block(decode.agent, 6) == block(prefill.agent, 5)
    await until(lambda: prefill.reports.freed == ["r-1"])
    assert prefill.actor.calls[PeerCall.REQUEST_PUSH] == 1


@pytest.mark.parametrize("nodes", [(True, False)], indirect=True, ids=["takes-none"])
async def test_an_engine_that_takes_no_push_requests_fails_the_load_at_once(nodes: tuple[Side, Side]) -> None:
    """Its actor refuses the ask (the engine serves no push requests, so it publishes no
    listener either): the refusal comes back through the call, and the load fails well before
    its transfer deadline, its blocks free again."""
    prefill, decode = nodes
    assert prefill.handoff is None and decode.handoff is not None
    assert PUSH_ADDRESS_ENDPOINT not in prefill.agent.info.endpoints
    started = time.monotonic()
    decode.handoff.load(load_from(prefill.agent, "d-1", (2, 3)))
    await until(lambda: "d-1" in decode.reports.loads)
    assert decode.reports.loads == {"d-1": True}
    assert time.monotonic() - started < 5.0
    assert prefill.actor.calls[PeerCall.REQUEST_PUSH] == 1
    decode.agent.expect("d-1", [2, 3])  # released: reserved again
