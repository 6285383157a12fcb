"""Engines whose per-layer tensors are views of one pool, packed back to back (the way engines
allocate their KV cache): adopted as one region per storage, a peer accepts them, and every
transport writes out of and into them exactly, canaries around the pool untouched."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from kvray.layout import BlockOrder, KVLayout, align_up, mixed
from kvray.memory import TORCH_DTYPES, Backing, MemoryKind
from kvray.validation import validate_engine_info

if TYPE_CHECKING:
    from conftest import TransportUnderTest

#: Where the pool starts past a page boundary of its storage: not aligned, as engines' pools are not.
POOL_MISALIGNMENT = 64


def pooled_backing(layout: KVLayout, alignment: int = 4096) -> Backing:
    """Every layer a view of one storage, packed back to back (each start rounded to 16 bytes,
    so every dtype can view it), the pool itself `POOL_MISALIGNMENT` bytes past a page."""
    nbytes = sum(align_up(layout.layer_nbytes(name), 16) for name in layout.layer_names)
    storage = torch.empty(nbytes + 3 * alignment, dtype=torch.uint8)
    offset = (-storage.data_ptr()) % alignment + alignment + POOL_MISALIGNMENT
    tensors = {}
    for spec in layout.layers:
        size = layout.layer_nbytes(spec.name)
        flat = storage[offset : offset + size].view(TORCH_DTYPES[spec.geometry.dtype])
        tensors[spec.name] = flat.view(layout.tensor_shape(spec.name))
        offset += align_up(size, 16)
    return Backing.adopt(layout, tensors, alignment=alignment)


@pytest.mark.parametrize("pooled", ["source", "destination", "both"])
async def test_a_pooled_engine_is_accepted_and_written_exactly(tut: TransportUnderTest, pooled: str) -> None:
    layout = mixed(num_blocks=32, block_order=BlockOrder.LAYER_MAJOR)
    pooled_destination = pooled in ("destination", "both")
    if pooled_destination and MemoryKind.CPU not in tut.transport.destination_kinds:
        pytest.skip(
            f"{tut.kind.value} writes only into {sorted(k.value for k in tut.transport.destination_kinds)}"
        )
    source_backing = pooled_backing(layout) if pooled in ("source", "both") else None
    destination_backing = pooled_backing(layout) if pooled_destination else None
    for backing in (source_backing, destination_backing):
        if backing is not None:
            assert len(backing.regions) == 1
            pool = backing.regions[0].tensor.untyped_storage().data_ptr()
            assert all(view.untyped_storage().data_ptr() == pool for view in backing.views.values())
    source = tut.source(layout, backing=source_backing)
    destination = tut.destination(layout, backing=destination_backing)
    validate_engine_info(source.info)
    validate_engine_info(destination.info)
    local, remote = tut.scattered(layout.num_blocks, 9)
    plan = tut.plan(source, destination, local, remote)
    before = tut.snapshot(destination)

    await tut.write(plan, source, destination)

    tut.assert_landed(plan, source, destination, before, local, remote)
