"""The hand-off between engines with tensor parallelism (`kvray.agent.handoff`, no vLLM): each rank
of an engine is its own agent holding its share of the KV heads (`KVLayout.tp`); every decode
rank asks each prefill rank holding heads it takes, tells the others it takes nothing from
them, and has arrived once every part has. Bytes and canaries are checked head by head against
one global reference; every rank frees its blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from head_layouts import head_layout

from kvray.agent.handoff import (
    PUSH_ENDPOINT,
    Handoff,
    LoadSpec,
    SendSpec,
    rank_engine_id,
)
from kvray.agent.kvagent import KVAgent
from kvray.config import Settings
from kvray.layout import Geometry, KVLayout, LayerSpec, TensorParallel
from kvray.wire import Role

KEY = "0" * 31 + "7"
TOKENS = 4
CONTENT = 8  # K and V of one head, one token
NUM_BLOCKS = 8
LAYERS = 2
#: What a decode block holds before anything is written into it.
UNWRITTEN = -1.0


class Recorder:
    def __init__(self) -> None:
        self.freed: list[str] = []
        self.loads: dict[str, bool] = {}

    def sent(self, request_id: str) -> None:
        self.freed.append(request_id)

    def loaded(self, spec: LoadSpec, *, failed: bool) -> None:
        assert spec.request_id not in self.loads, f"{spec.request_id} reported twice"
        self.loads[spec.request_id] = failed


@dataclass
class Rank:
    agent: KVAgent
    handoff: Handoff
    reports: Recorder

    @property
    def tp(self) -> TensorParallel:
        return self.agent.layout.tp

    def block(self, layer: int, block: int) -> np.ndarray:
        """One block of one layer as [heads or 1, tokens, content] (the layout's own order)."""
        view = list(self.agent.backing.views.values())[layer][block]
        heads = max(self.tp.local_heads, 1)
        return view.reshape(heads, TOKENS, -1).numpy()


def layout(tp: TensorParallel) -> KVLayout:
    """Per rank: heads, then tokens, then K and V (vLLM's CPU order); an MLA-like latent (no
    head axis, the whole cache on every rank) where the model has no KV heads to split."""
    if tp.kv_heads:
        return head_layout(tp, tokens=TOKENS, content=CONTENT, layers=LAYERS, num_blocks=NUM_BLOCKS)
    geometry = Geometry(
        block_size=TOKENS,
        entry_shape=(2 * CONTENT,),
        dtype="float32",
        block_layout=f"N{TOKENS} C{2 * CONTENT}",
    )
    layers = tuple(LayerSpec(name=f"layer{i}", geometry=geometry) for i in range(LAYERS))
    return KVLayout(layers=layers, num_blocks=NUM_BLOCKS, tp=tp)


def reference(layer: int, tag: int, heads: range, source_rank: int = 0) -> np.ndarray:
    """The global KV of one block (`tag` names the request's position), for `heads`: every
    value distinct, exact in float32. A latent (no heads) differs by the rank that holds it,
    so a test sees which prefill rank it came from."""
    if not heads:
        values = np.arange(TOKENS * 2 * CONTENT, dtype=np.float32).reshape(1, TOKENS, 2 * CONTENT)
        return values + layer * 100_000 + tag * 1_000 + source_rank * 10_000
    head = np.asarray(heads, dtype=np.float32).reshape(-1, 1, 1)
    token = np.arange(TOKENS, dtype=np.float32).reshape(1, -1, 1) * 10
    content = np.arange(CONTENT, dtype=np.float32).reshape(1, 1, -1) * 0.5
    return layer * 100_000 + tag * 1_000 + head * 100 + token + content


def heads_of(tp: TensorParallel) -> range:
    return range(tp.first_head, tp.first_head + tp.local_heads) if tp.kv_heads else range(0)


@contextlib.asynccontextmanager
async def engine(
    tmp_path: Path, name: str, role: Role, size: int, kv_heads: int, *, lease_s: float = 30.0
) -> AsyncIterator[list[Rank]]:
    settings = Settings(
        shm_dir=str(tmp_path), transport="shm", notify_timeout_s=5.0, transfer_timeout_s=20.0, heartbeat_s=0.5
    )
    ranks: list[Rank] = []
    try:
        for rank in range(size):
            tp = TensorParallel(size=size, rank=rank, kv_heads=kv_heads)
            agent = KVAgent(
                rank_engine_id(name, rank), role, layout(tp), settings=settings, use_coordinator=False
            )
            recorder = Recorder()
            handoff = Handoff(agent, recorder, lease_s=lease_s)
            ranks.append(Rank(agent, handoff, recorder))
            await agent.start()
            if role is Role.DECODE:
                for view in agent.backing.views.values():
                    view.fill_(UNWRITTEN)
        yield ranks
    finally:
        for rank_ in ranks:
            rank_.handoff.close()
            await rank_.agent.close()


def fill(prefill: list[Rank], blocks: tuple[int, ...]) -> None:
    for rank in prefill:
        for layer in range(LAYERS):
            for tag, block in enumerate(blocks):
                values = reference(layer, tag, heads_of(rank.tp), rank.tp.rank)
                rank.block(layer, block)[...] = values


def load(prefill: list[Rank], request_id: str, blocks: tuple[int, ...]) -> LoadSpec:
    """The load every decode rank is given (vLLM's scheduler hands all ranks the same)."""
    first = prefill[0].agent.info
    return LoadSpec(
        request_id,
        first.engine_id,
        first.incarnation,
        KEY,
        first.node_id,
        first.endpoints[PUSH_ENDPOINT],
        (blocks,),
        0,
        prefill_ranks=tuple(
            (rank.agent.info.incarnation, rank.agent.info.endpoints[PUSH_ENDPOINT]) for rank in prefill[1:]
        ),
    )


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


PAIRS = [(2, 1), (1, 2), (2, 2), (1, 1), (4, 2), (2, 4)]


@pytest.mark.parametrize(("prefill_size", "decode_size"), PAIRS)
@pytest.mark.parametrize("kv_heads", [4, 0], ids=["heads", "latent"])
async def test_every_decode_rank_gets_exactly_its_heads_from_the_prefill_ranks_that_hold_them(
    tmp_path: Path, prefill_size: int, decode_size: int, kv_heads: int
) -> None:
    held_blocks, decode_blocks = (5, 1, 2), (6, 3, 0)
    async with (
        engine(tmp_path, "tp-p", Role.PREFILL, prefill_size, kv_heads) as prefill,
        engine(tmp_path, "tp-d", Role.DECODE, decode_size, kv_heads) as decode,
    ):
        fill(prefill, held_blocks)
        for rank in prefill:
            rank.handoff.hold(SendSpec("r-1", (held_blocks,), key=KEY))
        spec = load(prefill, "d-1", decode_blocks)
        for rank in decode:
            rank.handoff.load(spec)
        await until(lambda: all("d-1" in rank.reports.loads for rank in decode))
        assert [rank.reports.loads for rank in decode] == [{"d-1": False}] * decode_size
        for rank in decode:
            source = rank.tp.rank % prefill_size
            for layer in range(LAYERS):
                for tag, block in enumerate(decode_blocks):
                    expected = reference(layer, tag, heads_of(rank.tp), source)
                    np.testing.assert_array_equal(rank.block(layer, block), expected)
                for canary in set(range(NUM_BLOCKS)) - set(decode_blocks):
                    assert (rank.block(layer, canary) == UNWRITTEN).all(), (rank.tp, layer, canary)
        # Every prefill rank lets the request's blocks go, the ones no decode rank read from at
        # once too (not at the end of their lease).
        await until(lambda: all(rank.reports.freed == ["r-1"] for rank in prefill), timeout_s=5.0)
        assert all(rank.handoff.parked() == 0 for rank in prefill)


async def test_asks_that_come_before_the_hold_are_parked_per_rank_then_pushed(tmp_path: Path) -> None:
    blocks = (3, 4)
    async with (
        engine(tmp_path, "tp-p", Role.PREFILL, 1, 4) as prefill,
        engine(tmp_path, "tp-d", Role.DECODE, 2, 4) as decode,
    ):
        fill(prefill, blocks)
        spec = load(prefill, "d-1", (1, 2))
        for rank in decode:
            rank.handoff.load(spec)
        await until(
            lambda: prefill[0].handoff.parked() == 1 and len(prefill[0].handoff.prefill._parked[KEY]) == 2
        )
        prefill[0].handoff.hold(SendSpec("r-1", (blocks,), key=KEY))
        await until(lambda: all("d-1" in rank.reports.loads for rank in decode))
        assert [rank.reports.loads for rank in decode] == [{"d-1": False}] * 2
        for rank in decode:
            np.testing.assert_array_equal(rank.block(1, 2), reference(1, 1, heads_of(rank.tp)))
        await until(lambda: prefill[0].reports.freed == ["r-1"])


async def test_a_dead_prefill_rank_fails_the_load_on_every_decode_rank_and_every_rank_frees(
    tmp_path: Path,
) -> None:
    """Prefill TP 2 into decode TP 1: the one decode rank needs both prefill ranks' heads, and
    rank 1 is gone: the load fails within the deadline, and prefill rank 0 frees its blocks."""
    async with (
        engine(tmp_path, "tp-p", Role.PREFILL, 2, 4) as prefill,
        engine(tmp_path, "tp-d", Role.DECODE, 1, 4) as decode,
    ):
        fill(prefill, (1,))
        prefill[0].handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
        spec = load(prefill, "d-1", (2,))
        dead = prefill[1]
        dead.handoff.close()
        await dead.agent.close()
        started = time.monotonic()
        decode[0].handoff.load(spec)
        await until(lambda: "d-1" in decode[0].reports.loads, timeout_s=15.0)
        assert decode[0].reports.loads == {"d-1": True}
        assert time.monotonic() - started < 10.0
        await until(lambda: prefill[0].reports.freed == ["r-1"], timeout_s=5.0)
        # Nothing but the request's block was written.
        for layer in range(LAYERS):
            for canary in set(range(NUM_BLOCKS)) - {2}:
                assert (decode[0].block(layer, canary) == UNWRITTEN).all()


async def test_engines_of_different_models_are_refused_before_a_byte_moves(tmp_path: Path) -> None:
    """A prefill engine whose model has 4 KV heads, split over 2 ranks, and a decode engine of a
    model with 2 (1 rank): the prefill ranks refuse to plan, naming both."""
    async with (
        engine(tmp_path, "tp-p", Role.PREFILL, 2, 4) as prefill,
        engine(tmp_path, "tp-d", Role.DECODE, 1, 2) as decode,
    ):
        fill(prefill, (1,))
        for rank in prefill:
            rank.handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
        decode[0].handoff.load(load(prefill, "d-1", (2,)))
        await until(lambda: "d-1" in decode[0].reports.loads)
        assert decode[0].reports.loads == {"d-1": True}
        for layer in range(LAYERS):
            assert (decode[0].block(layer, 2) == UNWRITTEN).all()
        await until(lambda: all(rank.reports.freed == ["r-1"] for rank in prefill), timeout_s=5.0)


def test_rank_engine_ids() -> None:
    assert rank_engine_id("vllm-p", 0) == "vllm-p"
    assert rank_engine_id("vllm-p", 3) == "vllm-p-tp3"
