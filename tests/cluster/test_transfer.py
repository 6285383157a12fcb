"""Real bytes between real Ray actors on one node: 2 prefill + 2 decode workers, concurrent
requests with random block ids, every ready-made layout in both block orders; destination
bytes compared block by block and every other byte of the decode allocations checked
against its canary pattern."""

from __future__ import annotations

import itertools
import random
from typing import Any

import msgspec
import numpy as np
import pytest
import ray

from kvray.config import Settings
from kvray.errors import (
    BlockIdError,
    GeometryMismatchError,
    KvrayError,
    TransferTimeoutError,
    UnknownEngineError,
)
from kvray.layout import READY_LAYOUTS, BlockOrder, Geometry, KVLayout, LayerSpec, llama_gqa
from kvray.wire import Reservation, TransportKind, decode_engine_info
from kvray.workers import DecodeActor, PrefillActor

NUM_BLOCKS = 24


def _info(actor_engine_id: str) -> object:
    from kvray.coordinator import get_or_create_coordinator

    coordinator = get_or_create_coordinator(Settings())
    info_bytes, _ = ray.get(coordinator.lookup.remote(actor_engine_id, 10.0))
    return decode_engine_info(info_bytes)


def _start(actors: list[object]) -> list[dict[str, object]]:
    return ray.get([actor.start.remote() for actor in actors])  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("layout_name", "order"), list(itertools.product(sorted(READY_LAYOUTS), list(BlockOrder)))
)
def test_concurrent_requests_land_exactly(
    local_ray: None, canary_mask: Any, layout_name: str, order: BlockOrder
) -> None:
    layout = READY_LAYOUTS[layout_name](NUM_BLOCKS, order)
    tag = f"{layout_name}-{order.value}"
    prefills = [PrefillActor.remote(f"p{i}-{tag}", layout, pool_seed=i) for i in range(2)]
    decodes = [DecodeActor.remote(f"d{i}-{tag}", layout, pool_seed=10 + i) for i in range(2)]
    _start(prefills + decodes)
    ray.get([d.fill_region.remote(100 + i) for i, d in enumerate(decodes)])
    before = ray.get([d.snapshot.remote() for d in decodes])

    rng = random.Random(f"{tag}")
    # (request id, prefill index, decode index, decode blocks, reservation, layers, expected bytes)
    requests = []
    for n in range(8):
        request_id = f"{tag}-r{n}"
        p, d = rng.randrange(2), rng.randrange(2)
        count = rng.randint(1, 5)
        layers = None if n % 3 else rng.sample(layout.layer_names, 2)
        src_blocks = ray.get(prefills[p].allocate.remote(request_id, count))
        ray.get(prefills[p].fill_random.remote(request_id, n))
        expected = ray.get(prefills[p].read_blocks.remote(src_blocks, layers))
        reservation = ray.get(decodes[d].reserve.remote(request_id, count, layers=layers))
        assert reservation.engine_id == f"d{d}-{tag}"
        requests.append((request_id, p, d, list(reservation.blocks), reservation, layers, expected))

    waits = [decodes[d].wait.remote(rid, 30) for rid, _, d, *_ in requests]
    pushes = [
        prefills[p].push.remote(reservation, layers=layers, layerwise=(i % 2 == 1))
        for i, (_, p, _, _, reservation, layers, _) in enumerate(requests)
    ]
    results = ray.get(pushes)
    completions = ray.get(waits)
    assert all(r.transport is TransportKind.SHM for r in results)
    assert [c.request_id for c in completions] == [r[0] for r in requests]

    for rid, _, d, blocks, _, layers, expected in requests:
        landed = ray.get(decodes[d].read_blocks.remote(blocks, layers))
        assert landed.keys() == expected.keys()
        for layer in expected:
            assert np.array_equal(landed[layer], expected[layer]), f"{rid} layer {layer}"

    # Canaries: every byte no request could write (other blocks, padding, slack) is untouched.
    after = ray.get([d.snapshot.remote() for d in decodes])
    for d, _decode in enumerate(decodes):
        engine_id = f"d{d}-{tag}"
        info = _info(engine_id)
        (region_offset, old), (_, new) = before[d][0], after[d][0]
        mine = [(blocks, layers) for _, _, dd, blocks, _, layers, _ in requests if dd == d]
        mask = canary_mask(info, region_offset, old.size, mine)
        assert np.array_equal(old[~mask], new[~mask]), f"bytes outside the written blocks of {engine_id}"

    # Prefill freed its blocks after each push; decode holds its blocks until release.
    assert ray.get([p.free_count.remote() for p in prefills]) == [NUM_BLOCKS, NUM_BLOCKS]
    for rid, _, d, *_ in requests:
        ray.get(decodes[d].release.remote(rid))
    assert ray.get([d.free_count.remote() for d in decodes]) == [NUM_BLOCKS, NUM_BLOCKS]
    for actor in prefills + decodes:
        ray.kill(actor)


