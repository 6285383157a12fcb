"""`kvray doctor`: what this machine offers kvray, and why a transport cannot run here.

It reports, for every transport, what it needs and whether this machine can provide it, with
the reason where not (`kvray.transport.machine_availability`: what the machine offers the
engines kvray runs on it, not the state of the doctor's own process, which runs no Ray),
whether pyverbs imports and which RDMA devices it sees (with none, pyverbs' `get_device_list`
raises rather than returning an empty list), the CUDA devices torch sees, whether GPU memory can
go over RDMA here (GPUDirect: per GPU whether its driver exports dma-buf, whether the NVIDIA open
kernel module and a peer-memory module are loaded, and one verdict), whether kvray's C
helpers are built (without them CPU copies run on Python threads and planning in numpy, both
slower), where a decode engine here would take notices from other nodes (and whether it can
listen there), and the versions of Python, Ray, torch and kvray.

With `--check-integrity` it also moves one request over each transport this machine provides,
between a prefill and a decode worker on a local Ray (or the cluster `RAY_ADDRESS` names): the
decode side checks the writer's checksums before it takes the request (`kvray.integrity`), and
the bytes of both sides are compared as well.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import ipaddress
import platform
import socket
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvray.config import Settings
from kvray.errors import TransportUnavailableError
from kvray.transport import machine_availability, transport_class
from kvray.transport.verbs.gpudirect import (
    PEER_MEMORY_MODULES,
    GpuDirect,
    GpuDirectReport,
    GpuPath,
    NodeGpuDirect,
    readiness,
)
from kvray.wire import TransportKind


@dataclass(frozen=True)
class VerbsReport:
    """What pyverbs says here."""

    #: None when pyverbs imports (with its libraries), else why not.
    import_error: str | None
    version: str | None = None
    devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class DoctorReport:
    versions: dict[str, str | None]
    #: Per transport: None when this machine can provide it, else the reason it cannot.
    transports: dict[TransportKind, str | None]
    verbs: VerbsReport
    cuda_devices: int
    cuda_error: str | None = None
    settings: dict[str, object] = field(default_factory=dict)
    #: Per C helper (`kvray._copy_pool`, `kvray._plan`): whether it is built and imports.
    native: dict[str, bool] = field(default_factory=dict)
    #: Where a decode engine here takes notices from writers on other nodes, and whether it can.
    notices: str = ""
    #: Per transport with a back-end in this build: what it needs (`Transport.needs`).
    needs: dict[TransportKind, str] = field(default_factory=dict)
    #: Whether GPU memory can be registered for RDMA here (None: not asked).
    gpudirect: GpuDirectReport | None = None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def verbs_report(api: object | None = None) -> VerbsReport:
    """Whether pyverbs imports, and the RDMA devices it lists (`api`: a stand-in for pyverbs)."""
    from kvray.transport.verbs import VerbsApi, list_devices, load_pyverbs

    try:
        verbs_api = api if isinstance(api, VerbsApi) else load_pyverbs()
    except (ImportError, OSError) as error:
        return VerbsReport(import_error=f"{type(error).__name__}: {error}")
    return VerbsReport(import_error=None, version=_version("pyverbs"), devices=tuple(list_devices(verbs_api)))


def rdma_missing(verbs: VerbsReport) -> str | None:
    """Why no RDMA device can be used here, as the GPUDirect verdict names it (None: one can)."""
    if verbs.import_error is not None:
        return "pyverbs does not import, so no RDMA device can be used (see docs/rdma.md)"
    if not verbs.devices:
        return "pyverbs sees no RDMA device"
    return None


def gpudirect_report(verbs: VerbsReport, gpudirect: GpuDirect | None = None) -> GpuDirectReport:
    """GPUDirect RDMA readiness (`gpudirect`: a stand-in for this node's driver and modules)."""
    return readiness(gpudirect or NodeGpuDirect(), rdma_missing(verbs))


def notices_report(settings: Settings) -> str:
    """Where a decode engine started with `settings` takes notices from other nodes; with a
    `notice_host`, whether a port of its range is free there (a bind, closed at once)."""
    if not settings.notice_tcp:
        return "through Ray calls on the engine's actor (KVRAY_NOTICE_TCP=0)"
    first, last = settings.notice_port, settings.notice_port + settings.notice_ports - 1
    if first == 0:
        ports, candidates = "any free port", [0]
    else:
        ports = f"port {first}" if last == first else f"ports {first}-{last}"
        candidates = list(range(first, last + 1))
    host = settings.notice_host
    if not host:
        return f"TCP listener on the node's Ray address, {ports} (set KVRAY_NOTICE_HOST to check one here)"
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    busy = 0
    for port in candidates:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    busy += 1
                    continue
                return f"TCP listener on {host}, {ports}: cannot listen there ({error})"
            free = probe.getsockname()[1]
        return f"TCP listener on {host}, {ports}: can listen (port {free} free, {busy} taken before it)"
    return f"TCP listener on {host}, {ports}: every port taken (widen KVRAY_NOTICE_PORTS)"


def transport_needs() -> dict[TransportKind, str]:
    """What each transport with a back-end in this build needs."""
    needs: dict[TransportKind, str] = {}
    for kind in TransportKind:
        try:
            needs[kind] = transport_class(kind).needs
        except TransportUnavailableError:
            continue  # its unavailability reason says the back-end is missing
    return needs


def collect(
    settings: Settings | None = None,
    *,
    verbs_api: object | None = None,
    gpudirect: GpuDirect | None = None,
) -> DoctorReport:
    settings = settings or Settings.from_env()
    versions = {
        "python": platform.python_version(),
        "kvray": _version("kvray"),
        "ray": _version("ray"),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "msgspec": _version("msgspec"),
    }
    cuda_devices, cuda_error = 0, None
    try:
        import torch

        cuda_devices = torch.cuda.device_count()
    except Exception as error:  # a broken driver or torch build: say so, do not fail
        cuda_error = f"{type(error).__name__}: {error}"
    from kvray import plan
    from kvray.transport import cpu_copy

    verbs = verbs_report(verbs_api)
    return DoctorReport(
        versions=versions,
        transports=machine_availability(settings),
        verbs=verbs,
        cuda_devices=cuda_devices,
        cuda_error=cuda_error,
        settings={
            "transport": settings.transport,
            "verbs_device": settings.verbs_device,
            "verbs_port": settings.verbs_port,
        },
        native={
            "kvray._copy_pool (CPU copy pool)": cpu_copy.native(),
            "kvray._plan (planner loops)": plan.native(),
        },
        notices=notices_report(settings),
        needs=transport_needs(),
        gpudirect=gpudirect_report(verbs, gpudirect),
    )


def format_report(report: DoctorReport) -> str:
    lines = ["kvray doctor"]
    lines.append(
        "  versions: "
        + ", ".join(f"{name} {value or 'not installed'}" for name, value in report.versions.items())
    )
    lines.append("  transports (whether this machine can provide each, and what it needs):")
    for kind, reason in report.transports.items():
        state = "available" if reason is None else "unavailable: " + reason
        needs = report.needs.get(kind)
        lines.append(f"    {kind.value:<9} {state}" + (f"; needs {needs}" if needs else ""))
    verbs = report.verbs
    if verbs.import_error is not None:
        lines.append(f"  pyverbs: does not import ({verbs.import_error})")
    else:
        devices = ", ".join(verbs.devices) if verbs.devices else "none (get_device_list lists no device)"
        lines.append(f"  pyverbs: {verbs.version or 'imported'}; RDMA devices: {devices}")
    for helper, built in report.native.items():
        state = "built" if built else "not built (a slower fallback runs; reinstall kvray with a C compiler)"
        lines.append(f"  {helper}: {state}")
    cuda = f"{report.cuda_devices}" if report.cuda_error is None else f"unknown ({report.cuda_error})"
    lines.append(f"  CUDA devices: {cuda}")
    if report.gpudirect is not None:
        lines.extend(format_gpudirect(report.gpudirect))
    lines.append(f"  notices from other nodes: {report.notices}")
    lines.append("  settings: " + ", ".join(f"{name}={value!r}" for name, value in report.settings.items()))
    return "\n".join(lines)


def format_gpudirect(report: GpuDirectReport) -> list[str]:
    verdict = report.verdict.value + (f": {report.reason}" if report.reason else "")
    lines = [f"  GPUDirect RDMA (GPU memory over verbs): {verdict}"]
    for gpu in report.gpus:
        dmabuf = "dma-buf supported" if gpu.dmabuf else "no dma-buf support"
        if gpu.path is GpuPath.PEER_MEMORY:
            way = f"registered through peer memory ({report.peer_memory})"
        elif gpu.path is GpuPath.DMA_BUF:
            way = "registered through dma-buf"
        else:
            way = "cannot be registered"
        lines.append(f"    GPU {gpu.index}: {dmabuf}; its memory {way}")
    open_module = "loaded" if report.open_kernel_module else "not loaded"
    peer = report.peer_memory or f"none loaded ({', '.join(PEER_MEMORY_MODULES)})"
    lines.append(f"    NVIDIA open kernel module: {open_module}; peer-memory module: {peer}")
    return lines


@dataclass(frozen=True)
class RoundTrip:
    """One request moved over one transport and checked (`check_integrity`)."""

    transport: TransportKind
    #: None when the request landed, its checksums matched and its bytes are equal; else why not.
    failure: str | None
    nbytes: int = 0
    seconds: float = 0.0


#: The round trip's request: blocks of a small Llama-style layout.
_ROUND_TRIP_BLOCKS = 8


def check_integrity(settings: Settings | None = None, address: str | None = None) -> list[RoundTrip]:
    """One request over each transport this machine provides, between a prefill and a decode
    worker (Ray actors), checked by the decode side's integrity check and compared byte for
    byte. Starts a local Ray unless one is running here or `address` (or `RAY_ADDRESS`) names a
    cluster. A transport the machine cannot provide is left out (the report says why)."""
    import os
    import time

    import ray

    from kvray.layout import llama_gqa
    from kvray.memory import MemoryKind
    from kvray.workers import DecodeActor, PrefillActor

    settings = settings or Settings.from_env()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    layout = llama_gqa(num_blocks=32, num_layers=4)
    available = machine_availability(settings)
    results: list[RoundTrip] = []
    for kind in (TransportKind.SHM, TransportKind.CUDA_IPC, TransportKind.VERBS, TransportKind.RAY):
        if available.get(kind) is not None:
            continue
        forced = msgspec.structs.replace(settings, transport=kind.value, integrity_sample_rate=1.0)
        memory = MemoryKind.CUDA if kind is TransportKind.CUDA_IPC else None
        gpus = {"num_gpus": 0.5} if kind is TransportKind.CUDA_IPC else {}
        prefill: Any = PrefillActor.options(**gpus).remote(
            f"doctor-p-{kind.value}", layout, forced, memory=memory
        )
        decode: Any = DecodeActor.options(**gpus).remote(
            f"doctor-d-{kind.value}", layout, forced, memory=memory
        )
        started = time.perf_counter()
        try:
            ray.get([decode.start.remote(), prefill.start.remote()])
            source = ray.get(prefill.allocate.remote("doctor", _ROUND_TRIP_BLOCKS))
            ray.get(prefill.fill_random.remote("doctor", 1))
            sent = ray.get(prefill.read_blocks.remote(source))
            reservation: Any = ray.get(decode.reserve.remote("doctor", _ROUND_TRIP_BLOCKS))
            waiting = decode.wait.remote("doctor", settings.transfer_timeout_s)
            pushed: Any = ray.get(prefill.push.remote(reservation))
            ray.get(waiting)
            landed = ray.get(decode.read_blocks.remote(list(reservation.blocks)))
            stats: dict[str, int] = ray.get(decode.stats.remote())
            checked = stats.get("integrity_checks_ok", 0)
            failure = None
            if checked != 1:
                failure = "the decode side took the request without checking it"
            elif any(not np.array_equal(sent[layer], landed[layer]) for layer in sent):
                failure = "the bytes that landed differ from those sent, though the checksums matched"
            results.append(RoundTrip(kind, failure, pushed.nbytes, time.perf_counter() - started))
        except Exception as error:  # the report names it: a doctor does not stop at one failure
            results.append(RoundTrip(kind, f"{type(error).__name__}: {error}"))
        finally:
            for actor in (prefill, decode):
                with contextlib.suppress(Exception):
                    ray.get(actor.close.remote(), timeout=30)
                ray.kill(actor)
    return results


def format_round_trips(results: list[RoundTrip]) -> str:
    lines = [
        "  integrity round trips (one request per transport, checked by the decode side, bytes compared):"
    ]
    for trip in results:
        if trip.failure is None:
            lines.append(
                f"    {trip.transport.value:<9} ok: {trip.nbytes / 2**20:.2f} MiB, checksums matched, "
                f"bytes equal ({trip.seconds:.1f} s, the workers' start included)"
            )
        else:
            lines.append(f"    {trip.transport.value:<9} FAILED: {trip.failure}")
    if not results:
        lines.append("    none: this machine provides no transport")
    return "\n".join(lines)


def main(settings: Settings | None = None, *, integrity: bool = False) -> int:
    """Print the report; exit 0 (the report is the answer, not a verdict). With `integrity`,
    the round trips too, and exit 1 if one failed."""
    print(format_report(collect(settings)))
    if not integrity:
        return 0
    results = check_integrity(settings)
    print(format_round_trips(results))
    return exit_code(results)


def exit_code(results: list[RoundTrip]) -> int:
    """1 when a round trip failed, else 0."""
    return 1 if any(trip.failure is not None for trip in results) else 0
