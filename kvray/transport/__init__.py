"""Transports, their registry and the choice between them: back-ends are imported lazily, by
name, when first used; `choose_transport` is a pure function of the capability flags."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from kvray.config import Settings
from kvray.errors import TransportUnavailableError
from kvray.memory import MemoryKind
from kvray.metrics import EngineMetrics
from kvray.transport.base import Peer, PeerCache, Reach, Receiver, Transport
from kvray.wire import EngineInfo, TransportKind

#: Every back-end, in the order `auto` prefers them.
_BACKENDS: dict[TransportKind, tuple[str, str]] = {
    TransportKind.CUDA_IPC: ("kvray.transport.cuda_ipc", "CudaIpcTransport"),
    TransportKind.SHM: ("kvray.transport.shm", "ShmTransport"),
    TransportKind.VERBS: ("kvray.transport.verbs", "VerbsTransport"),
    TransportKind.RAY: ("kvray.transport.ray", "RayTransport"),
    TransportKind.LOOPBACK: ("kvray.transport.loopback", "LoopbackTransport"),
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
    return _reason(kind, lambda cls: cls.unavailable_reason(settings))


def availability(settings: Settings) -> dict[TransportKind, str | None]:
    """Every transport kvray knows, with the reason an agent in this process cannot open it
    now (None: it can)."""
    return {kind: unavailable_reason(kind, settings) for kind in TransportKind}


def machine_availability(settings: Settings) -> dict[TransportKind, str | None]:
    """Every transport kvray knows, with what this machine lacks to provide it to the engines
    kvray runs here (None: nothing; `Transport.machine_unavailable_reason`)."""
    return {
        kind: _reason(kind, lambda cls: cls.machine_unavailable_reason(settings)) for kind in TransportKind
    }


def _reason(kind: TransportKind, ask: Callable[[type[Transport]], str | None]) -> str | None:
    """`ask`'s answer for `kind`'s class, or why that class cannot be imported."""
    try:
        return ask(transport_class(kind))
    except TransportUnavailableError as error:
        return str(error)


def open_transport(
    kind: TransportKind, settings: Settings, metrics: EngineMetrics | None = None
) -> Transport:
    reason = unavailable_reason(kind, settings)
    if reason is not None:
        raise TransportUnavailableError(
            f"transport {kind.value!r} is unavailable: {reason}", transport=kind.value
        )
    return transport_class(kind)(settings, metrics)


#: The registry's transport that describes each kind of backing.
_REGISTRARS: dict[MemoryKind, TransportKind] = {
    MemoryKind.SHM: TransportKind.SHM,
    MemoryKind.CUDA: TransportKind.CUDA_IPC,
    MemoryKind.CPU: TransportKind.RAY,
}


def registering_class(memory: MemoryKind, injected: Sequence[Transport] = ()) -> type[Transport]:
    """The transport whose descriptors an engine with a `memory` backing publishes: the first
    injected one that registers such backings, else the registry's."""
    for transport in injected:
        if memory in transport.registers:
            return type(transport)
    return transport_class(_REGISTRARS[memory])


def destination_kinds(peer: EngineInfo) -> frozenset[MemoryKind]:
    """The memory a peer's regions may live in, as the transports that registered them say."""
    kinds: frozenset[MemoryKind] = frozenset()
    for registrar in {region.transport for region in peer.regions}:
        kinds |= transport_class(registrar).registers
    return kinds


def choose_transport(
    setting: str,
    local_memory: MemoryKind,
    local_node: str,
    peer: EngineInfo,
    candidates: Sequence[type[Transport]],
) -> TransportKind:
    """Which transport writes from a `local_memory` backing on `local_node` into `peer`.

    A transport named by `setting` (`Settings.transport`) is taken as it is; `auto` takes the
    first of `candidates` (in order of preference) whose reach covers the two nodes, which
    reads the local backing's memory and writes the peer's, and that the peer published what
    it needs for (`Transport.accepts`)."""
    if setting != "auto":
        return TransportKind(setting)
    same_node = peer.node_id == local_node
    destination = destination_kinds(peer)
    for cls in candidates:
        if cls.reach is Reach.SAME_NODE and not same_node:
            continue
        if cls.reach is Reach.OTHER_NODES and same_node:
            continue
        if local_memory not in cls.source_kinds or not cls.accepts(peer):
            continue
        if not destination <= cls.destination_kinds:
            continue
        return cls.kind
    raise TransportUnavailableError(
        f"no transport here writes from a {local_memory.value} backing into engine "
        f"{peer.engine_id!r} ({'same' if same_node else 'another'} node, memory "
        f"{', '.join(sorted(kind.value for kind in destination))}); tried "
        f"{', '.join(cls.kind.value for cls in candidates) or 'none'}",
        engine_id=peer.engine_id,
    )


__all__ = [
    "Peer",
    "PeerCache",
    "Reach",
    "Receiver",
    "Transport",
    "availability",
    "choose_transport",
    "destination_kinds",
    "machine_availability",
    "open_transport",
    "registering_class",
    "transport_class",
    "unavailable_reason",
]
