"""`KvrayConnector`: kvray as a vLLM KV connector (v1 interface), loaded by module path:

    --kv-transfer-config '{"kv_connector": "KvrayConnector",
                           "kv_connector_module_path": "kvray.integrations.vllm.connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

Every engine of one P/D deployment (and the proxy or orchestrator in front of them) shares a
hand-off key, read in this order: `handoff_key` in `kv_connector_extra_config` (vLLM prints that
config in its start-up log: prefer the others), `handoff_key_file` (a regular file of mode 0600
holding the 64 hex digits), `KVRAY_HANDOFF_KEY` in the environment. kvray's own helpers
(`pd.transfer_config`, `serve_llm.kv_transfer_config`) put no key in any config; without one
the connector does not start. `kv_connector_extra_config` keys are `kvray.Settings` fields (e.g.
`transfer_timeout_s`, or `transport`: auto, shm or ray, the transport this engine's pushes
take), plus `handoff_key`, `handoff_key_file`, `preempt_wait_s` (the longest
`handle_preemptions` holds vLLM's step for a preempted request's layer copies: 0.1 s; one still
running then aborts that request's push), `lease_s` (how long a prefill engine holds a finished
request's blocks for a decode engine), `ray_address` (a Ray cluster's GCS address: the worker
joins it and registers with kvray's coordinator, so engines on other nodes reach it) and
`node_id` (the Ray node the engine runs on, when its launcher knows it). Measurements and
demonstrations load a subclass by module path instead, with every key above: `DigestLogConnector`
(`kvray.bench.handoff_log`: per-layer digests of the KV each side sent and received, and each
side's time, in the file `digest_log`, one request in `digest_every` hashed) and
`SeedBugConnector` (`kvray.faults`: offsets cached by geometry alone, the bug kvray exists to
stop). This connector refuses their keys, naming the connector that reads them.

The hand-off is kvray's push: the decode side reserves, the prefill side writes into it.
kv_transfer_params are client input: kvray reads only tickets it signed (`tickets`), each with
an expiry (a held ticket's is its lease; an orchestrator's `TICKET_TTL_S`) and, from an
orchestrator, the decode engine it chose; a release needs its own tag, which the decode leg's
copy of the ticket lacks (`decode_leg_params`). Push requests and withdrawals between the
workers carry a proof (an HMAC under the key over the hand-off), and one without it is dropped.

    proxy -> P    request with kv_transfer_params {"do_remote_decode": true}, max_tokens 1
    P scheduler   request_finished: holds the blocks under a hand-off id it mints, returns a
                  signed ticket naming P's engine, incarnation, node, inbox and that id
    proxy -> D    the request with that ticket
    D scheduler   get_num_new_matched_tokens: checks the ticket, the prompt's tokens load
                  asynchronously (a bad ticket: the load fails at once, never an exception);
                  update_state_after_alloc: the blocks vLLM allocated for them
    D worker      expects the request (a Reservation over those blocks) and sends P a
                  PushRequest (fenced by both incarnations, carrying D's token)
    P worker      pushes its blocks of the request into the reservation (plan per layer and
                  geometry, one-sided write, notify); reports the request finished sending
    D worker      wait_for_kv, release; reports it finished receiving (or failed: its blocks
                  are load errors, and vLLM's kv_load_failure_policy applies)
    proxy -> P    only if D refused the request: the ticket back with kvray_release; P frees
                  the held blocks at once

On one node, once a pair of engines has handed off one request the usual way, routine requests
take the prefill engine's native lane (`kvray.agent.lane`, `native_lane`): D's worker asks from
vLLM's thread, a C thread of P checks the ask and copies, and D's `get_finished` reads the answer;
neither engine's event loop runs for it.

The scheduler's lines are `scheduler.ConnectorScheduler`, which hands each step's decisions to
the workers as `metadata.KvrayMetadata`. The workers' lines are `kvray.agent.handoff.Handoff`
(the same for any engine integration); `worker.ConnectorWorker` hands it each step's decisions
and reports its outcomes to vLLM, over the cache `cache_layout` read from vLLM's tensors, and
`stats` what the agent recorded (transfers, bytes, latencies, failures, integrity, holds) to
vLLM's `/metrics`. This class only picks the side by role and hands each hook to it.

Decode first (Ray Serve LLM's orchestrator): the orchestrator mints the id and signs a `load`
ticket for D and a `hold` ticket for P; D asks while P computes, and P pushes each layer as its
forward saves it. A layer-wise request vLLM preempts stops its layer copies before its blocks
are reused (`handle_preemptions`) and is pushed whole once it runs again.

A prefill engine frees a held request's blocks once it has pushed them, or when no decode
engine asked within `lease_s`. A second request under a hand-off id already held, pushed,
dropped or expired is not held (its blocks go back at once). On one node the `shm` transport writes
straight into the decode engine's KV cache (kvray places it in a shared-memory file) and push
requests and notices go through Unix datagram sockets; across nodes both engines join Ray
(`ray_address`), the KV goes by the `ray` transport and the messages through each engine's
host actor.

On GPUs the same: the worker reads vLLM's CUDA caches in any of its KV cache layouts
(`cache_layout.block_runs`), places the decode engine's cache in a CUDA allocation of its own
(`get_mem_pool_context`), `cuda_ipc` writes it on one node and `ray` (staged through pinned host
memory) across nodes, and a layer saved during the forward is copied after a CUDA event recorded
on the forward's stream.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvray.agent.handoff import PUSH_ENDPOINT, rank_engine_id
from kvray.config import handoff_key_from_env
from kvray.integrations.vllm import compat
from kvray.integrations.vllm.cache_layout import cache_config_of, kv_heads_of, tp_rank
from kvray.integrations.vllm.metadata import KvrayHandshake, KvrayMetadata
from kvray.integrations.vllm.scheduler import ConnectorScheduler
from kvray.integrations.vllm.stats import KvrayConnectorStats, KvrayPromMetrics, take_stats
from kvray.integrations.vllm.tickets import key_from
from kvray.integrations.vllm.worker import CONNECTOR_KEYS, PREEMPT_WAIT_S, ConnectorWorker, settings_from
from kvray.layout import TensorParallel
from kvray.wire import Role

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

__all__ = ["KvrayConnector", "KvrayHandshake", "KvrayMetadata"]

log = logging.getLogger("kvray.vllm")


class KvrayConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """kvray's vLLM connector: the scheduler side in the engine-core process, the worker side
    in each worker process (vLLM builds one of each). It supports vLLM's hybrid KV cache
    manager (`SupportsHMA`): a model with several KV cache groups (sliding-window and full
    attention layers) keeps them, and a request's blocks move per group.

    A subclass that reads keys of its own from `kv_connector_extra_config` names them in
    `extra_config_keys` (every other key is a `kvray.Settings` field)."""

    #: The `kv_connector_extra_config` keys this connector reads itself.
    extra_config_keys: ClassVar[frozenset[str]] = CONNECTOR_KEYS

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        kv_heads = kv_heads_of(vllm_config)
        self.engine_id = f"vllm-{transfer.engine_id}"
        self.cache_config = cache_config_of(vllm_config, kv_cache_config)
        compat.check_groups(self.cache_config.group_layers)
        lease_s = float(extra.get("lease_s", 60.0))
        # Both sides read the key: the scheduler reads and writes the tickets (and refuses to
        # start without it), the workers prove their push requests and withdrawals with it.
        key = key_from(extra, handoff_key_from_env())
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(
                self.engine_id, self.cache_config.block_size, key, lease_s=lease_s
            )
            return
        settings = settings_from(extra, self.extra_config_keys)
        # A pure producer exposes nothing writable (least privilege); otherwise the engine
        # takes writes, and pushes too.
        worker_role = Role.PREFILL if transfer.kv_role == "kv_producer" else Role.DECODE
        tp = TensorParallel(size=self.tp_size, rank=tp_rank(self.tp_size), kv_heads=kv_heads)
        self._worker = ConnectorWorker(
            rank_engine_id(self.engine_id, tp.rank),
            worker_role,
            settings,
            lease_s,
            ray_address=extra.get("ray_address"),
            node_id=extra.get("node_id"),
            tp=tp,
            proof=key,
            preempt_wait_s=float(extra.get("preempt_wait_s", PREEMPT_WAIT_S)),
        )
        if not compat.asks_for_allocation_context():
            compat.place_in_one_allocation(self.get_mem_pool_context)

    @property
    def worker(self) -> ConnectorWorker | None:
        """The worker side (None in the scheduler's process): what a subclass instruments
        before vLLM registers the KV cache (`ConnectorWorker.observer`, `offset_cache`)."""
        return self._worker

    # ---- worker side ------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[None] | None:
        return self._worker.allocation_context() if self._worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, self.cache_config)

    def get_handshake_metadata(self) -> KvrayHandshake | None:
        if self._worker is None:
            return None
        info = self._worker.info
        return KvrayHandshake(
            info.engine_id, info.incarnation, info.node_id, info.endpoints.get(PUSH_ENDPOINT, "")
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The step's hand-offs go to the agent here, before the forward: vLLM calls
        # start_load_kv once the forward is launched when no load is synchronous, which on a
        # CPU engine is once it has run, so a held request's push (or a decode engine's ask)
        # would wait a whole forward pass. Handing them over only schedules work on the
        # agent's loop; the forward does not wait for it.
        if self._worker is not None and isinstance(connector_metadata, KvrayMetadata):
            self._worker.begin(connector_metadata.step, connector_metadata.layerwise)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before this step's forward may write into a preempted request's blocks: its layer
        # copies (which read them after save_kv_layer returned) have ended.
        if self._worker is not None and isinstance(kv_connector_metadata, KvrayMetadata):
            self._worker.preempt(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # begun as the metadata was bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's `KVConnectorTransferResults` (`compat.TransferResults` where it has none)."""
        assert self._worker is not None
        sent, received, failed = self._worker.transfer_results()
        return compat.TransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side ---------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every tensor-parallel rank's handshake, by rank: a held request's ticket names them all."""
        assert self._scheduler is not None
        self._scheduler.take_handshakes([metadata.get(rank) for rank in range(self.tp_size)])

    # The hooks below read a request's kv_transfer_params, which a client wrote: an exception
    # from one would end vLLM's engine core, so each ends as that request's own failure (the
    # readers are meant to be total; this is the net under them).

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            return self._scheduler.matched(request, num_computed_tokens)
        except Exception:
            log.exception("kvray: request %s: its kv_transfer_params were not read", _id(request))
            self._scheduler.forget(request)
            return 0, False  # the engine computes the prompt itself

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        try:
            self._scheduler.allocated(request, blocks, num_external_tokens)
        except Exception as error:
            log.exception("kvray: request %s: its load was not set up", _id(request))
            self._scheduler.refuse_load(request, blocks, num_external_tokens, error)

    def build_connector_meta(self, scheduler_output: Any) -> KvrayMetadata:
        assert self._scheduler is not None
        return self._scheduler.step(scheduler_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, block_ids)

    def _finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        try:
            return self._scheduler.finished(request, block_ids)
        except Exception:
            log.exception("kvray: request %s: not held for a decode engine", _id(request))
            self._scheduler.forget(request)
            return False, None  # its blocks go back at once

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.reported(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending()

    # ---- vLLM's connector stats: kvray's figures on vLLM's /metrics (`stats`) -------------

    def get_kv_connector_stats(self) -> KvrayConnectorStats | None:
        return take_stats(self._worker.figures) if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvrayConnectorStats:
        return KvrayConnectorStats.build(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvrayPromMetrics:
        return KvrayPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _id(request: Any) -> str:
    return str(getattr(request, "request_id", "?"))[:200]
