"""The hand-off protocol (`kvray.agent.handoff`) between two agents in this process, without any
engine: a decode side that loads and a prefill side that holds, each a `Handoff` over a real
agent, their push requests over the real datagram inboxes, the KV over `shm`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvray.agent.handoff import (
    NO_BLOCK,
    PUSH_ENDPOINT,
    AskProof,
    BlockTable,
    Handoff,
    HandoffEvent,
    LayerwiseSpec,
    LoadSpec,
    PrefillAddress,
    SendSpec,
)
from kvray.agent.handoff.decode import departed
from kvray.agent.kvagent import KVAgent
from kvray.bench.handoff_log import DigestLog
from kvray.config import Settings
from kvray.integrations.vllm.tickets import HandoffKey, new_key_hex
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.wire import PushRequest, PushWithdrawn, Role, encode

GEOMETRY = Geometry(block_size=4, entry_shape=(8,), dtype="float32")
LAYOUT = KVLayout(
    layers=tuple(LayerSpec(name=f"layer{i}", geometry=GEOMETRY) for i in range(3)), num_blocks=8
)
KEY = "0" * 31 + "1"


class Recorder:
    """`HandoffReports`, recorded: held requests whose blocks may go, in order, and each load's
    outcome (whether it failed)."""

    def __init__(self) -> None:
        self.freed: list[str] = []
        self.loads: dict[str, bool] = {}

    def sent(self, request_id: str) -> None:
        self.freed.append(request_id)

    def loaded(self, spec: LoadSpec, *, failed: bool) -> None:
        assert spec.request_id not in self.loads, f"{spec.request_id} reported twice"
        self.loads[spec.request_id] = failed


class Engine:
    """One side: an agent, its hand-off and what it reported."""

    def __init__(self, agent: KVAgent, handoff: Handoff, reports: Recorder) -> None:
        self.agent, self.handoff, self.reports = agent, handoff, reports

    def fill(self, values: dict[int, float]) -> None:
        """Every layer's block `b` filled with `values[b]` plus the layer's index."""
        for index, view in enumerate(self.agent.backing.views.values()):
            for block, value in values.items():
                view[block].fill_(value + 16 * index)

    def block(self, block: int) -> list[set[float]]:
        return [set(view[block].float().unique().tolist()) for view in self.agent.backing.views.values()]


@contextlib.asynccontextmanager
async def engines(
    tmp_path: Path,
    *,
    lease_s: float = 30.0,
    max_parked: int = 4096,
    observe: bool = False,
    heartbeat_s: float = 2.0,
    proof: AskProof | None = None,
) -> AsyncIterator[tuple[Engine, Engine]]:
    """A prefill and a decode side; `max_parked` bounds the prefill side's parked asks (its
    `max_expected_requests`; the decode side keeps the default); every `heartbeat_s` a waiting
    load asks whether its prefill engine is still there; `proof`: both sides' deployment key."""
    settings = Settings(
        shm_dir=str(tmp_path),
        transport="shm",
        notify_timeout_s=5.0,
        transfer_timeout_s=30.0,
        heartbeat_s=heartbeat_s,
    )
    built: list[Engine] = []
    try:
        for name, role in (("hand-p", Role.PREFILL), ("hand-d", Role.DECODE)):
            bounded = (
                msgspec.structs.replace(settings, max_expected_requests=max_parked)
                if role is Role.PREFILL
                else settings
            )
            agent = KVAgent(name, role, LAYOUT, settings=bounded, use_coordinator=False)
            recorder = Recorder()
            observer = DigestLog(str(tmp_path / f"{name}.jsonl")) if observe else None
            handoff = Handoff(agent, recorder, lease_s=lease_s, observer=observer, proof=proof)
            built.append(Engine(agent, handoff, recorder))
            await agent.start()
        yield built[0], built[1]
    finally:
        for engine in built:
            engine.handoff.close()
            await engine.agent.close()


