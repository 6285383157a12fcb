"""A writer on another node (`verbs`, on the FAKE RDMA device) claims a request before its
first one-sided write: a decode engine that no longer expects the request refuses the claim,
so nothing is written and the push fails at the writer; a claimed request's blocks are kept
until the writer's notice arrives (or the writer has left the directory)."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
from test_verbs_agents import two_agents

from kvray.agent import KVAgent
from kvray.errors import NotExpectedError, WireDecodeError
from kvray.wire import TransferFailed, TransportKind, WriteClaim, encode


def _allocation(agent: KVAgent) -> np.ndarray:
    region = agent.backing.regions[0]
    assert region.allocation is not None
    return region.allocation.numpy()


async def test_a_push_after_release_is_refused_before_any_rdma_write() -> None:
    prefill, decode, _ = await two_agents()
    try:
        reservation = decode.expect("r", [10, 11])
        await decode.release("r")
        before = _allocation(decode).copy()
        with pytest.raises(NotExpectedError):
            await prefill.push(reservation, [1, 2])
        np.testing.assert_array_equal(_allocation(decode), before)
        assert decode.stats["claims_refused"] == 1
        # A live request over the same path lands.
        live = decode.expect("s", [12, 13])
        waiting = asyncio.ensure_future(decode.wait_for_kv("s", timeout=10))
        result = await prefill.push(live, [1, 2])
        assert result.transport is TransportKind.VERBS
        await waiting
        await decode.release("s")
    finally:
        await prefill.close()
        await decode.close()


async def test_release_keeps_a_claimed_request_until_the_writer_notice() -> None:
    prefill, decode, _ = await two_agents()
    try:
        reservation = decode.expect("r", [3])
        claim = WriteClaim(
            request_id="r",
            token=reservation.token,
            src_engine=prefill.engine_id,
            src_incarnation=prefill.incarnation,
            dst_engine=decode.engine_id,
            dst_incarnation=decode.incarnation,
        )
        with pytest.raises(NotExpectedError):
            await decode.claim(encode(msgspec.structs.replace(claim, token=reservation.token ^ 1)))
        with pytest.raises(WireDecodeError):
            await decode.claim(b"\x93not a claim")
        await decode.claim(encode(claim))
        releasing = asyncio.ensure_future(decode.release("r"))
        await asyncio.sleep(0.1)
        assert not releasing.done(), "released a request whose writer may still write"
        failed = TransferFailed(
            transfer_id="t",
            request_id="r",
            src_engine=prefill.engine_id,
            src_incarnation=prefill.incarnation,
            dst_engine=decode.engine_id,
            dst_incarnation=decode.incarnation,
            reason="gave up",
            token=reservation.token,
        )
        # Over Ray (another node) the notice is strict: the writer hears the request has ended,
        # and its claim ends too.
        with pytest.raises(NotExpectedError):
            await decode.notify(encode(failed))
        await asyncio.wait_for(releasing, 2.0)
    finally:
        await prefill.close()
        await decode.close()
