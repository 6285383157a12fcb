"""Wire structs: exact round trips, and every malformed input is a WireDecodeError naming its field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.errors import MetadataError, WireDecodeError
from kvray.layout import READY_LAYOUTS, BlockOrder
from kvray.memory import Backing, MemoryKind
from kvray.wire import (
    EngineInfo,
    RegionDescriptor,
    Role,
    TransferDone,
    TransferFailed,
    TransportKind,
    WriteOps,
    decode_engine_info,
    decode_notice,
    decode_write_ops,
    encode,
)

MESSAGES = [
    TransferDone(
        transfer_id="t-1",
        request_id="req-1",
        src_engine="prefill-0",
        src_incarnation=3,
        dst_engine="decode-0",
        dst_incarnation=9,
        nbytes=4 * 73728,
    ),
    TransferDone(
        transfer_id="t-2",
        request_id="req-1",
        src_engine="prefill-0",
        src_incarnation=3,
        dst_engine="decode-0",
        dst_incarnation=9,
        nbytes=0,
        final=False,
    ),
    TransferFailed(
        transfer_id="t-3",
        request_id="req-2",
        src_engine="prefill-1",
        src_incarnation=1,
        dst_engine="decode-0",
        dst_incarnation=2**40,
        reason="deadline passed after 60.0 s",
    ),
    WriteOps(
        transfer_id="t-4",
        dst_engine="decode-0",
        dst_incarnation=5,
        regions=[0, 0, 1],
        remote_offsets=[0, 4096, 2**33],
        nbytes=[64, 128, 73728],
    ),
    WriteOps(transfer_id="t-5", dst_engine="d", dst_incarnation=0, regions=[], remote_offsets=[], nbytes=[]),
]

MESSAGE_TYPES = (TransferDone, TransferFailed, WriteOps)


def engine_info_for(
    name: str, kind: MemoryKind, order: BlockOrder, make_info: Callable[..., EngineInfo]
) -> EngineInfo:
    with Backing.allocate(READY_LAYOUTS[name](num_blocks=3, block_order=order), kind) as backing:
        return make_info(backing, f"{name}-decode", 12345, Role.DECODE)


@pytest.fixture(scope="module")
def small_info() -> EngineInfo:
    with Backing.allocate(READY_LAYOUTS["mixed"](num_blocks=2), MemoryKind.SHM) as backing:
        regions = backing.region_descriptors("decode-0", 7, TransportKind.SHM, remote_writable=True)
        return backing.engine_info("decode-0", 7, Role.DECODE, "node-a", regions, {"qp_num": "1234"})


def raw_of(value: Any) -> Any:
    """Untyped msgpack of an encoded struct, to corrupt one field at a time."""
    return msgspec.msgpack.decode(encode(value))


# ---- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [MemoryKind.CPU, MemoryKind.SHM])
@pytest.mark.parametrize("order", list(BlockOrder))
@pytest.mark.parametrize("name", sorted(READY_LAYOUTS))
def test_engine_info_round_trips(
    name: str, order: BlockOrder, kind: MemoryKind, make_info: Callable[..., EngineInfo]
) -> None:
    info = engine_info_for(name, kind, order, make_info)
    data = encode(info)
    assert isinstance(data, bytes)
    decoded = decode_engine_info(data)
    assert decoded == info
    assert type(decoded) is EngineInfo
    assert decoded.layout == info.layout and decoded.layout.block_order is order
    assert decoded.layout.placements() == info.placements
    assert decoded.regions[0].handle == info.regions[0].handle
    assert decoded.role is Role.DECODE
    assert decode_engine_info(bytearray(data)) == info
    assert decode_engine_info(memoryview(data)) == info


def test_engine_info_round_trip_keeps_endpoints_and_descriptor_fields(small_info: EngineInfo) -> None:
    decoded = decode_engine_info(encode(small_info))
    assert decoded.endpoints == {"qp_num": "1234"}
    (region,) = decoded.regions
    assert region == small_info.regions[0]
    assert region.handle.startswith(b"/dev/shm/kvray-")
    assert region.remote_writable is True
    assert region.transport is TransportKind.SHM


@pytest.mark.parametrize("message", MESSAGES, ids=lambda message: type(message).__name__)
def test_every_message_round_trips(message: Any) -> None:
    decode = decode_write_ops if isinstance(message, WriteOps) else decode_notice
    decoded = decode(encode(message))
    assert decoded == message
    assert type(decoded) is type(message)


def test_messages_are_tagged() -> None:
    assert raw_of(MESSAGES[0])["type"] == "done"
    assert raw_of(MESSAGES[2])["type"] == "failed"
    assert raw_of(MESSAGES[3])["type"] == "write_ops"


def test_region_descriptor_defaults_are_least_privilege() -> None:
    descriptor = RegionDescriptor(
        engine_id="e", incarnation=1, transport=TransportKind.RAY, index=0, address=0, length=4096
    )
    assert descriptor.remote_writable is False
    assert (descriptor.handle, descriptor.handle_offset, descriptor.key) == (b"", 0, 0)


# ---- malformed input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x81", b"\xff\xff\xff", encode(MESSAGES[0])[:-1], encode(MESSAGES[0]) + b"\x00"],
    ids=["empty", "reserved-byte", "truncated-map", "garbage", "truncated", "trailing"],
)
def test_malformed_bytes_raise_wire_decode_error(data: bytes) -> None:
    for decode in (decode_notice, decode_write_ops, decode_engine_info):
        with pytest.raises(WireDecodeError) as caught:
            decode(data)
        assert isinstance(caught.value, MetadataError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize("data", ["a string", None, 42, [1, 2], {"type": "done"}])
def test_non_bytes_raise_wire_decode_error(data: Any) -> None:
    for decode in (decode_notice, decode_write_ops, decode_engine_info):
        with pytest.raises(WireDecodeError, match="bytes"):
            decode(data)


def test_wrong_field_type_names_the_field(small_info: EngineInfo) -> None:
    raw = raw_of(small_info)
    raw["incarnation"] = "seven"
    with pytest.raises(WireDecodeError) as caught:
        decode_engine_info(msgspec.msgpack.encode(raw))
    assert caught.value.field == "$.incarnation"
    assert "$.incarnation" in str(caught.value)


@pytest.mark.parametrize(
    ("corrupt", "field"),
    [
        (lambda raw: raw["regions"][0].__setitem__("length", "big"), "$.regions[0].length"),
        (lambda raw: raw["regions"][0].__setitem__("transport", "carrier-pigeon"), "$.regions[0].transport"),
        (lambda raw: raw.__setitem__("role", "router"), "$.role"),
        (lambda raw: raw["layout"].__setitem__("block_order", "random"), "$.layout.block_order"),
        (lambda raw: raw["layout"].__setitem__("num_blocks", 0), "$.layout"),
        (lambda raw: raw["endpoints"].__setitem__("qp_num", 1234), "$.endpoints[...]"),
        (lambda raw: raw["regions"][0].pop("length"), "$.regions[0]"),
    ],
    ids=["length", "transport", "role", "block-order", "zero-blocks", "endpoint", "missing-nested"],
)
def test_nested_field_errors_name_their_path(
    small_info: EngineInfo, corrupt: Callable[[Any], None], field: str
) -> None:
    raw = raw_of(small_info)
    corrupt(raw)
    with pytest.raises(WireDecodeError) as caught:
        decode_engine_info(msgspec.msgpack.encode(raw))
    assert caught.value.field == field


def test_negative_placement_on_the_wire_names_the_placement(small_info: EngineInfo) -> None:
    raw = raw_of(small_info)
    layer = next(iter(raw["placements"]))
    raw["placements"][layer]["offset"] = -4096
    with pytest.raises(WireDecodeError) as caught:
        decode_engine_info(msgspec.msgpack.encode(raw))
    assert caught.value.field == "$.placements[...].offset"
    assert ">= 0" in str(caught.value)


def test_a_bad_map_key_names_a_path(small_info: EngineInfo) -> None:
    raw = raw_of(small_info)
    raw["endpoints"] = {7: "qp"}
    with pytest.raises(WireDecodeError) as caught:
        decode_engine_info(msgspec.msgpack.encode(raw))
    assert caught.value.field == "$.endpoints"


def test_a_missing_top_level_field_is_named(small_info: EngineInfo) -> None:
    raw = raw_of(small_info)
    del raw["node_id"]
    with pytest.raises(WireDecodeError) as caught:
        decode_engine_info(msgspec.msgpack.encode(raw))
    assert caught.value.field is not None
    assert caught.value.field in ("$", "$.node_id")


def test_unknown_dtype_inside_the_layout_names_the_geometry(small_info: EngineInfo) -> None:
    raw = raw_of(small_info)
    raw["layout"]["layers"][0]["geometry"]["dtype"] = "float13"
    with pytest.raises(WireDecodeError) as caught:
        decode_engine_info(msgspec.msgpack.encode(raw))
    assert caught.value.field == "$.layout.layers[0].geometry"
    assert "float13" in str(caught.value)
    assert caught.value.what == "engine info"


def test_message_field_errors_name_their_path() -> None:
    raw = raw_of(MESSAGES[0])
    raw["nbytes"] = "lots"
    with pytest.raises(WireDecodeError) as caught:
        decode_notice(msgspec.msgpack.encode(raw))
    assert caught.value.field == "$.nbytes"

    raw = raw_of(MESSAGES[3])
    raw["remote_offsets"][1] = 1.5
    with pytest.raises(WireDecodeError) as caught:
        decode_write_ops(msgspec.msgpack.encode(raw))
    assert caught.value.field == "$.remote_offsets[1]"


def test_unknown_message_tag_and_wrong_family_raise(small_info: EngineInfo) -> None:
    raw = raw_of(MESSAGES[0])
    raw["type"] = "pickle"
    with pytest.raises(WireDecodeError) as caught:
        decode_notice(msgspec.msgpack.encode(raw))
    assert caught.value.field == "$.type"
    with pytest.raises(WireDecodeError):
        decode_notice(encode(small_info))
    # One union per receiver: a write header is not a notice, and a notice is not a write.
    with pytest.raises(WireDecodeError) as caught:
        decode_notice(encode(MESSAGES[3]))
    assert caught.value.field == "$.type"
    with pytest.raises(WireDecodeError) as caught:
        decode_write_ops(encode(MESSAGES[0]))
    assert caught.value.field == "$.type"
    with pytest.raises(WireDecodeError):
        decode_engine_info(encode(MESSAGES[0]))


def test_a_pickle_is_not_a_message() -> None:
    import pickle

    for decode in (decode_notice, decode_write_ops):
        with pytest.raises(WireDecodeError):
            decode(pickle.dumps(MESSAGES[0]))


# ---- fuzzing --------------------------------------------------------------------------------


def _valid_encodings() -> list[bytes]:
    with Backing.allocate(READY_LAYOUTS["mixed"](num_blocks=2)) as backing:
        regions = backing.region_descriptors("d", 1, TransportKind.SHM, remote_writable=True)
        info = backing.engine_info("d", 1, Role.DECODE, "n", regions, {"k": "v"})
    return [encode(message) for message in MESSAGES] + [encode(info)]


VALID = _valid_encodings()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if action == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif action == "set" and data:
            data[at] = draw(
                st.sampled_from([0x00, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC2, 0xCC, 0xD3, 0xDC, 0xFF])
            )
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete" and data:
            del data[at : at + draw(st.integers(1, 4))]
        else:
            del data[at:]
    return bytes(data)


def check_decodes_or_refuses(data: bytes) -> None:
    for decode in (decode_notice, decode_write_ops):
        try:
            message = decode(data)
        except WireDecodeError:
            pass
        else:
            assert isinstance(message, MESSAGE_TYPES)
    try:
        info = decode_engine_info(data)
    except WireDecodeError as error:
        assert error.field is None or isinstance(error.field, str)
    else:
        assert isinstance(info, EngineInfo)


@settings(max_examples=300)
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_wire_decode_error(data: bytes) -> None:
    check_decodes_or_refuses(data)


@settings(max_examples=600)
@given(mutated())
def test_mutated_encodings_decode_or_raise_wire_decode_error(data: bytes) -> None:
    check_decodes_or_refuses(data)
