"""The stand-in actor of a forwarded agent (`ForwardingHost`) as a plain object, no Ray: it
takes and answers forwarded calls for its owner alone, within a bounded queue, and forwards
every peer call of the table, answers and errors included, to the process that owns it."""

from __future__ import annotations

import asyncio
import re

import msgspec
import numpy as np
import pytest

from kvray.config import Settings
from kvray.errors import BackpressureError, KvrayError, TransferTimeoutError, WireDecodeError
from kvray.host import PeerCall
from kvray.host.forwarded import ForwardingHost

SETTINGS = Settings(notify_timeout_s=5.0, transfer_timeout_s=15.0)
OWNER = b"o" * 32


async def test_host_takes_and_answers_for_its_owner_alone_within_a_bounded_queue() -> None:
    """Another token can neither take nor answer a forwarded call; call ids are random; a call
    whose caller gave up leaves the queue; past the bound, a forwarded call is refused at once."""
    settings = msgspec.structs.replace(SETTINGS, notify_timeout_s=0.05, max_queued_transfers=2)
    stranger = b"s" * 32
    host = ForwardingHost(settings, OWNER)

    # The caller gives up before anyone takes its call: the call is gone, not served late.
    with pytest.raises(TransferTimeoutError):
        await host.kvray_notify(b"first")
    assert await host.take(OWNER, 0.01) == []

    pending = [asyncio.ensure_future(host.kvray_notify(message)) for message in (b"a", b"b")]
    await asyncio.sleep(0)
    with pytest.raises(BackpressureError):
        await host.kvray_notify(b"over the bound")
    for token in (stranger, b"", None):
        with pytest.raises(KvrayError, match="owns this host"):
            await host.take(token, 0.01)  # type: ignore[arg-type]
    calls = await host.take(OWNER, 1.0)
    assert [args for _, _, args in calls] == [(b"a",), (b"b",)]
    ids = [call_id for call_id, _, _ in calls]
    assert all(re.fullmatch("[0-9a-f]{32}", call_id) for call_id in ids) and ids[0] != ids[1]
    with pytest.raises(KvrayError, match="owns this host"):
        await host.answer(stranger, ids[0], None, None)
    assert not pending[0].done()
    await host.answer(OWNER, ids[0], None, None)
    await host.answer(OWNER, ids[1], None, WireDecodeError("bad notice"))
    assert await pending[0] is None
    with pytest.raises(WireDecodeError):
        await pending[1]


@pytest.mark.parametrize("call", list(PeerCall), ids=lambda call: call.name)
async def test_host_forwards_every_peer_call_with_its_arguments_and_answer(call: PeerCall) -> None:
    """Each entry point queues its own call with the arguments as given, and the owner's answer
    (a writer's RDMA queue pair, the bytes written, ...) goes back to the caller."""
    host = ForwardingHost(SETTINGS, OWNER)
    args = tuple(b"message" if kind is bytes else np.arange(8, dtype=np.uint8) for _, kind in call.arguments)
    calling = asyncio.ensure_future(getattr(host, call.host_method)(*args))
    ((call_id, taken, taken_args),) = await host.take(OWNER, 1.0)
    assert taken is call
    assert len(taken_args) == len(args)
    assert all(a is b for a, b in zip(taken_args, args, strict=True))
    await host.answer(OWNER, call_id, "the answer", None)
    assert await calling == "the answer"


async def test_a_write_waits_for_the_transfer_deadline_and_a_notice_for_the_notice_deadline() -> None:
    """A write carries its payload, so it may wait as long as a transfer; every other call is a
    control message and gives up at the notice deadline."""
    settings = msgspec.structs.replace(SETTINGS, notify_timeout_s=0.05, transfer_timeout_s=30.0)
    host = ForwardingHost(settings, OWNER)
    with pytest.raises(TransferTimeoutError, match=r"kvray_connect call within 0\.05 s"):
        await host.kvray_connect(b"request")
    delivering = asyncio.ensure_future(host.kvray_deliver(b"header", np.zeros(4, np.uint8)))
    await asyncio.sleep(0.2)
    assert not delivering.done()
    ((call_id, call, _),) = await host.take(OWNER, 1.0)
    assert call is PeerCall.DELIVER
    await host.answer(OWNER, call_id, 4, None)
    assert await delivering == 4
