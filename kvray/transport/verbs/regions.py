"""Memory registration of the `verbs` transport (the region step, for RDMA): each region of a
backing becomes one memory region of the device, deregistered when the backing is gone."""

from __future__ import annotations

import contextlib
import ctypes
import os
import weakref
from dataclasses import dataclass
from typing import Any

from kvray.errors import RegionError
from kvray.memory import Backing, MemoryKind
from kvray.transport.verbs.device import Device
from kvray.transport.verbs.requests import RegisteredRegion
from kvray.wire import VerbsRegionKey


@dataclass
class Registration:
    """The memory regions of one backing (one per region of it)."""

    backing: weakref.ReferenceType[Backing]
    mrs: list[Any]
    #: Per region: where the MR's address space puts the region's first byte.
    addresses: list[int]
    remote_writable: bool

    def local(self, backing: Backing) -> list[RegisteredRegion]:
        """The regions as a local gather names them (lkeys)."""
        return [
            RegisteredRegion(address, region.nbytes, int(mr.lkey))
            for address, region, mr in zip(self.addresses, backing.regions, self.mrs, strict=True)
        ]

    def remote(self, backing: Backing) -> tuple[VerbsRegionKey, ...]:
        """The regions as a writer on another node names them (rkeys)."""
        return tuple(
            VerbsRegionKey(index=index, address=address, length=region.nbytes, rkey=int(mr.rkey))
            for index, (address, region, mr) in enumerate(
                zip(self.addresses, backing.regions, self.mrs, strict=True)
            )
        )

    def close(self, errors: tuple[type[BaseException], ...]) -> None:
        for mr in self.mrs:
            with contextlib.suppress(*errors):
                mr.close()
        self.mrs.clear()


class Registrations:
    """The registered backings of one device, by backing."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._by_backing: dict[int, Registration] = {}

    def get(self, backing: Backing) -> Registration | None:
        registration = self._by_backing.get(id(backing))
        if registration is None or registration.backing() is not backing or not registration.mrs:
            return None
        return registration

    def of(self, backing: Backing, *, remote_writable: bool) -> Registration:
        """The backing's memory regions, registered now if they are not yet: REMOTE_WRITE |
        LOCAL_WRITE for a decode engine's, no access flag for a prefill engine's."""
        existing = self.get(backing)
        if existing is not None:
            if remote_writable and not existing.remote_writable:
                raise RegionError(
                    "this backing is registered for RDMA as local-only (a prefill engine's); it "
                    "cannot also take remote writes"
                )
            return existing
        if backing.closed:
            raise RegionError("cannot register a closed backing for RDMA")
        device = self._device
        api = device.api
        enums = api.enums
        access = enums.IBV_ACCESS_REMOTE_WRITE | enums.IBV_ACCESS_LOCAL_WRITE if remote_writable else 0
        key = id(backing)
        registration = Registration(weakref.ref(backing, lambda _: self._drop(key)), [], [], remote_writable)
        try:
            for region in backing.regions:
                if region.kind is MemoryKind.CUDA:
                    fd = _cuda_dmabuf_fd(region.address, region.nbytes)
                    try:
                        mr = api.DmaBufMR(device.pd, region.nbytes, access, dmabuf=fd, offset=0)
                    finally:
                        os.close(fd)
                    registration.addresses.append(0)  # a dma-buf MR's addresses start at its offset
                else:
                    mr = api.MR(device.pd, region.nbytes, access, address=region.address)
                    registration.addresses.append(region.address)
                registration.mrs.append(mr)
        except api.errors as error:
            registration.close(api.errors)
            raise RegionError(
                f"registering {backing.kind.value} memory for RDMA on {device.name} failed: {error}"
            ) from error
        except BaseException:
            registration.close(api.errors)
            raise
        self._by_backing[key] = registration
        return registration

    def _drop(self, key: int) -> None:
        """The backing is gone: deregister its memory (no peer may write into it any more)."""
        registration = self._by_backing.get(key)
        if registration is not None and registration.backing() is None:
            del self._by_backing[key]
            registration.close(self._device.api.errors)

    def close(self) -> None:
        for registration in self._by_backing.values():
            registration.close(self._device.api.errors)
        self._by_backing.clear()


def _cuda_dmabuf_fd(address: int, nbytes: int) -> int:
    """A dma-buf file descriptor for [address, address + nbytes) of GPU memory (CUDA driver API)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        get_handle = libcuda.cuMemGetHandleForAddressRange
    except (OSError, AttributeError) as error:
        raise RegionError(
            f"GPU memory is registered for RDMA through dma-buf, but the CUDA driver here has no "
            f"cuMemGetHandleForAddressRange ({error}); use a CUDA 11.7+ driver or a CPU backing"
        ) from error
    fd = ctypes.c_int(-1)
    dma_buf_fd_type = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    result = get_handle(
        ctypes.byref(fd),
        ctypes.c_uint64(address),
        ctypes.c_size_t(nbytes),
        ctypes.c_int(dma_buf_fd_type),
        ctypes.c_ulonglong(0),
    )
    if result != 0:
        raise RegionError(
            f"the CUDA driver refused a dma-buf for GPU memory at {address:#x} (+{nbytes}): CUresult "
            f"{result}; dma-buf needs an open kernel module (nvidia-open) and a page-aligned region, "
            "else use a CPU backing"
        )
    return fd.value
