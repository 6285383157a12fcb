"""GPUDirect RDMA probes on a real GPU (`kvray.transport.verbs.gpudirect.NodeGpuDirect`): the CUDA
driver's dma-buf attribute for every GPU, the GPU of a kvray CUDA backing's region, a dma-buf
descriptor exported for that region where the attribute says supported, and `kvray doctor`'s
GPUDirect verdict agreeing with those answers. Nothing here is faked; nothing is registered with
an RDMA device (the GPU machines have none: the registration paths run on the fake device,
tests/transport/test_verbs_gpudirect.py). Skipped without CUDA (CPU CI); run on a GPU machine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from kvray import doctor
from kvray.config import Settings
from kvray.errors import RegionError
from kvray.layout import mixed
from kvray.memory import Backing, MemoryKind
from kvray.transport.verbs.gpudirect import NodeGpuDirect, Readiness, check_page_aligned

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def node() -> NodeGpuDirect:
    return NodeGpuDirect()


@pytest.fixture
def backing() -> Iterator[Backing]:
    backing = Backing.allocate(mixed(32), MemoryKind.CUDA, device="cuda:0")
    yield backing
    backing.close()


def _is_dmabuf(fd: int) -> bool:
    """Whether `fd` is an open dma-buf descriptor (the kernel names its inode `dmabuf`)."""
    os.fstat(fd)  # raises on a descriptor that is not open
    return "dmabuf" in os.readlink(f"/proc/self/fd/{fd}")


def test_the_driver_answers_the_dmabuf_attribute_for_every_gpu(node: NodeGpuDirect) -> None:
    assert node.device_count() == torch.cuda.device_count()
    answers = [node.dmabuf_supported(device) for device in range(node.device_count())]
    assert all(isinstance(answer, bool) for answer in answers)
    print(
        f"dma-buf supported per GPU: {answers}; open kernel module: {node.open_kernel_module()}; "
        f"peer-memory module: {node.peer_memory_module()}"
    )


def test_a_cuda_backing_region_is_page_aligned_and_found_on_its_gpu(
    node: NodeGpuDirect, backing: Backing
) -> None:
    region = backing.regions[0]
    check_page_aligned(region.address, region.nbytes)
    assert node.device_of(region.address) == region.device.index == 0
    with pytest.raises(RegionError, match=r"does not know 0x[0-9a-f]+ as GPU memory"):
        node.device_of(torch.empty(4096, dtype=torch.uint8).data_ptr())


def test_a_cuda_backing_region_exports_a_dmabuf_where_the_driver_says_supported(
    node: NodeGpuDirect, backing: Backing
) -> None:
    region = backing.regions[0]
    device = node.device_of(region.address)
    if not node.dmabuf_supported(device):
        pytest.skip(f"GPU {device}'s driver reports no dma-buf support (CU_DEVICE_ATTRIBUTE 124)")
    fd = node.dmabuf_fd(region.address, region.nbytes)
    try:
        assert fd >= 0 and _is_dmabuf(fd)
    finally:
        os.close(fd)
    # Registration may run on a thread with no current CUDA context (an engine's event loop's).
    answers: list[tuple[int, int] | BaseException] = []

    def export() -> None:
        try:
            answers.append((node.device_of(region.address), node.dmabuf_fd(region.address, region.nbytes)))
        except BaseException as error:
            answers.append(error)

    thread = threading.Thread(target=export)
    thread.start()
    thread.join(60)
    (answer,) = answers
    if isinstance(answer, BaseException):
        raise answer
    found_on, fd = answer
    try:
        assert found_on == device and _is_dmabuf(fd)
    finally:
        os.close(fd)


def test_the_driver_refuses_a_dmabuf_for_a_range_that_is_not_page_aligned(
    node: NodeGpuDirect, backing: Backing
) -> None:
    region = backing.regions[0]
    if not node.dmabuf_supported(node.device_of(region.address)):
        pytest.skip("the driver reports no dma-buf support")
    with pytest.raises(RegionError, match="cuMemGetHandleForAddressRange"):
        node.dmabuf_fd(region.address + 64, 4096)


def test_doctor_gpudirect_verdict_agrees_with_the_driver(node: NodeGpuDirect) -> None:
    report = doctor.collect(Settings())
    gpudirect = report.gpudirect
    assert gpudirect is not None
    dmabuf = [node.dmabuf_supported(device) for device in range(torch.cuda.device_count())]
    assert [gpu.index for gpu in gpudirect.gpus] == list(range(len(dmabuf)))
    assert [gpu.dmabuf for gpu in gpudirect.gpus] == dmabuf
    assert gpudirect.open_kernel_module == node.open_kernel_module()
    assert gpudirect.peer_memory == node.peer_memory_module()
    verbs = report.verbs
    if verbs.import_error is not None or not verbs.devices:
        assert gpudirect.verdict is Readiness.NOT_READY
        assert gpudirect.reason is not None and "RDMA device" in gpudirect.reason
    elif all(dmabuf):
        assert gpudirect.verdict is Readiness.DMA_BUF
    elif gpudirect.peer_memory is not None:
        assert gpudirect.verdict is Readiness.PEER_MEMORY
    else:
        assert gpudirect.verdict is Readiness.NOT_READY
    lines = doctor.format_gpudirect(gpudirect)
    assert lines[0].startswith(f"  GPUDirect RDMA (GPU memory over verbs): {gpudirect.verdict.value}")
    assert len(lines) == 2 + len(dmabuf)
    print("\n".join(lines))
