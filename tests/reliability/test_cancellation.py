"""A request that ends early (cancelled, timed out, released) never lets a byte land in blocks
that another request may hold by then: a decode engine's blocks go back to its pool only once
no write for the request can land, a write that starts later fails at the writer, and only the
holder of a request's reservation can complete it. In one process, over the shm transport
(the claim board) and through the `ray` receiver's own checks, with canaries over the whole
destination allocation."""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import pytest_asyncio
from agent_pair import agent_pair
from process_probes import until

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import (
    BoundsError,
    KvrayError,
    MetadataError,
    NotExpectedError,
    PlanError,
    TransferTimeoutError,
)
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.models.reference import MODEL_PRESETS, ReferenceModel
from kvray.notice.claims import ClaimBoard, ClaimClient
from kvray.notice.local import ENDPOINT as COMPLETION_ENDPOINT
from kvray.notice.local import CompletionOutbox
from kvray.wire import Role, TransferDone, WriteOps, encode
from kvray.workers import DecodeWorker, PrefillWorker

LAYOUT = KVLayout(
    layers=tuple(
        LayerSpec(name=f"layer{i}", geometry=Geometry(block_size=16, entry_shape=(64,), dtype="uint8"))
        for i in range(3)
    ),
    num_blocks=32,
)


def allocation(agent: KVAgent) -> np.ndarray:
    region = agent.backing.regions[0]
    assert region.allocation is not None
    return region.allocation.numpy()


def fill(agent: KVAgent, seed: int) -> None:
    target = allocation(agent)
    target[:] = np.random.default_rng(seed).integers(0, 256, target.size, dtype=np.uint8)


@pytest_asyncio.fixture(loop_scope="function")
async def pair(tmp_path: Path) -> AsyncIterator[tuple[KVAgent, KVAgent]]:
    settings = Settings(shm_dir=str(tmp_path), transport="shm", notify_timeout_s=2.0, transfer_timeout_s=5.0)
    async with agent_pair("c", LAYOUT, settings) as (prefill, decode):
        fill(prefill, 1)
        fill(decode, 2)
        yield prefill, decode


async def test_a_push_after_release_fails_at_the_writer_and_writes_nothing(
    pair: tuple[KVAgent, KVAgent],
) -> None:
    """The shape of a failed push followed by a retry into the same blocks: once the decode side
    released the request, the retry is refused before a byte moves, never reported done."""
    prefill, decode = pair
    reservation = decode.expect("r", [4, 5])
    waiting = asyncio.ensure_future(decode.wait_for_kv("r", timeout=0.05))
    with pytest.raises(TransferTimeoutError):
        await waiting
    await decode.release("r")
    before = allocation(decode).copy()
    with pytest.raises(NotExpectedError):
        await prefill.push(reservation, [0, 1])
    with pytest.raises(NotExpectedError):
        await prefill.push_layer(reservation, "layer0", [0, 1])
    with pytest.raises(KvrayError):  # a request with a failed layer writes no more layers
        await prefill.push_layer(reservation, "layer1", [0, 1])
    np.testing.assert_array_equal(allocation(decode), before)
    assert not any(prefill.stats[f"transfers_{call}_ok"] for call in ("whole", "layer", "finish"))


async def test_layers_after_release_are_refused_and_finish_is_not_reported_done(
    pair: tuple[KVAgent, KVAgent],
) -> None:
    prefill, decode = pair
    reservation = decode.expect("r", [7, 9])
    await prefill.push_layer(reservation, "layer0", [1, 2])
    await decode.release("r")
    before = allocation(decode).copy()
    with pytest.raises(NotExpectedError):
        await prefill.push_layer(reservation, "layer1", [1, 2])
    with pytest.raises(KvrayError):
        await prefill.finish("r")
    np.testing.assert_array_equal(allocation(decode), before)


async def test_release_waits_for_a_writer_holding_the_claim(pair: tuple[KVAgent, KVAgent]) -> None:
    """A writer mid-copy holds the request's slot: release returns only once it lets go, and a
    write that starts after the release is refused."""
    _, decode = pair
    reservation = decode.expect("r", [3])
    writer = ClaimClient(decode.info.endpoints["claim_board"], "c-d", decode.settings.shm_dir)
    held = writer.hold("r", reservation.slot, reservation.token, timeout=1.0)
    await held.__aenter__()
    releasing = asyncio.ensure_future(decode.release("r"))
    await asyncio.sleep(0.1)
    assert not releasing.done(), "release returned while a writer still held the request"
    # While the engine waits, no other write of the request starts: not one joining the held
    # claim in this process, not one through another file description.
    other = ClaimClient(decode.info.endpoints["claim_board"], "c-d", decode.settings.shm_dir)
    for client in (writer, other):
        with pytest.raises(NotExpectedError):
            async with client.hold("r", reservation.slot, reservation.token, timeout=1.0):
                pytest.fail("a write started while the engine was closing the request")
    other.close()
    await held.__aexit__(None, None, None)
    await asyncio.wait_for(releasing, 2.0)
    with pytest.raises(NotExpectedError):
        async with writer.hold("r", reservation.slot, reservation.token, timeout=1.0):
            pytest.fail("a claim after release went through")
    writer.close()


