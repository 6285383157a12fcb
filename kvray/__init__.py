"""kvray: KV-cache transfer for disaggregated LLM inference, as one-sided writes on Ray.

Data flow: layout -> backing -> region -> coordinator -> plan -> transport -> completion ->
agent (what an engine embeds: `KVAgent`).
"""

from kvray.agent import Completion, KVAgent, PushResult
from kvray.config import Settings
from kvray.errors import (
    AgentNotRunningError,
    BackpressureError,
    BlockIdError,
    BoundsError,
    ConfigError,
    GeometryMismatchError,
    KvrayError,
    LayoutError,
    MetadataError,
    NotExpectedError,
    PlanError,
    RegionError,
    RegistrationRefusedError,
    RequestCancelledError,
    StaleIncarnationError,
    TicketError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
    UnknownEngineError,
    UnknownLayerError,
    WireDecodeError,
    WriteFailedError,
)
from kvray.host import AgentHost
from kvray.layout import (
    READY_LAYOUTS,
    BlockOrder,
    Geometry,
    KVLayout,
    LayerPlacement,
    LayerSpec,
    deepseek_v3,
    llama_gqa,
    mixed,
)
from kvray.memory import Backing, MemoryKind, MemoryRegion, RegionSpan
from kvray.plan import OffsetCache, OpTable, TransferPlan, plan_transfer
from kvray.transport.loopback import LoopbackNetwork, LoopbackTransport
from kvray.wire import EngineInfo, RegionDescriptor, Reservation, Role, TransportKind

__version__ = "0.1.0"

__all__ = [
    "READY_LAYOUTS",
    "AgentHost",
    "AgentNotRunningError",
    "BackpressureError",
    "Backing",
    "BlockIdError",
    "BlockOrder",
    "BoundsError",
    "Completion",
    "ConfigError",
    "EngineInfo",
    "Geometry",
    "GeometryMismatchError",
    "KVAgent",
    "KVLayout",
    "KvrayError",
    "LayerPlacement",
    "LayerSpec",
    "LayoutError",
    "LoopbackNetwork",
    "LoopbackTransport",
    "MemoryKind",
    "MemoryRegion",
    "MetadataError",
    "NotExpectedError",
    "OffsetCache",
    "OpTable",
    "PlanError",
    "PushResult",
    "RegionDescriptor",
    "RegionError",
    "RegionSpan",
    "RegistrationRefusedError",
    "RequestCancelledError",
    "Reservation",
    "Role",
    "Settings",
    "StaleIncarnationError",
    "TicketError",
    "TransferPlan",
    "TransferTimeoutError",
    "TransportError",
    "TransportKind",
    "TransportUnavailableError",
    "UnknownEngineError",
    "UnknownLayerError",
    "WireDecodeError",
    "WriteFailedError",
    "deepseek_v3",
    "llama_gqa",
    "mixed",
    "plan_transfer",
]
