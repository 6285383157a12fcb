"""GPUDirect RDMA for the `verbs` transport (the region step, for GPU memory): which way a GPU's
memory reaches the RDMA device, asked of the CUDA driver and the node's kernel modules.

Two ways, tried in order:

    dma-buf      the GPU reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (the NVIDIA open kernel
                 module); the driver exports the region as a dma-buf file descriptor and the
                 device registers that (`ibv_reg_dmabuf_mr`), addressed from the dma-buf's offset
    peer memory  a peer-memory kernel module (`nvidia_peermem`, or Mellanox's older `nv_peer_mem`)
                 is loaded; the device registers the GPU virtual address as it would CPU memory

Neither is a `RegionError` saying what to load, or to keep the backing on the CPU. Every question
goes through `GpuDirect`, one seam: `NodeGpuDirect` asks this node (libcuda through ctypes, /sys,
/proc); the tests fill it with a fake (tests/transport/fake_verbs.py `FakeGpuDirect`).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvray.errors import RegionError

#: CUdevice_attribute CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (CUDA 11.7+).
DMA_BUF_SUPPORTED = 124
#: CUpointer_attribute CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL.
POINTER_DEVICE_ORDINAL = 9
#: CUmemRangeHandleType CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD.
RANGE_HANDLE_DMA_BUF_FD = 1
_CUDA_SUCCESS = 0
_CUDA_ERROR_INVALID_VALUE = 1
_CUDA_ERROR_NO_DEVICE = 100
#: Peer-memory kernel modules, preferred first.
PEER_MEMORY_MODULES = ("nvidia_peermem", "nv_peer_mem")
#: What /proc/driver/nvidia/version says when the NVIDIA open kernel module is loaded.
OPEN_KERNEL_MODULE_MARK = "Open Kernel Module"
#: What to do when neither way is there, ending every such error.
_REMEDY = (
    "load the NVIDIA open kernel module (nvidia-open) for dma-buf or the nvidia_peermem module, or "
    "keep the KV backing on the CPU"
)


class GpuPath(enum.Enum):
    """How a GPU's memory is registered with the RDMA device."""

    DMA_BUF = "dma-buf"
    PEER_MEMORY = "peer memory"


class GpuDirect(Protocol):
    """What GPU memory registration asks of the node. Driver calls raise `RegionError` saying
    what failed; the module checks never raise."""

    def device_count(self) -> int:
        """GPUs the CUDA driver sees (0 where there is no GPU)."""
        ...

    def device_of(self, address: int) -> int:
        """The ordinal of the GPU whose memory `address` is."""
        ...

    def dmabuf_supported(self, device: int) -> bool:
        """Whether the driver can export GPU `device`'s memory as dma-buf."""
        ...

    def dmabuf_fd(self, address: int, nbytes: int) -> int:
        """A new dma-buf file descriptor for [address, address + nbytes) of GPU memory; the caller
        closes it."""
        ...

    def open_kernel_module(self) -> bool:
        """Whether the NVIDIA driver loaded here is the open kernel module."""
        ...

    def peer_memory_module(self) -> str | None:
        """The loaded peer-memory kernel module's name, or None."""
        ...


def host_page_size() -> int:
    return mmap.PAGESIZE


def check_page_aligned(address: int, nbytes: int) -> None:
    """RDMA devices and the driver's dma-buf export take whole host pages."""
    page = host_page_size()
    if address % page or nbytes % page:
        raise RegionError(
            f"GPU memory at {address:#x} of {nbytes} bytes is not aligned to the host page size "
            f"({page} bytes) in start and length, which RDMA registration needs; allocate the "
            "backing with kvray.Backing, or set gpu_alignment to a multiple of the page size",
            address=address,
            nbytes=nbytes,
            page_size=page,
        )


def choose_path(dmabuf: bool, peer_memory: str | None) -> GpuPath | None:
    """dma-buf where the GPU supports it, else peer memory where a module is loaded, else None."""
    if dmabuf:
        return GpuPath.DMA_BUF
    if peer_memory is not None:
        return GpuPath.PEER_MEMORY
    return None


