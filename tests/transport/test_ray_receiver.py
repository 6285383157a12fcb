"""The ray transport's receiving half: `apply_write` runs in the decode engine's actor on bytes a
peer sent, so it trusts nothing in them. Every op must lie inside a region of this engine
incarnation and the payload must hold exactly the ops' bytes; otherwise a kvray error, and not
a byte written. The header is a msgspec struct, never unpickled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import ray

from kvray.config import Settings
from kvray.errors import (
    BoundsError,
    KvrayError,
    StaleIncarnationError,
    TransportError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.layout import BlockOrder, mixed
from kvray.transport import ray as ray_transport
from kvray.transport.base import Peer
from kvray.transport.ray import apply_write
from kvray.wire import EngineInfo, TransferDone, WriteOps, encode

if TYPE_CHECKING:
    from conftest import CopyGuard, Engine, TransportUnderTest

LAYOUT = mixed(num_blocks=16, block_order=BlockOrder.LAYER_MAJOR)


def header(
    destination: Engine, regions: list[int], offsets: list[int], nbytes: list[int], **changes: Any
) -> bytes:
    fields: dict[str, Any] = {
        "transfer_id": "prefill-0:1:w1",
        "dst_engine": destination.engine_id,
        "dst_incarnation": destination.incarnation,
        "regions": regions,
        "remote_offsets": offsets,
        "nbytes": nbytes,
    }
    fields.update(changes)
    return encode(WriteOps(**fields))


def payload_of(size: int, rng: np.random.Generator) -> np.ndarray:
    return np.frombuffer(rng.bytes(size), dtype=np.uint8).copy()


async def test_valid_write_lands_exactly(ray_side: TransportUnderTest, guard: CopyGuard) -> None:
    destination = ray_side.destination(LAYOUT)
    length = destination.info.regions[0].length
    offsets, sizes = [length - 100, 0, 4096], [100, 1, 3000]
    payload = payload_of(sum(sizes), ray_side.rng)
    before = ray_side.snapshot(destination)

    written = await apply_write(
        destination.backing,
        "decode-0",
        destination.incarnation,
        header(destination, [0, 0, 0], offsets, sizes),
        payload,
    )

    assert written == sum(sizes)
    region_start = destination.backing.regions[0].span.offset_in_allocation
    expected = before[0].copy()
    cursor = 0
    for offset, size in zip(offsets, sizes, strict=True):
        expected[region_start + offset : region_start + offset + size] = payload[cursor : cursor + size]
        cursor += size
    assert np.array_equal(ray_side.allocation(destination), expected)
    assert guard.refused == []


#: (regions, offsets, nbytes, payload size or None for sum(nbytes), header changes) -> error
Case = tuple[
    Callable[[int], tuple[list[int], list[int], list[int], int | None, dict[str, Any]]], type[KvrayError]
]

CASES: dict[str, Case] = {
    "one-byte-past-end": (lambda n: ([0], [n - 99], [100], None, {}), BoundsError),
    "wholly-past-end": (lambda n: ([0], [n], [64], None, {}), BoundsError),
    "negative-offset": (lambda n: ([0], [-64], [128], None, {}), WireDecodeError),
    "zero-nbytes": (lambda n: ([0, 0], [0, 64], [64, 0], None, {}), BoundsError),
    "negative-nbytes": (lambda n: ([0, 0], [0, 4096], [128, -64], 64, {}), WireDecodeError),
    "region-past-last": (lambda n: ([0, 1], [0, 0], [64, 64], None, {}), BoundsError),
    "region-negative": (lambda n: ([0, -1], [0, 0], [64, 64], None, {}), WireDecodeError),
    "good-op-then-bad-op": (lambda n: ([0, 0], [0, n - 10], [4096, 64], None, {}), BoundsError),
    "payload-one-byte-short": (lambda n: ([0], [0], [4096], 4095, {}), BoundsError),
    "payload-one-byte-long": (lambda n: ([0], [0], [4096], 4097, {}), BoundsError),
    "columns-of-different-lengths": (lambda n: ([0, 0], [0], [64], 64, {}), WireDecodeError),
    "other-engine": (lambda n: ([0], [0], [64], None, {"dst_engine": "decode-1"}), StaleIncarnationError),
    "old-incarnation": (lambda n: ([0], [0], [64], None, {"dst_incarnation": 1}), StaleIncarnationError),
    # offset + nbytes wraps around int64 to a negative number.
    # Sizes past 2**62 never decode: refused as malformed before any array is built.
    "offset-overflow": (lambda n: ([0], [2**63 - 8], [64], None, {}), WireDecodeError),
    # The nbytes sum wraps around int64 to the payload's size, and each offset + nbytes wraps too.
    "nbytes-overflow": (
        lambda n: ([0, 0, 0], [16, 16, 0], [2**63 - 1, 2**63 - 1, 66], 64, {}),
        WireDecodeError,
    ),
    "offset-past-int64": (lambda n: ([0], [2**64 - 8], [64], None, {}), WireDecodeError),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_bad_write_is_refused_and_writes_nothing(
    ray_side: TransportUnderTest, guard: CopyGuard, case: str, request: pytest.FixtureRequest
) -> None:
    destination = ray_side.destination(LAYOUT)
    make, error = CASES[case]
    regions, offsets, nbytes, payload_size, changes = make(destination.info.regions[0].length)
    payload = payload_of(sum(nbytes) if payload_size is None else payload_size, ray_side.rng)
    data = header(destination, regions, offsets, nbytes, **changes)
    before = ray_side.snapshot(destination)

    with pytest.raises(error):
        await apply_write(destination.backing, "decode-0", destination.incarnation, data, payload)

    ray_side.assert_unchanged(destination, before)
    assert guard.refused == []


class Trap:
    """Unpickling this sets `sprung`: a receiver that unpickles a peer's bytes would spring it."""

    sprung = False

    def __reduce__(self) -> tuple[Any, ...]:
        return (_spring, ())


