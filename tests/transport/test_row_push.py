"""A prefill engine's whole pushes into a decode engine on its node through one C call
(`Pusher._push_rows`: the C copy plans from the pair's rows and the request's block ids, claims
the request's slot, copies, hashes and sends the notice): routine pushes take it and land
exactly (canaries untouched); a request the decode engine no
longer expects is refused before a byte moves; a slot the engine is closing is waited for; an
executor that stores elsewhere is caught; what the path does not take goes the usual way."""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvray.agent import KVAgent, push
from kvray.config import Settings
from kvray.errors import KVIntegrityError, NotExpectedError
from kvray.layout import mixed
from kvray.memory import MemoryKind
from kvray.notice import claims
from kvray.transport import cpu_copy
from kvray.transport.shm import ShmTransport
from kvray.wire import Role, TransportKind

pytestmark = [
    pytest.mark.fast,
    pytest.mark.skipif(not cpu_copy.rows_native(), reason="kvray._copy_pool is not built"),
]

LAYOUT = mixed(num_blocks=32)
SRC, DST = np.array([3, 1, 4, 15, 9, 26]), np.array([10, 11, 5, 20, 2, 30])


@dataclass
class Pair:
    prefill: KVAgent
    decode: KVAgent
    #: Calls of the one-call path, and of the usual path's planning.
    rows: list[int]
    plans: list[int]


