"""The reference model: deterministic, and its tokens depend on every cache byte being in place.

Disaggregated generation is simulated in one process: prefill writes backing A, the test copies
the used blocks' raw bytes into backing B at other block ids (what a transport does), decode
runs on B. Every backing starts out holding an earlier request's KV, so a block that was not
copied, or copied to the wrong place, is read as real but wrong data.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

import pytest
import torch

from kvray.errors import BlockIdError, ConfigError, LayoutError
from kvray.layout import BlockOrder
from kvray.memory import Backing
from kvray.models import (
    INDEXER_LAYER,
    LayerKind,
    ModelConfig,
    ReferenceModel,
    decode_text,
    encode_text,
)

NUM_BLOCKS = 32
NEW_TOKENS = 12
TEXT = (
    "The decode worker must see exactly the cache the prefill worker wrote, block by block, "
    "layer by layer, or the answer changes."
)
STALE_TEXT = "An earlier request left its keys and values in every block of this backing. " * 2

MODEL = ReferenceModel()

#: copy(src, dst, layer names, src blocks, dst blocks) -> None: how blocks reach the decode side.
Transfer = Callable[[Backing, Backing, Sequence[str], Sequence[int], Sequence[int]], None]


def prompt(length: int) -> list[int]:
    return encode_text(TEXT)[:length]


def copy_blocks(
    src: Backing,
    dst: Backing,
    src_layer: str,
    dst_layer: str,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
) -> None:
    """Copy whole blocks of one layer, every part, as raw bytes: src_blocks[i] -> dst_blocks[i]."""
    source, target = src.view(src_layer), dst.view(dst_layer)
    parts = src.layout.layer(src_layer).geometry.parts
    for src_block, dst_block in zip(src_blocks, dst_blocks, strict=True):
        for part in range(parts):
            src_block_view = source[src_block] if parts == 1 else source[part, src_block]
            dst_block_view = target[dst_block] if parts == 1 else target[part, dst_block]
            dst_block_view.view(torch.uint8).copy_(src_block_view.view(torch.uint8))


def correct_transfer(
    src: Backing, dst: Backing, layers: Sequence[str], src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> None:
    for name in layers:
        copy_blocks(src, dst, name, name, src_blocks, dst_blocks)


def layer_bytes(backing: Backing, name: str, blocks: Sequence[int]) -> torch.Tensor:
    """A copy of the raw bytes of `blocks` of one layer, every part."""
    view = backing.view(name)
    parts = backing.layout.layer(name).geometry.parts
    chunks = [
        (view[block] if parts == 1 else view[part, block]).reshape(-1).view(torch.uint8).clone()
        for block in blocks
        for part in range(parts)
    ]
    return torch.cat(chunks)


def token_bytes(
    model: ReferenceModel, backing: Backing, name: str, block_table: Sequence[int], num_tokens: int
) -> torch.Tensor:
    """The raw bytes of tokens 0..num_tokens-1 of one layer, in token order."""
    view = backing.view(name)
    parts = backing.layout.layer(name).geometry.parts
    block_size = model.config.block_size
    rows = []
    for position in range(num_tokens):
        block, slot = block_table[position // block_size], position % block_size
        for part in range(parts):
            entry = view[block, slot] if parts == 1 else view[part, block, slot]
            rows.append(entry.reshape(-1).view(torch.uint8))
    return torch.cat(rows)


@functools.cache
def stale_backing(model: ReferenceModel, order: BlockOrder) -> Backing:
    """A backing whose every block holds the KV of an unrelated earlier request."""
    backing = Backing.allocate(model.layout(NUM_BLOCKS, order))
    backing.regions[0].tensor.zero_()
    stale_tokens = encode_text(STALE_TEXT)[: NUM_BLOCKS * model.config.block_size]
    model.prefill(stale_tokens, backing.views, list(range(model.blocks_needed(len(stale_tokens)))))
    return backing


def fresh_backing(model: ReferenceModel, order: BlockOrder) -> Backing:
    template = stale_backing(model, order)
    backing = Backing.allocate(template.layout)
    backing.regions[0].tensor.copy_(template.regions[0].tensor)
    return backing


def block_tables(tag: str, prompt_blocks: int, total_blocks: int) -> tuple[list[int], list[int], list[int]]:
    """Prefill, decode and colocated tables; the decode side's prompt blocks all have new ids."""
    rng = random.Random(tag)
    prefill_table = rng.sample(range(NUM_BLOCKS), total_blocks)
    elsewhere = [block for block in range(NUM_BLOCKS) if block not in prefill_table[:prompt_blocks]]
    decode_table = rng.sample(elsewhere, total_blocks)
    colocated_table = rng.sample(range(NUM_BLOCKS), total_blocks)
    return prefill_table, decode_table, colocated_table


