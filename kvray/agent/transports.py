"""The transports one agent writes and receives through (sixth step, seen from an engine):
injected ones first (`KVAgent(..., transports=[...])`), the registry's opened when first needed,
and the choice per peer (`kvray.transport.choose_transport`) kept until the peer is forgotten."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvray.config import Settings
from kvray.errors import TransportUnavailableError
from kvray.memory import MemoryKind
from kvray.metrics import EngineMetrics
from kvray.transport import (
    Transport,
    choose_transport,
    open_transport,
    registering_class,
    transport_class,
    unavailable_reason,
)
from kvray.wire import EngineInfo, TransportKind

#: The registry's transports `auto` may pick, in order of preference.
_AUTO = (TransportKind.CUDA_IPC, TransportKind.SHM, TransportKind.VERBS, TransportKind.RAY)


class TransportSet:
    """An agent's transports, by kind; the agent closes them (injected ones too) when it closes."""

    def __init__(
        self,
        settings: Settings,
        memory: MemoryKind,
        injected: Sequence[Transport] = (),
        metrics: EngineMetrics | None = None,
        *,
        hook: Callable[[Transport], None] | None = None,
    ) -> None:
        self.settings = settings
        #: Sees each transport of the set once, as it is opened or given (`KVAgent`'s
        #: `transport_hook`).
        self.hook = hook
        self.memory = memory
        #: What the transports it opens count into (injected ones keep their own).
        self.metrics = metrics
        self._injected = tuple(injected)
        self._open: dict[TransportKind, Transport] = {}
        for transport in self._injected:
            if transport.kind in self._open:
                raise TransportUnavailableError(
                    f"two {transport.kind.value} transports were given; give one of each kind",
                    transport=transport.kind.value,
                )
            self._open[transport.kind] = self._hooked(transport)
        #: The transports the engine takes writes through (a decode engine's, once it started).
        self.receiving: list[Transport] = []
        self._candidates: tuple[type[Transport], ...] | None = None
        self._chosen: dict[tuple[str, int], TransportKind] = {}

    def get(self, kind: TransportKind, *, to_write: bool = True) -> Transport:
        """The agent's transport of `kind`, opened now if it is not yet: to write, only where it
        can run here (else a kvray error says why); to take a write that has arrived, as it is
        (e.g. a `ray`-transport write handed over by a host that is not a Ray actor)."""
        transport = self._open.get(kind)
        if transport is None:
            opened = (
                open_transport(kind, self.settings, self.metrics)
                if to_write
                else transport_class(kind)(self.settings, self.metrics)
            )
            transport = self._open[kind] = self._hooked(opened)
        return transport

    def _hooked(self, transport: Transport) -> Transport:
        if self.hook is not None:
            self.hook(transport)
        return transport

    def registrar(self) -> Transport:
        """The transport that describes the engine's backing for its published info. Describing
        memory needs nothing of the machine, so it is not checked for availability here."""
        cls = registering_class(self.memory, self._injected)
        transport = self._open.get(cls.kind)
        if transport is None:
            transport = self._open[cls.kind] = self._hooked(cls(self.settings))
        return transport

    def start_receiving(self, decode: bool) -> list[Transport]:
        """The transports a decode engine takes writes through: the one that registered its
        regions, the injected ones, and `verbs` where this machine has an RDMA device."""
        receiving = [self.registrar()]
        if decode:
            receiving += [transport for transport in self._injected if transport not in receiving]
            wants_verbs = self.settings.transport in ("auto", TransportKind.VERBS.value)
            if wants_verbs and unavailable_reason(TransportKind.VERBS, self.settings) is None:
                verbs = self.get(TransportKind.VERBS)
                if verbs not in receiving:
                    receiving.append(verbs)
        self.receiving = receiving
        return receiving

    def choose(self, peer: EngineInfo, node_id: str) -> Transport:
        """The transport that writes into `peer` from here, chosen once per peer incarnation."""
        key = (peer.engine_id, peer.incarnation)
        kind = self._chosen.get(key)
        if kind is None:
            kind = self._choose(peer, node_id)
            self._chosen[key] = kind
        return self.get(kind)

    def _choose(self, peer: EngineInfo, node_id: str) -> TransportKind:
        if self._candidates is None:
            injected = tuple(type(transport) for transport in self._injected)
            registry = tuple(
                transport_class(kind)
                for kind in _AUTO
                if kind not in {cls.kind for cls in injected}
                and unavailable_reason(kind, self.settings) is None
            )
            self._candidates = injected + registry
        try:
            return choose_transport(self.settings.transport, self.memory, node_id, peer, self._candidates)
        except TransportUnavailableError as error:
            self._candidates = None  # what is available may change (e.g. Ray starts): look again
            unavailable = {
                kind.value: reason
                for kind in _AUTO
                if (reason := unavailable_reason(kind, self.settings)) is not None
            }
            if not unavailable:
                raise
            reasons = "; ".join(f"{kind}: {reason}" for kind, reason in unavailable.items())
            raise TransportUnavailableError(f"{error} (unavailable here: {reasons})", **error.facts) from None

    def forget(self, engine_id: str) -> None:
        for key in [key for key in self._chosen if key[0] == engine_id]:
            del self._chosen[key]
        for transport in self._open.values():
            transport.forget(engine_id)

    async def close(self) -> None:
        for transport in self._open.values():
            await transport.close()
        self._open.clear()
        self.receiving = []
