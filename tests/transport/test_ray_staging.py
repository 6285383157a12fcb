"""The ray transport with KV on a GPU, on a CPU machine: engines whose backings claim CUDA memory
but live in CPU memory (a FAKE device), with the GPU copies replaced by CPU stand-ins
(`CpuGathers` for `cuda_staging.DeviceGathers`, `cpu_receive` for `cuda_staging.receive_payload`).
What runs for real is the transport around them: the chunking of a write, its deliveries (all
awaited before the write returns, all abandoned when it fails or is cancelled), and the receiver's
checks, none of which lets a byte move into GPU memory before it has passed.
`tests/gpu/test_ray_cuda.py` runs the real copies on a GPU."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pytest
import torch

from kvray.errors import BoundsError, NotExpectedError, StaleIncarnationError
from kvray.layout import BlockOrder, KVLayout, mixed
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.plan import OpTable
from kvray.transport import choose_transport, cuda_staging, transport_class
from kvray.transport import ray as ray_transport
from kvray.transport.base import Peer
from kvray.transport.cuda_staging import PinnedSlots, packed_offsets
from kvray.wire import CudaIpcHandle, TransportKind, WriteOps, encode

if TYPE_CHECKING:
    from conftest import Engine, TransportUnderTest

LAYOUT = mixed(num_blocks=16, block_order=BlockOrder.LAYER_MAJOR)
#: Small chunks, so that the small layout's writes go in several.
CHUNK_NBYTES = 8192


def fake_gpu_backing(layout: KVLayout) -> Backing:
    """A backing that says CUDA but lives in CPU memory: the FAKE device of these tests."""
    alignment = 4096
    buffer = torch.empty(layout.nbytes + 2 * alignment, dtype=torch.uint8)
    return Backing.in_buffer(layout, buffer, alignment=alignment, kind=MemoryKind.CUDA)


@dataclass(eq=False)
class _Gathered:
    data: np.ndarray
    over: bool = False


@dataclass
class CpuGathers:
    """Stands in for `DeviceGathers`: a chunk's bytes gathered from the fake device's regions with
    numpy; its 'copy' is over once `wait` has seen it."""

    sources: Sequence[torch.Tensor]
    started: list[_Gathered] = field(default_factory=list)
    released: int = 0

    def start(self, chunk: OpTable) -> _Gathered:
        data = np.empty(chunk.total_nbytes, dtype=np.uint8)
        for region, offset, at, count in zip(
            chunk.local_region.tolist(),
            chunk.local_offset.tolist(),
            packed_offsets(chunk.nbytes).tolist(),
            chunk.nbytes.tolist(),
            strict=True,
        ):
            data[at : at + count] = self.sources[region].numpy()[offset : offset + count]
        gathered = _Gathered(data)
        self.started.append(gathered)
        return gathered

    async def wait(self, gathers: Sequence[_Gathered]) -> None:
        await asyncio.sleep(0)
        for gathered in gathers:
            gathered.over = True

    def payload(self, gather: _Gathered) -> np.ndarray:
        assert gather.over
        return gather.data

    def release(self, gather: _Gathered) -> None:
        assert gather.over
        self.released += 1


@dataclass
class FakeDevice:
    """The GPU copies' stand-ins, and what they were asked to do."""

    gathers: list[CpuGathers] = field(default_factory=list)
    received: list[int] = field(default_factory=list)

    def device_gathers(
        self, local: Backing, ops: OpTable, slots: PinnedSlots, ready: SourceReady = None
    ) -> CpuGathers:
        gathers = CpuGathers([region.tensor for region in local.regions])
        self.gathers.append(gathers)
        return gathers

    async def receive(
        self,
        targets: Sequence[torch.Tensor],
        regions: np.ndarray,
        offsets: np.ndarray,
        nbytes: np.ndarray,
        payload: np.ndarray,
        slots: PinnedSlots,
        threads: int = 0,
    ) -> None:
        self.received.append(int(payload.size))
        for region, offset, at, count in zip(
            regions.tolist(), offsets.tolist(), packed_offsets(nbytes).tolist(), nbytes.tolist(), strict=True
        ):
            targets[region].numpy()[offset : offset + count] = payload[at : at + count]
        await asyncio.sleep(0)


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    fake = FakeDevice()
    monkeypatch.setattr(ray_transport, "device_gathers", fake.device_gathers)
    monkeypatch.setattr(ray_transport, "receive_payload", fake.receive)
    monkeypatch.setattr(cuda_staging, "MIN_CHUNK_NBYTES", CHUNK_NBYTES)
    monkeypatch.setattr(cuda_staging, "MAX_CHUNK_NBYTES", CHUNK_NBYTES)
    return fake


