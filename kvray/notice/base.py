"""Notice channel interface (seventh step of the data flow, completion): how a writer's notice
that a request's bytes are there, or will not come, reaches the decode engine; and, the same
way, how a decode engine's push request or withdrawal reaches a prefill engine (`Mailbox`).

A channel has two ends, each a handful of verbs:

    writer    `reaches` says whether the channel can carry a notice to a peer from here;
              `send` delivers one (returning once the engine took it, or raising its
              refusal), `send_now` without awaiting where nothing on the way would wait,
              `sender` the same with its lookups done once for a peer;
              `prepare` starts what a coming notice will need (a connection); `early` hands a
              transport a notice it may send from its copy thread; `listening` says whether
              the peer's receiving end is still there, where the channel can tell; `forget`
              drops what was kept for a peer; `close` releases everything.
    receiver  a decode engine's (or, for push requests, a prefill engine's): `listen` starts
              taking notices, each handed to the engine (the `NoticeReceiver` protocol, which
              the agent implements); `publish` gives
              the endpoints writers need to reach it (they go into its
              `EngineInfo.endpoints`); `close` stops.

Everything a writer needs to reach a peer arrives in a `Reachable` (a `Peer`, or a prefill engine
as its ticket names it); a path a peer publishes is only a
claim, checked by `kvray.owned.open_peer` before anything is sent there. The agent's
`kvray.notice.NoticeSet` holds one channel of each kind and sends each notice through the first
that reaches its peer. A channel serves one `Mailbox` of its engine's: an agent has one set for
the notices it takes as a decode engine, and one for the push requests it takes as a prefill
engine, each with endpoints of its own.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Callable
from typing import ClassVar, Protocol

from kvray.config import Settings
from kvray.errors import KvrayError, NotExpectedError, StaleIncarnationError, TransportError
from kvray.metrics import DropReason, EngineMetrics
from kvray.placement import Stored
from kvray.transport.base import Reachable
from kvray.wire import Notice, PushMessage

#: Takes one notice's bytes on the engine's event loop; returns None if the engine took it,
#: else why it dropped it.
NoticeHandler = Callable[[bytes], DropReason | None]

#: What `send_now` hands back for a notice it sent: resolves once the engine took it (already
#: resolved where the channel needs no answer), or fails with its refusal as `send` raises it.
Receipt = asyncio.Future[None]

#: Sends a notice's bytes to one peer at once (`NoticeChannel.sender`): True once they are out
#: (the engine sends no answer); False, having sent nothing, where they cannot go now.
QuickSend = Callable[[bytes], bool]


#: What a channel carries: a notice to a decode engine (`Mailbox.COMPLETIONS`), or a push request
#: or withdrawal to a prefill engine (`Mailbox.PUSH_REQUESTS`).
Mail = Notice | PushMessage


class Mailbox(enum.Enum):
    """Which of an engine's receiving ends a channel serves: each has endpoints of its own (an
    inbox, a listener, a peer call on the engine's host), so the two never mix."""

    #: A decode engine's: notices that a request's KV is there, or will not come.
    COMPLETIONS = "completions"
    #: A prefill engine's: decode engines' push requests and withdrawals (`kvray.wire.PushRequest`).
    PUSH_REQUESTS = "push_requests"


class NoticeKind(enum.Enum):
    """The channels kvray ships, in the order an agent tries them."""

    #: Same node: a datagram into the engine's inbox in the shared-memory folder.
    LOCAL = "local"
    #: Other nodes: an authenticated TCP connection to the engine's notice listener.
    TCP = "tcp"
    #: Anywhere Ray runs: a call on the actor hosting the engine's agent.
    ACTOR = "actor"
    #: Engines of one process (tests, embedding).
    LOOPBACK = "loopback"


class NoticeReceiver(Protocol):
    """The engine a channel's receiver end serves: for completions, the agent's receiving side;
    for push requests, what the agent hands them to."""

    @property
    def engine_id(self) -> str: ...

    @property
    def incarnation(self) -> int: ...

    @property
    def node_address(self) -> str | None:
        """This node's address as its peers know it (None outside a cluster)."""
        ...

    def receive(self, message: bytes, /) -> DropReason | None:
        """One message's bytes, on the engine's event loop: None if the engine took it, else
        why it dropped it (counted there)."""
        ...


