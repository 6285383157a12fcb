"""A prefill engine lets go of decode engines that leave the cluster: three decode actors (one
killed, two closed) that it wrote into are dropped by the coordinator, and at its next
heartbeat the prefill agent unmaps their shared memory, so the kernel can return it."""

from __future__ import annotations

import asyncio

import ray
from process_probes import mappings_of, until

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.layout import BlockOrder, llama_gqa
from kvray.wire import Reservation, Role
from kvray.workers import DecodeActor

SETTINGS = Settings(
    heartbeat_s=0.2, lookup_timeout_s=10.0, transport="shm", coordinator_name="kvray-coordinator-departed"
)
#: 16 MiB of KV per decode engine.
LAYOUT = llama_gqa(64, num_layers=4, block_order=BlockOrder.LAYER_MAJOR)


async def test_departed_decode_engines_are_unmapped_at_the_next_heartbeat(local_ray: None) -> None:
    prefill = KVAgent("dep-p", Role.PREFILL, LAYOUT, settings=SETTINGS)
    await prefill.start()
    decodes = [DecodeActor.remote(f"dep-d{i}", LAYOUT, SETTINGS) for i in range(3)]
    try:
        await asyncio.gather(*(decode.start.remote() for decode in decodes))
        paths = []
        for index, decode in enumerate(decodes):
            request_id = f"dep-r{index}"
            reservation: Reservation = await decode.reserve.remote(request_id, 8)
            waiting = decode.wait.remote(request_id, 30)
            await prefill.push(reservation, list(range(8)), timeout=30)
            await waiting
            peer = await prefill.peer(f"dep-d{index}")
            path = peer.info.regions[0].handle.decode()
            paths.append(path)
            assert mappings_of(path) == 1, "the prefill maps the decode engine's region once"

        ray.kill(decodes[0])
        await decodes[1].close.remote()
        await decodes[2].close.remote()

        await until(
            lambda: all(mappings_of(path) == 0 for path in paths),
            "the prefill still maps departed decode engines' shared memory",
        )
        assert prefill.stats["directory_events_peer_departed"] == 3
    finally:
        await prefill.close()
        for decode in decodes:
            ray.kill(decode)