def test_seed_bug_layers_of_one_geometry_land_apart(local_ray: None) -> None:
    """Two dense layers with identical geometry: each lands at its own address, no other layer moves."""
    layout = llama_gqa(16, num_layers=4)
    prefill = PrefillActor.remote("p-seed", layout)
    decode = DecodeActor.remote("d-seed", layout)
    _start([prefill, decode])
    ray.get(decode.fill_region.remote(5))
    untouched_before = ray.get(decode.read_blocks.remote(list(range(16))))
    l0, l1 = layout.layer_names[:2]
    src = ray.get(prefill.allocate.remote("seed", 3))
    ray.get(prefill.fill_random.remote("seed", 1))
    expected = ray.get(prefill.read_blocks.remote(src, [l0, l1]))
    assert not np.array_equal(expected[l0], expected[l1])
    reservation = ray.get(decode.reserve.remote("seed", 3, layers=[l0, l1]))
    dst = list(reservation.blocks)
    waiting = decode.wait.remote("seed", 30)
    ray.get(prefill.push.remote(reservation, layers=[l0, l1]))
    ray.get(waiting)
    landed = ray.get(decode.read_blocks.remote(dst, [l0, l1]))
    assert np.array_equal(landed[l0], expected[l0])
    assert np.array_equal(landed[l1], expected[l1])
    after = ray.get(decode.read_blocks.remote(list(range(16))))
    for layer in layout.layer_names[2:]:
        assert np.array_equal(after[layer], untouched_before[layer]), layer
    ray.kill(prefill)
    ray.kill(decode)


def test_bad_pushes_are_refused_and_write_nothing(local_ray: None) -> None:
    layout = llama_gqa(8, num_layers=2)
    settings = Settings(lookup_timeout_s=1.0)
    prefill = PrefillActor.remote("p-bad", layout, settings)
    decode = DecodeActor.remote("d-bad", layout, settings)
    other_geometry = KVLayout(
        layers=tuple(
            LayerSpec(
                name=name, geometry=Geometry(block_size=16, entry_shape=(4, 128), dtype="float16", parts=2)
            )
            for name in layout.layer_names
        ),
        num_blocks=8,
    )
    stranger = DecodeActor.remote("d-other-geometry", other_geometry, settings)
    _start([prefill, decode, stranger])
    ray.get(decode.fill_region.remote(9))
    before = ray.get(decode.snapshot.remote())

    def push(request_id: str, engine: str, blocks: list[int]) -> None:
        """Push into `blocks` of `engine`: a reservation of the engine's, naming those blocks
        (made up for an engine that does not exist)."""
        ray.get(prefill.allocate.remote(request_id, len(blocks)))
        target = {"d-bad": decode, "d-other-geometry": stranger}.get(engine)
        if target is None:
            reservation = Reservation(
                request_id=request_id, engine_id=engine, incarnation=1, blocks=tuple(blocks), token=1
            )
        else:
            reserved = ray.get(target.reserve.remote(request_id, 1))
            reservation = msgspec.structs.replace(reserved, blocks=tuple(blocks))
        try:
            ray.get(prefill.push.remote(reservation))
        finally:
            if target is not None:
                ray.get(target.release.remote(request_id))

    with pytest.raises(UnknownEngineError) as unknown:
        push("r-unknown", "nobody", [0])
    assert "nobody" in str(unknown.value)
    with pytest.raises(BlockIdError, match="outside"):
        push("r-range", "d-bad", [3, 8])
    with pytest.raises(BlockIdError, match="more than once"):
        push("r-dup", "d-bad", [2, 2])
    with pytest.raises(GeometryMismatchError, match="geometry"):
        push("r-geometry", "d-other-geometry", [0])
    assert ray.get(decode.snapshot.remote())[0][1].tobytes() == before[0][1].tobytes()
    assert ray.get(prefill.free_count.remote()) == 8  # freed on every failure

    # A decode wait past its deadline names the request and frees its blocks.
    ray.get(decode.reserve.remote("r-late", 3))
    assert ray.get(decode.free_count.remote()) == 5
    with pytest.raises(TransferTimeoutError, match="r-late"):
        ray.get(decode.wait.remote("r-late", 0.3))
    assert ray.get(decode.free_count.remote()) == 8
    stats = ray.get(decode.stats.remote())
    assert stats["waits_timed_out"] == 1
    for actor in (prefill, decode, stranger):
        ray.kill(actor)
    assert issubclass(UnknownEngineError, KvrayError)
