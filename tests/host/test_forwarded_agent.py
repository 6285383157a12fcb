"""Forwarded agents (`kvray.host.forwarded`) around an engine that is not the reference model: a
prefill and a decode `ForwardedAgent` over a layout of their own (two layers of one geometry and
a split K/V layer), run in this process as two Serve replicas or vLLM workers would run them. The prefill
engine's own compute writes the prompt's blocks, its agent pushes them, and the decode engine's
blocks then hold exactly those bytes while every other byte of its allocation (canaries) is
unchanged; over `ray` the write reaches the decode agent through its host actor. A push request
sent to the prefill engine's host reaches the handler its process gave, and its directory
answers which peers departed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import ray
import torch

from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import UnknownEngineError
from kvray.host.forwarded import ForwardedAgent, ForwardedDirectory
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.wire import Role, TransportKind

SETTINGS = Settings(
    heartbeat_s=300.0,
    lookup_timeout_s=5.0,
    transfer_timeout_s=15.0,
    notify_timeout_s=5.0,
    coordinator_name="kvray-coordinator-forwarded-agent-tests",
)
LATENT = Geometry(block_size=4, entry_shape=(24,), dtype="bfloat16")
SPLIT_KV = Geometry(block_size=4, entry_shape=(2, 8), dtype="float16", parts=2)
#: Two layers of one geometry: a push that wrote both to one place would show here.
LAYOUT = KVLayout(
    layers=(
        LayerSpec(name="dense0", geometry=LATENT),
        LayerSpec(name="dense1", geometry=LATENT),
        LayerSpec(name="attn.kv", geometry=SPLIT_KV),
    ),
    num_blocks=12,
)


@pytest.fixture(scope="module")
def coordinator(local_ray: None) -> Any:
    """The coordinator, started and answering before an engine registers: on a loaded machine
    its start alone can outlast a registration's deadline."""
    actor = get_or_create_coordinator(SETTINGS)
    ray.get(actor.departed.remote([]), timeout=120)
    return actor


class CountingEngine:
    """An engine of its own on kvray's views: its 'forward pass' writes, into every byte of each
    prompt token's slot, the token id plus the layer's and the part's index."""

    def __init__(self, kv: ForwardedAgent) -> None:
        self.kv = kv
        self.layout = kv.agent.layout

    def _slots(self, layer: str) -> torch.Tensor:
        """The layer's bytes, [parts, blocks, tokens per block, *entry as bytes] (a view)."""
        view = self.kv.agent.backing.view(layer)
        if self.layout.layer(layer).geometry.parts == 1:
            view = view.unsqueeze(0)
        return view.view(torch.uint8)

    def forward(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        block_size = LATENT.block_size
        for layer_index, layer in enumerate(self.layout.layer_names):
            slots = self._slots(layer)
            for part in range(slots.shape[0]):
                for position, token in enumerate(tokens):
                    block, slot = blocks[position // block_size], position % block_size
                    slots[part, block, slot] = (token + 7 * layer_index + 101 * part) % 256

    def read(self, blocks: Sequence[int]) -> dict[str, np.ndarray]:
        index = torch.as_tensor(list(blocks), dtype=torch.long)
        return {layer: self._slots(layer)[:, index].numpy().copy() for layer in self.layout.layer_names}

    def fill_allocations(self, seed: int) -> None:
        """Seeded bytes over every allocation, region and slack."""
        for region in self.kv.agent.backing.regions:
            assert region.allocation is not None
            generator = torch.Generator().manual_seed(seed + region.index)
            region.allocation.copy_(
                torch.randint(0, 256, region.allocation.shape, dtype=torch.uint8, generator=generator)
            )

    def snapshot(self) -> list[tuple[int, np.ndarray]]:
        """(region offset inside its allocation, copy of the whole allocation) per region."""
        return [
            (region.span.offset_in_allocation, region.allocation.numpy().copy())
            for region in self.kv.agent.backing.regions
            if region.allocation is not None
        ]


@pytest.mark.parametrize(("transport", "layerwise"), [("shm", False), ("ray", True)])
async def test_own_engine_pushes_kv_between_replica_engines(
    coordinator: Any, canary_mask: Any, transport: str, layerwise: bool
) -> None:
    settings = msgspec.structs.replace(SETTINGS, transport=transport)
    decode = await ForwardedAgent.start(f"own-decode-{transport}", Role.DECODE, LAYOUT, settings=settings)
    prefill = await ForwardedAgent.start(f"own-prefill-{transport}", Role.PREFILL, LAYOUT, settings=settings)
    try:
        await decode.check_health()
        await prefill.check_health()
        writer, reader = CountingEngine(prefill), CountingEngine(decode)
        tokens = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38]  # 3 blocks, the last one partly filled
        source, target = [7, 0, 4], [9, 2, 6]
        writer.forward(tokens, source)
        expected = writer.read(source)
        reader.fill_allocations(seed=11)
        before = reader.snapshot()

        reservation = decode.agent.expect("req-1", target)
        if layerwise:
            for layer in LAYOUT.layer_names:
                await prefill.agent.push_layer(reservation, layer, source, timeout=10.0)
            pushed = await prefill.agent.finish("req-1", timeout=10.0)
        else:
            pushed = await prefill.agent.push(reservation, source, timeout=10.0)
        assert pushed.transport is TransportKind(transport)
        await decode.agent.wait_for_kv("req-1", timeout=10.0)

        landed = reader.read(target)
        for layer in LAYOUT.layer_names:
            assert np.array_equal(landed[layer], expected[layer]), layer
        assert not np.array_equal(landed["dense0"], landed["dense1"])
        for (offset, old), (_, new) in zip(before, reader.snapshot(), strict=True):
            mask = canary_mask(decode.agent.info, offset, old.size, [(target, None)])
            assert np.array_equal(old[~mask], new[~mask])  # canaries: nothing else changed
            assert not np.array_equal(old[mask], new[mask])
        await decode.agent.release("req-1")
        gone = (decode.engine_id, decode.agent.incarnation)
    finally:
        await prefill.close()
        await decode.close()
    with pytest.raises(UnknownEngineError):
        await coordinator.lookup.remote(decode.engine_id, 0.1)
    # What a replica's agent asks on its heartbeat, to forget the peers that left.
    assert await ForwardedDirectory(SETTINGS, None).departed([gone]) == [gone]
