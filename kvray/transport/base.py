"""Transport interface (sixth step of the data flow): both halves of a one-sided write.

A transport is small, and each half is a handful of methods:

    writer    `register` turns a backing's regions into descriptors a peer can write through;
              `write` (or `write_then`) issues a plan's ops into a peer's regions and returns
              the placement digest of the ranges it stored to (`kvray.placement`); `forget`
              drops what was opened for a peer; `close` releases everything.
    receiver  a decode engine's side: `publish` adds what writers need to reach it (an RDMA
              port) to the info it publishes; `expect` and `release` bracket one request;
              `deliver` takes a write that arrives as a message (`ray`), `accept` a writer's
              connection request (`verbs`); `complete` returns once the transport's own proofs
              that a notice's writes have landed have come (`arrival_proofs` per write, counted
              in the notice: `verbs` immediates). The defaults
              do nothing: a transport whose writes land with no help from the receiver
              (`shm`, `cuda_ipc`) leaves them alone.

Everything a writer needs to reach a peer arrives in a `Peer` (its published `EngineInfo` and,
under Ray, the actor hosting its agent); everything a receiving transport needs from the
engine it serves comes through the `Receiver` protocol, which the agent implements. The
capability flags on each class (`reach`, `source_kinds`, `destination_kinds`, `registers`,
`accepts`) are what `kvray.transport.choose_transport` reads; `arrival_proofs` and
`claims_across_nodes` are what the agent's push and receive read. Availability is asked two
ways: `unavailable_reason`, whether an agent in this process can open the transport now, and
`machine_unavailable_reason` with `needs`, whether this machine can provide it at all (what
`kvray doctor` reports).
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvray.config import Settings
from kvray.content import Stretches
from kvray.errors import RegionError, StaleIncarnationError, TransportError
from kvray.integrity import THREAD_MIN_BYTES
from kvray.layout import Int64Array
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.metrics import EngineMetrics
from kvray.placement import Stored, ranges_digest
from kvray.plan import TransferPlan, check_op_table, check_rows
from kvray.wire import EngineInfo, RegionDescriptor, TransferDone, TransportKind

#: Raises unless every op (region, offset, nbytes) lies inside what one request may change.
OpsCheck = Callable[[Int64Array, Int64Array, Int64Array], None]
#: What `Transport.write_then` calls once every byte of a write is in the peer's memory.
OnStored = Callable[[Stored], None]


@dataclass(frozen=True)
class Peer:
    """A remote engine as a transport sees it."""

    info: EngineInfo
    #: Ray actor hosting the peer's agent (an `AgentHost`), or None outside Ray.
    host: Any = None


class PeerAddress(Protocol):
    """What a notice channel reads of what a peer published (an `EngineInfo` has it all)."""

    @property
    def engine_id(self) -> str: ...

    @property
    def incarnation(self) -> int: ...

    @property
    def node_id(self) -> str:
        """The node it runs on (a same-node channel compares it with its own agent's)."""

    @property
    def endpoints(self) -> Mapping[str, str]:
        """Where its receiving ends are (an inbox's path, a listener's address and key)."""


class Reachable(Protocol):
    """A peer as a notice channel sees it (`kvray.notice`; a `Peer` is one, and so is a prefill
    engine as its ticket names it): what it published, and the actor hosting its agent (None:
    none)."""

    @property
    def info(self) -> PeerAddress: ...

    @property
    def host(self) -> Any: ...


class Reach(enum.Enum):
    """Where a transport's two ends may be."""

    #: Both on one node (shared memory, CUDA IPC).
    SAME_NODE = "same_node"
    #: On different nodes (RDMA: on one node a same-node transport is always the better pick).
    OTHER_NODES = "other_nodes"
    #: Anywhere.
    ANYWHERE = "anywhere"


class Receiver(Protocol):
    """The decode engine a receiving transport serves (the agent implements it)."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def backing(self) -> Backing: ...

    def admit(self, request_id: str, token: int) -> AbstractAsyncContextManager[OpsCheck]:
        """Enter before a write of `request_id` moves a byte: refuses (`NotExpectedError`) a
        request the engine does not expect under `token`; yields the check that the write's ops
        stay inside the request's blocks; a failed wait for the request outlasts the block."""
        ...

    def landed(self, request_id: str, stored: Stored) -> None:
        """Inside `admit`: what the executor of a write of `request_id` that ran here reports
        (`kvray.placement.Stored`); the engine adds it to the writer's own."""
        ...

    async def writer(self, engine_id: str, incarnation: int) -> EngineInfo:
        """The registered info of a writer at the incarnation it claims, or a kvray error."""
        ...


class Transport(abc.ABC):
    """Moves bytes from a local backing into a peer's registered regions (writer half), and
    helps a decode engine take them in (receiver half)."""

    kind: ClassVar[TransportKind]
    #: What the transport needs of a machine and its engines, in a few words (`kvray doctor`).
    needs: ClassVar[str]
    #: Where the two ends may be.
    reach: ClassVar[Reach]
    #: Memory the writer's backing may live in.
    source_kinds: ClassVar[frozenset[MemoryKind]]
    #: Memory the destination backing may live in.
    destination_kinds: ClassVar[frozenset[MemoryKind]]
    #: Backings whose regions this transport describes at registration (an engine publishes its
    #: regions through exactly one transport).
    registers: ClassVar[frozenset[MemoryKind]] = frozenset()
    #: Proofs of arrival the receiver gets from this transport for each write, which a
    #: completion notice can overtake: the notice counts them, and the receiver completes the
    #: request only once they have all come (`complete`).
    arrival_proofs: ClassVar[int] = 0
    #: The receiver does not see this transport's writes land (one-sided, across nodes): a writer
    #: on another node claims each request from the receiver before its first byte, so the
    #: receiver keeps the request's blocks until the writer's notice.
    claims_across_nodes: ClassVar[bool] = False

    def __init__(self, settings: Settings, metrics: EngineMetrics | None = None) -> None:
        self.settings = settings
        #: Where the transport counts what it did (its agent's metrics).
        self.metrics = metrics if metrics is not None else EngineMetrics.detached()

    @classmethod
    @abc.abstractmethod
    def unavailable_reason(cls, settings: Settings) -> str | None:
        """None when an agent in this process can open the transport now, else one sentence
        saying why not."""

    @classmethod
    def machine_unavailable_reason(cls, settings: Settings) -> str | None:
        """None when this machine can provide the transport to the engines kvray runs on it,
        else one sentence saying what it lacks. By default `unavailable_reason`, for transports
        whose needs are the machine's; one whose run-time check is about the process (Ray
        initialised in it) answers here for the machine."""
        return cls.unavailable_reason(settings)

    @classmethod
    def accepts(cls, peer: EngineInfo) -> bool:
        """Whether the peer published what this transport writes through (by default, nothing
        beyond its regions)."""
        return True

    # ---- writer half ------------------------------------------------------------------

    def register(
        self, backing: Backing, engine_id: str, incarnation: int, *, remote_writable: bool
    ) -> tuple[RegionDescriptor, ...]:
        """Descriptors of the backing's regions, for the engine's published info."""
        return backing.region_descriptors(engine_id, incarnation, self.kind, remote_writable=remote_writable)

    @abc.abstractmethod
    async def write(
        self, plan: TransferPlan, local: Backing, peer: Peer, *, ready: SourceReady = None
    ) -> Stored:
        """Issue every op of `plan`; return once the bytes are in the peer's memory, with what
        its executor reports of the ranges it stored to (`kvray.placement.Stored`), taken where
        it stores: their placement digest and, where it hashed the bytes as it copied them, their
        content digest (`Stored(0, 0)` where the receiving side's executor reports instead:
        `Receiver.landed`). `ready`: what says the source bytes are written
        (`kvray.memory.SourceReady`); a transport that reads device memory orders its reads
        after it."""

    async def write_then(
        self, plan: TransferPlan, local: Backing, peer: Peer, then: OnStored, *, ready: SourceReady = None
    ) -> Stored:
        """`write`, calling `then(stored)` once, as soon as every byte is in the peer's memory: a
        transport whose copy finishes on a thread of its own calls it there, before this
        coroutine resumes (the agent sends the completion notice from it, sparing the decode
        side a trip through this event loop; a `DatagramNotice` may even be sent without
        Python, by the C copy pool's thread). `then` must be quick, thread-safe and must not
        raise. Here: after `write` returns, on the loop."""
        stored = await self.write(plan, local, peer, ready=ready)
        then(stored)
        return stored

    async def reference(self, stretches: Stretches, local: Backing, *, ready: SourceReady = None) -> int:
        """The writer's own content digest of `stretches` (`kvray.content`), hashing them in
        `local`'s memory now (after `ready`, as `write` reads them): what the decode side
        compares with the digest the copy reports.
        Here: host memory, on a worker thread when large (the hash releases the GIL); a
        transport whose sources are on a device hashes them there."""
        regions = [region.tensor.numpy() for region in local.regions]
        if stretches.nbytes_total < THREAD_MIN_BYTES:
            return stretches.digest(regions)
        return await asyncio.to_thread(stretches.digest, regions)

    def hashes(self, local: Backing, peer: Peer) -> bool:
        """Whether a write from `local` to `peer` reports a content digest (`Stored.content`):
        its copy hashes the bytes as it moves them (`kvray.content`). Where not, a checked
        request's writer sends every layer's checksums instead."""
        return False

    def forget(self, engine_id: str) -> None:  # noqa: B027 - optional hook
        """Drop whatever is cached for a peer (it restarted, left or failed). A write still
        using an entry keeps it until the write ends."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything the transport opened."""

    # ---- receiver half (a decode engine's) --------------------------------------------

    def publish(self, info: EngineInfo, receiver: Receiver) -> EngineInfo:
        """The engine `receiver` starts taking writes through this transport (once, at its
        start): `info` with whatever writers need to reach it added."""
        return info

    def expect(self, receiver: Receiver, request_id: str) -> None:  # noqa: B027 - optional hook
        """The engine expects writes of `request_id` from now on (may refuse with a kvray error)."""

    def release(self, receiver: Receiver, request_id: str) -> None:  # noqa: B027 - optional hook
        """The engine expects no more writes of `request_id`."""

    async def complete(self, receiver: Receiver, notice: TransferDone) -> None:  # noqa: B027
        """Return once this transport's own proof that the notice's writes have landed has
        come (the caller bounds the wait)."""

    async def deliver(self, receiver: Receiver, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        """A write that arrives as a message: check it, then apply it; the bytes written."""
        raise TransportError(
            f"the {self.kind.value} transport takes no delivered writes", transport=self.kind.value
        )

    async def accept(self, receiver: Receiver, request: bytes) -> bytes:
        """A writer's connection request, and the answer that lets it write."""
        raise TransportError(
            f"the {self.kind.value} transport takes no connection requests", transport=self.kind.value
        )


K = TypeVar("K")
V = TypeVar("V")


class PeerCache(Generic[K, V]):
    """What a transport opened for its peers (mappings, handles, connections), each entry
    under (engine, incarnation, part): one incarnation per engine (opening another drops the
    old one's entries), at most `max_peers` engines and, where entries have a size (`nbytes`),
    at most `max_nbytes` in all; the least recently used engines are forgotten first, never
    the one just opened. A dropped entry goes to `drop` (e.g. to unmap it once its last user
    is done)."""

    def __init__(
        self,
        max_peers: int,
        drop: Callable[[V], None] | None = None,
        *,
        nbytes: Callable[[V], int] | None = None,
        max_nbytes: int | None = None,
    ) -> None:
        self._max_peers = max_peers
        self._drop = drop
        self._nbytes = nbytes
        self._max_nbytes = max_nbytes
        self._entries: dict[tuple[str, int, K], V] = {}
        #: Engines with entries, least recently used first.
        self._engines: OrderedDict[str, int] = OrderedDict()
        #: The size of every entry, by `nbytes`.
        self.total_nbytes = 0

    def get(self, engine_id: str, incarnation: int, part: K) -> V | None:
        """The entry, if one is open; counts as a use of the engine."""
        if self._engines.get(engine_id) == incarnation:
            self._engines.move_to_end(engine_id)
        return self._entries.get((engine_id, incarnation, part))

    def put(self, engine_id: str, incarnation: int, part: K, value: V) -> None:
        if self._engines.get(engine_id, incarnation) != incarnation:
            self.forget(engine_id)
        key = (engine_id, incarnation, part)
        replaced = self._entries.get(key)
        self._entries[key] = value
        if self._nbytes is not None:
            self.total_nbytes += self._nbytes(value) - (0 if replaced is None else self._nbytes(replaced))
        self._engines[engine_id] = incarnation
        self._engines.move_to_end(engine_id)
        while len(self._engines) > self._max_peers or (
            self._max_nbytes is not None and self.total_nbytes > self._max_nbytes and len(self._engines) > 1
        ):
            self.forget(next(iter(self._engines)))

    def pop(self, engine_id: str, incarnation: int, part: K) -> None:
        """Drop one entry."""
        value = self._entries.pop((engine_id, incarnation, part), None)
        if value is None:
            return
        if self._nbytes is not None:
            self.total_nbytes -= self._nbytes(value)
        if self._drop is not None:
            self._drop(value)

    def forget(self, engine_id: str) -> None:
        """Drop every entry of an engine."""
        self._engines.pop(engine_id, None)
        for key in [key for key in self._entries if key[0] == engine_id]:
            self.pop(*key)

    def forget_where(self, gone: Callable[[V], bool], *, keep: str | None = None) -> list[str]:
        """Forget every engine but `keep` one of whose entries is `gone` (e.g. its memory was
        removed: that life of the engine is over); the engines forgotten."""
        engines = list(
            dict.fromkeys(
                engine_id
                for (engine_id, _, _), value in self._entries.items()
                if engine_id != keep and gone(value)
            )
        )
        for engine_id in engines:
            self.forget(engine_id)
        return engines

    def clear(self) -> None:
        for engine_id in list(self._engines):
            self.forget(engine_id)

    def values(self) -> Iterator[V]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)


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
    local_lengths = tuple(r.nbytes for r in local.regions)
    remote_lengths = tuple(r.length for r in info.regions)
    if plan.rows is not None:
        # Every op lies between its row's smallest and largest block id (`check_rows`), so
        # the rows and the ids cover the ops without expanding them. Planning has checked
        # them already if it saw these lengths and the ids are still the ones it checked.
        rows = plan.rows
        if not rows.was_checked_against(local_lengths, remote_lengths):
            check_rows(rows.local, rows.local_ids, local_lengths, side="local", engine_id=plan.src_engine)
            check_rows(rows.remote, rows.remote_ids, remote_lengths, side="remote", engine_id=info.engine_id)
        remote_regions = rows.remote.region
    else:
        check_op_table(
            plan.ops,
            local_lengths,
            remote_lengths,
            local_engine=plan.src_engine,
            remote_engine=info.engine_id,
        )
        remote_regions = plan.ops.remote_region
    # The usual plan writes one region: no scan for the distinct ones.
    single = remote_regions.size > 0 and not remote_regions.any()
    targets = [0] if single else np.unique(remote_regions).tolist()
    for index in targets:
        if not info.regions[index].remote_writable:
            raise RegionError(
                f"region {index} of engine {info.engine_id!r} is not remotely writable "
                "(only decode engines expose their regions)",
                engine_id=info.engine_id,
                region=index,
            )


def planned_placement(plan: TransferPlan) -> Stored:
    """The placement digest of the plan's op table: what an executor that takes the table
    whole (a device's copy kernel, a NIC's work requests) reports for it; no content digest."""
    ops = plan.ops
    return Stored(ranges_digest(ops.remote_region, ops.remote_offset, ops.nbytes))


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
