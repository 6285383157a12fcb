"""The hand-off's native lane (the push and completion steps of the data flow, for the routine
hand-off between two engines on one node over `shm`): no Python on the prefill side, and none
of the agent's event loops on the decode side.

    decode   `DecodeLane.ask` (on the engine's own thread): opens the request's claim slot
             (as `expect` does) and sends the prefill engine one record over a connected
             SOCK_SEQPACKET socket (`kvray._copy_pool.lane_ask`): both incarnations, the
             hold's key, the slot, its token and the decode engine's block ids, under a MAC
             keyed by the pair (`AskProof.lane_key`: both engines derive it from the
             deployment's key; no one else can ask).
    prefill  a C thread (`kvray._copy_pool.Lane`, served by `PrefillLane`) checks the MAC,
             the incarnations, the ids (each in the decode engine's pool, none twice, as many
             as the hold has), takes the hold, computes the content digest the copy must give
             from the sums held for its blocks, checks every op against both regions, takes
             the claim slot's shared lock and checks it is open under the token, copies
             (hashing), lets go of the slot and answers: placement and content digests.
             An ask for a hold not there yet waits for it (`PARK_S`; the decode engine may
             ask before the prefill engine's next step holds the request); anything else it
             cannot take is answered at once, nothing written.
    decode   `DecodeLane.poll` (from `get_finished`): reads the answers, takes a request only
             when its placement digest equals the one its own layout gives and the content
             digest the writer's held reference, closes the slot (no writer holds it any
             more) and reports; an answer that says "ask the usual way" (not held yet, no
             digests, no lane to this engine) hands the load to the agent's loop.

Python keeps the first push of each pair (which makes the pair), tensor parallelism,
layer-wise pushes, groups with gaps, sampled requests, leases and metrics. Every guarantee of
the usual path holds: fencing by both incarnations and the slot's token, ids and ops checked
before a byte moves, a deadline on every ask (the slot is closed, waiting for a writer holding
it, before the blocks are reported), and a prefill engine seen gone fails its asks at once.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import hashlib
import logging
import os
import secrets
import socket
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvray.errors import KvrayError
from kvray.layout import Int64Array
from kvray.notice.claims import ClaimBoard
from kvray.owned import LANE_NAME, PeerPath, open_peer
from kvray.wire import TransportKind

_native: types.ModuleType | None
try:
    import kvray._copy_pool as _native
except ImportError:  # the C helpers are not built: no lane
    _native = None

log = logging.getLogger("kvray.lane")

#: The most block ids one ask carries (a request of more goes the usual way).
MAX_ASK_BLOCKS = 8192

#: How long an ask waits in the prefill engine's lane for the hold it names: the decode engine
#: may ask as soon as the prefill engine answered the request, before the prefill engine's next
#: step has held it. A hold the prefill engine keeps from the lane settles its asks at once.
PARK_S = 2.0


class Answer(enum.IntEnum):
    """What the prefill engine's lane answers an ask."""

    DONE = 0  # every byte is in place
    FAILED = 1  # the copy ended incomplete
    NOT_HELD = 2  # no such hold in the lane (yet, or any more): ask the usual way
    UNKNOWN_PAIR = 3  # no lane to this decode incarnation yet: ask the usual way
    STALE = 4  # the ask names another incarnation of the prefill engine
    REFUSED = 5  # ids that do not fit the hold, the pool or the regions: nothing written
    NOT_OPEN = 6  # the slot is not open under the token: nothing written
    CLOSING = 7  # the engine is closing the slot: nothing written
    UNCHECKED = 8  # a checked push whose blocks' digests are not all held: ask the usual way
    BUSY = 9  # the copy could not start: ask the usual way
    GONE = 10  # the decode engine's memory was removed or shrank: nothing written


#: Answers after which the usual path may still move the request (nothing was written).
USUAL_WAY = frozenset({Answer.NOT_HELD, Answer.UNKNOWN_PAIR, Answer.UNCHECKED, Answer.BUSY})


def available() -> bool:
    """Whether the C lane is built."""
    return _native is not None


