"""The `ray` transport with KV on the GPU, staged through pinned host memory: across two Ray nodes
of one GPU machine (both offering the one GPU), `auto` picks `ray` between a prefill and a decode
engine with CUDA backings; whole and layer-wise pushes land exactly and every other byte of the
decode allocation keeps its canary, both checked on the GPU; GPU to CPU and CPU to GPU work too;
a write past its deadline or cancelled leaves no byte to land later. In one process (no Ray): the
staged copies themselves, through the Triton kernels and through the torch fallback, a push right
after the model's stream wrote, and a bad write into GPU memory that writes nothing. Skipped
without CUDA (CPU CI); `tests/gpu/run_on_device.sh` runs them on a GPU machine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvray.config import Settings
from kvray.errors import BoundsError, KvrayError, TransferTimeoutError
from kvray.layout import BlockOrder, Geometry, KVLayout, LayerSpec
from kvray.memory import Backing, MemoryKind
from kvray.plan import OpTable, plan_transfer
from kvray.transport import Peer
from kvray.transport.cuda_staging import chunk_nbytes, chunk_ops, packed_offsets
from kvray.wire import EngineInfo, Role, TransportKind, WriteOps, encode

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)"),
]

NUM_BLOCKS = 40
#: Blocks of a large request: each MLA layer then holds more than a chunk's minimum (1 MiB), so a
#: whole push goes in several chunks.
LARGE = 16
#: Each worker's share of the GPU its node offers (both nodes offer the one GPU).
GPU_SHARE = 0.25
OBJECT_STORE_NBYTES = 1 << 30
PUSH_DEADLINE_S = 20.0
#: Only turns a hang into a failure: far above every deadline in play.
NEVER_HANG_S = 120.0


def layout(order: BlockOrder = BlockOrder.LAYER_MAJOR) -> KVLayout:
    """DeepSeek-style MLA layers (576 bf16 per token, 64 tokens a block) with split K/V layers and
    an indexer cache between them."""
    mla = Geometry(block_size=64, entry_shape=(576,), dtype="bfloat16")
    kv = Geometry(block_size=64, entry_shape=(4, 128), dtype="float16", parts=2)
    indexer = Geometry(block_size=64, entry_shape=(132,), dtype="uint8")
    layers = (
        LayerSpec(name="layers.0.mla", geometry=mla),
        LayerSpec(name="layers.1.kv", geometry=kv),
        LayerSpec(name="layers.2.mla", geometry=mla),
        LayerSpec(name="indexer.k_cache", geometry=indexer),
        LayerSpec(name="layers.3.mla", geometry=mla),
        LayerSpec(name="layers.4.kv", geometry=kv),
    )
    return KVLayout(layers=layers, num_blocks=NUM_BLOCKS, block_order=order)


# ---- in one process: the staged copies ------------------------------------------------------------


class InProcessHost:
    """IN-PROCESS STAND-IN for the Ray actor hosting a decode agent: `kvray_deliver.remote` copies
    the payload (as Ray's object store does) and runs kvray's receiving half (`apply_write`)."""

    def __init__(self, backing: Backing, info: EngineInfo) -> None:
        self.backing = backing
        self.info = info
        self.deliveries = 0
        self.kvray_deliver = self

    def remote(self, header: bytes, payload: npt.NDArray[np.uint8]) -> Any:
        self.deliveries += 1
        received = np.array(payload, copy=True)
        received.flags.writeable = False
        return self._deliver(header, received)

    async def _deliver(self, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        from kvray.transport.ray import apply_write

        return await apply_write(self.backing, self.info.engine_id, self.info.incarnation, header, payload)


def _engines(source_memory: MemoryKind, destination_memory: MemoryKind, order: BlockOrder) -> Any:
    """A prefill backing of random bytes and a decode backing of canaries, with their infos
    registered as an agent would (a CUDA decode engine through cuda_ipc)."""
    from kvray.transport.cuda_ipc import CudaIpcTransport
    from kvray.transport.ray import RayTransport

    kv_layout = layout(order)
    source = Backing.allocate(kv_layout, source_memory)
    destination = Backing.allocate(kv_layout, destination_memory)
    for backing, seed in ((source, 1), (destination, 2)):
        allocation = backing.regions[0].allocation
        assert allocation is not None
        allocation.copy_(_pattern(allocation.numel(), seed).to(allocation.device))
    torch.cuda.synchronize()
    registrar = CudaIpcTransport if destination_memory is MemoryKind.CUDA else RayTransport
    regions = registrar(Settings()).register(destination, "decode", 5, remote_writable=True)
    destination_info = destination.engine_info("decode", 5, Role.DECODE, "node-b", regions)
    source_regions = source.region_descriptors("prefill", 3, TransportKind.RAY, remote_writable=False)
    source_info = source.engine_info("prefill", 3, Role.PREFILL, "node-a", source_regions)
    return source, source_info, destination, destination_info


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _byte_index(
    starts: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64], device: torch.device
) -> torch.Tensor:
    """Every byte the ops name, from `starts`, in op order, as one index tensor."""
    counts = torch.as_tensor(nbytes, device=device)
    op = torch.repeat_interleave(torch.arange(nbytes.size, device=device), counts)
    within = (
        torch.arange(int(nbytes.sum()), device=device)
        - torch.as_tensor(packed_offsets(nbytes), device=device)[op]
    )
    return torch.as_tensor(starts, device=device)[op] + within


def check_landed(ops: OpTable, source: Backing, destination: Backing, before: torch.Tensor) -> None:
    """On the GPU: every op's bytes at the destination equal the source's, and no other byte of the
    destination's allocation (other blocks, padding, slack) changed."""
    gpu = torch.device("cuda", torch.cuda.current_device())
    assert len(source.regions) == len(destination.regions) == 1
    source_bytes = source.regions[0].tensor.to(gpu)[_byte_index(ops.local_offset, ops.nbytes, gpu)]
    region = destination.regions[0]
    landed_index = _byte_index(ops.remote_offset, ops.nbytes, gpu)
    landed = region.tensor.to(gpu)[landed_index]
    wrong = int((landed != source_bytes).sum().item())
    assert wrong == 0, f"{wrong} of {ops.total_nbytes} written bytes differ from the source's"
    allocation = region.allocation
    assert allocation is not None
    written = torch.zeros(allocation.numel(), dtype=torch.bool, device=gpu)
    written[landed_index + region.span.offset_in_allocation] = True
    changed = (allocation.to(gpu) != before.to(gpu)) & ~written
    assert not changed.any(), f"{int(changed.sum().item())} bytes outside the ops changed (canaries)"


PAIRS = {
    "gpu-to-gpu": (MemoryKind.CUDA, MemoryKind.CUDA),
    "gpu-to-cpu": (MemoryKind.CUDA, MemoryKind.CPU),
    "cpu-to-gpu": (MemoryKind.CPU, MemoryKind.CUDA),
}


@pytest.mark.parametrize("copies", ["kernel", "torch"])
@pytest.mark.parametrize("layers", [None, ["layers.2.mla"]], ids=["whole", "one-layer"])
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda order: order.value)
async def test_staged_writes_land_and_canaries_hold(
    pair: str, layers: list[str] | None, copies: str, order: BlockOrder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvray.transport import cuda_staging
    from kvray.transport.ray import RayTransport

    if copies == "torch":  # the fallback without Triton: one async copy per op
        monkeypatch.setattr(cuda_staging, "triton_available", lambda: False)
    elif not cuda_staging.triton_available():
        pytest.skip("Triton is not installed")
    source, source_info, destination, destination_info = _engines(*PAIRS[pair], order)
    rng = np.random.default_rng(7)
    local = rng.choice(NUM_BLOCKS, LARGE, replace=False)
    remote = rng.choice(NUM_BLOCKS, LARGE, replace=False)
    plan = plan_transfer(source_info, destination_info, local, remote, layers)
    allocation = destination.regions[0].allocation
    assert allocation is not None
    before = allocation.clone()
    host = InProcessHost(destination, destination_info)
    transport = RayTransport(Settings())

    await transport.write(plan, source, Peer(destination_info, host=host))

    check_landed(plan.ops, source, destination, before)
    expected = (
        1
        if PAIRS[pair][0] is MemoryKind.CPU
        else len(chunk_ops(plan.ops, chunk_nbytes(plan.nbytes, len(plan.layers))))
    )
    assert host.deliveries == expected
    if layers is None and PAIRS[pair][0] is MemoryKind.CUDA:
        assert host.deliveries > 1, "a whole push from the GPU went in one chunk"
    await transport.close()
    source.close()
    destination.close()


async def test_a_push_right_after_the_models_stream_wrote_carries_the_new_bytes() -> None:
    from kvray.transport.ray import RayTransport

    source, source_info, destination, destination_info = _engines(
        MemoryKind.CUDA, MemoryKind.CUDA, BlockOrder.LAYER_MAJOR
    )
    blocks = np.arange(LARGE, dtype=np.int64)
    plan = plan_transfer(source_info, destination_info, blocks, blocks + 8)
    region = source.regions[0].tensor
    fresh = _pattern(region.numel(), 99).to(region.device)
    torch.cuda.synchronize()
    allocation = destination.regions[0].allocation
    assert allocation is not None
    before = allocation.clone()
    # The model's stream is busy, then writes the KV: the write must wait for both.
    torch.cuda._sleep(200_000_000)
    region.copy_(fresh)

    await RayTransport(Settings()).write(
        plan, source, Peer(destination_info, host=InProcessHost(destination, destination_info))
    )

    check_landed(plan.ops, source, destination, before)
    assert torch.equal(source.regions[0].tensor, fresh)


@pytest.mark.parametrize("bad", ["past-end", "payload-short"])
async def test_a_bad_write_into_gpu_memory_writes_nothing(bad: str) -> None:
    from kvray.transport.ray import apply_write

    _, _, destination, info = _engines(MemoryKind.CPU, MemoryKind.CUDA, BlockOrder.LAYER_MAJOR)
    length = info.regions[0].length
    offsets, nbytes, payload_nbytes = {
        "past-end": ([0, length - 100], [1 << 20, 4096], (1 << 20) + 4096),
        "payload-short": ([0, 2 << 20], [1 << 20, 4096], (1 << 20) + 4095),
    }[bad]
    header = encode(
        WriteOps(
            transfer_id="t",
            dst_engine="decode",
            dst_incarnation=5,
            regions=[0, 0],
            remote_offsets=offsets,
            nbytes=nbytes,
        )
    )
    allocation = destination.regions[0].allocation
    assert allocation is not None
    before = allocation.clone()
    with pytest.raises(BoundsError):
        await apply_write(destination, "decode", 5, header, np.ones(payload_nbytes, dtype=np.uint8))
    torch.cuda.synchronize()
    assert torch.equal(allocation, before), "a refused write changed GPU memory"


# ---- two Ray nodes sharing the GPU -------------------------------------------------------------


@pytest.fixture(scope="module")
def two_gpu_nodes(own_ray: None) -> Iterator[Any]:
    """Two Ray nodes on this machine (loopback addresses), each offering the machine's GPU 0 and a
    custom resource of its own; yields the workers' module, shipped by value."""
    import ray
    import ray.cloudpickle
    import ray_cuda_workers
    from ray.cluster_utils import Cluster

    node = {
        "num_cpus": 4,
        "num_gpus": 1,
        "node_ip_address": "127.0.0.1",
        "object_store_memory": OBJECT_STORE_NBYTES,
    }
    ray.cloudpickle.register_pickle_by_value(ray_cuda_workers)
    cluster = Cluster(
        initialize_head=True, head_node_args={**node, "resources": {"node_a": 10}, "include_dashboard": False}
    )
    try:
        cluster.add_node(**node, resources={"node_b": 10})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, namespace="kvray-gpu-ray")
        yield ray_cuda_workers
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(ray_cuda_workers)


