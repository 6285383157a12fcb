"""One vLLM GPU worker's kvray side, played without vLLM (its GPU wheel cannot run on the GPU
machine here): a Ray actor holding `ConnectorWorker` over a real CUDA KV cache laid out as vLLM
lays it out (`tests.vllm_layouts`), called in the order vLLM's GPU worker calls the connector:

    allocation  one `torch.zeros(int8, cuda)` inside `get_mem_pool_context()`, then the
                per-layer views
    register    `register_kv_caches`
    each step   `bind_connector_metadata` (the hand-offs: `hold`, `load`, `begin_layerwise`),
                the forward on its own stream with `save_kv_layer` after each layer's KV is
                written (`forward`), `wait_for_save`, then `get_finished` (`finished`)

Digests are computed on the GPU, per block, in vLLM's own view of each layer. The GPU tests ship
this module by value."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch

from kvray.agent.handoff import PUSH_ENDPOINT, HandoffStep, LayerwiseSpec, LoadSpec, SendSpec
from kvray.config import Settings
from kvray.integrations.vllm.tickets import HandoffKey
from kvray.integrations.vllm.worker import ConnectorWorker
from kvray.wire import Role
from tests.vllm_layouts import CacheShape, block_of, layout_views, legacy_views

#: The hand-off key every engine of these tests shares.
SHARED_KEY = bytes(range(32))
#: What fills the decode allocation's bytes outside the KV cache (int8).
CANARY = -91
PAGE = 4096


def load_specs(prefill: dict[str, Any], loads: list[tuple[str, str, list[int]]]) -> dict[str, LoadSpec]:
    """The scheduler's `LoadSpec`s of (request, hand-off key, blocks) from `prefill` (what its
    `register` returned), as a step's metadata carries them."""
    return {
        request_id: LoadSpec(
            request_id,
            prefill["engine"],
            prefill["incarnation"],
            key,
            prefill["node"],
            prefill["inbox"],
            (tuple(blocks),),
            0,
        )
        for request_id, key, blocks in loads
    }


