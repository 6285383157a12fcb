"""What an engine's scheduler decides about its hand-offs, as plain values (the first thing an
engine integration builds, before anything moves): block tables, the specs of loads, holds and
layer-wise pushes, one step's decisions (`HandoffStep`), and where a prefill engine takes push
requests (`PrefillAddress`). Pure: nothing here awaits, touches an agent or a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: A request's blocks on one side: one tuple of block ids per KV cache group of the engine (one
#: group for most models; e.g. sliding-window and full-attention layers make two), position by
#: position, `NO_BLOCK` where the engine keeps none (a sliding window's past). The groups share
#: their memory: a block id names the same bytes of every layer the agent moves, so the KV of
#: a request is its blocks of every group.
BlockTable = tuple[tuple[int, ...], ...]
#: A position of a block table that holds no block here.
NO_BLOCK = -1


def one_group(block_ids: Sequence[int]) -> BlockTable:
    """The block table of an engine with one KV cache group."""
    return (tuple(block_ids),)


def table_blocks(table: BlockTable) -> tuple[int, ...]:
    """A block table's blocks, group after group, in position order (`NO_BLOCK` left out)."""
    if len(table) == 1 and NO_BLOCK not in table[0]:  # the usual table: one group, every block
        return tuple(table[0])
    return tuple(block for group in table for block in group if block != NO_BLOCK)


@dataclass(frozen=True)
class LoadSpec:
    """What the decode side needs to receive one request."""

    request_id: str
    prefill_engine: str
    #: None: the orchestrator gave this engine the request first, naming the prefill engine
    #: alone; its current incarnation, node and inbox come from the coordinator.
    prefill_incarnation: int | None
    #: The hand-off's id at the prefill engine (minted by kvray, signed).
    prefill_request_id: str
    #: The prefill engine's Ray node and push-request inbox, as its ticket names them.
    prefill_node: str
    prefill_inbox: str
    #: The blocks the engine allocated here for the request's pushed tokens, in order, per group.
    block_ids: BlockTable
    #: Which of the prefill engine's blocks of the request (in each group) the first of them takes.
    first_block: int
    #: Why the request's ticket was refused ("": it was not): its load fails at once.
    refusal: str = ""
    #: A prefill engine of several tensor-parallel ranks: the incarnation and push-request
    #: inbox of each rank after the first (`prefill_engine` is rank 0; rank r's engine id is
    #: `rank_engine_id(prefill_engine, r)`, on the same node), as its ticket names them.
    prefill_ranks: tuple[tuple[int, str], ...] = ()

    @classmethod
    def refused(cls, request_id: str, block_ids: BlockTable, why: str) -> LoadSpec:
        return cls(request_id, "", None, "", "", "", block_ids, 0, refusal=why)


@dataclass(frozen=True)
class SendSpec:
    """A finished request the prefill side holds for a decode engine."""

    #: The engine's id of the request (reported back when its blocks may go).
    request_id: str
    block_ids: BlockTable
    #: The id decode engines ask for (the client's hand-off id); "" means `request_id`.
    key: str = ""
    #: The request did not finish well: end (abort) any push of it, send nothing.
    failed: bool = False
    #: The decode engine the request is for, where its ticket named one: only that engine's
    #: ranks' reservations are pushed into ("": any decode engine that asks).
    decode_engine: str = ""

    @property
    def handoff(self) -> str:
        return self.key or self.request_id


@dataclass(frozen=True)
class LayerwiseSpec:
    """A request whose whole prompt this step computes, for a decode engine: each layer is
    pushed as the forward saves it, if the decode engine has asked by then."""

    request_id: str
    key: str
    block_ids: BlockTable
    #: As `SendSpec.decode_engine`.
    decode_engine: str = ""


@dataclass
class HandoffStep:
    """One scheduler step's hand-off decisions: what an engine integration gathers during a step
    and hands over whole (`Handoff.step`). Empty collections are the usual case."""

    #: Decode: loads to start, by request id.
    loads: dict[str, LoadSpec] = field(default_factory=dict)
    #: Prefill: finished requests to hold for a decode engine, by request id.
    sends: dict[str, SendSpec] = field(default_factory=dict)
    #: Prefill: hand-off ids of requests that ended with no KV to push (aborted, failed): a
    #: decode engine's push request for one is refused at once, not held for the lease.
    dropped: set[str] = field(default_factory=set)
    #: Decode: requests (by id) that ended while their KV was loading: their wait ends now, and
    #: their blocks go back once no write of theirs can land.
    cancelled: set[str] = field(default_factory=set)
    #: Prefill: hand-off ids a proxy released (the decode leg failed): freed at once.
    released: set[str] = field(default_factory=set)
    #: Decode: loads of requests that ended before their blocks were allocated: their prefill
    #: engines are told not to hold them.
    withdrawn: list[LoadSpec] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.loads or self.sends or self.dropped or self.cancelled or self.released or self.withdrawn
        )

    def copy(self) -> HandoffStep:
        """A copy whose collections are its own (the caller may reuse its collections)."""
        return HandoffStep(
            loads=dict(self.loads),
            sends=dict(self.sends),
            dropped=set(self.dropped),
            cancelled=set(self.cancelled),
            released=set(self.released),
            withdrawn=list(self.withdrawn),
        )


def rank_engine_id(engine_id: str, rank: int) -> str:
    """The kvray engine id of tensor-parallel rank `rank` of engine `engine_id`: rank 0 goes by
    the engine's own id (an engine of one rank is its rank 0), the others by a suffix."""
    return engine_id if rank == 0 else f"{engine_id}-tp{rank}"


@dataclass(frozen=True)
class PrefillAddress:
    """Where a decode engine sends a push request: the prefill engine's id and incarnation,
    its Ray node and its push-request inbox on that node ("" if it has none)."""

    engine_id: str
    incarnation: int
    node_id: str
    inbox: str
