"""Bad-input campaign: hypothesis drives random and mutated bytes through wire decoding, random
block ids, lengths, layers and geometries through planning and a real transport, and forged
descriptors (regions outside their allocation, overflowing offsets, negative lengths) through
planning and a real transport. Every case either succeeds correctly or raises a kvray error;
no case changes a byte of the destination's allocation that the request does not name (canaries
over the whole allocation, slack included), none writes outside that allocation, and a real
decode actor fed garbage stays up. The number of cases tried is reported."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvray.config import Settings
from kvray.errors import KvrayError
from kvray.layout import BlockOrder, Geometry, KVLayout, LayerSpec, mixed
from kvray.memory import Backing, MemoryKind
from kvray.plan import TransferPlan, plan_transfer
from kvray.transport import Peer, Transport
from kvray.transport.ray import RayTransport, apply_write
from kvray.transport.shm import ShmTransport
from kvray.validation import validate_engine_info
from kvray.wire import (
    EngineInfo,
    Role,
    TransferDone,
    TransferFailed,
    WriteOps,
    decode_engine_info,
    decode_notice,
    decode_write_ops,
    encode,
)

ByteArray = npt.NDArray[np.uint8]
CASES: Counter[str] = Counter()
OUTCOMES: Counter[str] = Counter()
CAMPAIGN = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
DTYPES = ["float32", "bfloat16", "float16", "int8", "uint8"]
EDGE_INTS = [0, 1, -1, 4095, 4096, 2**31, 2**32, 2**62 - 1, 2**62, 2**63 - 1, -(2**63)]


def _outcome(campaign: str, error: BaseException | None) -> None:
    CASES[campaign] += 1
    if error is None:
        OUTCOMES["ok"] += 1
        OUTCOMES[f"ok_{campaign}"] += 1
    else:
        assert isinstance(error, KvrayError), (
            f"{campaign}: not a kvray error: {type(error).__name__}: {error}"
        )
        OUTCOMES[type(getattr(error, "cause", None) or error).__name__] += 1


# ---- wire ------------------------------------------------------------------------------------


def _valid_encodings() -> list[bytes]:
    backing = Backing.allocate(mixed(4), MemoryKind.CPU)
    info = backing.engine_info(
        "d", 5, Role.DECODE, "n", backing.region_descriptors("d", 5, ShmTransport.kind, remote_writable=True)
    )
    ids = {"transfer_id": "t", "request_id": "r", "src_engine": "p", "src_incarnation": 1}
    return [
        encode(info),
        encode(TransferDone(**ids, dst_engine="d", dst_incarnation=5, nbytes=10, token=7)),
        encode(TransferFailed(**ids, dst_engine="d", dst_incarnation=5, reason="x", token=7)),
        encode(
            WriteOps(
                transfer_id="w",
                dst_engine="d",
                dst_incarnation=5,
                regions=[0, 0],
                remote_offsets=[0, 4096],
                nbytes=[64, 64],
                request_id="r",
                token=7,
            )
        ),
    ]


VALID = _valid_encodings()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 6))):
        action = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "splice"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if action == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif action == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xCC, 0xCF, 0xD3, 0xFF]))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=9))
        elif action == "delete" and data:
            del data[at : at + draw(st.integers(1, 9))]
        elif action == "splice":
            other = draw(st.sampled_from(VALID))
            data[at:] = other[draw(st.integers(0, len(other) - 1)) :]
        else:
            del data[at:]
    return bytes(data)


@settings(CAMPAIGN, max_examples=700)
@given(st.one_of(st.binary(max_size=512), mutated()))
def test_wire_bytes_decode_or_raise_kvray_errors(data: bytes) -> None:
    for decode in (decode_notice, decode_write_ops, decode_engine_info):
        try:
            value = decode(data)
            if isinstance(value, EngineInfo):
                validate_engine_info(value)
        except Exception as error:
            _outcome("wire", error)
        else:
            _outcome("wire", None)


# ---- engines on both ends of a real transport, in this process -------------------------------


class _Remote:
    def __init__(self, function: Callable[..., Any]) -> None:
        self.remote = function


class _LocalHost:
    """The decode agent's actor, in process: `kvray_deliver` runs the real receiving half."""

    def __init__(self, backing: Backing, engine_id: str, incarnation: int) -> None:
        async def deliver(header: bytes, payload: ByteArray) -> int:
            return await apply_write(backing, engine_id, incarnation, header, np.array(payload))

        self.kvray_deliver = _Remote(deliver)