def _settings(coordinator: str) -> Settings:
    return Settings(
        transport="auto",
        heartbeat_s=0.3,
        lookup_timeout_s=30.0,
        notify_timeout_s=5.0,
        transfer_timeout_s=PUSH_DEADLINE_S,
        coordinator_name=coordinator,
    )


def _worker(
    cls: Any, node: str, engine_id: str, order: BlockOrder, memory: MemoryKind, settings: Settings, seed: int
) -> Any:
    import ray

    options: dict[str, Any] = {"resources": {node: 1}}
    if memory is MemoryKind.CUDA:
        options["num_gpus"] = GPU_SHARE
    return (
        ray.remote(cls)
        .options(**options)
        .remote(engine_id, layout(order), settings, memory=memory, pool_seed=seed)
    )


def _pair(
    workers: Any, name: str, order: BlockOrder, memory: tuple[MemoryKind, MemoryKind]
) -> tuple[Any, Any]:
    """A prefill worker on node a and a decode worker on node b, started (on two nodes)."""
    import ray

    settings = _settings(f"kvray-ray-cuda-{name}")
    prefill = _worker(workers.PatternPrefill, "node_a", f"{name}-p", order, memory[0], settings, 1)
    decode = _worker(workers.CheckedDecode, "node_b", f"{name}-d", order, memory[1], settings, 2)
    started = ray.get([prefill.start.remote(), decode.start.remote()], timeout=NEVER_HANG_S)
    assert started[0]["node_id"] != started[1]["node_id"]
    ray.get(decode.fill_canaries.remote(11), timeout=NEVER_HANG_S)
    return prefill, decode


