"""Claims (between the plan and the completion of the data flow): a writer proves, for as long as
it writes, that the decode engine still expects the request, so the engine keeps its blocks.

On the engine's node (`ClaimBoard`, `ClaimClient`): a decode engine keeps a small file of slots
in a private folder of its own in the shared-memory folder, one slot per expected request: the
request's token and whether it is open. A writer holds a shared lock on the request's slot (an
open-file-description lock, which the kernel drops when the writer's process dies) from its
check of the slot until its last byte and its completion notice are out; a notice sent on its
own (a layer-wise push's finish) may just read that the slot is open, as it writes nothing into
the blocks. The engine takes the slot's lock exclusively to close it, so closing waits for every
write that had started, and a write that starts later finds the slot closed and writes nothing.
A request's blocks go back to the engine's pool only once its slot is closed.

Slot `i` is bytes [16 i, 16 i + 16) of the file: the token (uint64), then its state (uint64:
1 open, 2 closing, 0 closed). Only the engine writes them: the token and the open and closed
states while it holds the slot's lock exclusively; "closing" before it waits for that lock, so
a write that would start (or join one of its own process) while the engine waits is refused
instead of keeping the slot open.

Across nodes (`Claims`, over a transport whose writes the engine does not see land, `verbs`): the
writer asks the engine's actor once per request to keep the blocks until its notice comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import mmap
import os
import struct
import time
from collections import deque
from collections.abc import AsyncIterator

import numpy as np

from kvray.config import Settings
from kvray.errors import BackpressureError, NotExpectedError, TransportError
from kvray.host.calls import PeerCall
from kvray.notice.actor import call_host
from kvray.owned import BOARD_NAME, PeerPath, create_owned_folder, open_peer, remove_owned
from kvray.transport.base import Peer, PeerCache
from kvray.transport.cpu_copy import ClaimSlot
from kvray.wire import EngineInfo, Reservation, WriteClaim, encode

#: Key of the claim board's path in `EngineInfo.endpoints`.
ENDPOINT = "claim_board"
SLOT_NBYTES = 16
#: The most slots a board may have (a writer maps the whole board).
MAX_SLOTS = 1 << 20
_OPEN = 1
_CLOSED = 0
#: The engine is closing the slot and waits for the writers holding it: no new write may start.
_CLOSING = 2
#: One slot as it lies in the file (token, state), for a read without numpy's indexing.
_SLOT = struct.Struct("=QQ")


def _lock(fd: int, kind: int, slot: int, *, wait: bool = False) -> bool:
    """Set (F_RDLCK / F_WRLCK) or drop (F_UNLCK) an open-file-description lock on one slot.
    False when another description holds a conflicting lock (and `wait` is not set)."""
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0: an OFD lock has no owner pid).
    request = struct.pack("hhqqi4x", kind, os.SEEK_SET, slot * SLOT_NBYTES, SLOT_NBYTES, 0)
    command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, command, request)
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class ClaimBoard:
    """The decode engine's side: opens a slot per expected request and closes it once no
    writer holds it. One event loop owns it; a second thread (`kvray.agent.lane.DecodeLane`)
    may open and close slots of its own beside it (each call takes or returns one slot at a
    time, and no two owners touch one slot)."""

    def __init__(self, shm_dir: str, slots: int) -> None:
        # Locked for the board's life, so a sweep by another process never removes it.
        self.folder = create_owned_folder(shm_dir)
        self.path = os.path.join(self.folder, BOARD_NAME)
        self.slots = slots
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except BaseException:
            remove_owned(self.folder)
            raise
        try:
            os.ftruncate(self._fd, slots * SLOT_NBYTES)
            self._mm = mmap.mmap(self._fd, slots * SLOT_NBYTES, mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            remove_owned(self.folder)
            raise
        self._table = np.frombuffer(self._mm, dtype=np.uint64).reshape(slots, 2)
        self._free: deque[int] = deque(range(slots))

    def open(self, token: int) -> int:
        """A slot holding `token`, open to writers."""
        # A closed slot can still be read-locked for a moment by a writer that came too late
        # (it finds the slot closed and lets go): skip it and take the next.
        for _ in range(len(self._free)):
            slot = self._free.popleft()
            if _lock(self._fd, fcntl.F_WRLCK, slot):
                self._table[slot, 0] = token
                self._table[slot, 1] = _OPEN
                _lock(self._fd, fcntl.F_UNLCK, slot)
                return slot
            self._free.append(slot)
        raise BackpressureError(
            f"all {self.slots} claim slots of this engine are in use: too many requests expected "
            "at once (raise max_expected_requests, or free finished requests)",
            slots=self.slots,
        )

    def try_close(self, slot: int) -> bool:
        """Close the slot if no writer holds it; True once it is closed."""
        if not _lock(self._fd, fcntl.F_WRLCK, slot):
            return False
        self._table[slot, 1] = _CLOSED
        _lock(self._fd, fcntl.F_UNLCK, slot)
        self._free.append(slot)
        return True

    def mark_closing(self, slot: int) -> None:
        """No write of the slot may start any more; the engine closes it once its writers
        have let go (`try_close`)."""
        # An aligned 8-byte store, read whole by writers that check it under their shared lock.
        self._table[slot, 1] = _CLOSING

    async def close(self, slot: int, timeout: float) -> bool:
        """Close the slot, waiting up to `timeout` seconds for writers holding it to finish
        (or die); True once it is closed, False if a writer still held it at the deadline."""
        if self.try_close(slot):
            return True
        # An aligned 8-byte store, read whole by writers that check it under their shared lock.
        self._table[slot, 1] = _CLOSING
        # Polled: a lock gives the event loop nothing to wait on, and a thread blocked in
        # F_OFD_SETLKW could not be abandoned at the deadline.
        deadline = time.monotonic() + timeout
        pause = 50e-6
        while time.monotonic() < deadline:
            await asyncio.sleep(pause)
            if self.try_close(slot):
                return True
            pause = min(pause * 2, 5e-3)
        return False

    def dispose(self) -> None:
        """Remove the board (the engine is closing; nothing expects KV any more)."""
        del self._table
        with contextlib.suppress(BufferError):
            self._mm.close()
        os.close(self._fd)
        remove_owned(self.folder)


class ClaimClient:
    """A writer's view of one decode engine incarnation's board: claims slots while it writes.

    Claims of one slot by several writes of this process at once (a request's layers pushed
    concurrently) share one lock, taken by the first and dropped by the last."""

    def __init__(self, path: str, engine_id: str, shm_dir: str) -> None:
        self.engine_id = engine_id
        self.path = path
        fd = open_peer(
            path, PeerPath.CLAIM_BOARD, shm_dir, named_by=f"engine {engine_id!r}", engine_id=engine_id
        )
        try:
            status = os.fstat(fd)
            slots, rest = divmod(status.st_size, SLOT_NBYTES)
            if rest or not 0 < slots <= MAX_SLOTS:
                raise TransportError(
                    f"engine {engine_id!r}'s claim board {path} has {status.st_size} bytes, not a "
                    f"whole number of 1 to {MAX_SLOTS} slots; refusing to use it",
                    engine_id=engine_id,
                    path=path,
                )
            self._mm = mmap.mmap(fd, slots * SLOT_NBYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._table = np.frombuffer(self._mm, dtype=np.uint64).reshape(slots, 2)
        self._holders: dict[int, int] = {}
        self._closed = False

    @contextlib.asynccontextmanager
    async def hold(self, request_id: str, slot: int, token: int, timeout: float) -> AsyncIterator[None]:
        """Hold the request's slot while the body writes; raise `WriteFailedError` (nothing
        written) if the engine no longer expects the request under this token."""
        if self._closed:
            raise TransportError(f"claim board of {self.engine_id!r} was closed", engine_id=self.engine_id)
        if not 0 <= slot < self._table.shape[0]:
            raise NotExpectedError(
                f"reservation of {request_id!r} names claim slot {slot}, but engine "
                f"{self.engine_id!r} has {self._table.shape[0]}; nothing was written",
                request_id=request_id,
                engine_id=self.engine_id,
            )
        await self._acquire(slot, timeout)
        try:
            if int(self._table[slot, 0]) != token or int(self._table[slot, 1]) != _OPEN:
                raise NotExpectedError(
                    f"engine {self.engine_id!r} no longer expects request {request_id!r} under this "
                    "reservation (its wait ended, it was released, or the reservation is forged); "
                    "nothing was written",
                    request_id=request_id,
                    engine_id=self.engine_id,
                )
            yield
        finally:
            self._let_go(slot)

    def copy_slot(self, slot: int, token: int) -> ClaimSlot:
        """The request's slot as the C copy claims it itself (`kvray.transport.cpu_copy.copy_rows`,
        which checks the slot against the board's size): through this client's own open file,
        so its locks are apart from any other client's of the same board."""
        if self._closed:
            raise TransportError(f"claim board of {self.engine_id!r} was closed", engine_id=self.engine_id)
        return ClaimSlot(self._fd, slot, int(self._table.shape[0]), int(self._table.ctypes.data), token)

    def is_open(self, slot: int, token: int) -> bool:
        """Whether the slot is open under `token` now, read without its lock. Enough for a
        completion notice, which writes no byte into the request's blocks: the lock would tell
        no more (a request is no longer expected before its slot closes, and a decode engine
        drops a notice for a request it does not expect in any case). Writes take `hold`."""
        if self._closed or not 0 <= slot < self._table.shape[0]:
            return False
        # A read torn between the engine's two stores matches no open slot of this token.
        return _SLOT.unpack_from(self._mm, slot * SLOT_NBYTES) == (token, _OPEN)

    async def _acquire(self, slot: int, timeout: float) -> None:
        if self._holders.get(slot):
            self._holders[slot] += 1
            return
        # The engine holds a slot's lock only for a few instructions at a time.
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while not _lock(self._fd, fcntl.F_RDLCK, slot):
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"engine {self.engine_id!r} kept claim slot {slot} locked for {timeout} s",
                    engine_id=self.engine_id,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2e-3)
            if self._holders.get(slot):  # another write of ours took it meanwhile
                self._holders[slot] += 1
                return
        self._holders[slot] = 1

    def _let_go(self, slot: int) -> None:
        self._holders[slot] -= 1
        if self._holders[slot] == 0:
            del self._holders[slot]
            if not self._closed:
                _lock(self._fd, fcntl.F_UNLCK, slot)
            self._maybe_dispose()

    def close(self) -> None:
        """Forget the board; the file is closed once no claim of ours is held (closing it
        would drop those locks while their writes still run)."""
        self._closed = True
        self._maybe_dispose()

    def _maybe_dispose(self) -> None:
        if self._closed and not self._holders and self._fd >= 0:
            del self._table
            with contextlib.suppress(BufferError):
                self._mm.close()
            os.close(self._fd)
            self._fd = -1