@dataclass
class Pair:
    source: Backing
    destination: Backing
    transport: Transport
    src_info: EngineInfo
    dst_info: EngineInfo

    def peer(self, info: EngineInfo | None = None) -> Peer:
        host = _LocalHost(self.destination, "d", 22) if isinstance(self.transport, RayTransport) else None
        return Peer(info or self.dst_info, host)

    def allocation(self) -> ByteArray:
        allocation = self.destination.regions[0].allocation
        assert allocation is not None
        return allocation.numpy()


@contextlib.contextmanager
def engines(src_layout: KVLayout, dst_layout: KVLayout, kind: str, seed: int) -> Iterator[Pair]:
    transport: Transport = ShmTransport(Settings()) if kind == "shm" else RayTransport(Settings())
    source = Backing.allocate(src_layout, MemoryKind.CPU)
    destination = Backing.allocate(dst_layout, MemoryKind.SHM)
    try:
        rng = np.random.default_rng(seed)
        for backing in (source, destination):
            allocation = backing.regions[0].allocation
            assert allocation is not None
            allocation.numpy()[:] = rng.integers(0, 256, allocation.numel(), dtype=np.uint8)
        src_info = source.engine_info(
            "p", 11, Role.PREFILL, "n", transport.register(source, "p", 11, remote_writable=False)
        )
        dst_info = destination.engine_info(
            "d", 22, Role.DECODE, "n", transport.register(destination, "d", 22, remote_writable=True)
        )
        yield Pair(source, destination, transport, src_info, dst_info)
    finally:
        asyncio.run(transport.close())
        source.close()
        destination.close()


def _write(pair: Pair, plan: TransferPlan, info: EngineInfo | None = None) -> None:
    asyncio.run(pair.transport.write(plan, pair.source, pair.peer(info)))


def _segments(info: EngineInfo, layer: str, blocks: Sequence[int]) -> list[tuple[int, int]]:
    placement = info.placements[layer]
    return [
        (placement.byte_offset(part, block), placement.part_nbytes)
        for block in blocks
        for part in range(placement.parts)
    ]


def _check_landed(
    pair: Pair, before: ByteArray, local: Sequence[int], remote: Sequence[int], layers: Sequence[str]
) -> None:
    """The named blocks hold the source's bytes, and not one other byte of the allocation changed."""
    after = pair.allocation()
    region_offset = pair.destination.regions[0].span.offset_in_allocation
    source = pair.source.regions[0].tensor.numpy()
    named = np.zeros(after.size, dtype=bool)
    for layer in layers:
        for (src, nbytes), (dst, _) in zip(
            _segments(pair.src_info, layer, local), _segments(pair.dst_info, layer, remote), strict=True
        ):
            start = region_offset + dst
            assert np.array_equal(after[start : start + nbytes], source[src : src + nbytes]), layer
            named[start : start + nbytes] = True
    changed = np.flatnonzero((after != before) & ~named)
    assert changed.size == 0, f"{changed.size} bytes outside the named blocks changed (first {changed[0]})"


# ---- plan inputs -----------------------------------------------------------------------------


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    return Geometry(
        block_size=draw(st.integers(1, 4)),
        entry_shape=tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2))),
        dtype=draw(st.sampled_from(DTYPES)),
        parts=draw(st.integers(1, 2)),
    )


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    count = draw(st.integers(1, 4))
    return KVLayout(
        layers=tuple(LayerSpec(name=f"layer{i}", geometry=draw(geometries())) for i in range(count)),
        num_blocks=draw(st.integers(1, 10)),
        block_order=draw(st.sampled_from(list(BlockOrder))),
    )