def load_from(
    prefill: Engine,
    request_id: str,
    key: str,
    blocks: tuple[int, ...],
    first: int = 0,
    *,
    table: BlockTable | None = None,
) -> LoadSpec:
    """A load of what `prefill` holds (or will hold) under `key`, as its ticket names it, into
    `blocks` (one KV cache group) or `table` (several)."""
    info = prefill.agent.info
    return LoadSpec(
        request_id,
        info.engine_id,
        info.incarnation,
        key,
        info.node_id,
        info.endpoints[PUSH_ENDPOINT],
        table if table is not None else (blocks,),
        first,
    )


async def until(
    condition: Callable[[], bool], timeout_s: float = 10.0, tick: Callable[[], None] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        if tick is not None:
            tick()
        await asyncio.sleep(0.01)


async def test_an_ask_before_the_hold_is_parked_then_pushed_into_exactly_its_blocks(tmp_path: Path) -> None:
    async with engines(tmp_path, observe=True) as (prefill, decode):
        prefill.fill({1: 1.0, 2: 2.0, 5: 9.0})
        decode.handoff.load(load_from(prefill, "d-1", KEY, (6, 3), first=1))
        await until(lambda: prefill.handoff.parked() == 1)
        assert decode.reports.loads == {}
        prefill.handoff.hold(SendSpec("r-1", ((5, 1, 2),), key=KEY))
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": False}
        assert decode.block(6) == prefill.block(1) and decode.block(3) == prefill.block(2)
        for canary in (0, 1, 2, 4, 5, 7):
            assert decode.block(canary) == [{0.0}] * 3
        await until(lambda: prefill.reports.freed == ["r-1"])
        assert prefill.handoff.parked() == 0
    # Both sides' digest logs name the same bytes (the observer saw the blocks before they went).
    sides = {}
    for name, side in (("hand-p", "sent"), ("hand-d", "received")):
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        (moved,) = [record for record in records if record["side"] == side]
        sides[side] = moved["layers"]
    assert sides["sent"] == sides["received"] and len(sides["sent"]) == 3
    asked = [json.loads(line) for line in (tmp_path / "hand-p.jsonl").read_text().splitlines()]
    assert asked[0]["side"] == HandoffEvent.ASKED.value


async def test_each_kv_cache_groups_blocks_move_and_positions_the_decode_side_keeps_none_of_are_skipped(
    tmp_path: Path,
) -> None:
    """Two groups (a sliding window's and full attention's): every group's blocks of the request
    move, position by position, in every layer; a position the decode engine keeps no block
    for (outside its window) moves nothing, though the prefill engine still holds it."""
    async with engines(tmp_path, observe=True) as (prefill, decode):
        prefill.fill({1: 1.0, 2: 2.0, 3: 3.0, 5: 5.0, 6: 6.0, 7: 7.0})
        held = ((7, 1, 2), (3, 5, 6))
        prefill.handoff.hold(SendSpec("r-1", held, key=KEY))
        decode.handoff.load(load_from(prefill, "d-1", KEY, (), table=((NO_BLOCK, 7, 4), (2, 3, 5))))
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": False}
        pairs = {7: 1, 4: 2, 2: 3, 3: 5, 5: 6}
        for mine, theirs in pairs.items():
            assert decode.block(mine) == prefill.block(theirs), (mine, theirs)
        for canary in (0, 1, 6):
            assert decode.block(canary) == [{0.0}] * 3
        await until(lambda: prefill.reports.freed == ["r-1"])
    sides = {}
    for name, side in (("hand-p", "sent"), ("hand-d", "received")):
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        (moved,) = [record for record in records if record["side"] == side]
        sides[side] = moved["layers"]
    assert sides["sent"] == sides["received"]
    assert sorted(sides["sent"]) == sorted(f"layer{i}@group{g}" for i in range(3) for g in range(2))


@pytest.mark.parametrize(
    ("held", "wanted", "why"),
    [
        # The decode engine wants the first position of group 0, which the prefill engine's
        # window has let go of: nothing it could write there is the request's KV.
        (((NO_BLOCK, 1), (3, 5)), ((7, 4), (2, 3)), "no longer keeps"),
        # One engine's cache has two groups, the other's one: not the same model.
        (((1, 2),), ((7, 4), (2, 3)), "groups"),
    ],
)
async def test_a_block_table_the_prefill_side_cannot_serve_fails_the_load_and_writes_nothing(
    tmp_path: Path, held: BlockTable, wanted: BlockTable, why: str
) -> None:
    async with engines(tmp_path, observe=True) as (prefill, decode):
        prefill.fill({1: 1.0, 2: 2.0, 3: 3.0, 5: 5.0})
        prefill.handoff.hold(SendSpec("r-1", held, key=KEY))
        decode.handoff.load(load_from(prefill, "d-1", KEY, (), table=wanted))
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": True}
        for block in range(LAYOUT.num_blocks):
            assert decode.block(block) == [{0.0}] * 3
    records = [json.loads(line) for line in (tmp_path / "hand-p.jsonl").read_text().splitlines()]
    assert any(
        record["side"] == HandoffEvent.PUSH_FAILED.value and why in record["error"] for record in records
    )


async def test_a_hold_nobody_asks_for_is_freed_when_its_lease_ends_and_its_id_stays_spent(
    tmp_path: Path,
) -> None:
    async with engines(tmp_path, lease_s=0.3) as (prefill, decode):
        prefill.handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
        prefill.handoff.expire()
        assert prefill.reports.freed == []  # not before the lease ends
        await until(lambda: prefill.reports.freed == ["r-1"], tick=prefill.handoff.expire)
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2,)))
        await until(lambda: "d-1" in decode.reports.loads, timeout_s=0.25)  # refused within the lease
        assert decode.reports.loads == {"d-1": True}


