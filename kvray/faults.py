"""Deliberate faults, for demonstrations and for tests that prove kvray's checks can fail.

Nothing here is used unless asked for by name (`kvray demo --inject-seed-bug`, a
`ByteFlipper` given to an agent as its `transport_hook`, `executor_offset_bug`, or the vLLM
connector `SeedBugConnector`, loaded by module path: `KvrayConnector` with a digest log when
`digest_log` asks for one, as `kvray.bench.handoff_log.DigestLogConnector`, whose agents plan
with `SeedBugOffsetCache`):

    --kv-transfer-config '{"kv_connector": "SeedBugConnector",
                           "kv_connector_module_path": "kvray.faults", "kv_role": "kv_both"}'

(`SEED_BUG_CONNECTOR` for `pd.transfer_config`.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvray.integrations.vllm.pd import ConnectorClass
from kvray.memory import Backing, SourceReady
from kvray.placement import Stored
from kvray.plan import OffsetCache, OffsetKey, TransferPlan
from kvray.transport.base import OnStored, Peer, Transport
from kvray.transport.cpu_copy import set_executor_fault
from kvray.wire import EngineInfo


@contextlib.contextmanager
def executor_offset_bug() -> Iterator[None]:
    """While inside: every copy executor of this process (the C copy pool, its Python fallback;
    the shm, loopback and ray transports' copies; the `cuda_ipc` kernels) stores the last op of
    each batch of two or more over the op before it (on the GPU: the last block pair's), under
    a correct plan, as an executor that computed a wrong destination would. The placement
    digests report where the bytes went, so the decode side refuses every such transfer
    (`kvray.integrity.PlacementTable`)."""
    from kvray.transport.cuda_ipc.ops import set_executor_fault as set_gpu_executor_fault

    set_executor_fault(True)
    set_gpu_executor_fault(True)
    try:
        yield
    finally:
        set_executor_fault(False)
        set_gpu_executor_fault(False)


class SeedBugOffsetCache(OffsetCache):
    """The bug kvray exists to stop: offsets cached per engine by block geometry alone.

    Two layers of one geometry (dense0, dense1) share one cache entry, so the second is written
    to the first one's address and its own blocks on the decode side are never written.
    """

    def key(self, info: EngineInfo, layer: str) -> OffsetKey:
        return OffsetKey(info.engine_id, info.incarnation, "", info.layout.layer(layer).geometry)


class BuildsAgents(Protocol):
    """Something that builds an agent with `offset_cache` (None: the agent's own)."""

    offset_cache: OffsetCache | None


def inject_seed_bug(target: BuildsAgents) -> None:
    """Make the agent `target` builds next plan with `SeedBugOffsetCache`."""
    target.offset_cache = SeedBugOffsetCache()


#: The vLLM connector with the seed bug, as a `kv_transfer_config` names it.
SEED_BUG_CONNECTOR = ConnectorClass("SeedBugConnector", __name__)


class SeedBug:
    """The seed-bug half of `SeedBugConnector`, first in its bases: once the connector has built
    its worker side, the agent that worker starts plans with `SeedBugOffsetCache`."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        parent: Any = super()
        parent.__init__(vllm_config, role, kv_cache_config)
        worker = parent.worker
        if worker is not None:
            inject_seed_bug(worker)


@functools.cache
def seed_bug_connector() -> type:
    """`SeedBugConnector`: the digest-logging connector with `SeedBug` (built on first use, so
    that importing this module imports no vLLM)."""
    from kvray.bench.handoff_log import digest_log_connector

    name = SEED_BUG_CONNECTOR.name
    namespace = {"__module__": __name__, "__qualname__": name}
    return type(name, (SeedBug, digest_log_connector()), namespace)


def __getattr__(name: str) -> type:
    # vLLM loads the connector as `getattr(module, kv_connector)`.
    if name == SEED_BUG_CONNECTOR.name:
        return seed_bug_connector()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class ByteFlipper:
    """A transport hook (`KVAgent(..., transport_hook=ByteFlipper())`) that corrupts one byte of
    every `every`-th write on its way: one bit of a byte in the middle of the write's middle op
    is flipped in the writer's memory while the transport moves it, and put back after. The
    writer's checksums were taken before the write, so the decode side receives bytes that
    differ from what was hashed, as if the link had flipped them; the writer's own memory ends
    as it was. `flipped` records (request id, layer) of each corrupted write."""

    every: int = 1
    #: Zero the whole middle op's bytes instead of flipping one bit (a block that arrives blank).
    zero: bool = False
    writes: int = 0
    flipped: list[tuple[str, str]] = field(default_factory=list)
    #: Writes under way: a transport's `write_then` may call its own `write`, which must not
    #: count (or flip the byte back) a second time.
    _active: int = 0

    def __call__(self, transport: Transport) -> None:
        write, write_then = transport.write, transport.write_then

        async def flipped_write(
            plan: TransferPlan, local: Backing, peer: Peer, *, ready: SourceReady = None
        ) -> Stored:
            with self._flipped(plan, local):
                return await write(plan, local, peer, ready=ready)

        async def flipped_write_then(
            plan: TransferPlan,
            local: Backing,
            peer: Peer,
            then: OnStored,
            *,
            ready: SourceReady = None,
        ) -> Stored:
            with self._flipped(plan, local):
                return await write_then(plan, local, peer, then, ready=ready)

        # Deliberately on the instance: only this agent's transport corrupts.
        patched: Any = transport
        patched.write = flipped_write
        patched.write_then = flipped_write_then

    @contextlib.contextmanager
    def _flipped(self, plan: TransferPlan, local: Backing) -> Iterator[None]:
        if self._active:
            yield
            return
        self._active += 1
        try:
            with self._flip(plan, local):
                yield
        finally:
            self._active -= 1

    @contextlib.contextmanager
    def _flip(self, plan: TransferPlan, local: Backing) -> Iterator[None]:
        self.writes += 1
        ops = plan.unmerged
        if self.writes % self.every or not len(ops):
            yield
            return
        middle = len(ops) // 2
        region = int(ops.local_region[middle])
        layer = next(name for index, name in enumerate(plan.layers) if plan.layer_starts[index + 1] > middle)
        self.flipped.append((plan.request_id, layer))
        if self.zero:
            # The whole op's bytes (one block's part of a layer, or a run of them) zeroed.
            start = int(ops.local_offset[middle])
            block = local.regions[region].tensor[start : start + int(ops.nbytes[middle])]
            kept = block.clone()
            block.zero_()
            try:
                yield
            finally:
                block.copy_(kept)
            return
        offset = int(ops.local_offset[middle]) + int(ops.nbytes[middle]) // 2
        byte = local.regions[region].tensor[offset : offset + 1]
        byte.bitwise_xor_(1)
        try:
            yield
        finally:
            byte.bitwise_xor_(1)
