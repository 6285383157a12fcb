"""Closing an agent ends every request it still expects, quietly: a wait under way fails with
`AgentNotRunningError`, and a request nobody waits for leaves nothing for asyncio to log."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest
from agent_pair import agent_pair

from kvray.config import Settings
from kvray.errors import AgentNotRunningError
from kvray.layout import BlockOrder, mixed

LAYOUT = mixed(8, BlockOrder.LAYER_MAJOR)


async def test_closing_with_requests_nobody_awaits_logs_nothing(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    # asyncio reports a future whose exception nobody retrieved here, when it is collected.
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        settings = Settings(shm_dir=str(tmp_path), transport="shm")
        async with agent_pair("close", LAYOUT, settings) as (_, decode):
            decode.expect("never-awaited", [1, 2])
            decode.expect("awaited", [3])
            waiter = loop.create_task(decode.wait_for_kv("awaited", timeout=5.0))
            await asyncio.sleep(0)  # the wait is under way when the agent closes
        with pytest.raises(AgentNotRunningError):
            await waiter
        del waiter
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [context.get("message") for context in reported] == []
