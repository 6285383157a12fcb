"""Ready prefill and decode workers: async Ray actors around a `KVAgent` and a block pool.

The decode worker reserves blocks for a request (and expects its KV), the prefill worker
pushes its blocks into them and frees its own after the push, success or failure; the
decode worker frees a request's blocks when its wait fails or passes its deadline, or when
the caller releases it after decoding.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
import torch

from kvray.agent import AgentHost, Completion, KVAgent, PushResult
from kvray.config import Settings
from kvray.errors import BackpressureError, BlockIdError, ConfigError, KvrayError, LayoutError, PlanError
from kvray.layout import KVLayout
from kvray.memory import MemoryKind
from kvray.metrics import EngineMetrics
from kvray.models.reference import ModelConfig, ReferenceModel
from kvray.plan import OffsetCache
from kvray.wire import Role, TransportKind

ByteArray = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker reports for one request."""

    first_token: int
    #: The forward pass over the prompt.
    compute_s: float
    #: Transfer time left after the forward pass ended (what layer-wise pushing hides).
    exposed_transfer_s: float
    #: The push itself (for layer-wise pushes: first layer written to completion sent).
    transfer_s: float
    nbytes: int
    transport: TransportKind
    #: Per layer, a hash of the prompt's blocks as prefill wrote them.
    kv_digest: dict[str, str]


@dataclass(frozen=True)
class DecodeResult:
    """What a decode worker reports for one request."""

    tokens: list[int]
    #: From the decode call to the KV's arrival.
    wait_s: float
    decode_s: float
    #: Per layer, a hash of the prompt's blocks as they arrived (compare with the prefill's).
    kv_digest: dict[str, str]


class BlockPool:
    """Free-list of block ids; double frees and foreign ids are errors, not silent. Its usage
    is recorded in `metrics` (blocks in use and in the pool), when given."""

    def __init__(
        self, num_blocks: int, seed: int | None = None, metrics: EngineMetrics | None = None
    ) -> None:
        self.num_blocks = num_blocks
        order = np.random.default_rng(seed).permutation(num_blocks) if seed is not None else range(num_blocks)
        self._free: list[int] = [int(block) for block in order]
        self._used: set[int] = set()
        self._metrics = metrics
        self._record()

    def _record(self) -> None:
        if self._metrics is not None:
            self._metrics.blocks(len(self._used), self.num_blocks)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._used)

    def allocate(self, count: int) -> list[int]:
        if count <= 0:
            raise BlockIdError(f"allocate a positive number of blocks, not {count}", count=count)
        if count > len(self._free):
            raise BackpressureError(
                f"{count} blocks requested, {len(self._free)} of {self.num_blocks} free",
                requested=count,
                free=len(self._free),
            )
        blocks = [self._free.pop() for _ in range(count)]
        self._used.update(blocks)
        self._record()
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        foreign = [block for block in blocks if block not in self._used]
        if foreign or len(set(blocks)) != len(blocks):
            raise BlockIdError(f"blocks {foreign or list(blocks)} are not allocated (double free?)")
        self._used.difference_update(blocks)
        self._free.extend(blocks)
        self._record()