class ThreadNotice(Protocol):
    """A notice a transport may send from whichever thread writes a transfer's last byte
    (`Transport.write_then`): callable from any thread, quick, never raising, with what the
    transfer's executor reported (`kvray.placement.Stored`), which it puts in the notice;
    `sent` says whether it went (if not, the writer sends it the usual way)."""

    sent: bool

    def __call__(self, stored: Stored) -> None: ...


def refusal(reason: DropReason | None, engine_id: str, request_id: str) -> KvrayError | None:
    """The error a notice the engine dropped for `reason` stands for (None for a taken one), as
    the engine's own `notify` would have raised it through a Ray call."""
    if reason is None:
        return None
    if reason is DropReason.STALE:
        return StaleIncarnationError(
            f"engine {engine_id!r} refused the notice for request {request_id!r}: it names another "
            "engine or an old incarnation",
            engine_id=engine_id,
            request_id=request_id,
        )
    if reason is DropReason.FORGED:
        return NotExpectedError(
            f"engine {engine_id!r} refused the notice for request {request_id!r}: it did not carry "
            "its reservation's token",
            engine_id=engine_id,
            request_id=request_id,
        )
    if reason is DropReason.UNKNOWN:
        return NotExpectedError(
            f"engine {engine_id!r} does not expect request {request_id!r} (never reserved, or its "
            "wait has ended)",
            engine_id=engine_id,
            request_id=request_id,
        )
    return TransportError(
        f"engine {engine_id!r} could not decode the notice for request {request_id!r}",
        engine_id=engine_id,
        request_id=request_id,
    )


class NoticeChannel(abc.ABC):
    """Carries notices from writers to decode engines (writer end), and takes them in for a
    decode engine (receiver end); or, serving `Mailbox.PUSH_REQUESTS`, push requests from
    decode engines to prefill engines, the same way. One per agent, mailbox and kind; it counts
    what it did in `metrics`."""

    kind: ClassVar[NoticeKind]

    def __init__(
        self, settings: Settings, metrics: EngineMetrics | None = None, mailbox: Mailbox = Mailbox.COMPLETIONS
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else EngineMetrics.detached()
        self.mailbox = mailbox
        #: The node this agent runs on (the set keeps it current).
        self.node_id = ""

    # ---- writer end -------------------------------------------------------------------

    @abc.abstractmethod
    def reaches(self, peer: Reachable) -> bool:
        """Whether this channel can carry a notice to `peer` from here, now."""

    @abc.abstractmethod
    async def send(self, peer: Reachable, notice: Mail, message: bytes) -> bool:
        """Deliver `message` (`notice`, encoded): True once the engine took it (a refusal raises
        as the kvray error the engine's own `notify` would raise); False, having sent nothing,
        if it cannot go this way after all (the next channel that reaches the peer takes it).
        The caller bounds the wait."""

    def send_now(self, peer: Reachable, notice: Mail, message: bytes) -> Receipt | None:
        """`send` from the event loop's thread without awaiting: the notice is out when this
        returns, with its receipt; None, having sent nothing, where the channel would have to
        wait (then `send` follows)."""
        return None

    def sender(self, peer: Reachable) -> QuickSend | None:
        """`send_now` to `peer` with what it looks up (the peer's inbox, a connected socket)
        looked up once, for a writer that keeps it for the notices it sends the peer; only where
        the engine sends no answer. None where the channel has none."""
        return None

    def listening(self, peer: Reachable) -> bool | None:
        """Whether the peer's receiver end on this channel is still there (a sender waiting on
        an answer asks now and then); None where the channel cannot tell."""
        return None

    def prepare(self, peer: Reachable) -> None:  # noqa: B027 - optional hook
        """Start what a notice to `peer` will need (e.g. a connection), awaiting nothing."""

    def early(self, peer: Reachable, message: bytes) -> ThreadNotice | None:
        """A notice a transport may send from its copy thread the moment the last byte lands;
        None where this channel has none."""
        return None

    def forget(self, engine_id: str) -> None:  # noqa: B027 - optional hook
        """Drop what is kept for a peer (it restarted, left or failed)."""

    # ---- receiver end (a decode engine's) ---------------------------------------------

    async def listen(self, receiver: NoticeReceiver) -> None:  # noqa: B027 - optional hook
        """Start taking notices for the engine `receiver` serves (once, at its start), handing
        each to its `receive`."""

    def publish(self) -> dict[str, str]:
        """The endpoints writers need to reach this engine through the channel."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release both ends."""