def missing_support(devices: Sequence[int], *, open_kernel_module: bool) -> str:
    """Why the memory of these GPUs cannot be registered for RDMA (part of a sentence)."""
    who = f"GPU {devices[0]} has" if len(devices) == 1 else f"GPUs {', '.join(map(str, devices))} have"
    why = "" if open_kernel_module else " (the NVIDIA open kernel module is not loaded)"
    return (
        f"{who} no dma-buf support{why} and no peer-memory module "
        f"({', '.join(PEER_MEMORY_MODULES)}) is loaded"
    )


def gpu_path(gpudirect: GpuDirect, device: int) -> GpuPath:
    """How GPU `device`'s memory is registered for RDMA here; `RegionError` when it cannot be."""
    path = choose_path(gpudirect.dmabuf_supported(device), gpudirect.peer_memory_module())
    if path is None:
        reason = missing_support([device], open_kernel_module=gpudirect.open_kernel_module())
        raise RegionError(f"cannot register GPU memory for RDMA: {reason}; {_REMEDY}", device=device)
    return path


# ---- the node's readiness (`kvray doctor`) ------------------------------------------------------


class Readiness(enum.Enum):
    DMA_BUF = "ready through dma-buf"
    PEER_MEMORY = "ready through peer memory"
    NOT_READY = "not ready"


@dataclass(frozen=True)
class GpuReadiness:
    """One GPU: whether its driver exports dma-buf, and the way its memory would be registered."""

    index: int
    dmabuf: bool
    #: None: neither way is there.
    path: GpuPath | None


@dataclass(frozen=True)
class GpuDirectReport:
    """Whether GPU memory on this node can be registered for RDMA, and why not."""

    verdict: Readiness
    #: Why not, in one sentence (None when ready).
    reason: str | None
    gpus: tuple[GpuReadiness, ...] = ()
    open_kernel_module: bool = False
    peer_memory: str | None = None


def readiness(gpudirect: GpuDirect, rdma_missing: str | None) -> GpuDirectReport:
    """The node's GPUDirect RDMA readiness. `rdma_missing`: why there is no usable RDMA device
    here (None when there is one)."""
    open_module = gpudirect.open_kernel_module()
    peer_memory = gpudirect.peer_memory_module()
    missing: list[str] = []
    gpus: list[GpuReadiness] = []
    try:
        for index in range(gpudirect.device_count()):
            dmabuf = gpudirect.dmabuf_supported(index)
            gpus.append(GpuReadiness(index, dmabuf, choose_path(dmabuf, peer_memory)))
        if not gpus:
            missing.append("the CUDA driver sees no GPU")
    except RegionError as error:
        missing.append(str(error))
    if rdma_missing is not None:
        missing.append(rdma_missing)
    unable = [gpu.index for gpu in gpus if gpu.path is None]
    if unable:
        # Last, so that the remedy ends the sentence.
        missing.append(f"{missing_support(unable, open_kernel_module=open_module)}: {_REMEDY}")
    if missing:
        verdict, reason = Readiness.NOT_READY, "; ".join(missing)
    elif any(gpu.path is GpuPath.PEER_MEMORY for gpu in gpus):
        verdict, reason = Readiness.PEER_MEMORY, None
    else:
        verdict, reason = Readiness.DMA_BUF, None
    return GpuDirectReport(verdict, reason, tuple(gpus), open_module, peer_memory)


# ---- this node ----------------------------------------------------------------------------------


