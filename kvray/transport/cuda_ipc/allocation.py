"""What a peer's CUDA IPC handle may reach: the allocation the driver knows for it, against which
an exporter's claimed sizes and offsets are checked before the `cuda_ipc` transport writes.
"""

from __future__ import annotations

import ctypes

from kvray.errors import RegionError
from kvray.transport.cuda_ipc.driver import libcuda


def cuda_allocation_range(pointer: int) -> tuple[int, int]:
    """(start, nbytes) of the CUDA allocation that holds device address `pointer`, as the driver
    knows it (`cuMemGetAddressRange`): for an opened IPC handle, the whole allocation the
    exporter shared, whatever size its handle claims."""
    start = ctypes.c_uint64()
    nbytes = ctypes.c_size_t()
    result = libcuda().cuMemGetAddressRange_v2(
        ctypes.byref(start), ctypes.byref(nbytes), ctypes.c_uint64(pointer)
    )
    if result != 0:
        raise RegionError(
            f"the CUDA driver knows no allocation at {pointer:#x} (CUresult {result})", address=pointer
        )
    return int(start.value), int(nbytes.value)


def check_inside_allocation(
    region_start: int, region_nbytes: int, allocation: tuple[int, int], *, engine_id: str, region: int
) -> None:
    """Refuse a region that leaves the CUDA allocation it was opened in: an exporter's claimed
    storage size and offsets are only claims, and bytes past its allocation's end, or before
    its start, belong to other allocations of that process or to none."""
    allocation_start, allocation_nbytes = allocation
    offset = region_start - allocation_start
    if offset < 0 or region_nbytes > allocation_nbytes or offset > allocation_nbytes - region_nbytes:
        raise RegionError(
            f"engine {engine_id!r} describes region {region} as {region_nbytes} bytes at offset "
            f"{offset} of its CUDA allocation, which has {allocation_nbytes}; its CUDA IPC handle "
            "claims memory it did not export, refusing to write",
            engine_id=engine_id,
            region=region,
            offset=offset,
            nbytes=region_nbytes,
            allocation_nbytes=allocation_nbytes,
        )
