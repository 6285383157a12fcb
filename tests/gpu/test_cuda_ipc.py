"""The GPU path on real GPUs: CUDA backings, and the cuda_ipc transport between two processes
(a decode process exports its backing, a prefill process writes into it), cross-GPU when two
GPUs are visible and within one GPU always. Skipped without CUDA (CPU CI); run on a GPU machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from kvray.errors import BoundsError, StaleIncarnationError
from kvray.layout import BlockOrder, KVLayout, mixed
from kvray.memory import Backing, MemoryKind
from kvray.plan import OpTable, TransferPlan, plan_transfer
from kvray.wire import EngineInfo, Role, decode_engine_info, encode

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CANARY_SEED = 1234
#: The agent test's request: prefill blocks and the decode blocks they go to.
LOCAL_BLOCKS = [3, 4, 5, 9]
REMOTE_BLOCKS = [20, 21, 22, 0]


def _pattern(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def _expected_stored(plan: TransferPlan, src: np.ndarray) -> Any:
    """What a copy of `plan` from a source region holding `src` reports, by numpy: the placement
    digest of its ops and, for a hashed plan, the content digest (`kvray.content`)."""
    from kvray.content import destination_factor, hash_ranges, pair_salt, region_seed
    from kvray.placement import MASK64, Stored, ranges_digest

    ops = plan.ops
    placement = ranges_digest(ops.remote_region, ops.remote_offset, ops.nbytes)
    if not plan.hashed:
        return Stored(placement)
    content = 0
    sums = hash_ranges(src, ops.local_offset, ops.nbytes, region_seed(0))
    for value, lo, ro, lr, rr in zip(
        sums,
        ops.local_offset.tolist(),
        ops.remote_offset.tolist(),
        ops.local_region.tolist(),
        ops.remote_region.tolist(),
        strict=True,
    ):
        assert lr == 0
        content += value * destination_factor(pair_salt(lr, rr), ro - lo)
    return Stored(placement, content & MASK64)


def _decode_process(conn: Connection, layout: KVLayout, device: int, use_agent: bool) -> None:
    """The decode side: allocate, fill canaries, publish, wait, send back the allocation's bytes."""
    torch.cuda.set_device(device)
    if use_agent:
        asyncio.run(_decode_agent(conn, layout, device))
        return
    from kvray.config import Settings
    from kvray.transport.cuda_ipc import CudaIpcTransport

    backing = Backing.allocate(layout, MemoryKind.CUDA, device=f"cuda:{device}")
    region = backing.regions[0]
    assert region.allocation is not None
    region.allocation.copy_(_pattern(region.allocation.numel(), CANARY_SEED, region.allocation.device))
    torch.cuda.synchronize()
    incarnation = 7
    descriptors = CudaIpcTransport(Settings()).register(backing, "decode", incarnation, remote_writable=True)
    conn.send(encode(backing.engine_info("decode", incarnation, Role.DECODE, "node", descriptors)))
    while conn.recv() == "snapshot":
        torch.cuda.synchronize()
        conn.send((region.span.offset_in_allocation, region.allocation.cpu().numpy()))
    backing.close()


async def _decode_agent(conn: Connection, layout: KVLayout, device: int) -> None:
    from kvray.agent import KVAgent
    from kvray.config import Settings

    backing = Backing.allocate(layout, MemoryKind.CUDA, device=f"cuda:{device}")
    agent = KVAgent("decode", Role.DECODE, backing=backing, settings=Settings(), use_coordinator=False)
    info = await agent.start()
    reservation = agent.expect("req", REMOTE_BLOCKS)
    conn.send(encode(info))
    conn.send(msgspec.msgpack.encode(reservation))
    completion = await agent.wait_for_kv("req", timeout=60)
    region = backing.regions[0]
    conn.send((completion.nbytes, region.tensor.cpu().numpy()))
    conn.recv()
    await agent.close()


