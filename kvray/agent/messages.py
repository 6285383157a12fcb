"""What a writer says to a decode engine around its one-sided writes (completion step, writer's
side): it claims the request before the first byte (so the engine keeps the blocks while it
writes), and it notifies the engine when the bytes are there or will not come.

On one node both go without Ray: a claim is a read lock on the request's slot in the engine's
claim board (`kvray.claims`), a notice is a datagram into its completion inbox
(`kvray.completion`). Across nodes both are calls on the actor hosting the peer's agent
(`AgentHost.kvray_claim`, `kvray_notify`), each within `notify_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from kvray.claims import BOARD_NAME, ClaimClient
from kvray.claims import ENDPOINT as CLAIMS_ENDPOINT
from kvray.completion import ENDPOINT as COMPLETION_ENDPOINT
from kvray.completion import CompletionOutbox, DatagramNotice
from kvray.config import Settings
from kvray.errors import KvrayError, MetadataError, TransferTimeoutError, TransportError
from kvray.transport import Peer
from kvray.wire import EngineInfo, Notice, Reservation, TransferDone, TransportKind, WriteClaim, encode


class Messenger:
    """One writer engine's claims and notices to the decode engines it writes into."""

    def __init__(self, engine_id: str, node_id: str, settings: Settings) -> None:
        self.engine_id = engine_id
        self.node_id = node_id
        self.settings = settings
        self._outbox: CompletionOutbox | None = None
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

    async def send(self, peer: Peer, notice: Notice) -> None:
        what = f"a {type(notice).__name__} notice"
        inbox = self.inbox_here(peer)
        if inbox is None:
            await self.call_host(peer, what, "kvray_notify", encode(notice))
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

    def close(self) -> None:
        for board in self._boards.values():
            board.close()
        self._boards.clear()
        if self._outbox is not None:
            self._outbox.close()