def _block_ids(draw: st.DrawFn, num_blocks: int) -> Any:
    wild = st.one_of(st.integers(-3, num_blocks + 3), st.sampled_from(EDGE_INTS))
    ids = draw(
        st.one_of(
            st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=num_blocks, unique=True),
            st.lists(wild, max_size=num_blocks + 2),
        )
    )
    dtype = draw(st.sampled_from([None, np.int64, np.uint64, np.int16, np.float64]))
    if dtype is None:
        return ids
    try:
        return np.array(ids, dtype=dtype)
    except (OverflowError, ValueError):
        return ids


@st.composite
def plan_cases(draw: st.DrawFn) -> tuple[KVLayout, KVLayout, Any, Any, Any, str]:
    layout = draw(layouts())
    change = draw(st.sampled_from(["same"] * 5 + ["other_pool", "other_geometry", "renamed"]))
    dst_layout = layout
    if change == "other_pool":
        dst_layout = msgspec.structs.replace(layout, num_blocks=draw(st.integers(1, 12)))
    elif change == "other_geometry":
        layers = list(layout.layers)
        at = draw(st.integers(0, len(layers) - 1))
        layers[at] = LayerSpec(name=layers[at].name, geometry=draw(geometries()))
        dst_layout = msgspec.structs.replace(layout, layers=tuple(layers))
    elif change == "renamed":
        layers = list(layout.layers)
        layers[0] = LayerSpec(name="renamed", geometry=layers[0].geometry)
        dst_layout = msgspec.structs.replace(layout, layers=tuple(layers))
    if draw(st.booleans()):  # a well-formed request (which a changed layout may still refuse)
        count = draw(st.integers(1, min(layout.num_blocks, dst_layout.num_blocks)))
        local: Any = draw(st.permutations(range(layout.num_blocks)))[:count]
        remote: Any = draw(st.permutations(range(dst_layout.num_blocks)))[:count]
        layers = draw(
            st.one_of(st.none(), st.lists(st.sampled_from(layout.layer_names), min_size=1, unique=True))
        )
    else:
        local = _block_ids(draw, layout.num_blocks)
        remote = _block_ids(draw, dst_layout.num_blocks)
        names = [*layout.layer_names, "bogus", ""]
        layers = draw(st.one_of(st.none(), st.lists(st.sampled_from(names), max_size=5)))
    return layout, dst_layout, local, remote, layers, draw(st.sampled_from(["shm", "ray"]))


@settings(CAMPAIGN, max_examples=250)
@given(plan_cases(), st.integers(0, 2**32 - 1))
def test_plan_inputs_plan_and_write_exactly_or_raise(case: Any, seed: int) -> None:
    layout, dst_layout, local, remote, layers, kind = case
    with engines(layout, dst_layout, kind, seed) as pair:
        before = pair.allocation().copy()
        try:
            plan = plan_transfer(pair.src_info, pair.dst_info, local, remote, layers)
            _write(pair, plan)
        except Exception as error:
            _outcome("plan", error)
            assert np.array_equal(before, pair.allocation()), "a refused request changed the destination"
            return
        _outcome("plan", None)
        _check_landed(pair, before, [int(b) for b in local], [int(b) for b in remote], plan.layers)


# ---- forged descriptors ----------------------------------------------------------------------

REGION_FIELDS = ["length", "handle_offset", "address", "index", "incarnation", "engine_id", "remote_writable"]
PLACEMENT_FIELDS = ["offset", "block_stride", "part_stride", "part_nbytes", "region", "parts"]


@st.composite
def forged_values(draw: st.DrawFn, real: int) -> int:
    return draw(
        st.one_of(
            st.sampled_from(EDGE_INTS),
            st.integers(-(2**63), 2**63 - 1),
            st.integers(-8192, 8192).map(lambda delta: real + delta),
            st.integers(-4, 4).map(lambda units: real + units * 4096),
        )
    )