async def test_a_dead_writer_lets_go_of_its_claim(pair: tuple[KVAgent, KVAgent]) -> None:
    """The lock dies with the writer's process: a writer killed mid-write does not hold the
    decode side's blocks forever."""
    _, decode = pair
    reservation = decode.expect("r", [3])
    holder = _lock_holder(decode.info.endpoints["claim_board"], reservation.slot)
    try:
        releasing = asyncio.ensure_future(decode.release("r"))
        await asyncio.sleep(0.1)
        assert not releasing.done()
        holder.kill()
        await asyncio.wait_for(releasing, 2.0)
    finally:
        holder.kill()
        holder.wait()


async def test_blocks_a_writer_holds_past_the_deadline_are_quarantined(tmp_path: Path) -> None:
    settings = Settings(shm_dir=str(tmp_path), transport="shm", transfer_timeout_s=0.2)
    decode = KVAgent("q-d", Role.DECODE, LAYOUT, settings=settings, use_coordinator=False)
    await decode.start()
    try:
        reservation = decode.expect("r", [3])
        holder = _lock_holder(decode.info.endpoints["claim_board"], reservation.slot)
        try:
            with pytest.raises(TransferTimeoutError):
                await decode.release("r")
            let_go = decode.quarantined["r"]
            assert not let_go.is_set()
        finally:
            holder.kill()
            holder.wait()
        await asyncio.wait_for(let_go.wait(), 2.0)
        assert "r" not in decode.quarantined
    finally:
        await decode.close()