class _Worker(AgentHost):
    role: Role

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        settings: Settings | None = None,
        memory: MemoryKind | None = None,
        pool_seed: int | None = None,
        model: ModelConfig | None = None,
        offset_cache: OffsetCache | None = None,
        coordinator: Any = None,
    ) -> None:
        self.model = ReferenceModel(model) if model is not None else None
        if self.model is not None:
            expected = self.model.layout(layout.num_blocks, layout.block_order)
            if expected != layout:
                raise LayoutError(
                    f"worker {engine_id!r}: the layout is not the model's (the model caches "
                    f"{list(expected.layer_names)})",
                    engine_id=engine_id,
                )
        # `coordinator`: the directory the agent registers with (default: the named coordinator
        # actor). Serve replicas pass one that names their host actor (see kvray.serve).
        self.kvray_agent = KVAgent(
            engine_id,
            self.role,
            layout,
            settings=settings,
            memory=memory,
            offset_cache=offset_cache,
            coordinator=coordinator,
        )
        self.pool = BlockPool(layout.num_blocks, pool_seed, self.kvray_agent.metrics)
        self.requests: dict[str, list[int]] = {}

    async def start(self) -> dict[str, Any]:
        info = await self.kvray_agent.start()
        return {"engine_id": info.engine_id, "incarnation": info.incarnation, "node_id": info.node_id}

    async def close(self) -> None:
        await self.kvray_agent.close()

    async def stats(self) -> dict[str, int]:
        return {
            **self.kvray_agent.stats,
            "free_blocks": self.pool.free_count,
            "used_blocks": self.pool.used_count,
            "requests": len(self.requests),
        }

    async def free_count(self) -> int:
        return self.pool.free_count

    # ---- inspection: what the model would read and write ------------------------------

    async def write_blocks(self, blocks: Sequence[int], data: dict[str, ByteArray]) -> None:
        """Write raw bytes into the given blocks of each named layer (as a forward pass would)."""
        for layer, values in data.items():
            view = self.kvray_agent.backing.view(layer)
            target = _blocks_of(view, blocks, self.kvray_agent.layout.layer(layer).geometry.parts)
            source = torch.from_numpy(np.ascontiguousarray(values)).view(view.dtype).reshape(target.shape)
            _assign_blocks(view, blocks, self.kvray_agent.layout.layer(layer).geometry.parts, source)

    async def read_blocks(
        self, blocks: Sequence[int], layers: Sequence[str] | None = None
    ) -> dict[str, ByteArray]:
        """The bytes of the given blocks of each layer, as uint8 arrays."""
        out: dict[str, ByteArray] = {}
        for layer in layers or self.kvray_agent.layout.layer_names:
            view = self.kvray_agent.backing.view(layer)
            picked = _blocks_of(view, blocks, self.kvray_agent.layout.layer(layer).geometry.parts)
            out[layer] = picked.contiguous().view(torch.uint8).numpy().copy()
        return out

    async def fill_region(self, seed: int) -> None:
        """Fill every byte of every allocation (region and slack) with a seeded pattern."""
        for region in self.kvray_agent.backing.regions:
            assert region.allocation is not None
            generator = torch.Generator().manual_seed(seed + region.index)
            region.allocation.copy_(
                torch.randint(0, 256, region.allocation.shape, dtype=torch.uint8, generator=generator)
            )

    async def kv_digest(self, blocks: Sequence[int]) -> dict[str, str]:
        """Per layer, a hash of the bytes of `blocks` in order: equal on both sides of a transfer."""
        return {
            layer: hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
            for layer, data in (await self.read_blocks(blocks)).items()
        }

    async def generate_colocated(self, tokens: Sequence[int], max_new_tokens: int) -> list[int]:
        """Reference generation: prefill and decode here, on this worker's own blocks."""
        model = self._model()
        blocks = self.pool.allocate(model.blocks_needed(len(tokens) + max_new_tokens))
        try:
            return await asyncio.to_thread(
                model.generate, list(tokens), self.kvray_agent.backing.views, blocks, max_new_tokens
            )
        finally:
            self.pool.free(blocks)

    def _model(self) -> ReferenceModel:
        if self.model is None:
            raise ConfigError(
                f"worker {self.kvray_agent.engine_id!r} was started without a model (pass model=...)"
            )
        return self.model

    async def snapshot(self) -> list[tuple[int, ByteArray]]:
        """(region offset inside its allocation, copy of the whole allocation) per region."""
        return [
            (region.span.offset_in_allocation, region.allocation.numpy().copy())
            for region in self.kvray_agent.backing.regions
            if region.allocation is not None
        ]


def _blocks_of(view: torch.Tensor, blocks: Sequence[int], parts: int) -> torch.Tensor:
    index = torch.as_tensor(list(blocks), dtype=torch.long)
    return view[:, index] if parts == 2 else view[index]


def _assign_blocks(view: torch.Tensor, blocks: Sequence[int], parts: int, values: torch.Tensor) -> None:
    index = torch.as_tensor(list(blocks), dtype=torch.long)
    if parts == 2:
        view[:, index] = values
    else:
        view[index] = values


