"""A digest log of hand-offs: a `HandoffObserver` (`kvray.agent.handoff`) that appends one JSON
line per event on one engine, with per-layer digests of the KV each side sent and received, to
compare both sides, and each side's time (the vLLM connector's `digest_log`).

    {"side": "sent", "request": id, "prefill_request": hand-off id, "seconds": s,
     "transport": "shm", "layerwise": false, "tail_seconds": null, "layers": {name: sha256},
     "tp": [rank, size], "heads": {"name#head": sha256}}

`heads` (models whose KV heads tensor parallelism splits) has one digest per layer and KV head,
numbered across the whole model: engines of different TP sizes are compared head by head.
    {"side": "asked" | "withdrawn" | "preempted" | "receive cancelled", "request": ..., ...}
    {"side": "push failed" | "receive failed", ..., "error": why}
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import zlib
from typing import Any

import torch

from kvray.agent.handoff import BlockTable, HandoffEvent, Moved
from kvray.memory import Backing
from kvray.tensor_parallel import head_runs


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
        digests = await asyncio.to_thread(self.digests, backing, moved.handoff, moved.groups)
        heads = await asyncio.to_thread(self.head_digests, backing, moved.handoff, moved.groups)
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

    def digests(self, backing: Backing, handoff: str, groups: BlockTable) -> dict[str, str]:
        """Per-layer SHA-256 of a request's blocks, for one request in `every`: by layer for an
        engine of one KV cache group, by `layer@group` for each group of several (a group's
        blocks in a layer's cache are that group's KV of it)."""
        if zlib.crc32(handoff.encode()) % self.every != 0:
            return {}
        digests = {}
        for group, blocks in enumerate(groups):
            index = torch.as_tensor(list(blocks), dtype=torch.long)
            for name, view in backing.views.items():
                block_axis = view.dim() - 3  # [(2,) blocks, tokens, entry]
                picked = view.index_select(block_axis, index).contiguous().view(torch.uint8)
                key = name if len(groups) == 1 else f"{name}@group{group}"
                digests[key] = hashlib.sha256(picked.numpy().tobytes()).hexdigest()
        return digests

    def head_digests(self, backing: Backing, handoff: str, groups: BlockTable) -> dict[str, str]:
        """Per layer and KV head (numbered across the model's ranks), SHA-256 of the head's
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
                runs = head_runs(spec.geometry, head, 1)
                pieces = [
                    memory[start : start + nbytes]
                    for block in blocks
                    for part, offset, nbytes in runs
                    for start in (placement.byte_offset(part, block) + offset,)
                ]
                data = torch.cat(pieces).cpu().numpy().tobytes() if pieces else b""
                digests[f"{spec.name}#{tp.first_head + head}"] = hashlib.sha256(data).hexdigest()
        return digests

    def _append(self, event: HandoffEvent, request_id: str, handoff: str, **fields: Any) -> None:
        record = {"side": event.value, "request": request_id, "prefill_request": handoff, **fields}
        with contextlib.suppress(OSError), open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")
