"""Shared settings and fixtures of the unit tests (pure code: layout, memory, wire, plan)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings

from kvray.memory import Backing
from kvray.wire import EngineInfo, Role, TransportKind

# No deadline: allocation time varies on shared CI machines. Each property test sets its own
# max_examples; this is the default for the rest.
settings.register_profile(
    "kvray-unit",
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("kvray-unit")

MakeInfo = Callable[..., EngineInfo]


def _make_info(
    backing: Backing,
    engine_id: str,
    incarnation: int = 1,
    role: Role = Role.DECODE,
    *,
    transport: TransportKind = TransportKind.SHM,
    remote_writable: bool | None = None,
    node_id: str = "node-a",
) -> EngineInfo:
    """The EngineInfo an engine owning `backing` would publish."""
    if remote_writable is None:
        remote_writable = role is Role.DECODE
    regions = backing.region_descriptors(engine_id, incarnation, transport, remote_writable=remote_writable)
    return backing.engine_info(engine_id, incarnation, role, node_id, regions)


@pytest.fixture(scope="session")
def make_info() -> MakeInfo:
    return _make_info


@pytest.fixture
def closing() -> Iterator[Callable[[Backing], Backing]]:
    """Register a backing to be closed at teardown (shared-memory files must not leak)."""
    backings: list[Backing] = []

    def register(backing: Backing) -> Backing:
        backings.append(backing)
        return backing

    yield register
    for backing in backings:
        backing.close()
