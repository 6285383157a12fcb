"""The ready workers on a GPU, as Ray GPU actors: KV backings on the GPU, cuda_ipc between them.
The bytes of a push land and nothing else in the decode allocation changes; disaggregated
generation on the GPU equals colocated generation on the GPU, token for token and layer digest
for layer digest; a GPU actor killed mid-transfer gives its peer a kvray error within the
deadline, leaves no block held, and the next request works. Skipped without CUDA (CPU CI);
`tests/gpu/run_on_device.sh` runs them on a GPU machine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvray.config import Settings
from kvray.errors import KvrayError, TransferTimeoutError
from kvray.layout import BlockOrder, mixed
from kvray.memory import MemoryKind
from kvray.wire import EngineInfo, Role, TransportKind, decode_engine_info

pytestmark = [
    pytest.mark.usefixtures("own_ray"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)"),
]

NUM_BLOCKS = 32
#: Four workers at most share one GPU in these tests.
GPU_SHARE = 0.25
WAIT_DEADLINE_S = 5.0
PUSH_DEADLINE_S = 20.0
#: Only turns a hang into a failure: far above every deadline in play.
NEVER_HANG_S = 120.0


@pytest.fixture(scope="module")
def gpu_ray() -> Iterator[Any]:
    """A local Ray offering every GPU torch sees; the GPU workers' test class shipped by value."""
    import gpu_workers
    import ray
    import ray.cloudpickle

    ray.init(
        address="local",
        num_cpus=8,
        num_gpus=torch.cuda.device_count(),
        include_dashboard=False,
        log_to_driver=False,
        namespace="kvray-gpu-tests",
    )
    ray.cloudpickle.register_pickle_by_value(gpu_workers)
    yield gpu_workers
    ray.cloudpickle.unregister_pickle_by_value(gpu_workers)
    ray.shutdown()


def _settings(coordinator: str) -> Settings:
    return Settings(
        transport="auto",
        heartbeat_s=0.3,
        # Starting GPU actors and a coordinator after a kill takes Ray several seconds.
        lookup_timeout_s=30.0,
        notify_timeout_s=5.0,
        transfer_timeout_s=PUSH_DEADLINE_S,
        coordinator_name=coordinator,
    )


def _actor(cls: Any, engine_id: str, layout: Any, settings: Settings) -> Any:
    import ray

    remote = cls if hasattr(cls, "remote") else ray.remote(cls)
    return remote.options(num_gpus=GPU_SHARE).remote(engine_id, layout, settings, memory=MemoryKind.CUDA)


def _info(settings: Settings, engine_id: str) -> EngineInfo:
    import ray

    from kvray.coordinator import get_or_create_coordinator

    coordinator = get_or_create_coordinator(settings)
    return decode_engine_info(ray.get(coordinator.lookup.remote(engine_id, 10.0))[0])


def _dropped(settings: Settings, engine_id: str) -> Callable[[], bool]:
    import ray

    from kvray.coordinator import get_or_create_coordinator
    from kvray.errors import UnknownEngineError

    coordinator = get_or_create_coordinator(settings)

    def check() -> bool:
        try:
            ray.get(coordinator.lookup.remote(engine_id, 0.1))
        except UnknownEngineError:
            return True
        return False

    return check


def _transfer_and_check(
    prefill: Any,
    decode: Any,
    decode_id: str,
    request_id: str,
    count: int,
    seed: int,
    canary_mask: Any,
    settings: Settings,
    also_written: list[list[int]] | None = None,
) -> Any:
    """One push between GPU workers: it goes over cuda_ipc, the bytes land, and no byte of the
    decode allocation outside the request's blocks (and `also_written`, blocks an interrupted
    transfer may have reached) changes. Returns the push's result."""
    import ray

    ray.get(decode.fill_region.remote(seed))
    before = ray.get(decode.snapshot.remote())
    src = ray.get(prefill.allocate.remote(request_id, count))
    ray.get(prefill.fill_random.remote(request_id, seed))
    expected = ray.get(prefill.read_blocks.remote(src))
    reservation = ray.get(decode.reserve.remote(request_id, count))
    dst = list(reservation.blocks)
    waiting = decode.wait.remote(request_id, 30.0)
    result = ray.get(prefill.push.remote(reservation), timeout=NEVER_HANG_S)
    ray.get(waiting, timeout=NEVER_HANG_S)
    assert result.transport is TransportKind.CUDA_IPC
    landed = ray.get(decode.read_blocks.remote(dst))
    for layer, data in expected.items():
        assert np.array_equal(landed[layer], data), f"{request_id}: layer {layer} did not land"
    (offset, old), (_, new) = before[0], ray.get(decode.snapshot.remote())[0]
    written = [(dst, None)] + [(blocks, None) for blocks in also_written or []]
    mask = canary_mask(_info(settings, decode_id), offset, old.size, written)
    assert mask.any() and (~mask).any()
    assert np.array_equal(old[~mask], new[~mask]), f"{request_id}: bytes outside its blocks changed"
    ray.get(decode.release.remote(request_id))
    return result


