"""Hosts: how peers reach an agent (steps six and seven of the data flow arrive through one).

A peer holds a Ray actor handle for each engine it talks to (`Peer.host`) and calls the peer
calls on it: writes over `ray`, notices and claims from other nodes, RDMA connection requests,
push requests. Where the agent lives decides which host answers them:

    calls      `PeerCall`, the one table of peer calls (entry point, arguments, answer, the
               agent method that serves it); every host's entry points are made from it, and
               the notice channels call a host through it (`kvray.notice.actor.call_host`)
    actor      `AgentHost`: the agent lives in a Ray actor of its own (kvray's workers, your
               actor); mix it in and the actor's handle is the agent's host
    forwarded  the agent lives in a process that is not such an actor (a Serve replica, whose
               actor is Serve's; a vLLM worker, started by vLLM): `ForwardedAgent` holds the
               agent and starts a `ForwardingHost` actor that stands in for the process and
               forwards each call into it; `ForwardedDirectory` registers that actor as the
               engine's. It imports Ray: import its names from `kvray.host.forwarded`

The coordinator holds `kvray_watch` on the same handle to learn when an agent closes or dies.
"""

from kvray.host.actor import AgentHost
from kvray.host.calls import PeerCall, add_peer_calls

__all__ = ["AgentHost", "PeerCall", "add_peer_calls"]
