"""vLLM's KV cache layouts as the connector's worker reads them (`block_runs`, `layout_of`), and a
hand-off between two workers whose caches are laid out differently: every layout of vLLM 0.32+
and the earlier backends' shapes, on CPU tensors (the arithmetic is the same on a GPU, where
tests/gpu runs it on CUDA caches). Bytes and canaries are checked per block in vLLM's own view."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvray.agent.handoff import PUSH_ENDPOINT, HandoffStep, LayerwiseSpec, LoadSpec, SendSpec
from kvray.config import Settings
from kvray.errors import ConfigError
from kvray.integrations.vllm.cache_layout import block_runs, layout_of
from kvray.integrations.vllm.worker import ConnectorWorker
from kvray.memory import Backing
from kvray.wire import Role
from tests.vllm_layouts import KV_CACHE_LAYOUTS, CacheShape, block_of, layout_views, legacy_views

GQA = CacheShape(layers=3, num_blocks=8, block_size=16, heads=4, content=2 * 32, dtype=torch.bfloat16)
MLA = CacheShape(layers=3, num_blocks=8, block_size=16, heads=1, content=576, dtype=torch.bfloat16)
FP8 = CacheShape(layers=3, num_blocks=8, block_size=16, heads=4, content=2 * 32, dtype=torch.float8_e4m3fn)

#: (layout, parts a block is stored as, in-block order) for GQA's 4 heads of 16 tokens.
EXPECTED = {
    "LBHNC": (1, "H4 N16 C64"),
    "LBNHC": (1, "N16 H4 C64"),
    "LHBNC": (4, "H4 N16 C64"),
    "BLHNC": (1, "H4 N16 C64"),
    "BLNHC": (1, "N16 H4 C64"),
    "BHLNC": (4, "H4 N16 C64"),
}


def fresh(shape: CacheShape) -> torch.Tensor:
    """Zeroed int8 for `shape`, page-aligned with a page to spare at the end (room for the
    aligned region around it)."""
    buffer = torch.zeros(shape.nbytes + 3 * 4096, dtype=torch.int8)
    skip = -buffer.data_ptr() % 4096
    return buffer[skip : skip + shape.nbytes]


@pytest.mark.parametrize("layout", sorted(KV_CACHE_LAYOUTS))
def test_every_vllm_layout_is_read_as_runs_of_whole_blocks(layout: str) -> None:
    caches = layout_views(fresh(GQA), GQA, layout)
    cache = layout_of(caches, GQA.num_blocks, GQA.block_size)
    parts, order = EXPECTED[layout]
    for name in GQA.names():
        geometry = cache.layout.layer(name).geometry
        assert (geometry.parts, geometry.block_layout, geometry.dtype) == (parts, order, "bfloat16")
        assert geometry.block_nbytes == GQA.heads * GQA.block_size * GQA.content * 2
    backing = Backing.adopt(cache.layout, cache.tensors, strides=cache.strides)
    # kvray's view of each layer addresses exactly the bytes of vLLM's: fill kvray's view of
    # block 5 and find it in vLLM's block 5 and nowhere else.
    for index, name in enumerate(GQA.names()):
        view = backing.view(name)
        (view[:, 5] if parts > 1 else view[5]).fill_(index + 1)
    for index, name in enumerate(GQA.names()):
        vllm_view = caches[name]
        assert bool((vllm_view[5] == index + 1).all())
        others = torch.cat([vllm_view[:5].flatten(), vllm_view[6:].flatten()])
        assert bool((others == 0).all())


def test_mla_and_fp8_caches_are_one_run_per_block() -> None:
    for shape in (MLA, FP8):
        for layout in ("LBNHC", "LBHNC", "BLHNC"):
            cache = layout_of(layout_views(fresh(shape), shape, layout), shape.num_blocks, shape.block_size)
            geometry = cache.layout.layers[0].geometry
            assert geometry.parts == 1
            assert geometry.entry_shape == (shape.heads * shape.content,)
    latent = layout_of(legacy_views(fresh(MLA), MLA, "mla"), MLA.num_blocks, MLA.block_size)
    assert latent.layout.layers[0].geometry.entry_shape == (576,)
    assert layout_of(layout_views(fresh(FP8), FP8, "LBHNC"), FP8.num_blocks, FP8.block_size).layout.layers[
        0
    ].geometry.dtype == ("float8_e4m3fn")


@pytest.mark.parametrize(
    ("backend", "order", "parts", "block_layout"),
    [
        ("flash_attn", "NHD", 2, "KV2 N16 H4 D32"),
        ("flash_attn", "HND", 2, "KV2 H4 N16 D32"),
        ("flashinfer", "NHD", 1, "KV2 N16 H4 D32"),
        ("flashinfer", "HND", 1, "KV2 H4 N16 D32"),
    ],
)
def test_earlier_backends_shapes_are_read_too(
    backend: str, order: str, parts: int, block_layout: str
) -> None:
    caches = legacy_views(fresh(GQA), GQA, backend, order)
    geometry = layout_of(caches, GQA.num_blocks, GQA.block_size).layout.layers[0].geometry
    assert (geometry.parts, geometry.block_layout) == (parts, block_layout)


def test_a_rank_of_one_kv_head_says_where_its_heads_are_alike_in_every_layout() -> None:
    """A TP rank holding one of the model's KV heads keeps its head axis ("H1", which TP
    planning slices blocks by) in one place: outside the run, inside the parts. One head orders
    no bytes, so layouts that differ only in where it sits still exchange whole blocks."""
    one_head = CacheShape(layers=2, num_blocks=8, block_size=16, heads=1, content=64, dtype=torch.bfloat16)
    for layout in sorted(KV_CACHE_LAYOUTS):
        caches = layout_views(fresh(one_head), one_head, layout)
        geometry = layout_of(caches, one_head.num_blocks, one_head.block_size).layout.layers[0].geometry
        assert (geometry.parts, geometry.block_layout) == (1, "H1 N16 C64"), layout
    for backend, parts, block_layout in (
        ("flash_attn", 2, "KV2 H1 N16 D32"),
        ("flashinfer", 1, "H1 KV2 N16 D32"),
    ):
        for order in ("NHD", "HND"):
            caches = legacy_views(fresh(one_head), one_head, backend, order)
            geometry = layout_of(caches, one_head.num_blocks, one_head.block_size).layout.layers[0].geometry
            assert (geometry.parts, geometry.block_layout) == (parts, block_layout), (backend, order)


def test_kernel_blocks_that_split_each_block_are_one_block() -> None:
    """vLLM may hand [B x ratio, H, N/ratio, C] views when kernels use smaller blocks."""
    caches = layout_views(fresh(GQA), GQA, "LBHNC")
    split = {
        name: tensor.reshape(GQA.num_blocks * 2, GQA.heads // 2, GQA.block_size, GQA.content)
        for name, tensor in caches.items()
    }
    geometry, strides = block_runs("layer", next(iter(split.values())), GQA.num_blocks, GQA.block_size)
    assert geometry.parts == 1 and geometry.block_nbytes == GQA.heads * GQA.block_size * GQA.content * 2
    assert strides.block_stride == geometry.block_nbytes


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (torch.zeros(8, 16, 32)[:, :, ::2], "no contiguous innermost axis"),
        (torch.zeros(8, 2, 3, 256)[:, :, :2, :128], "more than one stride"),
        (torch.zeros(9, 16, 8), "block axis"),
        (torch.zeros(8, 3), "whole tokens"),
    ],
    ids=["element-strided", "parts-at-two-strides", "block-axis", "partial-block"],
)
def test_a_cache_kvray_cannot_move_as_runs_is_refused(tensor: torch.Tensor, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        block_runs("layer", tensor, 8, 16)


def test_layers_interleaved_block_by_block_are_disjoint_but_overlapping_ones_are_refused() -> None:
    caches = layout_views(fresh(GQA), GQA, "BLHNC")
    layout_of(caches, GQA.num_blocks, GQA.block_size)  # interleaved, and disjoint
    names = GQA.names()
    clash = {names[0]: caches[names[0]], names[1]: caches[names[0]][:, :, :, :].view(torch.float16)}
    with pytest.raises(ConfigError, match="overlap"):
        layout_of(clash, GQA.num_blocks, GQA.block_size)


# ---- a hand-off between two layouts -------------------------------------------------------


def worker_pair(
    tmp_path: Path, shape: CacheShape, prefill_layout: str, decode_layout: str
) -> tuple[ConnectorWorker, ConnectorWorker, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    settings = Settings(shm_dir=str(tmp_path), notify_timeout_s=5.0, transfer_timeout_s=30.0)
    prefill = ConnectorWorker("vllm-p", Role.DECODE, settings, lease_s=30.0)
    decode = ConnectorWorker("vllm-d", Role.DECODE, settings, lease_s=30.0)
    caches = []
    for worker, layout in ((prefill, prefill_layout), (decode, decode_layout)):
        with worker.allocation_context():
            buffer = torch.zeros(shape.nbytes + (1 << 20), dtype=torch.int8)
        caches.append(layout_views(buffer[: shape.nbytes], shape, layout))
    generator = torch.Generator().manual_seed(7)
    for tensor in caches[0].values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    prefill.register(caches[0], shape.num_blocks, shape.block_size)
    decode.register(caches[1], shape.num_blocks, shape.block_size)
    return prefill, decode, caches[0], caches[1]


def load(prefill: ConnectorWorker, request_id: str, key: str, blocks: tuple[int, ...]) -> LoadSpec:
    info = prefill.info
    return LoadSpec(
        request_id,
        info.engine_id,
        info.incarnation,
        key,
        info.node_id,
        info.endpoints[PUSH_ENDPOINT],
        (blocks,),
        0,
    )


def received_within(worker: ConnectorWorker, request_id: str, seconds: float) -> set[str]:
    deadline = time.monotonic() + seconds
    failed: set[str] = set()
    while time.monotonic() < deadline:
        _, received, _, failures = worker.finished()
        failed |= failures
        if request_id in received:
            return failed
        time.sleep(0.02)
    raise AssertionError(f"{request_id} was not reported within {seconds} s")


@pytest.mark.parametrize(
    ("prefill_layout", "decode_layout", "layerwise"),
    [
        ("LBNHC", "LBNHC", False),
        ("LHBNC", "BHLNC", True),
        ("LBHNC", "BLHNC", False),
        ("BLHNC", "LBHNC", True),
    ],
)
def test_blocks_move_between_layouts_that_order_a_block_alike(
    tmp_path: Path, prefill_layout: str, decode_layout: str, layerwise: bool
) -> None:
    prefill, decode, source, target = worker_pair(tmp_path, GQA, prefill_layout, decode_layout)
    held, taken = (1, 2, 6), (7, 0, 3)
    try:
        if layerwise:
            prefill.begin_layerwise({"r-1": LayerwiseSpec("r-1", "p-1", (held,))})
        else:
            prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", (held,), key="p-1")}))
        decode.begin(HandoffStep(loads={"d-1": load(prefill, "d-1", "p-1", taken)}))
        if layerwise:
            time.sleep(0.3)
            for name in GQA.names():
                prefill.save_layer(name)
            prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", (held,), key="p-1")}))
        assert received_within(decode, "d-1", 15) == set()
        for name in GQA.names():
            for src, dst in zip(held, taken, strict=True):
                assert torch.equal(block_of(target[name], dst), block_of(source[name], src)), (name, dst)
            for canary in set(range(GQA.num_blocks)) - set(taken):
                assert bool((block_of(target[name], canary).float() == 0).all()), (name, canary)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_layouts_that_order_a_block_differently_are_refused_before_a_byte_moves(tmp_path: Path) -> None:
    prefill, decode, _, target = worker_pair(tmp_path, GQA, "LBNHC", "LBHNC")
    try:
        prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", ((1, 2),), key="p-1")}))
        decode.begin(HandoffStep(loads={"d-1": load(prefill, "d-1", "p-1", (3, 4))}))
        assert received_within(decode, "d-1", 15) == {"d-1"}
        assert not any(bool((tensor.float() != 0).any()) for tensor in target.values())
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("layout", sorted(KV_CACHE_LAYOUTS))
def test_the_views_here_are_the_views_vllm_makes(layout: str) -> None:
    """`tests.vllm_layouts` against vLLM's own `create_kv_cache_views`, where vLLM is installed
    (the GPU tests drive the connector with the former, on a machine without vLLM)."""
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
    shape = GQA
    buffer = fresh(shape)
    ours = layout_views(buffer, shape, layout)
    spec = interface.FullAttentionSpec(
        block_size=shape.block_size, num_kv_heads=shape.heads, head_size=shape.content // 2, dtype=shape.dtype
    )
    first, second = ours[shape.names()[0]], ours[shape.names()[1]]
    itemsize = first.element_size()
    tensor = interface.KVCacheTensor(
        size=shape.nbytes,
        layers=shape.names(),
        layer_stride=(second.data_ptr() - first.data_ptr()),
        block_stride=first.stride(0) * itemsize,
    )
    theirs = interface.create_kv_cache_views(
        buffer, spec, shape.num_blocks, layouts.KVCacheLayout[layout], tensor
    )
    for mine, vllms in zip(ours.values(), theirs, strict=True):
        assert (mine.shape, mine.stride(), mine.data_ptr(), mine.dtype) == (
            vllms.shape,
            vllms.stride(),
            vllms.data_ptr(),
            vllms.dtype,
        )


def test_a_layers_push_runs_after_what_the_forward_said_its_kv_is_ready_by(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU `save_kv_layer` records a CUDA event on the forward's stream; the layer's push
    is given it (`KVAgent.push_layer(..., ready=)`, a `kvray.memory.SourceReady`), which the GPU
    transports order their copies after (here, on the CPU, any object stands for the event)."""
    prefill, decode, _, _ = worker_pair(tmp_path, GQA, "LBHNC", "LBHNC")
    seen: dict[str, object] = {}
    agent = prefill.agent
    original = agent.push_layer

    async def recording(reservation: object, layer: str, blocks: object, *, ready: object = None) -> int:
        seen[layer] = ready
        return await original(reservation, layer, blocks, ready=ready)  # type: ignore[arg-type]

    monkeypatch.setattr(agent, "push_layer", recording)
    events = {name: object() for name in GQA.names()}
    try:
        prefill.begin_layerwise({"r-1": LayerwiseSpec("r-1", "p-1", ((1, 2),))})
        decode.begin(HandoffStep(loads={"d-1": load(prefill, "d-1", "p-1", (3, 4))}))
        time.sleep(0.3)
        loop = prefill._loop
        assert loop is not None
        for name in GQA.names():
            loop.loop.call_soon_threadsafe(prefill.handoff.save_layer, name, events[name])
        prefill.begin(HandoffStep(sends={"r-1": SendSpec("r-1", ((1, 2),), key="p-1")}))
        assert received_within(decode, "d-1", 15) == set()
        assert seen == events
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_model_that_keeps_recurrent_state_is_refused_by_its_state_groups() -> None:
    """A Mamba, Mamba2 or Gated DeltaNet layer's cache (vLLM's `MambaSpec`) is one state slot per
    request, not blocks of tokens: kvray cannot move it yet and refuses the model at start-up,
    naming the group, where a model of attention of every kind (full, sliding window, MLA) passes."""
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvray.integrations.vllm.cache_layout import cache_config_of, check_attention_only

    attention = interface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    sliding = interface.SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=32
    )
    latent = interface.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    state = interface.MambaSpec(
        block_size=16, shapes=((3, 1024), (8, 64, 16)), dtypes=(torch.bfloat16, torch.float32)
    )

    def config(*specs: object) -> object:
        groups = [
            interface.KVCacheGroupSpec([f"model.layers.{index}.mixer"], spec)
            for index, spec in enumerate(specs)
        ]
        return interface.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    check_attention_only(config(attention, sliding, latent))
    with pytest.raises(ConfigError, match=r"recurrent state .* group 1 \(MambaSpec: model\.layers\.1\.mixer"):
        check_attention_only(config(attention, state))
    uniform = interface.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": attention, "b": state})
    with pytest.raises(ConfigError, match=r"group 0 \(MambaSpec"):
        check_attention_only(config(uniform))

    class Cache:
        block_size = 16

    class VllmConfig:
        cache_config = Cache()

    with pytest.raises(ConfigError, match="recurrent state"):
        cache_config_of(VllmConfig(), config(attention, state))
