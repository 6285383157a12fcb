"""What `KvrayConnector`'s two sides tell each other through vLLM: a worker's handshake to its
scheduler once its agent has started (`KvrayHandshake`), and each step's hand-offs from the
scheduler to the workers (`KvrayMetadata`). vLLM pickles both between processes; the workers
only read the metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvray.agent.handoff import HandoffStep, LayerwiseSpec


@dataclass
class KvrayHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells its scheduler once its agent has started."""

    engine_id: str
    incarnation: int
    #: The engine's Ray node ("" outside Ray) and its push-request inbox: what a decode engine
    #: on the same node needs to ask it to push (the rest of its info stays inside kvray).
    node: str
    inbox: str


@dataclass
class KvrayMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's hand-offs, from the scheduler to the workers."""

    #: The hand-offs the scheduler decided this step.
    step: HandoffStep = field(default_factory=HandoffStep)
    #: Requests whose whole prompt this step computes, while a decode engine may wait for
    #: their KV: their layers are pushed as the forward saves them.
    layerwise: dict[str, LayerwiseSpec] = field(default_factory=dict)
    #: Prefill: hand-off ids of layer-wise requests vLLM preempted this step
    #: (`handle_preemptions`): their layer pushes end before their blocks are reused.
    preempted: set[str] = field(default_factory=set)
