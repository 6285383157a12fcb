"""GPU memory through the `verbs` transport, on the FAKE RDMA device and a FAKE GPU side
(tests/transport/fake_verbs.py `FakeDmaBufMR`, `FakeGpuDirect`): no GPU and no NIC here. A region
labelled CUDA over CPU memory stands for GPU memory.

dma-buf where the GPU supports it (REMOTE_WRITE | LOCAL_WRITE for a decode engine, no access for
a prefill engine, the descriptor closed once registered, the region addressed from the dma-buf's
offset, a planned write landing in the right bytes); the GPU address through a peer-memory module
where it does not; else a RegionError, with nothing left registered; a misaligned region refused
before the driver is asked anything. On a real GPU: tests/gpu/test_gpudirect.py."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import msgspec
import pytest
import torch
from fake_verbs import ENUMS, FakeDmaBufMR, FakeGpuDirect, FakeMR
from test_contract import ready_layout

from kvray.errors import RegionError, WriteFailedError
from kvray.layout import BlockOrder, KVLayout
from kvray.memory import Backing, MemoryKind, RegionSpan
from kvray.transport.verbs import VerbsTransport

if TYPE_CHECKING:
    from conftest import Engine, TransportUnderTest

ALIGNMENT = 4096
DECODE_ACCESS = ENUMS.IBV_ACCESS_REMOTE_WRITE | ENUMS.IBV_ACCESS_LOCAL_WRITE


@pytest.fixture
def fake(verbs_fake: TransportUnderTest) -> TransportUnderTest:
    return verbs_fake


def gpu_backing(layout: KVLayout) -> Backing:
    """A backing whose one region says CUDA, over CPU memory (what the fake GPU side exports)."""
    buffer = torch.empty(layout.nbytes + 2 * ALIGNMENT, dtype=torch.uint8)
    return Backing.in_buffer(layout, buffer, alignment=ALIGNMENT, kind=MemoryKind.CUDA)


def gpudirect(fake: TransportUnderTest) -> FakeGpuDirect:
    side: FakeGpuDirect = fake.fabric.gpudirect
    return side


def transport(fake: TransportUnderTest) -> VerbsTransport:
    assert isinstance(fake.transport, VerbsTransport)
    return fake.transport


def registered_keys(fake: TransportUnderTest) -> set[int]:
    """The keys of every memory region on the fake device (the device opened first)."""
    assert transport(fake).device is not None
    return set(fake.fabric.mrs)


def mrs_of(fake: TransportUnderTest, engine: Engine) -> list[object]:
    registration = transport(fake).registrations.get(engine.backing)
    assert registration is not None
    return registration.mrs


async def write_and_check(fake: TransportUnderTest, source: Engine, destination: Engine) -> None:
    layout = source.backing.layout
    local, remote = fake.scattered(layout.num_blocks, 7)
    plan = fake.plan(source, destination, local, remote)
    before = fake.snapshot(destination)
    await fake.write(plan, source, destination)
    fake.assert_landed(plan, source, destination, before, local, remote)


async def test_gpu_memory_registers_as_dmabuf_and_a_planned_write_lands(fake: TransportUnderTest) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = fake.source(layout, backing=gpu_backing(layout))
    destination = fake.destination(layout, backing=gpu_backing(layout))

    (decode_mr,) = mrs_of(fake, destination)
    (prefill_mr,) = mrs_of(fake, source)
    assert isinstance(decode_mr, FakeDmaBufMR) and decode_mr.access == DECODE_ACCESS
    assert isinstance(prefill_mr, FakeDmaBufMR) and prefill_mr.access == 0
    region = destination.backing.regions[0]
    assert (decode_mr.host, decode_mr.length) == (region.address, region.nbytes)
    assert gpudirect(fake).descriptors_closed() == [True, True], "a dma-buf descriptor stayed open"
    # What a writer is told: the region starts at the dma-buf MR's iova (its offset, 0).
    registration = transport(fake).registrations.get(destination.backing)
    assert registration is not None and registration.addresses == [0]
    (key,) = registration.remote(destination.backing)
    assert (key.address, key.length, key.rkey) == (0, region.nbytes, decode_mr.rkey)
    assert destination.info.regions[0].key == decode_mr.rkey

    # The allocation's slack around the region is canary: only the planned bytes change.
    await write_and_check(fake, source, destination)


async def test_a_dmabuf_region_named_by_its_virtual_address_takes_no_write(fake: TransportUnderTest) -> None:
    """The published address is the one the device knows: the GPU's virtual address is outside
    a dma-buf MR's address space, and the device refuses a write to it."""
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = fake.source(layout)
    destination = fake.destination(layout, backing=gpu_backing(layout))
    local, remote = fake.scattered(layout.num_blocks, 3)
    plan = fake.plan(source, destination, local, remote)
    await fake.write(plan, source, destination)
    writer = (source.engine_id, source.incarnation)
    connection = transport(fake)._connections.get("decode-0", destination.incarnation, writer)
    assert connection is not None
    connection.regions = tuple(
        msgspec.structs.replace(key, address=destination.backing.regions[0].address)
        for key in connection.regions
    )
    fake.refill(source)
    before = fake.snapshot(destination)

    with pytest.raises(WriteFailedError, match="IBV_WC_REM_ACCESS_ERR"):
        await fake.write(plan, source, destination)

    fake.assert_unchanged(destination, before)


