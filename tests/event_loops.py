"""The event loops Ray may give an async actor, for tests that must pass on each: asyncio's own,
and uvloop (which Ray uses whenever it is installed, e.g. by ray[serve])."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest


def loop_params() -> list[Any]:
    """`pytest.param`s of a new-loop factory per loop, ids "asyncio" and "uvloop" (skipped
    where uvloop is not installed)."""
    params: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        params.append(pytest.param(None, id="uvloop", marks=pytest.mark.skip(reason="uvloop not installed")))
    else:
        params.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return params


def run_on(new_loop: Callable[[], asyncio.AbstractEventLoop], main: Awaitable[None]) -> None:
    """Run `main` to completion on a fresh loop from `new_loop`, then close it."""
    loop = new_loop()
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()
