"""KV integrity end to end between two agents, on every transport this machine can run without
hardware: `shm` (one node), `ray` (its delivery path, the peer's actor stood in), and `verbs`
on the fake RDMA fabric (two "nodes"). The writer hashes each layer's bytes as it pushes them;
the decode side hashes the bytes as they landed in its blocks and lets the request complete
only when every layer agrees. A byte flipped on the way (`kvray.faults.ByteFlipper`) or a plan
that writes a layer over another (the seed bug) fails the request with `KVIntegrityError`
naming the layers, counted in the metrics; blocks outside the request stay as they were.
(`cuda_ipc`: tests/gpu/test_integrity_gpu.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch
from fake_verbs import FakeFabric
from test_contract import ready_layout
from test_verbs_agents import AgentActorStandIn, _Method

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import KVIntegrityError, PlanError
from kvray.faults import ByteFlipper, SeedBugOffsetCache, executor_offset_bug
from kvray.layout import BlockOrder, Geometry, KVLayout, LayerSpec
from kvray.metrics import MemorySink
from kvray.transport.ray import RayTransport
from kvray.transport.verbs import VerbsTransport
from kvray.wire import Role, TransportKind

TRANSPORTS = ("shm", "ray", "verbs")
#: Four layers of one geometry: the seed bug writes them all to the first one's place.
SAME_GEOMETRY = KVLayout(
    layers=tuple(
        LayerSpec(
            name=f"dense{i}", geometry=Geometry(block_size=16, entry_shape=(2, 64), dtype="bfloat16", parts=2)
        )
        for i in range(4)
    ),
    num_blocks=24,
)


class StandIn(AgentActorStandIn):
    """IN-PROCESS STAND-IN for the decode agent's Ray actor, with the `ray` transport's delivery."""

    def __init__(self, agent: KVAgent) -> None:
        super().__init__(agent)
        self.kvray_deliver = _Method(agent.deliver)


@dataclass
class Pair:
    prefill: KVAgent
    decode: KVAgent
    kind: TransportKind
    flipper: ByteFlipper
    sink: MemorySink


def _agents(
    kind: str,
    tmp_path: Path,
    layout: KVLayout,
    flip: bool,
    seed_bug: bool,
    sample_rate: float,
    integrity: bool = True,
) -> tuple[KVAgent, KVAgent, ByteFlipper, MemorySink]:
    settings = Settings(
        shm_dir=str(tmp_path),
        transport=kind,
        transfer_timeout_s=10.0,
        notify_timeout_s=5.0,
        integrity=integrity,
    )
    writer_settings = msgspec.structs.replace(settings, integrity_sample_rate=sample_rate)
    flipper = ByteFlipper(every=1 if flip else 1 << 30)
    sink = MemorySink()
    prefill_transports: list[Any] = []
    decode_transports: list[Any] = []
    if kind == "verbs":
        fabric = FakeFabric()
        prefill_transports = [VerbsTransport(settings, api=fabric.api())]
        decode_transports = [VerbsTransport(settings, api=fabric.api())]
    prefill = KVAgent(
        "p",
        Role.PREFILL,
        layout,
        settings=writer_settings,
        use_coordinator=False,
        transports=prefill_transports,
        transport_hook=flipper,
        offset_cache=SeedBugOffsetCache() if seed_bug else None,
    )
    decode = KVAgent(
        "d",
        Role.DECODE,
        layout,
        settings=settings,
        use_coordinator=False,
        transports=decode_transports,
        metrics_sink=sink,
    )
    if kind == "verbs":
        prefill.node_id, decode.node_id = "node-a", "node-b"
    return prefill, decode, flipper, sink


@pytest_asyncio.fixture(loop_scope="function")
async def make_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    # As inside a Ray actor: the `ray` transport may be chosen (its peer's actor is stood in).
    monkeypatch.setattr(RayTransport, "unavailable_reason", classmethod(lambda cls, settings: None))
    made: list[Pair] = []

    async def make(
        kind: str,
        layout: KVLayout | None = None,
        *,
        flip: bool = False,
        seed_bug: bool = False,
        sample_rate: float = 1.0,
        integrity: bool = True,
    ) -> Pair:
        layout = layout or ready_layout("mixed", BlockOrder.LAYER_MAJOR)
        prefill, decode, flipper, sink = _agents(
            kind, tmp_path, layout, flip, seed_bug, sample_rate, integrity
        )
        await decode.start()
        await prefill.start()
        prefill.add_peer(decode.info, StandIn(decode))
        decode.add_peer(prefill.info)
        rng = np.random.default_rng(5)
        for agent in (prefill, decode):
            for region in agent.backing.regions:
                data = (region.allocation if region.allocation is not None else region.tensor).numpy()
                data[:] = rng.integers(0, 256, data.size, dtype=np.uint8)
        pair = Pair(prefill, decode, TransportKind(kind), flipper, sink)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        await pair.prefill.close()
        await pair.decode.close()


def _blocks(agent: KVAgent, layer: str, ids: np.ndarray) -> torch.Tensor:
    view = agent.backing.view(layer)
    picked = view[:, ids] if agent.layout.layer(layer).geometry.parts == 2 else view[ids]
    return picked.contiguous().view(torch.uint8)


def _memory(agent: KVAgent) -> list[np.ndarray]:
    """Every byte of the agent's allocations (the canaries around its regions included)."""
    return [
        (region.allocation if region.allocation is not None else region.tensor).numpy().copy()
        for region in agent.backing.regions
    ]