def _forge(draw: st.DrawFn, info: EngineInfo) -> EngineInfo:
    """`info` with one to three fields changed, as a lying or broken peer would publish it
    (constructing it may already raise a kvray error)."""
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            region = info.regions[0]
            name = draw(st.sampled_from(REGION_FIELDS))
            if name == "engine_id":
                value: Any = draw(st.sampled_from(["p", "other", ""]))
            elif name == "remote_writable":
                value = False
            else:
                value = draw(forged_values(getattr(region, name)))
            info = msgspec.structs.replace(info, regions=(msgspec.structs.replace(region, **{name: value}),))
        else:
            layer = draw(st.sampled_from(info.layout.layer_names))
            placement = info.placements[layer]
            name = draw(st.sampled_from(PLACEMENT_FIELDS))
            value = draw(forged_values(getattr(placement, name)))
            placements = dict(info.placements)
            placements[layer] = msgspec.structs.replace(placement, **{name: value})
            info = msgspec.structs.replace(info, placements=placements)
    return info


@st.composite
def descriptor_cases(draw: st.DrawFn) -> tuple[KVLayout, list[int], list[int], str, Any]:
    layout = draw(layouts())
    count = draw(st.integers(1, layout.num_blocks))
    local = draw(st.permutations(range(layout.num_blocks)))[:count]
    remote = draw(st.permutations(range(layout.num_blocks)))[:count]
    return layout, list(local), list(remote), draw(st.sampled_from(["shm", "ray"])), draw(st.data())


@settings(CAMPAIGN, max_examples=300)
@given(descriptor_cases(), st.integers(0, 2**32 - 1))
def test_forged_descriptors_are_refused_or_stay_inside(case: Any, seed: int) -> None:
    layout, local, remote, kind, data = case
    with engines(layout, layout, kind, seed) as pair:
        before = pair.allocation().copy()
        try:
            forged = _forge(data.draw, pair.dst_info)
            plan = plan_transfer(pair.src_info, forged, local, remote)
            _write(pair, plan, forged)
        except Exception as error:
            _outcome("descriptor", error)
            assert np.array_equal(before, pair.allocation()), "a refused forgery changed the destination"
            return
        _outcome("descriptor", None)
        # It went through: then every byte it named lies inside the destination's allocation (the
        # shm writer maps only inside the file; the ray receiver checks its own region), holds the
        # source's bytes, and nothing else changed.
        after = pair.allocation()
        source = pair.source.regions[0].tensor.numpy()
        named = np.zeros(after.size, dtype=bool)
        ops = plan.ops
        for local_offset, remote_offset, nbytes in zip(
            ops.local_offset.tolist(), ops.remote_offset.tolist(), ops.nbytes.tolist(), strict=True
        ):
            if kind == "shm":
                start = forged.regions[0].handle_offset + remote_offset
            else:
                start = pair.destination.regions[0].span.offset_in_allocation + remote_offset
                assert remote_offset + nbytes <= pair.destination.regions[0].nbytes
            assert start >= 0 and start + nbytes <= after.size, "a write named bytes outside the allocation"
            assert np.array_equal(after[start : start + nbytes], source[local_offset : local_offset + nbytes])
            named[start : start + nbytes] = True
        assert not ((after != before) & ~named).any(), "bytes the forged plan did not name changed"


# ---- a real decode actor fed garbage ---------------------------------------------------------