async def test_without_dmabuf_a_peer_memory_module_registers_the_gpu_address(
    fake: TransportUnderTest,
) -> None:
    side = gpudirect(fake)
    side.dmabuf, side.peer_memory = (False,), "nvidia_peermem"
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = fake.source(layout, backing=gpu_backing(layout))
    destination = fake.destination(layout, backing=gpu_backing(layout))

    for engine, access in ((destination, DECODE_ACCESS), (source, 0)):
        (mr,) = mrs_of(fake, engine)
        assert type(mr) is FakeMR and mr.access == access
        assert (mr.buf, mr.length) == (engine.backing.regions[0].address, engine.backing.regions[0].nbytes)
    assert "dmabuf_fd" not in side.calls
    registration = transport(fake).registrations.get(destination.backing)
    assert registration is not None
    assert registration.addresses == [destination.backing.regions[0].address]
    await write_and_check(fake, source, destination)


async def test_a_device_refusing_dmabuf_falls_back_to_peer_memory_only_where_loaded(
    fake: TransportUnderTest,
) -> None:
    """The GPU exports dma-buf but the device will not register it (an old kernel, a NIC driver
    without dma-buf): peer memory where a module is loaded, else a RegionError; the descriptor
    is closed either way."""
    fake.fabric.dmabuf = False
    side = gpudirect(fake)
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    before = registered_keys(fake)
    backing = gpu_backing(layout)
    fake.backings.append(backing)

    with pytest.raises(RegionError, match=r"refused a dma-buf memory region .* nvidia_peermem"):
        transport(fake).register(backing, "decode-0", 1, remote_writable=True)
    assert set(fake.fabric.mrs) == before and transport(fake).registrations.get(backing) is None

    side.peer_memory = "nv_peer_mem"
    destination = fake.destination(layout, backing=backing)
    (mr,) = mrs_of(fake, destination)
    assert type(mr) is FakeMR and mr.buf == backing.regions[0].address
    assert side.descriptors_closed() == [True, True]
    await write_and_check(fake, fake.source(layout), destination)


@pytest.mark.parametrize("open_module", [True, False])
def test_neither_dmabuf_nor_peer_memory_is_a_region_error_and_registers_nothing(
    fake: TransportUnderTest, open_module: bool
) -> None:
    side = gpudirect(fake)
    side.dmabuf, side.open_module = (False,), open_module
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    before = registered_keys(fake)
    backing = gpu_backing(layout)
    fake.backings.append(backing)

    with pytest.raises(RegionError) as raised:
        transport(fake).register(backing, "decode-0", 1, remote_writable=True)

    message = str(raised.value)
    assert "GPU 0 has no dma-buf support" in message and "nvidia_peermem" in message
    assert "keep the KV backing on the CPU" in message and raised.value.device == 0
    assert ("open kernel module is not loaded" in message) is not open_module
    assert set(fake.fabric.mrs) == before and transport(fake).registrations.get(backing) is None
    assert "dmabuf_fd" not in side.calls and side.exported == []


@pytest.mark.parametrize("misaligned", ["start", "length"])
def test_a_misaligned_gpu_region_is_refused_before_the_driver_is_asked(
    fake: TransportUnderTest, misaligned: str
) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    aligned = gpu_backing(layout)
    fake.backings.append(aligned)
    region = aligned.regions[0]
    span = region.span
    if misaligned == "start":
        start, nbytes = span.start + 64, span.nbytes - ALIGNMENT
    else:
        start, nbytes = span.start, 2 * ALIGNMENT + 64
    shifted = dataclasses.replace(region, span=RegionSpan(start, nbytes, span.alloc_start, span.alloc_nbytes))
    backing = Backing(layout, MemoryKind.CUDA, ALIGNMENT, [shifted], aligned.placements, aligned.views)
    before = registered_keys(fake)

    with pytest.raises(RegionError, match="not aligned to the host page size") as raised:
        transport(fake).register(backing, "decode-0", 1, remote_writable=True)

    assert f"{start:#x}" in str(raised.value) and f"{nbytes} bytes" in str(raised.value)
    assert (raised.value.address, raised.value.nbytes) == (start, nbytes)
    assert gpudirect(fake).calls == [], "the driver was asked before the alignment was checked"
    assert set(fake.fabric.mrs) == before


def test_a_failure_on_a_later_region_leaves_no_region_registered(fake: TransportUnderTest) -> None:
    """Two GPU regions; the driver refuses the second one's dma-buf after the first one's MR is
    registered: the first is deregistered again and its descriptor closed."""
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    first, second = gpu_backing(layout), gpu_backing(layout)
    fake.backings += [first, second]
    regions = [first.regions[0], dataclasses.replace(second.regions[0], index=1)]
    backing = Backing(layout, MemoryKind.CUDA, ALIGNMENT, regions, first.placements, first.views)
    gpudirect(fake).refused.add(regions[1].address)
    before = registered_keys(fake)

    with pytest.raises(RegionError, match="refused a dma-buf"):
        transport(fake).register(backing, "decode-0", 1, remote_writable=True)

    assert gpudirect(fake).calls.count("dmabuf_fd") == 2
    assert set(fake.fabric.mrs) == before and transport(fake).registrations.get(backing) is None
    assert gpudirect(fake).descriptors_closed() == [True]
