"""The native lane's GPU half (`kvray._copy_pool.Lane` with `cuda`, `add_cuda_pair`), its C logic
run on the host against a CUDA driver played by Python (ctypes callbacks at the addresses the
lane calls): a hold records its event on the engine's stream and the copy waits for it before
its captured copy is launched on the pair's stream; the ids go into the copy's staging; the
answer carries the digests its fold left, after its claim is let go; every refusal (ids out of
the regions, a request larger than any captured copy, a closed slot, a launch the driver
refuses) writes nothing and keeps the hold; a copy that fails is answered FAILED with its claim
let go; an ask waits for a busy captured copy and copies run one after another in launch order;
close and letting go of the pair wait for copies in flight. The real driver and kernels run in
`tests/gpu/test_connector_gpu.py` on a GPU."""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvray.agent.lane import Answer, hold_key
from kvray.notice.claims import ClaimBoard, ClaimClient

native = pytest.importorskip("kvray._copy_pool")

BLOCK = 64  # bytes of one block in one row
ROWS = 2  # (layer, part) rows: K and V of one layer
SRC_POOL = 8
DST_POOL = 8
KEY = bytes(range(16))
PREFILL, DECODE = 11, 22
CONTEXT, PAIR_STREAM, ENGINE_STREAM = 0x1000, 0x2000, 0x3000
CANARY = 0xEE

Ptr = ctypes.c_void_p
_pair = ctypes.CFUNCTYPE(ctypes.c_int, Ptr, Ptr)
_one = ctypes.CFUNCTYPE(ctypes.c_int, Ptr)
_out = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Ptr))
_create = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Ptr), ctypes.c_uint)
_wait = ctypes.CFUNCTYPE(ctypes.c_int, Ptr, Ptr, ctypes.c_uint)


@dataclass
class Graph:
    """A captured row copy as the lane sees one: staging, events and a cell of host memory."""

    capacity: int
    exec_id: int
    staging: np.ndarray = field(init=False)
    cell: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.staging = np.zeros(1 + 2 * self.capacity, dtype=np.int64)
        self.cell = np.zeros(2, dtype=np.uint64)

    @property
    def produced(self) -> int:
        return 0x10000 + self.exec_id

    @property
    def done(self) -> int:
        return 0x20000 + self.exec_id

    def record(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.capacity,
            self.exec_id,
            self.staging.ctypes.data,
            self.produced,
            self.done,
            self.cell.ctypes.data,
        )


