"""The CUDA driver as the `cuda_ipc` transport calls it directly, through ctypes: the library,
and the calls a captured row copy's capture and replay make (external event wait and record,
graph launch), where torch's wrappers have none or cost more than the call.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvray.errors import TransportError


@functools.cache
def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


#: Flags of a wait and a record captured as a graph's own nodes (`cudaEventWaitExternal`,
#: `cudaEventRecordExternal`), not as dependencies inside the capture.
EVENT_WAIT_EXTERNAL = 1
EVENT_RECORD_EXTERNAL = 1


@dataclass(frozen=True)
class DriverCalls:
    event_record: Callable[[int, int], int]
    event_record_with_flags: Callable[[int, int, int], int]
    stream_wait_event: Callable[[int, int, int], int]
    graph_launch: Callable[[int, int], int]


@functools.cache
def driver_calls() -> DriverCalls:
    """The driver entry points a capture and a replay use, with their argument types declared
    (so that ctypes converts each argument without guessing, on every call)."""
    lib = libcuda()
    pair = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    triple = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
    return DriverCalls(
        pair(("cuEventRecord", lib)),
        triple(("cuEventRecordWithFlags", lib)),
        triple(("cuStreamWaitEvent", lib)),
        pair(("cuGraphLaunch", lib)),
    )


def driver_check(name: str, result: int) -> None:
    if result != 0:
        raise TransportError(f"{name} failed (CUresult {result})", result=result)


#: The driver's entry points a GPU lane calls from its own threads (`kvray._copy_pool.Lane`'s
#: `cuda`), in the order it takes them.
LANE_CALLS = (
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuGraphLaunch",
)


def lane_calls() -> tuple[int, ...]:
    """The addresses of `LANE_CALLS` in the driver."""
    lib = libcuda()
    return tuple(int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0) for name in LANE_CALLS)


def primary_context(device: torch.device) -> int:
    """CUDA device `device`'s primary context (torch's), whichever context is current on this
    thread, if any: a thread torch has not run CUDA work on has none current. torch keeps the
    context for the process's life; the reference taken here to read it goes at once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    lib = libcuda()
    handle = ctypes.c_int()
    driver_check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(index)))
    context = ctypes.c_void_p()
    driver_check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle))
    driver_check("cuDevicePrimaryCtxRelease", lib.cuDevicePrimaryCtxRelease_v2(handle))
    return int(context.value or 0)