SRC, DST = np.array([3, 1, 4, 15, 9]), np.array([10, 11, 5, 20, 2])


async def _push_one_flipped(pair: Pair, request: str, layerwise: bool) -> None:
    """Push SRC into DST with the pair's flipper on: whole, or layer by layer with one layer in
    the middle corrupted and the others intact."""
    prefill = pair.prefill
    reservation = pair.decode.expect(request, DST)
    if layerwise:
        pair.flipper.every = len(prefill.layout.layer_names)
        for layer in prefill.layout.layer_names:
            await prefill.push_layer(reservation, layer, SRC)
        await prefill.finish(request)
    else:
        await prefill.push(reservation, SRC)


async def _lands_exactly(pair: Pair, request: str) -> None:
    """A push of SRC into DST is taken and every layer's bytes landed as sent."""
    reservation = pair.decode.expect(request, DST)
    await pair.prefill.push(reservation, SRC)
    await pair.decode.wait_for_kv(request, timeout=10)
    for layer in pair.prefill.layout.layer_names:
        assert torch.equal(_blocks(pair.prefill, layer, SRC), _blocks(pair.decode, layer, DST)), layer
    await pair.decode.release(request)


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
async def test_kv_that_lands_intact_is_checked_and_taken(make_pair: Any, kind: str, layerwise: bool) -> None:
    pair: Pair = await make_pair(kind)
    prefill, decode = pair.prefill, pair.decode
    before = _memory(decode)
    reservation = decode.expect("r", DST)
    if layerwise:
        for layer in prefill.layout.layer_names:
            await prefill.push_layer(reservation, layer, SRC)
        result = await prefill.finish("r")
    else:
        result = await prefill.push(reservation, SRC)
    assert result.transport is pair.kind
    await decode.wait_for_kv("r", timeout=10)
    for layer in prefill.layout.layer_names:
        assert torch.equal(_blocks(prefill, layer, SRC), _blocks(decode, layer, DST)), layer
    # Only the reserved blocks changed.
    after = _memory(decode)
    changed = sum(int((a != b).sum()) for a, b in zip(before, after, strict=True))
    assert 0 < changed <= result.nbytes
    assert pair.sink.value("kvray_integrity_checks", result="ok") == 1
    assert pair.sink.value("kvray_integrity_checks", result="mismatch") == 0
    assert pair.sink.observations("kvray_integrity_seconds")


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
async def test_a_byte_flipped_on_the_way_fails_the_request_naming_its_layer(
    make_pair: Any, kind: str, layerwise: bool
) -> None:
    pair: Pair = await make_pair(kind, flip=True)
    prefill, decode = pair.prefill, pair.decode
    sent = _memory(prefill)
    await _push_one_flipped(pair, "r", layerwise)
    with pytest.raises(KVIntegrityError) as raised:
        await decode.wait_for_kv("r", timeout=10)
    flipped_layers = [layer for request, layer in pair.flipper.flipped if request == "r"]
    assert len(flipped_layers) == 1
    assert raised.value.facts["layers"] == flipped_layers
    assert flipped_layers[0] in str(raised.value)
    # Exactly one bit differs from what was sent, in that layer's blocks.
    differing = [
        layer
        for layer in prefill.layout.layer_names
        if not torch.equal(_blocks(prefill, layer, SRC), _blocks(decode, layer, DST))
    ]
    assert differing == flipped_layers
    bits = (_blocks(prefill, differing[0], SRC) ^ _blocks(decode, differing[0], DST)).numpy()
    assert int(np.unpackbits(bits).sum()) == 1
    # The writer's memory is as it was.
    assert all(np.array_equal(a, b) for a, b in zip(sent, _memory(prefill), strict=True))
    assert pair.sink.value("kvray_integrity_checks", result="mismatch") == 1
    assert pair.sink.value("kvray_integrity_mismatched_layers") == 1
    await decode.release("r")


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_the_seed_bug_fails_the_request_naming_the_layers_it_wrote_over(
    make_pair: Any, kind: str
) -> None:
    pair: Pair = await make_pair(kind, SAME_GEOMETRY, seed_bug=True)
    prefill, decode = pair.prefill, pair.decode
    reservation = decode.expect("r", DST)
    await prefill.push(reservation, SRC)
    with pytest.raises(KVIntegrityError) as raised:
        await decode.wait_for_kv("r", timeout=10)
    # Every layer went to dense0's place: the others' places got nothing, and dense0's holds
    # whichever layer's bytes landed last (its own only if they did).
    wrong = raised.value.facts["layers"]
    assert {"dense1", "dense2", "dense3"} <= set(wrong) <= {"dense0", "dense1", "dense2", "dense3"}
    assert pair.sink.value("kvray_integrity_mismatched_layers") == len(wrong)
    await decode.release("r")