def _push_and_check(
    prefill: Any, decode: Any, request_id: str, count: int, layerwise: bool, seed: int, written: list[Any]
) -> None:
    """One push: it goes over ray, its blocks hold the prefill's bytes and nothing else in the
    decode allocation left its canary (both checked on the decode worker's device)."""
    import ray

    ray.get(prefill.allocate.remote(request_id, count), timeout=NEVER_HANG_S)
    ray.get(prefill.fill_pattern.remote(request_id, seed), timeout=NEVER_HANG_S)
    reservation = ray.get(decode.reserve.remote(request_id, count), timeout=NEVER_HANG_S)
    waiting = decode.wait.remote(request_id, PUSH_DEADLINE_S)
    result = ray.get(prefill.push.remote(reservation, layerwise=layerwise), timeout=NEVER_HANG_S)
    ray.get(waiting, timeout=NEVER_HANG_S)
    assert result.transport is TransportKind.RAY, f"{request_id} went over {result.transport}"
    blocks = list(reservation.blocks)
    differ = ray.get(decode.blocks_differ.remote(blocks, seed), timeout=NEVER_HANG_S)
    assert differ == [], f"{request_id}: layers {differ} did not land"
    written.append((blocks, None))
    changed = ray.get(decode.changed_outside.remote(written), timeout=NEVER_HANG_S)
    assert changed == 0, f"{request_id}: {changed} bytes outside the requests' blocks changed"
    ray.get(decode.release.remote(request_id), timeout=NEVER_HANG_S)