async def test_an_ask_nobody_holds_for_is_refused_when_its_lease_ends(tmp_path: Path) -> None:
    async with engines(tmp_path, lease_s=0.5) as (prefill, decode):
        started = time.monotonic()
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2, 3)))
        await until(lambda: "d-1" in decode.reports.loads, tick=prefill.handoff.expire)
        assert time.monotonic() - started >= 0.5
        assert decode.reports.loads == {"d-1": True} and prefill.handoff.parked() == 0


async def test_a_second_hold_under_a_held_id_ends_at_once_and_a_second_ask_is_refused(tmp_path: Path) -> None:
    async with engines(tmp_path) as (prefill, decode):
        prefill.fill({1: 1.0, 4: 4.0})
        prefill.handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
        prefill.handoff.hold(SendSpec("r-2", ((4,),), key=KEY))
        assert prefill.reports.freed == ["r-2"]  # the newcomer's blocks go back at once
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2,)))
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": False} and decode.block(2) == prefill.block(1)
        await until(lambda: prefill.reports.freed == ["r-2", "r-1"])
        decode.handoff.load(load_from(prefill, "d-2", KEY, (3,)))
        await until(lambda: "d-2" in decode.reports.loads)
        assert decode.reports.loads["d-2"] is True and decode.block(3) == [{0.0}] * 3
        prefill.handoff.hold(SendSpec("r-3", ((5,),), key=KEY))  # spent: not held either
        assert prefill.reports.freed == ["r-2", "r-1", "r-3"]


async def test_a_withdrawal_frees_the_hold_and_refuses_a_later_one(tmp_path: Path) -> None:
    other = "0" * 31 + "2"
    async with engines(tmp_path, lease_s=60.0) as (prefill, decode):
        prefill.handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
        await decode.handoff.withdraw(load_from(prefill, "d-1", KEY, ()))
        await until(lambda: prefill.reports.freed == ["r-1"])
        await decode.handoff.withdraw(load_from(prefill, "d-2", other, ()))
        await asyncio.sleep(0.2)
        prefill.handoff.hold(SendSpec("r-2", ((2,),), key=other))  # finished after its withdrawal
        assert prefill.reports.freed == ["r-1", "r-2"]


async def test_a_cancelled_load_reports_no_failure_and_withdraws_its_parked_ask(tmp_path: Path) -> None:
    async with engines(tmp_path, lease_s=60.0) as (prefill, decode):
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2, 3)))
        await until(lambda: prefill.handoff.parked() == 1)
        decode.handoff.cancel("d-1")
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": False}
        await until(lambda: prefill.handoff.parked() == 0)
        prefill.handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
        assert prefill.reports.freed == ["r-1"]
        decode.agent.expect("d-1", [2, 3])  # released: reserved again