@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda order: order.value)
def test_gpu_workers_push_over_cuda_ipc_and_canaries_hold(
    gpu_ray: Any, canary_mask: Any, order: BlockOrder
) -> None:
    import ray

    from kvray.workers import DecodeActor, PrefillActor

    settings = _settings(f"kvray-gpu-workers-{order.value}")
    layout = mixed(NUM_BLOCKS, order)
    prefill = _actor(PrefillActor, f"gpu-p-{order.value}", layout, settings)
    decode = _actor(DecodeActor, f"gpu-d-{order.value}", layout, settings)
    ray.get([prefill.start.remote(), decode.start.remote()])
    for index, count in enumerate((1, 5, 11)):
        _transfer_and_check(
            prefill, decode, f"gpu-d-{order.value}", f"r{index}", count, 10 + index, canary_mask, settings
        )
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS
    assert ray.get(decode.free_count.remote()) == NUM_BLOCKS
    for actor in (prefill, decode):
        ray.get(actor.close.remote())
        ray.kill(actor)


@pytest.mark.parametrize("model", ["mixed", "deepseek-v3"])
def test_demo_on_the_gpu_equals_colocated_generation(gpu_ray: Any, model: str) -> None:
    """Prefill and decode as Ray GPU actors with the model and KV on the GPU: every prompt's
    tokens equal colocated generation on the GPU, every layer's digest is equal on both sides,
    half the prompts pushed layer by layer while prefill computes."""
    from kvray.demo import parse, run_demo
    from kvray.models import MODEL_PRESETS

    args = parse(
        ["--device", "cuda", "--model", model, "--prompts", "24", "--max-new-tokens", "6", "--blocks", "256"]
    )
    outcomes = asyncio.run(run_demo(args))
    assert len(outcomes) == 24
    block_size = MODEL_PRESETS[model].block_size
    assert {1, block_size, block_size + 1} <= {outcome.prompt_len for outcome in outcomes}
    assert {outcome.layerwise for outcome in outcomes} == {True, False}
    assert {outcome.transport for outcome in outcomes} == {TransportKind.CUDA_IPC.value}
    mismatched = [(o.prompt_len, o.tokens, o.reference) for o in outcomes if not o.exact]
    assert not mismatched, f"{len(mismatched)} prompts differ, first: {mismatched[0]}"
    assert not [o.bad_layers for o in outcomes if o.bad_layers]


def test_the_seed_bug_is_caught_on_the_gpu(gpu_ray: Any) -> None:
    """Offsets cached by geometry alone, on GPU backings: the decode side's integrity check
    refuses the requests whose KV the bug wrote over, as on the CPU; none is decoded from it."""
    from kvray.demo import parse, run_demo

    args = parse(["--device", "cuda", "--prompts", "8", "--max-new-tokens", "6", "--inject-seed-bug"])
    outcomes = asyncio.run(run_demo(args))
    named = {layer for o in outcomes for layer in o.refused_layers}
    assert {"model.layers.2.self_attn.kv", "model.layers.3.self_attn.mla"} <= named
    assert all(o.exact for o in outcomes if not o.refused_layers), "a request was decoded from wrong KV"


