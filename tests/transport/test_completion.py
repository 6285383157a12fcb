"""Same-node completion notices on both event loops Ray may give an async actor: asyncio's own,
and uvloop (which Ray uses whenever it is installed, e.g. by ray[serve])."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kvray.completion import CompletionInbox, CompletionOutbox
from kvray.errors import TransportError


def _loops() -> list[Any]:
    params: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        params.append(pytest.param(None, id="uvloop", marks=pytest.mark.skip(reason="uvloop not installed")))
    else:
        params.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return params


def _run(new_loop: Callable[[], asyncio.AbstractEventLoop], main: Coroutine[Any, Any, None]) -> None:
    loop = new_loop()
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()


@pytest.mark.parametrize("new_loop", _loops())
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
        outbox = CompletionOutbox()
        try:
            async with asyncio.timeout(30):
                await asyncio.gather(*(outbox.send(inbox.path, b"notice-%d" % i) for i in range(count)))
                await done.wait()
        finally:
            outbox.close()
            inbox.close()

    _run(new_loop, main())
    assert sorted(received) == sorted(b"notice-%d" % i for i in range(count))


@pytest.mark.parametrize("new_loop", _loops())
def test_a_closed_inbox_is_a_transport_error(
    new_loop: Callable[[], asyncio.AbstractEventLoop], tmp_path: Any
) -> None:
    async def main() -> None:
        inbox = CompletionInbox(str(tmp_path), lambda message: None)
        path = inbox.path
        inbox.close()
        assert not os.path.exists(path)
        outbox = CompletionOutbox()
        try:
            with pytest.raises(TransportError, match="is gone"):
                async with asyncio.timeout(10):
                    await outbox.send(path, b"late")
        finally:
            outbox.close()

    _run(new_loop, main())
