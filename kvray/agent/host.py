"""The entry points peers and the coordinator call on the Ray actor hosting an agent."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvray.agent.kvagent import KVAgent


class AgentHost:
    """Mix into a Ray actor class whose agent is `self.kvray_agent`: the calls peers and the
    coordinator make on it. Their methods are async, so the actor is an async actor."""

    kvray_agent: KVAgent

    async def kvray_deliver(self, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        """A `ray`-transport write."""
        return await self.kvray_agent.deliver(header, payload)

    async def kvray_notify(self, message: bytes) -> None:
        """A completion or failure notice from a writer on another node."""
        await self.kvray_agent.notify(message)

    async def kvray_connect(self, request: bytes) -> bytes:
        """A writer's RDMA connection request (`verbs`)."""
        return await self.kvray_agent.accept_connection(request)

    async def kvray_claim(self, message: bytes) -> None:
        """A writer on another node claims a request before its first write (`verbs`)."""
        await self.kvray_agent.claim(message)

    async def kvray_watch(self) -> None:
        """Returns when the agent closes; fails (in the caller) when this actor dies."""
        await self.kvray_agent.wait_closed()
