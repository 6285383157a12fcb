"""KV integrity on GPU backings over `cuda_ipc`, prefill and decode agents in two processes (no
Ray): at the defaults every request is checked, the copy kernel hashing what it moves against the
digest the writer's GPU took of its blocks (`kvray.content`), and a request whose bytes were
corrupted on the way (`ByteFlipper`) or stored elsewhere by the kernel under a correct plan
(`executor_offset_bug`) fails with `KVIntegrityError`; the next, intact, is taken. The sampled
backstop (`wsum64` on the device) equals the host's. Also what the slow check costs here
(printed, not asserted: timings belong in benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from kvray.layout import KVLayout, mixed
from kvray.memory import Backing, MemoryKind
from kvray.wire import Reservation, Role, decode_engine_info, encode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LOCAL_BLOCKS = [3, 4, 5, 9, 17]
REMOTE_BLOCKS = [20, 21, 22, 0, 6]


def _decode(conn: Connection, layout: KVLayout, requests: int) -> None:
    asyncio.run(_decode_agent(conn, layout, requests))


async def _decode_agent(conn: Connection, layout: KVLayout, requests: int) -> None:
    from kvray.agent import KVAgent
    from kvray.config import Settings
    from kvray.errors import KVIntegrityError

    torch.cuda.set_device(0)
    backing = Backing.allocate(layout, MemoryKind.CUDA, device="cuda:0")
    agent = KVAgent("decode", Role.DECODE, backing=backing, settings=Settings(), use_coordinator=False)
    info = await agent.start()
    conn.send(encode(info))
    for index in range(requests):
        request_id = f"req-{index}"
        reservation = agent.expect(request_id, REMOTE_BLOCKS)
        conn.send(msgspec.msgpack.encode(reservation))
        try:
            await agent.wait_for_kv(request_id, timeout=60)
            conn.send(("ok", []))
        except KVIntegrityError as error:
            conn.send(("refused", list(error.facts["layers"])))
        await agent.release(request_id)
    conn.send(dict(agent.stats))
    conn.recv()
    await agent.close()


@pytest.fixture
def decode_process(request: pytest.FixtureRequest) -> Any:
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    layout = mixed(32)
    requests = getattr(request, "param", 3)
    process = context.Process(target=_decode, args=(child, layout, requests))
    process.start()
    assert parent.poll(120), "the decode process did not publish its engine info"
    yield parent, decode_engine_info(parent.recv())
    with contextlib.suppress(BrokenPipeError, OSError):
        parent.send("done")
    process.join(60)
    if process.is_alive():
        process.kill()


@pytest.mark.parametrize("zero", [False, True], ids=["flipped-bit", "zeroed-block"])
def test_cuda_ipc_pushes_are_checked_and_a_flipped_byte_is_caught(decode_process: Any, zero: bool) -> None:
    from kvray.agent import KVAgent
    from kvray.faults import ByteFlipper
    from kvray.wire import TransportKind

    conn, info = decode_process
    source = Backing.allocate(info.layout, MemoryKind.CUDA, device="cuda:0")
    generator = torch.Generator(device="cuda:0").manual_seed(5)
    region = source.regions[0].tensor
    region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8, device="cuda:0", generator=generator))
    flipper = ByteFlipper(every=1 << 30, zero=zero)
    before = region.cpu().numpy().copy()

    async def push(flip: bool) -> tuple[Any, float]:
        agent = KVAgent(
            "prefill", Role.PREFILL, backing=source, use_coordinator=False, transport_hook=flipper
        )
        await agent.start()
        agent.add_peer(info)
        reservation = msgspec.msgpack.decode(conn.recv(), type=Reservation)
        flipper.every = 1 if flip else 1 << 30
        started = time.perf_counter()
        result = await agent.push(reservation, LOCAL_BLOCKS)
        seconds = time.perf_counter() - started
        await agent.close()
        return result, seconds

    clean, _ = asyncio.run(push(False))
    assert clean.transport is TransportKind.CUDA_IPC
    assert conn.recv() == ("ok", [])
    asyncio.run(push(True))
    verdict, layers = conn.recv()
    # The copy's digest covers the whole push: the error names every layer it wrote.
    assert verdict == "refused" and {layer for _, layer in flipper.flipped} <= set(layers), (verdict, layers)
    again, seconds = asyncio.run(push(False))
    assert conn.recv() == ("ok", [])
    stats = conn.recv()
    assert stats["integrity_checks_ok"] == 2 and stats["integrity_checks_mismatch"] == 1
    # The writer's memory is as it was.
    assert np.array_equal(region.cpu().numpy(), before)
    print(
        f"\ncuda_ipc push of {again.nbytes / 2**20:.2f} MiB with the integrity check: {seconds * 1e3:.2f} ms"
    )


@pytest.mark.parametrize("decode_process", [4], indirect=True)
def test_a_kernel_storing_elsewhere_than_its_correct_plan_is_refused(decode_process: Any) -> None:
    """`kvray.faults.executor_offset_bug` on the GPU: the plan is right, the row kernel stores
    the last block pair over the one before it; the placement digest it reports says so and
    the decode side refuses the request, replayed graph or launched kernel alike."""
    from kvray.agent import KVAgent
    from kvray.faults import executor_offset_bug

    conn, info = decode_process
    source = Backing.allocate(info.layout, MemoryKind.CUDA, device="cuda:0")
    region = source.regions[0].tensor
    region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8, device="cuda:0"))

    async def push(faulty: bool) -> None:
        agent = KVAgent("prefill", Role.PREFILL, backing=source, use_coordinator=False)
        await agent.start()
        agent.add_peer(info)
        reservation = msgspec.msgpack.decode(conn.recv(), type=Reservation)
        if faulty:
            with executor_offset_bug():
                await agent.push(reservation, LOCAL_BLOCKS)
        else:
            await agent.push(reservation, LOCAL_BLOCKS)
        await agent.close()

    verdicts = []
    for faulty in (False, True, True, False):
        asyncio.run(push(faulty))
        verdicts.append(conn.recv()[0])
    assert verdicts == ["ok", "refused", "refused", "ok"]
    stats = conn.recv()
    assert stats["integrity_checks_ok"] == 2


@pytest.mark.parametrize("decode_process", [4], indirect=True)
def test_digests_held_on_the_gpu_check_the_push_and_a_block_written_after_fails_closed(
    decode_process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hold_digests` on a GPU backing: the block kernel hashes the held blocks on the GPU, and
    the push checks its copy against those sums without hashing its source again (the
    writer's `reference` is never called). Used once; a block written after the hold (without
    holding again) fails the request; a hold given back (`forget_digests`) checks nothing."""
    from kvray.agent import KVAgent
    from kvray.transport.cuda_ipc import CudaIpcTransport

    references = []
    reference = CudaIpcTransport.reference

    async def counted(self: Any, *args: Any, **kwargs: Any) -> int:
        references.append(1)
        return await reference(self, *args, **kwargs)

    monkeypatch.setattr(CudaIpcTransport, "reference", counted)
    # What each push's notice said, for the failure message.
    from kvray.notice import NoticeSet

    notices: list[dict[str, Any]] = []
    send = NoticeSet.send

    async def recorded(self: Any, peer: Any, notice: Any, **kwargs: Any) -> None:
        fields = ("request_id", "content", "reference", "checksum", "landed")
        notices.append({name: getattr(notice, name, None) for name in fields})
        await send(self, peer, notice, **kwargs)

    monkeypatch.setattr(NoticeSet, "send", recorded)
    conn, info = decode_process
    source = Backing.allocate(info.layout, MemoryKind.CUDA, device="cuda:0")
    region = source.regions[0].tensor
    region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8, device="cuda:0"))
    layer = info.layout.layer_names[1]
    view = source.view(layer)

    async def push(step: str) -> int:
        agent = KVAgent("prefill", Role.PREFILL, backing=source, use_coordinator=False)
        await agent.start()
        agent.add_peer(info)
        reservation = msgspec.msgpack.decode(conn.recv(), type=Reservation)
        if step in ("held", "stale", "forgotten"):
            await agent.hold_digests(LOCAL_BLOCKS)
        if step == "stale":
            view[:, LOCAL_BLOCKS[2]].view(torch.uint8).bitwise_not_()
        if step == "forgotten":
            agent.forget_digests(LOCAL_BLOCKS)
            view[:, LOCAL_BLOCKS[2]].view(torch.uint8).bitwise_not_()
        before = len(references)
        await agent.push(reservation, LOCAL_BLOCKS)
        await agent.close()
        return len(references) - before

    hashed = {}
    verdicts = []
    for step in ("held", "stale", "forgotten", "unheld"):
        hashed[step] = asyncio.run(push(step))
        verdicts.append(conn.recv()[0])
    assert verdicts == ["ok", "refused", "ok", "ok"], notices
    assert hashed == {"held": 0, "stale": 0, "forgotten": 1, "unheld": 1}
    stats = conn.recv()
    assert stats["integrity_checks_ok"] == 3 and stats["integrity_checks_mismatch"] == 1


