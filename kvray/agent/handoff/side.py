"""What both sides of one engine's hand-offs share (`Side`): what they are built over (`Wiring`:
the engine's agent, how the engine hears back, the observer, the deployment's proof), and the
tasks a side runs on the agent's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from kvray.agent.handoff.events import AskProof, HandoffEvent, HandoffObserver, HandoffReports, Moved
from kvray.agent.kvagent import KVAgent


@dataclass(frozen=True)
class Wiring:
    """What both sides of an engine's hand-offs are built over."""

    agent: KVAgent
    reports: HandoffReports
    #: The engine joined Ray: the coordinator knows its peers and their host actors.
    joined: bool = False
    observer: HandoffObserver | None = None
    #: The deployment's key: asks carry a proof, and one without a valid proof is dropped.
    proof: AskProof | None = None


class Side:
    """One side of an engine's hand-offs over its agent."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.agent = wiring.agent
        self.settings = wiring.agent.settings
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
        observer = self.wiring.observer
        if observer is not None:
            observer.event(event, request_id, handoff, error)

    async def _moved(self, moved: Moved) -> None:
        observer = self.wiring.observer
        if observer is not None:
            await observer.moved(moved, self.agent.backing)


def reason_of(error: BaseException) -> str:
    """An error as a hand-off reports it (to the log, an observer, a refusal)."""
    return f"{type(error).__name__}: {error}"