def _close(*actors: Any) -> None:
    import ray

    for actor in actors:
        ray.get(actor.close.remote(), timeout=NEVER_HANG_S)
        ray.kill(actor)


@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda order: order.value)
def test_auto_picks_ray_between_gpus_on_two_nodes(two_gpu_nodes: Any, order: BlockOrder) -> None:
    import ray

    prefill, decode = _pair(two_gpu_nodes, f"gpu-{order.value}", order, (MemoryKind.CUDA, MemoryKind.CUDA))
    written: list[Any] = []
    requests = [
        ("whole-large", LARGE, False),
        ("layers-large", LARGE, True),
        ("whole-one", 1, False),
        ("layers-one", 1, True),
    ]
    for index, (request_id, count, layerwise) in enumerate(requests):
        arrived_before, _ = ray.get(decode.deliveries.remote())
        _push_and_check(prefill, decode, request_id, count, layerwise, 100 + index, written)
        arrived, ended = ray.get(decode.deliveries.remote())
        assert arrived == ended
        if request_id == "whole-large":
            assert arrived - arrived_before > 1, "a whole push from the GPU went in one delivery"
    assert ray.get(prefill.free_count.remote()) == NUM_BLOCKS
    assert ray.get(decode.free_count.remote()) == NUM_BLOCKS
    _close(prefill, decode)


