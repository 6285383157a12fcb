"""A decode engine's published region is bound to it: an engine that publishes another engine's
shared-memory file as its own region gets no byte written there (the shm writer checks the seal
the file's owner wrote when it registered)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.errors import MetadataError
from kvray.layout import BlockOrder, mixed
from kvray.wire import Role

LAYOUT = mixed(8, BlockOrder.LAYER_MAJOR)


def allocation(agent: KVAgent) -> np.ndarray:
    region = agent.backing.regions[0]
    assert region.allocation is not None
    return region.allocation.numpy()


async def test_an_agent_publishing_another_engines_file_is_refused_before_a_byte_is_written(
    tmp_path: Path,
) -> None:
    settings = Settings(shm_dir=str(tmp_path), transport="shm")
    agents = [
        KVAgent(name, role, LAYOUT, settings=settings, use_coordinator=False)
        for name, role in [("bind-p", Role.PREFILL), ("bind-a", Role.DECODE), ("bind-b", Role.DECODE)]
    ]
    prefill, victim, liar = agents
    try:
        for agent in agents:
            await agent.start()
        allocation(prefill)[:] = 0x11
        for agent in (victim, liar):
            allocation(agent)[:] = 0xA5  # canaries over the whole allocation, slack included
        theirs = victim.info.regions[0]
        forged_region = msgspec.structs.replace(
            liar.info.regions[0],
            handle=theirs.handle,
            handle_offset=theirs.handle_offset,
            length=theirs.length,
        )
        prefill.add_peer(msgspec.structs.replace(liar.info, regions=(forged_region,)))
        reservation = liar.expect("r", [2, 3])

        with pytest.raises(MetadataError, match="holds engine 'bind-a'"):
            await prefill.push(reservation, [0, 1], timeout=5.0)

        assert bool((allocation(victim) == 0xA5).all()), "bytes landed in the other engine's memory"
        assert bool((allocation(liar) == 0xA5).all())
    finally:
        for agent in agents:
            await agent.close()
