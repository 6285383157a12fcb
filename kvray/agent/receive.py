"""Receive (seventh step, the decode side): the requests a decode engine expects, the writes and
notices it takes for them, and `wait_for_kv`.

A request is expected from `expect` (its blocks are reserved; the writer gets a `Reservation`
with a secret token) until `release`, which returns only once no write of it can land any more:
a same-node writer's claim (`kvray.notice.claims`) has ended, a claiming writer on another node has
sent its notice or left, and no write delivered as a message is still being scattered. Writes
and notices for a request the engine does not expect under that token are refused, counted and
dropped. A writer still holding a request past `transfer_timeout_s` leaves it quarantined: its
blocks must stay out of the pool until the writer is done.

Every completion is checked for placement before the request completes (`kvray.integrity`'s
`PlacementTable`): the digest of the ranges the executors stored to (the writer's, in the notice,
plus this engine's own scatters, `landed`) must equal the digest of where this engine's layout
puts the named layers in the request's blocks; else the request fails with `KVIntegrityError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvray.agent.directory import Directory
from kvray.agent.engine import Blocks, Engine, landed_in, node_address
from kvray.agent.transports import TransportSet
from kvray.errors import (
    AgentNotRunningError,
    KVIntegrityError,
    KvrayError,
    MetadataError,
    NotExpectedError,
    PlanError,
    RequestCancelledError,
    StaleIncarnationError,
    TransferTimeoutError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.integrity import (
    THREAD_MIN_BYTES,
    Checksums,
    PlacementTable,
    check,
    landed_pieces,
    regions_of,
    writer_heads,
)
from kvray.layout import Int64Array
from kvray.memory import Backing
from kvray.metrics import DropReason, IntegrityCheck, Outcome
from kvray.notice import NoticeSet
from kvray.notice.claims import ENDPOINT as CLAIMS_ENDPOINT
from kvray.notice.claims import ClaimBoard
from kvray.placement import MASK64, NOTHING, Stored
from kvray.plan import OffsetCache, block_ids, check_ops_within, request_spans
from kvray.transport.base import OpsCheck
from kvray.wire import (
    EngineInfo,
    Notice,
    Reservation,
    Role,
    TransferDone,
    TransferFailed,
    decode_notice,
    decode_notice_or_none,
    decode_write_claim,
)


@dataclass(frozen=True)
class Completion:
    """What the decode side learns when a request's KV has arrived."""

    request_id: str
    transfer_id: str
    src_engine: str
    nbytes: int


#: Completions `Receiving` keeps for the metrics before it counts them anyway.
_MAX_UNRECORDED = 1024


#: Which layers (indices) a transfer covers, and which heads (None: all of them).
_PlacementKey = tuple[tuple[int, ...], tuple[int, int] | None]


@dataclass
class _Expectation:
    """A request a decode agent expects: what its writer must show, and where it may write."""

    future: asyncio.Future[Completion]
    token: int
    #: Its slot in the claim board (-1: the agent has no board, e.g. it never started an inbox).
    slot: int
    blocks: npt.NDArray[np.int64]
    #: (region, start, end) byte spans of the request's blocks, built at its first checked write.
    spans: tuple[Int64Array, Int64Array, Int64Array] | None = None
    #: A writer on another node that claimed the request (`Transport.claims_across_nodes`), and
    #: an event set once its notice (done or failed) has arrived: until then its one-sided
    #: writes may still land.
    writer: tuple[str, int] | None = None
    writer_done: asyncio.Event = field(default_factory=asyncio.Event)
    #: What this engine's own executor reported of the request's writes (`Receiver.landed`: the
    #: ray transport's scatter), added to what the writer's reported.
    landed: Stored = NOTHING
    #: The indices of the layers the request's KV must cover, ascending (None: every layer).
    layers: tuple[int, ...] | None = None
    #: The placement digest a transfer of some (layers, heads) into the blocks must report, taken
    #: while the request waits (`Receiving.wait_for_kv`) rather than once its notice is in.
    placement: tuple[_PlacementKey, int] | None = None


