"""What a writer says to a decode engine around its one-sided writes (completion step, writer's
side): it claims the request before the first byte (so the engine keeps the blocks while it
writes), and it notifies the engine when the bytes are there or will not come.

On one node both go without Ray: a claim is a read lock on the request's slot in the engine's
claim board (`kvray.claims`), a notice is a datagram into its completion inbox
(`kvray.completion`). Across nodes a claim is a call on the actor hosting the peer's agent
(`AgentHost.kvray_claim`), and a notice goes over the authenticated TCP connection to the
engine's notice listener (`kvray.completion_tcp`) where it has one that this writer can reach,
else through that actor too (`kvray_notify`); each within `notify_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator

from kvray.claims import BOARD_NAME, ClaimClient
from kvray.claims import ENDPOINT as CLAIMS_ENDPOINT
from kvray.completion import ENDPOINT as COMPLETION_ENDPOINT
from kvray.completion import CompletionOutbox, DatagramNotice
from kvray.completion_tcp import (
    ADDRESS_ENDPOINT,
    KEY_ENDPOINT,
    NoticeChannel,
    Verdict,
    parse_address,
    parse_key,
    refusal,
)
from kvray.config import Settings
from kvray.errors import KvrayError, MetadataError, TransferTimeoutError, TransportError
from kvray.transport import Peer
from kvray.wire import EngineInfo, Notice, Reservation, TransferDone, TransportKind, WriteClaim, encode

#: The share of `notify_timeout_s` a writer spends reaching a peer's notice listener before it
#: sends the notice through the peer's actor instead.
CONNECT_SHARE = 0.25
#: Seconds a writer leaves a notice listener alone after failing to reach it.
UNREACHABLE_S = 30.0


class Messenger:
    """One writer engine's claims and notices to the decode engines it writes into."""

    def __init__(
        self, engine_id: str, node_id: str, settings: Settings, stats: Counter[str] | None = None
    ) -> None:
        self.engine_id = engine_id
        self.node_id = node_id
        self.settings = settings
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self._outbox: CompletionOutbox | None = None
        #: Connections to decode engines' notice listeners, per (engine, incarnation), least
        #: recently used first; each an opening task until it is up.
        self._channels: OrderedDict[tuple[str, int], asyncio.Task[NoticeChannel]] = OrderedDict()
        #: Listeners a connection failed to recently, and until when they are left alone.
        self._unreachable: dict[tuple[str, int], float] = {}
        #: Claim boards of same-node decode engines this agent writes into, per incarnation.
        self._boards: dict[tuple[str, int], ClaimClient] = {}
        #: Requests (id, token) a decode engine on another node holds for this writer (`verbs`).
        self._remote_claims: set[tuple[str, int]] = set()

    # ---- claims -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def claim(
        self, writer: EngineInfo, peer: Peer, reservation: Reservation, kind: TransportKind | None = None
    ) -> AsyncIterator[None]:
        """Make sure the decode engine still expects the request, and keeps its blocks, while
        the body writes and notifies; a request it no longer expects is refused before a byte
        moves. On its node: hold the request's slot in its claim board. Over `verbs`: ask it
        once per request to hold the blocks until this writer's notice. Other transports'
        receivers check each write themselves (`Receiver.admit`)."""
        path = peer.info.endpoints.get(CLAIMS_ENDPOINT)
        if not path or peer.info.node_id != self.node_id:
            if kind is TransportKind.VERBS:
                await self._claim_remote(writer, peer, reservation)
            yield
            return
        key = (peer.info.engine_id, peer.info.incarnation)
        board = self._boards.get(key)
        if board is None:
            self._check_board_path(peer, path)
            board = self._boards[key] = ClaimClient(path, peer.info.engine_id)
        async with board.hold(
            reservation.request_id, reservation.slot, reservation.token, self.settings.notify_timeout_s
        ):
            yield

    def end_claim(self, reservation: Reservation) -> None:
        """The request's writes and notice are over: a later push of it claims again."""
        self._remote_claims.discard((reservation.request_id, reservation.token))

    def _check_board_path(self, peer: Peer, path: str) -> None:
        """A peer's claim board must sit in its completion inbox's folder, which the outbox
        checks is a private kvray folder of this user in the shared-memory folder."""
        inbox = peer.info.endpoints.get(COMPLETION_ENDPOINT, "")
        if not inbox or path != os.path.join(os.path.dirname(inbox), BOARD_NAME):
            raise MetadataError(
                f"engine {peer.info.engine_id!r} publishes its claim board at {path!r}, not beside its "
                "completion inbox; kvray opens only the boards it creates",
                engine_id=peer.info.engine_id,
                path=path,
            )
        self.outbox().check_inbox(inbox)

    async def _claim_remote(self, writer: EngineInfo, peer: Peer, reservation: Reservation) -> None:
        key = (reservation.request_id, reservation.token)
        if key in self._remote_claims:
            return
        claim = WriteClaim(
            request_id=reservation.request_id,
            token=reservation.token,
            src_engine=writer.engine_id,
            src_incarnation=writer.incarnation,
            dst_engine=reservation.engine_id,
            dst_incarnation=reservation.incarnation,
        )
        await self.call_host(peer, f"the claim of {reservation.request_id!r}", "kvray_claim", encode(claim))
        self._remote_claims.add(key)

    # ---- notices ----------------------------------------------------------------------

    def outbox(self) -> CompletionOutbox:
        if self._outbox is None:
            self._outbox = CompletionOutbox(self.settings.shm_dir)
        return self._outbox

    def inbox_here(self, peer: Peer) -> str | None:
        """The peer's completion inbox, when it is on this node (else notices go through Ray)."""
        inbox = peer.info.endpoints.get(COMPLETION_ENDPOINT)
        return inbox if inbox and peer.info.node_id == self.node_id else None

    def early_notice(self, peer: Peer, notice: TransferDone) -> DatagramNotice | None:
        """A completion notice the transport may send from its copy thread the moment the last
        byte lands (same node, through the peer's inbox; see `Transport.write_then`)."""
        inbox = self.inbox_here(peer)
        if inbox is None:
            return None
        return DatagramNotice(self.outbox(), inbox, encode(notice))

    def notify_now(self, peer: Peer, reservation: Reservation, notice: Notice) -> bool:
        """Send a notice about `reservation` to a same-node peer at once, awaiting nothing: True
        if it is in the peer's inbox. False, having sent nothing, wherever the usual path
        (`claim`, then `send`) would have to wait or to say why not: a peer on another node or
        whose board this writer has not opened yet, a slot no longer open under the
        reservation's token, a full or gone inbox. The slot is read without taking its claim
        (`ClaimClient.is_open`): a notice writes no byte into the request's blocks."""
        inbox = self.inbox_here(peer)
        board = self._boards.get((peer.info.engine_id, peer.info.incarnation))
        if inbox is None or board is None or not board.is_open(reservation.slot, reservation.token):
            return False
        return self.outbox().send_now(inbox, encode(notice))

    def connect_ahead(self, peer: Peer) -> None:
        """Start connecting to a peer's notice listener on another node, if this writer has no
        connection to it yet, so that the notice finds it open (awaits nothing)."""
        target = self._far_listener(peer)
        if target is None:
            return
        key = (peer.info.engine_id, peer.info.incarnation)
        if key not in self._channels and self._unreachable.get(key, 0.0) <= time.monotonic():
            opening = self._opening(key, *target)
            if opening is not None:
                # Its failure is counted when a notice first needs it (`_channel`).
                opening.add_done_callback(lambda task: task.cancelled() or task.exception())

    def _far_listener(self, peer: Peer) -> tuple[str, str] | None:
        """(address, key) of a peer's notice listener, if notices to it should go there."""
        if not self.settings.notice_tcp or self.inbox_here(peer) is not None:
            return None
        address = peer.info.endpoints.get(ADDRESS_ENDPOINT)
        listener_key = peer.info.endpoints.get(KEY_ENDPOINT)
        if not address or not listener_key:
            return None
        return address, listener_key

    def notify_far_now(self, peer: Peer, notice: Notice) -> asyncio.Future[Verdict] | None:
        """Send a notice to a peer on another node over the connection this writer keeps open to
        its notice listener, at once, awaiting nothing: the future of the engine's verdict. None,
        having sent nothing, where there is no such connection open (the usual `send` then
        opens one, or calls the peer's actor)."""
        if self._far_listener(peer) is None:
            return None
        opening = self._channels.get((peer.info.engine_id, peer.info.incarnation))
        if opening is None or not opening.done() or opening.cancelled() or opening.exception() is not None:
            return None
        try:
            sent = opening.result().send_now(encode(notice))
        except TransportError:
            return None
        self.stats["notices_sent_tcp"] += 1
        self.stats["notices_sent_tcp_at_once"] += 1
        return sent

    async def send(self, peer: Peer, notice: Notice) -> None:
        """Deliver a notice to the decode engine: through its inbox on this node, else over its
        notice listener, else through its actor. Across nodes it returns once the engine has
        read it, raising the engine's refusal as a kvray error."""
        what = f"a {type(notice).__name__} notice"
        inbox = self.inbox_here(peer)
        if inbox is None:
            message = encode(notice)
            if not await self._send_over_tcp(peer, what, notice, message):
                await self.call_host(peer, what, "kvray_notify", message)
            return
        async with self._deadline(peer, what):
            try:
                await self.outbox().send(inbox, encode(notice))
            except TransportError as error:
                raise TransportError(
                    f"could not notify engine {peer.info.engine_id!r}: {error}",
                    engine_id=peer.info.engine_id,
                    path=inbox,
                ) from error

    async def _send_over_tcp(self, peer: Peer, what: str, notice: Notice, message: bytes) -> bool:
        """The notice over the peer's notice listener: True once the engine took it (its refusal
        raises); False, having sent nothing, when the peer publishes no usable listener or this
        writer cannot reach it in its share of the deadline (the caller then calls the actor)."""
        info = peer.info
        key = (info.engine_id, info.incarnation)
        target = self._far_listener(peer)
        if target is None or self._unreachable.get(key, 0.0) > time.monotonic():
            return False
        async with self._deadline(peer, what):
            channel = await self._channel(key, *target)
            if channel is None:
                return False
            try:
                verdict = await channel.send(message)
            except TransportError as error:
                self._close_channel(key)
                raise TransportError(
                    f"could not notify engine {info.engine_id!r}: {error}", engine_id=info.engine_id
                ) from error
        self.stats["notices_sent_tcp"] += 1
        refused = refusal(verdict, info.engine_id, notice.request_id)
        if refused is not None:
            raise refused
        return True

    async def _channel(self, key: tuple[str, int], address: str, listener_key: str) -> NoticeChannel | None:
        """The open connection to a listener, opened now if needed (None if it cannot be)."""
        opening = self._channels.get(key)
        # A connection that was lost (or an opening given up) is opened again; one that failed
        # to open is reported below.
        if opening is not None and opening.done() and (opening.cancelled() or _lost(opening)):
            self._close_channel(key)
            opening = None
        if opening is None:
            opening = self._opening(key, address, listener_key)
            if opening is None:
                return None
        self._channels.move_to_end(key)
        try:
            return await asyncio.shield(opening)
        except (TransportError, TimeoutError):
            self.stats["notice_listeners_unreachable"] += 1
            self._close_channel(key)
            self._unreachable[key] = time.monotonic() + UNREACHABLE_S
            return None

    def _opening(
        self, key: tuple[str, int], address: str, listener_key: str
    ) -> asyncio.Task[NoticeChannel] | None:
        """Start opening a connection to a listener (None, marked unusable, if what the peer
        published is not an address and a key)."""
        try:
            host, port = parse_address(address)
            secret = parse_key(listener_key)
        except MetadataError:
            self.stats["notice_listeners_malformed"] += 1
            self._unreachable[key] = float("inf")
            return None
        opening = asyncio.ensure_future(self._open_channel(host, port, secret, key[0]))
        self._channels[key] = opening
        self._evict_channels()
        return opening

    async def _open_channel(self, host: str, port: int, secret: bytes, engine_id: str) -> NoticeChannel:
        async with asyncio.timeout(self.settings.notify_timeout_s * CONNECT_SHARE):
            channel = await NoticeChannel.open(host, port, secret, engine_id)
        self.stats["notice_channels_opened"] += 1
        return channel

    def _evict_channels(self) -> None:
        while len(self._channels) > self.settings.max_cached_peers:
            self._close_channel(next(iter(self._channels)))

    def _close_channel(self, key: tuple[str, int]) -> None:
        opening = self._channels.pop(key, None)
        if opening is None:
            return
        if not opening.done():
            opening.cancel()
        elif not opening.cancelled() and opening.exception() is None:
            opening.result().close()

    async def call_host(self, peer: Peer, what: str, method: str, message: bytes) -> None:
        """One call to the actor hosting a peer's agent, within `notify_timeout_s`: a kvray error
        the peer raised comes back as itself, a timeout as `TransferTimeoutError`, anything
        else (its actor died) as `TransportError`."""
        if peer.host is None:
            raise TransportError(
                f"engine {peer.info.engine_id!r} has no host to send {what} to; its agent must run in "
                "an AgentHost actor (or be added with a host)",
                engine_id=peer.info.engine_id,
            )
        try:
            async with self._deadline(peer, what):
                await getattr(peer.host, method).remote(message)
        except KvrayError:
            raise
        except Exception as error:  # e.g. the peer's actor died
            cause = getattr(error, "cause", None)
            if isinstance(cause, KvrayError):
                raise cause from error
            raise TransportError(
                f"could not send {what} to engine {peer.info.engine_id!r}: {type(error).__name__}",
                engine_id=peer.info.engine_id,
            ) from error

    @contextlib.asynccontextmanager
    async def _deadline(self, peer: Peer, what: str) -> AsyncIterator[None]:
        """`notify_timeout_s` for one message to a peer; passing it is `TransferTimeoutError`."""
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                yield
        except TimeoutError as error:
            if isinstance(error, KvrayError):  # the peer's own timeout, already worded
                raise
            raise TransferTimeoutError(
                f"engine {peer.info.engine_id!r} did not take {what} within "
                f"{self.settings.notify_timeout_s} s",
                engine_id=peer.info.engine_id,
                timeout_s=self.settings.notify_timeout_s,
            ) from error

    # ---- life cycle -------------------------------------------------------------------

    def forget(self, engine_id: str) -> None:
        for key in [key for key in self._boards if key[0] == engine_id]:
            self._boards.pop(key).close()
        for key in [key for key in self._channels if key[0] == engine_id]:
            self._close_channel(key)
        for key in [key for key in self._unreachable if key[0] == engine_id]:
            del self._unreachable[key]

    def close(self) -> None:
        for key in list(self._channels):
            self._close_channel(key)
        for board in self._boards.values():
            board.close()
        self._boards.clear()
        if self._outbox is not None:
            self._outbox.close()


def _lost(opening: asyncio.Task[NoticeChannel]) -> bool:
    """An opened connection that has closed since (the task is done and not cancelled)."""
    return opening.exception() is None and opening.result().closed
