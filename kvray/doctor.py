"""`kvray doctor`: what this machine offers kvray, and why a transport cannot run here.

It reports every transport's availability with its reason (`kvray.transport.availability`),
whether pyverbs imports and which RDMA devices it sees (with none, pyverbs' `get_device_list`
raises rather than returning an empty list), the CUDA devices torch sees, whether kvray's C
helpers are built (without them CPU copies run on Python threads and planning in numpy, both
slower), and the versions of Python, Ray, torch and kvray.
"""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass, field

from kvray.config import Settings
from kvray.transport import availability
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
    #: Per transport: None when it can run here, else the reason it cannot.
    transports: dict[TransportKind, str | None]
    verbs: VerbsReport
    cuda_devices: int
    cuda_error: str | None = None
    settings: dict[str, object] = field(default_factory=dict)
    #: Per C helper (`kvray._copy`, `kvray._plan`): whether it is built and imports.
    native: dict[str, bool] = field(default_factory=dict)


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


def collect(settings: Settings | None = None, *, verbs_api: object | None = None) -> DoctorReport:
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
    from kvray.transport import _copy

    return DoctorReport(
        versions=versions,
        transports=availability(settings),
        verbs=verbs_report(verbs_api),
        cuda_devices=cuda_devices,
        cuda_error=cuda_error,
        settings={
            "transport": settings.transport,
            "verbs_device": settings.verbs_device,
            "verbs_port": settings.verbs_port,
        },
        native={"kvray._copy (CPU copy pool)": _copy.native(), "kvray._plan (planner loops)": plan.native()},
    )


def format_report(report: DoctorReport) -> str:
    lines = ["kvray doctor"]
    lines.append(
        "  versions: "
        + ", ".join(f"{name} {value or 'not installed'}" for name, value in report.versions.items())
    )
    lines.append("  transports:")
    for kind, reason in report.transports.items():
        lines.append(f"    {kind.value:<9} {'available' if reason is None else 'unavailable: ' + reason}")
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
    lines.append("  settings: " + ", ".join(f"{name}={value!r}" for name, value in report.settings.items()))
    return "\n".join(lines)


def main(settings: Settings | None = None) -> int:
    """Print the report; exit 0 (the report is the answer, not a verdict)."""
    print(format_report(collect(settings)))
    return 0