@pytest.fixture
def decode_process(request: pytest.FixtureRequest) -> Any:
    """Start a decode process; yields (connection, published info)."""
    layout, device, use_agent = request.param
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_decode_process, args=(child, layout, device, use_agent))
    process.start()
    assert parent.poll(120), "the decode process did not publish its engine info"
    info = decode_engine_info(parent.recv())
    yield parent, info
    with contextlib.suppress(BrokenPipeError, OSError):
        parent.send("done")
    process.join(60)
    if process.is_alive():
        process.kill()


def _devices() -> list[int]:
    return [1, 0] if torch.cuda.device_count() > 1 else [0]


def _source(layout: KVLayout) -> Backing:
    source = Backing.allocate(layout, MemoryKind.CUDA, device="cuda:0")
    source.regions[0].tensor.copy_(_pattern(source.regions[0].nbytes, 99, torch.device("cuda:0")))
    return source


def _prefill_info(source: Backing, peer: EngineInfo) -> EngineInfo:
    """The prefill engine's info for `source`, its regions described for `peer`'s transport."""
    transport = peer.regions[0].transport
    return source.engine_info(
        "prefill",
        1,
        Role.PREFILL,
        "node",
        source.region_descriptors("prefill", 1, transport, remote_writable=False),
    )


def _cases() -> list[Any]:
    cases = [
        pytest.param((mixed(32, order), device, False), True, id=f"{order.value}-to-cuda{device}")
        for order in BlockOrder
        for device in _devices()
    ]
    if torch.cuda.device_count() > 1:
        # The path for GPU pairs without peer access: gather, one copy, scatter.
        cases.append(pytest.param((mixed(32), 1, False), False, id="staged-to-cuda1"))
    return cases


