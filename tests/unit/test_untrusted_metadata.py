"""Forged or buggy metadata must not redirect a write: what `wire` and `validate_engine_info`
refuse, and that they stay cheap on claims a peer makes up."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvray.errors import LayoutError, MetadataError, WireDecodeError
from kvray.layout import MAX_BLOCKS, MAX_LAYERS, Geometry, KVLayout, LayerPlacement, LayerSpec
from kvray.plan import OpTable, merge_ops
from kvray.validation import validate_engine_info
from kvray.wire import (
    MAX_ENGINE_INFO_BYTES,
    CudaIpcHandle,
    EngineInfo,
    RegionDescriptor,
    Role,
    TransportKind,
    decode_engine_info,
    decode_notice,
    decode_verbs_handshake,
    encode,
)

PART = 64


def region(index: int, address: int, length: int, **fields: object) -> RegionDescriptor:
    return RegionDescriptor(
        engine_id="decode-0",
        incarnation=1,
        transport=fields.pop("transport", TransportKind.SHM),  # type: ignore[arg-type]
        index=index,
        address=address,
        length=length,
        remote_writable=True,
        **fields,  # type: ignore[arg-type]
    )


def info_with(
    regions: list[RegionDescriptor], placed: list[tuple[int, int]], num_blocks: int = 1
) -> EngineInfo:
    """One single-part layer of `PART` bytes per block per (region, offset) in `placed`."""
    geometry = Geometry(block_size=1, entry_shape=(PART,), dtype="uint8")
    names = [f"layer{i}" for i in range(len(placed))]
    return EngineInfo(
        engine_id="decode-0",
        incarnation=1,
        role=Role.DECODE,
        node_id="node",
        layout=KVLayout(
            layers=tuple(LayerSpec(name=n, geometry=geometry) for n in names), num_blocks=num_blocks
        ),
        regions=tuple(regions),
        placements={
            name: LayerPlacement(
                region=index, offset=offset, part_stride=0, block_stride=PART, part_nbytes=PART, parts=1
            )
            for name, (index, offset) in zip(names, placed, strict=True)
        },
    )


# ---- regions are disjoint in what the writer opens, not only by address ---------------------


def test_two_shm_regions_over_one_file_range_are_refused() -> None:
    # Distinct addresses, one file and overlapping offsets: the shm writer would map one place twice.
    path = b"/dev/shm/kvray-1-0123456789abcdef"
    regions = [
        region(0, 1 << 20, 8192, handle=path, handle_offset=0),
        region(1, 1 << 30, 8192, handle=path, handle_offset=4096),
    ]
    with pytest.raises(MetadataError, match="overlap in the memory its handle names") as caught:
        validate_engine_info(info_with(regions, [(0, 0), (1, 0)]))
    assert caught.value.region == 1
    # The same offsets in two different files are fine.
    regions[1] = region(1, 1 << 30, 8192, handle=path + b"0", handle_offset=4096)
    validate_engine_info(info_with(regions, [(0, 0), (1, 0)]))


def _cuda_handle(storage_offset: int) -> bytes:
    return msgspec.msgpack.encode(
        CudaIpcHandle(
            device_uuid="GPU-1",
            handle=b"\x01" * 64,
            storage_size=1 << 20,
            storage_offset=storage_offset,
            ref_counter_handle=b"r",
            ref_counter_offset=0,
            event_handle=b"",
            event_sync_required=False,
        )
    )


def test_two_cuda_ipc_regions_over_one_allocation_range_are_refused() -> None:
    # Different storage offsets in the handle, the same bytes of one allocation after adding
    # each region's own offset.
    regions = [
        region(
            0, 1 << 20, 8192, transport=TransportKind.CUDA_IPC, handle=_cuda_handle(0), handle_offset=4096
        ),
        region(
            1, 1 << 30, 8192, transport=TransportKind.CUDA_IPC, handle=_cuda_handle(8192), handle_offset=0
        ),
    ]
    with pytest.raises(MetadataError, match="overlap in the memory its handle names"):
        validate_engine_info(info_with(regions, [(0, 0), (1, 0)]))


def test_a_malformed_cuda_ipc_handle_is_metadata_error() -> None:
    regions = [region(0, 0, 8192, transport=TransportKind.CUDA_IPC, handle=b"\xc1")]
    with pytest.raises(MetadataError, match="malformed handle"):
        validate_engine_info(info_with(regions, [(0, 0)]))


# ---- no int64 key wraps on offsets near 2**62 ---------------------------------------------


def test_an_overlap_near_2_62_in_a_high_region_is_found() -> None:
    # Two layers of region 3 overlap by PART/2 bytes at offsets where `region * span + offset`
    # wraps past int64 between them: sorted on that key, region 0's layer fell between the two.
    high = 2**61 - 25
    regions = [region(i, 4096 * i, 4096) for i in range(3)]
    regions.append(region(3, 1 << 20, 2**61 + 4096))
    with pytest.raises(MetadataError, match="two KV segments over the same bytes") as caught:
        validate_engine_info(info_with(regions, [(3, high), (0, 0), (3, high + PART // 2)]))
    assert caught.value.region == 3


def test_merge_orders_ops_near_2_62_by_region_then_offset() -> None:
    high = 2**61
    local_region = np.array([3, 0, 3, 1], dtype=np.int64)
    local_offset = np.array([high + 64, 0, high, high], dtype=np.int64)
    ops = OpTable(
        local_region,
        local_offset,
        np.zeros(4, dtype=np.int64),
        np.array([64, 1000, 0, 5000], dtype=np.int64),
        np.full(4, 64, dtype=np.int64),
    )
    merged = merge_ops(ops)
    assert merged.rows() == [(0, 0, 0, 1000, 64), (1, high, 0, 5000, 64), (3, high, 0, 0, 128)]


# ---- bounds on what a peer may claim, checked before any work in proportion to it ----------


def _raw_info() -> dict[str, object]:
    regions = [region(0, 0, PART * 4)]
    raw: dict[str, object] = msgspec.msgpack.decode(encode(info_with(regions, [(0, 0)], num_blocks=4)))
    return raw


def test_too_many_blocks_is_refused_on_decoding() -> None:
    raw = _raw_info()
    raw["layout"]["num_blocks"] = 30_000_000  # type: ignore[index]
    with pytest.raises(WireDecodeError, match="num_blocks"):
        decode_engine_info(msgspec.msgpack.encode(raw))
    assert MAX_BLOCKS < 30_000_000


def test_too_many_layers_is_refused_on_decoding() -> None:
    raw = _raw_info()
    layer = raw["layout"]["layers"][0]  # type: ignore[index]
    raw["layout"]["layers"] = [{**layer, "name": f"l{i}"} for i in range(MAX_LAYERS + 1)]  # type: ignore[index]
    with pytest.raises(WireDecodeError, match="layers"):
        decode_engine_info(msgspec.msgpack.encode(raw))


def test_an_oversized_engine_info_is_refused_before_decoding() -> None:
    raw = _raw_info()
    raw["endpoints"] = {"padding": "x" * MAX_ENGINE_INFO_BYTES}
    with pytest.raises(WireDecodeError, match="larger than"):
        decode_engine_info(msgspec.msgpack.encode(raw))


def test_a_layout_past_the_bounds_cannot_be_built() -> None:
    geometry = Geometry(block_size=1, entry_shape=(PART,), dtype="uint8")
    with pytest.raises(LayoutError):
        KVLayout(layers=(LayerSpec(name="a", geometry=geometry),), num_blocks=MAX_BLOCKS + 1)


def test_a_large_block_major_pool_validates_without_enumerating_blocks() -> None:
    # MAX_BLOCKS blocks of 8 interleaved layers: enumerating every segment would take GiBs.
    count = 8
    regions = [region(0, 0, PART * count * MAX_BLOCKS)]
    info = info_with(regions, [(0, PART * i) for i in range(count)], num_blocks=MAX_BLOCKS)
    info = msgspec.structs.replace(
        info,
        placements={
            name: msgspec.structs.replace(placement, block_stride=PART * count)
            for name, placement in info.placements.items()
        },
    )
    validate_engine_info(info)
    bad = dict(info.placements)
    bad["layer1"] = msgspec.structs.replace(bad["layer1"], offset=PART // 2)
    with pytest.raises(MetadataError, match="same bytes"):
        validate_engine_info(msgspec.structs.replace(info, placements=bad))


# ---- every decoder: deep nesting and struct checks are WireDecodeError ---------------------


def _nested_unknown_field(valid: bytes, depth: int) -> bytes:
    """`valid` (a msgpack map) with one more field: `depth` nested one-element arrays."""
    head = valid[0]
    assert 0x80 <= head <= 0x8E, "a fixmap of fewer than 15 fields"
    return bytes([head + 1]) + valid[1:] + b"\xa7unknown" + b"\x91" * depth + b"\x01"


@pytest.mark.parametrize("decoder", ["engine", "message", "handshake"])
def test_deeply_nested_unknown_fields_are_wire_decode_errors(decoder: str) -> None:
    from kvray.wire import TransferFailed, VerbsAccept, VerbsEndpoint

    if decoder == "engine":
        valid, decode = encode(info_with([region(0, 0, PART)], [(0, 0)])), decode_engine_info
    elif decoder == "message":
        message = TransferFailed(
            transfer_id="t",
            request_id="r",
            src_engine="p",
            src_incarnation=1,
            dst_engine="d",
            dst_incarnation=1,
            reason="x",
        )
        valid, decode = encode(message), decode_notice  # type: ignore[assignment]
    else:
        endpoint = VerbsEndpoint(device="d", port=1, gid="g", gid_index=0, lid=0, mtu=5, link_layer=2)
        accept = VerbsAccept(
            dst_engine="d", dst_incarnation=1, endpoint=endpoint, qp_num=1, psn=1, regions=()
        )
        valid, decode = encode(accept), decode_verbs_handshake  # type: ignore[assignment]
    decode(_nested_unknown_field(valid, 3))  # shallow unknown fields are skipped
    with pytest.raises(WireDecodeError, match="nested too deep"):
        decode(_nested_unknown_field(valid, 50_000))


def test_a_zero_length_region_in_engine_info_bytes_is_a_wire_decode_error() -> None:
    raw = _raw_info()
    raw["regions"][0]["length"] = 0  # type: ignore[index]
    with pytest.raises(WireDecodeError, match="positive length") as caught:
        decode_engine_info(msgspec.msgpack.encode(raw))
    assert caught.value.what == "engine info"
