"""The vLLM connector's worker side joined to Ray, without vLLM: two `ConnectorWorker`s (what each
vLLM worker process runs) register through host actors with kvray's coordinator, and the
scheduler's hand-offs are played by hand. Per-layer KV tensors in separate storages (not one
pool, so not in a shared-memory file) are one region each and take the push by the `ray`
transport; the bytes land in exactly the reserved blocks and nowhere else."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from kvray.agent.handoff import PUSH_ENDPOINT, HandoffStep, LoadSpec, SendSpec
from kvray.bench.handoff_log import DigestLog
from kvray.config import Settings
from kvray.integrations.vllm.worker import ConnectorWorker
from kvray.wire import Role

pytestmark = pytest.mark.cluster

NUM_BLOCKS, BLOCK_SIZE, LAYERS = 8, 16, 3
CANARY = 0x5A
PAGE = 4096


def separate_caches(fill: int | None) -> dict[str, torch.Tensor]:
    """Per-layer caches [blocks, KV heads, tokens, 2 x head_dim] float32, each in a storage of its
    own with a page of room on both sides (a region is page-aligned and must stay inside it)."""
    caches = {}
    shape = (NUM_BLOCKS, 2, BLOCK_SIZE, 8)
    nbytes = NUM_BLOCKS * 2 * BLOCK_SIZE * 8 * 4
    for layer in range(LAYERS):
        storage = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
        start = PAGE - storage.data_ptr() % PAGE
        tensor = storage[start : start + nbytes].view(torch.float32).view(shape)
        if fill is None:
            tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(layer)))
        else:
            tensor.view(torch.uint8).fill_(fill)
        caches[f"model.layers.{layer}.self_attn"] = tensor
    return caches


def wait_reported(worker: ConnectorWorker, request_id: str, index: int, timeout_s: float = 30.0) -> set[str]:
    """What `finished()` reported for `request_id` (sent: index 0, received: 1; plus failures)."""
    deadline = time.monotonic() + timeout_s
    failed: set[str] = set()
    while time.monotonic() < deadline:
        results = worker.finished()
        failed |= results[3]
        if request_id in results[index]:
            return failed
        time.sleep(0.01)
    raise AssertionError(f"{request_id} was not reported within {timeout_s} s")


def test_separate_storages_take_a_push_over_the_ray_transport(local_ray: Any, tmp_path: Path) -> None:
    settings = Settings(shm_dir=str(tmp_path), transfer_timeout_s=30.0)
    address = ray.get_runtime_context().gcs_address
    log = tmp_path / "digests.jsonl"
    prefill = ConnectorWorker("vllm-p", Role.DECODE, settings, 30.0, ray_address=address)
    prefill.observer = DigestLog(str(log))
    decode = ConnectorWorker("vllm-d", Role.DECODE, settings, 30.0, ray_address=address)
    source, destination = separate_caches(None), separate_caches(CANARY)
    try:
        prefill.register(source, NUM_BLOCKS, BLOCK_SIZE)
        decode.register(destination, NUM_BLOCKS, BLOCK_SIZE)
        assert len(decode.info.regions) == LAYERS  # one region per storage
        held, reserved = (1, 2, 3), (6, 0, 4)
        prefill.begin(HandoffStep(sends={"p-request": SendSpec("p-request", (held,))}))
        load = LoadSpec(
            request_id="d-request",
            prefill_engine=prefill.info.engine_id,
            prefill_incarnation=prefill.info.incarnation,
            prefill_request_id="p-request",
            prefill_node=prefill.info.node_id,
            prefill_inbox=prefill.info.endpoints[PUSH_ENDPOINT],
            block_ids=(reserved,),
            first_block=0,
        )
        decode.begin(HandoffStep(loads={"d-request": load}))
        assert not wait_reported(decode, "d-request", 1)
        wait_reported(prefill, "p-request", 0)
    finally:
        prefill.shutdown()
        decode.shutdown()
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["transport"] == "ray"
    for name, landed in destination.items():
        assert torch.equal(landed[list(reserved)], source[name][list(held)]), name
        others = [block for block in range(NUM_BLOCKS) if block not in reserved]
        assert bool((landed[others].view(torch.uint8) == CANARY).all()), name