class VllmGpuWorker:
    def __init__(
        self,
        engine_id: str,
        layout: str,
        shape: CacheShape,
        settings: Settings,
        *,
        producer: bool = False,
        legacy: str = "",
        order: str = "NHD",
        device: str = "cuda",
    ) -> None:
        self.shape = shape
        #: "cuda", or "cpu" for the same hand-off over a CPU cache (the decode engine's in a
        #: shared-memory file, the `shm` transport): no forward, no CUDA stream.
        self.device = device
        # The deployment's key, as the connector always has one (push requests carry proofs,
        # routine loads go through the prefill engine's native lane where the cache allows).
        self.worker = ConnectorWorker(
            engine_id, Role.PREFILL if producer else Role.DECODE, settings, 30.0, proof=HandoffKey(SHARED_KEY)
        )
        with self.worker.allocation_context():  # vLLM's `get_mem_pool_context()`
            if device == "cuda":
                buffer = torch.zeros(shape.nbytes, dtype=torch.int8, device=device)
            else:  # page-aligned inside the allocation, as a registered CPU region must be
                padded = torch.zeros(shape.nbytes + 2 * PAGE, dtype=torch.int8)
                start = -padded.data_ptr() % PAGE
                buffer = padded[start : start + shape.nbytes]
        self.buffer = buffer
        self.kv_axis_first = legacy == "flash_attn"
        if legacy:
            self.caches = legacy_views(buffer, shape, legacy, order)
        else:
            self.caches = layout_views(buffer, shape, layout)
        #: vLLM's compute stream.
        self.stream = torch.cuda.Stream() if device == "cuda" else None  # type: ignore[no-untyped-call]
        self._weights: torch.Tensor | None = None
        self._gate: asyncio.Event | None = None
        self._holding = 0

    # ---- allocation and registration -----------------------------------------------------

    def fill(self, seed: int) -> None:
        """Every byte of the cache from a seeded generator; the rest of the decode engine's own
        CUDA allocation with canaries."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.buffer.copy_(
            torch.randint(
                -128, 128, self.buffer.shape, generator=generator, device=self.device, dtype=torch.int8
            )
        )
        if self.worker._cuda_buffer is not None:
            pool = self.worker._cuda_buffer.view(torch.int8)
            start = self.buffer.data_ptr() - pool.data_ptr()
            pool[:start].fill_(CANARY)
            pool[start + self.buffer.numel() :].fill_(CANARY)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def canaries_hold(self) -> bool:
        if self.worker._cuda_buffer is None:
            return True
        pool = self.worker._cuda_buffer.view(torch.int8)
        start = self.buffer.data_ptr() - pool.data_ptr()
        outside = torch.cat([pool[:start], pool[start + self.buffer.numel() :]])
        return bool((outside == CANARY).all())

    def register(self) -> dict[str, Any]:
        info = self.worker.register(
            self.caches, self.shape.num_blocks, self.shape.block_size, [self.shape.names()]
        )
        return {
            "engine": info.engine_id,
            "incarnation": info.incarnation,
            "node": info.node_id,
            "inbox": info.endpoints[PUSH_ENDPOINT],
            "transport": info.regions[0].transport.value,
            "parts": info.layout.layers[0].geometry.parts,
        }

    # ---- a step --------------------------------------------------------------------------

    def hold(self, request_id: str, key: str, blocks: list[int]) -> None:
        """The prefill request finished: its blocks are held for a decode engine."""
        self.worker.begin(HandoffStep(sends={request_id: SendSpec(request_id, (tuple(blocks),), key=key)}))

    def load(self, request_id: str, prefill: dict[str, Any], key: str, blocks: list[int]) -> None:
        self.worker.begin(HandoffStep(loads=load_specs(prefill, [(request_id, key, blocks)])))

    def begin_layerwise(self, request_id: str, key: str, blocks: list[int]) -> None:
        self.worker.begin_layerwise({request_id: LayerwiseSpec(request_id, key, (tuple(blocks),))})

    def forward(self, blocks: list[int], seed: int, sleep_cycles: int = 2_000_000) -> None:
        """The forward pass on vLLM's stream: per layer, a slow kernel, then the layer's KV of
        `blocks` written, then `save_kv_layer` (which must order the layer's copy after those
        writes without waiting for them). Returns before the GPU has run any of it."""
        generator = torch.Generator(device="cuda").manual_seed(seed)
        with torch.cuda.stream(self.stream):
            for name in self.shape.names():
                torch.cuda._sleep(sleep_cycles)
                cache = self.caches[name]
                for block in blocks:
                    target = cache[:, block] if self.kv_axis_first else cache[block]
                    fresh = torch.randn(target.shape, generator=generator, device="cuda")
                    target.copy_(fresh.to(target.dtype))
                self.worker.save_layer(name)

    def sync(self) -> None:
        self.stream.synchronize()

    def finished(self, request_id: str, seconds: float, *, sending: bool = False) -> dict[str, Any]:
        """Poll `get_finished` until `request_id` is reported (received, or with `sending`
        sent); what was reported for it."""
        deadline = time.monotonic() + seconds
        failed: set[str] = set()
        errors: set[int] = set()
        while time.monotonic() < deadline:
            sent, received, blocks, failures = self.worker.finished()
            failed |= failures
            errors |= blocks
            if request_id in (sent if sending else received):
                return {"reported": True, "failed": request_id in failed, "load_errors": sorted(errors)}
            time.sleep(0.002)
        return {"reported": False, "failed": request_id in failed, "load_errors": sorted(errors)}

    # ---- checks --------------------------------------------------------------------------

    def digests(self, blocks: list[int]) -> dict[str, list[int]]:
        """Per layer, each block's digest (a weighted sum of its bytes, on the GPU)."""
        out: dict[str, list[int]] = {}
        for name in self.shape.names():
            rows = [
                block_of(self.caches[name], block, kv_axis_first=self.kv_axis_first)
                .view(-1)
                .view(torch.uint8)
                for block in blocks
            ]
            stacked = torch.stack(rows).to(torch.int64)
            if self._weights is None or self._weights.numel() != stacked.shape[1]:
                positions = torch.arange(stacked.shape[1], device=self.device, dtype=torch.int64)
                self._weights = (positions * 2654435761) % 2147483647 + 1
            out[name] = (stacked * self._weights).sum(dim=1).tolist()
        return out

    # ---- faults --------------------------------------------------------------------------

    def hold_writes(self) -> None:
        """From now on every cuda_ipc write waits at a gate once its copies are queued (as
        `gpu_workers.HoldingGpuPrefill`, on the connector's loop)."""
        from kvray.transport.cuda_ipc import transport

        gate = self._gate = asyncio.Event()
        original = transport.wait_for_events

        async def held(events: Any, nbytes: int) -> None:
            self._holding += 1
            await gate.wait()
            await original(events, nbytes)

        transport.wait_for_events = held  # type: ignore[assignment]

    def held(self) -> int:
        return self._holding

    def release_writes(self) -> None:
        loop = self.worker._loop
        if self._gate is not None and loop is not None:
            loop.loop.call_soon_threadsafe(self._gate.set)

    def lane_answers(self) -> dict[str, int]:
        """How the prefill engines' lanes answered this decode engine's asks, and the loads
        taken whole through them (`moved`)."""
        lane = self.worker._lane
        if lane is None:
            return {}
        return {**{answer.name: count for answer, count in lane.answers.items()}, "moved": lane.moved}

    def executor_fault(self, on: bool) -> None:
        """Every copy of this process stores its last block pair over the one before
        (`kvray.faults.executor_offset_bug`), from now on or no more."""
        from kvray._copy_pool import set_executor_fault

        set_executor_fault(on)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.worker.shutdown()
