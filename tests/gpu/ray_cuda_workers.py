"""Workers for tests/gpu/test_ray_cuda.py, shipped by value into Ray actors: a prefill worker that
fills a request's blocks with a seeded pattern, and a decode worker that checks on its own device
(the GPU, for a CUDA backing) that blocks hold that pattern and that no other byte of its
allocation left the canary pattern it was filled with; it can also hold arriving `ray`-transport
deliveries at a gate before they reach its agent. Patterns are generated on the CPU from a seed,
so a worker on either kind of memory regenerates the same bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvray.workers import DecodeWorker, PrefillWorker


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def _index(view: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(list(blocks), dtype=torch.long, device=view.device)


def _picked(view: torch.Tensor, blocks: Sequence[int], parts: int) -> torch.Tensor:
    index = _index(view, blocks)
    return view[:, index] if parts == 2 else view[index]


def _settle(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class PatternPrefill(PrefillWorker):
    async def fill_pattern(self, request_id: str, seed: int) -> None:
        """Write layer i of the request's blocks with pattern(seed + i)."""
        agent = self.kvray_agent
        blocks = self._held(request_id)
        for i, layer in enumerate(agent.layout.layer_names):
            view = agent.backing.view(layer)
            parts = agent.layout.layer(layer).geometry.parts
            shape = _picked(view, blocks, parts).shape
            nbytes = int(np.prod(shape)) * view.element_size()
            values = pattern(nbytes, seed + i).to(view.device).view(view.dtype).reshape(shape)
            index = _index(view, blocks)
            if parts == 2:
                view[:, index] = values
            else:
                view[index] = values
            _settle(view)


class CheckedDecode(DecodeWorker):
    _canary_seed = 0
    _gate: asyncio.Event | None = None
    _arrived = 0
    _ended = 0

    async def fill_canaries(self, seed: int) -> None:
        """Every byte of every allocation (region and slack) from pattern(seed + region index)."""
        self._canary_seed = seed
        for region in self.kvray_agent.backing.regions:
            assert region.allocation is not None
            region.allocation.copy_(pattern(region.allocation.numel(), seed + region.index).to(region.device))
            _settle(region.allocation)

    async def blocks_differ(self, blocks: Sequence[int], seed: int) -> list[str]:
        """The layers whose `blocks` do not hold what `PatternPrefill.fill_pattern(seed)` wrote,
        compared on this worker's device."""
        agent = self.kvray_agent
        differ = []
        for i, layer in enumerate(agent.layout.layer_names):
            view = agent.backing.view(layer)
            picked = _picked(view, blocks, agent.layout.layer(layer).geometry.parts).contiguous()
            landed = picked.view(torch.uint8).reshape(-1)
            if not torch.equal(landed, pattern(landed.numel(), seed + i).to(landed.device)):
                differ.append(layer)
        return differ

    async def changed_outside(self, written: Sequence[tuple[Sequence[int], Sequence[str] | None]]) -> int:
        """Bytes of the allocations that left the canary pattern outside the (blocks, layers) the
        given requests wrote (None: every layer), counted on this worker's device."""
        agent = self.kvray_agent
        changed = 0
        for region in agent.backing.regions:
            allocation = region.allocation
            assert allocation is not None
            allowed = torch.zeros(allocation.numel(), dtype=torch.bool, device=allocation.device)
            start_of_region = region.span.offset_in_allocation
            for blocks, layers in written:
                for layer in layers or agent.layout.layer_names:
                    placement = agent.backing.placements[layer]
                    if placement.region != region.index:
                        continue
                    for block in blocks:
                        for part in range(placement.parts):
                            start = start_of_region + placement.byte_offset(part, block)
                            allowed[start : start + placement.part_nbytes] = True
            canary = pattern(allocation.numel(), self._canary_seed + region.index).to(allocation.device)
            changed += int(((allocation != canary) & ~allowed).sum().item())
        return changed

    # ---- deliveries held at a gate --------------------------------------------------------------

    async def hold_deliveries(self) -> None:
        self._gate = asyncio.Event()

    async def release_deliveries(self) -> None:
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    async def deliveries(self) -> tuple[int, int]:
        """(arrived, ended) `ray`-transport deliveries."""
        return self._arrived, self._ended

    async def kvray_deliver(self, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        self._arrived += 1
        try:
            gate = self._gate
            if gate is not None:
                await gate.wait()
            return await self.kvray_agent.deliver(header, payload)
        finally:
            self._ended += 1