class Claims:
    """One writer engine's claims on the decode engines it writes into: their boards on this
    node (at most `max_cached_peers` open), and the requests engines on other nodes hold for it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: The node this agent runs on (its notice set keeps it current).
        self.node_id = ""
        self._boards: PeerCache[None, ClaimClient] = PeerCache(settings.max_cached_peers, ClaimClient.close)
        #: Requests (id, token) an engine on another node holds for this writer.
        self._remote: set[tuple[str, int]] = set()

    def board_path(self, peer: Peer) -> str | None:
        """The path of `peer`'s claim board, when it is on this writer's node (None elsewhere)."""
        path = peer.info.endpoints.get(ENDPOINT)
        return path if path and peer.info.node_id == self.node_id else None

    @contextlib.asynccontextmanager
    async def hold(
        self, writer: EngineInfo, peer: Peer, reservation: Reservation, *, remote: bool = False
    ) -> AsyncIterator[None]:
        """Make sure the decode engine still expects the request, and keeps its blocks, while
        the body writes (a push sends its notice after the body; `finish` sends it inside); a
        request it no longer expects is refused before a byte moves. On its node: hold the
        request's slot in its claim board. Elsewhere, with
        `remote` (a transport whose writes the engine does not see land): ask it once per
        request to keep the blocks until this writer's notice. Other transports' receivers
        check each write themselves (`Receiver.admit`)."""
        path = self.board_path(peer)
        if path is None:
            if remote:
                await self._claim_remote(writer, peer, reservation)
            yield
            return
        info = peer.info
        board = self._boards.get(info.engine_id, info.incarnation, None)
        if board is None:
            board = ClaimClient(path, info.engine_id, self.settings.shm_dir)
            self._boards.put(info.engine_id, info.incarnation, None, board)
        async with board.hold(
            reservation.request_id, reservation.slot, reservation.token, self.settings.notify_timeout_s
        ):
            yield

    def client(self, peer: Peer) -> ClaimClient | None:
        """This writer's view of `peer`'s board, if it has opened one (None: not yet)."""
        return self._boards.get(peer.info.engine_id, peer.info.incarnation, None)

    def open_now(self, peer: Peer, reservation: Reservation) -> bool:
        """Whether a notice about `reservation` may go out at once, without taking the claim:
        on the engine's node, its slot is open under the reservation's token in a board this
        writer has opened already (read without its lock: a notice writes no byte into the
        request's blocks); elsewhere the engine checks the notice's token itself."""
        if self.board_path(peer) is None:
            return True
        board = self.client(peer)
        return board is not None and board.is_open(reservation.slot, reservation.token)

    def end(self, reservation: Reservation) -> None:
        """The request's writes and notice are over: a later push of it claims again."""
        self._remote.discard((reservation.request_id, reservation.token))

    async def _claim_remote(self, writer: EngineInfo, peer: Peer, reservation: Reservation) -> None:
        key = (reservation.request_id, reservation.token)
        if key in self._remote:
            return
        claim = WriteClaim(
            request_id=reservation.request_id,
            token=reservation.token,
            src_engine=writer.engine_id,
            src_incarnation=writer.incarnation,
            dst_engine=reservation.engine_id,
            dst_incarnation=reservation.incarnation,
        )
        what = f"the claim of {reservation.request_id!r}"
        await call_host(peer, what, PeerCall.CLAIM, encode(claim), self.settings.notify_timeout_s)
        self._remote.add(key)

    def forget(self, engine_id: str) -> None:
        self._boards.forget(engine_id)

    def close(self) -> None:
        self._boards.clear()
