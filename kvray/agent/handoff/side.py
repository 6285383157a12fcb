"""What both sides of one engine's hand-offs share (`Side`): the engine's agent, how the engine
hears back, the observer, the deployment's proof, and the tasks a side runs on the agent's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from kvray.agent.handoff.events import AskProof, HandoffEvent, HandoffObserver, HandoffReports, Moved
from kvray.agent.kvagent import KVAgent


class Side:
    """One side of an engine's hand-offs over its agent. `joined`: the engine joined Ray, so the
    coordinator knows its peers and their host actors."""

    def __init__(
        self,
        agent: KVAgent,
        reports: HandoffReports,
        *,
        joined: bool,
        observer: HandoffObserver | None,
        proof: AskProof | None,
    ) -> None:
        self.agent = agent
        self.settings = agent.settings
        self.joined = joined
        self.observer = observer
        self._reports = reports
        self._proof = proof
        self._tasks: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        """Cancel what is under way (before the agent closes, which ends every wait)."""
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _note(self, event: HandoffEvent, request_id: str, handoff: str, error: str = "") -> None:
        if self.observer is not None:
            self.observer.event(event, request_id, handoff, error)

    async def _moved(self, moved: Moved) -> None:
        if self.observer is not None:
            await self.observer.moved(moved, self.agent.backing)


def reason_of(error: BaseException) -> str:
    """An error as a hand-off reports it (to the log, an observer, a refusal)."""
    return f"{type(error).__name__}: {error}"
