"""`kvray._copy_pool.start_rows` (through `kvray.transport.cpu_copy.copy_rows`): the C copy that
plans a request from its rows and paired block ids. It checks every op against both regions
before a byte moves, takes the request's claim slot (a shared lock) and holds it until its last
byte is in place (the notice goes after), and reports the same digests as the ops it expands
would give `scatter_copy`."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvray.transport import cpu_copy
from kvray.transport.cpu_copy import ClaimSlot, Hashing, copy_rows, scatter_copy

pytestmark = [
    pytest.mark.fast,
    pytest.mark.skipif(not cpu_copy.rows_native(), reason="kvray._copy_pool is not built"),
]

SLOT_NBYTES = 16
TOKEN = 0x1234_5678_9ABC
#: Two rows (a layer's K and V, say): source start and stride, destination start and stride, bytes.
ROWS = np.array([[0, 4096], [1024, 1024], [64, 8256], [1024, 1024], [512, 512]], dtype=np.int64)
SRC_NBYTES, DST_NBYTES = 4096 + 1024 * 16, 8256 + 1024 * 16


class Board:
    """A claim board as a decode engine keeps one: slots of (token, state), in a file."""

    def __init__(self, path: Path, slots: int = 4) -> None:
        self.path = path
        path.write_bytes(bytes(SLOT_NBYTES * slots))
        self.fd = os.open(path, os.O_RDWR)
        self.slots = slots
        self.table = np.memmap(path, dtype=np.uint64, mode="r+", shape=(slots, 2))

    def open_slot(self, slot: int, token: int = TOKEN) -> None:
        self.table[slot] = (token, 1)

    def close_slot(self, slot: int) -> None:
        self.table[slot] = (0, 0)

    def claim(self, slot: int, token: int = TOKEN) -> ClaimSlot:
        return ClaimSlot(self.fd, slot, self.slots, int(self.table.ctypes.data), token)

    def try_lock_exclusive(self, slot: int) -> int | None:
        """The engine's exclusive lock on `slot` through a file description of its own (its fd),
        or None while a writer holds the slot."""
        fd = os.open(self.path, os.O_RDWR)
        request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, slot * SLOT_NBYTES, SLOT_NBYTES, 0)
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
        except OSError:
            os.close(fd)
            return None
        return fd


@pytest.fixture
def board(tmp_path: Path) -> Iterator[Board]:
    made = Board(tmp_path / "board")
    yield made
    os.close(made.fd)


def _regions() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.integers(0, 256, SRC_NBYTES, dtype=np.uint8), np.zeros(DST_NBYTES, dtype=np.uint8)


def _expanded(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ops the rows and ids stand for, one per (row, block pair): destination and source
    offsets and lengths."""
    src, dst, nbytes = [], [], []
    for row in range(ROWS.shape[1]):
        src += (ROWS[0, row] + ids[0] * ROWS[1, row]).tolist()
        dst += (ROWS[2, row] + ids[1] * ROWS[3, row]).tolist()
        nbytes += [int(ROWS[4, row])] * ids.shape[1]
    return (np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64), np.array(nbytes, dtype=np.int64))


async def _copy(
    src: np.ndarray,
    dst: np.ndarray,
    ids: np.ndarray,
    claim: ClaimSlot,
    *,
    threads: int = 1,
    big: bool = False,
    notice: tuple[int, bytes, bytes, int] | None = None,
) -> tuple[object, bool] | None:
    nbytes = 1 << 30 if big else 1  # over or under the size copied on the calling thread
    return await copy_rows(
        dst.ctypes.data,
        src.ctypes.data,
        ROWS,
        ids,
        src.size,
        dst.size,
        nbytes,
        threads=threads,
        notice=notice,
        claim=claim,
        salt=7 << 56,
        hashing=Hashing.between(0, 0),
    )


@pytest.mark.parametrize("big", [False, True], ids=["inline", "pool"])
@pytest.mark.parametrize(
    "pairs",
    [[(0, 0), (1, 1), (2, 2), (3, 3)], [(5, 9), (2, 0), (11, 15), (3, 14)], [(0, 3), (1, 4), (7, 5)]],
    ids=["contiguous", "scattered", "partly"],
)
async def test_rows_copy_as_their_ops_would_with_the_same_digests(
    board: Board, pairs: list[tuple[int, int]], big: bool
) -> None:
    """The bytes land where the expanded ops put them and nowhere else, and the placement and
    content digests equal those of `scatter_copy` over the expanded ops (runs merged or not)."""
    src, dst = _regions()
    pairs.sort()
    ids = np.ascontiguousarray(np.array(pairs, dtype=np.int64).T)
    board.open_slot(1)
    done = await _copy(src, dst, ids, board.claim(1), threads=3, big=big)
    assert done is not None
    stored, sent = done
    assert not sent  # no notice asked for
    expected = np.zeros_like(dst)
    dst_offsets, src_offsets, nbytes = _expanded(ids)
    reference = scatter_copy(
        expected.ctypes.data,
        src.ctypes.data,
        dst_offsets,
        src_offsets,
        nbytes,
        7 << 56,
        Hashing.between(0, 0),
    )
    assert np.array_equal(dst, expected)
    assert stored == reference
    # The claim went with the last byte: the engine may close the slot now.
    locked = board.try_lock_exclusive(1)
    assert locked is not None
    os.close(locked)