class PrefillWorker(_Worker):
    """Holds a request's KV after prefill and pushes it into a decode worker's blocks."""

    role = Role.PREFILL

    async def allocate(self, request_id: str, count: int) -> list[int]:
        if request_id in self.requests:
            raise PlanError(f"request {request_id!r} already holds blocks", request_id=request_id)
        blocks = self.pool.allocate(count)
        self.requests[request_id] = blocks
        return blocks

    async def fill_random(self, request_id: str, seed: int) -> None:
        """Write seeded random bytes into the request's blocks of every layer."""
        blocks = self.requests[request_id]
        rng = np.random.default_rng(seed)
        data = {}
        for layer in self.kvray_agent.layout.layer_names:
            view = self.kvray_agent.backing.view(layer)
            nbytes = _blocks_of(view, blocks, self.kvray_agent.layout.layer(layer).geometry.parts).numel()
            nbytes *= view.element_size()
            data[layer] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        await self.write_blocks(blocks, data)

    async def push(
        self,
        request_id: str,
        decode_engine: str,
        decode_blocks: Sequence[int],
        decode_incarnation: int | None = None,
        *,
        layerwise: bool = False,
        layers: Sequence[str] | None = None,
        timeout: float | None = None,
        keep_blocks: bool = False,
    ) -> PushResult:
        """Push the request's blocks; the request's own blocks are freed afterwards either way."""
        blocks = self.requests.get(request_id)
        if blocks is None:
            raise PlanError(f"request {request_id!r} holds no blocks here", request_id=request_id)
        agent = self.kvray_agent
        try:
            if not layerwise:
                return await agent.push(
                    request_id,
                    blocks,
                    decode_engine,
                    decode_blocks,
                    layers,
                    remote_incarnation=decode_incarnation,
                    timeout=timeout,
                )
            try:
                for layer in layers or agent.layout.layer_names:
                    await agent.push_layer(
                        request_id,
                        layer,
                        blocks,
                        decode_engine,
                        decode_blocks,
                        remote_incarnation=decode_incarnation,
                        timeout=timeout,
                    )
                return await agent.finish(request_id, timeout=timeout)
            except KvrayError as error:
                await agent.abort(
                    request_id, decode_engine, str(error), remote_incarnation=decode_incarnation
                )
                raise
        finally:
            if not keep_blocks:
                self.pool.free(self.requests.pop(request_id))

    async def release(self, request_id: str) -> None:
        self.pool.free(self.requests.pop(request_id))

    async def prefill(
        self,
        request_id: str,
        tokens: Sequence[int],
        decode_engine: str,
        decode_blocks: Sequence[int],
        decode_incarnation: int | None = None,
        *,
        layerwise: bool = False,
        timeout: float | None = None,
    ) -> PrefillResult:
        """Run the model over the prompt and push its KV into the decode worker's blocks.

        Layer-wise, each layer's push starts as soon as the forward pass has written that
        layer, while later layers are still being computed; otherwise the whole request is
        pushed after the pass. The request's blocks here are freed afterwards either way.
        """
        model = self._model()
        agent = self.kvray_agent
        blocks = await self.allocate(request_id, model.blocks_needed(len(tokens)))
        if len(decode_blocks) != len(blocks):
            self.pool.free(self.requests.pop(request_id))
            raise BlockIdError(
                f"a {len(tokens)}-token prompt fills {len(blocks)} blocks, but {len(decode_blocks)} "
                "decode blocks were given",
                request_id=request_id,
            )
        loop = asyncio.get_running_loop()
        pushes: list[asyncio.Task[int]] = []

        def start_push(layer: str) -> None:
            pushes.append(
                loop.create_task(
                    agent.push_layer(
                        request_id,
                        layer,
                        blocks,
                        decode_engine,
                        decode_blocks,
                        remote_incarnation=decode_incarnation,
                        timeout=timeout,
                    )
                )
            )

        def on_layer(layer: str) -> None:  # runs on the compute thread, once per cache layer
            loop.call_soon_threadsafe(start_push, layer)

        try:
            started = time.perf_counter()
            try:
                first_token = await asyncio.to_thread(
                    model.prefill, list(tokens), agent.backing.views, blocks, on_layer if layerwise else None
                )
                computed = time.perf_counter()
                if layerwise:
                    await asyncio.gather(*pushes)
                    pushed = await agent.finish(request_id, timeout=timeout)
                else:
                    pushed = await agent.push(
                        request_id,
                        blocks,
                        decode_engine,
                        decode_blocks,
                        remote_incarnation=decode_incarnation,
                        timeout=timeout,
                    )
            except BaseException as error:
                # No push may still read these blocks once they go back to the pool.
                for push in pushes:
                    push.cancel()
                await asyncio.gather(*pushes, return_exceptions=True)
                if layerwise:
                    await agent.abort(
                        request_id,
                        decode_engine,
                        f"{type(error).__name__}: {error}",
                        remote_incarnation=decode_incarnation,
                    )
                raise
            finished = time.perf_counter()
            digest = await self.kv_digest(blocks)
            return PrefillResult(
                first_token=first_token,
                compute_s=computed - started,
                exposed_transfer_s=finished - computed,
                transfer_s=pushed.seconds,
                nbytes=pushed.nbytes,
                transport=pushed.transport,
                kv_digest=digest,
            )
        finally:
            self.pool.free(self.requests.pop(request_id))