async def test_a_release_frees_the_hold_at_once_and_a_drop_refuses_the_parked_ask(tmp_path: Path) -> None:
    other = "0" * 31 + "2"
    async with engines(tmp_path, lease_s=60.0) as (prefill, decode):
        prefill.handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
        prefill.handoff.release(KEY)
        assert prefill.reports.freed == ["r-1"]
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2,)))
        decode.handoff.load(load_from(prefill, "d-2", other, (3,)))
        await until(lambda: "d-1" in decode.reports.loads and prefill.handoff.parked() == 1)
        assert decode.reports.loads == {"d-1": True}
        prefill.handoff.drop(other)
        await until(lambda: "d-2" in decode.reports.loads, timeout_s=5.0)
        assert decode.reports.loads["d-2"] is True


async def test_parked_asks_are_bounded_and_a_duplicate_is_refused(tmp_path: Path) -> None:
    keys = [f"{index:032x}" for index in range(1, 4)]
    async with engines(tmp_path, max_parked=2) as (prefill, decode):
        for index, key in enumerate(keys[:2]):
            decode.handoff.load(load_from(prefill, f"d-{index}", key, (index,)))
        await until(lambda: prefill.handoff.parked() == 2)
        decode.handoff.load(load_from(prefill, "d-2", keys[2], (2,)))
        decode.handoff.load(load_from(prefill, "d-dup", keys[0], (3,)))
        await until(lambda: {"d-2", "d-dup"} <= decode.reports.loads.keys())
        assert decode.reports.loads == {"d-2": True, "d-dup": True} and prefill.handoff.parked() == 2


async def test_an_ask_naming_another_incarnation_is_refused(tmp_path: Path) -> None:
    async with engines(tmp_path) as (prefill, decode):
        reservation = decode.agent.expect("d-1", [2])
        info = prefill.agent.info
        stale = PushRequest(
            request_id=KEY,
            src_engine=info.engine_id,
            src_incarnation=info.incarnation + 1,
            reservation=reservation,
            decode_info=encode(decode.agent.info),
        )
        prefill.handoff.take(encode(stale))
        with pytest.raises(Exception, match="another incarnation"):
            await decode.agent.wait_for_kv("d-1", timeout=5.0)
        assert prefill.handoff.parked() == 0
        await decode.agent.release("d-1")


async def test_a_preempted_layerwise_request_is_pushed_whole_from_its_new_blocks(tmp_path: Path) -> None:
    async with engines(tmp_path) as (prefill, decode):
        prefill.fill({0: 1.0, 1: 2.0})
        layers = prefill.agent.layout.layer_names
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2, 3)))
        await until(lambda: prefill.handoff.parked() == 1)
        prefill.handoff.layerwise({"r-1": LayerwiseSpec("r-1", KEY, ((0, 1),))})
        assert prefill.handoff.parked() == 0  # the ask is taken by the forward
        prefill.handoff.save_layer(layers[0])
        await prefill.handoff.preempt({KEY}, wait_s=5.0)
        assert prefill.handoff.parked() == 1  # parked again, for the request's next run
        prefill.fill({0: 7.0, 1: 7.0, 4: 1.0, 5: 2.0})  # reused; the request's KV recomputed
        assert decode.reports.loads == {}
        prefill.handoff.hold(SendSpec("r-1", ((4, 5),), key=KEY))
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": False}
        assert decode.block(2) == prefill.block(4) and decode.block(3) == prefill.block(5)
        for canary in (0, 1, 4, 5):
            assert decode.block(canary) == [{0.0}] * 3
        await until(lambda: prefill.reports.freed == ["r-1"])


async def test_layers_saved_before_the_ask_are_pushed_when_it_comes(tmp_path: Path) -> None:
    async with engines(tmp_path) as (prefill, decode):
        prefill.fill({0: 1.0})
        prefill.handoff.layerwise({"r-1": LayerwiseSpec("r-1", KEY, ((0,),))})
        for layer in prefill.agent.layout.layer_names[:2]:
            prefill.handoff.save_layer(layer)
        decode.handoff.load(load_from(prefill, "d-1", KEY, (6,)))
        await until(lambda: len(prefill.agent.layerwise_requests) == 1)
        prefill.handoff.hold(SendSpec("r-1", ((0,),), key=KEY))  # the last layer was never saved
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": False} and decode.block(6) == prefill.block(0)


