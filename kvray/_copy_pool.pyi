"""kvray's batched memcpy and its pthread copy pool (kvray/_copy_pool.c); each array is
C-contiguous native int64."""

from collections.abc import Callable
from typing import Any

class CopyJob:
    """A copy running on the pool's threads."""

    @property
    def over(self) -> bool: ...
    @property
    def complete(self) -> bool: ...
    @property
    def notice_sent(self) -> bool: ...
    @property
    def placement(self) -> int: ...
    @property
    def content(self) -> int: ...
    def fileno(self) -> int: ...

def scatter_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: object,
    src_offsets: object,
    nbytes: object,
    salt: int = 0,
    seed: int = 0,
    pair_salt: int = 0,
    content: bool = False,
) -> Any: ...
def start_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: object,
    src_offsets: object,
    nbytes: object,
    threads: int,
    piece: int,
    notice: tuple[int, bytes, bytes] | tuple[int, bytes, bytes, int] | None = None,
    salt: int = 0,
    base: int = 0,
    content: bool = False,
    seed: int = 0,
    pair_salt: int = 0,
    content_base: int = 0,
) -> CopyJob: ...
def hash_ranges(base: int, offsets: object, nbytes: object, seed: int, logical: object = ...) -> bytes: ...
def set_executor_fault(on: bool) -> None: ...
def set_worker_hook(hook: Callable[[int, int, int], bool] | None) -> None: ...
def start_rows(
    dst_base: int,
    src_base: int,
    rows: object,
    ids: object,
    src_nbytes: int,
    dst_nbytes: int,
    threads: int,
    piece: int,
    notice: tuple[int, bytes, bytes, int] | None,
    claim: tuple[int, int, int, int, int] | None,
    salt: int = 0,
    content: bool = False,
    seed: int = 0,
    pair_salt: int = 0,
) -> CopyJob | None: ...

class Lane:
    """A prefill engine's native hand-off lane (kvray/_lane.c, kvray/agent/lane.py)."""

    def __init__(
        self,
        listen_fd: int,
        incarnation: int,
        src_base: int,
        src_len: int,
        src_pool: int,
        threads: int,
        piece: int,
        inline_max: int,
    ) -> None: ...
    def add_pair(
        self,
        incarnation: int,
        key: bytes,
        destination: tuple[int, int, int, int, int],
        rows: object,
        stretch: object,
        board: tuple[int, int, int],
        salt: int,
        seed: int,
        pair_salt: int,
        checked: bool,
    ) -> bool: ...
    def remove_pair(self, incarnation: int) -> bool: ...
    def hold(self, key: bytes, ids: object, sums: object | None, held: object | None) -> bool: ...
    def unhold(self, key: bytes) -> bool: ...
    def done(self) -> list[tuple[bytes, int, int, float, int]]: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    @property
    def holds(self) -> int: ...

def lane_ask(
    fd: int,
    key: bytes,
    prefill_incarnation: int,
    decode_incarnation: int,
    hold: bytes,
    token: int,
    slot: int,
    first_block: int,
    ask_id: int,
    ids: object,
    checked: bool,
) -> None: ...
def lane_answers(fd: int) -> tuple[list[tuple[int, int, int, int, int, int, int, int, float]], int]: ...
def lane_stamp(fd: int) -> None: ...
def lane_siphash(key: bytes, data: bytes) -> int: ...
