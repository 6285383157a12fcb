"""`local` notice channel (completion, same node): a decode engine on this node is told its KV
has landed in tens of microseconds instead of a Ray call's milliseconds.

The decode agent binds a Unix datagram socket inside a private folder (mode 0700, so only
this user can send to it) next to its shared-memory files and publishes the path in its
`EngineInfo.endpoints`. A writer on the same node sends the msgspec-encoded notice there (from
its copy thread where the transport allows, `DatagramNotice`); the inbox path is only a claim,
checked once per path by `kvray.owned.open_peer`. A prefill engine's push-request inbox is one
more such inbox, published under its own key (`ENDPOINTS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections import OrderedDict
from collections.abc import Callable

from kvray.config import Settings
from kvray.errors import MetadataError, TransportError
from kvray.metrics import EngineMetrics
from kvray.notice.base import Mail, Mailbox, NoticeChannel, NoticeKind, NoticeReceiver, QuickSend, Receipt
from kvray.owned import INBOX_NAME, PeerPath, create_owned_folder, open_peer, remove_owned
from kvray.placement import Stored, filled
from kvray.transport.base import Reachable
from kvray.transport.cpu_copy import resolve_once

#: Key of the inbox path in `EngineInfo.endpoints`.
ENDPOINT = "completion_socket"
#: Key of a prefill engine's push-request inbox in `EngineInfo.endpoints`.
PUSH_ENDPOINT = "push_requests"
#: The key each mailbox's inbox is published under.
ENDPOINTS = {Mailbox.COMPLETIONS: ENDPOINT, Mailbox.PUSH_REQUESTS: PUSH_ENDPOINT}
_MAX_MESSAGE = 64 * 1024
#: Inbox paths an outbox remembers as checked (a few per peer engine on the node).
_MAX_CHECKED_PATHS = 1024
#: Inboxes an outbox keeps a connected socket to (those it had to wait on recently).
_MAX_CONNECTED = 64


class CompletionInbox:
    """A datagram socket whose messages are handed to `handler` on the event loop."""

    def __init__(self, folder: str, handler: Callable[[bytes], object]) -> None:
        # Locked for the inbox's life, so a sweep by another process never removes it.
        self._folder = create_owned_folder(folder)
        self.path = os.path.join(self._folder, INBOX_NAME)
        #: The private folder (mode 0700) the inbox lives in; the engine's claim board sits there too.
        self.folder = self._folder
        self._handler = handler
        self._buffer = bytearray(_MAX_MESSAGE)
        self._view = memoryview(self._buffer)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._socket.bind(self.path)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._socket.fileno(), self.drain)

    def fileno(self) -> int:
        return self._socket.fileno()

    def drain(self) -> None:
        """Hand the next queued message to the handler (the loop calls this while one is queued).

        One message per call: the reader is level-triggered, so the loop calls again while more
        are queued, and the handler's waiter is not held up by a read that finds nothing."""
        try:
            nbytes = self._socket.recv_into(self._buffer)
        except OSError:  # nothing queued after all (BlockingIOError, InterruptedError), or closed
            return
        # Into a buffer kept for the inbox's life: `recv` would allocate (and fault in) 64 KiB
        # for every message, most of its cost.
        self._handler(bytes(self._view[:nbytes]))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._socket.fileno())
        self._socket.close()
        remove_owned(self._folder)


