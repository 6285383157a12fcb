"""A kvray engine in a Ray Serve replica of any engine: its agent is a forwarded one
(`kvray.host.forwarded.ForwardedAgent`, since the replica's actor is Serve's own), named by the
replica it runs in.

    class MyDecode:                                  # a Serve deployment of your engine
        async def __init__(self) -> None:
            self.kv = await ForwardedAgent.start(replica_engine_id(), Role.DECODE, my_layout)
            self.model = MyModel(self.kv.agent.backing.views)   # your compute, on kvray's views
        async def check_health(self) -> None:
            await self.kv.check_health()
        async def __del__(self) -> None:
            await self.kv.close()                    # deregisters, closes the host

Health: `check_health` raises when the agent is closed, its host is gone, or the coordinator
does not have this engine incarnation registered (Serve replaces a replica after three failed
checks in a row; a coordinator restart is re-registered within a heartbeat).
"""

from __future__ import annotations


def replica_engine_id() -> str:
    """`<app>-<deployment>-<replica id>` of the Serve replica calling it: unique per replica (a
    replacement gets a new id), so an engine id for `ForwardedAgent.start`."""
    from ray import serve

    context = serve.get_replica_context()
    return f"{context.app_name}-{context.deployment}-{context.replica_id.unique_id}"