@pytest.mark.parametrize(("decode_process", "peer_reads"), _cases(), indirect=["decode_process"])
def test_bytes_land_and_canaries_hold(
    decode_process: Any, peer_reads: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvray.config import Settings
    from kvray.transport import Peer
    from kvray.transport.cuda_ipc import CudaIpcTransport, ops, transport

    if not peer_reads:
        # Both places that choose between a direct read and the staged path.
        for module in (ops, transport):
            monkeypatch.setattr(module, "peer_reads", lambda reader, owner: reader == owner)
    conn, info = decode_process
    layout = info.layout
    source = _source(layout)
    local = _prefill_info(source, info)
    rng = np.random.default_rng(0)
    plan = plan_transfer(local, info, rng.permutation(32)[:11], rng.permutation(32)[:11])
    transport = CudaIpcTransport(Settings())
    asyncio.run(transport.write(plan, source, Peer(info)))
    # The same ops as an op table, hashed (the op kernel's digests; staged or direct), land the
    # same bytes again.
    tables = TransferPlan.from_ops(
        plan.src_engine,
        plan.src_incarnation,
        plan.dst_engine,
        plan.dst_incarnation,
        plan.layers,
        plan.ops,
        plan.unmerged,
        plan.layer_starts,
    )
    tables = replace(tables, hashed=True)
    stored = asyncio.run(transport.write(tables, source, Peer(info)))
    assert stored == _expected_stored(tables, source.regions[0].tensor.cpu().numpy())

    conn.send("snapshot")
    region_offset, after = conn.recv()
    before = _pattern(after.size, CANARY_SEED, torch.device("cuda:0")).cpu().numpy()
    expected = before.copy()
    src = source.regions[0].tensor.cpu().numpy()
    written = np.zeros(after.size, dtype=bool)
    for _, lo, _, ro, n in plan.ops.rows():
        expected[region_offset + ro : region_offset + ro + n] = src[lo : lo + n]
        written[region_offset + ro : region_offset + ro + n] = True
    assert written.any()
    assert np.array_equal(after[written], expected[written]), "bytes did not land"
    assert np.array_equal(after[~written], before[~written]), "bytes outside the written blocks changed"

    # A tampered plan past the region end is refused before any byte moves.
    ops = plan.ops
    bad = TransferPlan.from_ops(
        plan.src_engine,
        plan.src_incarnation,
        plan.dst_engine,
        plan.dst_incarnation,
        plan.layers,
        OpTable(
            ops.local_region[:1],
            ops.local_offset[:1],
            ops.remote_region[:1],
            np.array([info.regions[0].length - 8], dtype=np.int64),
            ops.nbytes[:1],
        ),
        plan.unmerged,
        plan.layer_starts,
    )
    with pytest.raises(BoundsError):
        asyncio.run(transport.write(bad, source, Peer(info)))
    with pytest.raises(StaleIncarnationError):
        asyncio.run(
            transport.write(replace(plan, dst_incarnation=plan.dst_incarnation + 1), source, Peer(info))
        )
    # A tampered request (a remote block id past the pool) is refused on the row path too.
    assert plan.rows is not None
    far = replace(
        plan,
        rows=replace(plan.rows, remote_ids=plan.rows.remote_ids + 10 * info.layout.num_blocks),
    )
    with pytest.raises(BoundsError):
        asyncio.run(transport.write(far, source, Peer(info)))
    conn.send("snapshot")
    _, again = conn.recv()
    assert np.array_equal(again, after), "a refused write changed bytes"
    asyncio.run(transport.close())


@pytest.mark.parametrize(
    ("decode_process", "replay"),
    [
        pytest.param((mixed(32, order), _devices()[0], False), replay, id=f"{order.value}-replay-{replay}")
        for order in BlockOrder
        for replay in (True, False)
    ],
    indirect=["decode_process"],
)
def test_requests_of_every_size_land_through_one_transport(decode_process: Any, replay: bool) -> None:
    """Many requests through one transport: sizes below, at and past a captured copy's capacity
    (ids left from a larger request in its pinned buffer must not be copied again), one after
    the other over the same blocks, then more at once than the copies captured per size (the
    rest launched); every byte lands and nothing outside the written blocks changes. Every other
    plan is hashed: the kernel's placement and content digests equal numpy's over the plan."""
    from kvray.config import Settings
    from kvray.transport import Peer
    from kvray.transport.cuda_ipc import CudaIpcTransport

    conn, info = decode_process
    source = _source(info.layout)
    local = _prefill_info(source, info)
    transport = CudaIpcTransport(Settings(), replay_graphs=replay)
    peer = Peer(info)
    rng = np.random.default_rng(5)
    one_by_one = [
        plan_transfer(local, info, rng.permutation(32)[:size], rng.permutation(32)[:size])
        for size in (11, 1, 17, 16, 3, 32, 2)
    ]
    pool = rng.permutation(32)
    at_once = [
        plan_transfer(local, info, rng.permutation(32)[:5], pool[5 * index : 5 * (index + 1)])
        for index in range(6)
    ]

    hashed = [replace(plan, hashed=index % 2 == 0) for index, plan in enumerate(one_by_one + at_once)]
    one_by_one, at_once = hashed[: len(one_by_one)], hashed[len(one_by_one) :]
    reported = []

    async def write_all() -> None:
        for plan in one_by_one:
            reported.append(await transport.write(plan, source, peer))
        reported.extend(await asyncio.gather(*(transport.write(plan, source, peer) for plan in at_once)))
        await transport.close()

    asyncio.run(write_all())
    src_bytes = source.regions[0].tensor.cpu().numpy()
    for plan, stored in zip(one_by_one + at_once, reported, strict=True):
        assert stored == _expected_stored(plan, src_bytes), plan.hashed
    conn.send("snapshot")
    region_offset, after = conn.recv()
    before = _pattern(after.size, CANARY_SEED, torch.device("cuda:0")).cpu().numpy()
    expected = before.copy()
    src = source.regions[0].tensor.cpu().numpy()
    written = np.zeros(after.size, dtype=bool)
    for plan in one_by_one + at_once:
        assert plan.rows is not None
        for _, lo, _, ro, n in plan.ops.rows():
            expected[region_offset + ro : region_offset + ro + n] = src[lo : lo + n]
            written[region_offset + ro : region_offset + ro + n] = True
    assert np.array_equal(after[written], expected[written]), "bytes did not land"
    assert np.array_equal(after[~written], before[~written]), "bytes outside the written blocks changed"


@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "launched"])
@pytest.mark.parametrize(
    "decode_process", [pytest.param((mixed(32), _devices()[0], False), id="cuda")], indirect=True
)
def test_the_copy_waits_for_the_work_queued_before_it(decode_process: Any, replay: bool) -> None:
    """A write issued while the model's stream is still busy writing the KV copies those writes,
    not the bytes before them: the copy follows the source GPU's current stream. The stream is
    kept busy for about 0.1 s before the new bytes are written, so a copy that did not wait
    would read the old ones."""
    from kvray.config import Settings
    from kvray.transport import Peer
    from kvray.transport.cuda_ipc import CudaIpcTransport

    conn, info = decode_process
    source = _source(info.layout)
    src = source.regions[0].tensor
    local = _prefill_info(source, info)
    transport = CudaIpcTransport(Settings(), replay_graphs=replay)
    peer = Peer(info)
    plan = plan_transfer(local, info, LOCAL_BLOCKS, REMOTE_BLOCKS)
    fresh = _pattern(src.numel(), 4321, src.device)

    async def write_after_late_writes() -> None:
        await transport.write(plan, source, peer)  # the old bytes (and, replayed, the capture)
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 28)
        src.copy_(fresh)
        await transport.write(plan, source, peer)
        await transport.close()

    asyncio.run(write_after_late_writes())
    conn.send("snapshot")
    region_offset, after = conn.recv()
    before = _pattern(after.size, CANARY_SEED, torch.device("cuda:0")).cpu().numpy()
    fresh_bytes = fresh.cpu().numpy()
    written = np.zeros(after.size, dtype=bool)
    for _, lo, _, ro, n in plan.ops.rows():
        assert np.array_equal(after[region_offset + ro : region_offset + ro + n], fresh_bytes[lo : lo + n]), (
            "the copy read the bytes from before the model's last writes"
        )
        written[region_offset + ro : region_offset + ro + n] = True
    assert np.array_equal(after[~written], before[~written]), "bytes outside the written blocks changed"