def disaggregated(
    model: ReferenceModel, tokens: list[int], order: BlockOrder, transfer: Transfer, tag: str = ""
) -> tuple[list[int], Backing, list[int]]:
    """Prefill on one backing, `transfer` the prompt's blocks, decode on another."""
    prompt_blocks = model.blocks_needed(len(tokens))
    total_blocks = model.blocks_needed(len(tokens) + NEW_TOKENS)
    prefill_table, decode_table, _ = block_tables(f"{tag}{order}{len(tokens)}", prompt_blocks, total_blocks)
    prefill_side = fresh_backing(model, order)
    first = model.prefill(tokens, prefill_side.views, prefill_table[:prompt_blocks])
    decode_side = fresh_backing(model, order)
    transfer(
        prefill_side,
        decode_side,
        model.layer_names,
        prefill_table[:prompt_blocks],
        decode_table[:prompt_blocks],
    )
    generated = model.decode(first, len(tokens), decode_side.views, decode_table, NEW_TOKENS)
    return generated, decode_side, decode_table


def colocated(
    model: ReferenceModel, tokens: list[int], order: BlockOrder
) -> tuple[list[int], Backing, list[int]]:
    total_blocks = model.blocks_needed(len(tokens) + NEW_TOKENS)
    _, _, table = block_tables(f"{order}{len(tokens)}", model.blocks_needed(len(tokens)), total_blocks)
    backing = fresh_backing(model, order)
    return model.generate(tokens, backing.views, table, NEW_TOKENS), backing, table


# ---- layout ---------------------------------------------------------------------------------


def test_layout_has_all_three_cache_kinds_with_repeated_geometries() -> None:
    layout = MODEL.layout(NUM_BLOCKS)
    assert layout.layer_names == MODEL.layer_names
    geometries = {spec.name: spec.geometry for spec in layout.layers}
    latent = [name for name, g in geometries.items() if g.parts == 1 and g.dtype != "uint8"]
    split_kv = [name for name, g in geometries.items() if g.parts == 2]
    indexer = [name for name, g in geometries.items() if g.dtype == "uint8"]
    assert indexer == [INDEXER_LAYER]
    assert geometries[INDEXER_LAYER].parts == 1
    # The seed bug needs two layers of one geometry: one per-geometry offset serves both.
    assert len(latent) >= 2 and len({geometries[name] for name in latent}) == 1
    assert len(split_kv) >= 2 and len({geometries[name] for name in split_kv}) == 1
    assert len({g.block_size for g in geometries.values()}) == 1
    assert len({g.entry_nbytes for g in geometries.values()}) == 3


def test_block_size_is_configurable() -> None:
    model = ReferenceModel(ModelConfig(block_size=16))
    assert {spec.geometry.block_size for spec in model.layout(4).layers} == {16}
    assert model.blocks_needed(16) == 1 and model.blocks_needed(17) == 2


# ---- determinism ----------------------------------------------------------------------------


def test_generate_is_deterministic() -> None:
    tokens = prompt(23)
    table = list(range(MODEL.blocks_needed(len(tokens) + NEW_TOKENS)))
    first = MODEL.generate(tokens, fresh_backing(MODEL, BlockOrder.LAYER_MAJOR).views, table, NEW_TOKENS)
    again = MODEL.generate(tokens, fresh_backing(MODEL, BlockOrder.LAYER_MAJOR).views, table, NEW_TOKENS)
    twin = ReferenceModel(ModelConfig(seed=0))
    other = ReferenceModel(ModelConfig(seed=1))
    twin_backing = Backing.allocate(twin.layout(NUM_BLOCKS))
    other_backing = Backing.allocate(other.layout(NUM_BLOCKS))
    assert len(first) == NEW_TOKENS
    assert first == again
    assert twin.generate(tokens, twin_backing.views, table, NEW_TOKENS) == first
    assert other.generate(tokens, other_backing.views, table, NEW_TOKENS) != first