class DecodeWorker(_Worker):
    """Reserves blocks for requests and waits for their KV to arrive."""

    role = Role.DECODE

    async def reserve(self, request_id: str, count: int) -> tuple[list[int], int]:
        """Blocks for the request, and the incarnation they belong to; its KV is now expected."""
        if request_id in self.requests:
            raise PlanError(f"request {request_id!r} already holds blocks", request_id=request_id)
        blocks = self.pool.allocate(count)
        self.requests[request_id] = blocks
        self.kvray_agent.expect(request_id)
        return blocks, self.kvray_agent.incarnation

    async def wait(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait for the request's KV; on failure or deadline its blocks go back to the pool."""
        blocks = self.requests.get(request_id)
        if blocks is None:
            raise PlanError(f"request {request_id!r} holds no blocks here", request_id=request_id)
        try:
            return await self.kvray_agent.wait_for_kv(request_id, timeout)
        except BaseException:
            if self.requests.get(request_id) is blocks:  # else `release` freed them meanwhile
                self.pool.free(self.requests.pop(request_id))
            raise

    async def decode(
        self,
        request_id: str,
        first_token: int,
        prompt_len: int,
        max_new_tokens: int,
        timeout: float | None = None,
    ) -> DecodeResult:
        """Wait for the request's KV, generate from it, free its blocks."""
        model = self._model()
        started = time.perf_counter()
        await self.wait(request_id, timeout)
        arrived = time.perf_counter()
        blocks = self.requests[request_id]
        try:
            digest = await self.kv_digest(blocks[: model.blocks_needed(prompt_len)])
            tokens = await asyncio.to_thread(
                model.decode, first_token, prompt_len, self.kvray_agent.backing.views, blocks, max_new_tokens
            )
        finally:
            await self.release(request_id)
        return DecodeResult(
            tokens=tokens,
            wait_s=arrived - started,
            decode_s=time.perf_counter() - arrived,
            kv_digest=digest,
        )

    async def release(self, request_id: str) -> None:
        """The request is decoded: free its blocks."""
        self.kvray_agent.cancel(request_id)
        self.pool.free(self.requests.pop(request_id))


#: Custom Ray resources of prefill and decode nodes (see ray_cluster.yaml): where a cluster
#: offers them, workers ask for one unit so they land on their own node types.
PREFILL_RESOURCE = "prefill"
DECODE_RESOURCE = "decode"


def placement_options(role: Role) -> dict[str, Any]:
    """Actor options that place a worker of `role` on its node type, if the cluster has one."""
    resource = PREFILL_RESOURCE if role is Role.PREFILL else DECODE_RESOURCE
    available: dict[str, float] = ray.cluster_resources() if ray.is_initialized() else {}  # type: ignore[no-untyped-call]
    if available.get(resource, 0) >= 1:
        return {"resources": {resource: 1}}
    return {}


PrefillActor = ray.remote(PrefillWorker)
DecodeActor = ray.remote(DecodeWorker)
