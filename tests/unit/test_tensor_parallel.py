"""Tensor-parallel planning: prefill and decode ranks that split a model's KV heads differently
exchange exactly each decode rank's heads, inside both regions (invariant 2), per layer
(invariant 3); a replicated (MLA) cache moves whole blocks; layouts that order a block unalike
are refused before any op exists."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvray.plan as plan_module
from kvray.errors import (
    GeometryMismatchError,
    KVIntegrityError,
    LayoutError,
    MetadataError,
    PlanError,
    WireDecodeError,
)
from kvray.integrity import Checksums, HostRegions, check, landed_pieces, writer_checksums
from kvray.layout import (
    MAX_TP_SIZE,
    BlockOrder,
    Geometry,
    KVLayout,
    LayerSpec,
    TensorParallel,
    block_axes,
    head_axis_size,
)
from kvray.memory import Backing
from kvray.plan import OffsetCache, TransferPlan, plan_transfer
from kvray.tensor_parallel import (
    HeadRun,
    check_head_geometries,
    head_runs,
    pair_runs,
    reader_ranks,
    shared_heads,
    source_ranks,
)
from kvray.validation import validate_engine_info
from kvray.wire import EngineInfo, Role, decode_engine_info, encode

MakeInfo = Callable[..., EngineInfo]

# ---- in-block layouts -----------------------------------------------------------------------

#: Each layout: its axes over the logical (heads, tokens, K/V, content) of one block, outer to
#: inner, and how its block is split into parts ("heads": one part per head, "kv": K and V).
#: Layouts of one family order a block's elements alike; "hnd" and "nhd" (and "kv_nhd" and
#: "kv_hnd") alike too where a side holds one head.
LAYOUTS: dict[str, tuple[str, str, str]] = {
    # name: (family, axes, parts)
    "hnd": ("hnd", "HNC", "one"),  # vLLM's CPU and HND GPU caches: "H2 N128 C128"
    "heads_as_parts": ("hnd", "HNC", "heads"),  # heads outside the blocks: "H8 N16 C256", 8 parts
    "nhd": ("nhd", "NHC", "one"),  # vLLM's NHD GPU caches: "N16 H8 C256"
    "kv_nhd": ("kv_nhd", "KNHD", "kv"),  # FlashAttention's legacy [2, B, N, H, D]: "KV2 N16 H8 D128"
    "kv_nhd_inside": ("kv_nhd", "KNHD", "one"),  # FlashInfer's legacy [B, 2, N, H, D]
    "kv_hnd": ("kv_hnd", "KHND", "kv"),  # FlashAttention's legacy HND
}
#: Families whose element order is the same where one side holds a single head.
ONE_HEAD_PARTNERS = {"hnd": "nhd", "nhd": "hnd", "kv_nhd": "kv_hnd", "kv_hnd": "kv_nhd"}
DTYPES = {1: "uint8", 2: "bfloat16", 4: "float32"}
#: Bytes before and after each decode region in the test's buffers.
CANARY = 64


@dataclass(frozen=True)
class BlockShape:
    """One layer's block as the reference holds it: `heads` x `tokens` x (K, V) x `head_dim`
    elements of `itemsize` bytes (heads: the rank's own; 0 for a replicated latent)."""

    layout: str
    heads: int
    tokens: int
    head_dim: int
    itemsize: int

    @property
    def axes(self) -> str:
        return LAYOUTS[self.layout][1]

    def geometry(self) -> Geometry:
        heads, tokens, head_dim = self.heads, self.tokens, self.head_dim
        if heads == 0:  # a latent: no head axis
            return Geometry(
                block_size=tokens,
                entry_shape=(2 * head_dim,),
                dtype=DTYPES[self.itemsize],
                block_layout=f"N{tokens} C{2 * head_dim}",
            )
        sizes = {
            "H": f"H{heads}",
            "N": f"N{tokens}",
            "C": f"C{2 * head_dim}",
            "K": "KV2",
            "D": f"D{head_dim}",
        }
        parts = {"one": 1, "heads": heads, "kv": 2}[LAYOUTS[self.layout][2]]
        elements = heads * tokens * 2 * head_dim
        return Geometry(
            block_size=tokens,
            entry_shape=(elements // (parts * tokens),),
            dtype=DTYPES[self.itemsize],
            parts=parts,
            block_layout=" ".join(sizes[axis] for axis in self.axes),
        )

    def lay_out(self, block: np.ndarray) -> np.ndarray:
        """A block's bytes in this layout, from its [heads, tokens, 2, head_dim * itemsize]
        reference bytes (parts one after the other)."""
        if self.heads == 0:
            return block.reshape(-1)
        order = {"HNC": (0, 1, 2, 3), "NHC": (1, 0, 2, 3), "KNHD": (2, 1, 0, 3), "KHND": (2, 0, 1, 3)}
        return np.ascontiguousarray(block.transpose(order[self.axes])).reshape(-1)


def write_block(buffer: np.ndarray, info: EngineInfo, layer: str, block: int, data: np.ndarray) -> None:
    """Store a block's bytes (parts one after the other) where `info` places them."""
    placement = info.placements[layer]
    part_nbytes = placement.part_nbytes
    for part in range(placement.parts):
        start = placement.byte_offset(part, block)
        buffer[start : start + part_nbytes] = data[part * part_nbytes : (part + 1) * part_nbytes]


def rank_info(
    make_info: MakeInfo,
    engine_id: str,
    shapes: Sequence[BlockShape],
    num_blocks: int,
    order: BlockOrder,
    tp: TensorParallel,
    role: Role,
) -> EngineInfo:
    layers = tuple(LayerSpec(name=f"layer{index}", geometry=s.geometry()) for index, s in enumerate(shapes))
    backing = Backing.allocate(KVLayout(layers=layers, num_blocks=num_blocks, block_order=order, tp=tp))
    info = make_info(backing, engine_id, 1, role)
    backing.close()
    return info


@contextlib.contextmanager
def planner(native: bool) -> Iterator[None]:
    """Plan with the C loops (where built) or with their numpy twin."""
    saved = plan_module._native
    plan_module._native = saved if native else None
    try:
        yield
    finally:
        plan_module._native = saved


def apply_checked(
    plan: TransferPlan, src: EngineInfo, dst: EngineInfo, source: np.ndarray, target: np.ndarray
) -> None:
    """Copy every op's bytes, after asserting that it lies inside both regions (invariants 1
    and 2: the test's decode buffer has canaries on both sides of the region)."""
    (src_length,) = [region.length for region in src.regions]
    (dst_length,) = [region.length for region in dst.regions]
    for local_region, local_offset, remote_region, remote_offset, nbytes in plan.ops.rows():
        assert local_region == remote_region == 0
        assert nbytes > 0
        assert local_offset >= 0 and local_offset + nbytes <= src_length
        assert remote_offset >= 0 and remote_offset + nbytes <= dst_length
        start = CANARY + remote_offset
        target[start : start + nbytes] = source[local_offset : local_offset + nbytes]


# ---- ranks ----------------------------------------------------------------------------------


def heads_of(tp: TensorParallel) -> set[int]:
    return set(range(tp.first_head, tp.first_head + tp.local_heads))


@pytest.mark.parametrize("decode_size", [1, 2, 4])
@pytest.mark.parametrize("prefill_size", [1, 2, 4])
def test_source_and_reader_ranks_of_four_sharded_heads(prefill_size: int, decode_size: int) -> None:
    for rank in range(decode_size):
        dst = TensorParallel(size=decode_size, rank=rank, kv_heads=4)
        sources = source_ranks(dst, prefill_size, 4)
        covered: set[int] = set()
        for source in sources:
            src = TensorParallel(size=prefill_size, rank=source, kv_heads=4)
            assert heads_of(src) & heads_of(dst)
            assert rank in reader_ranks(src, decode_size, 4)
            covered |= heads_of(src) & heads_of(dst)
        assert covered == heads_of(dst)
        assert len(sources) == max(1, prefill_size // decode_size)
    for source in range(prefill_size):
        src = TensorParallel(size=prefill_size, rank=source, kv_heads=4)
        readers = reader_ranks(src, decode_size, 4)
        assert readers == tuple(
            rank
            for rank in range(decode_size)
            if source
            in source_ranks(TensorParallel(size=decode_size, rank=rank, kv_heads=4), prefill_size, 4)
        )
        assert len(readers) == max(1, decode_size // prefill_size)


@pytest.mark.parametrize("decode_size", [1, 2, 4])
@pytest.mark.parametrize("prefill_size", [1, 2, 4])
def test_a_replicated_cache_is_read_from_one_rank(prefill_size: int, decode_size: int) -> None:
    readers: dict[int, list[int]] = {}
    for rank in range(decode_size):
        (source,) = source_ranks(TensorParallel(size=decode_size, rank=rank), prefill_size, 0)
        assert source == rank % prefill_size
        readers.setdefault(source, []).append(rank)
    for source in range(prefill_size):
        assert reader_ranks(TensorParallel(size=prefill_size, rank=source), decode_size, 0) == tuple(
            readers.get(source, [])
        )


def test_examples_of_ranks() -> None:
    assert source_ranks(TensorParallel(size=1, rank=0, kv_heads=4), 2, 4) == (0, 1)
    assert source_ranks(TensorParallel(size=2, rank=1, kv_heads=4), 1, 4) == (0,)
    assert reader_ranks(TensorParallel(size=1, rank=0, kv_heads=4), 2, 4) == (0, 1)
    # MLA from prefill TP 2 to decode TP 1: prefill rank 1 has no reader.
    assert reader_ranks(TensorParallel(size=2, rank=1), 1, 0) == ()
    assert source_ranks(TensorParallel(size=1), 2, 0) == (0,)


def test_tp_configurations_that_cannot_be_are_refused() -> None:
    with pytest.raises(LayoutError, match="TP size 3 does not divide the model's 4 KV heads"):
        TensorParallel(size=3, rank=0, kv_heads=4)
    with pytest.raises(LayoutError, match="TP size 3 does not divide the model's 4 KV heads"):
        source_ranks(TensorParallel(size=1, kv_heads=4), 3, 4)
    with pytest.raises(LayoutError, match="TP size 3 does not divide the model's 4 KV heads"):
        reader_ranks(TensorParallel(size=2, kv_heads=4), 3, 4)
    for bad in (
        {"size": 0},
        {"size": MAX_TP_SIZE + 1},
        {"size": 2, "rank": 2},
        {"rank": -1},
        {"kv_heads": -4},
    ):
        with pytest.raises(LayoutError):
            TensorParallel(**bad)
    # From a peer: the same checks, as a wire error.
    info_bytes = msgspec.msgpack.encode({"size": 3, "rank": 0, "kv_heads": 4})
    with pytest.raises(msgspec.ValidationError, match="does not divide"):
        msgspec.msgpack.decode(info_bytes, type=TensorParallel)


def test_mismatched_models_are_refused_naming_both_configurations() -> None:
    with pytest.raises(
        GeometryMismatchError, match="prefill TP 2 with 4 KV heads, decode TP 1 with 2 KV heads"
    ):
        source_ranks(TensorParallel(size=1, kv_heads=2), 2, 4)
    with pytest.raises(
        GeometryMismatchError, match="prefill TP 2 with 4 KV heads, decode TP 2 with a replicated"
    ):
        reader_ranks(TensorParallel(size=2, kv_heads=4), 2, 0)
    with pytest.raises(
        GeometryMismatchError, match=r"prefill TP 1 with a replicated cache .* decode TP 2 with 4"
    ):
        source_ranks(TensorParallel(size=2, kv_heads=4), 1, 0)


def test_shared_heads() -> None:
    def tp(size: int, rank: int, heads: int = 8) -> TensorParallel:
        return TensorParallel(size=size, rank=rank, kv_heads=heads)

    assert shared_heads(tp(1, 0), tp(1, 0, 0)) is None  # both TP 1: whole blocks, as before
    assert shared_heads(tp(2, 1, 0), tp(4, 3, 0)) is None  # replicated
    assert shared_heads(tp(2, 1), tp(2, 1)) is None  # the same heads
    assert shared_heads(tp(2, 1), tp(4, 3)) == (6, 2)
    assert shared_heads(tp(4, 1), tp(1, 0)) == (2, 2)
    with pytest.raises(PlanError, match=r"holds KV heads \[0, 4\) and decode .* holds \[4, 8\)"):
        shared_heads(tp(2, 0), tp(2, 1))


# ---- block layouts --------------------------------------------------------------------------


def test_block_axes_and_the_head_axis() -> None:
    assert [tuple(axis) for axis in block_axes("KV2 N16 H8 D128")] == [
        ("KV", 2),
        ("N", 16),
        ("H", 8),
        ("D", 128),
    ]
    assert block_axes("") == ()
    assert head_axis_size("N16 H8 C256") == 8
    assert head_axis_size("N16 C576") is None
    assert head_axis_size("d016 d12") is None  # positional names need not parse
    for bad in ("N16 H", "N0", "16N"):
        with pytest.raises(LayoutError, match="not a label"):
            block_axes(bad)
    with pytest.raises(LayoutError, match="2 times"):
        head_axis_size("H2 N4 H2")


def geometry(layout: str, parts: int = 1, tokens: int = 4, dtype: str = "bfloat16") -> Geometry:
    elements = math.prod(axis.size for axis in block_axes(layout))
    return Geometry(
        block_size=tokens,
        entry_shape=(elements // (parts * tokens),),
        dtype=dtype,
        parts=parts,
        block_layout=layout,
    )


def test_head_runs_of_each_layout() -> None:
    # HND: heads 1-2 of 4 are one run of 2 x 4 tokens x 8 bf16.
    assert head_runs(geometry("H4 N4 C8"), 1, 2) == [HeadRun(0, 64, 128)]
    # NHD: one run per token.
    assert head_runs(geometry("N4 H4 C8"), 1, 2) == [HeadRun(0, t * 64 + 16, 32) for t in range(4)]
    # All heads of NHD: the whole block.
    assert head_runs(geometry("N4 H4 C8"), 0, 4) == [HeadRun(0, 0, 256)]
    # K and V as parts: per part, one run per token.
    assert head_runs(geometry("KV2 N4 H2 D4", parts=2), 1, 1) == [
        HeadRun(kv, t * 16 + 8, 8) for kv in range(2) for t in range(4)
    ]
    # Heads as parts: whole parts.
    assert head_runs(geometry("H4 N4 C8", parts=4), 1, 2) == [HeadRun(1, 0, 64), HeadRun(2, 0, 64)]
    with pytest.raises(LayoutError, match="0 KV-head axes"):
        head_runs(geometry("N4 C8"), 0, 1)
    with pytest.raises(LayoutError, match="elements"):
        head_runs(Geometry(block_size=4, entry_shape=(16,), dtype="uint8", block_layout="H4 N4 C8"), 0, 1)
    with pytest.raises(LayoutError, match="multiply to"):
        head_runs(geometry("H4 N4 C8", parts=2), 0, 1)
    with pytest.raises(LayoutError, match="not among"):
        head_runs(geometry("H4 N4 C8"), 3, 2)


def test_runs_pair_by_bytes() -> None:
    whole = [HeadRun(0, 0, 64)]
    strided = [HeadRun(0, t * 64 + 16, 16) for t in range(4)]
    assert [tuple(piece) for piece in pair_runs(whole, strided)] == [
        (0, t * 16, 0, t * 64 + 16, 16) for t in range(4)
    ]
    assert [
        tuple(piece)
        for piece in pair_runs([HeadRun(0, 0, 10), HeadRun(1, 0, 6)], [HeadRun(2, 4, 4), HeadRun(3, 0, 12)])
    ] == [
        (0, 0, 2, 4, 4),
        (0, 4, 3, 0, 6),
        (1, 0, 3, 6, 6),
    ]
    with pytest.raises(GeometryMismatchError, match="64 bytes and the remote runs 48"):
        pair_runs(whole, strided[:3])


def test_head_geometries_must_agree_but_for_the_heads() -> None:
    check_head_geometries("l", geometry("H4 N4 C8"), geometry("H2 N4 C8", parts=2))
    check_head_geometries("l", geometry("N4 H1 C8"), geometry("H2 N4 C8"))  # one head: anywhere
    check_head_geometries("l", geometry("KV2 N4 H2 D4", parts=2), geometry("KV2 N4 H4 D4"))
    refusals = [
        (geometry("N4 H2 C8"), geometry("H4 N4 C8"), "different places"),
        (geometry("H4 N4 C8"), geometry("H2 N4 C16"), "differently"),
        (geometry("H4 N4 C8"), geometry("H2 N4 C8", dtype="float16"), "dtype"),
        (geometry("N4 C8"), geometry("H2 N4 C4"), "0 KV-head axes"),
    ]
    for local, remote, reason in refusals:
        with pytest.raises(GeometryMismatchError, match=reason) as caught:
            check_head_geometries("layer7", local, remote)
        assert caught.value.layer == "layer7"


# ---- planning between ranks ---------------------------------------------------------------


@st.composite
def tp_models(draw: st.DrawFn) -> tuple[int, int, int]:
    """(kv_heads, prefill TP size, decode TP size); kv_heads 0: a replicated latent."""
    kv_heads = draw(st.sampled_from([0, 1, 2, 3, 4, 6, 8, 12, 16]))
    sizes = [size for size in (1, 2, 4, 8) if kv_heads == 0 or kv_heads % size == 0]
    prefill_size = draw(st.sampled_from(sizes))
    others = [size for size in sizes if size != prefill_size]
    # Mostly different sizes: equal ones move whole blocks, as test_plan.py covers.
    if others and draw(st.integers(0, 3)):
        return kv_heads, prefill_size, draw(st.sampled_from(others))
    return kv_heads, prefill_size, prefill_size


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_every_decode_rank_gets_exactly_its_heads(data: st.DataObject, make_info: MakeInfo) -> None:
    kv_heads, prefill_size, decode_size = data.draw(tp_models(), label="kv heads, prefill TP, decode TP")
    tokens = data.draw(st.integers(1, 6), label="tokens per block")
    head_dim = data.draw(st.integers(1, 6), label="head dim")
    itemsize = data.draw(st.sampled_from(sorted(DTYPES)), label="itemsize")
    prefill_heads = kv_heads // prefill_size
    decode_heads = kv_heads // decode_size
    prefill_layouts: list[str] = []
    decode_layouts: list[str] = []
    for _ in range(data.draw(st.integers(1, 3), label="layers")):
        prefill_layout = data.draw(st.sampled_from(sorted(LAYOUTS)), label="prefill layout")
        family = LAYOUTS[prefill_layout][0]
        partners = {family}
        if 1 in (prefill_heads, decode_heads):
            partners.add(ONE_HEAD_PARTNERS[family])
        choices = sorted(name for name, spec in LAYOUTS.items() if spec[0] in partners)
        if kv_heads == 0 or prefill_size == decode_size:
            choices = [prefill_layout]  # ranks that hold the same heads move whole blocks, alike
        prefill_layouts.append(prefill_layout)
        decode_layouts.append(data.draw(st.sampled_from(choices), label="decode layout"))
    prefill_shapes = [BlockShape(name, prefill_heads, tokens, head_dim, itemsize) for name in prefill_layouts]
    decode_shapes = [BlockShape(name, decode_heads, tokens, head_dim, itemsize) for name in decode_layouts]

    prefill_blocks = data.draw(st.integers(1, 6), label="prefill pool")
    decode_blocks = data.draw(st.integers(1, 6), label="decode pool")
    count = data.draw(st.integers(1, min(prefill_blocks, decode_blocks)), label="request blocks")
    prefill_ids = data.draw(st.permutations(range(prefill_blocks)), label="prefill ids")[:count]
    decode_ids = data.draw(st.permutations(range(decode_blocks)), label="decode ids")[:count]
    prefill_order = data.draw(st.sampled_from(list(BlockOrder)), label="prefill order")
    decode_order = data.draw(st.sampled_from(list(BlockOrder)), label="decode order")
    warm_first = data.draw(st.booleans(), label="C loops on a warm cache (else on a cold one)")

    prefill = [
        rank_info(
            make_info,
            f"prefill-{rank}",
            prefill_shapes,
            prefill_blocks,
            prefill_order,
            TensorParallel(size=prefill_size, rank=rank, kv_heads=kv_heads),
            Role.PREFILL,
        )
        for rank in range(prefill_size)
    ]
    decode = [
        rank_info(
            make_info,
            f"decode-{rank}",
            decode_shapes,
            decode_blocks,
            decode_order,
            TensorParallel(size=decode_size, rank=rank, kv_heads=kv_heads),
            Role.DECODE,
        )
        for rank in range(decode_size)
    ]

    # The reference: every head of every layer of the request's blocks; a replicated latent is
    # one "head" every rank holds whole.
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    all_heads = max(kv_heads, 1)
    reference = [
        rng.integers(0, 256, (count, all_heads, tokens, 2, head_dim * itemsize), dtype=np.uint8)
        for _ in prefill_shapes
    ]

    def local_heads(tp: TensorParallel) -> slice:
        return slice(tp.first_head, tp.first_head + tp.local_heads) if tp.sharded else slice(0, 1)

    sources = []
    for info in prefill:
        (length,) = [region.length for region in info.regions]
        source = rng.integers(0, 256, length, dtype=np.uint8)  # blocks outside the request: junk
        for layer, shape in enumerate(prefill_shapes):
            for position, block in enumerate(prefill_ids):
                heads = reference[layer][position, local_heads(info.layout.tp)]
                write_block(source, info, f"layer{layer}", block, shape.lay_out(heads))
        sources.append(source)

    cache = OffsetCache()
    for dst in decode:
        (length,) = [region.length for region in dst.regions]
        background = rng.integers(0, 256, length + 2 * CANARY, dtype=np.uint8)
        background[:CANARY] = background[-CANARY:] = 0xA5
        target = background.copy()
        written = 0
        #: Each source rank's checksums of what it wrote (`kvray.integrity`).
        checked: list[tuple[EngineInfo, Checksums]] = []
        for source_rank in source_ranks(dst.layout.tp, prefill_size, kv_heads):
            src = prefill[source_rank]
            # The C loops (where built) and the numpy twin, one on a cache that has the pair's
            # rows already (one C call checks the request) and one on a cache that has not.
            plans = []
            for native in (not warm_first, warm_first):
                with planner(native):
                    plans.append(plan_transfer(src, dst, prefill_ids, decode_ids, cache=cache))
            assert plans[0].ops.rows() == plans[1].ops.rows()
            assert plans[0].unmerged.rows() == plans[1].unmerged.rows()
            apply_checked(plans[0], src, dst, sources[source_rank], target)
            written += plans[0].nbytes
            checked.append((src, writer_checksums(plans[0], HostRegions([sources[source_rank]]), dst.layout)))

        expected = background.copy()
        region = expected[CANARY : CANARY + length]
        for layer, shape in enumerate(decode_shapes):
            for position, block in enumerate(decode_ids):
                heads = reference[layer][position, local_heads(dst.layout.tp)]
                write_block(region, dst, f"layer{layer}", block, shape.lay_out(heads))
        assert np.array_equal(target, expected), (
            f"decode rank {dst.layout.tp.rank} did not get exactly its heads"
        )
        block_nbytes = sum(shape.geometry().block_nbytes for shape in decode_shapes)
        assert written == count * block_nbytes, "a byte was written twice or not at all"

        # The decode side's integrity check, from its own layout: every source rank's layers
        # hash as they were written; one bit flipped in a layer's landed bytes names that layer.
        landed = target[CANARY : CANARY + length]
        ids = np.array(decode_ids, dtype=np.int64)
        for src, expected in checked:
            writer_tp = src.layout.tp if shared_heads(src.layout.tp, dst.layout.tp) is not None else None
            facts = {"request_id": "r", "engine_id": dst.engine_id, "writer": src.engine_id}
            check(expected, HostRegions([landed]), dst.layout, dst.placements, ids, writer_tp, **facts)
            layer = data.draw(st.sampled_from(sorted(dst.layout.layer_names)), label="flipped layer")
            heads = shared_heads(src.layout.tp, dst.layout.tp)
            pieces = landed_pieces(dst.layout, dst.placements[layer], ids, layer, heads)
            piece = data.draw(st.integers(0, pieces.offset.size - 1), label="flipped piece")
            at = int(pieces.offset[piece]) + data.draw(
                st.integers(0, int(pieces.nbytes[piece]) - 1), label="byte"
            )
            bit = 1 << data.draw(st.integers(0, 7), label="bit")
            landed[at] ^= bit
            with pytest.raises(KVIntegrityError) as raised:
                check(expected, HostRegions([landed]), dst.layout, dst.placements, ids, writer_tp, **facts)
            assert raised.value.facts["layers"] == [layer]
            landed[at] ^= bit


def llama_rank(
    make_info: MakeInfo, engine_id: str, tp: TensorParallel, layout: str, role: Role
) -> EngineInfo:
    shape = BlockShape(layout, tp.local_heads, 4, 8, 2)
    return rank_info(make_info, engine_id, [shape, shape], 6, BlockOrder.LAYER_MAJOR, tp, role)


def test_a_replicated_latent_moves_whole_blocks_rank_to_rank(make_info: MakeInfo) -> None:
    latent = [BlockShape("hnd", 0, 16, 288, 2)] * 3
    prefill = [
        rank_info(
            make_info,
            f"prefill-{r}",
            latent,
            5,
            BlockOrder.LAYER_MAJOR,
            TensorParallel(size=2, rank=r),
            Role.PREFILL,
        )
        for r in range(2)
    ]
    decode = [
        rank_info(
            make_info,
            f"decode-{r}",
            latent,
            7,
            BlockOrder.BLOCK_MAJOR,
            TensorParallel(size=4, rank=r),
            Role.DECODE,
        )
        for r in range(4)
    ]
    cache = OffsetCache()
    for dst in decode:
        (source,) = source_ranks(dst.layout.tp, 2, 0)
        plan = plan_transfer(prefill[source], dst, [0, 3], [6, 1], cache=cache)
        assert plan.rows is not None and cache.known_pairing(prefill[source], dst) is not None
        assert cache.known_pairing(prefill[source], dst).heads is None  # type: ignore[union-attr]
        block_nbytes = latent[0].geometry().block_nbytes
        # One op per (layer, block), each a whole block: the rows are the placements' own.
        assert len(plan.unmerged) == 3 * 2
        assert set(plan.unmerged.nbytes.tolist()) == {block_nbytes}
        assert plan.rows.local is cache.rows(prefill[source], plan.layers)


def test_sliced_rows_are_cached_per_pair_apart_from_whole_block_rows(make_info: MakeInfo) -> None:
    prefill = llama_rank(
        make_info, "prefill-0", TensorParallel(size=2, rank=0, kv_heads=4), "nhd", Role.PREFILL
    )
    decode = llama_rank(make_info, "decode-0", TensorParallel(size=1, rank=0, kv_heads=4), "nhd", Role.DECODE)
    cache = OffsetCache()
    first = plan_transfer(prefill, decode, [1, 2], [3, 4], cache=cache)
    again = plan_transfer(prefill, decode, [5], [0], cache=cache)
    pairing = cache.known_pairing(prefill, decode)
    assert pairing is not None and pairing.heads == (0, 2)
    assert first.rows is not None and again.rows is not None
    assert again.rows.local is first.rows.local is pairing.local
    # The whole-block rows of the same engine are another table.
    whole = cache.rows(prefill, pairing.layers)
    assert whole.base.size == 2 and pairing.local.base.size == 2 * 4  # one per token of 4
    # 2 layers of 2 heads x 4 tokens x K and V x 8 bf16
    assert int(pairing.local.nbytes.sum()) == 2 * (2 * 4 * 2 * 8 * 2)


def test_layouts_that_order_a_block_unalike_are_refused_before_any_op(make_info: MakeInfo) -> None:
    prefill = llama_rank(
        make_info, "prefill-0", TensorParallel(size=2, rank=0, kv_heads=8), "nhd", Role.PREFILL
    )
    decode = llama_rank(make_info, "decode-0", TensorParallel(size=1, rank=0, kv_heads=8), "hnd", Role.DECODE)
    cache = OffsetCache()
    with pytest.raises(
        GeometryMismatchError, match=r"layer 'layer0' cannot move between TP ranks.*different places"
    ):
        plan_transfer(prefill, decode, [0], [0], cache=cache)
    assert cache.known_pairing(prefill, decode) is None


def test_ranks_that_share_no_head_are_refused(make_info: MakeInfo) -> None:
    prefill = llama_rank(
        make_info, "prefill-1", TensorParallel(size=4, rank=1, kv_heads=8), "hnd", Role.PREFILL
    )
    decode = llama_rank(make_info, "decode-1", TensorParallel(size=2, rank=1, kv_heads=8), "hnd", Role.DECODE)
    with pytest.raises(
        PlanError, match=r"'prefill-1' \(TP rank 1 of 4\) holds KV heads \[2, 4\) and 'decode-1'"
    ):
        plan_transfer(prefill, decode, [0], [0])


def test_different_models_are_refused(make_info: MakeInfo) -> None:
    prefill = llama_rank(
        make_info, "prefill-0", TensorParallel(size=2, rank=0, kv_heads=8), "hnd", Role.PREFILL
    )
    decode = llama_rank(make_info, "decode-0", TensorParallel(size=1, rank=0, kv_heads=4), "hnd", Role.DECODE)
    with pytest.raises(
        GeometryMismatchError, match="'prefill-0' TP 2 with 8 KV heads, 'decode-0' TP 1 with 4"
    ):
        plan_transfer(prefill, decode, [0], [0])


def test_a_sharded_layer_without_a_head_axis_is_refused(make_info: MakeInfo) -> None:
    tp = TensorParallel(size=2, rank=0, kv_heads=4)
    latent = BlockShape("hnd", 0, 4, 8, 2)
    prefill = rank_info(make_info, "prefill-0", [latent], 4, BlockOrder.LAYER_MAJOR, tp, Role.PREFILL)
    decode = rank_info(
        make_info,
        "decode-0",
        [latent],
        4,
        BlockOrder.LAYER_MAJOR,
        TensorParallel(size=1, kv_heads=4),
        Role.DECODE,
    )
    with pytest.raises(GeometryMismatchError, match="0 KV-head axes"):
        plan_transfer(prefill, decode, [0], [0])


def test_a_rank_must_hold_its_share_of_the_heads(make_info: MakeInfo) -> None:
    # Four heads a block, but as rank 0 of 2 of a model with 4 KV heads it holds 2.
    shape = BlockShape("hnd", 4, 4, 8, 2)
    tp = TensorParallel(size=2, kv_heads=4)
    info = rank_info(make_info, "p", [shape], 4, BlockOrder.LAYER_MAJOR, tp, Role.PREFILL)
    with pytest.raises(MetadataError, match="layer 'layer0' holds 4 KV heads a block, but as TP rank 0 of 2"):
        validate_engine_info(info)
    with pytest.raises(MetadataError, match="holds 4 KV heads"):
        plan_transfer(info, info, [0], [1])
    # A layer that does not say where its heads are is not checked (nor can it be sliced).
    validate_engine_info(
        rank_info(
            make_info, "p", [BlockShape("hnd", 0, 4, 8, 2)], 4, BlockOrder.LAYER_MAJOR, tp, Role.PREFILL
        )
    )


def test_the_tp_configuration_travels_with_the_layout(make_info: MakeInfo) -> None:
    tp = TensorParallel(size=4, rank=3, kv_heads=8)
    info = llama_rank(make_info, "decode-3", tp, "kv_nhd", Role.DECODE)
    decoded = decode_engine_info(encode(info))
    assert decoded.layout.tp == tp and decoded == info
    assert hash(decoded.layout) == hash(info.layout)
    bad = encode(info).replace(b"\xa8kv_heads\x08", b"\xa8kv_heads\x07")
    with pytest.raises(WireDecodeError):
        decode_engine_info(bad)