def test_same_bits_on_any_thread_count() -> None:
    """A prefill worker and a decode worker may run different torch thread counts."""
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            run = []
            for length in (6, 23, 40):
                backing = fresh_backing(MODEL, BlockOrder.LAYER_MAJOR)
                generated = MODEL.generate(prompt(length), backing.views, list(range(NUM_BLOCKS)), NEW_TOKENS)
                run.append((generated, backing.regions[0].tensor.clone()))
            results.append(run)
    finally:
        torch.set_num_threads(threads)
    for run in results[1:]:
        for (tokens, cache), (expected_tokens, expected_cache) in zip(run, results[0], strict=True):
            assert tokens == expected_tokens
            assert torch.equal(cache, expected_cache)


def test_prefill_agrees_with_decode() -> None:
    """Prefilling the prompt plus j generated tokens predicts generated token j, as decode did."""
    tokens = prompt(13)
    table = list(range(NUM_BLOCKS))
    generated = MODEL.generate(tokens, fresh_backing(MODEL, BlockOrder.LAYER_MAJOR).views, table, NEW_TOKENS)
    for j in (1, 4, NEW_TOKENS - 1):
        backing = fresh_backing(MODEL, BlockOrder.LAYER_MAJOR)
        assert MODEL.prefill(tokens + generated[:j], backing.views, table) == generated[j]


# ---- disaggregated == colocated -------------------------------------------------------------


@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda order: order.value)
@pytest.mark.parametrize("length", [1, MODEL.config.block_size, MODEL.config.block_size + 1, 40])
def test_disaggregated_generation_matches_colocated(order: BlockOrder, length: int) -> None:
    tokens = prompt(length)
    expected, colocated_side, colocated_table = colocated(MODEL, tokens, order)
    generated, decode_side, decode_table = disaggregated(MODEL, tokens, order, correct_transfer)
    assert generated == expected
    # The cache the decode side ends with (prompt and generated tokens) is the colocated one.
    cached_tokens = length + NEW_TOKENS - 1
    for name in MODEL.layer_names:
        assert torch.equal(
            token_bytes(MODEL, decode_side, name, decode_table, cached_tokens),
            token_bytes(MODEL, colocated_side, name, colocated_table, cached_tokens),
        ), name


def test_disaggregated_matches_colocated_with_odd_block_size() -> None:
    model = ReferenceModel(ModelConfig(block_size=3, seed=7))
    for length in (2, 3, 29):
        tokens = prompt(length)
        expected, _, _ = colocated(model, tokens, BlockOrder.BLOCK_MAJOR)
        generated, _, _ = disaggregated(model, tokens, BlockOrder.BLOCK_MAJOR, correct_transfer)
        assert generated == expected


# ---- wrong offsets change the tokens --------------------------------------------------------


def layers_of(kind: LayerKind) -> list[str]:
    return [name for name in MODEL.layer_names if name.endswith(f".{kind.value}")]


def seed_bug(kind: LayerKind) -> Transfer:
    """The second layer of a geometry gets the first one's bytes: one offset for both."""
    first_layer, second_layer = layers_of(kind)[:2]

    def transfer(
        src: Backing,
        dst: Backing,
        layers: Sequence[str],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
    ) -> None:
        for name in layers:
            copy_blocks(src, dst, first_layer if name == second_layer else name, name, src_blocks, dst_blocks)

    return transfer