class Receiving:
    """A decode engine's expected requests, and the writes and notices it takes for them. It
    is the `Receiver` its transports hand incoming writes to, and the `NoticeReceiver` its
    notice channels hand notices to; it builds its claim board and starts its channels'
    receiving ends itself (`start`)."""

    def __init__(
        self,
        engine: Engine,
        directory: Directory,
        transports: TransportSet,
        notices: NoticeSet,
        cache: OffsetCache,
    ) -> None:
        self.engine = engine
        self.directory = directory
        self.transports = transports
        self.notices = notices
        self.cache = cache
        self._pending: dict[str, _Expectation] = {}
        #: Requests being released (their writers may still send their notice).
        self._releasing: dict[str, _Expectation] = {}
        #: Requests that could not be released yet (a writer still held their claim), each with
        #: an event set once it is released after all.
        self.quarantined: dict[str, asyncio.Event] = {}
        #: Writes being applied by this engine itself, per request (a failed wait outlasts them).
        self._writing: Counter[str] = Counter()
        self._writes_done = asyncio.Condition()
        #: Where same-node writers claim the requests they write (once started).
        self.board: ClaimBoard | None = None
        #: Completions taken on the usual path, not yet in the metrics (`record_completions`):
        #: counted after the waiter resumes, not between the notice and it.
        self._unrecorded: list[TransferDone] = []
        #: Where transfers of some layers (with some heads) land: per (layers, heads).
        self._placements: dict[_PlacementKey, PlacementTable] = {}
        #: Every layer of this engine's layout, in order: what the usual notice names.
        self._every_layer = tuple(range(len(engine.backing.layout.layers)))

    async def start(self) -> dict[str, str]:
        """Start taking writers' claims and notices (a decode engine, once, at its start): the
        endpoints the engine publishes for them."""
        settings = self.engine.settings
        endpoints = await self.notices.listen(self)
        self.board = ClaimBoard(settings.shm_dir, settings.max_expected_requests)
        endpoints[CLAIMS_ENDPOINT] = self.board.path
        return endpoints

    # ---- the NoticeReceiver protocol ----------------------------------------------------

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    @property
    def incarnation(self) -> int:
        return self.engine.incarnation

    @property
    def node_address(self) -> str | None:
        return node_address()

    # ---- the Receiver protocol ----------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def backing(self) -> Backing:
        return self.engine.backing

    @contextlib.asynccontextmanager
    async def admit(self, request_id: str, token: int) -> AsyncIterator[OpsCheck]:
        expectation = self._pending.get(request_id)
        if expectation is None or expectation.future.done():
            # Its wait ended (done, failed, timed out) or it was never reserved: its blocks may
            # belong to another request by now.
            raise self._counted(
                DropReason.UNEXPECTED_WRITE,
                NotExpectedError(
                    f"engine {self.engine.engine_id!r} does not expect KV for request {request_id!r} "
                    "(never reserved, or its wait has ended); nothing was written",
                    request_id=request_id,
                    engine_id=self.engine.engine_id,
                ),
            )
        if token != expectation.token:
            raise self._counted(
                DropReason.FORGED,
                NotExpectedError(
                    f"a write for request {request_id!r} did not carry its reservation's token; "
                    "nothing was written",
                    request_id=request_id,
                    engine_id=self.engine.engine_id,
                ),
            )
        self._writing[request_id] += 1
        try:
            yield self._within(request_id, expectation)
        finally:
            self._writing[request_id] -= 1
            if not self._writing[request_id]:
                del self._writing[request_id]
                async with self._writes_done:
                    self._writes_done.notify_all()

    def landed(self, request_id: str, stored: Stored) -> None:
        expectation = self._pending.get(request_id)
        if expectation is not None:
            expectation.landed = expectation.landed.plus(stored)

    async def writer(self, engine_id: str, incarnation: int) -> EngineInfo:
        peer = await self.directory.current(engine_id, incarnation, wait_s=0)
        return peer.info

    def _within(self, request_id: str, expectation: _Expectation) -> OpsCheck:
        """A check that a write's ops stay inside the request's blocks (spans built once)."""

        def check(regions: Int64Array, offsets: Int64Array, nbytes: Int64Array) -> None:
            if expectation.spans is None:
                rows = self.cache.rows(self.info, self.engine.backing.layout.layer_names)
                expectation.spans = request_spans(rows, expectation.blocks)
            check_ops_within(
                expectation.spans,
                regions,
                offsets,
                nbytes,
                request_id=request_id,
                engine_id=self.engine.engine_id,
            )

        return check

    # ---- requests -----------------------------------------------------------------------

    def expect(self, request_id: str, blocks: Blocks, layers: Sequence[str] | None = None) -> Reservation:
        engine = self.engine
        if engine.role is not Role.DECODE:
            raise PlanError(f"engine {engine.engine_id!r} is not a decode engine and expects no KV")
        engine.check_running()
        if request_id in self._pending:
            raise PlanError(f"request {request_id!r} is already expected", request_id=request_id)
        ids = block_ids(blocks, engine.backing.layout.num_blocks, "decode", engine.engine_id)
        expected = None if layers is None else self._layer_indices(request_id, layers)
        token = secrets.randbits(62) or 1
        for transport in self.transports.receiving:
            transport.expect(self, request_id)
        slot = self.board.open(token) if self.board is not None else -1
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Expectation(future, token, slot, ids, layers=expected)
        return Reservation(
            request_id=request_id,
            engine_id=engine.engine_id,
            incarnation=engine.incarnation,
            blocks=tuple(ids.tolist()),
            token=token,
            slot=max(slot, 0),
            integrity=engine.settings.integrity,
        )

    def _layer_indices(self, request_id: str, layers: Sequence[str]) -> tuple[int, ...]:
        """The indices of `layers` in this engine's layout, ascending; a name it lacks, a name
        given twice or none at all is refused."""
        names = self.engine.backing.layout.layer_names
        index = {name: at for at, name in enumerate(names)}
        unknown = [name for name in layers if name not in index]
        if unknown or not layers or len(set(layers)) != len(layers):
            raise PlanError(
                f"request {request_id!r} must expect one or more distinct layers of engine "
                f"{self.engine.engine_id!r} (unknown: {unknown[:8]}); pass none to expect every layer",
                request_id=request_id,
                engine_id=self.engine.engine_id,
            )
        return tuple(sorted(index[name] for name in layers))

    async def release(self, request_id: str) -> None:
        expectation = self._pending.pop(request_id, None)
        if expectation is None:
            return
        if not expectation.future.done():
            expectation.future.cancel()
        # A claiming writer's notice may still come: it ends the claim (see `receive`).
        self._releasing[request_id] = expectation
        try:
            await self._end_writes(request_id, expectation)
        finally:
            if self._releasing.get(request_id) is expectation:
                del self._releasing[request_id]

    def cancel(self, request_id: str) -> None:
        expectation = self._pending.get(request_id)
        if expectation is not None and not expectation.future.done():
            expectation.future.cancel()

    async def _end_writes(self, request_id: str, expectation: _Expectation) -> None:
        if self._writing[request_id]:
            async with self._writes_done:
                await self._writes_done.wait_for(lambda: not self._writing[request_id])
        if await self._writes_ended(request_id, expectation):
            return
        self.quarantined[request_id] = asyncio.Event()
        self.engine.metrics.release_quarantined()
        self.engine.spawn(self._release_later(request_id, expectation))
        raise TransferTimeoutError(
            f"a writer still holds request {request_id!r} at {self.engine.engine_id!r} after "
            f"{self.engine.settings.transfer_timeout_s} s; its blocks must stay out of the pool",
            request_id=request_id,
            engine_id=self.engine.engine_id,
            timeout_s=self.engine.settings.transfer_timeout_s,
        )

    async def _writes_ended(self, request_id: str, expectation: _Expectation) -> bool:
        """True once no write for the request can land: a writer on another node that claimed
        it is done, and its slot in the claim board is closed (each awaited up to
        `transfer_timeout_s`)."""
        if not await self._remote_writer_done(expectation):
            return False
        board = self.board
        if (
            expectation.slot >= 0
            and board is not None
            and not await board.close(expectation.slot, self.engine.settings.transfer_timeout_s)
        ):
            return False
        for transport in self.transports.receiving:
            transport.release(self, request_id)
        return True

    async def _remote_writer_done(self, expectation: _Expectation) -> bool:
        """True once a writer on another node that claimed the request has sent its notice, or
        has left the directory (its process died: no write of it can still be issued)."""
        if expectation.writer is None or expectation.writer_done.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.engine.settings.transfer_timeout_s):
                await expectation.writer_done.wait()
                return True
        if self.directory.service is None:
            return False
        try:
            await self.directory.check(*expectation.writer)
        except KvrayError:
            return True  # gone or restarted: that life issues no more writes
        except Exception:
            return False
        return False

    async def _release_later(self, request_id: str, expectation: _Expectation) -> None:
        self._releasing[request_id] = expectation
        while not self.engine.closed.is_set():
            if await self._writes_ended(request_id, expectation):
                self._releasing.pop(request_id, None)
                self.quarantined.pop(request_id).set()
                return

    async def wait_for_kv(self, request_id: str, timeout: float | None = None) -> Completion:
        engine = self.engine
        expectation = self._pending.get(request_id)
        if expectation is None:
            raise PlanError(
                f"request {request_id!r} is not expected at {engine.engine_id!r}; expect() it first",
                request_id=request_id,
                engine_id=engine.engine_id,
            )
        future = expectation.future
        deadline = engine.settings.deadline(timeout, engine.settings.transfer_timeout_s, "timeout")
        if expectation.placement is None and not future.done():
            # The usual transfer's placement digest (every layer, every head), while the writer
            # writes: the notice then needs one comparison.
            key = (self._every_layer, None) if expectation.layers is None else (expectation.layers, None)
            expectation.placement = (key, self._placement_table(key).digest(expectation.blocks))
        started = time.perf_counter()
        outcome = Outcome.FAILED
        loop = asyncio.get_running_loop()
        # The deadline cancels the future itself (a timed-out wait ends the request: later
        # writes for it are refused), which wakes this task as a completion would. The task
        # awaits the future directly: `asyncio.timeout` or a shield would add a hop through the
        # event loop, or a timer's bookkeeping, between the completion and the caller.
        expired = False

        def expire() -> None:
            nonlocal expired
            if not future.done():
                expired = True
                future.cancel()

        timer = loop.call_later(deadline, expire)
        try:
            completion = await future
            outcome = Outcome.OK
            return completion
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                outcome = Outcome.CANCELLED
                raise  # the caller was cancelled (or its own timeout passed)
            if expired:
                outcome = Outcome.TIMED_OUT
                raise TransferTimeoutError(
                    f"KV for request {request_id!r} did not arrive at {engine.engine_id!r} "
                    f"within {deadline} s",
                    request_id=request_id,
                    engine_id=engine.engine_id,
                    timeout_s=deadline,
                ) from None
            outcome = Outcome.CANCELLED
            # `cancel` or `release` (the request is over), not a cancelled caller.
            raise RequestCancelledError(
                f"request {request_id!r} was cancelled at {engine.engine_id!r} while waiting for its KV",
                request_id=request_id,
                engine_id=engine.engine_id,
            ) from None
        finally:
            timer.cancel()
            if outcome is Outcome.OK:  # after the caller resumes: off the path to its next step
                loop.call_soon(self._record_wait, outcome, time.perf_counter() - started)
            else:  # the error leaving the wait: the future's, or one raised above
                engine.metrics.wait(outcome, time.perf_counter() - started, sys.exc_info()[1])
            if not future.done():
                future.cancel()

    def _record_wait(self, outcome: Outcome, seconds: float) -> None:
        self.engine.metrics.wait(outcome, seconds)
        self.record_completions()

    def record_completions(self) -> None:
        """Count the completions taken on the usual path since the last call."""
        unrecorded, self._unrecorded = self._unrecorded, []
        metrics = self.engine.metrics
        for message in unrecorded:
            metrics.received(message.src_engine, message.nbytes)
            if message.checksum:
                continue  # counted as its checksums were checked
            if message.reference is not None:
                # Taken: its content digest matched the writer's (`_unchecked_content`).
                metrics.integrity(message.src_engine, IntegrityCheck.OK)
            elif message.landed is None:
                metrics.integrity(message.src_engine, IntegrityCheck.UNCHECKED)

    def close(self) -> None:
        """Fail every wait (the agent closed) and release the claim board (the agent closes the
        notice channels, which its pushes share)."""
        for request_id, expectation in list(self._pending.items()):
            if not expectation.future.done():
                expectation.future.set_exception(
                    AgentNotRunningError(
                        f"agent {self.engine.engine_id!r} closed while {request_id!r} waited for KV",
                        request_id=request_id,
                        engine_id=self.engine.engine_id,
                    )
                )
                # Retrieved here, or asyncio logs it for a request nobody waits for; a
                # wait_for_kv under way still raises it.
                expectation.future.exception()
        self._pending.clear()
        if self.board is not None:
            self.board.dispose()
            self.board = None

    # ---- what writers send ------------------------------------------------------------

    def claim(self, message_bytes: bytes) -> None:
        """A writer on another node claims a request before its first one-sided write of it
        (`Transport.claims_across_nodes`): refused unless the request is expected under the
        claim's token; the request's blocks are then kept (see `release`) until the writer's
        notice arrives."""
        try:
            claim = decode_write_claim(message_bytes)
        except WireDecodeError:
            self.engine.metrics.dropped(DropReason.MALFORMED)
            raise
        if claim.dst_engine != self.engine.engine_id or claim.dst_incarnation != self.engine.incarnation:
            raise self._misaddressed("claim", claim.dst_engine, claim.dst_incarnation)
        expectation = self._pending.get(claim.request_id)
        if expectation is None or expectation.future.done() or expectation.token != claim.token:
            self.engine.metrics.claim_refused()
            raise NotExpectedError(
                f"engine {self.engine.engine_id!r} does not expect request {claim.request_id!r} under "
                "this reservation; nothing may be written",
                request_id=claim.request_id,
                engine_id=self.engine.engine_id,
            )
        writer = (claim.src_engine, claim.src_incarnation)
        if expectation.writer is not None and expectation.writer != writer:
            raise NotExpectedError(
                f"request {claim.request_id!r} is already claimed by {expectation.writer[0]!r}",
                request_id=claim.request_id,
                engine_id=self.engine.engine_id,
            )
        expectation.writer = writer

    def receive(self, message_bytes: bytes, strict: bool = False) -> DropReason | None:
        """A completion or failure notice; unknown, stale, forged or malformed ones are dropped
        and counted, and why is returned (`strict`: they raise instead, for a caller that can be
        told)."""
        engine = self.engine
        message = decode_notice_or_none(message_bytes)
        # The usual notice in as few steps as it takes (every step a cold cache pays for): done,
        # for this engine's life, for a request it waits for, under that request's token.
        if (
            type(message) is TransferDone
            and not message.arrival_proofs
            and not message.checksum
            and message.landed is None
            and message.dst_engine == engine.engine_id
            and message.dst_incarnation == engine.incarnation
        ):
            expectation = self._pending.get(message.request_id)
            if (
                expectation is not None
                and expectation.token == message.token
                and not expectation.future.done()
            ):
                self._complete_if_placed(message, expectation)
                return None
        return self._checked(message_bytes, message, strict)

    def _checked(self, message_bytes: bytes, message: Notice | None, strict: bool) -> DropReason | None:
        """`receive`, every case: each check in turn, and why a notice is dropped."""
        engine = self.engine
        if message is None:
            try:
                message = decode_notice(message_bytes)
            except WireDecodeError as error:
                return self._drop(DropReason.MALFORMED, strict, error)
        if message.dst_engine != engine.engine_id or message.dst_incarnation != engine.incarnation:
            return self._drop(
                DropReason.STALE,
                strict,
                self._misaddressed("notice", message.dst_engine, message.dst_incarnation),
            )
        expectation = self._pending.get(message.request_id)
        if expectation is None or expectation.future.done():
            ending = expectation or self._releasing.get(message.request_id)
            if ending is not None and ending.writer is not None and ending.token == message.token:
                # The claiming writer's last word (done or failed): its writes have ended.
                ending.writer_done.set()
            return self._drop(
                DropReason.UNKNOWN,
                strict,
                NotExpectedError(
                    f"engine {engine.engine_id!r} does not expect request {message.request_id!r} "
                    "(never reserved, or its wait has ended)",
                    request_id=message.request_id,
                    engine_id=engine.engine_id,
                ),
            )
        if message.token != expectation.token:
            return self._drop(
                DropReason.FORGED,
                strict,
                NotExpectedError(
                    f"a notice for request {message.request_id!r} did not carry its reservation's token",
                    request_id=message.request_id,
                    engine_id=engine.engine_id,
                ),
            )
        future = expectation.future
        if isinstance(message, TransferFailed):
            if expectation.writer is not None:
                expectation.writer_done.set()  # sent once its last write had stopped moving
            engine.metrics.completion_failed()
            future.set_exception(
                WriteFailedError(
                    f"engine {message.src_engine!r} could not deliver {message.request_id!r}: "
                    f"{message.reason}",
                    request_id=message.request_id,
                    engine_id=message.src_engine,
                )
            )
            future.exception()  # retrieved here; wait_for_kv re-raises it
        elif message.arrival_proofs or message.checksum or message.landed is not None:
            # The writer's transport gives the decode side its own proofs of arrival, which the
            # notice can overtake, and the bytes that landed must hash as the writer's did:
            # complete once both hold (wait_for_kv's deadline bounds the wait).
            engine.spawn(self._complete_when_landed(message, expectation))
        else:
            self._complete_if_placed(message, expectation)
        return None

    def _complete_if_placed(self, message: TransferDone, expectation: _Expectation) -> None:
        """Complete the request if its writes stored where they must (`_misplaced`), else fail it."""
        error = self._misplaced(message, expectation)
        if error is None:
            self._complete(message, expectation.future)
        else:
            expectation.future.set_exception(error)
            expectation.future.exception()  # retrieved here; wait_for_kv re-raises it

    def _misplaced(self, message: TransferDone, expectation: _Expectation) -> KvrayError | None:
        """Why the writes of `message`'s transfer cannot be taken (None: they can): the placement
        digest of where the executors stored (the notice's plus this engine's own scatters)
        differs from where this engine's layout puts the named layers in the request's blocks."""
        engine = self.engine
        layout = engine.backing.layout
        layers = message.layers
        # The usual notice names every layer in order: one comparison says so.
        if expectation.layers is not None or layers != self._every_layer:
            if len(set(layers)) != len(layers) or any(
                not 0 <= index < len(layout.layers) for index in layers
            ):
                return MetadataError(
                    f"the notice for {message.request_id!r} from {message.src_engine!r} names a layer "
                    f"twice or one engine {engine.engine_id!r} lacks",
                    request_id=message.request_id,
                    engine_id=engine.engine_id,
                )
            expected = range(len(layout.layers)) if expectation.layers is None else expectation.layers
            if sorted(layers) != list(expected):
                if not message.checksum:  # else the checksums' check counts it
                    engine.metrics.integrity(message.src_engine, IntegrityCheck.MISMATCH, len(layers), 0.0)
                covered = set(layers)
                missing = layout.names_at(index for index in expected if index not in covered)
                why = f"covers {len(layers)} layer(s), not the {len(expected)} it expects; missing"
                return _refusal(engine.engine_id, message, why, missing)
        try:
            heads = writer_heads(layout, message.src_tp)
        except KvrayError as error:
            return error
        key = (layers, heads)
        ahead = expectation.placement
        if ahead is not None and ahead[0] == key:
            wanted = ahead[1]
        else:
            wanted = self._placement_table(key).digest(expectation.blocks)
        stored = (message.placement + expectation.landed.placement) & MASK64
        if stored == wanted:
            return self._unchecked_content(message, expectation)
        names = layout.names_at(layers)
        if not message.checksum:  # else the checksums' check counts it (`_check_integrity`)
            engine.metrics.integrity(message.src_engine, IntegrityCheck.MISMATCH, len(layers), 0.0)
        why = (
            "was not stored where this engine keeps it (a layer written over another, a block written "
            "twice or not at all, or an executor that stored elsewhere than planned): the placement "
            "digest of its writes differs from that of the request's blocks in"
        )
        return _refusal(engine.engine_id, message, why, names)

    def _placement_table(self, key: _PlacementKey) -> PlacementTable:
        """Where a transfer of `key`'s layers (and heads) lands in a block, built once per key."""
        table = self._placements.get(key)
        if table is None:
            if len(self._placements) >= 256:
                self._placements.clear()
            engine = self.engine
            layers, heads = key
            table = PlacementTable(engine.backing.layout, engine.backing.placements, layers, heads)
            self._placements[key] = table
        return table

    def _complete(self, message: TransferDone, future: asyncio.Future[Completion]) -> None:
        future.set_result(
            Completion(message.request_id, message.transfer_id, message.src_engine, message.nbytes)
        )
        self._unrecorded.append(message)
        if len(self._unrecorded) > _MAX_UNRECORDED:  # nobody waits: count them now
            self.record_completions()

    def _unchecked_content(self, message: TransferDone, expectation: _Expectation) -> KvrayError | None:
        """Why the transfer's bytes cannot be taken (None: they can, or the slower checksums
        in the notice decide): its copy's content digest (`kvray.content`: the writer's
        executor's plus this engine's own) differs from the one the writer took from its blocks,
        or, where this engine checks every request even where copies do not hash
        (`integrity_unhashed`), the transfer came with neither."""
        engine = self.engine
        if message.reference is None:
            if engine.settings.integrity_unhashed and not message.checksum and message.landed is None:
                return MetadataError(
                    f"the KV of request {message.request_id!r} from {message.src_engine!r} came "
                    f"unchecked, and engine {engine.engine_id!r} checks every request's KV "
                    "(integrity_unhashed); the request is not decoded from it",
                    request_id=message.request_id,
                    engine_id=engine.engine_id,
                )
            return None
        landed = expectation.landed.content
        content = None if message.content is None or landed is None else (message.content + landed) & MASK64
        if content == message.reference:
            # Counted with the completion, after the waiting task has resumed (`record_completions`).
            return None
        # Refused even where checksums came too: those are taken from the writer's blocks as
        # the push reads them, so they match bytes written after the reference was held (the
        # checksums' check then counts it, and names the layers where the landed bytes differ).
        names = engine.backing.layout.names_at(message.layers)
        if not message.checksum:
            engine.metrics.integrity(message.src_engine, IntegrityCheck.MISMATCH, len(names), 0.0)
        why = (
            "its copy did not hash it" if content is None else "its content digest differs from the writer's"
        )
        return _refusal(engine.engine_id, message, f"did not arrive as the writer holds it: {why} in", names)

    async def _complete_when_landed(self, message: TransferDone, expectation: _Expectation) -> None:
        future = expectation.future
        try:
            if message.arrival_proofs:
                await self._arrived(message)
                # Every write posted before the last immediate has landed: the writer is done here.
                expectation.writer_done.set()
            misplaced = None if future.done() else self._misplaced(message, expectation)
            if message.checksum and not future.done():
                # The checksums name the layers that differ, where the digests cannot; bytes that
                # landed as the writer read them are still refused for what the digests say.
                await self._check_integrity(message, expectation, misplaced)
            if misplaced is not None:
                raise misplaced
            if message.landed is not None and not message.checksum and not future.done():
                await self._check_landed(message, expectation)
        except asyncio.CancelledError:
            return  # the wait ended (deadline, cancel, close): its own path reports it
        except KvrayError as error:
            if not future.done():
                future.set_exception(error)
                future.exception()
            return
        if not future.done():
            self._complete(message, future)

    async def _check_integrity(
        self, message: TransferDone, expectation: _Expectation, refused: KvrayError | None = None
    ) -> None:
        """`KVIntegrityError` unless every layer the notice names hashes, as landed in the
        request's blocks, to the writer's value (`kvray.integrity.check`), counted either way;
        `refused`: what the digests already refuse the transfer for (then raised, and counted as
        a mismatch, where the checksums find none)."""
        engine = self.engine
        backing = engine.backing
        # Called only for a notice that names an algorithm (the wire admits those kvray has).
        assert message.checksum
        expected = Checksums(message.checksum_layers, message.checksum_values, message.checksum)
        blocks = expectation.blocks

        def checked() -> None:
            check(
                expected,
                regions_of(backing),
                backing.layout,
                backing.placements,
                blocks,
                message.src_tp,
                request_id=message.request_id,
                engine_id=engine.engine_id,
                writer=message.src_engine,
            )

        started = time.perf_counter()
        try:
            if message.nbytes < THREAD_MIN_BYTES:
                checked()
            else:
                await asyncio.to_thread(checked)
        except KVIntegrityError as error:
            layers = len(error.facts.get("layers", ()))
            engine.metrics.integrity(
                message.src_engine, IntegrityCheck.MISMATCH, layers, time.perf_counter() - started
            )
            raise
        seconds = time.perf_counter() - started
        if refused is not None:
            layers = len(refused.facts.get("layers", ()))
            engine.metrics.integrity(message.src_engine, IntegrityCheck.MISMATCH, layers, seconds)
            raise refused
        engine.metrics.integrity(message.src_engine, IntegrityCheck.OK, 0, seconds)

    async def _check_landed(self, message: TransferDone, expectation: _Expectation) -> None:
        """The landed digest of the ranges the transfer filled in this engine's memory against
        the one the writer sent (`kvray.content.landed_digest`), read after the last write: on a
        worker thread when large, on the GPU by the `cuda_ipc` op kernel storing nothing. Where
        that kernel cannot run (no Triton), such a transfer counts as unchecked (and
        `integrity_unhashed` refuses it)."""
        engine = self.engine
        backing = engine.backing
        layout = backing.layout
        names = layout.names_at(message.layers)
        heads = writer_heads(layout, message.src_tp)
        pieces = [
            landed_pieces(layout, backing.placements[name], expectation.blocks, name, heads) for name in names
        ]
        region = np.concatenate([piece.region for piece in pieces])
        offset = np.concatenate([piece.offset for piece in pieces])
        nbytes = np.concatenate([piece.nbytes for piece in pieces])
        started = time.perf_counter()
        landed = await landed_in(backing, region, offset, region, offset, nbytes)
        if landed is None:
            if engine.settings.integrity_unhashed:
                raise MetadataError(
                    f"the KV of request {message.request_id!r} from {message.src_engine!r} came with a "
                    f"landed digest engine {engine.engine_id!r} does not read in device memory, and "
                    "it checks every request's KV (integrity_unhashed); the request is not decoded "
                    "from it",
                    request_id=message.request_id,
                    engine_id=engine.engine_id,
                )
            engine.metrics.integrity(message.src_engine, IntegrityCheck.UNCHECKED, 0, 0.0)
            return
        seconds = time.perf_counter() - started
        if landed == message.landed:
            engine.metrics.integrity(message.src_engine, IntegrityCheck.OK, 0, seconds)
            return
        engine.metrics.integrity(message.src_engine, IntegrityCheck.MISMATCH, len(names), seconds)
        why = "did not land as the writer holds it: its landed digest differs from the writer's in"
        raise _refusal(engine.engine_id, message, why, names)

    async def _arrived(self, message: TransferDone) -> None:
        """Wait for the proofs of arrival the notice names (`Transport.complete`)."""
        if not any(transport.arrival_proofs for transport in self.transports.receiving):
            raise MetadataError(
                f"engine {message.src_engine!r} names {message.arrival_proofs} proofs of arrival "
                f"for {message.request_id!r}, but engine {self.engine.engine_id!r} takes writes "
                "through no transport that gives them",
                request_id=message.request_id,
                engine_id=self.engine.engine_id,
            )
        for transport in self.transports.receiving:
            await transport.complete(self, message)

    def _misaddressed(self, what: str, engine_id: str, incarnation: int) -> StaleIncarnationError:
        return StaleIncarnationError(
            f"{what} for {engine_id!r} incarnation {incarnation} reached {self.engine.engine_id!r} "
            f"incarnation {self.engine.incarnation}",
            engine_id=self.engine.engine_id,
            incarnation=self.engine.incarnation,
            stale_incarnation=incarnation,
        )

    def _counted(self, reason: DropReason, error: KvrayError) -> KvrayError:
        """`error`, after counting what it refuses."""
        self.engine.metrics.dropped(reason)
        return error

    def _drop(self, reason: DropReason, strict: bool, error: KvrayError) -> DropReason:
        self._counted(reason, error)
        if strict:
            raise error
        return reason


def _refusal(engine_id: str, message: TransferDone, why: str, layers: list[str]) -> KVIntegrityError:
    """The error that fails a request whose KV a check refused: `why`, then the `layers` it
    names (the first eight shown)."""
    shown = ", ".join(layers[:8]) + (", ..." if len(layers) > 8 else "")
    return KVIntegrityError(
        f"the KV of request {message.request_id!r} from {message.src_engine!r} {why} {len(layers)} "
        f"layer(s) ({shown}) of engine {engine_id!r}; the request is not decoded from it",
        request_id=message.request_id,
        engine_id=engine_id,
        src_engine=message.src_engine,
        layers=layers,
    )
