"""What only the `verbs` transport has, on the FAKE RDMA device (tests/transport/fake_verbs.py):
immediates matched against expected transfers, errors the device reports (a write past a memory
region, a key without REMOTE_WRITE), the handshake refusing engines that expose nothing and
writers that are not registered prefill engines, device choice. Two agents moving requests
through it: test_verbs_agents.py.

The contract suite (test_contract.py) runs the shared guarantees on this device too
(`verbs-fake`), and on a real RDMA device through pyverbs (`verbs`, skipped without one)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pytest
from fake_verbs import ENUMS, FakeFabric
from test_contract import ready_layout, with_ops

from kvray.config import Settings
from kvray.errors import RegionError, WriteFailedError
from kvray.layout import BlockOrder
from kvray.memory import MemoryKind
from kvray.transport.base import Peer, Reach
from kvray.transport.verbs import VerbsTransport, probe
from kvray.wire import TransferDone

if TYPE_CHECKING:
    from conftest import Engine, TransportUnderTest


@pytest.fixture
def fake(verbs_fake: TransportUnderTest) -> TransportUnderTest:
    return verbs_fake


def verbs(tut: TransportUnderTest) -> VerbsTransport:
    assert isinstance(tut.transport, VerbsTransport)
    return tut.transport


def done(plan: Any, immediates: int) -> TransferDone:
    """The writer's completion notice for `plan`, naming `immediates` WRITE WITH IMMEDIATE requests."""
    return TransferDone(
        transfer_id=f"{plan.request_id}@test",
        request_id=plan.request_id,
        src_engine=plan.src_engine,
        src_incarnation=plan.src_incarnation,
        dst_engine=plan.dst_engine,
        dst_incarnation=plan.dst_incarnation,
        nbytes=plan.nbytes,
        arrival_proofs=immediates,
    )


async def test_the_last_request_carries_the_immediate_the_decode_side_expects(
    fake: TransportUnderTest,
) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source, destination = fake.source(layout), fake.destination(layout)
    local, remote = fake.scattered(layout.num_blocks, 9)
    plan = dataclasses.replace(fake.plan(source, destination, local, remote), request_id="req-1")
    before = fake.snapshot(destination)
    transport, receiver = verbs(fake), fake.receiver(destination)
    transport.expect(receiver, "req-1")

    await fake.write(plan, source, destination)

    fake.assert_landed(plan, source, destination, before, local, remote)
    # The one immediate came, from this writer incarnation; a notice naming none waits for none.
    await asyncio.wait_for(transport.complete(receiver, done(plan, immediates=1)), 10)
    await transport.complete(receiver, done(plan, immediates=0))
    assert transport.expected_requests("decode-0", destination.incarnation) == ["req-1"]
    transport.release(receiver, "req-1")
    assert transport.expected_requests("decode-0", destination.incarnation) == []
    opcodes = [opcode for opcode, *_ in fake.fabric.executed]
    assert opcodes[-1] == ENUMS.IBV_WR_RDMA_WRITE_WITH_IMM
    assert opcodes.count(ENUMS.IBV_WR_RDMA_WRITE_WITH_IMM) == 1 and len(opcodes) > 1
    assert max(sges for _, sges, _, _ in fake.fabric.executed) <= fake.fabric.max_sge
    assert sum(nbytes for _, _, nbytes, _ in fake.fabric.executed) == plan.nbytes


async def test_expected_requests_are_told_apart_by_tag(fake: TransportUnderTest) -> None:
    """Immediates carry a 32-bit tag of the request id: two expected requests may not share one,
    and an immediate for a request that is not expected completes nothing."""
    from kvray.errors import PlanError
    from kvray.transport.verbs import transfer_tag

    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source, destination = fake.source(layout), fake.destination(layout)
    plan = fake.plan(source, destination, *fake.scattered(layout.num_blocks, 2))
    transport, receiver = verbs(fake), fake.receiver(destination)
    assert transfer_tag("req-104381") == transfer_tag("req-105609")
    transport.expect(receiver, "req-104381")
    transport.expect(receiver, "req-104381")  # again: the same request, nothing new
    with pytest.raises(PlanError, match="share the 32-bit RDMA transfer tag"):
        transport.expect(receiver, "req-105609")
    with pytest.raises(PlanError, match="does not expect RDMA writes"):
        await transport.complete(receiver, done(dataclasses.replace(plan, request_id="req-105609"), 1))
    transport.release(receiver, "req-104381")
    transport.release(receiver, "req-104381")  # a request no longer expected: nothing to do
    transport.expect(receiver, "req-105609")
    assert transport.expected_requests("decode-0", destination.incarnation) == ["req-105609"]


async def test_unknown_and_stale_immediates_are_dropped(fake: TransportUnderTest) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = fake.source(layout)
    old = fake.destination(layout, engine_id="decode-0")
    new = fake.destination(layout, engine_id="decode-0")
    local, remote = fake.scattered(layout.num_blocks, 3)
    transport = verbs(fake)
    transport.expect(fake.receiver(new), "req-a")

    def plan(destination: Any, request_id: str) -> Any:
        return dataclasses.replace(fake.plan(source, destination, local, remote), request_id=request_id)

    await fake.write(plan(old, "req-a"), source, old)  # the right id, for the old life
    await fake.write(plan(new, "req-b"), source, new)  # the new life, an id nobody expects
    await fake.write(plan(new, "req-a"), source, new)
    await asyncio.wait_for(transport.complete(fake.receiver(new), done(plan(new, "req-a"), 1)), 10)

    assert transport.metrics.counts["rdma_receives_unknown"] == 2
    assert transport.metrics.counts["rdma_receives_matched"] == 1