def _spring() -> None:
    Trap.sprung = True


def _engine_info_bytes(destination: Engine) -> bytes:
    info: EngineInfo = destination.info
    return encode(info)


MALFORMED: dict[str, Callable[[Engine], bytes]] = {
    "garbage": lambda destination: b"\xc1not msgpack at all",
    "empty": lambda destination: b"",
    "truncated": lambda destination: header(destination, [0], [0], [64])[:-5],
    "pickle": lambda destination: pickle.dumps(Trap()),
    "other-message": lambda destination: encode(
        TransferDone(
            transfer_id="t",
            request_id="r",
            src_engine="prefill-0",
            src_incarnation=1,
            dst_engine=destination.engine_id,
            dst_incarnation=destination.incarnation,
            nbytes=64,
        )
    ),
    "engine-info": _engine_info_bytes,
    "wrong-field-type": lambda destination: header(destination, [0], ["0"], [64]),  # type: ignore[list-item]
}


@pytest.mark.parametrize("malformed", list(MALFORMED))
async def test_malformed_header_is_refused_and_writes_nothing(
    ray_side: TransportUnderTest, guard: CopyGuard, malformed: str
) -> None:
    destination = ray_side.destination(LAYOUT)
    data = MALFORMED[malformed](destination)
    before = ray_side.snapshot(destination)
    Trap.sprung = False

    with pytest.raises(WireDecodeError):
        await apply_write(
            destination.backing, "decode-0", destination.incarnation, data, payload_of(64, ray_side.rng)
        )

    assert not Trap.sprung
    ray_side.assert_unchanged(destination, before)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(np.zeros(16, dtype=np.float32), id="float32"),
        pytest.param(np.zeros((8, 8), dtype=np.uint8), id="two-dimensional"),
        pytest.param(np.zeros(128, dtype=np.uint8)[::2], id="strided"),
    ],
)
async def test_payload_of_the_wrong_shape_is_refused(
    ray_side: TransportUnderTest, guard: CopyGuard, payload: np.ndarray
) -> None:
    destination = ray_side.destination(LAYOUT)
    before = ray_side.snapshot(destination)

    with pytest.raises(WireDecodeError):
        await apply_write(
            destination.backing,
            "decode-0",
            destination.incarnation,
            header(destination, [0], [0], [64]),
            payload,
        )

    ray_side.assert_unchanged(destination, before)