@pytest.mark.parametrize("big", [False, True], ids=["inline", "pool"])
async def test_an_op_past_either_region_is_refused_before_a_byte_moves(board: Board, big: bool) -> None:
    src, dst = _regions()
    board.open_slot(0)
    for pairs in ([(0, 0), (1, 16)], [(16, 0)], [(0, 1 << 60)], [(-1, 0)]):
        ids = np.ascontiguousarray(np.array(pairs, dtype=np.int64).T)
        with pytest.raises(ValueError, match="leaves a region"):
            await _copy(src, dst, ids, board.claim(0), big=big)
        assert not dst.any()
    locked = board.try_lock_exclusive(0)  # no claim kept by a refused copy
    assert locked is not None
    os.close(locked)


async def test_a_slot_not_open_under_the_token_writes_nothing(board: Board) -> None:
    src, dst = _regions()
    ids = np.array([[0, 1], [0, 1]], dtype=np.int64)
    board.open_slot(2, token=TOKEN + 1)
    with pytest.raises(LookupError, match="not open under its token"):
        await _copy(src, dst, ids, board.claim(2))
    board.close_slot(2)
    with pytest.raises(LookupError, match="not open under its token"):
        await _copy(src, dst, ids, board.claim(2))
    with pytest.raises(LookupError, match="not one of the board's"):
        await _copy(src, dst, ids, board.claim(4))
    assert not dst.any()
    locked = board.try_lock_exclusive(2)
    assert locked is not None
    os.close(locked)


async def test_a_slot_the_engine_holds_is_given_way_to_and_nothing_written(board: Board) -> None:
    """While the engine holds the slot's lock (it is closing the slot), the copy returns None at
    once and writes nothing; once it lets go, the copy runs."""
    src, dst = _regions()
    ids = np.array([[0, 1], [0, 1]], dtype=np.int64)
    board.open_slot(3)
    engine = board.try_lock_exclusive(3)
    assert engine is not None
    assert await _copy(src, dst, ids, board.claim(3)) is None
    assert not dst.any()
    os.close(engine)
    assert await _copy(src, dst, ids, board.claim(3)) is not None
    assert dst.any()


@pytest.mark.parametrize("big", [False, True], ids=["inline", "pool"])
async def test_the_claim_is_let_go_before_the_notice_goes(board: Board, tmp_path: Path, big: bool) -> None:
    """The decode engine that takes the notice may close the slot at once: the copy lets go of
    the claim before it sends the notice, so whoever reads the notice finds the slot free."""
    src, dst = _regions()
    ids = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int64)
    inbox_path = str(tmp_path / "inbox")
    inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    inbox.bind(inbox_path)
    inbox.settimeout(10)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    free_when_told: list[bool] = []

    def read_notice() -> None:
        inbox.recv(64)
        locked = board.try_lock_exclusive(1)  # as the engine's release does, told it is done
        free_when_told.append(locked is not None)
        if locked is not None:
            os.close(locked)

    rounds = 500
    loop = asyncio.get_running_loop()
    try:
        for _ in range(rounds):
            board.open_slot(1)
            reader = loop.run_in_executor(None, read_notice)
            notice = (sender.fileno(), inbox_path.encode(), b"done", 0)
            done = await _copy(src, dst, ids, board.claim(1), threads=2, big=big, notice=notice)
            assert done is not None and done[1]  # the notice went
            await asyncio.wait_for(reader, 10)
    finally:
        inbox.close()
        sender.close()
    assert free_when_told == [True] * rounds


async def test_the_claim_is_held_while_the_pool_copies(board: Board) -> None:
    """A copy on the pool's threads holds the slot until its last byte is in place: a test hook
    parks the pool's thread, and the engine cannot take the slot until it lets go."""
    src, dst = _regions()
    ids = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int64)
    board.open_slot(1)
    parked = asyncio.Event()
    go = asyncio.Event()
    loop = asyncio.get_running_loop()
    from kvray import _copy_pool

    def hook(low: int, high: int, nbytes: int) -> bool:
        loop.call_soon_threadsafe(parked.set)
        asyncio.run_coroutine_threadsafe(go.wait(), loop).result(10)
        return True

    _copy_pool.set_worker_hook(hook)
    try:
        copying = asyncio.ensure_future(_copy(src, dst, ids, board.claim(1), big=True))
        await asyncio.wait_for(parked.wait(), 10)
        assert board.try_lock_exclusive(1) is None
        go.set()
        assert await asyncio.wait_for(copying, 10) is not None
    finally:
        _copy_pool.set_worker_hook(None)
    locked = board.try_lock_exclusive(1)
    assert locked is not None
    os.close(locked)
