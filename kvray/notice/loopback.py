"""`loopback` notice channel: decode engines of one process take notices straight from their
writers, for tests and for embedding kvray where both ends live in one program; it pairs with
`kvray.transport.loopback`. The engine checks each notice as it checks any other (address,
incarnation, token), and a refusal comes back to the writer as the engine's own error.

    transports, notices = LoopbackNetwork(), NoticeNetwork()
    prefill = KVAgent("p", Role.PREFILL, layout,
                      transports=[LoopbackTransport(transports)], notices=[LoopbackChannel(notices)])
    decode = KVAgent("d", Role.DECODE, layout,
                     transports=[LoopbackTransport(transports)], notices=[LoopbackChannel(notices)])

Each agent takes its own `LoopbackChannel`; the engines that share a `NoticeNetwork` reach each
other, and a notice to any other engine goes the next way (its inbox, listener or actor).
"""

from __future__ import annotations

import asyncio

from kvray.config import Settings
from kvray.metrics import EngineMetrics
from kvray.notice.base import Mail, NoticeChannel, NoticeHandler, NoticeKind, NoticeReceiver, Receipt, refusal
from kvray.transport.base import Reachable


class NoticeNetwork:
    """The decode engines loopback channels reach: each one that listens with a
    `LoopbackChannel` of this network, until its agent closes."""

    def __init__(self) -> None:
        self._handlers: dict[str, tuple[int, NoticeHandler]] = {}
        #: Notices delivered (taken or refused).
        self.notices = 0

    def join(self, engine_id: str, incarnation: int, handler: NoticeHandler) -> None:
        self._handlers[engine_id] = (incarnation, handler)

    def leave(self, engine_id: str, incarnation: int) -> None:
        if self._handlers.get(engine_id, (None,))[0] == incarnation:
            del self._handlers[engine_id]

    def handler(self, engine_id: str, incarnation: int) -> NoticeHandler | None:
        """The engine's handler, if that incarnation of it is on this network."""
        joined = self._handlers.get(engine_id)
        return joined[1] if joined is not None and joined[0] == incarnation else None


class LoopbackChannel(NoticeChannel):
    """One agent's end of a `NoticeNetwork` (a fresh network of its own when none is given)."""

    kind = NoticeKind.LOOPBACK

    def __init__(
        self,
        network: NoticeNetwork | None = None,
        settings: Settings | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        super().__init__(settings or Settings(), metrics)
        self.network = network if network is not None else NoticeNetwork()
        self._joined: tuple[str, int] | None = None

    def reaches(self, peer: Reachable) -> bool:
        return self.network.handler(peer.info.engine_id, peer.info.incarnation) is not None

    async def send(self, peer: Reachable, notice: Mail, message: bytes) -> bool:
        receipt = self.send_now(peer, notice, message)
        if receipt is None:
            return False
        await receipt
        return True

    def send_now(self, peer: Reachable, notice: Mail, message: bytes) -> Receipt | None:
        info = peer.info
        handler = self.network.handler(info.engine_id, info.incarnation)
        if handler is None:
            return None
        self.network.notices += 1
        refused = refusal(handler(message), info.engine_id, notice.request_id)
        receipt: Receipt = asyncio.get_running_loop().create_future()
        if refused is None:
            receipt.set_result(None)
        else:
            receipt.set_exception(refused)
        return receipt

    async def listen(self, receiver: NoticeReceiver) -> None:
        self._joined = (receiver.engine_id, receiver.incarnation)
        self.network.join(*self._joined, receiver.receive)

    def close(self) -> None:
        if self._joined is not None:
            self.network.leave(*self._joined)
            self._joined = None
