"""What only the `verbs` transport has, on the FAKE RDMA device (tests/transport/fake_verbs.py):
immediates matched against expected transfers, errors the device reports (a write past a memory
region, a key without REMOTE_WRITE), the handshake refusing engines that expose nothing, device
choice, and two agents choosing verbs across nodes and moving a request through it.

The contract suite (test_contract.py) runs the shared guarantees on this device too
(`verbs-fake`), and on a real RDMA device through pyverbs (`verbs`, skipped without one)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pytest
import torch
from fake_verbs import ENUMS, FakeFabric
from test_contract import ready_layout, with_ops

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import RegionError, WriteFailedError
from kvray.layout import BlockOrder
from kvray.plan import plan_transfer
from kvray.transport.base import Peer
from kvray.transport.verbs import VerbsTransport, probe
from kvray.wire import Reservation, Role, TransportKind

if TYPE_CHECKING:
    from conftest import TransportUnderTest


@pytest.fixture
def fake(verbs_fake: TransportUnderTest) -> TransportUnderTest:
    return verbs_fake


def verbs(tut: TransportUnderTest) -> VerbsTransport:
    assert isinstance(tut.transport, VerbsTransport)
    return tut.transport


async def test_the_last_request_carries_the_immediate_the_decode_side_expects(
    fake: TransportUnderTest,
) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source, destination = fake.source(layout), fake.destination(layout)
    local, remote = fake.scattered(layout.num_blocks, 9)
    plan = dataclasses.replace(fake.plan(source, destination, local, remote), request_id="req-1")
    before = fake.snapshot(destination)
    arrival = verbs(fake).expect_transfer("decode-0", destination.incarnation, "req-1")

    await fake.write(plan, source, destination)

    fake.assert_landed(plan, source, destination, before, local, remote)
    landed = await asyncio.wait_for(arrival, 10)
    assert (landed.request_id, landed.src_engine, landed.src_incarnation) == (
        "req-1",
        "prefill-0",
        source.incarnation,
    )
    opcodes = [opcode for opcode, *_ in fake.fabric.executed]
    assert opcodes[-1] == ENUMS.IBV_WR_RDMA_WRITE_WITH_IMM
    assert opcodes.count(ENUMS.IBV_WR_RDMA_WRITE_WITH_IMM) == 1 and len(opcodes) > 1
    assert max(sges for _, sges, _, _ in fake.fabric.executed) <= fake.fabric.max_sge
    assert sum(nbytes for _, _, nbytes, _ in fake.fabric.executed) == plan.nbytes


async def test_unknown_and_stale_immediates_are_dropped(fake: TransportUnderTest) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = fake.source(layout)
    old = fake.destination(layout, engine_id="decode-0")
    new = fake.destination(layout, engine_id="decode-0")
    local, remote = fake.scattered(layout.num_blocks, 3)
    transport = verbs(fake)
    expected = transport.expect_transfer("decode-0", new.incarnation, "req-a")

    def plan(destination: Any, request_id: str) -> Any:
        return dataclasses.replace(fake.plan(source, destination, local, remote), request_id=request_id)

    await fake.write(plan(old, "req-a"), source, old)  # the right id, for the old life
    await fake.write(plan(new, "req-b"), source, new)  # the new life, an id nobody expects
    await fake.write(plan(new, "req-a"), source, new)
    await asyncio.wait_for(expected, 10)

    assert transport.stats["immediates_dropped_unknown"] == 2
    assert transport.stats["immediates_matched"] == 1


async def test_device_refuses_a_write_past_the_memory_region(fake: TransportUnderTest) -> None:
    """The transport's own checks are bypassed (forged lengths): the device still refuses."""
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source, destination = fake.source(layout), fake.destination(layout)
    local, remote = fake.scattered(layout.num_blocks, 4)
    plan = fake.plan(source, destination, local, remote)
    await fake.write(plan, source, destination)  # connects
    connection = verbs(fake)._connections[("decode-0", destination.incarnation)]
    region = destination.info.regions[0]
    connection.regions = tuple(
        msgspec.structs.replace(key, length=key.length + 4096) for key in connection.regions
    )
    forged = msgspec.structs.replace(
        destination.info, regions=(msgspec.structs.replace(region, length=region.length + 4096),)
    )
    last = len(plan.ops) - 1
    one_op = with_ops(
        plan,
        **{
            name: getattr(plan.ops, name)[last:].copy()
            for name in ("local_region", "local_offset", "remote_region")
        },
        remote_offset=np.array([region.length - int(plan.ops.nbytes[last]) + 64], dtype=np.int64),
        nbytes=plan.ops.nbytes[last:].copy(),
    )
    before = fake.snapshot(destination)

    with pytest.raises(WriteFailedError, match="IBV_WC_REM_ACCESS_ERR") as raised:
        await fake.transport.write(one_op, source.backing, Peer(forged, fake.peer(destination).host))

    assert raised.value.engine_id == "decode-0" and raised.value.op == 0
    fake.assert_unchanged(destination, before)
    # The broken connection is dropped; the next write connects again and lands.
    fake.refill(source)
    before = fake.snapshot(destination)
    await fake.write(plan, source, destination)
    fake.assert_landed(plan, source, destination, before, local, remote)