async def test_a_load_fails_soon_after_its_prefill_engine_goes_away(tmp_path: Path) -> None:
    # The prefill engine took the ask, then died (its inbox has no reader): the load fails
    # within a few heartbeats, not at its 30 s deadline, and its blocks are free again.
    async with engines(tmp_path, heartbeat_s=0.1) as (prefill, decode):
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2, 3)))
        await until(lambda: prefill.handoff.parked() == 1)
        prefill.agent.push_requests.close()  # its push-request inbox, as a dead engine's
        started = time.monotonic()
        await until(lambda: "d-1" in decode.reports.loads, timeout_s=5.0)
        assert time.monotonic() - started < 2.0
        assert decode.reports.loads == {"d-1": True}
        decode.agent.expect("d-1", [2, 3])  # released: reserved again
        assert decode.block(2) == decode.block(3) == [{0.0}] * 3


async def test_a_load_waits_for_a_prefill_engine_that_is_slow_but_there(tmp_path: Path) -> None:
    # Asked every heartbeat, a live prefill engine is never taken for gone: the KV comes late
    # and lands.
    async with engines(tmp_path, heartbeat_s=0.05) as (prefill, decode):
        prefill.fill({1: 1.0, 4: 4.0})
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2, 3)))
        await until(lambda: prefill.handoff.parked() == 1)
        await asyncio.sleep(0.5)  # ten heartbeats
        assert decode.reports.loads == {}
        prefill.handoff.hold(SendSpec("r-1", ((1, 4),), key=KEY))
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": False}
        assert decode.block(2) == prefill.block(1) and decode.block(3) == prefill.block(4)


class Directory:
    """What `kvray.agent.handoff.decode.departed` asks of an agent whose prefill engine is on
    another node: the coordinator's list of departed engines (here, a set), or no answer at all."""

    def __init__(self, departed: set[tuple[str, int]], *, answers: bool = True) -> None:
        self.node_id = "node-d"
        self.settings = Settings(notify_timeout_s=0.2)
        self._departed, self._answers = departed, answers

    async def departed(self, peers: list[tuple[str, int]]) -> list[tuple[str, int]]:
        if not self._answers:
            await asyncio.sleep(3600)
        return [peer for peer in peers if peer in self._departed]


async def test_a_prefill_engine_on_another_node_is_gone_once_the_coordinator_drops_it(tmp_path: Path) -> None:
    there = PrefillAddress("p", 7, "node-p", "")
    agent: Any = Directory(set())
    assert await departed(agent, there, joined=True) == ""
    agent = Directory({("p", 7)})
    assert "no longer lists" in await departed(agent, there, joined=True)
    # A restarted engine (another incarnation) is not the one the request waits on.
    restarted: Any = Directory({("p", 8)})
    assert await departed(restarted, there, joined=True) == ""
    # No coordinator to ask (not joined), or no answer in time: no news, the deadline rules.
    assert await departed(agent, there, joined=False) == ""
    silent: Any = Directory({("p", 7)}, answers=False)
    assert await departed(silent, there, joined=True) == ""


DEPLOYMENT = HandoffKey.from_hex(new_key_hex())