@pytest.fixture
async def make_pair(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> AsyncIterator[Any]:
    rows: list[int] = []
    plans: list[int] = []
    write_rows, plan = ShmTransport.write_rows, push.Pusher._plan

    async def counted_rows(self: Any, *args: Any, **kwargs: Any) -> Any:
        rows.append(1)
        return await write_rows(self, *args, **kwargs)

    async def counted_plan(self: Any, *args: Any, **kwargs: Any) -> Any:
        plans.append(1)
        return await plan(self, *args, **kwargs)

    monkeypatch.setattr(ShmTransport, "write_rows", counted_rows)
    monkeypatch.setattr(push.Pusher, "_plan", counted_plan)
    agents: list[KVAgent] = []

    async def make(*, integrity: bool = True, sample_rate: float = 0.0) -> Pair:
        settings = Settings(integrity=integrity, integrity_sample_rate=sample_rate, transfer_timeout_s=10.0)
        decode = KVAgent("rows-d", Role.DECODE, LAYOUT, settings=settings, use_coordinator=False)
        prefill = KVAgent(
            "rows-p", Role.PREFILL, LAYOUT, memory=MemoryKind.SHM, settings=settings, use_coordinator=False
        )
        agents.extend([decode, prefill])
        await decode.start()
        await prefill.start()
        prefill.add_peer(decode.info)
        region = prefill.backing.regions[0].tensor
        region.copy_(
            torch.randint(0, 256, region.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        )
        return Pair(prefill, decode, rows, plans)

    yield make
    for agent in agents:
        await agent.close()


def _blocks(agent: KVAgent, layer: str, ids: np.ndarray) -> torch.Tensor:
    view = agent.backing.view(layer)
    picked = view[:, ids] if agent.layout.layer(layer).geometry.parts == 2 else view[ids]
    return picked.contiguous().view(torch.uint8)


def _memory(agent: KVAgent) -> np.ndarray:
    """Every byte of the decode engine's allocation, the canaries around its region included."""
    region = agent.backing.regions[0]
    return (region.allocation if region.allocation is not None else region.tensor).numpy().copy()


async def _push(pair: Pair, request: str, *, hold: bool = True) -> None:
    if hold:
        await pair.prefill.hold_digests(SRC)
    reservation = pair.decode.expect(request, DST)
    result = await pair.prefill.push(reservation, SRC)
    assert result.transport is TransportKind.SHM
    await pair.decode.wait_for_kv(request, timeout=10)


def _landed_exactly(pair: Pair, before: np.ndarray, canary_mask: Any) -> None:
    for layer in LAYOUT.layer_names:
        assert torch.equal(_blocks(pair.prefill, layer, SRC), _blocks(pair.decode, layer, DST)), layer
    region = pair.decode.backing.regions[0]
    after = _memory(pair.decode)
    offset = region.span.offset_in_allocation
    written = canary_mask(pair.decode.info, offset, after.size, [(DST.tolist(), None)])
    assert np.array_equal(after[~written], before[~written]), "a byte outside the request's blocks changed"


@pytest.mark.parametrize("integrity", [True, False], ids=["checked", "unchecked"])
async def test_routine_pushes_take_one_c_call_and_land_exactly(
    make_pair: Any, canary_mask: Any, integrity: bool
) -> None:
    pair: Pair = await make_pair(integrity=integrity)
    for attempt in range(4):
        before = _memory(pair.decode)
        await _push(pair, f"r{attempt}", hold=integrity)
        _landed_exactly(pair, before, canary_mask)
        await pair.decode.release(f"r{attempt}")
        pair.prefill.forget_digests(SRC)
    # Each push was one C call; none planned the usual way.
    assert len(pair.rows) == 4 and not pair.plans


async def test_an_executor_that_stores_elsewhere_is_caught_on_the_one_call_path(make_pair: Any) -> None:
    """The C copy stores the request's last op over the one before (`kvray.faults`'s executor
    bug): the placement digest it reports differs from the request's blocks', and the decode
    engine refuses the request; the next, intact, is taken."""
    pair: Pair = await make_pair(integrity=True)
    await _push(pair, "first")
    await pair.decode.release("first")
    cpu_copy.set_executor_fault(True)
    try:
        await pair.prefill.hold_digests(SRC)
        reservation = pair.decode.expect("bad", DST)
        await pair.prefill.push(reservation, SRC)
        with pytest.raises(KVIntegrityError):
            await pair.decode.wait_for_kv("bad", timeout=10)
        await pair.decode.release("bad")
    finally:
        cpu_copy.set_executor_fault(False)
    pair.prefill.forget_digests(SRC)
    await _push(pair, "good")
    assert len(pair.rows) == 3 and not pair.plans


async def test_a_request_no_longer_expected_is_refused_before_a_byte_moves(make_pair: Any) -> None:
    pair: Pair = await make_pair(integrity=False)
    await _push(pair, "first", hold=False)
    await pair.decode.release("first")
    reservation = pair.decode.expect("gone", DST)
    await pair.decode.release("gone")  # its slot is closed
    before = _memory(pair.decode)
    with pytest.raises(NotExpectedError, match="no longer expects"):
        await pair.prefill.push(reservation, SRC)
    assert np.array_equal(_memory(pair.decode), before)
    assert len(pair.rows) == 2 and not pair.plans  # refused by the C copy's claim


async def test_a_slot_the_engine_is_closing_is_waited_for(make_pair: Any, canary_mask: Any) -> None:
    """While the engine holds the request's slot (as it does for a moment while it closes one),
    the C copy gives way without writing, and the usual path waits for the slot."""
    pair: Pair = await make_pair(integrity=False)
    await _push(pair, "first", hold=False)
    await pair.decode.release("first")
    reservation = pair.decode.expect("busy", DST)
    board = os.open(pair.decode.info.endpoints[claims.ENDPOINT], os.O_RDWR)
    slot = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, reservation.slot * 16, 16, 0)
    fcntl.fcntl(board, fcntl.F_OFD_SETLK, slot)
    try:
        before = _memory(pair.decode)
        pushing = asyncio.ensure_future(pair.prefill.push(reservation, SRC))
        await asyncio.sleep(0.05)
        assert not pushing.done()
        assert np.array_equal(_memory(pair.decode), before)
    finally:
        os.close(board)  # the engine lets go
    await asyncio.wait_for(pushing, 10)
    await pair.decode.wait_for_kv("busy", timeout=10)
    _landed_exactly(pair, before, canary_mask)
    assert len(pair.rows) == 2 and len(pair.plans) == 1


@pytest.mark.parametrize("case", ["not held", "sampled"])
async def test_what_the_one_call_path_does_not_take_goes_the_usual_way(
    make_pair: Any, canary_mask: Any, case: str
) -> None:
    """A checked request whose blocks' digests are not held (the usual path hashes them while
    the bytes move), and one sampled for the slow checksums, are pushed the usual way."""
    pair: Pair = await make_pair(integrity=True, sample_rate=1.0 if case == "sampled" else 0.0)
    await _push(pair, "first", hold=True)
    await pair.decode.release("first")
    pair.prefill.forget_digests(SRC)
    before = _memory(pair.decode)
    await _push(pair, "second", hold=case == "sampled")
    _landed_exactly(pair, before, canary_mask)
    assert len(pair.plans) == (2 if case == "sampled" else 1)
