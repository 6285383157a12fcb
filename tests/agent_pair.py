"""A prefill and a decode agent wired by hand in this process, for the tests that push between
two agents without Ray (a module of its own name: several test folders each have a conftest)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.layout import KVLayout
from kvray.wire import Role


@contextlib.asynccontextmanager
async def agent_pair(
    name: str, layout: KVLayout, settings: Settings, **options: Any
) -> AsyncIterator[tuple[KVAgent, KVAgent]]:
    """Agents `{name}-p` (prefill) and `{name}-d` (decode), started without a coordinator, the
    prefill told the decode's info; closed on the way out. `options` go to both constructors."""
    prefill = KVAgent(f"{name}-p", Role.PREFILL, layout, settings=settings, use_coordinator=False, **options)
    decode = KVAgent(f"{name}-d", Role.DECODE, layout, settings=settings, use_coordinator=False, **options)
    await prefill.start()
    await decode.start()
    prefill.add_peer(decode.info)
    try:
        yield prefill, decode
    finally:
        await prefill.close()
        await decode.close()
