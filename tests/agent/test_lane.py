"""The hand-off's native lane (`kvray.agent.lane`): routine loads between two connector workers
of one deployment go through it and land exactly; forged, stale and ill-fitting asks are
answered (or dropped) without a byte written; a prefill engine gone fails its asks."""

from __future__ import annotations

import fcntl
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvray.agent.handoff import HandoffEvent, HandoffStep, LoadSpec, Moved, SendSpec
from kvray.agent.lane import Answer, hold_key, lane_path
from kvray.config import Settings
from kvray.integrations.vllm.tickets import HandoffKey
from kvray.integrations.vllm.worker import ConnectorWorker
from kvray.memory import Backing
from kvray.notice.claims import _lock
from kvray.notice.local import PUSH_ENDPOINT
from kvray.wire import Role
from tests.unit.test_vllm_worker import block_values, fill_blocks, load_from

pytest.importorskip("kvray._copy_pool")
from kvray._copy_pool import lane_ask

NUM_BLOCKS = 16
BLOCK_SIZE = 4
LAYERS = 3
KEY = HandoffKey(bytes(range(32)))
#: What fills every block no hand-off writes (a canary).
CANARY = -7.0


def caches(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    per_layer = NUM_BLOCKS * 2 * BLOCK_SIZE * 8
    flat = buffer.view(torch.float16)
    return {
        f"layer.{index}": flat[index * per_layer : (index + 1) * per_layer].view(
            NUM_BLOCKS, 2, BLOCK_SIZE, 2, 4
        )
        for index in range(LAYERS)
    }


class Watcher:
    """An observer that notes each moved request's blocks as it sees them (still held)."""

    def __init__(self) -> None:
        self.worker: ConnectorWorker | None = None
        self.seen: list[tuple[str, str, tuple[int, ...], list[list[set[float]]]]] = []

    def event(self, event: HandoffEvent, request_id: str, handoff: str, error: str = "") -> None:
        pass

    async def moved(self, moved: Moved, backing: Backing) -> None:
        assert self.worker is not None
        values = [block_values(self.worker, block) for block in moved.blocks]
        self.seen.append((moved.event.value, moved.handoff, moved.blocks, values))


def pair(
    tmp_path: Path, *, transfer_timeout_s: float = 10.0, watch: bool = False
) -> tuple[ConnectorWorker, ConnectorWorker]:
    settings = Settings(
        shm_dir=str(tmp_path),
        notify_timeout_s=5.0,
        transfer_timeout_s=transfer_timeout_s,
        native_lane=True,
        integrity_sample_rate=0.0,  # a sampled request goes the usual way
    )
    prefill = ConnectorWorker("lane-p", Role.DECODE, settings, lease_s=30.0, proof=KEY)
    decode = ConnectorWorker("lane-d", Role.DECODE, settings, lease_s=30.0, proof=KEY)
    nbytes = LAYERS * NUM_BLOCKS * 2 * BLOCK_SIZE * 8 * 2
    for worker in (prefill, decode):
        if watch:
            worker.observer = watcher = Watcher()
            watcher.worker = worker
        with worker.allocation_context():
            buffer = torch.zeros(nbytes + (1 << 20), dtype=torch.int8)
        worker.register(caches(buffer[:nbytes]), NUM_BLOCKS, BLOCK_SIZE)
    return prefill, decode


def hold(prefill: ConnectorWorker, request_id: str, key: str, blocks: tuple[int, ...]) -> None:
    prefill.begin(HandoffStep(sends={request_id: SendSpec(request_id, (blocks,), key=key)}))


def received(worker: ConnectorWorker, request_id: str, seconds: float = 20.0) -> bool:
    """Whether `request_id` arrived whole (False: it was reported failed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _, got, _, failed = worker.finished()
        if request_id in got:
            return request_id not in failed
        time.sleep(0.002)
    raise AssertionError(f"{request_id} was not reported within {seconds} s")


def lane_holds(prefill: ConnectorWorker) -> int:
    lane = prefill.agent._pusher.lane
    return 0 if lane is None else lane.holds


def warm_up(prefill: ConnectorWorker, decode: ConnectorWorker) -> None:
    """Hand-offs the usual way until the prefill engine's lane has paired with the decode
    engine (the first push pairs them; one that beats the lane's opening, the next)."""
    for round_ in range(5):
        hold(prefill, f"warm-p-{round_}", f"warm-{round_}", (0,))
        decode.begin(
            HandoffStep(
                loads={f"warm-d-{round_}": load_from(prefill, f"warm-d-{round_}", f"warm-{round_}", (0,))}
            )
        )
        assert received(decode, f"warm-d-{round_}")
        lane = prefill.agent._pusher.lane
        if lane is not None and lane._pairs:
            time.sleep(0.1)  # past the decode engine's pause after asks its lane did not take
            return
    raise AssertionError("the engines never paired")


def until(condition: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_routine_loads_go_through_the_lane_and_land_exactly(tmp_path: Path) -> None:
    prefill, decode = pair(tmp_path)
    try:
        warm_up(prefill, decode)  # the first push pairs the engines the usual way
        fill_blocks(decode, {block: CANARY for block in range(NUM_BLOCKS)})
        for round_ in range(12):
            source = (round_ % 5, 5 + round_ % 3)
            target = (10 + round_ % 2, 13 - round_ % 2)
            fill_blocks(prefill, {source[0]: 1.0 + round_, source[1]: 2.0 + round_})
            key = f"h-{round_}"
            hold(prefill, f"p-{round_}", key, source)
            until(lambda: lane_holds(prefill) == 1)
            decode.begin(HandoffStep(loads={f"d-{round_}": load_from(prefill, f"d-{round_}", key, target)}))
            assert received(decode, f"d-{round_}")
            for src, dst in zip(source, target, strict=True):
                assert block_values(decode, dst) == block_values(prefill, src)
            for block in set(range(NUM_BLOCKS)) - {10, 11, 12, 13}:
                assert block_values(decode, block) == [{CANARY + 16 * index} for index in range(LAYERS)]
            for block in target:  # ready for the next round's check
                fill_blocks(decode, {block: CANARY})
        lane = decode._lane
        assert lane is not None and not decode._lane_asks
        assert lane.moved == 12  # every round through the lane
        # Counted on the agent's loop, taken there as vLLM's next steps ask for finished loads.
        until(lambda: decode.finished() and decode.agent.stats.get("lane_asks_done", 0) >= 12)
        assert lane_holds(prefill) == 0
        # Every slot the lane took is closed again: the board has all of them free.
        board = decode.agent._receiving.board
        assert board is not None and len(board._free) == board.slots
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_an_observer_sees_both_sides_of_a_lane_push_with_the_blocks_still_held(tmp_path: Path) -> None:
    """Engines with an observer (a digest log) take the lane too: each side's observer sees
    the request's blocks, as moved, before they are reported (and may go)."""
    prefill, decode = pair(tmp_path, watch=True)
    try:
        warm_up(prefill, decode)
        lane = decode._lane
        assert lane is not None
        moved = lane.moved
        fill_blocks(prefill, {2: 6.0, 3: 7.0, 4: 8.0})
        hold(prefill, "p-1", "h-1", (2, 3, 4))
        until(lambda: lane_holds(prefill) == 1)
        # The decode engine has the first block already (a prefix it cached): two move.
        decode.begin(HandoffStep(loads={"d-1": load_from(prefill, "d-1", "h-1", (12, 14), first_block=1)}))
        assert received(decode, "d-1")
        assert lane.moved == moved + 1
        sent: set[str] = set()
        until(lambda: sent.update(prefill.finished()[0]) or "p-1" in sent)
        watched = {
            side: [entry for entry in worker.observer.seen if entry[1] == "h-1"]  # type: ignore[union-attr]
            for side, worker in (("sent", prefill), ("received", decode))
        }
        assert [entry[:3] for entry in watched["sent"]] == [("sent", "h-1", (3, 4))]
        assert [entry[:3] for entry in watched["received"]] == [("received", "h-1", (12, 14))]
        assert (
            watched["sent"][0][3]
            == watched["received"][0][3]
            == [block_values(prefill, 3), block_values(prefill, 4)]
        )
    finally:
        prefill.shutdown()
        decode.shutdown()


def raw_ask(
    prefill: ConnectorWorker,
    decode: ConnectorWorker,
    handoff: str,
    blocks: list[int],
    *,
    key: bytes | None = None,
    prefill_incarnation: int | None = None,
    token: int = 5,
    slot: int = 0,
    wait_s: float = 2.0,
) -> tuple[list[tuple[int, ...]], bool]:
    """One ask sent by hand through the prefill engine's lane, and what came back."""
    info = prefill.info
    path = lane_path(info.endpoints[PUSH_ENDPOINT])
    d = decode.agent
    mac_key = key or KEY.lane_key(info.engine_id, info.incarnation, d.engine_id, d.incarnation)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(path)
        ids = np.array(blocks, dtype=np.int64)
        incarnation = info.incarnation if prefill_incarnation is None else prefill_incarnation
        lane_ask(
            sock.fileno(),
            mac_key,
            incarnation,
            d.incarnation,
            hold_key(handoff),
            token,
            slot,
            0,
            1,
            ids,
            True,
        )
        sock.settimeout(wait_s)
        try:
            answer = sock.recv(1024)
        except TimeoutError:
            return [], False
        if not answer:
            return [], True
        _magic, status, *rest = struct.unpack("<IIQQQQQQQ", answer)
        return [(rest[0], status, *rest[1:])], False


def test_forged_stale_and_ill_fitting_asks_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvray.agent.push

    monkeypatch.setattr(kvray.agent.push, "_LANE_PARK_S", 0.1)  # an ask for no hold waits 0.1 s
    prefill, decode = pair(tmp_path)
    try:
        fill_blocks(decode, {block: CANARY for block in range(NUM_BLOCKS)})
        fill_blocks(prefill, {1: 3.0, 2: 4.0})
        warm_up(prefill, decode)
        fill_blocks(decode, {0: CANARY})
        hold(prefill, "p-1", "h-1", (1, 2))
        until(lambda: lane_holds(prefill) == 1)
        board = decode.agent._receiving.board
        assert board is not None
        token = 77
        slot = board.open(token)

        def answer_of(**kwargs: object) -> Answer | None:
            answers, _ = raw_ask(prefill, decode, kwargs.pop("handoff", "h-1"), **kwargs)  # type: ignore[arg-type]
            return Answer(answers[0][1]) if answers else None

        # A MAC under another key: no answer, the connection closed, the hold still there.
        assert answer_of(blocks=[6, 7], key=bytes(16), token=token, slot=slot) is None
        # Another incarnation of the prefill engine; a hold it does not have.
        assert (
            answer_of(
                blocks=[6, 7], prefill_incarnation=prefill.agent.incarnation + 1, token=token, slot=slot
            )
            is Answer.STALE
        )
        assert answer_of(handoff="h-nothing", blocks=[6, 7], token=token, slot=slot) is Answer.NOT_HELD
        # Ids outside the decode pool, repeated, or more than the hold has.
        for blocks in ([6, NUM_BLOCKS], [6, 6], [6, 7, 8], [-1, 7]):
            assert answer_of(blocks=blocks, token=token, slot=slot) is Answer.REFUSED
        # The slot under another token; a slot the engine holds while closing it.
        assert answer_of(blocks=[6, 7], token=token + 1, slot=slot) is Answer.NOT_OPEN
        assert _lock(board._fd, fcntl.F_WRLCK, slot)
        try:
            assert answer_of(blocks=[6, 7], token=token, slot=slot) is Answer.CLOSING
        finally:
            _lock(board._fd, fcntl.F_UNLCK, slot)
        for block in range(NUM_BLOCKS):
            assert block_values(decode, block) == [{CANARY + 16 * index} for index in range(LAYERS)]
        assert lane_holds(prefill) == 1  # every refusal gave the hold back
        # The right ask takes it, once.
        assert answer_of(blocks=[6, 7], token=token, slot=slot) is Answer.DONE
        assert block_values(decode, 6) == block_values(prefill, 1) and block_values(
            decode, 7
        ) == block_values(prefill, 2)
        assert answer_of(blocks=[8, 9], token=token, slot=slot) is Answer.NOT_HELD
        assert board.try_close(slot)
        sent: set[str] = set()
        until(lambda: sent.update(prefill.finished()[0]) or "p-1" in sent)  # its blocks go back
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_an_ask_before_its_hold_waits_for_it_or_is_sent_the_usual_way(tmp_path: Path) -> None:
    """The decode engine may ask as soon as the prefill engine answered the request, before the
    prefill engine's next step holds it: the lane keeps the ask until the hold comes, and
    answers "not held" at once when the prefill engine keeps the hold from the lane, or when
    the wait ends."""
    prefill, decode = pair(tmp_path)
    results: dict[str, tuple[list[tuple[int, ...]], bool]] = {}
    try:
        fill_blocks(decode, {block: CANARY for block in range(NUM_BLOCKS)})
        fill_blocks(prefill, {1: 3.0, 2: 4.0})
        warm_up(prefill, decode)
        fill_blocks(decode, {0: CANARY})
        board = decode.agent._receiving.board
        lane = prefill.agent._pusher.lane
        assert board is not None and lane is not None
        token = 91
        slot = board.open(token)

        def ask(handoff: str, blocks: list[int]) -> threading.Thread:
            def run() -> None:
                results[handoff] = raw_ask(
                    prefill, decode, handoff, blocks, token=token, slot=slot, wait_s=10.0
                )

            thread = threading.Thread(target=run)
            thread.start()
            until(lambda: lane.parked == 1)
            return thread

        # Asked first, held later: the ask waits, then takes the hold and copies.
        early = ask("h-early", [6, 7])
        time.sleep(0.2)
        for block in range(NUM_BLOCKS):  # nothing written while it waits
            assert block_values(decode, block) == [{CANARY + 16 * index} for index in range(LAYERS)]
        hold(prefill, "p-early", "h-early", (1, 2))
        early.join(10.0)
        assert Answer(results["h-early"][0][0][1]) is Answer.DONE and lane.parked == 0
        assert block_values(decode, 6) == block_values(prefill, 1)
        assert block_values(decode, 7) == block_values(prefill, 2)
        # A hand-off the prefill engine will never hold (its request ended without KV) settles
        # the ask at once, with nothing written.
        fill_blocks(decode, {6: CANARY, 7: CANARY})
        kept = ask("h-kept", [8, 9])
        started = time.monotonic()
        prefill.begin(HandoffStep(dropped={"h-kept"}))
        kept.join(10.0)
        assert Answer(results["h-kept"][0][0][1]) is Answer.NOT_HELD
        assert time.monotonic() - started < 1.5  # not the wait's end (2 s)
        for block in range(NUM_BLOCKS):
            assert block_values(decode, block) == [{CANARY + 16 * index} for index in range(LAYERS)]
        # No hold comes: the wait ends and the ask goes the usual way.
        started = time.monotonic()
        ask("h-never", [8, 9]).join(10.0)
        assert Answer(results["h-never"][0][0][1]) is Answer.NOT_HELD
        assert time.monotonic() - started >= 1.5
        # A lane that closes answers what waits in it.
        closing = ask("h-closing", [8, 9])
        prefill.shutdown()
        closing.join(10.0)
        assert results["h-closing"][0] == [] or Answer(results["h-closing"][0][0][1]) is Answer.NOT_HELD
        for block in range(NUM_BLOCKS):
            assert block_values(decode, block) == [{CANARY + 16 * index} for index in range(LAYERS)]
        assert board.try_close(slot)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_letting_go_of_a_decode_engine_answers_its_waiting_asks_at_once(tmp_path: Path) -> None:
    """A decode engine the prefill engine's lane lets go of (it went away): its asks waiting
    for holds are answered at once, unserved, and letting go does not wait out their wait."""
    prefill, decode = pair(tmp_path)
    answers: list[tuple[list[tuple[int, ...]], bool]] = []
    try:
        warm_up(prefill, decode)
        lane = prefill.agent._pusher.lane
        assert lane is not None
        thread = threading.Thread(
            target=lambda: answers.append(raw_ask(prefill, decode, "h-1", [8], wait_s=10.0))
        )
        thread.start()
        until(lambda: lane.parked == 1)
        started = time.monotonic()
        lane.remove_pair(decode.agent.incarnation)
        hold(prefill, "p-1", "h-1", (1,))  # too late: the ask is not served
        thread.join(10.0)
        assert time.monotonic() - started < 1.5  # not the wait's end (2 s)
        assert Answer(answers[0][0][0][1]) is Answer.NOT_HELD and lane.parked == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prefill_engine_gone_fails_its_loads_at_once_and_frees_the_slots(tmp_path: Path) -> None:
    prefill, decode = pair(tmp_path, transfer_timeout_s=30.0)
    try:
        fill_blocks(prefill, {1: 3.0})
        warm_up(prefill, decode)
        for round_ in range(2):
            hold(prefill, f"p-{round_}", f"h-{round_}", (1,))
            until(lambda: lane_holds(prefill) == 1)
            decode.begin(
                HandoffStep(loads={f"d-{round_}": load_from(prefill, f"d-{round_}", f"h-{round_}", (3,))})
            )
            assert received(decode, f"d-{round_}")
        info = prefill.info
        prefill.shutdown()
        started = time.monotonic()
        spec = LoadSpec(
            "d-2",
            info.engine_id,
            info.incarnation,
            "h-2",
            info.node_id,
            info.endpoints[PUSH_ENDPOINT],
            ((4,),),
            0,
        )
        decode.begin(HandoffStep(loads={"d-2": spec}))
        assert not received(decode, "d-2")
        assert time.monotonic() - started < 10  # not the 30 s deadline
        board = decode.agent._receiving.board
        assert board is not None
        until(lambda: len(board._free) == board.slots)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_an_executor_that_stores_elsewhere_and_a_block_rewritten_after_its_hold_fail_closed(
    tmp_path: Path,
) -> None:
    from kvray._copy_pool import set_executor_fault

    prefill, decode = pair(tmp_path)
    try:
        warm_up(prefill, decode)
        fill_blocks(prefill, {1: 3.0, 3: 5.0, 4: 6.0})
        lane = decode._lane
        assert lane is not None
        moved, done = lane.moved, lane.answers[Answer.DONE]
        # The lane's copy stores its last op over the one before, under a correct plan: its
        # placement digest says so, and the load fails.
        hold(prefill, "p-1", "h-1", (1, 3))
        until(lambda: lane_holds(prefill) == 1)
        set_executor_fault(True)
        try:
            decode.begin(HandoffStep(loads={"d-1": load_from(prefill, "d-1", "h-1", (5, 9))}))
            assert not received(decode, "d-1")
        finally:
            set_executor_fault(False)
        # A block written again after its digests were held: the copy's content digest differs
        # from the held one, and the load fails.
        hold(prefill, "p-2", "h-2", (3, 4))
        until(lambda: lane_holds(prefill) == 1)
        fill_blocks(prefill, {4: 9.0})
        decode.begin(HandoffStep(loads={"d-2": load_from(prefill, "d-2", "h-2", (6, 7))}))
        assert not received(decode, "d-2")
        assert lane.answers[Answer.DONE] == done + 2  # both copied through the lane ...
        assert lane.moved == moved  # ... and neither taken
        assert lane.waiting == 0 and not decode._lane_asks
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_copy_that_ends_incomplete_fails_its_load_and_frees_both_sides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvray.agent.push
    from kvray._copy_pool import set_worker_hook

    monkeypatch.setattr(kvray.agent.push, "_LANE_INLINE_MAX", 0)  # every lane copy on the pool
    prefill, decode = pair(tmp_path)
    try:
        warm_up(prefill, decode)
        fill_blocks(decode, {block: CANARY for block in range(NUM_BLOCKS)})
        fill_blocks(prefill, {1: 3.0, 2: 4.0})
        hold(prefill, "p-1", "h-1", (1, 2))
        until(lambda: lane_holds(prefill) == 1)
        set_worker_hook(lambda low, high, nbytes: False)  # the pool's threads copy nothing
        try:
            decode.begin(HandoffStep(loads={"d-1": load_from(prefill, "d-1", "h-1", (5, 6))}))
            assert not received(decode, "d-1")
        finally:
            set_worker_hook(None)
        lane = decode._lane
        assert lane is not None and lane.answers[Answer.FAILED] == 1
        for block in range(NUM_BLOCKS):
            assert block_values(decode, block) == [{CANARY + 16 * index} for index in range(LAYERS)]
        sent: set[str] = set()
        until(lambda: sent.update(prefill.finished()[0]) or "p-1" in sent)  # its blocks go back
        board = decode.agent._receiving.board
        assert board is not None and len(board._free) == board.slots
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_an_answer_is_timed_from_when_it_came_not_from_when_it_was_read() -> None:
    """The decode engine reads its answers when vLLM next asks for finished requests: the
    ask's time (`kvray_wait`, the benchmarks) ends when the answer came, as the kernel stamped
    it, not at that read."""
    from kvray._copy_pool import lane_answers, lane_stamp

    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with reader, writer:
        lane_stamp(reader.fileno())
        answer = struct.pack("<IIQQQQQQQ", 0x4B564C52, Answer.DONE, 7, 5, 0, 0, 0, 0, 64)
        before = time.monotonic()
        writer.send(answer)
        after = time.monotonic()
        time.sleep(0.3)
        answers, ended = lane_answers(reader.fileno())
        assert not ended and len(answers) == 1
        *fields, arrived = answers[0]
        assert fields[:3] == [7, Answer.DONE, 5]
        assert before - 0.005 <= arrived <= after + 0.005  # not the read, 0.3 s later


def test_holds_the_lane_hashes_wait_for_their_sums_and_can_be_let_go_of_meanwhile(tmp_path: Path) -> None:
    """A hold given no sums is queued for the lane's hasher (asks for it wait meanwhile); it is
    the lane's once hashed. Let go of while queued or being hashed, it is gone (never offered),
    and a second hold under its key is refused while the first waits."""
    from kvray._copy_pool import Lane

    block = 4 << 20  # a 4 MiB row per block: each hold takes a few ms to hash
    pool = 8
    source = np.ones(pool * block, dtype=np.uint8)  # pages of its own, read at memory's speed
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(tmp_path / "lane"))
    listener.listen(4)
    lane = Lane(listener.fileno(), 1, source.ctypes.data, source.size, pool, 0, 1 << 20, 0, 0.5)
    try:
        with pytest.raises(ValueError):  # no hash rows yet
            lane.hold(hold_key("h-0"), np.array([0], dtype=np.int64), None, None, 0, True)
        rows = np.array([[0], [0], [block], [block]], dtype=np.int64)  # held row 0: the whole block
        lane.hash_rows(rows, 1, 7)
        with pytest.raises(ValueError):  # once
            lane.hash_rows(rows, 1, 7)
        keys = [hold_key(f"h-{index}") for index in range(6)]
        for index, key in enumerate(keys):
            assert lane.hold(
                key, np.array([index % pool, (index + 1) % pool], dtype=np.int64), None, None, 0, True
            )
        assert lane.hashing >= 2  # they wait for their sums
        assert not lane.hold(keys[5], np.array([0], dtype=np.int64), None, None, 0, True)  # a key waiting
        assert lane.unhold(keys[5]) and lane.unhold(keys[0])  # queued, or being hashed
        until(lambda: lane.hashing == 0)
        assert lane.holds == 4
        assert not lane.unhold(keys[0]) and not lane.unhold(keys[5])  # gone, never offered
        assert all(lane.unhold(key) for key in keys[1:5])
        assert lane.holds == 0
    finally:
        lane.close()
        listener.close()
