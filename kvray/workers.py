"""Ready prefill and decode workers: async Ray actors around a `KVAgent` and a block pool.

The decode worker reserves blocks for a request (and expects its KV), the prefill worker
pushes its blocks into them and frees its own after the push, success or failure; the
decode worker frees a request's blocks when its wait fails or passes its deadline, or when
the caller releases it after decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
import torch

from kvray.agent import Completion, KVAgent, PushResult
from kvray.config import Settings
from kvray.errors import (
    BackpressureError,
    BlockIdError,
    ConfigError,
    LayoutError,
    PlanError,
    TransferTimeoutError,
)
from kvray.host import AgentHost
from kvray.layout import KVLayout
from kvray.memory import MemoryKind
from kvray.metrics import EngineMetrics
from kvray.models.reference import ModelConfig, ReferenceModel
from kvray.plan import OffsetCache
from kvray.wire import Reservation, Role, TransportKind

ByteArray = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker reports for one request."""

    #: The prefill engine that ran it.
    engine_id: str
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
        #: Requests whose blocks are kept out of the pool: something may still write them.
        self.quarantined: dict[str, list[int]] = {}

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
            "quarantined_requests": len(self.quarantined),
        }

    async def free_count(self) -> int:
        return self.pool.free_count

    # ---- inspection: what the model would read and write ------------------------------

    async def write_blocks(self, blocks: Sequence[int], data: dict[str, ByteArray]) -> None:
        """Write raw bytes into the given blocks of each named layer (as a forward pass would),
        wherever the backing lives (host bytes are copied to its device)."""
        for layer, values in data.items():
            view = self.kvray_agent.backing.view(layer)
            parts = self.kvray_agent.layout.layer(layer).geometry.parts
            target = _blocks_of(view, blocks, parts)
            source = torch.from_numpy(np.ascontiguousarray(values)).view(view.dtype).reshape(target.shape)
            _assign_blocks(view, blocks, parts, source.to(view.device))
        _settle(self.kvray_agent.backing.kind)

    async def read_blocks(
        self, blocks: Sequence[int], layers: Sequence[str] | None = None
    ) -> dict[str, ByteArray]:
        """The bytes of the given blocks of each layer, as uint8 arrays."""
        out: dict[str, ByteArray] = {}
        for layer in layers or self.kvray_agent.layout.layer_names:
            view = self.kvray_agent.backing.view(layer)
            picked = _blocks_of(view, blocks, self.kvray_agent.layout.layer(layer).geometry.parts)
            out[layer] = picked.contiguous().view(torch.uint8).cpu().numpy().copy()
        return out

    async def fill_region(self, seed: int) -> None:
        """Fill every byte of every allocation (region and slack) with a seeded pattern."""
        for region in self.kvray_agent.backing.regions:
            assert region.allocation is not None
            generator = torch.Generator().manual_seed(seed + region.index)
            region.allocation.copy_(
                torch.randint(0, 256, region.allocation.shape, dtype=torch.uint8, generator=generator)
            )
        _settle(self.kvray_agent.backing.kind)

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
        views = self.kvray_agent.backing.views
        compute = asyncio.ensure_future(
            asyncio.to_thread(model.generate, list(tokens), views, blocks, max_new_tokens)
        )
        try:
            return await asyncio.shield(compute)
        finally:
            # The thread writes into these blocks until it ends, cancelled caller or not.
            await _outlast(compute)
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
            (region.span.offset_in_allocation, region.allocation.cpu().numpy().copy())
            for region in self.kvray_agent.backing.regions
            if region.allocation is not None
        ]


async def _outlast(future: asyncio.Future[Any]) -> None:
    """Return once `future` is done, whatever it raised and however often the caller is
    cancelled meanwhile (the caller's own cancellation goes on from where it was raised): the
    thread or pushes behind it may still touch a request's blocks."""
    while not future.done():
        with contextlib.suppress(BaseException):
            await asyncio.shield(future)


def _settle(kind: MemoryKind) -> None:
    """Wait for this thread's device work on a CUDA backing: bytes written through the views
    must be in memory before a peer process (which sees none of this process's streams) copies
    them, and before the call that wrote them returns."""
    if kind is MemoryKind.CUDA:
        torch.cuda.current_stream().synchronize()


def _blocks_of(view: torch.Tensor, blocks: Sequence[int], parts: int) -> torch.Tensor:
    index = torch.as_tensor(list(blocks), dtype=torch.long, device=view.device)
    return view[:, index] if parts == 2 else view[index]