@pytest.mark.parametrize(
    "decode_process", [pytest.param((mixed(32), _devices()[0], True), id="agent")], indirect=True
)
def test_agents_push_over_cuda_ipc_and_complete(decode_process: Any) -> None:
    """Prefill and decode agents in two processes, no Ray: auto picks cuda_ipc, the completion
    arrives through the decode agent's inbox, the bytes are the prefill's."""
    from kvray.agent import KVAgent
    from kvray.wire import Reservation, TransportKind

    conn, info = decode_process
    reservation = msgspec.msgpack.decode(conn.recv(), type=Reservation)
    assert reservation.blocks == tuple(REMOTE_BLOCKS)
    source = _source(info.layout)

    async def push() -> Any:
        agent = KVAgent("prefill", Role.PREFILL, backing=source, use_coordinator=False)
        await agent.start()
        agent.add_peer(info)
        result = await agent.push(reservation, LOCAL_BLOCKS)
        await agent.close()
        return result

    result = asyncio.run(push())
    assert result.transport is TransportKind.CUDA_IPC
    nbytes, region = conn.recv()
    assert nbytes == result.nbytes
    src = source.regions[0].tensor.cpu().numpy()
    local_placements = source.placements
    for name, remote in info.placements.items():
        local_placement = local_placements[name]
        for lb, rb in zip(LOCAL_BLOCKS, REMOTE_BLOCKS, strict=True):
            for part in range(remote.parts):
                lo, ro = local_placement.byte_offset(part, lb), remote.byte_offset(part, rb)
                assert np.array_equal(region[ro : ro + remote.part_nbytes], src[lo : lo + remote.part_nbytes])


