"""Ray Serve LLM's prefill/decode application with a tensor-parallel decode deployment: the
decode engine runs TP 2 (one rank per core of this CPU machine), the prefill engine TP 1, on
`kvray model tiny-llama-gqa` (2 KV heads: one per decode rank). The orchestrator hands each
request to the decode engine first; each decode rank finds the prefill engine through kvray's
coordinator and has its KV head pushed into its blocks. Completions over real HTTP equal a
single TP-1 engine's greedy text; every request's KV is equal head by head as the prefill rank
sent it and as the two decode ranks received it; afterwards no block is held on either replica.

Skipped where vLLM, the model's package or pyarrow (which `ray.serve.llm` imports) is missing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from handoff_logs import failures, head_digests, records
from serve_llm_clients import serving, wait_until_nothing_held
from vllm_installed import require_vllm

require_vllm()
pytest.importorskip("pyarrow", reason="ray.serve.llm needs pyarrow: pip install -e '.[vllm]'")

import httpx  # noqa: E402 - after the check that they are installed
import ray  # noqa: E402 - after the check that they are installed

from kvray.integrations.vllm.model import TINY_LLAMA_GQA, tiny_model  # noqa: E402
from kvray.integrations.vllm.prompts import load_prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("own_ray", "vllm_ready")

MODEL_ID = "tiny-llama-gqa"
NEW_TOKENS = 16
BLOCKS = {"num_gpu_blocks_override": 64}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    extra = {"transfer_timeout_s": 60.0, "lease_s": 60.0, "digest_every": 1}
    yield from serving(
        tmp_path_factory.mktemp("serve-llm-tp"),
        extra,
        model=str(tiny_model(TINY_LLAMA_GQA)),
        model_id=MODEL_ID,
        prefill_options=BLOCKS,
        decode_options={**BLOCKS, "tensor_parallel_size": 2},
    )


def test_completions_through_a_tp2_decode_deployment_equal_a_single_engine(app: dict[str, Any]) -> None:
    prompts = load_prompts()[:8]
    alone = [g.text for g in ray.get(app["reference"].generate.remote(prompts, NEW_TOKENS))]
    served = []
    for prompt in prompts:
        body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
        reply = httpx.post(f"{app['url']}/v1/completions", json=body, timeout=300.0)
        assert reply.status_code == 200, reply.text
        served.append(reply.json()["choices"][0]["text"])
    logs = app["logs"]
    assert served == alone, failures(logs / "p.jsonl", logs / "d.jsonl")
    sent, received = head_digests(logs / "p.jsonl", "sent"), head_digests(logs / "d.jsonl", "received")
    assert len(sent) >= len(prompts) and set(sent) == set(received)
    decode_ranks = {record["tp"][0] for record in records(logs / "d.jsonl") if record["side"] == "received"}
    assert decode_ranks == {0, 1}
    for handoff, digests in sent.items():
        assert len(digests) == 4 * 2 and digests == received[handoff], handoff  # 4 layers x 2 heads
    wait_until_nothing_held()