def test_actors_fed_garbage_stay_up_and_write_nothing_unnamed(
    local_ray: None, canary_mask: Any, figures: Callable[[str], None]
) -> None:
    from kvray.coordinator import get_or_create_coordinator
    from kvray.workers import DecodeActor, PrefillActor

    settings_ = Settings(coordinator_name="kvray-coordinator-fuzz", lookup_timeout_s=20.0)
    layout = mixed(8, BlockOrder.BLOCK_MAJOR)
    prefill = PrefillActor.remote("fuzz-p", layout, settings_)
    decode = DecodeActor.remote("fuzz-d", layout, settings_)
    ray.get([prefill.start.remote(), decode.start.remote()])
    info = msgspec.msgpack.decode(
        ray.get(get_or_create_coordinator(settings_).lookup.remote("fuzz-d", 5.0))[0], type=EngineInfo
    )
    ray.get(decode.fill_region.remote(5))
    before = ray.get(decode.snapshot.remote())[0]
    rng = np.random.default_rng(2026)
    written: list[tuple[list[int], list[str] | None]] = []
    header = WriteOps(
        transfer_id="w",
        dst_engine="fuzz-d",
        dst_incarnation=info.incarnation,
        regions=[0],
        remote_offsets=[0],
        nbytes=[64],
        request_id="r",
    )
    for case in range(150):
        kind = case % 3
        try:
            if kind == 0:
                garbage = VALID[case % len(VALID)] if case % 2 else encode(header)
                data = bytearray(garbage)
                for _ in range(int(rng.integers(0, 4))):
                    data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
                ray.get(decode.kvray_notify.remote(bytes(data)))
            elif kind == 1:
                offsets = rng.integers(-(2**40), 2**40, int(rng.integers(1, 4))).tolist()
                forged = msgspec.structs.replace(
                    header,
                    regions=rng.integers(0, 2, len(offsets)).tolist(),
                    remote_offsets=[abs(o) for o in offsets],
                    nbytes=rng.integers(1, 2**20, len(offsets)).tolist(),
                    request_id=str(rng.choice(["r", "", "x" * 300])),
                )
                payload = np.zeros(int(rng.integers(0, 4096)), dtype=np.uint8)
                ray.get(decode.kvray_deliver.remote(encode(forged), payload))
            else:
                count = int(rng.integers(1, 4))
                request_id = f"push-{case}"
                ray.get(prefill.allocate.remote(request_id, count))
                reservation = ray.get(decode.reserve.remote(request_id, count))
                if rng.random() < 0.5:
                    remote = rng.choice(8, count, replace=False).tolist()
                else:
                    remote = rng.integers(-2, 11, int(rng.integers(0, 5))).tolist()
                layers = (
                    None if rng.random() < 0.5 else rng.choice([*layout.layer_names, "bogus"], 2).tolist()
                )
                incarnation = info.incarnation if rng.random() < 0.8 else info.incarnation + 1
                token = reservation.token if rng.random() < 0.8 else reservation.token ^ 1
                forged = msgspec.structs.replace(
                    reservation, blocks=tuple(remote), incarnation=incarnation, token=token
                )
                try:
                    ray.get(prefill.push.remote(forged, layers=layers))
                finally:
                    written.append((remote, layers))  # may have landed (shm writes are one-sided)
                    ray.get(decode.release.remote(request_id))
        except KvrayError as error:
            _outcome("actor", error)
        else:
            _outcome("actor", None)
    assert ray.get(decode.stats.remote())["free_blocks"] == 8, "the decode actor is up"
    assert ray.get(prefill.free_count.remote()) == 8, "every refused push freed its blocks"
    (offset, old), (_, new) = before, ray.get(decode.snapshot.remote())[0]
    valid = [(blocks, layers) for blocks, layers in written if _valid_request(blocks, layers, layout)]
    mask = canary_mask(info, offset, old.size, valid)
    assert np.array_equal(old[~mask], new[~mask]), "garbage changed bytes no request named"
    for actor in (prefill, decode):
        ray.kill(actor)

    total = sum(CASES.values())
    errors = sum(count for name, count in OUTCOMES.items() if not name.startswith("ok"))
    figures(
        f"[kvray fuzz] cases={total} (wire={CASES['wire']}, plan={CASES['plan']}, "
        f"descriptors={CASES['descriptor']}, actor={CASES['actor']}): {OUTCOMES['ok']} succeeded "
        f"exactly (plan {OUTCOMES['ok_plan']}, descriptors {OUTCOMES['ok_descriptor']}), "
        f"{errors} raised kvray errors, 0 other exceptions, 0 bytes written outside the "
        "named blocks, 0 actor crashes"
    )
    top = ", ".join(f"{name} {count}" for name, count in OUTCOMES.most_common() if not name.startswith("ok"))
    figures(f"[kvray fuzz] errors by class: {top}")


def _valid_request(blocks: list[int], layers: list[str] | None, layout: KVLayout) -> bool:
    in_range = all(0 <= block < layout.num_blocks for block in blocks)
    return (
        bool(blocks)
        and in_range
        and len(set(blocks)) == len(blocks)
        and (layers is None or all(layer in layout.layer_names for layer in layers))
    )