def _assign_blocks(view: torch.Tensor, blocks: Sequence[int], parts: int, values: torch.Tensor) -> None:
    index = torch.as_tensor(list(blocks), dtype=torch.long, device=view.device)
    if parts == 2:
        view[:, index] = values
    else:
        view[index] = values


class _RequestEnded(Exception):
    """Raised inside the model's compute thread to stop a forward pass whose request ended."""


class PrefillWorker(_Worker):
    """Holds a request's KV after prefill and pushes it into a decode worker's blocks.

    A request's blocks go back to the pool only once nothing can touch them any more: its
    forward pass has stopped, and every push of it has returned (a cancelled push returns only
    once its last byte has stopped moving). One push at a time per request."""

    role = Role.PREFILL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Requests with a push or forward pass running: refused a second one meanwhile.
        self._busy: set[str] = set()

    async def allocate(self, request_id: str, count: int) -> list[int]:
        if request_id in self.requests:
            raise PlanError(f"request {request_id!r} already holds blocks", request_id=request_id)
        blocks = self.pool.allocate(count)
        self.requests[request_id] = blocks
        return blocks

    async def fill_random(self, request_id: str, seed: int) -> None:
        """Write seeded random bytes into the request's blocks of every layer."""
        blocks = self._held(request_id)
        rng = np.random.default_rng(seed)
        data = {}
        for layer in self.kvray_agent.layout.layer_names:
            view = self.kvray_agent.backing.view(layer)
            nbytes = _blocks_of(view, blocks, self.kvray_agent.layout.layer(layer).geometry.parts).numel()
            nbytes *= view.element_size()
            data[layer] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        await self.write_blocks(blocks, data)

    def _held(self, request_id: str) -> list[int]:
        blocks = self.requests.get(request_id)
        if blocks is None:
            raise PlanError(
                f"request {request_id!r} holds no blocks here (never allocated, or already pushed "
                "or released)",
                request_id=request_id,
            )
        return blocks

    def _take(self, request_id: str) -> list[int]:
        """The request's blocks, marked busy: a second push or release waits its turn."""
        blocks = self._held(request_id)
        if request_id in self._busy:
            raise PlanError(f"request {request_id!r} is already being pushed", request_id=request_id)
        self._busy.add(request_id)
        return blocks

    def _give_back(self, request_id: str, free: bool) -> None:
        self._busy.discard(request_id)
        if free:
            self.pool.free(self.requests.pop(request_id))

    async def push(
        self,
        reservation: Reservation,
        *,
        layerwise: bool = False,
        layers: Sequence[str] | None = None,
        timeout: float | None = None,
        keep_blocks: bool = False,
    ) -> PushResult:
        """Push the request's blocks into the decode worker's reservation; the request's own
        blocks are freed afterwards either way (unless `keep_blocks`)."""
        request_id = reservation.request_id
        if layers is not None and not list(layers):
            raise PlanError("push at least one layer (layers=None pushes every layer)", request_id=request_id)
        settings = self.kvray_agent.settings
        timeout = settings.deadline(timeout, settings.transfer_timeout_s, "timeout")
        blocks = self._take(request_id)
        agent = self.kvray_agent
        try:
            if not layerwise:
                return await agent.push(reservation, blocks, layers, timeout=timeout)
            try:
                for layer in layers or agent.layout.layer_names:
                    await agent.push_layer(reservation, layer, blocks, timeout=timeout)
                return await agent.finish(request_id, timeout=timeout)
            except BaseException as error:
                await agent.abort(reservation, f"{type(error).__name__}: {error}")
                raise
        finally:
            self._give_back(request_id, not keep_blocks)

    async def release(self, request_id: str) -> None:
        self._take(request_id)
        self._give_back(request_id, True)

    async def prefill(
        self,
        tokens: Sequence[int],
        reservation: Reservation,
        *,
        layerwise: bool = False,
        timeout: float | None = None,
    ) -> PrefillResult:
        """Run the model over the prompt and push its KV into the decode worker's reservation.

        Layer-wise, each layer's push starts as soon as the forward pass has written that
        layer, while later layers are still being computed; otherwise the whole request is
        pushed after the pass. The request's blocks here are freed afterwards either way, once
        the forward pass and every push have stopped; a layer that completes after the request
        ended starts no push.
        """
        settings = self.kvray_agent.settings
        timeout = settings.deadline(timeout, settings.transfer_timeout_s, "timeout")
        model = self._model()
        agent = self.kvray_agent
        request_id = reservation.request_id
        needed = model.blocks_needed(len(tokens))
        if len(reservation.blocks) != needed:
            raise BlockIdError(
                f"a {len(tokens)}-token prompt fills {needed} blocks, but the reservation of "
                f"{request_id!r} names {len(reservation.blocks)} decode blocks",
                request_id=request_id,
            )
        blocks = await self.allocate(request_id, needed)
        self._busy.add(request_id)
        loop = asyncio.get_running_loop()
        pushes: list[asyncio.Task[int]] = []
        ended = threading.Event()

        def start_push(layer: str) -> None:
            if ended.is_set():
                return
            pushes.append(loop.create_task(agent.push_layer(reservation, layer, blocks, timeout=timeout)))

        def on_layer(layer: str) -> None:  # runs on the compute thread, once per cache layer
            if ended.is_set():
                raise _RequestEnded(request_id)
            loop.call_soon_threadsafe(start_push, layer)

        compute: asyncio.Future[int] | None = None
        try:
            started = time.perf_counter()
            try:
                callback = on_layer if layerwise else None
                compute = asyncio.ensure_future(
                    asyncio.to_thread(model.prefill, list(tokens), agent.backing.views, blocks, callback)
                )
                # Shielded: a cancelled caller must not let the blocks go while the thread writes.
                first_token = await asyncio.shield(compute)
                computed = time.perf_counter()
                if layerwise:
                    await asyncio.gather(*pushes)
                    pushed = await agent.finish(request_id, timeout=timeout)
                else:
                    pushed = await agent.push(reservation, blocks, timeout=timeout)
            except BaseException as error:
                ended.set()
                await self._stop(compute, pushes)
                if layerwise:
                    await agent.abort(reservation, f"{type(error).__name__}: {error}")
                raise
            finished = time.perf_counter()
            digest = await self.kv_digest(blocks)
            return PrefillResult(
                engine_id=agent.engine_id,
                first_token=first_token,
                compute_s=computed - started,
                exposed_transfer_s=finished - computed,
                transfer_s=pushed.seconds,
                nbytes=pushed.nbytes,
                transport=pushed.transport,
                kv_digest=digest,
            )
        finally:
            ended.set()
            await self._stop(compute, pushes)
            self._give_back(request_id, True)

    @staticmethod
    async def _stop(compute: asyncio.Future[int] | None, pushes: list[asyncio.Task[int]]) -> None:
        """Until the forward pass and every layer push of a request have stopped (a cancelled
        push returns once its last byte has stopped moving); cancellation waits for it too."""
        waiting: list[asyncio.Future[Any]] = [push for push in pushes if not push.done()]
        for push in waiting:
            push.cancel()
        if compute is not None and not compute.done():
            waiting.append(compute)
        if waiting:
            await _outlast(asyncio.gather(*waiting, return_exceptions=True))


