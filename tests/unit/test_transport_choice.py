"""`choose_transport` is a pure function of the capability flags: which transport writes from a
backing here into a peer, for every pairing of memory, node and published endpoints."""

from __future__ import annotations

import msgspec
import pytest

from kvray.errors import TransportUnavailableError
from kvray.layout import mixed
from kvray.memory import Backing, MemoryKind
from kvray.transport import choose_transport, transport_class
from kvray.transport.loopback import LoopbackTransport
from kvray.wire import EngineInfo, Role, TransportKind, VerbsEndpoint

REGISTRY = [
    transport_class(kind)
    for kind in (TransportKind.CUDA_IPC, TransportKind.SHM, TransportKind.VERBS, TransportKind.RAY)
]
PORT = VerbsEndpoint(device="mlx5_0", port=1, gid="g", gid_index=0, lid=0, mtu=5, link_layer=2)


def peer(registered_by: TransportKind, node: str, *, handle: bytes = b"h", rdma: bool = False) -> EngineInfo:
    with Backing.allocate(mixed(4)) as backing:
        regions = backing.region_descriptors("d", 1, registered_by, remote_writable=True)
        info = backing.engine_info("d", 1, Role.DECODE, node, regions, {})
    regions = tuple(msgspec.structs.replace(region, handle=handle) for region in info.regions)
    return msgspec.structs.replace(info, regions=regions, verbs=PORT if rdma else None)


@pytest.mark.parametrize(
    ("local", "registered_by", "node", "rdma", "chosen"),
    [
        (MemoryKind.CPU, TransportKind.SHM, "here", False, TransportKind.SHM),
        (MemoryKind.SHM, TransportKind.SHM, "here", False, TransportKind.SHM),
        (MemoryKind.CPU, TransportKind.SHM, "there", False, TransportKind.RAY),
        (MemoryKind.CPU, TransportKind.SHM, "there", True, TransportKind.VERBS),
        (MemoryKind.CPU, TransportKind.SHM, "here", True, TransportKind.SHM),  # RDMA is for other nodes
        (MemoryKind.CPU, TransportKind.RAY, "here", False, TransportKind.RAY),
        (MemoryKind.CUDA, TransportKind.CUDA_IPC, "here", False, TransportKind.CUDA_IPC),
        (MemoryKind.CUDA, TransportKind.CUDA_IPC, "here", True, TransportKind.CUDA_IPC),
        (MemoryKind.CUDA, TransportKind.CUDA_IPC, "there", True, TransportKind.VERBS),
        (MemoryKind.CUDA, TransportKind.SHM, "there", True, TransportKind.VERBS),
        # GPUs on two nodes without RDMA: ray, staged through pinned host memory on both sides.
        (MemoryKind.CUDA, TransportKind.CUDA_IPC, "there", False, TransportKind.RAY),
        (MemoryKind.CUDA, TransportKind.RAY, "there", False, TransportKind.RAY),
        (MemoryKind.CUDA, TransportKind.SHM, "there", False, TransportKind.RAY),
        (MemoryKind.CPU, TransportKind.CUDA_IPC, "there", False, TransportKind.RAY),
        # Between GPU and CPU memory on one node nothing but ray moves bytes.
        (MemoryKind.CPU, TransportKind.CUDA_IPC, "here", False, TransportKind.RAY),
        (MemoryKind.CUDA, TransportKind.SHM, "here", False, TransportKind.RAY),
        (MemoryKind.CUDA, TransportKind.RAY, "here", False, TransportKind.RAY),
    ],
)
def test_auto_takes_the_first_transport_whose_flags_fit(
    local: MemoryKind, registered_by: TransportKind, node: str, rdma: bool, chosen: TransportKind
) -> None:
    assert choose_transport("auto", local, "here", peer(registered_by, node, rdma=rdma), REGISTRY) is chosen


@pytest.mark.parametrize(
    ("local", "registered_by", "node"),
    [
        (MemoryKind.CPU, TransportKind.CUDA_IPC, "here"),  # a GPU peer and no RDMA: nothing reads CPU into it
        (MemoryKind.CUDA, TransportKind.SHM, "here"),  # shm copies from CPU memory only
        (MemoryKind.CUDA, TransportKind.CUDA_IPC, "there"),  # cuda_ipc needs one node
    ],
)
def test_no_fitting_transport_is_an_error_that_says_what_was_tried(
    local: MemoryKind, registered_by: TransportKind, node: str
) -> None:
    """Where Ray is not there (no `ray` candidate), GPU memory and other nodes need what is."""
    without_ray = [cls for cls in REGISTRY if cls.kind is not TransportKind.RAY]
    with pytest.raises(TransportUnavailableError, match=r"tried cuda_ipc, shm, verbs$"):
        choose_transport("auto", local, "here", peer(registered_by, node), without_ray)


def test_same_node_transports_need_the_peers_handles() -> None:
    no_handles = peer(TransportKind.SHM, "here", handle=b"")
    assert choose_transport("auto", MemoryKind.CPU, "here", no_handles, REGISTRY) is TransportKind.RAY


def test_a_named_transport_is_taken_as_it_is() -> None:
    info = peer(TransportKind.SHM, "here")
    assert choose_transport("ray", MemoryKind.CPU, "here", info, REGISTRY) is TransportKind.RAY


def test_candidates_come_in_order_of_preference() -> None:
    loopback = peer(TransportKind.LOOPBACK, "here")
    candidates = [LoopbackTransport, *REGISTRY]
    assert choose_transport("auto", MemoryKind.CPU, "here", loopback, candidates) is TransportKind.LOOPBACK
    # Only the loopback transport writes into engines registered through it.
    with pytest.raises(TransportUnavailableError):
        choose_transport("auto", MemoryKind.CPU, "here", loopback, REGISTRY)
    shm_peer = peer(TransportKind.SHM, "here")
    assert choose_transport("auto", MemoryKind.CPU, "here", shm_peer, candidates) is TransportKind.SHM