class Driver:
    """The driver's calls the lane makes, played on host arrays: a launch copies the staged
    block pairs' rows from `src` to `dst` and leaves (content, placement) in the graph's cell;
    `sync_gate` holds each copy's wait until set; `fail` makes a call answer an error."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, rows: np.ndarray, graphs: list[Graph]) -> None:
        self.src, self.dst, self.rows = src, dst, rows
        self.graphs = {graph.exec_id: graph for graph in graphs}
        self.calls: list[tuple[str, int, int]] = []
        self.live_events: set[int] = set()
        self.fail: set[str] = set()
        self.sync_gate = threading.Event()
        self.sync_gate.set()
        self.launched: list[int] = []
        self._next_event = 0x50000
        self._lock = threading.Lock()
        self._callbacks = [
            _one(lambda ctx: self._note("set", ctx or 0)),
            _one(lambda ctx: self._note("push", ctx or 0)),
            _out(self._pop),
            _create(self._create),
            _one(self._destroy),
            _pair(lambda event, stream: self._note("record", event or 0, stream or 0)),
            _one(self._synchronize),
            _wait(lambda stream, event, flags: self._note("wait", stream or 0, event or 0)),
            _pair(self._launch),
        ]
        self.addresses = tuple(int(ctypes.cast(callback, Ptr).value or 0) for callback in self._callbacks)

    def _note(self, name: str, a: int, b: int = 0) -> int:
        with self._lock:
            self.calls.append((name, a, b))
        return 1 if name in self.fail else 0

    def _pop(self, out: ctypes._Pointer[Ptr]) -> int:
        out[0] = CONTEXT
        return 0

    def _create(self, out: ctypes._Pointer[Ptr], flags: int) -> int:
        with self._lock:
            self._next_event += 1
            event = self._next_event
            self.live_events.add(event)
        out[0] = event
        return self._note("create", event, flags)

    def _destroy(self, event: int | None) -> int:
        with self._lock:
            self.live_events.discard(event or 0)
        return self._note("destroy", event or 0)

    def _synchronize(self, event: int | None) -> int:
        self.sync_gate.wait(10.0)
        return self._note("synchronize", event or 0)

    def _launch(self, exec_id: int | None, stream: int | None) -> int:
        if self._note("launch", exec_id or 0, stream or 0):
            return 1
        graph = self.graphs[exec_id or 0]
        count = int(graph.staging[0])
        local = graph.staging[1 : 1 + count]
        remote = graph.staging[1 + graph.capacity : 1 + graph.capacity + count]
        src_start, src_stride, dst_start, dst_stride, nbytes = self.rows
        for r in range(self.rows.shape[1]):
            for i in range(count):
                at = int(src_start[r] + local[i] * src_stride[r])
                to = int(dst_start[r] + remote[i] * dst_stride[r])
                self.dst[to : to + nbytes[r]] = self.src[at : at + nbytes[r]]
        graph.cell[0] = 0xC0 + count  # "content"
        graph.cell[1] = 0xB0 + int(remote.sum())  # "placement"
        self.launched.append(exec_id or 0)
        return 0


@dataclass
class Rig:
    lane: object
    driver: Driver
    board: ClaimBoard
    client: ClaimClient
    sock: socket.socket
    path: str
    src: np.ndarray
    dst: np.ndarray
    graphs: list[Graph]

    def add_pair(self, *, dst_len: int | None = None) -> bool:
        slot = self.client.copy_slot(0, 0)
        stretch = np.zeros((6, 0), dtype=np.int64)
        return bool(
            self.lane.add_cuda_pair(  # type: ignore[attr-defined]
                DECODE,
                KEY,
                (self.dst.size if dst_len is None else dst_len, DST_POOL, CONTEXT, PAIR_STREAM),
                self.driver.rows,
                stretch,
                (slot.fd, slot.slots, slot.address),
                [graph.record() for graph in self.graphs],
                False,
            )
        )

    def hold(self, name: str, blocks: list[int]) -> bool:
        return bool(
            self.lane.hold(hold_key(name), np.array(blocks, dtype=np.int64), None, None, ENGINE_STREAM)  # type: ignore[attr-defined]
        )

    def ask(self, name: str, blocks: list[int], token: int, slot: int, ask_id: int = 1) -> socket.socket:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.connect(self.path)
        native.lane_ask(
            client.fileno(),
            KEY,
            PREFILL,
            DECODE,
            hold_key(name),
            token,
            slot,
            0,
            ask_id,
            np.array(blocks, dtype=np.int64),
            False,
        )
        return client

    @staticmethod
    def answer(client: socket.socket, wait_s: float = 5.0) -> tuple[Answer, int, int, int]:
        """(answer, placement, content, nbytes)."""
        client.settimeout(wait_s)
        data = client.recv(1024)
        _magic, status, _ask, _token, placement, content, _reference, _flags, nbytes = struct.unpack(
            "<IIQQQQQQQ", data
        )
        return Answer(status), placement, content, nbytes


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    row_bytes = SRC_POOL * BLOCK
    src = np.arange(ROWS * row_bytes, dtype=np.uint8) % 251
    dst = np.full(ROWS * DST_POOL * BLOCK + 2 * BLOCK, CANARY, dtype=np.uint8)  # a canary block after
    rows = np.ascontiguousarray(
        np.stack(
            [
                np.array([0, row_bytes]),  # source start of each row (K, then V)
                np.full(ROWS, BLOCK),
                np.array([0, DST_POOL * BLOCK]),
                np.full(ROWS, BLOCK),
                np.full(ROWS, BLOCK),
            ]
        ),
        dtype=np.int64,
    )
    graphs = [Graph(16, 1), Graph(16, 2), Graph(32, 3)]
    driver = Driver(src, dst, rows, graphs)
    path = str(tmp_path / "lane")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(path)
    sock.listen(8)
    lane = native.Lane(
        sock.fileno(),
        PREFILL,
        src.ctypes.data,
        src.size,
        SRC_POOL,
        0,
        1 << 20,
        0,
        0.0,
        (driver.addresses, CONTEXT),
    )
    board = ClaimBoard(str(tmp_path), 16)
    client = ClaimClient(board.path, "d", str(tmp_path))
    yield Rig(lane, driver, board, client, sock, path, src, dst, graphs)
    lane.close()
    client.close()
    board.dispose()
    sock.close()


def block_of(array: np.ndarray, pool: int, row: int, block: int) -> np.ndarray:
    start = row * pool * BLOCK + block * BLOCK
    return array[start : start + BLOCK]


def untouched(rig: Rig, except_blocks: frozenset[int] | set[int] = frozenset()) -> bool:
    for row in range(ROWS):
        for block in range(DST_POOL):
            if block not in except_blocks and not (block_of(rig.dst, DST_POOL, row, block) == CANARY).all():
                return False
    return bool((rig.dst[ROWS * DST_POOL * BLOCK :] == CANARY).all())


def test_a_gpu_lane_copy_waits_for_its_hold_launches_its_staged_ids_and_answers_its_digests(rig: Rig) -> None:
    assert rig.add_pair()
    assert rig.hold("h", [3, 5])
    create = [call for call in rig.driver.calls if call[0] == "create"]
    assert len(create) == 1
    hold_event = create[0][1]
    assert ("record", hold_event, ENGINE_STREAM) in rig.driver.calls  # on the engine's stream
    slot = rig.board.open(9)
    client = rig.ask("h", [6, 1], token=9, slot=slot)
    answer, placement, content, nbytes = rig.answer(client)
    client.close()
    assert answer is Answer.DONE and nbytes == 2 * ROWS * BLOCK
    graph = rig.graphs[0]  # the smallest size that fits
    assert (placement, content) == (0xB0 + 7, 0xC0 + 2)
    assert list(graph.staging[:3]) == [2, 3, 5] and list(graph.staging[17:19]) == [6, 1]
    calls = [call for call in rig.driver.calls if call[0] in ("wait", "record", "launch", "synchronize")]
    assert calls[-4:] == [
        ("wait", PAIR_STREAM, hold_event),
        ("record", graph.produced, PAIR_STREAM),
        ("launch", graph.exec_id, PAIR_STREAM),
        ("synchronize", graph.done, 0),
    ]
    for row in range(ROWS):
        assert (block_of(rig.dst, DST_POOL, row, 6) == block_of(rig.src, SRC_POOL, row, 3)).all()
        assert (block_of(rig.dst, DST_POOL, row, 1) == block_of(rig.src, SRC_POOL, row, 5)).all()
    assert untouched(rig, {1, 6})
    assert rig.board.try_close(slot)  # the claim was let go before the answer
    done = rig.lane.done()  # type: ignore[attr-defined]
    assert [(entry[1], entry[2], entry[5], entry[6]) for entry in done] == [
        (Answer.DONE, 2 * ROWS * BLOCK, 0, 2)
    ]
    assert not rig.driver.live_events  # the hold's event went with it


def test_refusals_write_nothing_and_keep_the_hold(rig: Rig) -> None:
    assert rig.add_pair(dst_len=ROWS * DST_POOL * BLOCK - 1)  # the last block's V row is outside
    assert rig.hold("h", [0, 1])
    slot = rig.board.open(4)

    def answer_of(name: str, blocks: list[int], token: int = 4) -> Answer:
        client = rig.ask(name, blocks, token=token, slot=slot)
        try:
            return rig.answer(client)[0]
        finally:
            client.close()

    assert answer_of("h", [2, DST_POOL - 1]) is Answer.REFUSED  # leaves the decode region
    assert answer_of("h", [2, 3], token=5) is Answer.NOT_OPEN
    rig.driver.fail.add("launch")
    assert answer_of("h", [2, 3]) is Answer.BUSY  # the driver refused the launch
    rig.driver.fail.clear()
    assert not rig.driver.launched and untouched(rig)
    assert rig.lane.holds >= 1  # type: ignore[attr-defined]
    assert rig.board.try_close(slot)  # no claim was kept
    slot = rig.board.open(4)
    assert answer_of("h", [2, 3]) is Answer.DONE
    assert untouched(rig, {2, 3})


def test_a_request_larger_than_any_captured_copy_goes_the_usual_way(rig: Rig) -> None:
    rig.graphs[:] = [Graph(1, 7)]
    rig.driver.graphs = {7: rig.graphs[0]}
    assert rig.add_pair()
    assert rig.hold("h", [0, 1])
    slot = rig.board.open(3)
    client = rig.ask("h", [4, 5], token=3, slot=slot)
    assert rig.answer(client)[0] is Answer.BUSY
    client.close()
    assert untouched(rig) and rig.board.try_close(slot)


def test_a_copy_that_fails_is_answered_failed_with_its_claim_let_go(rig: Rig) -> None:
    assert rig.add_pair()
    assert rig.hold("h", [0])
    rig.driver.fail.add("synchronize")
    slot = rig.board.open(8)
    client = rig.ask("h", [2], token=8, slot=slot)
    answer, placement, content, _ = rig.answer(client)
    client.close()
    assert (answer, placement, content) == (Answer.FAILED, 0, 0)
    assert rig.board.try_close(slot)
    time.sleep(0.05)
    assert [entry[1] for entry in rig.lane.done()] == [Answer.FAILED]  # type: ignore[attr-defined]


def test_asks_wait_for_a_busy_copy_and_finish_in_launch_order(rig: Rig) -> None:
    rig.graphs[:] = [Graph(16, 1)]  # one captured copy: the second ask waits for it
    rig.driver.graphs = {1: rig.graphs[0]}
    assert rig.add_pair()
    for index in range(3):
        assert rig.hold(f"h{index}", [index])
    slots = [rig.board.open(100 + index) for index in range(3)]
    rig.driver.sync_gate.clear()
    clients = [rig.ask(f"h{index}", [4 + index], token=100 + index, slot=slots[index]) for index in range(3)]
    time.sleep(0.2)
    assert rig.driver.launched == [1]  # the others wait for the one copy to be free
    assert not rig.board.try_close(slots[0])  # the first copy's claim is held while it runs
    rig.driver.sync_gate.set()
    answers = [rig.answer(client) for client in clients]
    for client in clients:
        client.close()
    assert [answer[0] for answer in answers] == [Answer.DONE] * 3
    assert rig.driver.launched == [1, 1, 1]
    for index in range(3):
        for row in range(ROWS):
            assert (
                block_of(rig.dst, DST_POOL, row, 4 + index) == block_of(rig.src, SRC_POOL, row, index)
            ).all()
    assert untouched(rig, {4, 5, 6})


def test_letting_go_of_the_pair_and_closing_wait_for_copies_in_flight(rig: Rig) -> None:
    assert rig.add_pair()
    assert rig.hold("h", [1])
    slot = rig.board.open(6)
    rig.driver.sync_gate.clear()
    client = rig.ask("h", [2], token=6, slot=slot)
    deadline = time.monotonic() + 5
    while not rig.driver.launched:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    removed = threading.Event()

    def remove() -> None:
        rig.lane.remove_pair(DECODE)  # type: ignore[attr-defined]
        removed.set()

    thread = threading.Thread(target=remove)
    thread.start()
    time.sleep(0.2)
    assert not removed.is_set()  # the copy still runs
    rig.driver.sync_gate.set()
    thread.join(5)
    assert removed.is_set()
    assert rig.answer(client)[0] is Answer.DONE
    client.close()
    assert rig.board.try_close(slot)
