"""The transport registry: every TransportKind is accounted for, each back-end is what its kind
says, and a transport that cannot run here says why in one sentence and refuses to open."""

from __future__ import annotations

import re

import pytest

from kvray.config import Settings
from kvray.errors import TransportUnavailableError
from kvray.memory import MemoryKind
from kvray.transport import Transport, availability, open_transport, transport_class, unavailable_reason
from kvray.transport.base import Reach
from kvray.wire import TransportKind


def assert_one_sentence(reason: object) -> None:
    assert isinstance(reason, str) and reason.strip(), f"not a reason: {reason!r}"
    assert "\n" not in reason, f"more than one line: {reason!r}"
    assert not re.search(r"[.!?]\s+[A-Z]", reason), f"more than one sentence: {reason!r}"


def built(kind: TransportKind) -> bool:
    try:
        transport_class(kind)
    except TransportUnavailableError:
        return False
    return True


def test_availability_accounts_for_every_kind() -> None:
    settings = Settings()
    report = availability(settings)
    assert list(report) == list(TransportKind)
    for kind, reason in report.items():
        assert reason == unavailable_reason(kind, settings)
        if reason is not None:
            assert_one_sentence(reason)
    assert {TransportKind.SHM, TransportKind.RAY} <= {kind for kind in TransportKind if built(kind)}


@pytest.mark.parametrize(
    "kind", [kind for kind in TransportKind if not built(kind)], ids=lambda kind: kind.value
)
def test_kind_without_a_back_end_says_why_and_does_not_open(kind: TransportKind) -> None:
    reason = availability(Settings())[kind]
    assert_one_sentence(reason)
    assert kind.value in str(reason)
    with pytest.raises(TransportUnavailableError) as raised:
        open_transport(kind, Settings())
    assert raised.value.transport == kind.value
    with pytest.raises(TransportUnavailableError):
        transport_class(kind)


@pytest.mark.parametrize("kind", [kind for kind in TransportKind if built(kind)], ids=lambda kind: kind.value)
def test_back_end_is_what_its_kind_says(kind: TransportKind) -> None:
    cls = transport_class(kind)
    assert issubclass(cls, Transport) and cls.kind is kind
    assert isinstance(cls.reach, Reach)
    for kinds in (cls.source_kinds, cls.destination_kinds):
        assert kinds and all(isinstance(memory, MemoryKind) for memory in kinds)
    assert all(isinstance(memory, MemoryKind) for memory in cls.registers)
    assert isinstance(cls.needs, str) and cls.needs
    for reason in (cls.unavailable_reason(Settings()), cls.machine_unavailable_reason(Settings())):
        if reason is not None:
            assert_one_sentence(reason)


def test_shm_without_a_shared_memory_folder_does_not_open() -> None:
    settings = Settings(shm_dir="/nonexistent/kvray-shm")
    reason = availability(settings)[TransportKind.SHM]
    assert_one_sentence(reason)
    assert "/nonexistent/kvray-shm" in str(reason)
    with pytest.raises(TransportUnavailableError, match="shm"):
        open_transport(TransportKind.SHM, settings)
    assert isinstance(open_transport(TransportKind.SHM, Settings()), transport_class(TransportKind.SHM))


def test_ray_outside_ray_does_not_open() -> None:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is initialized in this process")
    reason = availability(Settings())[TransportKind.RAY]
    assert_one_sentence(reason)
    assert "Ray" in str(reason)
    with pytest.raises(TransportUnavailableError, match="ray"):
        open_transport(TransportKind.RAY, Settings())