@pytest.mark.parametrize("length", [1, 4099, 1 << 20, (64 << 20) + 3])
def test_the_gpu_checksum_equals_the_host_one_to_the_bit(length: int) -> None:
    """`wsum64` by reduction kernels on the GPU equals numpy's over the same bytes (large
    streams included, where the sums wrap mod 2**64), and a flipped bit changes it."""
    from kvray.integrity import WeightedSum, wsum64

    generator = torch.Generator(device="cuda:0").manual_seed(length)
    data = torch.randint(0, 256, (length,), dtype=torch.uint8, device="cuda:0", generator=generator)
    host = WeightedSum()
    host.update(data.cpu().numpy())
    on_gpu = wsum64(data)
    assert on_gpu == host.value()
    data[length // 2] ^= 0x10
    assert wsum64(data) != on_gpu


def test_a_gpu_writer_sends_the_gpu_checksum_and_either_memory_checks_either() -> None:
    """A writer over GPU memory names `wsum64` (summed on the device); a decode engine in host
    memory computes the same value, and a GPU engine computes a host writer's XXH3 alike."""
    from kvray.integrity import WSUM64, XXH3_64, DeviceRegions, HostRegions, Pieces, regions_of

    layout = mixed(8)
    backing = Backing.allocate(layout, MemoryKind.CUDA, device="cuda:0")
    region = backing.regions[0].tensor
    region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8, device="cuda:0"))
    regions = regions_of(backing)
    assert isinstance(regions, DeviceRegions) and regions.algorithm == WSUM64
    placement = next(iter(backing.placements.values()))
    pieces = Pieces(
        region=np.zeros(3, dtype=np.int64),
        offset=np.array(
            [placement.offset + 3 * placement.block_stride, placement.offset, 100], dtype=np.int64
        ),
        nbytes=np.array([placement.block_stride, 4096, 77], dtype=np.int64),
    )
    host = HostRegions([region.cpu().numpy()])
    for algorithm in (WSUM64, XXH3_64):
        assert regions.digest(pieces, algorithm) == host.digest(pieces, algorithm), algorithm


