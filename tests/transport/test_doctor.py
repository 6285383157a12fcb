"""`kvray doctor`: every transport with what it needs and whether this machine can provide it (not
whether the doctor's own process could open it now), what pyverbs sees (a machine without an
RDMA device makes pyverbs' get_device_list raise: that reads as "no device"), CUDA, GPUDirect RDMA
readiness (on a FAKE GPU side, tests/transport/fake_verbs.py `FakeGpuDirect`; the real driver's
answers: tests/gpu/test_gpudirect.py), versions."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_verbs import FakeFabric

from kvray import cli, doctor
from kvray.config import Settings
from kvray.errors import RegionError
from kvray.transport import availability, machine_availability, transport_class
from kvray.transport.verbs.gpudirect import GpuPath, NodeGpuDirect, Readiness
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


# ---- GPUDirect RDMA: GPU memory over verbs ------------------------------------------------------


def gpudirect_report(
    dmabuf: tuple[bool, ...],
    *,
    peer_memory: str | None = None,
    open_module: bool = True,
    rdma_devices: tuple[str, ...] = ("fake_rdma0",),
) -> tuple[doctor.DoctorReport, str]:
    """The doctor's report (and its text) on a fake node: GPUs exporting dma-buf or not, the
    modules loaded, the RDMA devices pyverbs lists."""
    fabric = FakeFabric(devices=rdma_devices)
    side = fabric.gpudirect
    side.dmabuf, side.peer_memory, side.open_module = dmabuf, peer_memory, open_module
    report = doctor.collect(Settings(), verbs_api=fabric.api(), gpudirect=side)
    return report, doctor.format_report(report)


def test_gpudirect_ready_through_dmabuf_where_every_gpu_exports_it() -> None:
    report, text = gpudirect_report((True, True), peer_memory="nvidia_peermem")
    gpudirect = report.gpudirect
    assert gpudirect is not None
    assert gpudirect.verdict is Readiness.DMA_BUF and gpudirect.reason is None
    assert [(gpu.index, gpu.dmabuf, gpu.path) for gpu in gpudirect.gpus] == [
        (0, True, GpuPath.DMA_BUF),
        (1, True, GpuPath.DMA_BUF),
    ]
    assert "GPUDirect RDMA (GPU memory over verbs): ready through dma-buf\n" in text
    assert "    GPU 1: dma-buf supported; its memory registered through dma-buf" in text
    assert "NVIDIA open kernel module: loaded; peer-memory module: nvidia_peermem" in text


def test_gpudirect_ready_through_peer_memory_where_a_gpu_lacks_dmabuf() -> None:
    report, text = gpudirect_report((True, False), peer_memory="nv_peer_mem", open_module=False)
    assert report.gpudirect is not None and report.gpudirect.verdict is Readiness.PEER_MEMORY
    assert "GPUDirect RDMA (GPU memory over verbs): ready through peer memory\n" in text
    assert "    GPU 0: dma-buf supported; its memory registered through dma-buf" in text
    assert "    GPU 1: no dma-buf support; its memory registered through peer memory (nv_peer_mem)" in text
    assert "NVIDIA open kernel module: not loaded" in text


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        (
            {"dmabuf": (False, True, False), "open_module": False},
            "GPUs 0, 2 have no dma-buf support (the NVIDIA open kernel module is not loaded) and no "
            "peer-memory module (nvidia_peermem, nv_peer_mem) is loaded: load the NVIDIA open kernel "
            "module (nvidia-open) for dma-buf or the nvidia_peermem module, or keep the KV backing on "
            "the CPU",
        ),
        ({"dmabuf": ()}, "the CUDA driver sees no GPU"),
        ({"dmabuf": (True,), "rdma_devices": ()}, "pyverbs sees no RDMA device"),
        ({"dmabuf": (), "rdma_devices": ()}, "the CUDA driver sees no GPU; pyverbs sees no RDMA device"),
    ],
    ids=["no-driver-support", "no-gpu", "no-rdma-device", "neither"],
)
def test_gpudirect_not_ready_says_why_in_one_sentence(node: dict[str, Any], reason: str) -> None:
    report, text = gpudirect_report(**node)
    assert report.gpudirect is not None
    assert report.gpudirect.verdict is Readiness.NOT_READY and report.gpudirect.reason == reason
    assert f"GPUDirect RDMA (GPU memory over verbs): not ready: {reason}\n" in text
    # Each GPU is still reported as it is.
    for index, dmabuf in enumerate(node["dmabuf"]):
        assert f"    GPU {index}: {'dma-buf supported' if dmabuf else 'no dma-buf support'};" in text


def test_gpudirect_not_ready_where_the_driver_cannot_be_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    fabric = FakeFabric()

    def no_driver() -> int:
        raise RegionError("the CUDA driver library libcuda.so.1 does not load (test)")

    monkeypatch.setattr(fabric.gpudirect, "device_count", no_driver)
    report = doctor.collect(Settings(), verbs_api=FakeFabric(devices=()).api(), gpudirect=fabric.gpudirect)
    assert report.gpudirect is not None and report.gpudirect.gpus == ()
    assert report.gpudirect.reason == (
        "the CUDA driver library libcuda.so.1 does not load (test); pyverbs sees no RDMA device"
    )


def test_gpudirect_reads_the_kernel_modules_from_sys_and_proc(tmp_path: Path) -> None:
    node = NodeGpuDirect(root=str(tmp_path))
    assert not node.open_kernel_module() and node.peer_memory_module() is None
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    version = tmp_path / "proc/driver/nvidia/version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n")
    assert not node.open_kernel_module()
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06\n")
    assert node.open_kernel_module()
    (tmp_path / "sys/module/nv_peer_mem").mkdir(parents=True)
    assert node.peer_memory_module() == "nv_peer_mem"
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    assert node.peer_memory_module() == "nvidia_peermem"


def test_doctor_command_has_a_gpudirect_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "GPUDirect RDMA" in line)
    assert any(f": {verdict.value}" in line for verdict in Readiness)
