"""What the hand-off tells its engine and whoever watches it (the last thing a hand-off does): the
engine hears through `HandoffReports` that blocks may go back to it; an observer
(`kvray.bench.handoff_log`) sees each `HandoffEvent` and each side of a hand-off whose KV moved
(`Moved`). `AskProof` is what the engine's deployment lends the hand-off to prove its asks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvray.agent.handoff.specs import BlockTable, LoadSpec, table_blocks
from kvray.memory import Backing
from kvray.wire import TransportKind


class HandoffReports(Protocol):
    """How the hand-off tells its engine that blocks may go back to it."""

    def sent(self, request_id: str) -> None:
        """A held request's blocks are no longer read (pushed, freed, or never held)."""

    def loaded(self, spec: LoadSpec, *, failed: bool) -> None:
        """No write of a load can land any more; `failed`: its blocks hold no KV to use."""


class AskProof(Protocol):
    """What proves a decode engine's push request or withdrawal comes from an engine of the
    prefill engine's deployment (`kvray.integrations.vllm.tickets.HandoffKey`): without it,
    anyone who learnt a hand-off id could free another request's hold, or pin it with asks."""

    def ask_proof(self, prefill_engine: str, handoff: str) -> bytes: ...

    def lane_key(
        self, prefill_engine: str, prefill_incarnation: int, decode_engine: str, decode_incarnation: int
    ) -> bytes:
        """16 bytes both engines of a pair derive, keying asks through a lane (`kvray.agent.lane`)."""
        ...


class HandoffEvent(enum.Enum):
    ASKED = "asked"  # a push request parked, waiting for its request
    WITHDRAWN = "withdrawn"
    PREEMPTED = "preempted"
    SENT = "sent"
    RECEIVED = "received"
    PUSH_FAILED = "push failed"
    RECEIVE_FAILED = "receive failed"
    RECEIVE_CANCELLED = "receive cancelled"


@dataclass(frozen=True)
class Moved:
    """One side of a hand-off whose KV moved (`SENT` or `RECEIVED`)."""

    event: HandoffEvent
    #: The decode engine's id of the request (as its reservation names it).
    request_id: str
    #: The hand-off's id at the prefill engine.
    handoff: str
    #: The request's blocks on this side, per KV cache group, where both sides have one (so
    #: the two sides' tables line up): held until the observer returns.
    groups: BlockTable
    seconds: float
    transport: TransportKind | None = None
    layerwise: bool | None = None
    #: Layer-wise: from the forward saving the last layer to the decode side told.
    tail_s: float | None = None

    @property
    def blocks(self) -> tuple[int, ...]:
        """The request's blocks on this side, group after group."""
        return table_blocks(self.groups)


class HandoffObserver(Protocol):
    """Watches hand-offs (benchmarks, digest logs); installed by whoever measures."""

    def event(self, event: HandoffEvent, request_id: str, handoff: str, error: str = "") -> None: ...

    async def moved(self, moved: Moved, backing: Backing) -> None:
        """Called with the blocks still held: the observer may read them."""