async def test_with_integrity_off_unsampled_requests_are_taken_unchecked_and_counted(make_pair: Any) -> None:
    pair: Pair = await make_pair("shm", flip=True, sample_rate=0.0, integrity=False)
    prefill, decode = pair.prefill, pair.decode
    reservation = decode.expect("r", DST)
    await prefill.push(reservation, SRC)
    await decode.wait_for_kv("r", timeout=10)  # not checked: the flip goes unseen
    await asyncio.sleep(0)  # the completion is counted once the waiter has resumed
    assert pair.sink.value("kvray_integrity_checks", result="unchecked") == 1
    assert pair.sink.value("kvray_integrity_checks", result="mismatch") == 0


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
async def test_the_seed_bug_is_refused_on_every_request_with_no_byte_checked(
    make_pair: Any, kind: str, layerwise: bool
) -> None:
    """The placement check runs on every transfer: with no request's bytes hashed (no content
    check, no sampled checksums), a plan that writes layers over each other still never
    completes a request."""
    pair: Pair = await make_pair(kind, SAME_GEOMETRY, seed_bug=True, sample_rate=0.0, integrity=False)
    prefill, decode = pair.prefill, pair.decode
    for number in range(3):
        request = f"r{number}"
        reservation = decode.expect(request, DST)
        if layerwise:
            for layer in prefill.layout.layer_names:
                await prefill.push_layer(reservation, layer, SRC)
            await prefill.finish(request)
        else:
            await prefill.push(reservation, SRC)
        with pytest.raises(KVIntegrityError, match="placement digest") as raised:
            await decode.wait_for_kv(request, timeout=10)
        assert raised.value.facts["layers"] == list(SAME_GEOMETRY.layer_names)
        await decode.release(request)
    assert pair.sink.value("kvray_integrity_checks", result="mismatch") == 3


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_an_executor_that_stores_elsewhere_than_its_correct_plan_is_refused(
    make_pair: Any, kind: str
) -> None:
    """`kvray.faults.executor_offset_bug`: the plan is right, the copy executor (the writer's C
    copy for shm, the decode engine's scatter for ray; for verbs, this stand-in NIC's copy) puts
    one op's bytes over another's. The digest it reports is of where it stored (shm, ray), or
    the bytes are not where the writer's landed digest says (verbs, whose NIC reports
    nothing), so the request fails; the same push without the fault lands exactly."""
    pair: Pair = await make_pair(kind, sample_rate=0.0)
    prefill, decode = pair.prefill, pair.decode
    reservation = decode.expect("bad", DST)
    with executor_offset_bug():
        await prefill.push(reservation, SRC)
    refusal = "landed digest" if kind == "verbs" else "stored elsewhere than planned"
    with pytest.raises(KVIntegrityError, match=refusal):
        await decode.wait_for_kv("bad", timeout=10)
    await decode.release("bad")
    await _lands_exactly(pair, "good")


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
async def test_a_flipped_byte_is_caught_on_every_request_by_the_copys_own_digest(
    make_pair: Any, kind: str, layerwise: bool
) -> None:
    """At the defaults (no request sampled for the slow check), the copy that moves the bytes
    hashes them (`kvray.content`): a byte flipped on the way differs from the digest the writer
    took from its blocks, and the request fails; the next, intact, is taken. Where the copy does
    not hash (an RDMA NIC's, `verbs`), the decode side hashes what landed after the last write
    against the writer's landed digest."""
    pair: Pair = await make_pair(kind, flip=True, sample_rate=0.0)
    prefill, decode = pair.prefill, pair.decode
    await _push_one_flipped(pair, "r", layerwise)
    with pytest.raises(KVIntegrityError, match="landed digest" if kind == "verbs" else "content digest"):
        await decode.wait_for_kv("r", timeout=10)
    await decode.release("r")
    pair.flipper.every = 1 << 30
    reservation = decode.expect("next", DST)
    await prefill.push(reservation, SRC)
    await decode.wait_for_kv("next", timeout=10)
    await asyncio.sleep(0)  # a completion is counted once its waiting task has resumed
    assert pair.sink.value("kvray_integrity_checks", result="mismatch") == 1
    assert pair.sink.value("kvray_integrity_checks", result="ok") == 1


