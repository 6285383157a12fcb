"""The model-level proof: disaggregated generation (prefill on one actor, KV pushed to another,
decode there) produces exactly the tokens of colocated generation, for every prompt, with the
per-layer KV digests of both sides equal; with the seed bug injected, the decode side refuses the
requests whose KV it wrote over (and, with that check off, decodes them wrong)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kvray.demo import parse, run_demo
from kvray.models import MODEL_PRESETS

#: Every model and block order over shared memory; over the ray transport the model with every
#: kind of layer (MLA latent, split K/V, indexer) in both orders: the other two models' layers are
#: a subset of its, and tests/transport/test_contract.py checks every transport's bytes on every layout.
CASES = [
    *itertools.product(["shm"], sorted(MODEL_PRESETS), ["layer_major", "block_major"]),
    *itertools.product(["ray"], ["mixed"], ["layer_major", "block_major"]),
]


@pytest.mark.parametrize(("transport", "model", "order"), CASES)
def test_disaggregated_equals_colocated(local_ray: None, model: str, order: str, transport: str) -> None:
    """52 prompts (one token, one block, one past a block, random lengths up to 72), half pushed
    layer by layer while prefill computes, half as whole requests."""
    args = parse(
        [
            "--model",
            model,
            "--block-order",
            order,
            "--transport",
            transport,
            "--prompts",
            "52",
            "--max-new-tokens",
            "8",
            "--push",
            "both",
            "--blocks",
            "256",
        ]
    )
    outcomes = asyncio.run(run_demo(args))
    assert len(outcomes) == 52
    lengths = {outcome.prompt_len for outcome in outcomes}
    block_size = MODEL_PRESETS[model].block_size
    assert {1, block_size, block_size + 1} <= lengths
    assert {outcome.layerwise for outcome in outcomes} == {True, False}
    assert {outcome.transport for outcome in outcomes} == {transport}
    mismatched = [(o.prompt_len, o.tokens, o.reference) for o in outcomes if not o.exact]
    assert not mismatched, f"{len(mismatched)} prompts differ, first: {mismatched[0]}"
    assert not [o.bad_layers for o in outcomes if o.bad_layers]


def test_the_injected_seed_bug_is_refused_before_decoding(local_ray: None) -> None:
    """Offsets cached by geometry alone, integrity on (the default): the decode side finds the
    layers the bug wrote over and refuses those requests; none is decoded from wrong KV."""
    args = parse(["--model", "mixed", "--prompts", "12", "--max-new-tokens", "8", "--inject-seed-bug"])
    outcomes = asyncio.run(run_demo(args))
    refused = [o for o in outcomes if o.refused_layers]
    assert len(refused) >= len(outcomes) // 2, "the seed bug should damage most requests"
    assert all(o.exact for o in outcomes if not o.refused_layers), "a request was decoded from wrong KV"
    named = {layer for o in refused for layer in o.refused_layers}
    # Layers 2 (K/V) and 3 (MLA) share a geometry with layers 0 and 1: their blocks never land.
    assert {"model.layers.2.self_attn.kv", "model.layers.3.self_attn.mla"} <= named
    assert "model.layers.0.self_attn.kv" not in named


def test_with_the_content_check_off_placement_still_refuses_the_seed_bug(local_ray: None) -> None:
    """The same with the content check and the checksums off (`--no-integrity`): the placement
    digests (`kvray.placement`, on every transfer) still refuse every request whose layers the
    bug wrote over; none is decoded from wrong KV."""
    args = parse(
        [
            "--model",
            "mixed",
            "--prompts",
            "12",
            "--max-new-tokens",
            "8",
            "--inject-seed-bug",
            "--no-integrity",
        ]
    )
    outcomes = asyncio.run(run_demo(args))
    refused = [o for o in outcomes if o.refused_layers]
    assert len(refused) >= len(outcomes) // 2, "the seed bug should damage most requests"
    assert all(o.exact for o in outcomes if not o.refused_layers), "a request was decoded from wrong KV"
    # The digests say the transfer's layers were misplaced, not which: it names them all.
    named = {layer for o in refused for layer in o.refused_layers}
    assert {"model.layers.2.self_attn.kv", "model.layers.3.self_attn.mla"} <= named
