"""The table of peer calls is the one list: every host exposes each call with the table's
signature, the agent serves each with a method of the same arguments, and every call kvray's
own code makes on a host is in the table (a call added on either side alone fails here).
`AgentHost` answers push requests like any other host, through the agent."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import NotExpectedError
from kvray.host import AgentHost, PeerCall, add_peer_calls
from kvray.host.forwarded import ForwardingHost
from kvray.layout import BlockOrder, mixed
from kvray.wire import Role

PACKAGE = Path(__file__).resolve().parents[2] / "kvray"

#: Every host kvray ships.
HOSTS: tuple[type, ...] = (AgentHost, ForwardingHost)

#: The coordinator's call on a host, not a peer's.
WATCH = "kvray_watch"


def positional(method: Any) -> list[str]:
    """The names of a method's positional parameters (Ray adds a keyword-only one of its own to
    the methods of a class it makes an actor class)."""
    parameters = inspect.signature(method).parameters.values()
    return [parameter.name for parameter in parameters if parameter.kind is not parameter.KEYWORD_ONLY]


def missing_calls(host: type) -> list[str]:
    """The peer calls `host` lacks, or exposes with other arguments than the table's."""
    missing = []
    for call in PeerCall:
        method = getattr(host, call.host_method, None)
        if method is None or not inspect.iscoroutinefunction(method):
            missing.append(f"{host.__name__} has no async {call.host_method}")
        elif positional(method) != list(call.signature().parameters):
            missing.append(f"{host.__name__}.{call.host_method}{positional(method)}")
    return missing


def unserved_calls(agent: type) -> list[str]:
    """The peer calls `agent` has no async method for, with the call's argument names."""
    unserved = []
    for call in PeerCall:
        method = getattr(agent, call.agent_method, None)
        if method is None or not inspect.iscoroutinefunction(method):
            unserved.append(f"{call.name}: no async {agent.__name__}.{call.agent_method}")
            continue
        names = list(inspect.signature(method).parameters)[1:]
        if names != [name for name, _ in call.arguments]:
            unserved.append(f"{call.name}: {agent.__name__}.{call.agent_method}{names}")
    return unserved


@pytest.mark.parametrize("host", HOSTS, ids=lambda host: host.__name__)
def test_every_host_exposes_every_peer_call(host: type) -> None:
    assert missing_calls(host) == []
    assert inspect.iscoroutinefunction(getattr(host, WATCH))


def test_the_agent_serves_every_peer_call() -> None:
    assert unserved_calls(KVAgent) == []


def test_every_call_on_a_host_in_kvray_is_a_peer_call() -> None:
    """`peer.host.kvray_<name>.remote(...)` anywhere in the package names an entry point the
    table gives every host."""
    made = {
        name
        for path in PACKAGE.rglob("*.py")
        for name in re.findall(r"\.(kvray_\w+)\.remote\(", path.read_text())
    }
    assert made, "no call on a host found: the pattern no longer matches kvray's code"
    assert made - {WATCH} <= {call.host_method for call in PeerCall}
    # Notices, claims and push requests are made through the table itself (`call_host`).
    through_the_table = {
        name
        for path in PACKAGE.rglob("*.py")
        for name in re.findall(r"\bPeerCall\.([A-Z_]+)\b", path.read_text())
    }
    assert {"NOTIFY", "CLAIM", "REQUEST_PUSH"} <= through_the_table


def test_the_checks_catch_what_they_look_for() -> None:
    """A host written by hand without one call, or with other arguments, and an agent without
    the method for one, are each reported."""

    class HandWritten:
        async def kvray_deliver(self, header: bytes) -> int:
            return 0

    reported = missing_calls(HandWritten)
    assert "HandWritten.kvray_deliver['self', 'header']" in reported
    assert "HandWritten has no async kvray_request_push" in reported
    assert len(reported) == len(PeerCall)

    class Agent:
        async def notify(self, note: bytes) -> None: ...

    assert "NOTIFY: Agent.notify['note']" in unserved_calls(Agent)
    assert "REQUEST_PUSH: no async Agent.request_push" in unserved_calls(Agent)

    def entry_point(call: PeerCall) -> Any:
        async def method(self: object, *args: Any) -> None: ...

        return method

    built = add_peer_calls(type("Built", (), {}), entry_point)
    assert missing_calls(built) == []
    assert inspect.signature(built.kvray_deliver) == PeerCall.DELIVER.signature()


async def test_agent_host_takes_push_requests_through_the_agent(tmp_path: Path) -> None:
    """No Ray needed: the entry point as the actor runs it. Without a handler the request is
    refused with a kvray error its sender sees; with one, the handler gets the message."""

    class Prefill(AgentHost):
        def __init__(self) -> None:
            settings = Settings(shm_dir=str(tmp_path))
            layout = mixed(4, BlockOrder.LAYER_MAJOR)
            self.kvray_agent = KVAgent("p", Role.PREFILL, layout, settings=settings, use_coordinator=False)

    host: Any = Prefill()
    try:
        with pytest.raises(NotExpectedError, match="takes no push requests"):
            await host.kvray_request_push(b"push req-1")
        taken: list[bytes] = []
        host.kvray_agent.serve_push_requests(taken.append)
        assert await host.kvray_request_push(b"push req-1") is None
        assert taken == [b"push req-1"]
    finally:
        await host.kvray_agent.close()