class CountingHost:
    """Wraps the suite's `LocalHost`: counts deliveries started and ended, and can hold each one
    at a gate before it reaches the receiver."""

    def __init__(self, host: Any, gate: asyncio.Event | None = None) -> None:
        self.host = host
        self.gate = gate
        self.started = 0
        self.ended = 0
        self.cancelled = 0
        self.kvray_deliver = self

    def remote(self, header: bytes, payload: np.ndarray) -> Any:
        self.started += 1
        return self._deliver(header, np.array(payload, copy=True))

    async def _deliver(self, header: bytes, payload: np.ndarray) -> int:
        try:
            if self.gate is not None:
                await self.gate.wait()
            return int(await self.host.kvray_deliver.remote(header, payload))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.ended += 1


@pytest.mark.parametrize("destination_memory", [MemoryKind.SHM, MemoryKind.CUDA])
@pytest.mark.parametrize("layers", [None, ["model.layers.2.mla"]], ids=["whole", "one-layer"])
async def test_a_gpu_write_goes_in_chunks_and_lands_exactly(
    ray_side: TransportUnderTest, device: FakeDevice, destination_memory: MemoryKind, layers: list[str] | None
) -> None:
    source = ray_side.source(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    backing = fake_gpu_backing(LAYOUT) if destination_memory is MemoryKind.CUDA else None
    destination = ray_side.destination(LAYOUT, backing=backing)
    local, remote = ray_side.scattered(16, 6)
    plan = ray_side.plan(source, destination, local, remote, layers)
    before = ray_side.snapshot(destination)
    host = CountingHost(ray_side.peer(destination).host)

    await ray_side.transport.write(plan, source.backing, Peer(destination.info, host=host))

    chunks = cuda_staging.chunk_ops(plan.ops, CHUNK_NBYTES)
    assert len(chunks) > 1
    assert host.started == host.ended == len(chunks), "a delivery was still running when the write returned"
    (gathers,) = device.gathers
    assert len(gathers.started) == gathers.released == len(chunks)
    if destination_memory is MemoryKind.CUDA:
        assert device.received == [chunk.total_nbytes for chunk in chunks]
    else:
        assert device.received == []
    ray_side.assert_landed(plan, source, destination, before, local, remote)


async def test_a_cpu_write_into_gpu_memory_is_one_delivery(
    ray_side: TransportUnderTest, device: FakeDevice
) -> None:
    source = ray_side.source(LAYOUT)
    destination = ray_side.destination(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    local, remote = ray_side.scattered(16, 6)
    plan = ray_side.plan(source, destination, local, remote)
    before = ray_side.snapshot(destination)

    await ray_side.write(plan, source, destination)

    assert device.gathers == []
    assert device.received == [plan.nbytes]
    ray_side.assert_landed(plan, source, destination, before, local, remote)


def _header(
    destination: Engine, regions: list[int], offsets: list[int], nbytes: list[int], **changes: Any
) -> bytes:
    fields: dict[str, Any] = {
        "transfer_id": "prefill-0:1:w1.0",
        "dst_engine": destination.engine_id,
        "dst_incarnation": destination.incarnation,
        "regions": regions,
        "remote_offsets": offsets,
        "nbytes": nbytes,
    }
    fields.update(changes)
    return encode(WriteOps(**fields))


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("past-end", BoundsError),
        ("payload-short", BoundsError),
        ("stale-incarnation", StaleIncarnationError),
        ("outside-the-request", NotExpectedError),
    ],
)
async def test_into_gpu_memory_nothing_moves_before_every_check(
    ray_side: TransportUnderTest, device: FakeDevice, case: str, error: type[Exception]
) -> None:
    destination = ray_side.destination(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    length = destination.info.regions[0].length
    regions, offsets, nbytes, payload_nbytes, changes = {
        "past-end": ([0, 0], [0, length - 10], [4096, 64], 4160, {}),
        "payload-short": ([0], [0], [4096], 4095, {}),
        "stale-incarnation": ([0], [0], [64], 64, {"dst_incarnation": destination.incarnation + 1}),
        "outside-the-request": ([0], [0], [64], 64, {}),
    }[case]
    header = _header(destination, regions, offsets, nbytes, **changes)
    payload = np.frombuffer(ray_side.rng.bytes(payload_nbytes), dtype=np.uint8).copy()
    before = ray_side.snapshot(destination)
    receiver = ray_side.receiver(destination)

    @contextlib.asynccontextmanager
    async def admit(request_id: str, token: int) -> Any:
        def within(regions: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray) -> None:
            raise NotExpectedError("ops outside the request's blocks", request_id=request_id)

        yield within

    if case == "outside-the-request":
        receiver.admit = admit  # type: ignore[method-assign]

    with pytest.raises(error):
        await ray_side.transport.deliver(receiver, header, payload)

    assert device.received == []
    ray_side.assert_unchanged(destination, before)


async def test_a_peer_published_through_cuda_ipc_is_written_by_offset(
    ray_side: TransportUnderTest, device: FakeDevice
) -> None:
    """A CUDA decode engine's regions are registered by `cuda_ipc` (IPC handles, no address): auto
    picks ray for it from another node, and the ray writer reaches it through its agent by offset."""
    source = ray_side.source(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    destination = ray_side.destination(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    allocation = destination.backing.regions[0].allocation
    assert allocation is not None
    handle = CudaIpcHandle(
        device_uuid="GPU-fake",
        handle=b"\x01" * 64,
        storage_size=allocation.numel(),
        storage_offset=0,
        ref_counter_handle=b"ref",
        ref_counter_offset=0,
        event_handle=b"",
        event_sync_required=False,
    )
    regions = tuple(
        msgspec.structs.replace(
            region, transport=TransportKind.CUDA_IPC, handle=msgspec.msgpack.encode(handle), address=0
        )
        for region in destination.info.regions
    )
    destination.info = msgspec.structs.replace(destination.info, regions=regions, node_id="node-b")
    candidates = [
        transport_class(kind) for kind in (TransportKind.CUDA_IPC, TransportKind.SHM, TransportKind.RAY)
    ]
    assert (
        choose_transport("auto", MemoryKind.CUDA, "node-a", destination.info, candidates) is TransportKind.RAY
    )
    local, remote = ray_side.scattered(16, 5)
    plan = ray_side.plan(source, destination, local, remote)
    before = ray_side.snapshot(destination)

    await ray_side.write(plan, source, destination)

    ray_side.assert_landed(plan, source, destination, before, local, remote)


async def test_a_cancelled_gpu_write_leaves_no_delivery_to_land_later(
    ray_side: TransportUnderTest, device: FakeDevice
) -> None:
    source = ray_side.source(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    destination = ray_side.destination(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    local, remote = ray_side.scattered(16, 6)
    plan = ray_side.plan(source, destination, local, remote)
    before = ray_side.snapshot(destination)
    gate = asyncio.Event()
    host = CountingHost(ray_side.peer(destination).host, gate)

    writing = asyncio.ensure_future(
        ray_side.transport.write(plan, source.backing, Peer(destination.info, host=host))
    )
    chunks = len(cuda_staging.chunk_ops(plan.ops, CHUNK_NBYTES))
    for _ in range(200):
        if host.started == chunks:
            break
        await asyncio.sleep(0)
    assert host.started == chunks, "the write did not submit every chunk before waiting for them"
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    gate.set()
    for _ in range(20):
        await asyncio.sleep(0)

    assert host.cancelled == host.ended == chunks
    assert device.received == []
    ray_side.assert_unchanged(destination, before)


async def test_a_refused_chunk_fails_the_write_with_the_receivers_error(
    ray_side: TransportUnderTest, device: FakeDevice
) -> None:
    source = ray_side.source(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    old = ray_side.destination(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    restarted = ray_side.destination(LAYOUT, backing=fake_gpu_backing(LAYOUT))
    local, remote = ray_side.scattered(16, 6)
    plan = ray_side.plan(source, old, local, remote)
    before = ray_side.snapshot(restarted)

    with pytest.raises(StaleIncarnationError) as raised:
        await ray_side.transport.write(plan, source.backing, ray_side.peer(restarted, info=old.info))

    assert type(raised.value) is StaleIncarnationError
    assert device.received == []
    ray_side.assert_unchanged(restarted, before)


# ---- the staged copies themselves, on the fake device ------------------------------------------


class _FakeEvent:
    """Stands in for torch.cuda.Event: copies on the fake device are over when queued."""

    def __init__(self) -> None:
        self.recorded = 0

    def record(self, stream: object = None) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _FakeSlots(PinnedSlots):
    def _new(self, capacity: int, device: torch.device) -> cuda_staging.PinnedSlot:
        return cuda_staging.PinnedSlot(torch.empty(capacity, dtype=torch.uint8), None, _FakeEvent())  # type: ignore[arg-type]

    def _new_staging(self, capacity: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(capacity, dtype=torch.uint8)


def _launch_copy(
    dst: torch.Tensor, src: torch.Tensor, dst_offsets: np.ndarray, src_offsets: np.ndarray, nbytes: np.ndarray
) -> None:
    """`cuda_ipc.ops.launch_copy`'s contract, on CPU tensors."""
    for target, source, count in zip(
        dst_offsets.tolist(), src_offsets.tolist(), nbytes.tolist(), strict=True
    ):
        assert 0 <= target <= dst.numel() - count and 0 <= source <= src.numel() - count
        dst[target : target + count] = src[source : source + count]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's streams and events, cuda_ipc's streams and copy kernel, replaced by CPU stand-ins:
    what `DeviceGathers` and `receive_payload` queue then runs at once on CPU tensors."""
    from kvray.transport.cuda_ipc import ops, streams

    async def wait_for_events(events: list[_FakeEvent], nbytes: int) -> None:
        assert all(event.recorded for event in events), "waited for an event never recorded"

    monkeypatch.setattr(streams, "copy_stream", lambda device: "copy stream")
    monkeypatch.setattr(streams, "follow_current", lambda device, stream, ready=None: None)
    monkeypatch.setattr(streams, "wait_for_events", wait_for_events)
    monkeypatch.setattr(ops, "launch_copy", _launch_copy)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "per-op"])
async def test_the_staged_copies_move_the_right_bytes(
    fake_cuda: None, monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    """The gather packs each op's source bytes in op order, the scatter puts them back where the
    ops say, across two regions, through device staging (kernel) or op by op."""
    monkeypatch.setattr(cuda_staging, "triton_available", lambda: kernel)
    rng = np.random.default_rng(3)
    sources = [torch.from_numpy(rng.integers(0, 256, 50_000, dtype=np.uint8)) for _ in range(2)]
    targets = [torch.zeros(60_000, dtype=torch.uint8) for _ in range(2)]
    count = 9  # more than PER_OP_COPIES: the kernel path, where Triton is there
    nbytes = rng.integers(1, 3000, count).astype(np.int64)
    local_offset = np.sort(rng.choice(40_000, count, replace=False)).astype(np.int64)
    remote_offset = np.arange(count, dtype=np.int64) * 5000 + 17
    regions = np.array([0, 1] * 4 + [1], dtype=np.int64)
    chunk = OpTable(regions, local_offset, regions[::-1].copy(), remote_offset, nbytes)
    slots = _FakeSlots()
    gathers = cuda_staging.DeviceGathers(sources, torch.device("cpu"), slots)

    gathered = gathers.start(chunk)
    await gathers.wait([gathered])
    payload = gathers.payload(gathered).copy()
    gathers.release(gathered)

    expected = np.concatenate(
        [
            sources[r].numpy()[o : o + n]
            for r, o, n in zip(regions.tolist(), local_offset.tolist(), nbytes.tolist(), strict=True)
        ]
    )
    assert np.array_equal(payload, expected)
    assert (gathered.slot.device is not None) == kernel
    await cuda_staging.receive_payload(targets, chunk.remote_region, remote_offset, nbytes, payload, slots)
    for r, o, n, start in zip(
        chunk.remote_region.tolist(),
        remote_offset.tolist(),
        nbytes.tolist(),
        packed_offsets(nbytes).tolist(),
        strict=True,
    ):
        assert np.array_equal(targets[r].numpy()[o : o + n], payload[start : start + n])
    written = sum(int((target != 0).sum()) for target in targets)
    assert written <= int(nbytes.sum())
    assert len(slots._free[torch.device("cpu")]) == 1, "the slot was not given back for reuse"