class NodeGpuDirect:
    """`GpuDirect` on this node: libcuda (loaded at the first driver question) and the kernel's
    /sys and /proc under `root`."""

    def __init__(self, root: str = "/") -> None:
        self._root = root
        self._libcuda: ctypes.CDLL | None = None
        self._no_device = False

    def _driver(self) -> ctypes.CDLL:
        if self._libcuda is None:
            try:
                libcuda = ctypes.CDLL("libcuda.so.1")
            except OSError as error:
                raise RegionError(
                    f"the CUDA driver library libcuda.so.1 does not load ({error}); install the "
                    "NVIDIA driver, or keep the KV backing on the CPU"
                ) from error
            result = libcuda.cuInit(ctypes.c_uint(0))
            self._no_device = result == _CUDA_ERROR_NO_DEVICE
            if result not in (_CUDA_SUCCESS, _CUDA_ERROR_NO_DEVICE):
                raise RegionError(
                    f"the CUDA driver does not start (cuInit {_error_name(libcuda, result)}); check "
                    "it with nvidia-smi, or keep the KV backing on the CPU"
                )
            self._libcuda = libcuda
        return self._libcuda

    def device_count(self) -> int:
        libcuda = self._driver()
        if self._no_device:
            return 0
        count = ctypes.c_int(0)
        _check(libcuda, libcuda.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        return count.value

    def device_of(self, address: int) -> int:
        libcuda = self._driver()
        ordinal = ctypes.c_int(-1)
        result = libcuda.cuPointerGetAttribute(
            ctypes.byref(ordinal), ctypes.c_int(POINTER_DEVICE_ORDINAL), ctypes.c_uint64(address)
        )
        if result != _CUDA_SUCCESS:
            raise RegionError(
                f"the CUDA driver does not know {address:#x} as GPU memory (cuPointerGetAttribute "
                f"{_error_name(libcuda, result)}); register only memory of a CUDA backing",
                address=address,
            )
        return ordinal.value

    def _device_handle(self, device: int) -> ctypes.c_int:
        libcuda = self._driver()
        handle = ctypes.c_int(-1)
        _check(libcuda, libcuda.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)), "cuDeviceGet")
        return handle

    @contextlib.contextmanager
    def _primary_context(self, device: int) -> Iterator[None]:
        """GPU `device`'s primary context (the one torch allocates in) current on this thread for
        the block: the driver exports a range only in the context that owns it, and the thread
        registering memory (an engine's event-loop thread, an executor's) may have none."""
        libcuda = self._driver()
        handle = self._device_handle(device)
        context = ctypes.c_void_p()
        _check(
            libcuda,
            libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
            "cuDevicePrimaryCtxRetain",
        )
        try:
            _check(libcuda, libcuda.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
            try:
                yield
            finally:
                libcuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            libcuda.cuDevicePrimaryCtxRelease_v2(handle)

    def dmabuf_supported(self, device: int) -> bool:
        libcuda = self._driver()
        handle = self._device_handle(device)
        value = ctypes.c_int(0)
        result = libcuda.cuDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(DMA_BUF_SUPPORTED), handle)
        if result == _CUDA_ERROR_INVALID_VALUE:
            return False  # a driver older than CUDA 11.7 knows no such attribute
        _check(libcuda, result, "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)")
        return bool(value.value)

    def dmabuf_fd(self, address: int, nbytes: int) -> int:
        libcuda = self._driver()
        try:
            get_handle = libcuda.cuMemGetHandleForAddressRange
        except AttributeError as error:
            raise RegionError(
                "the CUDA driver here has no cuMemGetHandleForAddressRange (dma-buf export); use a "
                "CUDA 11.7+ driver, or keep the KV backing on the CPU"
            ) from error
        fd = ctypes.c_int(-1)
        with self._primary_context(self.device_of(address)):
            result = get_handle(
                ctypes.byref(fd),
                ctypes.c_uint64(address),
                ctypes.c_size_t(nbytes),
                ctypes.c_int(RANGE_HANDLE_DMA_BUF_FD),
                ctypes.c_ulonglong(0),
            )
        if result != _CUDA_SUCCESS:
            raise RegionError(
                f"the CUDA driver refused a dma-buf for GPU memory at {address:#x} (+{nbytes}): "
                f"cuMemGetHandleForAddressRange {_error_name(libcuda, result)}; {_REMEDY}",
                address=address,
                nbytes=nbytes,
            )
        return fd.value

    def open_kernel_module(self) -> bool:
        try:
            with open(os.path.join(self._root, "proc/driver/nvidia/version")) as file:
                return OPEN_KERNEL_MODULE_MARK in file.read()
        except OSError:
            return False

    def peer_memory_module(self) -> str | None:
        for name in PEER_MEMORY_MODULES:
            if os.path.isdir(os.path.join(self._root, "sys/module", name)):
                return name
        return None


def _error_name(libcuda: ctypes.CDLL, result: int) -> str:
    name = ctypes.c_char_p()
    if libcuda.cuGetErrorName(ctypes.c_int(result), ctypes.byref(name)) == _CUDA_SUCCESS and name.value:
        return f"{name.value.decode()} ({result})"
    return f"CUresult {result}"


def _check(libcuda: ctypes.CDLL, result: int, call: str) -> None:
    if result != _CUDA_SUCCESS:
        raise RegionError(
            f"the CUDA driver failed {call}: {_error_name(libcuda, result)}; check the GPU with "
            "nvidia-smi, or keep the KV backing on the CPU"
        )
