"""Every error kvray raises, one tree under `KvrayError`.

    KvrayError
    ├── ConfigError                  a setting is invalid
    ├── AgentNotRunningError         the agent has not started, or has closed
    ├── RequestCancelledError        the request was cancelled or released while it waited
    ├── LayoutError (ValueError)     a geometry or layout cannot describe a KV cache
    ├── RegionError                  memory cannot be registered without breaking invariant 1
    │   └── BoundsError              a write would leave its region (invariant 2)
    ├── MetadataError                a peer's description is missing, stale or malformed
    │   ├── UnknownEngineError
    │   ├── UnknownLayerError        (never a fallback to offset 0: invariant 3)
    │   ├── StaleIncarnationError    (invariant 4)
    │   ├── RegistrationRefusedError an engine id is held by another live registrant
    │   ├── WireDecodeError (ValueError)  bytes from a peer are not one kvray message
    │   └── TicketError (ValueError)  hand-off parameters are malformed or not signed by kvray
    ├── PlanError (ValueError)       a transfer request cannot be planned
    │   ├── BlockIdError
    │   └── GeometryMismatchError
    └── TransportError
        ├── TransportUnavailableError
        ├── WriteFailedError
        │   └── NotExpectedError     the decode engine no longer expects the request
        ├── TransferTimeoutError (TimeoutError)   (invariant 5)
        ├── BackpressureError        too much work is already queued
        └── KVIntegrityError         the KV that landed is not the KV that was sent (layers named)

Each error keeps the facts needed to act on it in `facts` (engine, layer, offsets, ...),
also readable as attributes, and survives pickling, so it crosses Ray task boundaries whole.
"""

from __future__ import annotations

from typing import Any


def _restore(cls: type[KvrayError], message: str, facts: dict[str, Any]) -> KvrayError:
    error = cls.__new__(cls)
    KvrayError.__init__(error, message, **facts)
    return error


class KvrayError(Exception):
    """Base of every kvray error: a message for people and `facts` for code."""

    def __init__(self, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.message = message
        self.facts: dict[str, Any] = dict(facts)

    def __getattr__(self, name: str) -> Any:
        facts = self.__dict__.get("facts")
        if facts is not None and name in facts:
            return facts[name]
        raise AttributeError(name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.message, self.facts))

    def __str__(self) -> str:
        return self.message


class AgentNotRunningError(KvrayError):
    """The agent has not started (`await agent.start()`), or has closed."""


class RequestCancelledError(KvrayError):
    """The request was cancelled or released while its KV was awaited."""


class ConfigError(KvrayError, ValueError):
    """A setting (argument or KVRAY_* variable) is invalid."""


class LayoutError(KvrayError, ValueError):
    """A geometry or layout is empty, zero-sized, or names an unknown dtype."""


class RegionError(KvrayError):
    """A memory region would break invariant 1 (inside the allocation, aligned, covering)."""


class BoundsError(RegionError):
    """A write op would touch bytes outside its region."""


class MetadataError(KvrayError):
    """A peer's engine description is missing, stale or inconsistent: it decoded, but cannot
    be honoured as a whole (`kvray.validation.validate_engine_info`)."""


class UnknownEngineError(MetadataError):
    """No engine with that id is registered."""


class UnknownLayerError(MetadataError):
    """A layer name is not part of an engine's layout."""


class StaleIncarnationError(MetadataError):
    """A message or descriptor names an incarnation the engine no longer has."""


class RegistrationRefusedError(MetadataError):
    """The coordinator refused to replace or remove an engine's entry: another live agent holds
    it, or the same incarnation was registered again with other contents."""


class WireDecodeError(MetadataError, ValueError):
    """Bytes from a peer are not a valid kvray message: too large, not msgpack, nested too
    deep, or a field missing, mistyped or out of its own range (see `kvray.wire`)."""


class TicketError(MetadataError, ValueError):
    """A request's hand-off parameters (vLLM's `kv_transfer_params`, client input) are
    malformed, or their tag does not verify under the engines' shared hand-off key (see
    `kvray.integrations.vllm.tickets`)."""


class PlanError(KvrayError, ValueError):
    """A transfer request cannot be planned as given."""


class BlockIdError(PlanError):
    """Block ids are negative, out of range, duplicated or of mismatched length."""


class GeometryMismatchError(PlanError):
    """The two sides describe a layer with different geometries."""


class TransportError(KvrayError):
    """A transport could not move the bytes."""


class TransportUnavailableError(TransportError):
    """A transport cannot run here; the message says why in one sentence."""


class WriteFailedError(TransportError):
    """Issuing or completing a write failed."""


class NotExpectedError(WriteFailedError):
    """The decode engine does not expect the request (any more), or not under this reservation:
    its wait ended, it was released, or the reservation's token is wrong. Nothing was written;
    the engine itself is fine. Reserve again to retry."""


class TransferTimeoutError(TransportError, TimeoutError):
    """A transfer, lookup or wait passed its deadline."""


class KVIntegrityError(TransportError):
    """The bytes of some layers, as they landed in the decode engine's blocks, differ from what
    the writer read for the push (`layers` names them): the request is not decoded from them."""


class BackpressureError(TransportError):
    """More work is queued than the configured bound allows."""


__all__ = [
    "AgentNotRunningError",
    "BackpressureError",
    "BlockIdError",
    "BoundsError",
    "ConfigError",
    "GeometryMismatchError",
    "KVIntegrityError",
    "KvrayError",
    "LayoutError",
    "MetadataError",
    "NotExpectedError",
    "PlanError",
    "RegionError",
    "RegistrationRefusedError",
    "RequestCancelledError",
    "StaleIncarnationError",
    "TicketError",
    "TransferTimeoutError",
    "TransportError",
    "TransportUnavailableError",
    "UnknownEngineError",
    "UnknownLayerError",
    "WireDecodeError",
    "WriteFailedError",
]
