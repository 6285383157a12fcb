"""What a prefill engine's hand-off records (`kvray.agent.handoff`): a hold that no decode engine
asked for within its lease counts as one lease expired, and the blocks held for decode engines
are recorded as each hold begins and ends."""

from __future__ import annotations

from pathlib import Path

from kvray.agent.handoff import NO_BLOCK, Handoff, LoadSpec, SendSpec
from kvray.agent.kvagent import KVAgent
from kvray.config import Settings
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.metrics import BLOCKS_HELD, LEASES_EXPIRED, MemorySink
from kvray.wire import Role

LAYOUT = KVLayout(
    layers=(LayerSpec(name="layer0", geometry=Geometry(block_size=4, entry_shape=(8,), dtype="float32")),),
    num_blocks=8,
)


class Freed:
    """`HandoffReports`: the held requests whose blocks may go, in order."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    def sent(self, request_id: str) -> None:
        self.requests.append(request_id)

    def loaded(self, spec: LoadSpec, *, failed: bool) -> None:
        raise AssertionError("a prefill engine loads nothing here")


async def test_an_expired_lease_is_counted_and_the_blocks_held_follow_the_holds(tmp_path: Path) -> None:
    sink = MemorySink()
    settings = Settings(shm_dir=str(tmp_path), transport="shm")
    agent = KVAgent(
        "lease-p", Role.PREFILL, LAYOUT, settings=settings, use_coordinator=False, metrics_sink=sink
    )
    freed = Freed()
    handoff = Handoff(agent, freed, lease_s=60.0)
    try:
        # Two groups; the window's past (NO_BLOCK) is not a block held.
        handoff.hold(SendSpec("kept", ((1, 2, NO_BLOCK), (3,)), key="a"))
        assert sink.value(BLOCKS_HELD.name, engine="lease-p") == 3
        handoff.expire()
        assert sink.value(LEASES_EXPIRED.name) == 0
        handoff.prefill.lease_s = 0.0  # the next hold's lease has ended by the next check
        handoff.hold(SendSpec("unasked", ((4, 5),), key="b"))
        assert sink.value(BLOCKS_HELD.name) == 5
        handoff.expire()
        assert freed.requests == ["unasked"]
        assert sink.value(LEASES_EXPIRED.name, engine="lease-p") == 1
        assert sink.value(BLOCKS_HELD.name, engine="lease-p") == 3
        assert agent.stats["leases_expired"] == 1
        # A hold released by its proxy is freed, not expired.
        handoff.release("a")
        assert freed.requests == ["unasked", "kept"]
        assert sink.value(LEASES_EXPIRED.name) == 1
        assert sink.value(BLOCKS_HELD.name) == 0
    finally:
        handoff.close()
        await agent.close()