def test_prefill_killed_mid_transfer_on_the_gpu(gpu_ray: Any, canary_mask: Any) -> None:
    """The prefill actor dies after its copy is queued and before its completion: the decode
    side gets `TransferTimeoutError` within its deadline, its blocks go back to its pool, and a
    restarted prefill's push lands exactly."""
    import ray
    from process_probes import wait_until

    from kvray.workers import DecodeActor, PrefillActor

    settings = _settings("kvray-gpu-kill-prefill")
    layout = mixed(NUM_BLOCKS, BlockOrder.LAYER_MAJOR)
    prefill_id, decode_id = "gpu-kill-p", "gpu-kill-pd"
    prefill = _actor(gpu_ray.HoldingGpuPrefill, prefill_id, layout, settings)
    decode = _actor(DecodeActor, decode_id, layout, settings)
    ray.get([prefill.start.remote(), decode.start.remote()])

    ray.get(prefill.allocate.remote("doomed", 6))
    ray.get(prefill.fill_random.remote("doomed", 1))
    reservation = ray.get(decode.reserve.remote("doomed", 6))
    assert ray.get(decode.free_count.remote()) == NUM_BLOCKS - 6
    ray.get(prefill.hold_writes.remote())
    started = time.monotonic()
    waiting = decode.wait.remote("doomed", WAIT_DEADLINE_S)
    pushing = prefill.push.remote(reservation)
    wait_until(lambda: ray.get(prefill.held.remote()) >= 1, what="a write held mid-transfer")
    ray.kill(prefill)

    with pytest.raises(TransferTimeoutError, match="doomed") as raised:
        ray.get(waiting, timeout=NEVER_HANG_S)
    assert raised.value.facts["timeout_s"] == WAIT_DEADLINE_S
    assert time.monotonic() - started < NEVER_HANG_S
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pushing, timeout=NEVER_HANG_S)
    assert ray.get(decode.free_count.remote()) == NUM_BLOCKS
    wait_until(_dropped(settings, prefill_id), what="the coordinator dropping the dead prefill")

    restarted = _actor(PrefillActor, prefill_id, layout, settings)
    ray.get(restarted.start.remote())
    _transfer_and_check(
        restarted,
        decode,
        decode_id,
        "after",
        3,
        7,
        canary_mask,
        settings,
        also_written=[list(reservation.blocks)],
    )
    assert ray.get(decode.free_count.remote()) == NUM_BLOCKS
    assert ray.get(restarted.free_count.remote()) == NUM_BLOCKS
    for actor in (restarted, decode):
        ray.kill(actor)


def test_decode_killed_mid_transfer_on_the_gpu(gpu_ray: Any, canary_mask: Any) -> None:
    """The decode actor dies while a push into its GPU memory is in flight: the push fails with
    a kvray error naming it, the prefill's blocks go back to its pool, and a decode restarted
    under the same id takes the next push exactly."""
    import ray
    from process_probes import wait_until

    from kvray.workers import DecodeActor

    settings = _settings("kvray-gpu-kill-decode")
    layout = mixed(NUM_BLOCKS, BlockOrder.BLOCK_MAJOR)
    prefill_id, decode_id = "gpu-kill-dp", "gpu-kill-d"
    prefill = _actor(gpu_ray.HoldingGpuPrefill, prefill_id, layout, settings)
    decode = _actor(DecodeActor, decode_id, layout, settings)
    ray.get([prefill.start.remote(), decode.start.remote()])

    ray.get(prefill.allocate.remote("doomed", 5))
    ray.get(prefill.fill_random.remote("doomed", 2))
    reservation = ray.get(decode.reserve.remote("doomed", 5))
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS - 5
    ray.get(prefill.hold_writes.remote())
    pushing = prefill.push.remote(reservation)
    wait_until(lambda: ray.get(prefill.held.remote()) >= 1, what="a write held mid-transfer")
    ray.kill(decode)
    wait_until(_dropped(settings, decode_id), what="the coordinator dropping the dead decode")
    ray.get(prefill.release_writes.remote())

    with pytest.raises(KvrayError, match=decode_id):
        ray.get(pushing, timeout=NEVER_HANG_S)
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS

    restarted = _actor(DecodeActor, decode_id, layout, settings)
    ray.get(restarted.start.remote())
    _transfer_and_check(prefill, restarted, decode_id, "after", 4, 9, canary_mask, settings)
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS
    assert ray.get(restarted.free_count.remote()) == NUM_BLOCKS
    for actor in (prefill, restarted):
        ray.kill(actor)


def test_a_gpu_worker_without_a_gpu_in_the_cluster_is_refused_clearly(gpu_ray: Any) -> None:
    from kvray.errors import ConfigError
    from kvray.workers import placement_options

    with pytest.raises(ConfigError, match="GPU"):
        placement_options(Role.DECODE, num_gpus=1000.0)