def writer(engine: Engine) -> tuple[str, int]:
    return engine.engine_id, engine.incarnation


async def test_device_refuses_a_write_past_the_memory_region(fake: TransportUnderTest) -> None:
    """The transport's own checks are bypassed (forged lengths): the device still refuses."""
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source, destination = fake.source(layout), fake.destination(layout)
    local, remote = fake.scattered(layout.num_blocks, 4)
    plan = fake.plan(source, destination, local, remote)
    await fake.write(plan, source, destination)  # connects
    connection = verbs(fake)._connections.get("decode-0", destination.incarnation, writer(source))
    assert connection is not None
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
    connection = transport._connections.get("decode-0", destination.incarnation, writer(source))
    registration = transport.registrations.get(source.backing)
    assert connection is not None and registration is not None
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


def test_verbs_writes_across_nodes_into_engines_that_publish_a_port(fake: TransportUnderTest) -> None:
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    destination = fake.destination(layout)
    transport = verbs(fake)
    assert VerbsTransport.reach is Reach.OTHER_NODES and VerbsTransport.registers == frozenset()
    every = {MemoryKind.CPU, MemoryKind.SHM, MemoryKind.CUDA}
    assert VerbsTransport.source_kinds == every and VerbsTransport.destination_kinds == every
    assert not VerbsTransport.accepts(destination.info)
    published = transport.publish(destination.info, fake.receiver(destination))
    assert published.verbs == transport.endpoint and VerbsTransport.accepts(published)
    assert msgspec.structs.replace(published, verbs=None) == destination.info


async def test_a_writer_keeps_connections_to_at_most_max_cached_peers_engines(
    fake: TransportUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `max_cached_peers` decode engines the least recently used one's connection is
    retired: a write still using it ends as it would have, then its queue pair closes; the next
    write to that engine connects again."""
    from kvray.transport import cpu_copy

    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    source = fake.source(layout)
    first, second = fake.destination(layout), fake.destination(layout, engine_id="decode-1")
    writing = VerbsTransport(Settings(max_cached_peers=1), api=fake.fabric.api())
    local, remote = fake.scattered(layout.num_blocks, 4)
    gate, entered = threading.Event(), threading.Event()
    copy = cpu_copy.scatter_copy

    def gated_copy(*args: Any) -> None:  # what the fake NIC copies with, on its thread
        entered.set()
        assert gate.wait(10), "the test never opened the gate"
        copy(*args)

    try:
        into_first = fake.plan(source, first, local, remote)
        before = fake.snapshot(first)
        monkeypatch.setattr(cpu_copy, "scatter_copy", gated_copy)
        held = asyncio.ensure_future(writing.write(into_first, source.backing, fake.peer(first)))
        assert await asyncio.to_thread(entered.wait, 10)
        connection = writing._connections.get("decode-0", first.incarnation, writer(source))
        assert connection is not None and connection.in_flight

        into_second = asyncio.ensure_future(
            writing.write(fake.plan(source, second, local, remote), source.backing, fake.peer(second))
        )
        for _ in range(100):  # until the second engine's connection is made (no byte moves yet)
            if writing._connections.get("decode-1", second.incarnation, writer(source)) is not None:
                break
            await asyncio.sleep(0.01)
        assert connection.retired and not connection.qp.closed, "retired while a write used it"
        assert writing._connections.get("decode-0", first.incarnation, writer(source)) is None

        gate.set()
        await asyncio.wait_for(asyncio.gather(held, into_second), 10)
        fake.assert_landed(into_first, source, first, before, local, remote)
        assert connection.qp.closed, "the retired connection's queue pair outlived its last write"

        fake.refill(source)
        before = fake.snapshot(first)
        await writing.write(into_first, source.backing, fake.peer(first))
        fake.assert_landed(into_first, source, first, before, local, remote)
        assert writing._connections.get("decode-0", first.incarnation, writer(source)) is not connection
    finally:
        gate.set()
        await writing.close()


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
            await transport.accept(fake.receiver(destination), garbage)
    assert transport.metrics.counts["rdma_connections_accepted"] == 0
    fake.assert_unchanged(destination, before)


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
        await transport.accept(fake.receiver(destination), request)

    assert transport.metrics.counts["rdma_connections_accepted"] == 0
    assert len(fake.fabric.qps) == queue_pairs
    # The registered writer still connects and writes.
    local, remote = fake.scattered(layout.num_blocks, 3)
    before = fake.snapshot(destination)
    plan = fake.plan(source, destination, local, remote)
    await fake.write(plan, source, destination)
    fake.assert_landed(plan, source, destination, before, local, remote)
    assert transport.metrics.counts["rdma_connections_accepted"] == 1


async def test_accept_holds_at_most_max_cached_peers_writers(fake: TransportUnderTest) -> None:
    from kvray.errors import BackpressureError

    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    transport = verbs(fake)
    transport.settings = msgspec.structs.replace(transport.settings, max_cached_peers=1)
    first, second = fake.source(layout), fake.source(layout, engine_id="prefill-1")
    destination = fake.destination(layout)
    local, remote = fake.scattered(layout.num_blocks, 3)
    await fake.write(fake.plan(first, destination, local, remote), first, destination)
    assert transport.metrics.counts["rdma_connections_accepted"] == 1

    request = _connect_request(transport, destination, second.engine_id, second.incarnation)
    with pytest.raises(BackpressureError, match="max_cached_peers"):
        await transport.accept(fake.receiver(destination), request)
    # The writer that holds the one slot may connect again: it replaces its own queue pair.
    again = _connect_request(transport, destination, first.engine_id, first.incarnation)
    await transport.accept(fake.receiver(destination), again)
    assert transport.metrics.counts["rdma_connections_accepted"] == 2
