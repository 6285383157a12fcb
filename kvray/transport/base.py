"""Transport interface (sixth step of the data flow): register regions, write a plan's ops.

A transport is small: `register` turns a backing's regions into descriptors a peer can
write through, `write` issues a plan's ops into a peer's regions as one-sided writes, and
`close` releases what it opened. Everything a transport needs to reach a peer arrives in a
`Peer` (the peer's published `EngineInfo` and, under Ray, the actor hosting its agent).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvray.config import Settings
from kvray.errors import RegionError, StaleIncarnationError
from kvray.memory import Backing, MemoryKind
from kvray.plan import TransferPlan, check_op_table
from kvray.wire import EngineInfo, RegionDescriptor, TransportKind


@dataclass(frozen=True)
class Peer:
    """A remote engine as a transport sees it."""

    info: EngineInfo
    #: Ray actor hosting the peer's agent (an `AgentHost`), or None outside Ray.
    host: Any = None


class Transport(abc.ABC):
    """Moves bytes from a local backing into a peer's registered regions."""

    kind: ClassVar[TransportKind]
    #: True when both ends must share a node (shared memory, CUDA IPC).
    same_node_only: ClassVar[bool]
    #: Memory the destination backing may live in.
    destination_kinds: ClassVar[frozenset[MemoryKind]]

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: Peers with cached entries (mappings, handles, connections), least recently used first.
        self._peers_used: OrderedDict[str, None] = OrderedDict()

    @classmethod
    @abc.abstractmethod
    def unavailable_reason(cls, settings: Settings) -> str | None:
        """None when the transport can run here, else one sentence saying why not."""

    def register(
        self, backing: Backing, engine_id: str, incarnation: int, *, remote_writable: bool
    ) -> tuple[RegionDescriptor, ...]:
        """Descriptors of the backing's regions, for the engine's published info."""
        return backing.region_descriptors(engine_id, incarnation, self.kind, remote_writable=remote_writable)

    @abc.abstractmethod
    async def write(self, plan: TransferPlan, local: Backing, peer: Peer) -> None:
        """Issue every op of `plan`; return once the bytes are in the peer's memory."""

    async def write_then(
        self, plan: TransferPlan, local: Backing, peer: Peer, then: Callable[[], None]
    ) -> None:
        """`write`, calling `then()` once, as soon as every byte is in the peer's memory: a
        transport whose copy finishes on a thread of its own calls it there, before this
        coroutine resumes (the agent sends the completion notice from it, sparing the decode
        side a trip through this event loop; a `DatagramNotice` may even be sent without
        Python, by the C copy pool's thread). `then` must be quick, thread-safe and must not
        raise. Here: after `write` returns, on the loop."""
        await self.write(plan, local, peer)
        then()

    def forget(self, engine_id: str) -> None:  # noqa: B027 - optional hook
        """Drop whatever is cached for a peer (it restarted, left or failed). A write still
        using an entry keeps it until the write ends."""

    def _used(self, engine_id: str) -> None:
        """Record that a peer's cached entries are being used; a transport that caches per peer
        calls this before it looks its entries up. Past `max_cached_peers` peers, the least
        recently used one is forgotten."""
        peers = self._peers_used
        if engine_id in peers:
            peers.move_to_end(engine_id)
            return
        peers[engine_id] = None
        while len(peers) > self.settings.max_cached_peers:
            oldest, _ = peers.popitem(last=False)
            self.forget(oldest)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything the transport opened."""


def check_write(plan: TransferPlan, local: Backing, peer: Peer) -> None:
    """What every transport checks before its first byte moves: the plan is for this peer
    incarnation, its destination regions are remotely writable, and every op lies inside its
    local and its remote region (invariants 2, 4 and 6)."""
    info = peer.info
    if (plan.dst_engine, plan.dst_incarnation) != (info.engine_id, info.incarnation):
        raise StaleIncarnationError(
            f"plan for {plan.dst_engine!r} incarnation {plan.dst_incarnation} cannot be written to "
            f"{info.engine_id!r} incarnation {info.incarnation}; plan again against the peer's "
            "current info",
            engine_id=info.engine_id,
            incarnation=info.incarnation,
            stale_incarnation=plan.dst_incarnation,
        )
    ops = plan.ops
    check_op_table(
        ops,
        [r.nbytes for r in local.regions],
        [r.length for r in info.regions],
        local_engine=plan.src_engine,
        remote_engine=info.engine_id,
    )
    # The usual plan writes one region: no scan for the distinct ones.
    single = len(ops) > 0 and not ops.remote_region.any()
    targets = [0] if single else np.unique(ops.remote_region).tolist()
    for index in targets:
        if not info.regions[index].remote_writable:
            raise RegionError(
                f"region {index} of engine {info.engine_id!r} is not remotely writable "
                "(only decode engines expose their regions)",
                engine_id=info.engine_id,
                region=index,
            )


def region_pairs(
    local_region: npt.NDArray[np.int64], remote_region: npt.NDArray[np.int64]
) -> list[tuple[tuple[int, int], slice | npt.NDArray[np.bool_]]]:
    """The (local region, remote region) pairs of an op table, each with the selector of its
    ops; the usual plan (one region each side) costs no scan."""
    if local_region.size and not local_region.any() and not remote_region.any():
        return [((0, 0), slice(None))]
    pairs: list[tuple[tuple[int, int], slice | npt.NDArray[np.bool_]]] = []
    for local_index, remote_index in np.unique(np.stack([local_region, remote_region]), axis=1).T.tolist():
        select = (local_region == local_index) & (remote_region == remote_index)
        pairs.append(((int(local_index), int(remote_index)), select))
    return pairs
