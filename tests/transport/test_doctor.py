"""`kvray doctor`: every transport with what it needs and whether this machine can provide it (not
whether the doctor's own process could open it now), what pyverbs sees (a machine without an
RDMA device makes pyverbs' get_device_list raise: that reads as "no device"), CUDA, versions."""

from __future__ import annotations

import socket
import sys

import pytest
from fake_verbs import FakeFabric

from kvray import cli, doctor
from kvray.config import Settings
from kvray.transport import availability, machine_availability, transport_class
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
    from kvray.transport import cpu_copy

    report = doctor.collect(Settings(), verbs_api=FakeFabric(devices=()).api())
    assert list(report.native.values()) == [cpu_copy.native(), plan.native()]
    monkeypatch.setattr(cpu_copy, "_start_copy", None)
    without = doctor.format_report(doctor.collect(Settings(), verbs_api=FakeFabric(devices=()).api()))
    assert "kvray._copy_pool (CPU copy pool): not built (a slower fallback runs" in without


def test_report_says_where_notices_from_other_nodes_go() -> None:
    assert "through Ray calls" in doctor.notices_report(Settings(notice_tcp=False))
    assert "node's Ray address, any free port" in doctor.notices_report(Settings())
    assert "can listen" in doctor.notices_report(Settings(notice_host="127.0.0.1"))
    # A documentation address (TEST-NET-1) is no address of this machine.
    assert "cannot listen there" in doctor.notices_report(Settings(notice_host="192.0.2.1"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        alone = Settings(notice_host="127.0.0.1", notice_port=port)
        assert "every port taken (widen KVRAY_NOTICE_PORTS)" in doctor.notices_report(alone)
        if port < 65535:
            wider = doctor.notices_report(Settings(notice_host="127.0.0.1", notice_port=port, notice_ports=2))
            assert f"ports {port}-{port + 1}" in wider
            assert f"port {port + 1} free, 1 taken before it" in wider or "every port taken" in wider
    text = doctor.format_report(
        doctor.collect(Settings(notice_tcp=False), verbs_api=FakeFabric(devices=()).api())
    )
    assert "notices from other nodes: through Ray calls" in text


def test_ray_is_available_where_ray_imports_though_this_process_runs_no_ray() -> None:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is initialized in this process")
    report = doctor.collect(Settings(), verbs_api=FakeFabric(devices=()).api())
    assert report.transports[TransportKind.RAY] is None
    line = next(line for line in doctor.format_report(report).splitlines() if line.strip().startswith("ray "))
    assert "available; needs only Ray, which kvray starts or joins" in line
    # An agent in this process still cannot open it until Ray runs here.
    assert "not initialized" in str(availability(Settings())[TransportKind.RAY])


def test_ray_is_unavailable_where_ray_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    reason = machine_availability(Settings())[TransportKind.RAY]
    assert reason is not None and "Ray does not import" in reason and "pip install" in reason
    assert availability(Settings())[TransportKind.RAY] == reason, "the run-time check says the same"


def test_every_transport_line_says_what_it_needs() -> None:
    report = doctor.collect(Settings(), verbs_api=FakeFabric(devices=()).api())
    text = doctor.format_report(report)
    for kind in TransportKind:
        needs = transport_class(kind).needs
        assert needs and report.needs[kind] == needs
        assert any(
            line.strip().startswith(kind.value) and f"; needs {needs}" in line for line in text.splitlines()
        )
