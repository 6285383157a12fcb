"""Wire families are strict about what they take: a message must carry its own `type` tag, and
each family refuses, before decoding, bytes or sequences past what a real request can hold."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from kvray.errors import WireDecodeError
from kvray.layout import MAX_BLOCKS
from kvray.wire import (
    MAX_ENGINE_INFO_BYTES,
    MAX_NOTICE_BYTES,
    MAX_PUSH_REQUEST_BYTES,
    MAX_REQUEST_BLOCKS,
    MAX_WRITE_OPS,
    PushRequest,
    Reservation,
    TransferDone,
    TransferFailed,
    VerbsAccept,
    VerbsConnect,
    VerbsEndpoint,
    WriteClaim,
    WriteOps,
    decode_notice,
    decode_push_request,
    decode_verbs_handshake,
    decode_write_claim,
    decode_write_ops,
    encode,
)

RESERVATION = Reservation(request_id="d-1", engine_id="d", incarnation=5, blocks=(3, 4), token=99, slot=2)
PUSH_REQUEST = PushRequest(request_id="p-1", src_engine="p", src_incarnation=7, reservation=RESERVATION)
CLAIM = WriteClaim(
    request_id="d-1", token=99, src_engine="p", src_incarnation=7, dst_engine="d", dst_incarnation=5
)
WRITE_OPS = WriteOps(
    transfer_id="t", dst_engine="d", dst_incarnation=5, regions=[0], remote_offsets=[4096], nbytes=[64]
)
DONE = TransferDone(
    transfer_id="t",
    request_id="d-1",
    src_engine="p",
    src_incarnation=7,
    dst_engine="d",
    dst_incarnation=5,
    nbytes=64,
)
FAILED = TransferFailed(
    transfer_id="t",
    request_id="d-1",
    src_engine="p",
    src_incarnation=7,
    dst_engine="d",
    dst_incarnation=5,
    reason="gone",
)
ENDPOINT = VerbsEndpoint(device="mlx5_0", port=1, gid="fe80::1", gid_index=0, lid=0, mtu=5, link_layer=2)
CONNECT = VerbsConnect(
    src_engine="p", src_incarnation=7, dst_engine="d", dst_incarnation=5, endpoint=ENDPOINT, qp_num=1, psn=2
)
ACCEPT = VerbsAccept(dst_engine="d", dst_incarnation=5, endpoint=ENDPOINT, qp_num=3, psn=4, regions=())

#: (message, its family's decoder) for every tagged family.
FAMILIES: list[tuple[Any, Callable[[bytes], Any]]] = [
    (WRITE_OPS, decode_write_ops),
    (CLAIM, decode_write_claim),
    (PUSH_REQUEST, decode_push_request),
    (DONE, decode_notice),
    (FAILED, decode_notice),
    (CONNECT, decode_verbs_handshake),
    (ACCEPT, decode_verbs_handshake),
]
FAMILY_IDS = [type(message).__name__ for message, _ in FAMILIES]


def raw_of(value: Any) -> Any:
    return msgspec.msgpack.decode(encode(value))


def peak_bytes(action: Callable[[], object]) -> int:
    """The most memory Python held at once while `action` ran (it may raise)."""
    tracemalloc.start()
    try:
        action()
    except WireDecodeError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ---- tags ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("message", "decode"), FAMILIES, ids=FAMILY_IDS)
def test_every_family_round_trips(message: Any, decode: Callable[[bytes], Any]) -> None:
    decoded = decode(encode(message))
    assert decoded == message and type(decoded) is type(message)


@pytest.mark.parametrize(("message", "decode"), FAMILIES, ids=FAMILY_IDS)
def test_a_message_without_its_tag_is_refused(message: Any, decode: Callable[[bytes], Any]) -> None:
    raw = raw_of(message)
    del raw["type"]
    with pytest.raises(WireDecodeError) as caught:
        decode(msgspec.msgpack.encode(raw))
    assert caught.value.field == "$.type"


@pytest.mark.parametrize(("message", "decode"), FAMILIES, ids=FAMILY_IDS)
def test_a_message_under_another_familys_tag_is_refused(message: Any, decode: Callable[[bytes], Any]) -> None:
    for other, other_decode in FAMILIES:
        if other_decode is decode:
            continue
        raw = raw_of(message)
        raw["type"] = raw_of(other)["type"]
        with pytest.raises(WireDecodeError) as caught:
            decode(msgspec.msgpack.encode(raw))
        assert caught.value.field is not None and caught.value.field.startswith("$")
        # And the other family's own message, whole.
        with pytest.raises(WireDecodeError) as caught:
            decode(encode(other))
        assert caught.value.field == "$.type"


# ---- sizes --------------------------------------------------------------------------------


def push_request_of(blocks: Iterator[int] | tuple[int, ...], decode_info: bytes = b"") -> bytes:
    """An encoded push request; built untyped, so that it may break the bounds."""
    raw = raw_of(PUSH_REQUEST)
    raw["reservation"]["blocks"] = list(blocks)
    raw["decode_info"] = decode_info
    return msgspec.msgpack.encode(raw)


def test_the_largest_real_push_request_decodes() -> None:
    blocks = tuple(range(MAX_BLOCKS - MAX_REQUEST_BLOCKS, MAX_BLOCKS))
    data = push_request_of(blocks, bytes(MAX_ENGINE_INFO_BYTES))
    assert len(data) <= MAX_PUSH_REQUEST_BYTES
    request = decode_push_request(data)
    assert request.reservation.blocks == blocks


def test_a_push_request_of_too_many_blocks_is_refused_before_they_are_decoded() -> None:
    # Block ids past 256 are objects of their own in Python: decoded, these would take ~40 MB.
    data = push_request_of(range(1000, 1000 + MAX_REQUEST_BLOCKS + 1))
    assert len(data) < MAX_PUSH_REQUEST_BYTES
    with pytest.raises(WireDecodeError) as caught:
        decode_push_request(data)
    assert caught.value.field == "$.reservation.blocks"
    assert peak_bytes(lambda: decode_push_request(data)) < 1024 * 1024


def test_a_block_id_past_any_pool_is_refused() -> None:
    with pytest.raises(WireDecodeError) as caught:
        decode_push_request(push_request_of((MAX_BLOCKS,)))
    assert caught.value.field == "$.reservation.blocks[0]"


def test_an_oversized_push_request_is_refused_before_decoding() -> None:
    data = push_request_of((1, 2), bytes(MAX_PUSH_REQUEST_BYTES))
    with pytest.raises(WireDecodeError, match="larger than") as caught:
        decode_push_request(data)
    assert caught.value.nbytes == len(data)
    assert peak_bytes(lambda: decode_push_request(data)) < 1024 * 1024


@pytest.mark.parametrize(
    ("message", "decode"),
    [(CLAIM, decode_write_claim), (DONE, decode_notice), (FAILED, decode_notice)],
    ids=["claim", "done", "failed"],
)
def test_claims_and_notices_are_small(message: Any, decode: Callable[[bytes], Any]) -> None:
    raw = raw_of(message)
    raw["request_id"] = "r" * MAX_NOTICE_BYTES
    data = msgspec.msgpack.encode(raw)
    with pytest.raises(WireDecodeError, match="larger than"):
        decode(data)
    assert peak_bytes(lambda: decode(data)) < 1024 * 1024


@pytest.mark.parametrize("column", ["regions", "remote_offsets", "nbytes"])
def test_a_write_of_too_many_ops_is_refused_before_they_are_decoded(column: str) -> None:
    raw = raw_of(WRITE_OPS)
    raw[column] = [0] * (MAX_WRITE_OPS + 1)
    data = msgspec.msgpack.encode(raw)
    with pytest.raises(WireDecodeError) as caught:
        decode_write_ops(data)
    assert caught.value.field == f"$.{column}"
    assert peak_bytes(lambda: decode_write_ops(data)) < 1024 * 1024