def hold_key(handoff: str) -> bytes:
    """The 16 bytes a hold goes by in a lane (the MAC of an ask covers it)."""
    return hashlib.blake2b(handoff.encode(), digest_size=16).digest()


def lane_path(inbox: str) -> str:
    """A prefill engine's lane, beside its push-request inbox (in the same private folder)."""
    return os.path.join(os.path.dirname(inbox), LANE_NAME)


class LanePush(NamedTuple):
    """A push a prefill engine's lane ended."""

    key: bytes  # the hold's (`hold_key`)
    answer: Answer  # DONE or FAILED
    nbytes: int
    seconds: float  # from the ask to the answer
    decode_engine: str
    first_block: int  # the hold's blocks pushed: `num_blocks` from `first_block`
    num_blocks: int


class PrefillLane:
    """A prefill engine's lane: its socket, the C thread serving it, and the holds and pairs
    it may push. Built by the engine's `Pusher`; holds come from the hand-off's prefill side
    (on the agent's loop), pushes ended come back through `done` (`fileno` wakes a loop)."""

    def __init__(
        self,
        folder: str,
        incarnation: int,
        source: tuple[int, int, int],
        threads: int,
        piece: int,
        inline_max: int,
        park_s: float = PARK_S,
        cuda: tuple[tuple[int, ...], int] | None = None,
    ) -> None:
        """`source`: this engine's region (address, bytes, pool of blocks). `cuda`, for GPU
        caches: the driver's calls (`kvray.transport.cuda_ipc.driver.lane_calls`) and the
        source GPU's context; its pairs are then `add_cuda_pair`'s."""
        if _native is None:
            raise KvrayError("the C lane is not built")
        self.cuda = cuda is not None
        #: Whether it takes its holds' content sums itself (`hash_rows`).
        self.hashes = False
        #: The transport its copies stand in for (what metrics and observers are told).
        self.transport = TransportKind.CUDA_IPC if self.cuda else TransportKind.SHM
        self.path = os.path.join(folder, LANE_NAME)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._socket.bind(self.path)
            self._socket.listen(64)
            base, nbytes, pool = source
            self._lane = _native.Lane(
                self._socket.fileno(),
                incarnation,
                base,
                nbytes,
                pool,
                threads,
                piece,
                inline_max,
                park_s,
                cuda,
            )
        except BaseException:
            self._socket.close()
            raise
        #: The pairs' decode incarnations, each with its engine and what to let go of once
        #: the pair is removed.
        self._pairs: dict[int, tuple[str, Callable[[], None]]] = {}
        #: Called as the lane closes (before its descriptors go).
        self.on_close: list[Callable[[], None]] = []

    def add_pair(
        self,
        engine_id: str,
        incarnation: int,
        key: bytes,
        destination: tuple[int, int, int, int, int],
        rows: Int64Array,
        stretch: Int64Array,
        board: tuple[int, int, int],
        digests: tuple[int, int, int],
        *,
        checked: bool,
        release: Callable[[], None],
    ) -> bool:
        """Push asks of decode engine incarnation `incarnation` (MAC'd under `key`) into its
        region (`destination`: address, length, pool of blocks), by `rows` (5 x R: source
        start and stride, destination start and stride, bytes) and `stretch` (6 x S: held row,
        salt, source start and stride, destination start and stride, `kvray.content`), under
        its claim `board` (fd, slots, address); `digests`: placement salt, content seed and
        pair salt. `destination` also names the region's shared-memory file and the bytes it
        must keep, asked before every copy. `release` runs once the pair is removed and no
        copy into it runs."""
        if incarnation in self._pairs:
            return False
        placement_salt, seed, pair_salt = digests
        added = bool(
            self._lane.add_pair(
                incarnation, key, destination, rows, stretch, board, placement_salt, seed, pair_salt, checked
            )
        )
        if added:
            self._pairs[incarnation] = (engine_id, release)
        return added

    def add_cuda_pair(
        self,
        engine_id: str,
        incarnation: int,
        key: bytes,
        destination: tuple[int, int, int, int],
        rows: Int64Array,
        stretch: Int64Array,
        board: tuple[int, int, int],
        graphs: Sequence[tuple[int, int, int, int, int, int]],
        *,
        checked: bool,
        release: Callable[[], None],
    ) -> bool:
        """`add_pair` for GPU caches: `destination` is the decode engine's region's bytes, its
        pool of blocks, and the context and stream the copies run in; the copies are `graphs`,
        row copies captured for the pair (`kvray.transport.cuda_ipc.lane`: size, graph,
        staging, produced and done events, digest cell), which report both digests."""
        if incarnation in self._pairs:
            return False
        added = bool(
            self._lane.add_cuda_pair(
                incarnation, key, destination, rows, stretch, board, list(graphs), checked
            )
        )
        if added:
            self._pairs[incarnation] = (engine_id, release)
        return added

    def remove_pair(self, incarnation: int) -> None:
        """Forget a pair, once no copy into it runs (bounded: its copies are under way)."""
        pair = self._pairs.pop(incarnation, None)
        if pair is not None:
            self._lane.remove_pair(incarnation)
            pair[1]()

    def hold(
        self,
        handoff: str,
        blocks: Int64Array,
        sums: npt.NDArray[np.uint64] | None,
        held: npt.NDArray[np.bool_] | None,
        stream: int = 0,
        *,
        hashed: bool = False,
    ) -> bool:
        """Let an ask take hand-off `handoff`'s `blocks` (with the content sums held for them,
        one row per (layer, part)); False if the lane has it already or is full. GPU caches:
        its copy waits for the work queued on `stream` (the driver's handle) so far. `hashed`:
        the lane takes the sums itself first (`hash_rows`; asks for it wait meanwhile)."""
        flags = None if held is None else np.ascontiguousarray(held, dtype=np.uint8)
        ids = np.ascontiguousarray(blocks, dtype=np.int64)
        return bool(self._lane.hold(hold_key(handoff), ids, sums, flags, stream, hashed))

    def hash_rows(self, rows: Int64Array, total: int, seed: int) -> None:
        """Have the lane take the content sums of holds given none (`hold(..., hashed=True)`)
        itself, on a thread of its own: `rows` (4 x R: held row, start, block stride, bytes) of
        the source region, `total` held rows (`layers * parts`), the region's content seed."""
        self._lane.hash_rows(np.ascontiguousarray(rows, dtype=np.int64), total, seed)
        self.hashes = True

    def unhold(self, handoff: str) -> bool:
        """Take hand-off `handoff` back from the lane; False when an ask took it (its push ends
        through `done`) or it was never held there."""
        return bool(self._lane.unhold(hold_key(handoff)))

    def settle(self, handoff: str) -> bool:
        """Answer the asks waiting for hand-off `handoff`'s hold now: served if the lane holds
        it, else sent the usual way (False: none waited)."""
        return bool(self._lane.settle(hold_key(handoff)))

    @property
    def holds(self) -> int:
        return int(self._lane.holds)

    @property
    def hashing(self) -> int:
        """Holds waiting for the lane to take their sums."""
        return int(self._lane.hashing)

    @property
    def parked(self) -> int:
        """Asks waiting for their holds."""
        return int(self._lane.parked)

    def done(self) -> list[LanePush]:
        """The pushes the lane ended since the last call."""
        return [
            LanePush(key, Answer(status), nbytes, seconds, self._pairs.get(pair, ("",))[0], first, count)
            for key, status, nbytes, seconds, pair, first, count in self._lane.done()
        ]

    def fileno(self) -> int:
        return int(self._lane.fileno())

    def close(self) -> None:
        """Stop serving; returns once no copy of the lane runs, then lets go of every pair."""
        for hook in self.on_close:
            hook()
        self.on_close.clear()
        self._lane.close()
        for incarnation in list(self._pairs):
            self.remove_pair(incarnation)
        self._socket.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


