"""Same-node completion notices on both event loops Ray may give an async actor: asyncio's own,
and uvloop (which Ray uses whenever it is installed, e.g. by ray[serve])."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from event_loops import loop_params, run_on

from kvray.errors import MetadataError, TransportError
from kvray.notice.local import CompletionInbox, CompletionOutbox, DatagramNotice
from kvray.owned import INBOX_NAME


@pytest.mark.parametrize("new_loop", loop_params())
def test_every_notice_arrives_through_a_full_inbox(
    new_loop: Callable[[], asyncio.AbstractEventLoop], tmp_path: Any
) -> None:
    # More concurrent notices than an inbox queues (net.unix.max_dgram_qlen, 10 by default):
    # senders wait for room instead of failing or dropping.
    count = 300
    received: list[bytes] = []

    async def main() -> None:
        done = asyncio.Event()

        def handler(message: bytes) -> None:
            received.append(message)
            if len(received) == count:
                done.set()

        inbox = CompletionInbox(str(tmp_path), handler)
        outbox = CompletionOutbox(str(tmp_path))
        try:
            async with asyncio.timeout(30):
                await asyncio.gather(*(outbox.send(inbox.path, b"notice-%d" % i) for i in range(count)))
                await done.wait()
        finally:
            outbox.close()
            inbox.close()

    run_on(new_loop, main())
    assert sorted(received) == sorted(b"notice-%d" % i for i in range(count))


@pytest.mark.parametrize("new_loop", loop_params())
def test_a_sender_waits_for_a_full_inbox_without_spinning(
    new_loop: Callable[[], asyncio.AbstractEventLoop], tmp_path: Any
) -> None:
    # While nobody reads a full inbox, a waiting sender sleeps (it must not take a core from
    # the engine that should drain it); once the inbox is read, every message goes.
    count = 40
    received: list[bytes] = []

    async def main() -> None:
        inbox = CompletionInbox(str(tmp_path), received.append)
        loop = asyncio.get_running_loop()
        loop.remove_reader(inbox.fileno())  # nobody reads for now
        outbox = CompletionOutbox(str(tmp_path))
        try:
            sending = asyncio.gather(*(outbox.send(inbox.path, b"m-%d" % i) for i in range(count)))
            cpu = time.process_time()
            await asyncio.sleep(1.0)
            assert not sending.done()
            assert time.process_time() - cpu < 0.5, "the waiting senders spun"
            loop.add_reader(inbox.fileno(), inbox.drain)
            async with asyncio.timeout(30):
                await sending
                while len(received) < count:
                    await asyncio.sleep(0.01)
        finally:
            outbox.close()
            inbox.close()

    run_on(new_loop, main())
    assert sorted(received) == sorted(b"m-%d" % i for i in range(count))


@pytest.mark.parametrize("new_loop", loop_params())
def test_a_closed_inbox_is_a_transport_error(
    new_loop: Callable[[], asyncio.AbstractEventLoop], tmp_path: Any
) -> None:
    async def main() -> None:
        inbox = CompletionInbox(str(tmp_path), lambda message: None)
        path = inbox.path
        inbox.close()
        assert not os.path.exists(path)
        outbox = CompletionOutbox(str(tmp_path))
        try:
            with pytest.raises(TransportError, match="is gone"):
                async with asyncio.timeout(10):
                    await outbox.send(path, b"late")
        finally:
            outbox.close()

    run_on(new_loop, main())


# ---- a published inbox path is only a claim -----------------------------------------------------


def _bound_socket(path: Path) -> socket.socket:
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.setblocking(False)
    return receiver


def _assert_nothing_arrived(receiver: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        receiver.recv(64)


def _forged_paths(tmp_path: Path) -> tuple[Path, list[tuple[str, Path]]]:
    """A folder the outbox trusts, and (why, path) for sockets outside it or not made by kvray."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    elsewhere = tmp_path / f"kvray-{os.getpid()}-{secrets.token_hex(4)}"
    elsewhere.mkdir()
    wrong_name = shm_dir / "not-kvray"
    wrong_name.mkdir()
    # A kvray-named folder in the trusted folder that is a link to a folder elsewhere.
    linked = shm_dir / f"kvray-{os.getpid()}-{secrets.token_hex(4)}"
    linked.symlink_to(elsewhere, target_is_directory=True)
    return shm_dir, [
        ("other-folder", elsewhere / INBOX_NAME),
        ("not-a-kvray-name", wrong_name / INBOX_NAME),
        ("other-socket-name", shm_dir / f"kvray-{os.getpid()}-0" / "other.sock"),
        ("linked-folder", linked / INBOX_NAME),
    ]


def test_the_outbox_sends_only_to_kvray_inboxes_in_its_folder(tmp_path: Path) -> None:
    shm_dir, forged = _forged_paths(tmp_path)
    (shm_dir / f"kvray-{os.getpid()}-0").mkdir()
    # The linked folder's socket is the other folder's: one receiver sees both.
    receivers = [_bound_socket(path) for why, path in forged if why != "linked-folder"]
    outbox = CompletionOutbox(str(shm_dir))

    async def main() -> None:
        for why, path in forged:
            with pytest.raises(MetadataError, match="kvray") as raised:
                await outbox.send(str(path), b"forged")
            assert raised.value.path == str(path), why
            assert not outbox.try_send(str(path), b"forged"), why
            assert outbox.sender(str(path)) is None, why
            with pytest.raises(MetadataError):
                DatagramNotice(outbox, str(path), b"forged")

    try:
        run_on(asyncio.new_event_loop, main())
        for receiver in receivers:
            _assert_nothing_arrived(receiver)
    finally:
        outbox.close()
        for receiver in receivers:
            receiver.close()