class CompletionOutbox:
    """The sending end: one unbound datagram socket for every peer on this node.

    `shm_dir`: the shared-memory folder (`Settings.shm_dir`) the peers' inboxes must live in.
    """

    def __init__(self, shm_dir: str) -> None:
        self._shm_dir = os.path.normpath(shm_dir)
        self._checked: set[str] = set()
        #: Unbound: `try_send` and senders outside Python address each datagram with `sendto`.
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        #: One socket connected to each inbox `send` has waited on, least recently used first.
        self._connected: OrderedDict[str, _Connected] = OrderedDict()

    def check_inbox(self, path: str) -> None:
        """Refuse an inbox path kvray did not make (`MetadataError`), or one that is gone
        (`TransportError`). Checked once per path: the folder is this user's and private, so
        only this user could swap what is inside it afterwards."""
        if path in self._checked:
            return
        os.close(open_peer(path, PeerPath.INBOX, self._shm_dir))
        if len(self._checked) >= _MAX_CHECKED_PATHS:
            self._checked.clear()
        self._checked.add(path)

    async def send(self, path: str, message: bytes) -> None:
        """Queue `message` in the peer's inbox (waits while the inbox is full; the caller bounds it).

        A socket connected to the inbox, because only a connected datagram socket reads as
        not writable while its peer's queue is full (and is woken when the peer reads): an
        unbound one reads as writable, so waiting on it would spin. A non-blocking `send` and a
        writer callback, not `loop.sock_sendall`: uvloop, the loop Ray gives async actors
        whenever it is installed (ray[serve] installs it), lacks the datagram variants."""
        self.check_inbox(path)
        connected = self._connect(path)
        loop = asyncio.get_running_loop()
        while True:
            try:
                connected.socket.send(message)
                return
            except (FileNotFoundError, ConnectionRefusedError) as error:
                self._disconnect(path)
                raise TransportError(
                    f"the completion inbox {path} is gone: the decode engine closed or died",
                    path=path,
                ) from error
            except (BlockingIOError, InterruptedError):
                await asyncio.shield(connected.writable(loop))

    def listening(self, path: str) -> bool:
        """Whether a process still reads the inbox at `path` (checked as `send` checks it):
        False once its owner closed it or died. A datagram queued just before that is lost
        without a word, so a sender waiting on an answer asks this now and then."""
        try:
            self.check_inbox(path)
        except (MetadataError, TransportError):
            return False
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(path)
        except OSError:
            return False
        finally:
            probe.close()
        return True

    def send_now(self, path: str, message: bytes) -> bool:
        """`send` without waiting, from the event loop's thread: True if the message is in the
        peer's inbox, False if it could not be queued right now (full, gone, not kvray's) - the
        caller then sends it with `send`, which waits or raises as the case may be. Through the
        inbox's connected socket, which skips the path lookup of an addressed `sendto`."""
        connected = self._checked_connection(path)
        return connected is not None and self._send_on(path, connected, message)

    def sender(self, path: str) -> QuickSend | None:
        """`send_now` to one inbox with its checks done and its socket connected once (None
        where they fail). A connection closed since (evicted, or the outbox closed) sends
        nothing: the caller then takes `send_now`'s way."""
        connected = self._checked_connection(path)
        if connected is None:
            return None
        return functools.partial(self._send_on, path, connected)

    def _checked_connection(self, path: str) -> _Connected | None:
        """The connected socket of a kvray inbox (None: not kvray's, or gone)."""
        try:
            self.check_inbox(path)
            return self._connect(path)
        except (MetadataError, TransportError):
            return None

    def _send_on(self, path: str, connected: _Connected, message: bytes) -> bool:
        """One non-blocking send on `path`'s connection: True once queued; False if the inbox is
        full, or the connection failed (then dropped, unless another has replaced it)."""
        try:
            connected.socket.send(message)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            if self._connected.get(path) is connected:
                self._disconnect(path)
            return False
        return True

    def _connect(self, path: str) -> _Connected:
        connected = self._connected.get(path)
        if connected is not None:
            self._connected.move_to_end(path)
            return connected
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except OSError as error:
            sock.close()
            raise TransportError(
                f"the completion inbox {path} is gone: the decode engine closed or died", path=path
            ) from error
        connected = self._connected[path] = _Connected(sock)
        self._evict()
        return connected

    def _evict(self) -> None:
        """Close the least recently used connections beyond the cap (none a sender waits on)."""
        excess = len(self._connected) - _MAX_CONNECTED
        for path, connected in list(self._connected.items()):
            if excess <= 0:
                break
            if not connected.waiting:
                self._disconnect(path)
                excess -= 1

    def _disconnect(self, path: str) -> None:
        connected = self._connected.pop(path, None)
        if connected is not None:
            connected.close()

    def try_send(self, path: str, message: bytes) -> bool:
        """One non-blocking `sendto`, from any thread: True if the message is in the peer's
        inbox, False if it could not be queued right now (full, gone, closed) - the caller then
        sends it with `send`, which waits or raises as the case may be."""
        try:
            self.check_inbox(path)
        except (MetadataError, TransportError):
            return False
        try:
            self._socket.sendto(message, path)
        except OSError:
            return False
        return True

    def fileno(self) -> int:
        return self._socket.fileno()

    def close(self) -> None:
        for path in list(self._connected):
            self._disconnect(path)
        self._socket.close()


class _Connected:
    """A socket connected to one inbox, and the wake-up its senders share while it is full."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._writable: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> bool:
        return self._writable is not None and not self._writable.done()

    def writable(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future that resolves once the inbox has room; one writer callback per socket.

        The callback removes itself as it resolves the future: removing it from the future's
        done-callback instead ran after the senders woke, and so could remove the writer
        callback of the next future, registered meanwhile by a sender that found the inbox
        full again, leaving that future (and its senders) unresolved for good."""
        if self._writable is None or self._writable.done():
            writable = self._writable = loop.create_future()
            fileno = self.socket.fileno()
            self._loop = loop

            def ready() -> None:
                loop.remove_writer(fileno)
                resolve_once(writable)

            loop.add_writer(fileno, ready)
        return self._writable

    def close(self) -> None:
        if self._writable is not None and not self._writable.done():
            if self._loop is not None:
                with contextlib.suppress(Exception):  # the loop may be closed already
                    self._loop.remove_writer(self.socket.fileno())
            self._writable.cancel()
        self.socket.close()