async def test_device_refuses_a_key_without_remote_write(fake: TransportUnderTest) -> None:
    """A remote key of a prefill engine's local-only region writes nothing there."""
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source, destination = fake.source(layout), fake.destination(layout)
    local, remote = fake.scattered(layout.num_blocks, 4)
    plan = fake.plan(source, destination, local, remote)
    await fake.write(plan, source, destination)
    transport = verbs(fake)
    connection = transport._connections[("decode-0", destination.incarnation)]
    registration = transport._registrations[id(source.backing)]
    connection.regions = tuple(
        msgspec.structs.replace(key, address=registration.addresses[0], rkey=int(registration.mrs[0].rkey))
        for key in connection.regions
    )
    source_before, destination_before = fake.snapshot(source), fake.snapshot(destination)

    with pytest.raises(WriteFailedError, match="IBV_WC_REM_ACCESS_ERR"):
        await fake.write(plan, source, destination)

    fake.assert_unchanged(source, source_before, "source")
    fake.assert_unchanged(destination, destination_before)


async def test_a_prefill_engine_takes_no_rdma_connection(fake: TransportUnderTest) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source, other = fake.source(layout), fake.source(layout, engine_id="prefill-1")
    local, remote = fake.scattered(layout.num_blocks, 2)
    plan = fake.plan(source, fake.destination(layout), local, remote)
    # The writer is told the region is writable; the engine itself knows better.
    forged = msgspec.structs.replace(
        other.info,
        engine_id="decode-0",
        incarnation=plan.dst_incarnation,
        regions=tuple(msgspec.structs.replace(r, remote_writable=True) for r in other.info.regions),
    )
    other.info = msgspec.structs.replace(other.info, engine_id="decode-0", incarnation=plan.dst_incarnation)
    before = fake.snapshot(other)

    with pytest.raises(RegionError, match="exposes no writable region"):
        await fake.transport.write(plan, source.backing, Peer(forged, fake.peer(other).host))

    fake.assert_unchanged(other, before, "prefill engine")


def test_device_by_name_by_locality_and_none() -> None:
    fabric = FakeFabric(devices=("fake_rdma0", "fake_rdma1"))
    chosen = VerbsTransport(Settings(verbs_device="fake_rdma1"), api=fabric.api())
    assert chosen.endpoint.device == "fake_rdma1"
    assert chosen.endpoint.gid == fabric.gid("fake_rdma1") and chosen.endpoint.gid_index == 1
    assert VerbsTransport(Settings(), api=fabric.api()).endpoint.device in fabric.device_names
    reason = probe(Settings(verbs_device="mlx5_9"), fabric.api())
    assert reason is not None and "mlx5_9" in reason and "fake_rdma0, fake_rdma1" in reason
    # With no device, pyverbs' get_device_list raises; that is "no device", not a crash.
    assert probe(Settings(), FakeFabric(devices=()).api()) == "pyverbs sees no RDMA device on this machine"
    assert probe(Settings(), fabric.api()) is None


# ---- two agents on two "nodes", through the agent's verbs path ----------------------------------


class _Method:
    def __init__(self, function: Any) -> None:
        self.remote = function


