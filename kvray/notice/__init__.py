"""Notice channels, their registry and the set an agent sends through (seventh step, completion):
channels are imported lazily, by name, when first opened; `NoticeSet` sends each notice through
the first of an agent's channels that reaches the peer, and holds the agent's claims. An agent
has a second set for its push-request mailbox (`Mailbox.PUSH_REQUESTS`): decode engines' push
requests reach a prefill engine the same way, through the first channel that reaches it."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvray.config import Settings
from kvray.errors import TransportError, TransportUnavailableError
from kvray.metrics import EngineMetrics
from kvray.notice.actor import deadline
from kvray.notice.base import (
    Mail,
    Mailbox,
    NoticeChannel,
    NoticeKind,
    NoticeReceiver,
    QuickSend,
    Receipt,
    ThreadNotice,
)
from kvray.notice.claims import ClaimClient, Claims
from kvray.transport.base import Peer, Reachable
from kvray.wire import Notice, Reservation, encode

#: Every channel kvray ships.
_CHANNELS: dict[NoticeKind, tuple[str, str]] = {
    NoticeKind.LOCAL: ("kvray.notice.local", "LocalChannel"),
    NoticeKind.TCP: ("kvray.notice.tcp", "TcpChannel"),
    NoticeKind.ACTOR: ("kvray.notice.actor", "ActorChannel"),
    NoticeKind.LOOPBACK: ("kvray.notice.loopback", "LoopbackChannel"),
}
#: The registry's channels every agent has, in the order they are tried (after injected ones):
#: the fastest that can reach a peer first.
DEFAULT_KINDS = (NoticeKind.LOCAL, NoticeKind.TCP, NoticeKind.ACTOR)


@dataclass(frozen=True)
class QuickNotice:
    """Notices about one reservation sent at once to its engine (`NoticeSet.quick`): each only
    while the request's slot in the engine's claim board on this node is open under its token
    (read without its lock, as `Claims.open_now` does), through a sender kept for the peer."""

    peer: Peer
    #: The engine's claim board, when it is on this node (None: the engine checks the token).
    board: ClaimClient | None
    slot: int
    token: int
    send: QuickSend

    def send_now(self, message: bytes) -> bool:
        """True once `message` is out; False, having sent nothing, where `NoticeSet.send_now`
        or the usual path must say why."""
        if self.board is not None and not self.board.is_open(self.slot, self.token):
            return False
        return self.send(message)


def channel_class(kind: NoticeKind) -> type[NoticeChannel]:
    """The channel class for `kind`, imported now."""
    module_name, class_name = _CHANNELS[kind]
    cls: type[NoticeChannel] = getattr(importlib.import_module(module_name), class_name)
    return cls


class NoticeSet:
    """An agent's notice channels: injected ones first (`KVAgent(..., notices=[...])`), then the
    registry's (`DEFAULT_KINDS`). Each notice goes through the first channel that reaches its
    peer, asked per notice: a channel's `reaches` looks only at what the peer published and
    at what the channel keeps per peer (a `PeerCache`), so a listener that could not be
    reached is passed over until it is worth trying again. The agent closes every channel
    (injected ones too) when it closes. Every channel of a set serves its `mailbox`."""

    def __init__(
        self,
        settings: Settings,
        metrics: EngineMetrics | None = None,
        injected: Sequence[NoticeChannel] = (),
        mailbox: Mailbox = Mailbox.COMPLETIONS,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else EngineMetrics.detached()
        self.mailbox = mailbox
        kinds = [channel.kind for channel in injected]
        if len(set(kinds)) != len(kinds):
            raise TransportUnavailableError(
                "two notice channels of one kind were given; give one of each kind",
                channels=[kind.value for kind in kinds],
            )
        if any(channel.mailbox is not mailbox for channel in injected):
            raise TransportUnavailableError(
                f"a notice channel given for the {mailbox.value} mailbox serves another one",
                channels=[channel.mailbox.value for channel in injected],
            )
        registry = [
            channel_class(kind)(settings, self.metrics, mailbox)
            for kind in DEFAULT_KINDS
            if kind not in kinds
        ]
        self.channels: tuple[NoticeChannel, ...] = (*injected, *registry)
        self.claims = Claims(settings)
        self._node_id = ""

    @property
    def node_id(self) -> str:
        return self._node_id

    @node_id.setter
    def node_id(self, value: str) -> None:
        """Where the agent runs (same-node channels and claims compare it with a peer's)."""
        self._node_id = value
        self.claims.node_id = value
        for channel in self.channels:
            channel.node_id = value

    def reaching(self, peer: Reachable) -> NoticeChannel | None:
        """The first channel that reaches `peer` now."""
        for channel in self.channels:
            if channel.reaches(peer):
                return channel
        return None

    # ---- writer end -------------------------------------------------------------------

    async def send(self, peer: Reachable, notice: Mail, *, timeout_s: float | None = None) -> None:
        """Deliver a notice to the engine (a push request to a prefill engine's mailbox), through
        the first channel that reaches it and takes it, each within `timeout_s` (default
        `notify_timeout_s`); the engine's refusal raises as its kvray error."""
        what = f"a {type(notice).__name__} notice"
        message = encode(notice)
        bound = self.settings.notify_timeout_s if timeout_s is None else timeout_s
        for channel in self.channels:
            if not channel.reaches(peer):
                continue
            async with deadline(peer, what, bound):
                if await channel.send(peer, notice, message):
                    return
        raise TransportError(
            f"engine {peer.info.engine_id!r} has no host to send {what} to; its agent must run in "
            "an AgentHost actor (or be added with a host)",
            engine_id=peer.info.engine_id,
        )

    def send_now(
        self, peer: Peer, reservation: Reservation, notice: Notice, message: bytes | None = None
    ) -> Receipt | None:
        """Send a notice about `reservation` (`message`: its bytes, if the caller has them) at
        once, awaiting nothing: its receipt, or None, having sent nothing, wherever the usual
        path (`claims.hold`, then `send`) would have to wait: a board this writer has not opened
        yet or a slot no longer open under the reservation's token (`Claims.open_now`), a
        channel that would wait (a full inbox, a connection not open yet, an actor call)."""
        if not self.claims.open_now(peer, reservation):
            return None
        channel = self.reaching(peer)
        if channel is None:
            return None
        return channel.send_now(peer, notice, encode(notice) if message is None else message)

    def quick(self, peer: Peer, reservation: Reservation) -> QuickNotice | None:
        """`send_now` for notices about `reservation`, with what it looks up looked up once (a
        layer-wise push keeps it for the notice its `finish` sends); None where the first
        channel that reaches the peer has no such sender, or the peer's board on this node is
        not open here yet."""
        channel = self.reaching(peer)
        send = None if channel is None else channel.sender(peer)
        if send is None:
            return None
        board = None
        if self.claims.board_path(peer) is not None:
            board = self.claims.client(peer)
            if board is None:
                return None
        return QuickNotice(peer, board, reservation.slot, reservation.token, send)

    def early(self, peer: Peer, notice: Notice) -> ThreadNotice | None:
        """A notice the transport may send from its copy thread the moment the last byte lands
        (see `Transport.write_then`); None where the peer's channel has none."""
        channel = self.reaching(peer)
        return None if channel is None else channel.early(peer, encode(notice))

    def listening(self, peer: Reachable) -> bool | None:
        """Whether the peer's receiver end is still there, as the first channel that reaches it
        can tell (its inbox on this node has a reader); None where it cannot tell."""
        channel = self.reaching(peer)
        return None if channel is None else channel.listening(peer)

    def prepare(self, peer: Reachable) -> None:
        """Start what a notice to `peer` will need (e.g. a connection to its listener) while the
        bytes move, awaiting nothing."""
        channel = self.reaching(peer)
        if channel is not None:
            channel.prepare(peer)

    def forget(self, engine_id: str) -> None:
        self.claims.forget(engine_id)
        for channel in self.channels:
            channel.forget(engine_id)

    # ---- receiver end -----------------------------------------------------------------

    async def listen(self, receiver: NoticeReceiver) -> dict[str, str]:
        """Start every channel's receiver end for a decode engine; the endpoints to publish."""
        endpoints: dict[str, str] = {}
        for channel in self.channels:
            await channel.listen(receiver)
            endpoints.update(channel.publish())
        return endpoints

    def close(self) -> None:
        self.claims.close()
        for channel in self.channels:
            channel.close()


__all__ = [
    "DEFAULT_KINDS",
    "Mail",
    "Mailbox",
    "NoticeChannel",
    "NoticeKind",
    "NoticeReceiver",
    "NoticeSet",
    "QuickNotice",
    "channel_class",
]