@pytest.mark.parametrize("sample_rate", [0.0, 1.0], ids=["digests", "sampled"])
@pytest.mark.parametrize("kind", ["shm", "ray"])
async def test_digests_held_before_the_push_check_it_and_a_block_written_after_fails_closed(
    make_pair: Any, kind: str, sample_rate: float
) -> None:
    """`hold_digests`: the writer takes its blocks' digests when their KV is held, and the push
    checks its copy against them without reading the blocks on its own path. A push uses them
    once. A block the engine writes after holding, without holding again, fails the request
    (its copy hashes the new bytes, the held digest is of the old): never decoded wrong. So
    too where the request is sampled for checksums: those are taken at push time, of the new
    bytes, and match what landed; the held digest still refuses it."""
    pair: Pair = await make_pair(kind, sample_rate=sample_rate)
    prefill, decode = pair.prefill, pair.decode
    await prefill.hold_digests(SRC)
    reservation = decode.expect("held", DST)
    await prefill.push(reservation, SRC)
    await decode.wait_for_kv("held", timeout=10)
    await decode.release("held")
    # Held again, then one block rewritten behind kvray's back.
    await prefill.hold_digests(SRC)
    layer = prefill.layout.layer_names[0]
    view = prefill.backing.view(layer)
    block = view[:, SRC[0]] if prefill.layout.layer(layer).geometry.parts == 2 else view[SRC[0]]
    block.view(torch.uint8).bitwise_not_()
    reservation = decode.expect("stale", DST)
    await prefill.push(reservation, SRC)
    with pytest.raises(KVIntegrityError, match="content digest"):
        await decode.wait_for_kv("stale", timeout=10)
    await decode.release("stale")
    assert pair.sink.value("kvray_integrity_checks", result="mismatch") == 1
    # Used once: the next push reads the blocks itself and is taken.
    await _lands_exactly(pair, "fresh")
    # Held, then given back to the engine (`forget_digests`) and rewritten: the push reads the
    # new bytes itself and is taken.
    await prefill.hold_digests(SRC)
    prefill.forget_digests(SRC)
    block.view(torch.uint8).bitwise_not_()
    await _lands_exactly(pair, "rewritten")