class AgentActorStandIn:
    """IN-PROCESS STAND-IN for the Ray actor hosting an agent (`AgentHost`): its verbs handshake
    and completion entry points, called directly."""

    def __init__(self, agent: KVAgent) -> None:
        self.kvray_connect = _Method(agent.accept_connection)
        self.kvray_notify = _Method(agent.notify)
        self.kvray_claim = _Method(agent.claim)


async def test_agents_on_two_nodes_choose_verbs_and_move_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    fabric = FakeFabric()
    monkeypatch.setattr(VerbsTransport, "unavailable_reason", classmethod(lambda cls, settings: None))
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    settings = Settings()
    prefill = KVAgent("prefill-0", Role.PREFILL, layout, settings=settings, use_coordinator=False)
    decode = KVAgent("decode-0", Role.DECODE, layout, settings=settings, use_coordinator=False)
    for agent, node in ((prefill, "node-a"), (decode, "node-b")):
        agent.node_id = node
        agent._transports[TransportKind.VERBS] = VerbsTransport(settings, api=fabric.api())
    try:
        await decode.start()
        await prefill.start()
        assert decode.info.verbs is not None and prefill.info.verbs is None  # only decode engines publish
        prefill.add_peer(decode.info, AgentActorStandIn(decode))
        decode.add_peer(prefill.info)  # the decode side takes connections from registered writers only
        peer = await prefill.peer("decode-0")
        assert prefill.choose_transport(peer) is TransportKind.VERBS
        same_node = Peer(msgspec.structs.replace(decode.info, node_id="node-a"))
        assert prefill.choose_transport(same_node) is TransportKind.SHM
        no_device = Peer(msgspec.structs.replace(decode.info, verbs=None))
        assert prefill.choose_transport(no_device) is TransportKind.RAY

        rng = np.random.default_rng(7)
        for index in range(len(prefill.backing.regions)):
            data = prefill.backing.regions[index].tensor.numpy()
            data[:] = rng.integers(0, 256, data.size, dtype=np.uint8)
        src, dst = np.array([3, 1, 4]), np.array([10, 11, 5])
        reservation = decode.expect("req-1", dst)
        result = await prefill.push(reservation, src)
        completion = await decode.wait_for_kv("req-1", timeout=10)

        assert result.transport is TransportKind.VERBS and completion.nbytes == result.nbytes
        for layer in layout.layer_names:
            sent, landed = prefill.backing.view(layer), decode.backing.view(layer)
            parts = layout.layer(layer).geometry.parts
            sent, landed = (sent[:, src], landed[:, dst]) if parts == 2 else (sent[src], landed[dst])
            assert torch.equal(sent.contiguous().view(torch.uint8), landed.contiguous().view(torch.uint8))
    finally:
        await prefill.close()
        await decode.close()


async def test_handshake_bytes_are_msgspec_only_and_malformed_ones_are_refused(
    fake: TransportUnderTest,
) -> None:
    import pickle

    from kvray.errors import WireDecodeError
    from kvray.wire import VerbsAccept, decode_engine_info, decode_verbs_handshake, encode

    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    destination = fake.destination(layout)
    transport = verbs(fake)
    info = msgspec.structs.replace(destination.info, verbs=transport.endpoint)
    assert decode_engine_info(encode(info)) == info
    accept = VerbsAccept(
        dst_engine="decode-0", dst_incarnation=1, endpoint=transport.endpoint, qp_num=5, psn=6, regions=()
    )
    assert decode_verbs_handshake(encode(accept)) == accept
    before = fake.snapshot(destination)
    for garbage in (b"", b"\x93\x01\x02", pickle.dumps({"qp_num": 1}), encode(accept)):
        with pytest.raises(WireDecodeError):
            await transport.accept(garbage, destination.backing, destination.info, fake.registered)
    assert transport.stats["connections_accepted"] == 0
    fake.assert_unchanged(destination, before)


