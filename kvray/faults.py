"""Deliberate faults, for demonstrations and for tests that prove kvray's checks can fail.

Nothing here is used unless asked for by name (`kvray demo --inject-seed-bug`, or `seed_bug` in
the vLLM connector's `kv_connector_extra_config`, which calls `inject_seed_bug`).
"""

from __future__ import annotations

from typing import Protocol

from kvray.plan import OffsetCache, OffsetKey
from kvray.wire import EngineInfo


class SeedBugOffsetCache(OffsetCache):
    """The bug kvray exists to stop: offsets cached per engine by block geometry alone.

    Two layers of one geometry (dense0, dense1) share one cache entry, so the second is written
    to the first one's address and its own blocks on the decode side are never written.
    """

    def key(self, info: EngineInfo, layer: str) -> OffsetKey:
        return OffsetKey(info.engine_id, info.incarnation, "", info.layout.layer(layer).geometry)


class BuildsAgents(Protocol):
    """Something that builds an agent with `offset_cache` (None: the agent's own)."""

    offset_cache: OffsetCache | None


def inject_seed_bug(target: BuildsAgents) -> None:
    """Make the agent `target` builds next plan with `SeedBugOffsetCache`."""
    target.offset_cache = SeedBugOffsetCache()
