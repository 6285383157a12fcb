"""Two agents on two "nodes", each given a `verbs` transport on one FAKE RDMA fabric
(tests/transport/fake_verbs.py): the prefill agent chooses verbs for a decode engine on another
node that published an RDMA port and moves requests through it, whole and layer by layer; the
decode agent completes a request only once the writer's notice and as many immediates as it
names have come. The transport alone: test_verbs.py."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
import torch
from fake_verbs import FakeFabric
from test_contract import ready_layout

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.layout import BlockOrder
from kvray.plan import plan_transfer
from kvray.transport.base import Peer
from kvray.transport.verbs import VerbsTransport
from kvray.wire import Reservation, Role, TransportKind


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


class TwoNodes(NamedTuple):
    prefill: KVAgent
    decode: KVAgent
    #: The verbs transport given to the decode agent.
    decode_verbs: VerbsTransport


def on_two_nodes(fabric: FakeFabric, settings: Settings | None = None) -> TwoNodes:
    """A prefill agent on "node-a" and a decode agent on "node-b", each given a verbs transport
    on `fabric` (not started)."""
    settings = settings or Settings()
    layout = ready_layout("mixed", BlockOrder.LAYER_MAJOR)
    prefill_verbs = VerbsTransport(settings, api=fabric.api())
    decode_verbs = VerbsTransport(settings, api=fabric.api())
    prefill = KVAgent(
        "prefill-0",
        Role.PREFILL,
        layout,
        settings=settings,
        use_coordinator=False,
        transports=[prefill_verbs],
    )
    decode = KVAgent(
        "decode-0", Role.DECODE, layout, settings=settings, use_coordinator=False, transports=[decode_verbs]
    )
    prefill.node_id, decode.node_id = "node-a", "node-b"
    return TwoNodes(prefill, decode, decode_verbs)


async def two_agents() -> TwoNodes:
    """`on_two_nodes`, started, each knowing the other, the prefill side's memory random."""
    nodes = on_two_nodes(FakeFabric())
    prefill, decode = nodes.prefill, nodes.decode
    await decode.start()
    await prefill.start()
    prefill.add_peer(decode.info, AgentActorStandIn(decode))
    decode.add_peer(prefill.info)
    rng = np.random.default_rng(11)
    data = prefill.backing.regions[0].tensor.numpy()
    data[:] = rng.integers(0, 256, data.size, dtype=np.uint8)
    return nodes


async def test_agents_on_two_nodes_choose_verbs_and_move_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvray.transport.ray import RayTransport

    # As inside a Ray actor: the `ray` transport is what reaches a node without RDMA.
    monkeypatch.setattr(RayTransport, "unavailable_reason", classmethod(lambda cls, settings: None))
    prefill, decode, _ = nodes = on_two_nodes(FakeFabric())
    layout = prefill.layout
    try:
        await decode.start()
        await prefill.start()
        assert decode.info.verbs is not None and prefill.info.verbs is None  # only decode engines publish
        assert decode.info.verbs == nodes.decode_verbs.endpoint
        prefill.add_peer(decode.info, AgentActorStandIn(decode))
        decode.add_peer(prefill.info)  # the decode side takes connections from registered writers only
        peer = await prefill.peer("decode-0")
        assert prefill.choose_transport(peer) is TransportKind.VERBS
        # Other lives of the engine (the choice is kept per peer incarnation): on this node, and
        # without an RDMA port.
        life = decode.info.incarnation
        same_node = Peer(msgspec.structs.replace(decode.info, node_id="node-a", incarnation=life + 1))
        assert prefill.choose_transport(same_node) is TransportKind.SHM
        no_device = Peer(msgspec.structs.replace(decode.info, verbs=None, incarnation=life + 2))
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
            arrival_proofs=immediates,
            token=reservation.token,
        )
    )


async def test_a_notice_alone_does_not_complete_an_rdma_request() -> None:
    """Over verbs the decode side needs its own proof that the bytes landed: the writer's notice
    names how many WRITE WITH IMMEDIATE requests it issued, and wait_for_kv resolves only once
    that many have arrived from that writer incarnation."""
    from kvray.errors import TransferTimeoutError

    prefill, decode, rdma = await two_agents()
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

        # The writer's own notice, asking for the one that came (and carrying the layer's
        # digests, as every checked request over verbs does): it completes, the request
        # expecting that layer alone.
        one = decode.expect("req-one", dst, [layer])
        await prefill.push_layer(one, layer, src)
        await prefill.finish("req-one")
        assert (await decode.wait_for_kv("req-one", timeout=10)).request_id == "req-one"
        await decode.release("req-one")
        assert rdma.expected_requests(decode.engine_id, decode.incarnation) == []  # nothing left behind
    finally:
        await prefill.close()
        await decode.close()


async def test_a_layerwise_rdma_push_completes_after_one_immediate_per_layer() -> None:
    prefill, decode, rdma = await two_agents()
    try:
        src, dst = np.array([5, 0, 7]), np.array([2, 9, 6])
        before = decode.backing.regions[0].tensor.numpy().copy()
        reservation = decode.expect("req-layers", dst)
        for layer in prefill.layout.layer_names:
            await prefill.push_layer(reservation, layer, src)
        result = await prefill.finish("req-layers")
        completion = await decode.wait_for_kv("req-layers", timeout=10)
        assert result.transport is TransportKind.VERBS and completion.nbytes == result.nbytes
        assert rdma.metrics.counts["rdma_receives_matched"] == len(prefill.layout.layer_names)
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