async def _two_agents(monkeypatch: pytest.MonkeyPatch) -> tuple[KVAgent, KVAgent]:
    """A prefill agent on "node-a" and a decode agent on "node-b", both on one fake fabric."""
    fabric = FakeFabric()
    monkeypatch.setattr(VerbsTransport, "unavailable_reason", classmethod(lambda cls, settings: None))
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    prefill = KVAgent("prefill-0", Role.PREFILL, layout, use_coordinator=False)
    decode = KVAgent("decode-0", Role.DECODE, layout, use_coordinator=False)
    for agent, node in ((prefill, "node-a"), (decode, "node-b")):
        agent.node_id = node
        agent._transports[TransportKind.VERBS] = VerbsTransport(Settings(), api=fabric.api())
    await decode.start()
    await prefill.start()
    prefill.add_peer(decode.info, AgentActorStandIn(decode))
    decode.add_peer(prefill.info)
    rng = np.random.default_rng(11)
    data = prefill.backing.regions[0].tensor.numpy()
    data[:] = rng.integers(0, 256, data.size, dtype=np.uint8)
    return prefill, decode


def _done(prefill: KVAgent, reservation: Reservation, immediates: int) -> bytes:
    from kvray.wire import TransferDone, encode

    request_id = reservation.request_id
    return encode(
        TransferDone(
            transfer_id=f"{request_id}@forged",
            request_id=request_id,
            src_engine=prefill.engine_id,
            src_incarnation=prefill.incarnation,
            dst_engine=reservation.engine_id,
            dst_incarnation=reservation.incarnation,
            nbytes=1,
            immediates=immediates,
            token=reservation.token,
        )
    )


