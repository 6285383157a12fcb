"""`actor` notice channel (completion anywhere Ray runs): a notice is a call on the Ray actor
hosting the decode engine's agent (`PeerCall.NOTIFY`), a push request one on the prefill
engine's (`PeerCall.REQUEST_PUSH`), the way left where no faster channel reaches it. `call_host`
is also how a writer on another node claims a request (`kvray.notice.claims`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvray.errors import KvrayError, TransferTimeoutError, TransportError
from kvray.host.calls import PeerCall
from kvray.notice.base import Mail, Mailbox, NoticeChannel, NoticeKind
from kvray.transport.base import Reachable

#: The peer call that takes each mailbox's messages on the engine's host.
CALLS = {Mailbox.COMPLETIONS: PeerCall.NOTIFY, Mailbox.PUSH_REQUESTS: PeerCall.REQUEST_PUSH}


@contextlib.asynccontextmanager
async def deadline(peer: Reachable, what: str, timeout_s: float) -> AsyncIterator[None]:
    """`timeout_s` for one message to a peer; passing it is `TransferTimeoutError`."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError as error:
        if isinstance(error, KvrayError):  # the peer's own timeout, already worded
            raise
        raise TransferTimeoutError(
            f"engine {peer.info.engine_id!r} did not take {what} within {timeout_s} s",
            engine_id=peer.info.engine_id,
            timeout_s=timeout_s,
        ) from error


async def call_host(peer: Reachable, what: str, call: PeerCall, message: bytes, timeout_s: float) -> None:
    """One peer call (`call`, of the one table) to the actor hosting a peer's agent, within
    `timeout_s`: a kvray error the peer
    raised comes back as itself, a timeout as `TransferTimeoutError`, anything else (its actor
    died) as `TransportError`."""
    if peer.host is None:
        raise TransportError(
            f"engine {peer.info.engine_id!r} has no host to send {what} to; its agent must run in "
            "an AgentHost actor (or be added with a host)",
            engine_id=peer.info.engine_id,
        )
    try:
        async with deadline(peer, what, timeout_s):
            await getattr(peer.host, call.host_method).remote(message)
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


class ActorChannel(NoticeChannel):
    """Notices (or push requests) through the actor hosting each peer's agent; the engine's own
    actor host takes them in (`AgentHost.kvray_notify`, `kvray_request_push`), so there is
    nothing to listen on or publish."""

    kind = NoticeKind.ACTOR

    def reaches(self, peer: Reachable) -> bool:
        return peer.host is not None

    async def send(self, peer: Reachable, notice: Mail, message: bytes) -> bool:
        if peer.host is None:
            return False
        what = f"a {type(notice).__name__} notice"
        await call_host(peer, what, CALLS[self.mailbox], message, self.settings.notify_timeout_s)
        return True
