"""`KvrayConnector`'s worker side on a GPU, driven the way vLLM's GPU worker drives it
(`connector_actors.VllmGpuWorker`: two Ray GPU actors on one GPU, real CUDA caches in vLLM's
layouts). Whole and layer-wise pushes land over cuda_ipc, block digests (on the GPU) equal on
both sides, untouched blocks and the bytes around the cache in its CUDA allocation stay as they
were; a layer's copy waits for the forward's writes on the device; a killed prefill or decode
engine fails its peer's request cleanly. Skipped without CUDA (CPU CI);
`tests/gpu/run_on_device.sh` runs them on a GPU machine."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvray.config import Settings
from kvray.errors import ConfigError
from kvray.wire import Role

pytestmark = [
    pytest.mark.usefixtures("own_ray"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)"),
]

GPU_SHARE = 0.25
#: Every engine of the module gets an id of its own.
SERIAL = itertools.count()
NEVER_HANG_S = 120.0


def shape(kind: str) -> Any:
    from tests.vllm_layouts import CacheShape

    if kind == "mla":  # DeepSeek's latent: 576 bf16 per token, one head slot, 64 tokens a block
        return CacheShape(layers=4, num_blocks=24, block_size=64, heads=1, content=576, dtype=torch.bfloat16)
    dtype = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
    return CacheShape(layers=4, num_blocks=24, block_size=16, heads=8, content=2 * 128, dtype=dtype)


@pytest.fixture(scope="module")
def actors() -> Iterator[Any]:
    import connector_actors
    import ray
    import ray.cloudpickle

    import tests.vllm_layouts

    ray.init(
        address="local",
        num_cpus=8,
        num_gpus=torch.cuda.device_count(),
        include_dashboard=False,
        log_to_driver=False,
        namespace="kvray-gpu-connector",
    )
    for module in (connector_actors, tests.vllm_layouts):
        ray.cloudpickle.register_pickle_by_value(module)
    yield ray.remote(connector_actors.VllmGpuWorker)
    for module in (connector_actors, tests.vllm_layouts):
        ray.cloudpickle.unregister_pickle_by_value(module)
    ray.shutdown()


def settings() -> Settings:
    return Settings(heartbeat_s=0.3, notify_timeout_s=5.0, transfer_timeout_s=20.0)


def pair(
    actors: Any, layout: str, kind: str, *, legacy: str = "", order: str = "NHD", producer: bool = False
) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    import ray

    options = actors.options(num_gpus=GPU_SHARE)
    cache = shape(kind)
    serial = next(SERIAL)
    prefill = options.remote(
        f"gpu-p-{serial}-{layout}-{kind}-{legacy}",
        layout,
        cache,
        settings(),
        producer=producer,
        legacy=legacy,
        order=order,
    )
    decode = options.remote(
        f"gpu-d-{serial}-{layout}-{kind}-{legacy}", layout, cache, settings(), legacy=legacy, order=order
    )
    ray.get([prefill.fill.remote(1), decode.fill.remote(2)])
    p_info, d_info = ray.get([prefill.register.remote(), decode.register.remote()])
    return prefill, decode, p_info, d_info


def check_landed(
    prefill: Any, decode: Any, held: list[int], taken: list[int], untouched: dict[str, list[int]]
) -> None:
    import ray

    sent, landed = ray.get([prefill.digests.remote(held), decode.digests.remote(taken)])
    assert landed == sent, "the blocks' bytes differ between the two engines"
    others = [block for block in range(24) if block not in taken]
    assert ray.get(decode.digests.remote(others)) == untouched, "blocks no request named changed"
    assert ray.get(decode.canaries_hold.remote()), "bytes around the KV cache in its allocation changed"


CASES = [
    # vLLM 0.32+'s [B, H, N, C] views: FlashAttention's default (NHD), FlashInfer's and NIXL's
    # (HND), the cross-layer layout, and heads outside the blocks (a block of 8 runs).
    ("LBNHC", "gqa", ""),
    ("LBHNC", "gqa", ""),
    ("BLHNC", "gqa", ""),
    ("LHBNC", "gqa", ""),
    ("LBHNC", "fp8", ""),
    ("LBNHC", "mla", ""),
    # Earlier vLLMs' per-layer tensors.
    ("", "gqa", "flash_attn"),
    ("", "gqa", "flashinfer"),
    ("", "mla", "mla"),
]


@pytest.mark.parametrize(("layout", "kind", "legacy"), CASES, ids=lambda value: value or "-")
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_pushes_land_in_vllms_gpu_layouts(
    actors: Any, layout: str, kind: str, legacy: str, layerwise: bool
) -> None:
    import ray

    prefill, decode, p_info, d_info = pair(actors, layout, kind, legacy=legacy, producer=layerwise)
    try:
        assert d_info["transport"] == "cuda_ipc"
        if layout in ("LHBNC",):
            assert d_info["parts"] == 8
        held, taken = [3, 4, 5, 11, 20], [0, 7, 8, 9, 23]
        untouched = ray.get(decode.digests.remote([b for b in range(24) if b not in taken]))
        if layerwise:
            ray.get(prefill.begin_layerwise.remote("r-1", "h-1", held))
            ray.get(decode.load.remote("d-1", p_info, "h-1", taken))
            time.sleep(0.3)  # the ask reaches the prefill engine before its forward
            ray.get(prefill.forward.remote(held, seed=5))
            ray.get(prefill.hold.remote("r-1", "h-1", held))  # request_finished
        else:
            ray.get(prefill.hold.remote("r-1", "h-1", held))
            ray.get(decode.load.remote("d-1", p_info, "h-1", taken))
        got = ray.get(decode.finished.remote("d-1", 30.0), timeout=NEVER_HANG_S)
        assert got == {"reported": True, "failed": False, "load_errors": []}
        assert ray.get(prefill.finished.remote("r-1", 30.0, sending=True))["reported"]
        ray.get(prefill.sync.remote())
        check_landed(prefill, decode, held, taken, untouched)
    finally:
        ray.get([prefill.shutdown.remote(), decode.shutdown.remote()])
        for actor in (prefill, decode):
            ray.kill(actor)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_routine_loads_take_the_gpu_lane_land_exactly_and_fail_closed(actors: Any, kind: str) -> None:
    """After the first push of the pair (the usual way, which pairs the engines and captures
    the lane's copies), loads go through the prefill engine's native lane: its C threads launch
    the captured row copy and answer with its digests. Every load lands exactly; a copy that
    stores a block pair over another (under a correct plan) is answered, and the decode engine
    refuses it by its placement digest. The prefill engine is a producer, as in a P/D
    deployment: its agent's thread has run no CUDA work when its lane opens."""
    import ray

    prefill, decode, p_info, _ = pair(actors, "LBNHC", kind, producer=True)
    try:
        rounds = [
            ([1], [2]),
            ([3, 4], [5, 6]),
            ([7, 8, 9], [10, 11, 12]),
            ([13, 14, 15, 16, 17], [18, 19, 20, 21, 22]),
        ]
        rounds += [([0, 23], [1, 3]), ([5], [4])]
        for index, (held, taken) in enumerate(rounds):
            untouched = ray.get(decode.digests.remote([b for b in range(24) if b not in taken]))
            ray.get(prefill.hold.remote(f"r-{index}", f"h-{index}", held))
            time.sleep(0.05)  # past the decode engine's pause after the ask before the pairing
            ray.get(decode.load.remote(f"d-{index}", p_info, f"h-{index}", taken))
            got = ray.get(decode.finished.remote(f"d-{index}", 30.0), timeout=NEVER_HANG_S)
            assert got == {"reported": True, "failed": False, "load_errors": []}
            assert ray.get(prefill.finished.remote(f"r-{index}", 30.0, sending=True))["reported"]
            check_landed(prefill, decode, held, taken, untouched)
        answers = ray.get(decode.lane_answers.remote())
        assert answers.get("DONE", 0) >= len(rounds) - 2 and answers["moved"] == answers["DONE"], answers
        ray.get(prefill.executor_fault.remote(True))
        try:
            ray.get(prefill.hold.remote("r-bad", "h-bad", [6, 7]))
            ray.get(decode.load.remote("d-bad", p_info, "h-bad", [8, 9]))
            got = ray.get(decode.finished.remote("d-bad", 30.0), timeout=NEVER_HANG_S)
        finally:
            ray.get(prefill.executor_fault.remote(False))
        assert got["reported"] and got["failed"], got
        after = ray.get(decode.lane_answers.remote())
        assert after["DONE"] == answers["DONE"] + 1 and after["moved"] == answers["moved"], after
    finally:
        ray.get([prefill.shutdown.remote(), decode.shutdown.remote()])
        for actor in (prefill, decode):
            ray.kill(actor)


def test_a_layers_copy_waits_for_the_forwards_writes_on_the_device(actors: Any) -> None:
    """The forward's stream sleeps before writing each layer (about a second in all) and
    `save_kv_layer` returns at once: copies ordered after the host call, not after the
    stream's event, would carry the layers' old bytes."""
    import ray

    prefill, decode, p_info, _ = pair(actors, "LBHNC", "gqa", producer=True)
    try:
        held, taken = [1, 2], [5, 6]
        untouched = ray.get(decode.digests.remote([b for b in range(24) if b not in taken]))
        ray.get(prefill.begin_layerwise.remote("r-1", "h-1", held))
        ray.get(decode.load.remote("d-1", p_info, "h-1", taken))
        time.sleep(0.3)
        ray.get(prefill.forward.remote(held, seed=9, sleep_cycles=400_000_000))
        ray.get(prefill.hold.remote("r-1", "h-1", held))
        assert ray.get(decode.finished.remote("d-1", 60.0))["failed"] is False
        ray.get(prefill.sync.remote())
        check_landed(prefill, decode, held, taken, untouched)
    finally:
        for actor in (prefill, decode):
            ray.kill(actor)


def test_a_prefill_engine_killed_mid_copy_fails_the_load_and_the_next_one_lands(actors: Any) -> None:
    import ray
    from process_probes import wait_until

    prefill, decode, p_info, _ = pair(actors, "LBHNC", "gqa")
    try:
        ray.get(prefill.hold.remote("r-1", "h-1", [1, 2, 3]))
        ray.get(prefill.hold_writes.remote())
        started = time.monotonic()
        ray.get(decode.load.remote("d-1", p_info, "h-1", [4, 5, 6]))
        wait_until(lambda: ray.get(prefill.held.remote()) >= 1, what="a copy held mid-transfer")
        ray.kill(prefill)
        got = ray.get(decode.finished.remote("d-1", 30.0), timeout=NEVER_HANG_S)
        assert got == {"reported": True, "failed": True, "load_errors": [4, 5, 6]}
        assert time.monotonic() - started < 15.0, "the load waited past a few heartbeats"
        again = actors.options(num_gpus=GPU_SHARE).remote("gpu-p-again", "LBHNC", shape("gqa"), settings())
        ray.get(again.fill.remote(3))
        a_info = ray.get(again.register.remote())
        untouched = ray.get(decode.digests.remote([b for b in range(24) if b not in (7, 8)]))
        ray.get(again.hold.remote("r-2", "h-2", [9, 10]))
        ray.get(decode.load.remote("d-2", a_info, "h-2", [7, 8]))
        assert ray.get(decode.finished.remote("d-2", 30.0))["failed"] is False
        # Blocks 4-6 may hold part of the killed copy: nothing else may have changed.
        sent, landed = ray.get([again.digests.remote([9, 10]), decode.digests.remote([7, 8])])
        assert landed == sent
        others = ray.get(decode.digests.remote([b for b in range(24) if b not in (4, 5, 6, 7, 8)]))
        assert others == {
            name: [
                d
                for b, d in zip([x for x in range(24) if x not in (7, 8)], values, strict=True)
                if b not in (4, 5, 6)
            ]
            for name, values in untouched.items()
        }
        assert ray.get(decode.canaries_hold.remote())
        ray.kill(again)
    finally:
        ray.kill(decode)


def test_a_decode_engine_killed_mid_copy_frees_the_prefill_blocks(actors: Any) -> None:
    import ray
    from process_probes import wait_until

    prefill, decode, p_info, _ = pair(actors, "LBHNC", "gqa")
    try:
        ray.get(prefill.hold.remote("r-1", "h-1", [1, 2, 3]))
        ray.get(prefill.hold_writes.remote())
        ray.get(decode.load.remote("d-1", p_info, "h-1", [4, 5, 6]))
        wait_until(lambda: ray.get(prefill.held.remote()) >= 1, what="a copy held mid-transfer")
        ray.kill(decode)
        ray.get(prefill.release_writes.remote())
        # The push ends (its notice finds no one) and the held blocks are reported: vLLM frees them.
        assert ray.get(prefill.finished.remote("r-1", 60.0, sending=True), timeout=NEVER_HANG_S)["reported"]
    finally:
        ray.kill(prefill)


def test_a_decode_cache_allocated_outside_the_connectors_context_is_refused() -> None:
    """Its CUDA allocation may hold other tensors, which the IPC handle would export too."""
    from kvray.integrations.vllm.worker import ConnectorWorker
    from tests.vllm_layouts import layout_views

    cache = shape("gqa")
    worker = ConnectorWorker("gpu-outside", Role.DECODE, settings(), 30.0)
    buffer = torch.zeros(cache.nbytes, dtype=torch.int8, device="cuda")
    with pytest.raises(ConfigError, match=r"outside KvrayConnector\.get_mem_pool_context"):
        worker.register(layout_views(buffer, cache, "LBHNC"), cache.num_blocks, cache.block_size)
    worker.shutdown()
