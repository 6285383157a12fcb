"""A digest log of hand-offs: a `HandoffObserver` (`kvray.agent.handoff`) that appends one JSON
line per event on one engine, with per-layer digests of the KV each side sent and received, to
compare both sides, and each side's time.

In vLLM, `DigestLogConnector` (`KvrayConnector` with this log) is loaded by module path, with
every key of kvray's connector and two of its own: `digest_log` (the file) and `digest_every`
(hash one request in this many; 1 by default):

    --kv-transfer-config '{"kv_connector": "DigestLogConnector",
                           "kv_connector_module_path": "kvray.bench.handoff_log",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"digest_log": "/tmp/p.jsonl"}}'

(`DIGEST_LOG_CONNECTOR` for `pd.transfer_config` and `serve_llm.build_pd_app`.) The log's lines:

    {"side": "sent", "request": id, "prefill_request": hand-off id, "seconds": s,
     "transport": "shm", "layerwise": false, "tail_seconds": null, "layers": {name: digest},
     "tp": [rank, size], "heads": {"name#head": digest}}

`heads` (models whose KV heads tensor parallelism splits) has one digest per layer and KV head,
numbered across the whole model: engines of different TP sizes are compared head by head.
    {"side": "asked" | "withdrawn" | "preempted" | "receive cancelled", "request": ..., ...}
    {"side": "push failed" | "receive failed", ..., "error": why}
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import zlib
from typing import Any

import torch
import xxhash

from kvray.agent.handoff import BlockTable, HandoffEvent, Moved
from kvray.integrations.vllm.pd import ConnectorClass
from kvray.memory import Backing
from kvray.tensor_parallel import head_runs

#: The digest-logging vLLM connector, as a `kv_transfer_config` names it.
DIGEST_LOG_CONNECTOR = ConnectorClass("DigestLogConnector", __name__)
#: The `kv_connector_extra_config` keys it reads beyond `KvrayConnector`'s.
DIGEST_LOG_KEYS = frozenset({"digest_log", "digest_every"})


class DigestLog:
    """Appends to `path`; hashes one request in `every` (chosen by the hand-off id, so both
    sides hash the same ones), and logs every request's times."""

    def __init__(self, path: str, every: int = 1) -> None:
        self.path = path
        self.every = max(1, every)

    def event(self, event: HandoffEvent, request_id: str, handoff: str, error: str = "") -> None:
        self._append(event, request_id, handoff, **({"error": error} if error else {}))

    async def moved(self, moved: Moved, backing: Backing) -> None:
        # On a thread: the agent's loop keeps moving other requests' KV meanwhile.
        digests, heads = await asyncio.to_thread(self._both, backing, moved.handoff, moved.groups)
        tp = backing.layout.tp
        self._append(
            moved.event,
            moved.request_id,
            moved.handoff,
            seconds=moved.seconds,
            transport=moved.transport.value if moved.transport is not None else None,
            layerwise=moved.layerwise,
            tail_seconds=moved.tail_s,
            layers=digests,
            tp=[tp.rank, tp.size],
            heads=heads,
        )

    def _both(
        self, backing: Backing, handoff: str, groups: BlockTable
    ) -> tuple[dict[str, str], dict[str, str]]:
        return self.digests(backing, handoff, groups), self.head_digests(backing, handoff, groups)

    def digests(self, backing: Backing, handoff: str, groups: BlockTable) -> dict[str, str]:
        """Per-layer digest of a request's blocks (each part's blocks in turn), for one request
        in `every`: by layer for an engine of one KV cache group, by `layer@group` for each group
        of several (a group's blocks in a layer's cache are that group's KV of it)."""
        if zlib.crc32(handoff.encode()) % self.every != 0:
            return {}
        digests = {}
        for group, blocks in enumerate(groups):
            for spec in backing.layout.layers:
                placement = backing.placements[spec.name]
                runs = [
                    (placement.byte_offset(part, block), placement.part_nbytes)
                    for part in range(placement.parts)
                    for block in blocks
                ]
                key = spec.name if len(groups) == 1 else f"{spec.name}@group{group}"
                digests[key] = _digest(backing.regions[placement.region].tensor, runs)
        return digests

    def head_digests(self, backing: Backing, handoff: str, groups: BlockTable) -> dict[str, str]:
        """Per layer and KV head (numbered across the model's ranks), digest of the head's
        bytes in a request's blocks (group after group), for one request in `every`; none for a
        model whose ranks each cache the whole KV (`TensorParallel.kv_heads` 0)."""
        tp = backing.layout.tp
        if not tp.kv_heads or zlib.crc32(handoff.encode()) % self.every != 0:
            return {}
        blocks = [block for group in groups for block in group]
        digests = {}
        for spec in backing.layout.layers:
            placement = backing.placements[spec.name]
            memory = backing.regions[placement.region].tensor
            for head in range(tp.local_heads):
                runs = [
                    (placement.byte_offset(part, block) + offset, nbytes)
                    for block in blocks
                    for part, offset, nbytes in head_runs(spec.geometry, head, 1)
                ]
                digests[f"{spec.name}#{tp.first_head + head}"] = _digest(memory, runs)
        return digests

    def _append(self, event: HandoffEvent, request_id: str, handoff: str, **fields: Any) -> None:
        record = {"side": event.value, "request": request_id, "prefill_request": handoff, **fields}
        with contextlib.suppress(OSError), open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")


def _digest(memory: torch.Tensor, runs: list[tuple[int, int]]) -> str:
    """XXH3-128 of the bytes [start, start + nbytes) of a region's uint8 tensor, run after run
    (a digest to compare two sides' copies, not a defence against anyone). Host memory is read
    through numpy and hashed without letting go of the GIL: a hash that let go of it once per
    call, on a thread beside an engine's busy Python thread, would wait up to a switch interval
    each time to get it back, on the path of the request's load."""
    if memory.device.type == "cpu":
        host = memory.numpy()
        data = b"".join(host[start : start + nbytes].data for start, nbytes in runs)
    else:
        pieces = [memory[start : start + nbytes] for start, nbytes in runs]
        data = torch.cat(pieces).cpu().numpy().tobytes() if pieces else b""
    return xxhash.xxh3_128_hexdigest(data)


class DigestLogging:
    """The digest-log half of `DigestLogConnector`, first in its bases: once `KvrayConnector`
    has built its worker side, a `DigestLog` watches its hand-offs (when `digest_log` names a
    file), before vLLM registers the KV cache and the agent starts."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        parent: Any = super()
        parent.__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        worker = parent.worker
        if worker is not None and extra.get("digest_log"):
            worker.observer = DigestLog(str(extra["digest_log"]), int(extra.get("digest_every", 1)))


@functools.cache
def digest_log_connector() -> type:
    """`DigestLogConnector`: `KvrayConnector` with `DigestLogging` (built on first use, so that
    importing this module imports no vLLM)."""
    from kvray.integrations.vllm.connector import KvrayConnector

    name = DIGEST_LOG_CONNECTOR.name
    keys = KvrayConnector.extra_config_keys | DIGEST_LOG_KEYS
    namespace = {"__module__": __name__, "__qualname__": name, "extra_config_keys": keys}
    return type(name, (DigestLogging, KvrayConnector), namespace)


def __getattr__(name: str) -> type:
    # vLLM loads the connector as `getattr(module, kv_connector)`.
    if name == DIGEST_LOG_CONNECTOR.name:
        return digest_log_connector()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
