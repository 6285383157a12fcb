"""An engine's two mailboxes (`kvray.notice.base.Mailbox`): the channels of one serve completions,
those of the other push requests, each through endpoints of its own, so a message for one never
lands in the other; the host call of each is its row of the peer-call table."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvray.config import Settings
from kvray.errors import NotExpectedError, TransportError, TransportUnavailableError
from kvray.host.calls import PeerCall
from kvray.metrics import DropReason
from kvray.notice import NoticeSet
from kvray.notice.actor import ActorChannel
from kvray.notice.base import Mailbox
from kvray.notice.local import ENDPOINT, PUSH_ENDPOINT, LocalChannel
from kvray.notice.loopback import LoopbackChannel
from kvray.notice.tcp import ADDRESS_ENDPOINT, PUSH_ADDRESS_ENDPOINT, PUSH_KEY_ENDPOINT, TcpChannel
from kvray.wire import MAX_NOTICE_BYTES, PushWithdrawn, decode_push_message, encode


class Receiver:
    """A prefill engine's push-request end (`NoticeReceiver`), recording what it took."""

    engine_id = "p"
    incarnation = 7
    node_address: str | None = "127.0.0.1"

    def __init__(self) -> None:
        self.taken: list[bytes] = []

    def receive(self, message: bytes, /) -> DropReason | None:
        self.taken.append(message)
        return None


@dataclass(frozen=True)
class Published:
    """What a prefill engine published, as a channel reads it (`PeerAddress`)."""

    endpoints: dict[str, str]
    node_id: str = "node-a"
    engine_id: str = "p"
    incarnation: int = 7


@dataclass(frozen=True)
class Prefill:
    """A prefill engine as a channel sees it (`Reachable`)."""

    info: Published
    host: Any = None


def peer(endpoints: dict[str, str], node_id: str = "node-a", host: Any = None) -> Prefill:
    return Prefill(Published(endpoints, node_id), host)


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5.0
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


WITHDRAWN = PushWithdrawn(request_id="h-1", src_engine="p", src_incarnation=7)


async def test_each_mailbox_publishes_its_inbox_under_its_own_key(tmp_path: Path) -> None:
    settings = Settings(shm_dir=str(tmp_path))
    completions = LocalChannel(settings)
    pushes = LocalChannel(settings, mailbox=Mailbox.PUSH_REQUESTS)
    completions.node_id = pushes.node_id = "node-a"
    receiver = Receiver()
    try:
        await pushes.listen(receiver)
        published = pushes.publish()
        assert list(published) == [PUSH_ENDPOINT]
        prefill = peer(published)
        # Only the push-request channel reaches an inbox published for push requests.
        assert pushes.reaches(prefill) and not completions.reaches(prefill)
        assert not pushes.reaches(peer({ENDPOINT: published[PUSH_ENDPOINT]}))
        assert await pushes.send(prefill, WITHDRAWN, encode(WITHDRAWN))
        await until(lambda: bool(receiver.taken))
        assert decode_push_message(receiver.taken[0]) == WITHDRAWN
        assert pushes.listening(prefill) is True
    finally:
        completions.close()
        pushes.close()
    # Closed: its inbox has no reader, and nothing sends through it any more.
    assert pushes.listening(prefill) is None
    with pytest.raises(TransportError):
        await pushes.send(prefill, WITHDRAWN, encode(WITHDRAWN))


async def test_a_push_request_listener_is_published_under_its_own_keys(tmp_path: Path) -> None:
    settings = Settings(shm_dir=str(tmp_path), notice_host="127.0.0.1")
    pushes = TcpChannel(settings, mailbox=Mailbox.PUSH_REQUESTS)
    receiver = Receiver()
    try:
        await pushes.listen(receiver)
        published = pushes.publish()
        assert set(published) == {PUSH_ADDRESS_ENDPOINT, PUSH_KEY_ENDPOINT}
        assert ADDRESS_ENDPOINT not in published
        assert not TcpChannel(settings).reaches(peer(published))
        writer = TcpChannel(settings, mailbox=Mailbox.PUSH_REQUESTS)
        try:
            assert await writer.send(peer(published, node_id="node-b"), WITHDRAWN, encode(WITHDRAWN))
        finally:
            writer.close()
        await until(lambda: bool(receiver.taken))
        assert [decode_push_message(message) for message in receiver.taken] == [WITHDRAWN]
        # Longer than a listener reads (a push request for a long prompt): left to the next
        # channel, sent nothing, the connection kept.
        writer = TcpChannel(settings, mailbox=Mailbox.PUSH_REQUESTS)
        try:
            too_long = b"x" * (MAX_NOTICE_BYTES + 1)
            assert not await writer.send(peer(published, node_id="node-b"), WITHDRAWN, too_long)
            assert writer.send_now(peer(published, node_id="node-b"), WITHDRAWN, too_long) is None
        finally:
            writer.close()
        assert len(receiver.taken) == 1
    finally:
        pushes.close()


async def test_a_fixed_port_the_completion_listener_took_leaves_push_requests_to_the_host(
    tmp_path: Path,
) -> None:
    settings = Settings(shm_dir=str(tmp_path), notice_host="127.0.0.1")
    completions = TcpChannel(settings)
    await completions.listen(Receiver())
    try:
        assert completions.listener is not None
        port = int(completions.listener.address.rpartition(":")[2])
        fixed = Settings(shm_dir=str(tmp_path), notice_host="127.0.0.1", notice_port=port)
        pushes = TcpChannel(fixed, mailbox=Mailbox.PUSH_REQUESTS)
        await pushes.listen(Receiver())
        assert pushes.publish() == {}
        with pytest.raises(TransportUnavailableError):
            await TcpChannel(fixed).listen(Receiver())
    finally:
        completions.close()


class Host:
    """A stand-in for an agent's actor that refuses every push request, as an engine that takes
    none does."""

    def __init__(self) -> None:
        self.calls: list[str] = []

        class Refusing:
            @staticmethod
            async def remote(message: bytes) -> None:
                self.calls.append(PeerCall.REQUEST_PUSH.host_method)
                raise NotExpectedError("engine 'p' takes no push requests", engine_id="p")

        setattr(self, PeerCall.REQUEST_PUSH.host_method, Refusing)


async def test_a_push_request_to_a_host_is_its_peer_call_and_its_refusal_comes_back() -> None:
    host = Host()
    channel = ActorChannel(Settings(), mailbox=Mailbox.PUSH_REQUESTS)
    with pytest.raises(NotExpectedError, match="takes no push requests"):
        await channel.send(peer({}, host=host), WITHDRAWN, encode(WITHDRAWN))
    assert host.calls == ["kvray_request_push"]


def test_a_set_takes_only_channels_of_its_mailbox() -> None:
    with pytest.raises(TransportUnavailableError, match="serves another one"):
        NoticeSet(Settings(), injected=[LoopbackChannel()], mailbox=Mailbox.PUSH_REQUESTS)
    pushes = NoticeSet(Settings(), mailbox=Mailbox.PUSH_REQUESTS)
    assert {channel.mailbox for channel in pushes.channels} == {Mailbox.PUSH_REQUESTS}
    pushes.close()
