"""kvray's batched memcpy and its pthread copy pool (kvray/_copy_pool.c); each array is
C-contiguous native int64."""

from collections.abc import Callable

class CopyJob:
    """A copy running on the pool's threads."""

    @property
    def over(self) -> bool: ...
    @property
    def complete(self) -> bool: ...
    @property
    def notice_sent(self) -> bool: ...
    def fileno(self) -> int: ...

def scatter_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: object,
    src_offsets: object,
    nbytes: object,
) -> None: ...
def start_copy(
    dst_base: int,
    src_base: int,
    dst_offsets: object,
    src_offsets: object,
    nbytes: object,
    threads: int,
    piece: int,
    notice: tuple[int, bytes, bytes] | None = None,
) -> CopyJob: ...
def set_worker_hook(hook: Callable[[int, int, int], bool] | None) -> None: ...
