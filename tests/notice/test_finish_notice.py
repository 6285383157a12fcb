"""The completion of a layer-wise push on one node: `finish` sends its notice at once when
nothing on its way would wait (the request's claim slot open, the decode engine's inbox not
full), without queueing behind the writer's other transfers, and never reports done a request
its decode engine is releasing or has released; a decode engine's `wait_for_kv` ends in
exactly one way (KV, its own deadline, the request cancelled, or its caller cancelled)."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from agent_pair import agent_pair

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import NotExpectedError, RequestCancelledError, TransferTimeoutError
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.notice.claims import ENDPOINT as CLAIMS_ENDPOINT
from kvray.notice.claims import SLOT_NBYTES, ClaimClient
from kvray.notice.local import ENDPOINT as INBOX_ENDPOINT
from kvray.transport.base import Peer

LAYOUT = KVLayout(
    layers=tuple(
        LayerSpec(name=f"layer{i}", geometry=Geometry(block_size=16, entry_shape=(64,), dtype="uint8"))
        for i in range(2)
    ),
    num_blocks=32,
)


@pytest_asyncio.fixture(loop_scope="function")
async def pair(tmp_path: Path) -> AsyncIterator[tuple[KVAgent, KVAgent]]:
    settings = Settings(
        shm_dir=str(tmp_path),
        transport="shm",
        max_concurrent_transfers=1,
        notify_timeout_s=3.0,
        transfer_timeout_s=5.0,
    )
    async with agent_pair("f", LAYOUT, settings) as (prefill, decode):
        source = prefill.backing.regions[0].tensor.numpy()
        source[:] = np.random.default_rng(3).integers(0, 256, source.size, dtype=np.uint8)
        yield prefill, decode


@contextmanager
def slot_locked(decode: KVAgent, slot: int) -> Iterator[None]:
    """Hold a claim slot's lock exclusively from another file description, as the engine does
    for a moment when it opens or closes the slot: writers cannot claim it meanwhile."""
    fd = os.open(decode.info.endpoints[CLAIMS_ENDPOINT], os.O_RDWR)
    flock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, slot * SLOT_NBYTES, SLOT_NBYTES, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock)
        yield
    finally:
        os.close(fd)  # drops the lock


async def test_finish_does_not_queue_behind_a_stalled_transfer(pair: tuple[KVAgent, KVAgent]) -> None:
    """The writer's one transfer slot is held by a push stalled on its claim; the finish of
    another request, whose layers are all written, still completes that request at once."""
    prefill, decode = pair
    done = decode.expect("done", [1, 2])
    for layer in LAYOUT.layer_names:
        await prefill.push_layer(done, layer, [3, 4], timeout=5)
    stalled = decode.expect("stalled", [5, 6])
    waiting = asyncio.ensure_future(decode.wait_for_kv("done", timeout=5))
    with slot_locked(decode, stalled.slot):
        pushing = asyncio.ensure_future(prefill.push_layer(stalled, "layer0", [7, 8], timeout=5))
        await asyncio.sleep(0.05)
        assert not pushing.done(), "the stalled push did not wait for its claim"
        result = await asyncio.wait_for(prefill.finish("done", timeout=5), 1.0)
        completion = await asyncio.wait_for(waiting, 1.0)
        assert not pushing.done(), "finish waited for the stalled push"
    assert (completion.transfer_id, completion.nbytes) == (result.transfer_id, result.nbytes)
    await asyncio.wait_for(pushing, 5.0)
    assert prefill.stats["transfers_finish_ok"] == 1
    await decode.release("done")
    await decode.release("stalled")


async def test_a_finish_is_refused_while_its_request_is_released(pair: tuple[KVAgent, KVAgent]) -> None:
    """The decode engine releases the request while a writer still holds its claim (the slot
    is closing): the finish is refused, as it is once the request is released."""
    prefill, decode = pair
    reservation = decode.expect("r", [1])
    for layer in LAYOUT.layer_names:
        await prefill.push_layer(reservation, layer, [2], timeout=5)
    holder = ClaimClient(decode.info.endpoints[CLAIMS_ENDPOINT], "f-d", decode.settings.shm_dir)
    held = holder.hold("r", reservation.slot, reservation.token, timeout=1.0)
    await held.__aenter__()
    try:
        releasing = asyncio.ensure_future(decode.release("r"))
        await asyncio.sleep(0.05)
        assert not releasing.done()
        assert not holder.is_open(reservation.slot, reservation.token)
        with pytest.raises(NotExpectedError):
            await prefill.finish("r", timeout=5)
    finally:
        await held.__aexit__(None, None, None)
        holder.close()
    await asyncio.wait_for(releasing, 2.0)

    later = decode.expect("later", [1])
    await prefill.push_layer(later, "layer0", [2], timeout=5)
    await decode.release("later")
    with pytest.raises(NotExpectedError):
        await prefill.finish("later", timeout=5)
    assert decode.stats["completions_ok"] == 0
    assert prefill.stats["transfers_finish_ok"] == 0


async def test_finish_goes_out_the_way_its_layers_looked_up_and_the_usual_way_once_that_is_gone(
    pair: tuple[KVAgent, KVAgent],
) -> None:
    """The last layer's push keeps how `finish` sends its notice (the inbox's connected socket
    and the board); `finish` then sends through it. A connection closed meanwhile, or a peer
    the directory no longer lists as it was, sends nothing that way: the usual path delivers."""
    prefill, decode = pair
    pusher = prefill._pusher
    for request_id, spoil in (("kept", None), ("closed", "connection"), ("relisted", "peer")):
        reservation = decode.expect(request_id, [1, 2])
        for layer in LAYOUT.layer_names:
            await prefill.push_layer(reservation, layer, [3, 4], timeout=5)
        state = pusher._layerwise[request_id]
        quick = state.quick
        assert quick is not None and quick.board is not None
        sent: list[bool] = []

        def spy(message: bytes, send: Callable[[bytes], bool] = quick.send, sent: list[bool] = sent) -> bool:
            sent.append(send(message))
            return sent[-1]

        state.quick = dataclasses.replace(quick, send=spy)
        if spoil == "connection":
            local = pusher.notices.reaching(quick.peer)
            assert local is not None
            local.outbox()._disconnect(decode.info.endpoints[INBOX_ENDPOINT])
        elif spoil == "peer":
            # The same engine listed anew (as after a lookup): not the peer the route was made for.
            pusher.directory._peers[decode.engine_id] = Peer(quick.peer.info, quick.peer.host)
        waiting = asyncio.ensure_future(decode.wait_for_kv(request_id, timeout=5))
        result = await asyncio.wait_for(prefill.finish(request_id, timeout=5), 2.0)
        completion = await asyncio.wait_for(waiting, 2.0)
        assert (completion.transfer_id, completion.nbytes) == (result.transfer_id, result.nbytes)
        assert sent == {None: [True], "connection": [False], "peer": []}[spoil], request_id
        await decode.release(request_id)
    assert prefill.stats["transfers_finish_ok"] == 3
    assert decode.stats["completions_ok"] == 3


async def test_a_slot_reads_open_only_under_its_token_until_release(pair: tuple[KVAgent, KVAgent]) -> None:
    _, decode = pair
    board = decode.info.endpoints[CLAIMS_ENDPOINT]
    slots = os.stat(board).st_size // SLOT_NBYTES
    reservation = decode.expect("r", [1])
    client = ClaimClient(board, "f-d", decode.settings.shm_dir)
    try:
        assert client.is_open(reservation.slot, reservation.token)
        assert not client.is_open(reservation.slot, reservation.token ^ 1)
        assert not client.is_open(slots, reservation.token)  # past the board's end
        await decode.release("r")
        assert not client.is_open(reservation.slot, reservation.token)
        again = decode.expect("again", [1])  # may take the same slot, under a new token
        assert client.is_open(again.slot, again.token)
        if again.slot == reservation.slot:
            assert not client.is_open(again.slot, reservation.token)
    finally:
        client.close()
    assert not client.is_open(again.slot, again.token), "a closed client still reads slots"
    await decode.release("again")


async def test_a_wait_ends_in_exactly_one_way(pair: tuple[KVAgent, KVAgent]) -> None:
    prefill, decode = pair
    # Its own deadline: a kvray timeout, and a notice that comes later is dropped.
    reservation = decode.expect("late", [1])
    with pytest.raises(TransferTimeoutError):
        await decode.wait_for_kv("late", timeout=0.05)
    assert decode.stats["waits_timed_out"] == 1
    await prefill.push_layer(reservation, "layer0", [2], timeout=5)  # its slot is open until release
    await prefill.finish("late", timeout=5)
    await asyncio.sleep(0.05)
    assert decode.stats["messages_dropped_unknown"] == 1
    await decode.release("late")

    # The request cancelled by the engine.
    decode.expect("cancelled", [1])
    waiting = asyncio.ensure_future(decode.wait_for_kv("cancelled", timeout=5))
    await asyncio.sleep(0.01)
    decode.cancel("cancelled")
    with pytest.raises(RequestCancelledError):
        await waiting
    await decode.release("cancelled")

    # The caller's own deadline, shorter than the wait's: the caller's timeout, not kvray's.
    decode.expect("caller", [1])
    with pytest.raises(TimeoutError) as caught:
        async with asyncio.timeout(0.05):
            await decode.wait_for_kv("caller", timeout=5)
    assert not isinstance(caught.value, TransferTimeoutError)
    await decode.release("caller")
    assert decode.stats["waits_timed_out"] == 1