@pytest.mark.parametrize("kind", ["shm", "ray"])
async def test_a_push_asked_for_while_its_hold_still_hashes_waits_for_those_digests(
    make_pair: Any, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push that starts while the hold of its blocks is still hashing them (a decode engine
    that asked before the request finished) takes the hold's digests, not a second hash of the
    same bytes; a hold of other blocks does not hold it up; both pushes are checked."""
    pair: Pair = await make_pair(kind, sample_rate=0.0)
    prefill, decode = pair.prefill, pair.decode
    transport = type(prefill._transports.choose(decode.info, prefill.node_id))
    references: list[int] = []
    reference = transport.reference

    async def counted(self: Any, *args: Any, **kwargs: Any) -> int:
        references.append(1)
        return await reference(self, *args, **kwargs)

    monkeypatch.setattr(transport, "reference", counted)
    hold = asyncio.create_task(prefill.hold_digests(SRC))
    await asyncio.sleep(0)  # the hold has begun hashing
    reservation = decode.expect("asked-early", DST)
    await prefill.push(reservation, SRC)
    await hold
    await decode.wait_for_kv("asked-early", timeout=10)
    await decode.release("asked-early")
    assert references == []
    # A hold of other blocks in flight: the push hashes its own at once.
    other = [block for block in range(prefill.layout.num_blocks) if block not in SRC][: len(SRC)]
    hold = asyncio.create_task(prefill.hold_digests(other))
    await asyncio.sleep(0)
    await _lands_exactly(pair, "unheld")
    await hold
    await asyncio.sleep(0)  # a completion is counted once its waiting task has resumed
    assert references == [1]
    assert pair.sink.value("kvray_integrity_checks", result="ok") == 2


#: One layer of 64 KiB blocks: a push of 80 of them (5 MiB) is copied by the C pool's threads,
#: whose last thread sends the completion notice itself, its digests filled in.
POOLED = KVLayout(
    layers=(LayerSpec(name="kv", geometry=Geometry(block_size=16, entry_shape=(1024,), dtype="float32")),),
    num_blocks=96,
)


@pytest.mark.parametrize("kind", ["shm", "ray"])
@pytest.mark.parametrize("integrity", [True, False], ids=["checked", "unchecked"])
async def test_a_pooled_copy_completes_checked_or_not(make_pair: Any, kind: str, integrity: bool) -> None:
    """The notice the C pool's thread sends carries exactly the digests the request is checked
    by (an unchecked push once sent a notice whose content field the thread overwrote: dropped
    as malformed, the request hung to its deadline)."""
    pair: Pair = await make_pair(kind, POOLED, sample_rate=0.0, integrity=integrity)
    prefill, decode = pair.prefill, pair.decode
    src, dst = np.arange(80), np.arange(95, 15, -1)
    reservation = decode.expect("big", dst)
    result = await prefill.push(reservation, src)
    assert result.nbytes > 4 * 2**20
    await decode.wait_for_kv("big", timeout=10)
    await asyncio.sleep(0)  # a completion is counted once its waiting task has resumed
    assert torch.equal(_blocks(prefill, "kv", src), _blocks(decode, "kv", dst))
    assert pair.sink.value("kvray_integrity_checks", result="ok") == (1 if integrity else 0)


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
async def test_kv_of_fewer_layers_than_expected_is_refused(
    make_pair: Any, kind: str, layerwise: bool
) -> None:
    """A decode engine expects every one of its layers by default: a transfer of one of four
    (whole, or layer-wise then finished) fails the request naming the missing three, under every
    check setting (it is decided from the notice's layers, before any byte is looked at); a
    request that expects only that layer takes it."""
    pair: Pair = await make_pair(kind, SAME_GEOMETRY, sample_rate=0.0, integrity=False)
    prefill, decode = pair.prefill, pair.decode
    first = SAME_GEOMETRY.layer_names[0]

    async def push_first(request: str, layers: list[str] | None) -> None:
        reservation = decode.expect(request, DST, layers)
        if layerwise:
            await prefill.push_layer(reservation, first, SRC)
            await prefill.finish(request)
        else:
            await prefill.push(reservation, SRC, [first])

    await push_first("short", None)
    with pytest.raises(KVIntegrityError, match="covers 1 layer") as raised:
        await decode.wait_for_kv("short", timeout=10)
    assert raised.value.facts["layers"] == list(SAME_GEOMETRY.layer_names[1:])
    await decode.release("short")
    await push_first("one", [first])
    await decode.wait_for_kv("one", timeout=10)
    await decode.release("one")
    with pytest.raises(PlanError, match="distinct layers"):
        decode.expect("bad", DST, ["no-such-layer"])


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_block_zeroed_on_the_way_is_caught_on_every_request(make_pair: Any, kind: str) -> None:
    """At the defaults (no request sampled for the slow check): a whole op's bytes (a block's
    part of a layer) arriving as zeros fails the request, by the copy's content digest or, on
    `verbs`, the landed digest; the writer's memory is as it was, and the next push is taken."""
    pair: Pair = await make_pair(kind, flip=True, sample_rate=0.0)
    pair.flipper.zero = True
    prefill, decode = pair.prefill, pair.decode
    before = [region.tensor.clone() for region in prefill.backing.regions]
    reservation = decode.expect("zeroed", DST)
    await prefill.push(reservation, SRC)
    with pytest.raises(KVIntegrityError, match="landed digest" if kind == "verbs" else "content digest"):
        await decode.wait_for_kv("zeroed", timeout=10)
    await decode.release("zeroed")
    assert all(
        torch.equal(a, region.tensor) for a, region in zip(before, prefill.backing.regions, strict=True)
    )
    pair.flipper.every = 1 << 30
    await _lands_exactly(pair, "after")
