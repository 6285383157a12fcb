"""`verbs` transport: RDMA NICs through pyverbs (sixth step of the data flow, across nodes).

    device       one RDMA device per process, by name or by locality (`Settings.verbs_device`),
                 one protection domain, two completion queues (sends, receives) and one thread
                 that polls them and hands completions to the event loop
    regions      a decode engine's regions are memory regions with REMOTE_WRITE | LOCAL_WRITE and
                 nothing else; a prefill engine's are local-only (no access flag at all); GPU
                 memory as `gpudirect` says, every region's way settled before any is registered
    gpudirect    how GPU memory reaches the device: dma-buf where the GPU supports it, else the
                 GPU address through a peer-memory module (nvidia_peermem), else a RegionError
                 saying what to load; the CUDA driver and kernel modules behind one seam
                 (`GpuDirect`), also `kvray doctor`'s GPUDirect readiness
    connections  the handshake: one reliable-connected queue pair per (writer incarnation,
                 decode incarnation), asked for through the actor hosting the decode agent
                 (`AgentHost.kvray_connect`, answered by `VerbsTransport.accept`). The static half
                 of both ends (device, port, GID, LID, MTU) is also published in `EngineInfo.verbs`
                 (`VerbsTransport.publish`).
    requests     the plan's ops as RDMA WRITEs with scatter-gather lists (pure code), every Nth
                 signalled; the last is a WRITE WITH IMMEDIATE carrying the transfer's tag
    write        work requests posted in a window no deeper than the queue pair; a failed one is
                 a `WriteFailedError` naming the peer and the op, and no posted request outlives
                 the write that posted it
    receive      the decode side matches each immediate against the transfers it expects
                 (`expect`) and counts them per writer; a request completes only once the
                 writer's notice and as many immediates as it names have come (`complete`)
    transport    `VerbsTransport`, both halves put together

pyverbs is reached through `VerbsApi`, one seam the tests fill with a fake device, and imported
only when a transport first opens its device (`import kvray` works without it); the CUDA driver
through `GpuDirect`, the same way.
"""

from kvray.transport.verbs.device import VerbsApi, list_devices, load_pyverbs, probe
from kvray.transport.verbs.gpudirect import GpuDirect, NodeGpuDirect
from kvray.transport.verbs.requests import transfer_tag
from kvray.transport.verbs.transport import VerbsTransport

__all__ = [
    "GpuDirect",
    "NodeGpuDirect",
    "VerbsApi",
    "VerbsTransport",
    "list_devices",
    "load_pyverbs",
    "probe",
    "transfer_tag",
]