@dataclass
class LaneAsk:
    """One load asked through a lane, until its answer (or deadline) and its slot's close."""

    request_id: str
    #: The engine integration's own record of the load (reported back as it ends).
    spec: object
    prefill: tuple[str, int]
    slot: int
    token: int
    blocks: Int64Array
    deadline: float
    asked: float
    answer: Answer | None = None
    #: The load's outcome, once known (None: waiting).
    failed: bool | None = None
    why: str = ""
    #: The engine ended the request meanwhile.
    cancelled: bool = False
    #: From the ask to its answer.
    seconds: float = 0.0


@dataclass
class _Connection:
    sock: socket.socket
    asks: dict[int, LaneAsk] = field(default_factory=dict)


class DecodeLane:
    """A decode engine's asks through prefill engines' lanes, made and read on one thread (the
    engine's own): `ask` a load, `poll` for the ended ones. Its slots are the agent's claim
    board's (`kvray.notice.claims.ClaimBoard`, which takes slots from two threads)."""

    def __init__(
        self,
        engine_id: str,
        incarnation: int,
        board: ClaimBoard,
        placement: Callable[[Int64Array], int],
        key_of: Callable[[str, int], bytes],
        shm_dir: str,
        *,
        checked: bool,
        timeout_s: float,
    ) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self._board = board
        self._placement = placement
        self._key_of = key_of
        self._shm_dir = shm_dir
        self._checked = checked
        self._timeout_s = timeout_s
        self._connections: dict[tuple[str, int], _Connection] = {}
        #: Prefill engines not to ask through a lane until then (`time.monotonic`).
        self._not_before: dict[tuple[str, int], float] = {}
        #: Asks each prefill engine answered UNKNOWN_PAIR in a row.
        self._misses: dict[tuple[str, int], int] = {}
        self._keys: dict[tuple[str, int], bytes] = {}
        self._closing: list[LaneAsk] = []
        self._next_id = 0
        #: Loads that came whole through a lane, and how lanes answered asks.
        self.moved = 0
        self.answers: collections.Counter[Answer] = collections.Counter()

    def usable(self, prefill: tuple[str, int]) -> bool:
        until = self._not_before.get(prefill)
        return until is None or until <= time.monotonic()

    def ask(
        self,
        request_id: str,
        spec: object,
        prefill: tuple[str, int],
        inbox: str,
        handoff: str,
        blocks: Int64Array,
        first_block: int,
    ) -> LaneAsk | None:
        """Ask prefill engine `prefill` (engine id, incarnation) to push hand-off `handoff`
        into `blocks` through its lane; None (nothing asked, no slot kept) where it cannot be
        asked so: the caller asks the usual way."""
        if not 0 < blocks.size <= MAX_ASK_BLOCKS or not 0 <= first_block < 2**31 or not self.usable(prefill):
            return None
        connection = self._connection(prefill, inbox)
        if connection is None:
            return None
        token = secrets.randbits(62) or 1  # as `expect` makes one
        try:
            slot = self._board.open(token)
        except KvrayError:
            return None
        self._next_id += 1
        ask_id = self._next_id
        now = time.monotonic()
        try:
            assert _native is not None  # an engine without it has no lane (`available`)
            _native.lane_ask(
                connection.sock.fileno(),
                self._key(prefill),
                prefill[1],
                self.incarnation,
                hold_key(handoff),
                token,
                slot,
                first_block,
                ask_id,
                blocks,
                self._checked,
            )
        except OSError as error:
            log.debug("kvray: lane ask to %s failed (%s); asking the usual way", prefill[0], error)
            self._drop(prefill)
            self._board.try_close(slot)
            return None
        asked = LaneAsk(request_id, spec, prefill, slot, token, blocks, now + self._timeout_s, now)
        connection.asks[ask_id] = asked
        return asked

    def cancel(self, asked: LaneAsk) -> None:
        """The engine ended the request: its wait ends, its blocks come back once closed."""
        asked.cancelled = True

    def poll(self) -> list[LaneAsk]:
        """The asks that ended since the last call, each with its slot closed (no write of it
        can land): `failed` None with an answer in `USUAL_WAY` (ask the usual way), else the
        load's outcome."""
        ended: list[LaneAsk] = []
        now = time.monotonic()
        for prefill, connection in list(self._connections.items()):
            assert _native is not None
            answers, gone = _native.lane_answers(connection.sock.fileno())
            for ask_id, status, token, placement, content, reference, flags, _nbytes, arrived in answers:
                asked = connection.asks.pop(ask_id, None)
                if asked is None or asked.token != token:
                    continue
                try:
                    answer = Answer(status)
                except ValueError:  # not an answer this engine knows: nothing is taken from it
                    answer = Answer.FAILED
                self._answered(asked, answer, placement, content, reference, flags, arrived)
                self._closing.append(asked)
            for ask_id, asked in list(connection.asks.items()):
                if gone:
                    asked.failed, asked.why = (
                        True,
                        f"prefill engine {prefill[0]!r} closed its lane or is gone",
                    )
                elif asked.cancelled:
                    asked.failed = False
                elif asked.deadline <= now:
                    asked.failed, asked.why = True, f"no answer within {self._timeout_s} s"
                else:
                    continue
                del connection.asks[ask_id]
                self._closing.append(asked)
            if gone:
                self._drop(prefill)
        still: list[LaneAsk] = []
        for asked in self._closing:
            if self._board.try_close(asked.slot):
                ended.append(asked)
            else:  # a writer holds it: closing now, closed once it lets go
                self._board.mark_closing(asked.slot)
                still.append(asked)
        self._closing = still
        return ended

    @property
    def waiting(self) -> int:
        return sum(len(connection.asks) for connection in self._connections.values()) + len(self._closing)

    def _answered(
        self,
        asked: LaneAsk,
        answer: Answer,
        placement: int,
        content: int,
        reference: int,
        flags: int,
        arrived: float,
    ) -> None:
        asked.answer = answer
        self.answers[answer] += 1
        asked.seconds = max(arrived - asked.asked, 0.0)
        if asked.cancelled:
            asked.failed = False
        elif answer in USUAL_WAY:
            if answer is Answer.UNKNOWN_PAIR:
                self._back_off(asked.prefill)
        elif answer is Answer.DONE:
            self._misses.pop(asked.prefill, None)
        if asked.failed is not None or answer in USUAL_WAY:
            return
        if answer is not Answer.DONE:
            asked.failed, asked.why = True, f"the prefill engine's lane answered {answer.name}"
        elif placement != self._placement(asked.blocks):
            asked.failed, asked.why = (
                True,
                "its placement digest differs from where this engine keeps its blocks",
            )
        elif (flags & 1 and content != reference) or (self._checked and not flags & 1):
            asked.failed, asked.why = True, "its content digest differs from the writer's (or came unchecked)"
        else:
            asked.failed = False
            self.moved += 1

    def _key(self, prefill: tuple[str, int]) -> bytes:
        key = self._keys.get(prefill)
        if key is None:
            key = self._keys[prefill] = self._key_of(*prefill)
        return key

    def _connection(self, prefill: tuple[str, int], inbox: str) -> _Connection | None:
        connection = self._connections.get(prefill)
        if connection is not None:
            return connection
        path = lane_path(inbox)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            os.close(open_peer(path, PeerPath.LANE, self._shm_dir, named_by=f"engine {prefill[0]!r}"))
            sock.connect(path)
            sock.setblocking(False)
            assert _native is not None
            _native.lane_stamp(sock.fileno())
        except (OSError, KvrayError) as error:
            sock.close()
            log.debug("kvray: no lane to %s (%s)", prefill[0], error)
            self._back_off(prefill)
            return None
        connection = self._connections[prefill] = _Connection(sock)
        return connection

    def _drop(self, prefill: tuple[str, int]) -> None:
        connection = self._connections.get(prefill)
        if connection is not None and not connection.asks:
            del self._connections[prefill]
            connection.sock.close()
        self._back_off(prefill)

    def _back_off(self, prefill: tuple[str, int]) -> None:
        """Ask `prefill` the usual way for a while: its lane is not open yet, or has not paired
        with this engine (the first push the usual way pairs them). Soon at first, then less
        and less often where it never does (e.g. the two caches differ)."""
        misses = self._misses[prefill] = self._misses.get(prefill, 0) + 1
        self._not_before[prefill] = time.monotonic() + min(1e-3 * 2**misses, 5.0)

    def close(self) -> None:
        """Stop asking; asks still waiting are left to the agent's close (it fails every wait)."""
        for connection in self._connections.values():
            connection.sock.close()
        self._connections.clear()