def test_what_the_gpu_checksum_costs() -> None:
    """Printed, not asserted: `wsum64` of 64 MiB on the device against copying it to the host
    and hashing it with XXH3 there (the other way a GPU engine could check)."""
    import xxhash

    from kvray.integrity import wsum64

    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda:0")
    timings: dict[str, list[float]] = {"wsum64 on the GPU": [], "copy to host + xxh3": []}
    for _ in range(7):
        torch.cuda.synchronize()
        started = time.perf_counter()
        wsum64(data)
        timings["wsum64 on the GPU"].append(time.perf_counter() - started)
        started = time.perf_counter()
        xxhash.xxh3_64_intdigest(data.cpu().numpy().data)
        timings["copy to host + xxh3"].append(time.perf_counter() - started)
    for name, seconds in timings.items():
        median = sorted(seconds)[len(seconds) // 2]
        print(
            f"\n{name}: 64 MiB in {median * 1e3:.2f} ms (median of 7), {(64 << 20) / median / 1e9:.1f} GB/s"
        )


def test_the_landed_digest_on_the_gpu_equals_the_hosts() -> None:
    """The landed digest (`kvray.content.landed_digest`: what a writer whose copy does not hash,
    GPU KV over `ray` or `verbs`, sends; what the decode side reads after the last write) taken
    on the GPU by the op kernel, on the writer's side (its blocks, weighed as at the places they
    go) and on the decode side (the bytes where they landed), equals the host's to the bit; a
    flipped byte where they landed changes it."""
    from kvray.content import Stretches, landed_digest, stretch_rows
    from kvray.transport.cuda_ipc.ops import landed_digest as device_landed_digest
    from kvray.wire import TransportKind

    layout = mixed(32)
    writer = Backing.allocate(layout, MemoryKind.CUDA, device="cuda:0")
    decode = Backing.allocate(layout, MemoryKind.CUDA, device="cuda:0")
    for backing in (writer, decode):
        region = backing.regions[0].tensor
        region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8, device="cuda:0"))
    descriptors = decode.region_descriptors("d", 1, TransportKind.RAY, remote_writable=True)
    info = decode.engine_info("d", 1, Role.DECODE, "node", descriptors)
    local, remote = np.array(LOCAL_BLOCKS, dtype=np.int64), np.array(REMOTE_BLOCKS, dtype=np.int64)
    rows = stretch_rows(layout, writer.placements, info.layout, info.placement, layout.layer_names)
    stretches = Stretches(rows, local, remote)
    found = stretches.expanded
    writer_tensors = [region.tensor for region in writer.regions]
    on_gpu = asyncio.run(
        device_landed_digest(
            writer_tensors, found.src_region, found.src_start, found.dst_region, found.dst_start, found.nbytes
        )
    )
    assert on_gpu == stretches.landed([tensor.cpu().numpy() for tensor in writer_tensors])
    # The bytes where they land, then the decode side's reading of them.
    target = decode.regions[0].tensor
    moves = zip(found.src_start.tolist(), found.dst_start.tolist(), found.nbytes.tolist(), strict=True)
    for source, at, nbytes in moves:
        target[at : at + nbytes].copy_(writer_tensors[0][source : source + nbytes])
    decode_tensors = [region.tensor for region in decode.regions]

    def read() -> tuple[int, int]:
        device = asyncio.run(
            device_landed_digest(
                decode_tensors,
                found.dst_region,
                found.dst_start,
                found.dst_region,
                found.dst_start,
                found.nbytes,
            )
        )
        host = landed_digest(
            [tensor.cpu().numpy() for tensor in decode_tensors],
            found.dst_region,
            found.dst_start,
            found.nbytes,
        )
        return device, host

    assert read() == (on_gpu, on_gpu)
    at = int(found.dst_start[len(found.dst_start) // 2])
    target[at] ^= 0x20
    device, host = read()
    assert device == host != on_gpu
