"""`kvray doctor --check-integrity`: one request over each transport this machine provides,
between a prefill and a decode worker on Ray, taken only once the decode side's integrity check
passed and compared byte for byte; a transport whose round trip fails is reported with why, and
the command exits 1."""

from __future__ import annotations

from typing import Any

import pytest

from kvray import doctor
from kvray.config import Settings
from kvray.wire import TransportKind


def test_every_transport_here_moves_a_checked_request_and_a_failure_is_reported(
    local_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if this machine also had an RDMA device: that round trip cannot run, and says why.
    provided = doctor.machine_availability

    def with_verbs(settings: Settings) -> dict[TransportKind, Any]:
        return {**provided(settings), TransportKind.VERBS: None}

    monkeypatch.setattr(doctor, "machine_availability", with_verbs)
    results = doctor.check_integrity(Settings())
    by_kind = {trip.transport: trip for trip in results}
    # This machine (no GPU, no RDMA device) provides shared memory and Ray's object store.
    assert set(by_kind) == {TransportKind.SHM, TransportKind.RAY, TransportKind.VERBS}
    for kind in (TransportKind.SHM, TransportKind.RAY):
        assert by_kind[kind].failure is None, by_kind[kind]
        assert by_kind[kind].nbytes == 8 * 4 * 2 * 16 * 8 * 128 * 2  # blocks x layers x K/V x block bytes
    assert by_kind[TransportKind.VERBS].failure
    text = doctor.format_round_trips(results)
    assert "shm       ok:" in text and "ray       ok:" in text and "checksums matched, bytes equal" in text
    assert "verbs     FAILED: " in text
    assert doctor.exit_code(results) == 1
    assert doctor.exit_code([by_kind[TransportKind.SHM]]) == 0