class DecodeWorker(_Worker):
    """Reserves blocks for requests and waits for their KV to arrive.

    A request's blocks go back to the pool only once no write for it can land (its agent's
    `release` returned) and the model no longer reads or writes them (its decode thread ended);
    blocks a writer still holds past the deadline stay out of the pool (`quarantined`) until it
    lets go."""

    role = Role.DECODE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Requests being released, with the task that frees their blocks.
        self._releasing: dict[str, asyncio.Future[None]] = {}

    async def reserve(
        self,
        request_id: str,
        count: int,
        kv_blocks: int | None = None,
        layers: Sequence[str] | None = None,
    ) -> Reservation:
        """Blocks for the request; the first `kv_blocks` of them (default all) expect its KV, of
        `layers` (default: every layer). The `Reservation` is what the prefill side pushes into."""
        if request_id in self.requests:
            raise PlanError(f"request {request_id!r} already holds blocks", request_id=request_id)
        if kv_blocks is not None and not 0 < kv_blocks <= count:
            raise BlockIdError(f"kv_blocks must be within 1..{count}, got {kv_blocks}", request_id=request_id)
        blocks = self.pool.allocate(count)
        try:
            reservation = self.kvray_agent.expect(request_id, blocks[: kv_blocks or count], layers)
        except BaseException:
            self.pool.free(blocks)
            raise
        self.requests[request_id] = blocks
        return reservation

    async def wait(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait for the request's KV; on failure or deadline its blocks go back to the pool
        (once no write for it can land)."""
        settings = self.kvray_agent.settings
        timeout = settings.deadline(timeout, settings.transfer_timeout_s, "timeout")
        if request_id not in self.requests:
            raise PlanError(f"request {request_id!r} holds no blocks here", request_id=request_id)
        try:
            return await self.kvray_agent.wait_for_kv(request_id, timeout)
        except BaseException:
            await self._shielded_release(request_id)
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
        compute: asyncio.Future[list[int]] | None = None
        try:
            digest = await self.kv_digest(blocks[: model.blocks_needed(prompt_len)])
            views = self.kvray_agent.backing.views
            compute = asyncio.ensure_future(
                asyncio.to_thread(model.decode, first_token, prompt_len, views, blocks, max_new_tokens)
            )
            tokens = await asyncio.shield(compute)
        finally:
            # The thread writes the new tokens' KV into these blocks: they wait for it.
            if compute is not None:
                await _outlast(compute)
            await self._shielded_release(request_id)
        return DecodeResult(
            tokens=tokens,
            wait_s=arrived - started,
            decode_s=time.perf_counter() - arrived,
            kv_digest=digest,
        )

    async def release(self, request_id: str) -> None:
        """The request is over: stop expecting its KV and free its blocks once no write for it
        can land. Raises `TransferTimeoutError` if a writer still holds it past the deadline
        (its blocks then stay out of the pool until the writer lets go)."""
        if request_id not in self.requests:
            raise PlanError(f"request {request_id!r} holds no blocks here", request_id=request_id)
        await self._shielded_release(request_id)

    async def _shielded_release(self, request_id: str) -> None:
        """`_release` once per request, run to its end even if the caller is cancelled."""
        releasing = self._releasing.get(request_id)
        if releasing is None:
            if request_id not in self.requests:
                return
            releasing = self._releasing[request_id] = asyncio.ensure_future(self._release(request_id))
        while not releasing.done():
            try:
                await asyncio.shield(releasing)
            except asyncio.CancelledError:
                if releasing.done():
                    raise
                continue
        releasing.result()

    async def _free_when(self, let_go: asyncio.Event, request_id: str) -> None:
        await let_go.wait()
        self.pool.free(self.quarantined.pop(request_id))

    async def _release(self, request_id: str) -> None:
        agent = self.kvray_agent
        try:
            await agent.release(request_id)
        except TransferTimeoutError:
            # A writer still holds the request: its blocks stay out of the pool until it lets go.
            self.quarantined[request_id] = self.requests.pop(request_id)
            let_go = agent.quarantined.get(request_id)
            if let_go is not None:
                asyncio.get_running_loop().create_task(self._free_when(let_go, request_id))
            raise
        finally:
            self._releasing.pop(request_id, None)
        self.pool.free(self.requests.pop(request_id))


#: Custom Ray resources of prefill and decode nodes (see ray_cluster.yaml): where a cluster
#: offers them, workers ask for one unit so they land on their own node types.
PREFILL_RESOURCE = "prefill"
DECODE_RESOURCE = "decode"


def placement_options(role: Role, num_gpus: float = 0.0) -> dict[str, Any]:
    """Actor options that place a worker of `role` on its node type, if the cluster has one,
    and give it `num_gpus` of a GPU (a fraction lets several workers share one: cuda_ipc then
    moves KV within that GPU)."""
    resource = PREFILL_RESOURCE if role is Role.PREFILL else DECODE_RESOURCE
    available: dict[str, float] = ray.cluster_resources() if ray.is_initialized() else {}  # type: ignore[no-untyped-call]
    options: dict[str, Any] = {}
    if available.get(resource, 0) >= 1:
        options["resources"] = {resource: 1}
    if num_gpus > 0:
        if available and available.get("GPU", 0) < num_gpus:
            raise ConfigError(
                f"a {role.value} worker asks for {num_gpus} GPU, but the Ray cluster has "
                f"{available.get('GPU', 0)}; start Ray on a machine with a GPU (ray start "
                "--num-gpus N) or run the workers on the CPU",
                num_gpus=num_gpus,
            )
        options["num_gpus"] = num_gpus
    return options


PrefillActor = ray.remote(PrefillWorker)
DecodeActor = ray.remote(DecodeWorker)
