"""The Ray actor hosting an agent: mix `AgentHost` into the actor class, and peers and the
coordinator reach the agent through the actor's handle (steps six and seven arrive here)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvray.host.calls import HostMethod, PeerCall, add_peer_calls

if TYPE_CHECKING:
    from kvray.agent.kvagent import KVAgent


class AgentHost:
    """Mix into a Ray actor class whose agent is `self.kvray_agent`: one `kvray_<name>` method
    per peer call (`PeerCall`), each run by the agent's method for it, and `kvray_watch` for
    the coordinator. They are async, so the actor is an async actor."""

    kvray_agent: KVAgent

    async def kvray_watch(self) -> None:
        """Returns when the agent closes; fails (in the caller) when this actor dies."""
        await self.kvray_agent.wait_closed()


def _run_on_agent(call: PeerCall) -> HostMethod:
    agent_method = call.agent_method

    async def entry_point(self: AgentHost, *args: Any) -> Any:
        return await getattr(self.kvray_agent, agent_method)(*args)

    return entry_point


add_peer_calls(AgentHost, _run_on_agent)