def test_cuda_backing_region_inside_allocation() -> None:
    for order in BlockOrder:
        backing = Backing.allocate(mixed(16, order), MemoryKind.CUDA)
        region = backing.regions[0]
        assert region.address % (2 * 1024 * 1024) == 0
        assert region.nbytes % (2 * 1024 * 1024) == 0
        assert region.span.alloc_start <= region.address
        assert region.address + region.nbytes <= region.span.alloc_start + region.span.alloc_nbytes
        for name, view in backing.views.items():
            assert view.is_cuda
            first = view.data_ptr()
            assert region.address <= first < region.address + region.nbytes, name
        backing.close()


@pytest.mark.parametrize(
    "decode_process", [pytest.param((mixed(32), _devices()[0], False), id="forged-size")], indirect=True
)
@pytest.mark.parametrize("claim", ["64x-storage", "shifted-past-the-end"])
def test_a_handle_claiming_more_than_its_allocation_is_refused(decode_process: Any, claim: str) -> None:
    """The exporter's storage size and offsets are claims: the writer asks the driver how large
    the opened allocation really is and refuses a region that leaves it, before any byte moves."""
    from kvray.config import Settings
    from kvray.errors import RegionError
    from kvray.transport import Peer
    from kvray.transport.cuda_ipc import CudaIpcTransport
    from kvray.wire import decode_cuda_ipc_handle

    conn, info = decode_process
    region = info.regions[0]
    handle = decode_cuda_ipc_handle(region.handle)
    if claim == "64x-storage":
        forged_handle = msgspec.structs.replace(handle, storage_size=64 * handle.storage_size)
        forged_region = msgspec.structs.replace(
            region, handle=msgspec.msgpack.encode(forged_handle), length=64 * region.length
        )
    else:
        # As long as it really is, but starting 1 GiB further in: past any allocation a test
        # process makes, and a claimed storage that reaches that far.
        shift = 1 << 30
        forged_handle = msgspec.structs.replace(handle, storage_size=handle.storage_size + shift)
        forged_region = msgspec.structs.replace(
            region, handle=msgspec.msgpack.encode(forged_handle), handle_offset=region.handle_offset + shift
        )
    forged = msgspec.structs.replace(info, regions=(forged_region,))
    layout = info.layout
    source = _source(layout)
    local = _prefill_info(source, info)
    conn.send("snapshot")
    _, before = conn.recv()
    plan = plan_transfer(local, forged, list(range(8)), list(range(24, 32)))
    transport = CudaIpcTransport(Settings())
    with pytest.raises(RegionError, match="did not export"):
        asyncio.run(transport.write(plan, source, Peer(forged)))
    conn.send("snapshot")
    _, after = conn.recv()
    assert np.array_equal(after, before), "a refused write changed bytes of the exporter"
    # The honest description of the same memory still takes writes.
    asyncio.run(transport.write(plan_transfer(local, info, [0], [1]), source, Peer(info)))
    asyncio.run(transport.close())


def test_a_cuda_backing_has_its_allocation_to_itself() -> None:
    """A peer that opens a backing's IPC handle can reach the whole CUDA allocation behind it,
    whatever the handle claims: that allocation holds the backing alone, never another tensor
    of the process (torch's caching allocator would otherwise carve others out of it)."""
    from kvray.transport.cuda_ipc.allocation import cuda_allocation_range

    freed = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")  # a cached segment to reuse
    del freed
    backings = [Backing.allocate(mixed(4), MemoryKind.CUDA) for _ in range(3)]
    others = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (512, 1 << 16, 1 << 20, 3 << 20)]
    try:
        for backing in backings:
            start, nbytes = cuda_allocation_range(backing.regions[0].address)
            neighbours = others + [b.regions[0].tensor for b in backings if b is not backing]
            for other in neighbours:
                assert not start <= other.data_ptr() < start + nbytes, "another tensor shares the allocation"
    finally:
        for backing in backings:
            backing.close()
