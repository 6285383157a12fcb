"""Transports and their registry: back-ends are imported lazily, by name, when first used."""

from __future__ import annotations

import importlib

from kvray.config import Settings
from kvray.errors import TransportUnavailableError
from kvray.transport.base import Peer, Transport
from kvray.wire import TransportKind

_BACKENDS: dict[TransportKind, tuple[str, str]] = {
    TransportKind.SHM: ("kvray.transport.shm", "ShmTransport"),
    TransportKind.RAY: ("kvray.transport.ray", "RayTransport"),
    TransportKind.CUDA_IPC: ("kvray.transport.cuda_ipc", "CudaIpcTransport"),
    TransportKind.VERBS: ("kvray.transport.verbs", "VerbsTransport"),
}


def transport_class(kind: TransportKind) -> type[Transport]:
    """The transport class for `kind`, imported now; unknown or unbuilt ones raise."""
    if kind not in _BACKENDS:
        raise TransportUnavailableError(
            f"transport {kind.value!r} is not part of this kvray build (have: "
            f"{', '.join(k.value for k in _BACKENDS)})",
            transport=kind.value,
        )
    module_name, class_name = _BACKENDS[kind]
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise TransportUnavailableError(
            f"transport {kind.value!r} cannot be imported: {error}", transport=kind.value
        ) from error
    cls: type[Transport] = getattr(module, class_name)
    return cls


def unavailable_reason(kind: TransportKind, settings: Settings) -> str | None:
    """None when `kind` can run here, else the one-sentence reason it cannot."""
    try:
        return transport_class(kind).unavailable_reason(settings)
    except TransportUnavailableError as error:
        return str(error)


def availability(settings: Settings) -> dict[TransportKind, str | None]:
    """Every transport kvray knows, with the reason it cannot run here (None: it can)."""
    return {kind: unavailable_reason(kind, settings) for kind in TransportKind}


def open_transport(kind: TransportKind, settings: Settings) -> Transport:
    reason = unavailable_reason(kind, settings)
    if reason is not None:
        raise TransportUnavailableError(
            f"transport {kind.value!r} is unavailable: {reason}", transport=kind.value
        )
    return transport_class(kind)(settings)


__all__ = ["Peer", "Transport", "availability", "open_transport", "transport_class", "unavailable_reason"]
