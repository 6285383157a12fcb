"""Prefill on one Ray node, decode on another (two nodes of one machine, loopback addresses):
`auto` must pick the ray transport, the bytes must land exactly, and every completion must come
over the decode engine's TCP notice listener, not a Ray call."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import ray

from kvray.layout import BlockOrder, mixed
from kvray.wire import TransportKind
from kvray.workers import DecodeActor, PrefillActor


@pytest.mark.parametrize("order", list(BlockOrder))
def test_auto_picks_ray_across_nodes(two_node_cluster: Any, canary_mask: Any, order: BlockOrder) -> None:
    from kvray.coordinator import get_or_create_coordinator
    from kvray.wire import decode_engine_info

    layout = mixed(32, order)
    prefill = PrefillActor.options(resources={"node_a": 1}).remote(f"p-{order.value}", layout, pool_seed=1)
    decode = DecodeActor.options(resources={"node_b": 1}).remote(f"d-{order.value}", layout, pool_seed=2)
    started = ray.get([prefill.start.remote(), decode.start.remote()])
    assert started[0]["node_id"] != started[1]["node_id"]
    ray.get(decode.fill_region.remote(3))
    before = ray.get(decode.snapshot.remote())

    requests = []
    for n in range(4):
        request_id = f"{order.value}-{n}"
        src = ray.get(prefill.allocate.remote(request_id, 3 + n))
        ray.get(prefill.fill_random.remote(request_id, n))
        expected = ray.get(prefill.read_blocks.remote(src))
        reservation = ray.get(decode.reserve.remote(request_id, 3 + n))
        requests.append((request_id, list(reservation.blocks), reservation, expected))
    waits = [decode.wait.remote(rid, 30) for rid, *_ in requests]
    results = ray.get(
        [
            prefill.push.remote(reservation, layerwise=bool(i % 2))
            for i, (_, _, reservation, _) in enumerate(requests)
        ]
    )
    ray.get(waits)
    assert {r.transport for r in results} == {TransportKind.RAY}
    decode_stats, prefill_stats = ray.get([decode.stats.remote(), prefill.stats.remote()])
    assert decode_stats["notices_received_tcp"] == len(requests), decode_stats
    sent = prefill_stats["notices_sent_tcp_after_write"] + prefill_stats["notices_sent_tcp_at_once"]
    assert sent == len(requests), prefill_stats
    for request_id, dst, _, expected in requests:
        landed = ray.get(decode.read_blocks.remote(dst))
        for layer in expected:
            assert np.array_equal(landed[layer], expected[layer]), f"{request_id} {layer}"

    coordinator = get_or_create_coordinator()
    info = decode_engine_info(ray.get(coordinator.lookup.remote(f"d-{order.value}", 10.0))[0])
    (offset, old), (_, new) = before[0], ray.get(decode.snapshot.remote())[0]
    mask = canary_mask(info, offset, old.size, [(dst, None) for _, dst, _, _ in requests])
    assert np.array_equal(old[~mask], new[~mask])
    ray.kill(prefill)
    ray.kill(decode)
