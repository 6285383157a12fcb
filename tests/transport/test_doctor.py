"""`kvray doctor`: every transport with its availability, what pyverbs sees (a machine without an
RDMA device makes pyverbs' get_device_list raise: that reads as "no device"), CUDA, versions."""

from __future__ import annotations

import pytest
from fake_verbs import FakeFabric

from kvray import cli, doctor
from kvray.config import Settings
from kvray.wire import TransportKind


def test_report_names_every_transport_and_what_pyverbs_sees() -> None:
    no_device = doctor.collect(Settings(), verbs_api=FakeFabric(devices=()).api())
    assert list(no_device.transports) == list(TransportKind)
    assert no_device.verbs.import_error is None and no_device.verbs.devices == ()
    text = doctor.format_report(no_device)
    for kind, reason in no_device.transports.items():
        assert kind.value in text
        assert (reason or "available") in text
    assert "RDMA devices: none" in text and "CUDA devices: " in text and "ray " in text

    two = doctor.collect(Settings(), verbs_api=FakeFabric(devices=("fake_rdma0", "fake_rdma1")).api())
    assert two.verbs.devices == ("fake_rdma0", "fake_rdma1")
    assert "RDMA devices: fake_rdma0, fake_rdma1" in doctor.format_report(two)


def test_doctor_command_reports_pyverbs_as_this_machine_has_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for kind in TransportKind:
        assert kind.value in out
    verbs = doctor.verbs_report()
    if verbs.import_error is None:
        assert "pyverbs: " in out and "RDMA devices: " in out
    else:
        assert f"pyverbs: does not import ({verbs.import_error})" in out


def test_report_says_whether_the_c_helpers_are_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvray import plan
    from kvray.transport import _copy

    report = doctor.collect(Settings(), verbs_api=FakeFabric(devices=()).api())
    assert list(report.native.values()) == [_copy.native(), plan.native()]
    monkeypatch.setattr(_copy, "_start_copy", None)
    without = doctor.format_report(doctor.collect(Settings(), verbs_api=FakeFabric(devices=()).api()))
    assert "kvray._copy (CPU copy pool): not built (a slower fallback runs" in without
