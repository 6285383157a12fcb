"""`loopback` transport: engines in one process, for tests and for embedding kvray where both
ends live in one program (as httpx ships a mock transport). Writes go through the same checks
as every transport's (`check_write`) and the decode engine's admission (`Receiver.admit`: the
request is expected under its token, the ops stay inside its blocks) before a byte moves.

    network = LoopbackNetwork()
    prefill = KVAgent("p", Role.PREFILL, layout, transports=[LoopbackTransport(network)])
    decode = KVAgent("d", Role.DECODE, layout, transports=[LoopbackTransport(network)])

Each agent takes its own `LoopbackTransport`; the engines that share a `LoopbackNetwork` reach
each other. Completion notices still travel the usual way (the decode engine's inbox).
"""

from __future__ import annotations

import numpy as np
import torch

from kvray.config import Settings
from kvray.errors import StaleIncarnationError, TransportError
from kvray.layout import Int64Array
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.metrics import EngineMetrics
from kvray.placement import NOTHING, Stored, ranges_digest, region_salt
from kvray.plan import TransferPlan
from kvray.transport.base import Peer, Reach, Receiver, Transport, check_write, region_pairs
from kvray.transport.cpu_copy import Hashing, scatter_copy_async
from kvray.wire import EngineInfo, TransportKind

_EVERY_KIND = frozenset(MemoryKind)


class LoopbackNetwork:
    """The decode engines loopback transports can write into: each one that started with a
    `LoopbackTransport` of this network, until its agent closes."""

    def __init__(self) -> None:
        self._receivers: dict[str, tuple[int, Receiver]] = {}
        #: Writes that moved bytes, and the bytes they moved.
        self.writes = 0
        self.nbytes = 0

    def join(self, receiver: Receiver) -> None:
        info = receiver.info
        self._receivers[info.engine_id] = (info.incarnation, receiver)

    def leave(self, engine_id: str, incarnation: int) -> None:
        if self._receivers.get(engine_id, (None,))[0] == incarnation:
            del self._receivers[engine_id]

    def receiver(self, info: EngineInfo) -> Receiver:
        """The engine's receiver, if that incarnation of it is on this network."""
        joined = self._receivers.get(info.engine_id)
        if joined is None:
            raise TransportError(
                f"engine {info.engine_id!r} is not on this loopback network (its agent closed, or "
                "it started with another network's transport)",
                engine_id=info.engine_id,
            )
        incarnation, receiver = joined
        if incarnation != info.incarnation:
            raise StaleIncarnationError(
                f"engine {info.engine_id!r} is incarnation {incarnation} on this loopback network, "
                f"not {info.incarnation}; look the engine up again",
                engine_id=info.engine_id,
                incarnation=incarnation,
                stale_incarnation=info.incarnation,
            )
        return receiver


class LoopbackTransport(Transport):
    """One agent's end of a `LoopbackNetwork` (a fresh network of its own when none is given)."""

    kind = TransportKind.LOOPBACK
    needs = "both engines in one process, each agent given one"
    reach = Reach.SAME_NODE
    source_kinds = _EVERY_KIND
    destination_kinds = _EVERY_KIND
    registers = _EVERY_KIND

    def __init__(
        self,
        network: LoopbackNetwork | None = None,
        settings: Settings | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        super().__init__(settings or Settings(), metrics)
        self.network = network if network is not None else LoopbackNetwork()
        self._joined: list[tuple[str, int]] = []

    @classmethod
    def unavailable_reason(cls, settings: Settings) -> str | None:
        return (
            "the loopback transport connects the engines of one process only: give each agent "
            "one, KVAgent(..., transports=[LoopbackTransport(network)])"
        )

    @classmethod
    def accepts(cls, peer: EngineInfo) -> bool:
        return all(region.transport is cls.kind for region in peer.regions)

    def publish(self, info: EngineInfo, receiver: Receiver) -> EngineInfo:
        self.network.join(receiver)
        self._joined.append((info.engine_id, info.incarnation))
        return info

    def hashes(self, local: Backing, peer: Peer) -> bool:
        destination = self.network.receiver(peer.info).backing
        return MemoryKind.CUDA not in (local.kind, destination.kind)

    async def write(
        self, plan: TransferPlan, local: Backing, peer: Peer, *, ready: SourceReady = None
    ) -> Stored:
        receiver = self.network.receiver(peer.info)
        check_write(plan, local, peer)
        ops = plan.ops
        async with receiver.admit(plan.request_id, plan.token) as within:
            within(ops.remote_region, ops.remote_offset, ops.nbytes)
            destination = receiver.backing
            stored = NOTHING
            for (local_index, remote_index), select in region_pairs(ops.local_region, ops.remote_region):
                stored = stored.plus(
                    await _copy(
                        plan.hashed,
                        local_index,
                        remote_index,
                        destination.regions[remote_index].tensor,
                        local.regions[local_index].tensor,
                        ops.remote_offset[select],
                        ops.local_offset[select],
                        ops.nbytes[select],
                    )
                )
        self.network.writes += 1
        self.network.nbytes += ops.total_nbytes
        return stored

    async def close(self) -> None:
        for engine_id, incarnation in self._joined:
            self.network.leave(engine_id, incarnation)
        self._joined.clear()


async def _copy(
    hashed: bool,
    source_region: int,
    region: int,
    target: torch.Tensor,
    source: torch.Tensor,
    target_offsets: Int64Array,
    source_offsets: Int64Array,
    sizes: Int64Array,
) -> Stored:
    """Copy each op's bytes: through the copy pool between CPU tensors (hashing them as it goes),
    by tensor slices where a GPU is involved; what was stored into `target` (region `region`)."""
    if not target.is_cuda and not source.is_cuda:
        return await scatter_copy_async(
            target.data_ptr(),
            source.data_ptr(),
            target_offsets,
            source_offsets,
            sizes,
            salt=region_salt(region),
            hashing=Hashing.between(source_region, region) if hashed else None,
        )
    for target_offset, source_offset, nbytes in zip(
        target_offsets.tolist(), source_offsets.tolist(), sizes.tolist(), strict=True
    ):
        target[target_offset : target_offset + nbytes].copy_(source[source_offset : source_offset + nbytes])
    if target.is_cuda:
        torch.cuda.synchronize(target.device)
    return Stored(ranges_digest(np.full(sizes.size, region, dtype=np.int64), target_offsets, sizes))
