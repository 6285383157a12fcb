"""kvray: KV-cache transfer for disaggregated LLM inference, as one-sided writes on Ray.

Data flow: layout -> backing -> region -> coordinator -> plan -> transport -> completion ->
agent (what an engine embeds: `KVAgent`).

The names here are the ones a user needs: the agent and its results, settings, layouts, the
descriptors an engine publishes and hands over, the in-process loopback transport, the Ray
actors of the minimal example, and the branches of the error tree. Everything else is imported
from the module that defines it (`kvray.plan`, `kvray.memory`, `kvray.errors`, ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvray.agent import Completion, KVAgent, PushResult
from kvray.config import Settings
from kvray.errors import (
    AgentNotRunningError,
    ConfigError,
    KVIntegrityError,
    KvrayError,
    LayoutError,
    MetadataError,
    PlanError,
    RegionError,
    RequestCancelledError,
    TransferTimeoutError,
    TransportError,
)
from kvray.host import AgentHost
from kvray.layout import (
    BlockOrder,
    Geometry,
    KVLayout,
    LayerSpec,
    TensorParallel,
    deepseek_v3,
    llama_gqa,
    mixed,
)
from kvray.memory import Backing, MemoryKind
from kvray.transport.loopback import LoopbackNetwork, LoopbackTransport
from kvray.wire import EngineInfo, Reservation, Role, TransportKind

__version__ = "0.1.0"

#: Names whose module imports Ray, loaded on first use: `import kvray` works without Ray.
_ON_FIRST_USE = {"PrefillActor": "kvray.workers", "DecodeActor": "kvray.workers"}

if TYPE_CHECKING:
    from kvray.workers import DecodeActor, PrefillActor
else:
    # Only at run time: a type checker sees the names above, and still flags unknown ones.

    def __getattr__(name: str) -> Any:
        module = _ON_FIRST_USE.get(name)
        if module is None:
            raise AttributeError(f"module 'kvray' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


__all__ = [
    "AgentHost",
    "AgentNotRunningError",
    "Backing",
    "BlockOrder",
    "Completion",
    "ConfigError",
    "DecodeActor",
    "EngineInfo",
    "Geometry",
    "KVAgent",
    "KVIntegrityError",
    "KVLayout",
    "KvrayError",
    "LayerSpec",
    "LayoutError",
    "LoopbackNetwork",
    "LoopbackTransport",
    "MemoryKind",
    "MetadataError",
    "PlanError",
    "PrefillActor",
    "PushResult",
    "RegionError",
    "RequestCancelledError",
    "Reservation",
    "Role",
    "Settings",
    "TensorParallel",
    "TransferTimeoutError",
    "TransportError",
    "TransportKind",
    "deepseek_v3",
    "llama_gqa",
    "mixed",
]