def _lock_holder(path: str, slot: int) -> subprocess.Popen[bytes]:
    """Another process holding a writer's lock on `slot` until it is killed."""
    script = (
        "import fcntl, os, struct, sys, time\n"
        f"fd = os.open({path!r}, os.O_RDONLY)\n"
        f"fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack('hhqqi4x', fcntl.F_RDLCK, 0, {slot} * 16, 16, 0))\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == b"held"
    process.stdout.close()  # it says nothing more
    return process


async def test_only_the_reservation_holder_completes_a_request(pair: tuple[KVAgent, KVAgent]) -> None:
    """A notice without the request's token, through the socket or through a Ray call, is
    dropped and counted; the wait goes on and the real push completes it."""
    prefill, decode = pair
    reservation = decode.expect("r", [5, 6])
    waiting = asyncio.ensure_future(decode.wait_for_kv("r", timeout=5.0))
    forged = TransferDone(
        transfer_id="forged",
        request_id="r",
        src_engine="mallory",
        src_incarnation=1,
        dst_engine="c-d",
        dst_incarnation=decode.incarnation,
        nbytes=0,
        token=reservation.token ^ 1,
    )
    outbox = CompletionOutbox(decode.settings.shm_dir)
    await outbox.send(decode.info.endpoints[COMPLETION_ENDPOINT], encode(forged))
    outbox.close()
    untokened = msgspec.structs.replace(forged, token=0)
    with pytest.raises(NotExpectedError):
        await decode.notify(encode(untokened))
    await asyncio.sleep(0.01)
    assert not waiting.done(), "a forged notice completed the request"
    assert decode.stats["messages_dropped_forged"] == 2
    await prefill.push(reservation, [0, 1])
    completion = await waiting
    assert completion.src_engine == "c-p"
    await decode.release("r")


async def test_the_ray_receiver_refuses_ops_outside_the_request_blocks(
    pair: tuple[KVAgent, KVAgent],
) -> None:
    """A write for request A that reaches a block of request B writes nothing, even with A's
    token and inside the region."""
    _, decode = pair
    first = decode.expect("a", [2])
    decode.expect("b", [3])
    placement = decode.info.placement("layer0")
    inside_a = placement.byte_offset(0, 2)
    inside_b = placement.byte_offset(0, 3)
    nbytes = placement.part_nbytes
    before = allocation(decode).copy()
    header = WriteOps(
        transfer_id="t",
        dst_engine="c-d",
        dst_incarnation=decode.incarnation,
        regions=[0, 0],
        remote_offsets=[inside_a, inside_b],
        nbytes=[nbytes, nbytes],
        request_id="a",
        token=first.token,
    )
    payload = np.full(2 * nbytes, 0x5A, dtype=np.uint8)
    with pytest.raises(BoundsError):
        await decode.deliver(encode(header), payload)
    with pytest.raises(NotExpectedError):
        await decode.deliver(encode(msgspec.structs.replace(header, token=0)), payload)
    np.testing.assert_array_equal(allocation(decode), before)
    # The same write inside A's block lands.
    within = msgspec.structs.replace(header, regions=[0], remote_offsets=[inside_a], nbytes=[nbytes])
    assert await decode.deliver(encode(within), payload[:nbytes]) == nbytes
    region_offset = decode.backing.regions[0].span.offset_in_allocation
    after = allocation(decode)
    landed = slice(region_offset + inside_a, region_offset + inside_a + nbytes)
    assert (after[landed] == 0x5A).all()
    outside = np.ones(after.size, dtype=bool)
    outside[landed] = False
    np.testing.assert_array_equal(after[outside], before[outside])


async def test_an_empty_layer_list_is_refused(tmp_path: Path) -> None:
    model = MODEL_PRESETS["mixed"]
    layout = ReferenceModel(model).layout(16)
    settings = Settings(shm_dir=str(tmp_path), transport="shm")
    prefill = PrefillWorker("e-p", layout, settings, model=model)
    decode = DecodeWorker("e-d", layout, settings, model=model)
    await prefill.start()
    await decode.start()
    try:
        prefill.kvray_agent.add_peer(decode.kvray_agent.info)
        reservation = await decode.reserve("r", 2)
        await prefill.allocate("r", 2)
        for layerwise in (False, True):
            with pytest.raises(PlanError):
                await prefill.push(reservation, layers=[], layerwise=layerwise)
        assert prefill.kvray_agent.stats["bytes_pushed"] == 0
    finally:
        await prefill.close()
        await decode.close()


# ---- the ready workers: a cancelled request never writes into the next one's blocks -----------


class SlowLayers:
    """Wraps a model's prefill so each cache layer takes `pause` seconds after it is written
    (a stand-in for a bigger model's compute), and its decode so it can be held at will."""

    def __init__(self, model: ReferenceModel, pause: float) -> None:
        self.pause = pause
        self.decode_gate = threading.Event()
        self.decode_gate.set()
        self.decoding = threading.Event()
        self._prefill = model.prefill
        self._decode = model.decode
        model.prefill = self.prefill  # type: ignore[method-assign]
        model.decode = self.decode  # type: ignore[method-assign]

    def prefill(self, tokens: Any, views: Any, table: Any, on_layer: Any = None) -> int:
        def slow(layer: str) -> None:
            if on_layer is not None:
                on_layer(layer)
            threading.Event().wait(self.pause)

        return self._prefill(tokens, views, table, slow)

    def decode(self, *args: Any) -> list[int]:
        self.decoding.set()
        assert self.decode_gate.wait(10)
        return self._decode(*args)


@pytest_asyncio.fixture(loop_scope="function")
async def workers(tmp_path: Path) -> AsyncIterator[tuple[PrefillWorker, DecodeWorker, SlowLayers]]:
    config = MODEL_PRESETS["mixed"]
    model = ReferenceModel(config)
    # Exactly one request's worth of decode blocks: a second request must reuse the first's.
    layout = model.layout(model.blocks_needed(24))
    settings = Settings(shm_dir=str(tmp_path), transport="shm", transfer_timeout_s=5.0)
    prefill = PrefillWorker("w-p", model.layout(64), settings, model=config)
    decode = DecodeWorker("w-d", layout, settings, model=config)
    assert prefill.model is not None
    slow = SlowLayers(prefill.model, pause=0.03)
    await prefill.start()
    await decode.start()
    prefill.kvray_agent.add_peer(decode.kvray_agent.info)
    yield prefill, decode, slow
    await prefill.close()
    await decode.close()


async def test_a_cancelled_decode_wait_lets_no_late_layer_into_the_next_request(
    workers: tuple[PrefillWorker, DecodeWorker, SlowLayers],
) -> None:
    """R1's decode gives up while its layer-wise prefill is still pushing; R2 then gets R1's
    blocks and its KV. No later byte of R1 may change R2's blocks."""
    prefill, decode, _ = workers
    tokens = list(range(1, 25))
    count = decode.pool.num_blocks
    first = await decode.reserve("r1", count)
    pushing = asyncio.ensure_future(prefill.prefill(tokens, first, layerwise=True))
    await until(lambda: prefill.kvray_agent.stats["bytes_pushed"] > 0, "a first layer pushed", seconds=5.0)
    waiting = asyncio.ensure_future(decode.wait("r1", timeout=5.0))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert decode.pool.free_count == count  # released once no R1 write could land
    second = await decode.reserve("r2", count)
    assert sorted(second.blocks) == sorted(first.blocks)
    current = await decode.read_blocks(second.blocks)
    r2_kv = {layer: np.full_like(data, 0x3C) for layer, data in current.items()}
    await decode.write_blocks(second.blocks, r2_kv)
    with pytest.raises(NotExpectedError):
        await pushing
    after = await decode.read_blocks(second.blocks)
    for layer, data in after.items():
        np.testing.assert_array_equal(data, r2_kv[layer], err_msg=f"R1 wrote into R2's {layer}")
    assert prefill.pool.used_count == 0
    assert not prefill.kvray_agent.layerwise_requests


async def test_a_cancelled_prefill_stops_pushing_and_frees_its_blocks_after_its_thread(
    workers: tuple[PrefillWorker, DecodeWorker, SlowLayers],
) -> None:
    prefill, decode, _ = workers
    reservation = await decode.reserve("r1", decode.pool.num_blocks)
    pushing = asyncio.ensure_future(prefill.prefill(list(range(1, 25)), reservation, layerwise=True))
    await until(lambda: prefill.kvray_agent.stats["bytes_pushed"] > 0, "a first layer pushed", seconds=5.0)
    pushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pushing
    # The forward pass stopped at its next layer, and it and every push had stopped before the
    # call returned.
    assert prefill.pool.used_count == 0
    pushed = prefill.kvray_agent.stats["bytes_pushed"]
    layout = decode.kvray_agent.layout
    block_nbytes = sum(layout.layer(name).geometry.block_nbytes for name in layout.layer_names)
    whole = block_nbytes * len(reservation.blocks)
    assert pushed < whole, "every layer was computed and pushed after the cancel"
    await asyncio.sleep(0.2)
    assert prefill.kvray_agent.stats["bytes_pushed"] == pushed, "layers kept being pushed after the cancel"
    assert not prefill.kvray_agent.layerwise_requests
    await decode.release("r1")


async def test_a_cancelled_decode_frees_its_blocks_only_after_the_model_thread_ends(
    workers: tuple[PrefillWorker, DecodeWorker, SlowLayers], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode, _ = workers
    assert decode.model is not None
    held = SlowLayers(decode.model, pause=0.0)
    held.decode_gate.clear()
    tokens = list(range(1, 9))
    count = decode.model.blocks_needed(len(tokens) + 4)
    reservation = await decode.reserve("r1", count, kv_blocks=decode.model.blocks_needed(len(tokens)))
    prefilled = await prefill.prefill(tokens, reservation)
    decoding = asyncio.ensure_future(decode.decode("r1", prefilled.first_token, len(tokens), 4))
    assert await asyncio.to_thread(held.decoding.wait, 5)
    decoding.cancel()
    await asyncio.sleep(0.1)
    assert decode.pool.used_count == count, "blocks went back to the pool while the model wrote them"
    held.decode_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await decoding
    assert decode.pool.used_count == 0


def test_lock_struct_matches_this_platform() -> None:
    """The claim board's lock request is a `struct flock` of this platform's size."""
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        query = struct.pack("hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 0, 16, 0)
        assert len(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query)) == len(query)
    finally:
        os.close(fd)


def test_a_board_refuses_more_requests_than_slots(tmp_path: Path) -> None:
    board = ClaimBoard(str(tmp_path), 2)
    try:
        board.open(1)
        board.open(2)
        with pytest.raises(KvrayError):
            board.open(3)
    finally:
        board.dispose()


async def test_a_claim_board_kvray_did_not_create_is_refused(
    pair: tuple[KVAgent, KVAgent], tmp_path: Path
) -> None:
    """A forged board path (elsewhere, or a symbolic link where the board should be) moves no
    byte: the writer opens only the board beside the peer's checked inbox, without following links."""
    prefill, decode = pair
    reservation = decode.expect("r", [4])
    before = allocation(decode).copy()
    board = decode.info.endpoints["claim_board"]
    # Boards that would admit the write: the request's slot open under its token.
    table = np.zeros((reservation.slot + 1, 2), dtype=np.uint64)
    table[reservation.slot] = (reservation.token, 1)
    elsewhere, beside = tmp_path / "claims", Path(board + "2")
    for forged_path in (elsewhere, beside):
        forged_path.write_bytes(table.tobytes())
        endpoints = {**decode.info.endpoints, "claim_board": str(forged_path)}
        forged = msgspec.structs.replace(decode.info, endpoints=endpoints)
        prefill.add_peer(forged)
        with pytest.raises(MetadataError, match="claim board"):
            await prefill.push(reservation, [0])
    beside.unlink()
    os.rename(board, board + ".real")
    os.symlink(board + ".real", board)
    prefill.add_peer(decode.info)
    with pytest.raises(KvrayError):
        await prefill.push(reservation, [0])
    np.testing.assert_array_equal(allocation(decode), before)
    os.unlink(board)
    os.rename(board + ".real", board)