def test_the_outbox_still_reaches_a_real_inbox(tmp_path: Path) -> None:
    received: list[bytes] = []

    async def main() -> None:
        inbox = CompletionInbox(str(tmp_path), received.append)
        outbox = CompletionOutbox(str(tmp_path))
        try:
            assert outbox.try_send(inbox.path, b"early")
            await outbox.send(inbox.path, b"late")
            async with asyncio.timeout(10):
                while len(received) < 2:
                    await asyncio.sleep(0.01)
        finally:
            outbox.close()
            inbox.close()

    run_on(asyncio.new_event_loop, main())
    assert received == [b"early", b"late"]


def test_a_kept_sender_sends_until_its_connection_closes_then_sends_nothing(tmp_path: Path) -> None:
    """`CompletionOutbox.sender` checks the inbox and connects once; once that connection is
    closed (evicted, or the outbox closed) it sends nothing and says so, and a new sender
    connects again."""
    received: list[bytes] = []

    async def main() -> None:
        inbox = CompletionInbox(str(tmp_path), received.append)
        outbox = CompletionOutbox(str(tmp_path))
        try:
            send = outbox.sender(inbox.path)
            assert send is not None
            assert send(b"one") and send(b"two")
            outbox._disconnect(inbox.path)  # as an eviction does
            assert not send(b"lost")
            again = outbox.sender(inbox.path)
            assert again is not None and again(b"three")
            async with asyncio.timeout(10):
                while len(received) < 3:
                    await asyncio.sleep(0.01)
            outbox.close()
            assert not again(b"closed")
        finally:
            outbox.close()
            inbox.close()

    run_on(asyncio.new_event_loop, main())
    assert received == [b"one", b"two", b"three"]


# ---- a decode agent meets a notice nested deeper than Python recurses ---------------------------


async def test_a_deeply_nested_notice_is_counted_as_malformed(tmp_path: Path) -> None:
    from kvray.agent import KVAgent
    from kvray.config import Settings
    from kvray.errors import WireDecodeError
    from kvray.layout import Geometry, KVLayout, LayerSpec
    from kvray.wire import Role, TransferFailed, encode

    layout = KVLayout(
        layers=(LayerSpec(name="kv", geometry=Geometry(block_size=1, entry_shape=(64,), dtype="uint8")),),
        num_blocks=4,
    )
    settings = Settings(shm_dir=str(tmp_path), transport="shm")
    decode = KVAgent("d", Role.DECODE, layout, settings=settings, use_coordinator=False)
    await decode.start()
    try:
        valid = encode(
            TransferFailed(
                transfer_id="t",
                request_id="r",
                src_engine="p",
                src_incarnation=1,
                dst_engine="d",
                dst_incarnation=decode.incarnation,
                reason="x",
            )
        )
        # One more field in the map: 20,000 nested one-element arrays (under the inbox's 64 KiB).
        nested = bytes([valid[0] + 1]) + valid[1:] + b"\xa7unknown" + b"\x91" * 20_000 + b"\x01"
        with pytest.raises(WireDecodeError, match="nested too deep"):
            await decode.notify(nested)  # through Ray: the sender is told
        assert decode.stats["messages_dropped_malformed"] == 1
        outbox = CompletionOutbox(str(tmp_path))
        try:
            await outbox.send(decode.info.endpoints["completion_socket"], nested)  # through the inbox
            async with asyncio.timeout(10):
                while decode.stats["messages_dropped_malformed"] < 2:
                    await asyncio.sleep(0.01)
        finally:
            outbox.close()
    finally:
        await decode.close()


class RecordingLoop:
    """The writer-callback half of an event loop, driven by hand: which callback is registered
    for which descriptor (futures come from the real loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.writers: dict[int, Callable[[], None]] = {}

    def create_future(self) -> asyncio.Future[None]:
        return self.loop.create_future()

    def add_writer(self, fileno: int, callback: Callable[..., None], *args: Any) -> None:
        self.writers[fileno] = lambda: callback(*args)

    def remove_writer(self, fileno: int) -> bool:
        return self.writers.pop(fileno, None) is not None


async def test_a_sender_that_finds_the_inbox_full_as_others_wake_is_woken_too(tmp_path: Path) -> None:
    """The inbox makes room (the writer callback resolves the senders' shared future); before
    those senders run, another finds the inbox full again and waits on a new future. That
    future must keep its writer callback: once the old future's senders have run, the socket's
    next writability still wakes it (a lost wake-up left such senders waiting for good)."""
    inbox = CompletionInbox(str(tmp_path), lambda message: None)
    outbox = CompletionOutbox(str(tmp_path))
    try:
        connected = outbox._connect(inbox.path)
        fileno = connected.socket.fileno()
        loop = RecordingLoop(asyncio.get_running_loop())
        first = connected.writable(loop)  # type: ignore[arg-type]
        loop.writers[fileno]()  # the inbox has room
        assert first.done()
        second = connected.writable(loop)  # type: ignore[arg-type]  # full again for a newcomer
        assert second is not first
        await asyncio.sleep(0)  # the first future's callbacks and senders run
        await asyncio.sleep(0)
        assert fileno in loop.writers, "the newcomer's writer callback was removed"
        loop.writers[fileno]()
        assert second.done()
        assert fileno not in loop.writers  # resolved: the callback is gone
    finally:
        inbox.close()
        outbox.close()