async def test_a_notice_alone_does_not_complete_an_rdma_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over verbs the decode side needs its own proof that the bytes landed: the writer's notice
    names how many WRITE WITH IMMEDIATE requests it issued, and wait_for_kv resolves only once
    that many have arrived from that writer incarnation."""
    from kvray.errors import TransferTimeoutError

    prefill, decode = await _two_agents(monkeypatch)
    try:
        # A notice that claims an RDMA write nobody made: the request never completes.
        claimed = decode.expect("req-claimed", [0])
        await decode.notify(_done(prefill, claimed, immediates=1))
        with pytest.raises(TransferTimeoutError):
            await decode.wait_for_kv("req-claimed", timeout=0.5)
        await decode.release("req-claimed")

        # One layer written over RDMA (one immediate), a notice asking for two: no completion.
        layer = prefill.layout.layer_names[0]
        src, dst = np.array([1, 2]), np.array([3, 4])
        short = decode.expect("req-short", dst)
        await prefill.push_layer(short, layer, src)
        await decode.notify(_done(prefill, short, immediates=2))
        with pytest.raises(TransferTimeoutError):
            await decode.wait_for_kv("req-short", timeout=0.5)
        # The writer's last word ends its claim on the request, so the release need not wait.
        await prefill.abort(short, "the request timed out")
        await decode.release("req-short")

        # The same with a notice asking for the one that came: it completes.
        one = decode.expect("req-one", dst)
        await prefill.push_layer(one, layer, src)
        await decode.notify(_done(prefill, one, immediates=1))
        assert (await decode.wait_for_kv("req-one", timeout=10)).request_id == "req-one"
        await prefill.abort(one, "completed by the notice above")
        await decode.release("req-one")
        rdma = decode._transports[TransportKind.VERBS]
        assert isinstance(rdma, VerbsTransport)
        assert rdma._expected[(decode.engine_id, decode.incarnation)] == {}  # nothing left behind
    finally:
        await prefill.close()
        await decode.close()


async def test_a_layerwise_rdma_push_completes_after_one_immediate_per_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefill, decode = await _two_agents(monkeypatch)
    try:
        src, dst = np.array([5, 0, 7]), np.array([2, 9, 6])
        before = decode.backing.regions[0].tensor.numpy().copy()
        reservation = decode.expect("req-layers", dst)
        for layer in prefill.layout.layer_names:
            await prefill.push_layer(reservation, layer, src)
        result = await prefill.finish("req-layers")
        completion = await decode.wait_for_kv("req-layers", timeout=10)
        assert result.transport is TransportKind.VERBS and completion.nbytes == result.nbytes
        rdma = decode._transports[TransportKind.VERBS]
        assert isinstance(rdma, VerbsTransport)
        assert rdma.stats["immediates_matched"] == len(prefill.layout.layer_names)
        for layer in prefill.layout.layer_names:
            sent, landed = prefill.backing.view(layer), decode.backing.view(layer)
            parts = prefill.layout.layer(layer).geometry.parts
            sent, landed = (sent[:, src], landed[:, dst]) if parts == 2 else (sent[src], landed[dst])
            assert torch.equal(sent.contiguous().view(torch.uint8), landed.contiguous().view(torch.uint8))
        # Canaries: no byte outside the request's blocks changed.
        written = np.zeros(before.size, dtype=bool)
        plan = plan_transfer(prefill.info, decode.info, src, dst)
        for _, _, _, offset, nbytes in plan.ops.rows():
            written[offset : offset + nbytes] = True
        after = decode.backing.regions[0].tensor.numpy()
        assert np.array_equal(after[~written], before[~written])
    finally:
        await prefill.close()
        await decode.close()


# ---- who may open a queue pair: registered prefill engines, at their current incarnation --------


def _connect_request(
    transport: VerbsTransport, destination: Any, src_engine: str, src_incarnation: int
) -> bytes:
    from kvray.wire import VerbsConnect, encode

    return encode(
        VerbsConnect(
            src_engine=src_engine,
            src_incarnation=src_incarnation,
            dst_engine=destination.engine_id,
            dst_incarnation=destination.incarnation,
            endpoint=transport.endpoint,
            qp_num=4242,
            psn=7,
        )
    )


@pytest.mark.parametrize("claim", ["unregistered", "decode-engine", "old-incarnation", "future-incarnation"])
async def test_accept_refuses_writers_that_are_not_registered_prefill_engines(
    fake: TransportUnderTest, claim: str
) -> None:
    from kvray.errors import MetadataError, StaleIncarnationError, UnknownEngineError

    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    old_source = fake.source(layout)
    source = fake.source(layout)  # prefill-0 restarted: the directory names this life
    destination = fake.destination(layout)
    other_decode = fake.destination(layout, engine_id="decode-1")
    transport = verbs(fake)
    src_engine, src_incarnation, error = {
        "unregistered": ("prefill-9", 1, UnknownEngineError),
        "decode-engine": (other_decode.engine_id, other_decode.incarnation, MetadataError),
        "old-incarnation": ("prefill-0", old_source.incarnation, StaleIncarnationError),
        "future-incarnation": ("prefill-0", source.incarnation + 1, StaleIncarnationError),
    }[claim]
    request = _connect_request(transport, destination, src_engine, src_incarnation)
    queue_pairs = len(fake.fabric.qps)

    with pytest.raises(error):
        await transport.accept(request, destination.backing, destination.info, fake.registered)

    assert transport.stats["connections_accepted"] == 0
    assert len(fake.fabric.qps) == queue_pairs
    # The registered writer still connects and writes.
    local, remote = fake.scattered(layout.num_blocks, 3)
    before = fake.snapshot(destination)
    plan = fake.plan(source, destination, local, remote)
    await fake.write(plan, source, destination)
    fake.assert_landed(plan, source, destination, before, local, remote)
    assert transport.stats["connections_accepted"] == 1


async def test_accept_holds_at_most_max_cached_peers_writers(fake: TransportUnderTest) -> None:
    from kvray.errors import BackpressureError

    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    transport = verbs(fake)
    transport.settings = msgspec.structs.replace(transport.settings, max_cached_peers=1)
    first, second = fake.source(layout), fake.source(layout, engine_id="prefill-1")
    destination = fake.destination(layout)
    local, remote = fake.scattered(layout.num_blocks, 3)
    await fake.write(fake.plan(first, destination, local, remote), first, destination)
    assert transport.stats["connections_accepted"] == 1

    request = _connect_request(transport, destination, second.engine_id, second.incarnation)
    with pytest.raises(BackpressureError, match="max_cached_peers"):
        await transport.accept(request, destination.backing, destination.info, fake.registered)
    # The writer that holds the one slot may connect again: it replaces its own queue pair.
    again = _connect_request(transport, destination, first.engine_id, first.incarnation)
    await transport.accept(again, destination.backing, destination.info, fake.registered)
    assert transport.stats["connections_accepted"] == 2