# ---- the sending half, as the receiver's errors reach it --------------------------------------------


async def test_receiver_errors_reach_the_writer_as_kvray_errors(ray_side: TransportUnderTest) -> None:
    """Through the LocalHost, errors cross back as Ray delivers them (a RayTaskError that is also
    its cause); the writer raises the kvray error itself."""
    source = ray_side.source(LAYOUT)
    old = ray_side.destination(LAYOUT)
    restarted = ray_side.destination(LAYOUT)  # what the actor now hosts
    local, remote = ray_side.scattered(16, 4)
    plan = ray_side.plan(source, old, local, remote)
    before = ray_side.snapshot(restarted)
    peer = ray_side.peer(restarted, info=old.info)

    with pytest.raises(StaleIncarnationError) as raised:
        await ray_side.transport.write(plan, source.backing, peer)

    assert type(raised.value) is StaleIncarnationError
    assert raised.value.stale_incarnation == old.incarnation
    assert peer.host.deliveries == 1
    ray_side.assert_unchanged(restarted, before)


async def test_undeliverable_payload_is_a_write_failure(ray_side: TransportUnderTest) -> None:
    source = ray_side.source(LAYOUT)
    destination = ray_side.destination(LAYOUT)
    local, remote = ray_side.scattered(16, 4)
    plan = ray_side.plan(source, destination, local, remote)

    class DeadHost:
        class kvray_deliver:
            @staticmethod
            async def remote(header: bytes, payload: np.ndarray) -> int:
                raise ConnectionError("actor died")

    with pytest.raises(WriteFailedError, match="actor died"):
        await ray_side.transport.write(plan, source.backing, Peer(destination.info, host=DeadHost()))


async def test_peer_without_an_actor_is_refused(ray_side: TransportUnderTest) -> None:
    source = ray_side.source(LAYOUT)
    destination = ray_side.destination(LAYOUT)
    local, remote = ray_side.scattered(16, 4)
    plan = ray_side.plan(source, destination, local, remote)
    before = ray_side.snapshot(destination)

    with pytest.raises(TransportError, match="Ray actor"):
        await ray_side.transport.write(plan, source.backing, Peer(destination.info, host=None))

    ray_side.assert_unchanged(destination, before)


class _ParkedDelivery:
    """Stands in for the ObjectRef of a delivery parked at a stalled peer: it ends only when a
    cancel gets through, and Ray loses the first `lost` cancels (as it does for a cancel that
    reaches the peer before the call's coroutine has started)."""

    def __init__(self, lost: int) -> None:
        self.lost = lost
        self.cancels = 0
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future[None]:
        return self._future

    def cancel(self) -> None:
        self.cancels += 1
        if self.cancels > self.lost:
            self._future.cancel()


async def test_a_lost_cancel_is_sent_again_until_the_delivery_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_transport, "CANCEL_RETRY_S", 0.01)
    monkeypatch.setattr(ray_transport, "_cancel", lambda delivery: delivery.cancel())
    monkeypatch.setattr(ray, "ObjectRef", _ParkedDelivery)
    transport = ray_transport.RayTransport(Settings())
    stubborn, ends_at_third = _ParkedDelivery(lost=10**9), _ParkedDelivery(lost=2)
    transport._abandon(ends_at_third)  # type: ignore[arg-type]
    transport._abandon(stubborn)  # type: ignore[arg-type]
    for _ in range(500):
        if ends_at_third.future().done() and stubborn.cancels > 5:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert ends_at_third.cancels == 3, "cancelled again after it ended, or never got through"
    assert ends_at_third not in transport._abandoned
    assert stubborn in transport._abandoned
    await transport.close()
    settled = stubborn.cancels
    await asyncio.sleep(0.05)
    assert stubborn.cancels == settled, "close() left the canceller running"