@pytest.mark.parametrize("pair", ["gpu-to-cpu", "cpu-to-gpu"])
def test_gpu_and_cpu_memory_on_two_nodes(two_gpu_nodes: Any, pair: str) -> None:
    prefill, decode = _pair(two_gpu_nodes, pair, BlockOrder.LAYER_MAJOR, PAIRS[pair])
    written: list[Any] = []
    _push_and_check(prefill, decode, "whole", LARGE, False, 200, written)
    _push_and_check(prefill, decode, "layers", LARGE, True, 201, written)
    _close(prefill, decode)


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_a_write_that_ends_early_leaves_no_late_bytes(two_gpu_nodes: Any, how: str) -> None:
    """The decode worker holds every delivery at a gate; the push passes its deadline (or is
    cancelled) meanwhile. The decode's wait fails, and once the gate opens no held delivery writes
    a byte: the whole allocation keeps its canaries. Both sides get their blocks back, and the next
    push lands."""
    import ray
    from process_probes import wait_until

    prefill, decode = _pair(
        two_gpu_nodes, f"late-{how}", BlockOrder.LAYER_MAJOR, (MemoryKind.CUDA, MemoryKind.CUDA)
    )
    ray.get(prefill.allocate.remote("doomed", LARGE))
    ray.get(prefill.fill_pattern.remote("doomed", 300))
    reservation = ray.get(decode.reserve.remote("doomed", LARGE))
    waiting = decode.wait.remote("doomed", PUSH_DEADLINE_S)
    ray.get(decode.hold_deliveries.remote())
    started = time.monotonic()
    if how == "deadline":
        pushing = prefill.push.remote(reservation, timeout=3.0)
        with pytest.raises(TransferTimeoutError):
            ray.get(pushing, timeout=NEVER_HANG_S)
    else:
        pushing = prefill.push.remote(reservation)
        wait_until(lambda: ray.get(decode.deliveries.remote())[0] >= 1, what="a delivery held at the decode")
        ray.cancel(pushing)
        with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
            ray.get(pushing, timeout=NEVER_HANG_S)
    with pytest.raises(KvrayError):
        ray.get(waiting, timeout=NEVER_HANG_S)
    assert time.monotonic() - started < PUSH_DEADLINE_S
    ray.get(decode.release_deliveries.remote())

    def settled() -> bool:
        arrived, ended = ray.get(decode.deliveries.remote())
        return arrived == ended

    wait_until(settled, what="every held delivery ending")
    assert ray.get(decode.deliveries.remote())[0] >= 1
    changed = ray.get(decode.changed_outside.remote([]))
    assert changed == 0, f"{changed} bytes landed after the write ended"
    wait_until(
        lambda: ray.get(prefill.free_count.remote()) == NUM_BLOCKS,
        what="the prefill's blocks back in its pool",
    )
    wait_until(
        lambda: ray.get(decode.free_count.remote()) == NUM_BLOCKS, what="the decode's blocks back in its pool"
    )
    _push_and_check(prefill, decode, "after", LARGE, False, 301, [])
    _close(prefill, decode)