def indexer_one_block_off(
    src: Backing, dst: Backing, layers: Sequence[str], src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> None:
    rotated = [*dst_blocks[1:], dst_blocks[0]]
    for name in layers:
        copy_blocks(src, dst, name, name, src_blocks, rotated if name == INDEXER_LAYER else dst_blocks)


def indexer_not_sent(
    src: Backing, dst: Backing, layers: Sequence[str], src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> None:
    correct_transfer(src, dst, [name for name in layers if name != INDEXER_LAYER], src_blocks, dst_blocks)


def wrong_block_ids(
    src: Backing, dst: Backing, layers: Sequence[str], src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> None:
    """Off by one in the destination's block table: block i lands where block i-1 is read."""
    everywhere_else = [block for block in range(NUM_BLOCKS) if block not in dst_blocks]
    shifted = [*dst_blocks[1:], everywhere_else[0]]
    correct_transfer(src, dst, layers, src_blocks, shifted)


CORRUPTIONS: dict[str, Transfer] = {
    "seed-bug-mla": seed_bug(LayerKind.MLA),
    "seed-bug-kv": seed_bug(LayerKind.KV),
    "indexer-one-block-off": indexer_one_block_off,
    "indexer-not-sent": indexer_not_sent,
    "wrong-block-ids": wrong_block_ids,
}


@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda order: order.value)
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_misplaced_bytes_change_the_tokens(corruption: str, order: BlockOrder) -> None:
    """Any one prompt may by chance give the same greedy tokens; most must not, and never all."""
    lengths = (17, 26, 33, 40)  # longer than index_topk, so the indexer's choice matters
    changed = 0
    for length in lengths:
        tokens = prompt(length)
        expected, _, _ = disaggregated(MODEL, tokens, order, correct_transfer, tag=corruption)
        corrupted, _, _ = disaggregated(MODEL, tokens, order, CORRUPTIONS[corruption], tag=corruption)
        changed += corrupted != expected
    assert changed >= len(lengths) - 1


# ---- on_layer -------------------------------------------------------------------------------


@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda order: order.value)
def test_on_layer_fires_once_per_layer_right_after_its_kv_is_written(order: BlockOrder) -> None:
    tokens = prompt(21)
    table = random.Random(3).sample(range(NUM_BLOCKS), MODEL.blocks_needed(len(tokens)))
    backing = fresh_backing(MODEL, order)
    before = {name: layer_bytes(backing, name, table) for name in MODEL.layer_names}
    calls: list[str] = []
    at_call: dict[str, dict[str, torch.Tensor]] = {}

    def on_layer(name: str) -> None:
        calls.append(name)
        at_call[name] = {layer: layer_bytes(backing, layer, table) for layer in MODEL.layer_names}

    MODEL.prefill(tokens, backing.views, table, on_layer=on_layer)
    assert calls == list(MODEL.layout(NUM_BLOCKS, order).layer_names)
    after = {name: layer_bytes(backing, name, table) for name in MODEL.layer_names}
    for index, name in enumerate(calls):
        assert not torch.equal(before[name], after[name]), name
        # Written when announced, and layers still to come not yet: a transfer can start now.
        assert torch.equal(at_call[name][name], after[name]), name
        for later in calls[index + 1 :]:
            assert torch.equal(at_call[name][later], before[later]), (name, later)


# ---- checks ---------------------------------------------------------------------------------


def test_block_tables_and_views_are_checked() -> None:
    backing = Backing.allocate(MODEL.layout(4))
    tokens = prompt(9)  # three blocks
    with pytest.raises(BlockIdError):
        MODEL.prefill(tokens, backing.views, [0, 1])
    with pytest.raises(BlockIdError):
        MODEL.prefill(tokens, backing.views, [0, 1, 1])
    with pytest.raises(BlockIdError):
        MODEL.prefill(tokens, backing.views, [0, 1, -1])
    with pytest.raises(BlockIdError):
        MODEL.prefill(tokens, backing.views, [0, 1, 4])
    with pytest.raises(BlockIdError):
        MODEL.decode(1, len(tokens), backing.views, [0, 1, 2], max_new_tokens=5)
    views = dict(backing.views)
    del views[INDEXER_LAYER]
    with pytest.raises(LayoutError):
        MODEL.prefill(tokens, views, [0, 1, 2])
    views[INDEXER_LAYER] = backing.view(INDEXER_LAYER).view(torch.int8)
    with pytest.raises(LayoutError):
        MODEL.prefill(tokens, views, [0, 1, 2])
    with pytest.raises(ConfigError):
        MODEL.prefill([], backing.views, [0])
    with pytest.raises(ConfigError):
        MODEL.prefill([256], backing.views, [0])
    with pytest.raises(ConfigError):
        ModelConfig(num_heads=3, num_kv_heads=2)


def test_byte_tokenizer_round_trips() -> None:
    text = "naïve ☃ text\n"
    assert encode_text(text) == list(text.encode("utf-8"))
    assert decode_text(encode_text(text)) == text
    assert all(0 <= token < MODEL.config.vocab_size for token in encode_text(text))