class DatagramNotice:
    """A completion notice for whichever thread writes a transfer's last byte (see
    `Transport.write_then`): callable from any Python thread, and also handed whole (socket,
    path, bytes) to the C copy pool, whose thread sends it without the GIL. A message that ends
    in the placeholders (`kvray.placement.PLACEHOLDER`) gets the executor's digests there, from
    either sender (`kvray.placement.filled`). `sent` says whether it went; if not, the caller sends it
    the usual way."""

    def __init__(self, outbox: CompletionOutbox, path: str, message: bytes) -> None:
        # A thread outside Python sends it: the path is checked here, before it leaves. An
        # inbox already gone (but named and placed as kvray's) is left to fail at the send, so
        # the caller's usual send reports it.
        with contextlib.suppress(TransportError):
            outbox.check_inbox(path)
        self._outbox = outbox
        self.path = path
        self.message = message
        self.sent = False

    def __call__(self, stored: Stored) -> None:
        self.sent = self._outbox.try_send(self.path, filled(self.message, stored))

    def datagram(self) -> tuple[int, bytes, bytes]:
        """(socket, peer path, message) for a sender outside Python."""
        return self._outbox.fileno(), os.fsencode(self.path), self.message


def taken() -> Receipt:
    """The receipt of a notice that needs no answer: already resolved."""
    receipt: Receipt = asyncio.get_running_loop().create_future()
    receipt.set_result(None)
    return receipt


class LocalChannel(NoticeChannel):
    """Notices to decode engines on this node, into their inboxes; this engine's own inbox (of
    its mailbox: push requests have an inbox of their own)."""

    kind = NoticeKind.LOCAL

    def __init__(
        self, settings: Settings, metrics: EngineMetrics | None = None, mailbox: Mailbox = Mailbox.COMPLETIONS
    ) -> None:
        super().__init__(settings, metrics, mailbox)
        self._outbox: CompletionOutbox | None = None
        #: This decode engine's inbox, once it listens.
        self.inbox: CompletionInbox | None = None
        self._closed = False

    def outbox(self) -> CompletionOutbox:
        if self._closed:
            # A task that outlived its agent sends nothing, and opens no socket nobody closes.
            raise TransportError("this agent's notice channels are closed")
        if self._outbox is None:
            self._outbox = CompletionOutbox(self.settings.shm_dir)
        return self._outbox

    def inbox_of(self, peer: Reachable) -> str | None:
        """The peer's inbox, when it is on this node."""
        inbox = peer.info.endpoints.get(ENDPOINTS[self.mailbox])
        return inbox if inbox and peer.info.node_id == self.node_id else None

    def reaches(self, peer: Reachable) -> bool:
        return self.inbox_of(peer) is not None

    async def send(self, peer: Reachable, notice: Mail, message: bytes) -> bool:
        inbox = self.inbox_of(peer)
        if inbox is None:
            return False
        try:
            await self.outbox().send(inbox, message)
        except TransportError as error:
            raise TransportError(
                f"could not notify engine {peer.info.engine_id!r}: {error}",
                engine_id=peer.info.engine_id,
                path=inbox,
            ) from error
        return True

    def send_now(self, peer: Reachable, notice: Mail, message: bytes) -> Receipt | None:
        inbox = self.inbox_of(peer)
        if inbox is None or self._closed or not self.outbox().send_now(inbox, message):
            return None
        return taken()

    def sender(self, peer: Reachable) -> QuickSend | None:
        inbox = self.inbox_of(peer)
        return None if inbox is None or self._closed else self.outbox().sender(inbox)

    def listening(self, peer: Reachable) -> bool | None:
        inbox = self.inbox_of(peer)
        return None if inbox is None or self._closed else self.outbox().listening(inbox)

    def early(self, peer: Reachable, message: bytes) -> DatagramNotice | None:
        inbox = self.inbox_of(peer)
        return None if inbox is None or self._closed else DatagramNotice(self.outbox(), inbox, message)

    async def listen(self, receiver: NoticeReceiver) -> None:
        self.inbox = CompletionInbox(self.settings.shm_dir, receiver.receive)

    def publish(self) -> dict[str, str]:
        return {} if self.inbox is None else {ENDPOINTS[self.mailbox]: self.inbox.path}

    def close(self) -> None:
        self._closed = True
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None