async def test_with_a_key_messages_without_its_proof_neither_free_nor_pin_a_hold(tmp_path: Path) -> None:
    """Anyone who learnt a hand-off id could send a withdrawal (freeing another request's hold)
    or asks (filling the parked asks, so real decode-first asks fail): with the deployment's
    key, a message without its proof is dropped unread, and the engines' own still work."""
    other = "0" * 31 + "2"
    async with engines(tmp_path, max_parked=4, proof=DEPLOYMENT) as (prefill, decode):
        info = prefill.agent.info
        prefill.fill({1: 1.0, 2: 2.0})
        prefill.handoff.hold(SendSpec("r-1", ((1,),), key=KEY))
        forger = HandoffKey.from_hex(new_key_hex())
        for proof in (b"", forger.ask_proof(info.engine_id, KEY), DEPLOYMENT.ask_proof("vllm-x", KEY)):
            withdrawn = PushWithdrawn(
                request_id=KEY, src_engine=info.engine_id, src_incarnation=info.incarnation, proof=proof
            )
            prefill.handoff.take(encode(withdrawn))
        victim = decode.agent.expect("victim", [5])
        for index in range(64):
            forged = PushRequest(
                request_id=other if index == 0 else f"{index + 16:032x}",
                src_engine=info.engine_id,
                src_incarnation=info.incarnation,
                reservation=victim,
                decode_info=encode(decode.agent.info),
            )
            prefill.handoff.take(encode(forged))
        await asyncio.sleep(0.2)
        assert prefill.reports.freed == [] and prefill.handoff.parked() == 0
        # The decode engine's own ask, before its request is held, parks and is pushed.
        decode.handoff.load(load_from(prefill, "d-1", other, (3,)))
        await until(lambda: prefill.handoff.parked() == 1)
        prefill.handoff.hold(SendSpec("r-2", ((2,),), key=other))
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": False} and decode.block(3) == prefill.block(2)
        # The forged asks told the reservation they named nothing: it still waits, unwritten.
        with pytest.raises(TimeoutError):
            await decode.agent.wait_for_kv("victim", timeout=0.2)
        assert decode.block(5) == [{0.0}] * 3
        await decode.agent.release("victim")
        # The decode engine's own withdrawal frees the first hold.
        await decode.handoff.withdraw(load_from(prefill, "d-2", KEY, ()))
        await until(lambda: sorted(prefill.reports.freed) == ["r-1", "r-2"])


async def test_a_request_bound_to_a_decode_engine_is_pushed_only_into_that_engines_reservations(
    tmp_path: Path,
) -> None:
    other = "0" * 31 + "2"
    async with engines(tmp_path, proof=DEPLOYMENT) as (prefill, decode):
        prefill.fill({1: 1.0, 2: 2.0})
        prefill.handoff.hold(SendSpec("r-1", ((1,),), key=KEY, decode_engine="vllm-elsewhere"))
        decode.handoff.load(load_from(prefill, "d-1", KEY, (3,)))
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": True} and decode.block(3) == [{0.0}] * 3
        prefill.handoff.hold(SendSpec("r-2", ((2,),), key=other, decode_engine=decode.agent.engine_id))
        decode.handoff.load(load_from(prefill, "d-2", other, (4,)))
        await until(lambda: "d-2" in decode.reports.loads)
        assert decode.reports.loads["d-2"] is False and decode.block(4) == prefill.block(2)


async def test_a_preemption_waits_at_most_its_budget_and_a_copy_outlasting_it_fails_the_load(
    tmp_path: Path,
) -> None:
    """vLLM's thread waits in `handle_preemptions`: at most `wait_s`. A layer copy still running
    then may read blocks vLLM has given to another request, so the push is aborted once the copy
    ends: the decode side's load fails (it never decodes from those bytes), nothing outside its
    blocks is written, and the request's later finish is not pushed again."""
    async with engines(tmp_path) as (prefill, decode):
        prefill.fill({0: 1.0, 1: 2.0})
        layers = prefill.agent.layout.layer_names
        push_layer = prefill.agent.push_layer

        async def slow_push_layer(*args: Any, **kwargs: Any) -> int:
            await asyncio.sleep(1.0)
            return await push_layer(*args, **kwargs)

        prefill.agent.push_layer = slow_push_layer  # type: ignore[method-assign]
        decode.handoff.load(load_from(prefill, "d-1", KEY, (2, 3)))
        await until(lambda: prefill.handoff.parked() == 1)
        prefill.handoff.layerwise({"r-1": LayerwiseSpec("r-1", KEY, ((0, 1),))})
        prefill.handoff.save_layer(layers[0])
        started = time.monotonic()
        await prefill.handoff.preempt({KEY}, wait_s=0.05)
        assert time.monotonic() - started < 0.5
        assert prefill.handoff.parked() == 0
        await until(lambda: "d-1" in decode.reports.loads)
        assert decode.reports.loads == {"d-1": True}
        for canary in (0, 1, 4, 5, 6, 7):
            assert decode.block(canary) == [{0.0}] * 3
        prefill.handoff.hold(SendSpec("r-1", ((4, 5),), key=KEY))
        assert prefill.reports.freed == ["r-1"]  # spent: its blocks go back at once
