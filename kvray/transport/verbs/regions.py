"""Memory registration of the `verbs` transport (the region step, for RDMA): each region of a
backing becomes one memory region of the device, deregistered when the backing is gone. GPU
regions go through dma-buf or peer memory (`gpudirect`), or are refused before anything is
registered."""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import Any

from kvray.errors import RegionError
from kvray.memory import Backing, MemoryKind, MemoryRegion
from kvray.transport.verbs.device import Device
from kvray.transport.verbs.gpudirect import GpuDirect, GpuPath, NodeGpuDirect, check_page_aligned, gpu_path
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

    def __init__(self, device: Device, gpudirect: GpuDirect | None = None) -> None:
        self._device = device
        #: Asked about GPU memory only (the node's own at first use unless given one).
        self._gpudirect = gpudirect
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
        # Every GPU region's way in is settled before anything is registered (fail closed).
        paths = self._gpu_paths(backing)
        key = id(backing)
        registration = Registration(weakref.ref(backing, lambda _: self._drop(key)), [], [], remote_writable)
        try:
            for region, path in zip(backing.regions, paths, strict=True):
                if path is GpuPath.DMA_BUF:
                    mr, address = self._dmabuf_mr(region, access)
                else:
                    mr = api.MR(device.pd, region.nbytes, access, address=region.address)
                    address = region.address
                registration.mrs.append(mr)
                registration.addresses.append(address)
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

    @property
    def gpudirect(self) -> GpuDirect:
        if self._gpudirect is None:
            self._gpudirect = NodeGpuDirect()
        return self._gpudirect

    def _gpu_paths(self, backing: Backing) -> list[GpuPath | None]:
        """Per region, how its GPU memory is registered (None: CPU memory). Alignment is checked
        for every region before the driver is asked anything."""
        for region in backing.regions:
            if region.kind is MemoryKind.CUDA:
                check_page_aligned(region.address, region.nbytes)
        return [
            gpu_path(self.gpudirect, self.gpudirect.device_of(region.address))
            if region.kind is MemoryKind.CUDA
            else None
            for region in backing.regions
        ]

    def _dmabuf_mr(self, region: MemoryRegion, access: int) -> tuple[Any, int]:
        """A dma-buf memory region over `region` and the address its first byte has there: a
        dma-buf MR is addressed from its offset into the dma-buf (pyverbs sets iova = offset),
        here 0. A device that refuses dma-buf falls back to peer memory where a module is
        loaded. The descriptor is closed either way (the MR holds its own reference)."""
        device = self._device
        api = device.api
        fd = self.gpudirect.dmabuf_fd(region.address, region.nbytes)
        try:
            return api.DmaBufMR(device.pd, region.nbytes, access, dmabuf=fd, offset=0), 0
        except TypeError as error:
            raise RegionError(
                f"this pyverbs takes no dma-buf file descriptor ({error}); install pyverbs from "
                "rdma-core 44 or newer, or keep the KV backing on the CPU"
            ) from error
        except api.errors as error:
            if self.gpudirect.peer_memory_module() is None:
                raise RegionError(
                    f"{device.name} refused a dma-buf memory region for GPU memory at "
                    f"{region.address:#x} ({error}) and no peer-memory module (nvidia_peermem) is "
                    "loaded; the kernel needs 5.12+ and the NIC driver dma-buf support, else load "
                    "nvidia_peermem or keep the KV backing on the CPU",
                    address=region.address,
                ) from error
        finally:
            os.close(fd)
        return api.MR(device.pd, region.nbytes, access, address=region.address), region.address

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
