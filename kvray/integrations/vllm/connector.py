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
`node_id` (the Ray node the engine runs on, when its launcher knows it). For measurements and
demonstrations: `digest_log` (a file to append per-layer digests of the KV each side sent and received, to
compare them, and each side's time: `kvray.bench.handoff_log`), `digest_every` (hash one
request in this many) and `seed_bug` (plan with offsets cached by geometry alone: the bug
kvray exists to stop, injected from `kvray.faults`).

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

The workers' lines are `kvray.agent.handoff.Handoff` (the same for any engine integration);
`worker` hands it each step's decisions and reports its outcomes to vLLM, and `stats` what the
agent recorded (transfers, bytes, latencies, failures, integrity, holds) to vLLM's `/metrics`.

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
(`worker.block_runs`), places the decode engine's cache in a CUDA allocation of its own
(`get_mem_pool_context`), `cuda_ipc` writes it on one node and `ray` (staged through pinned host
memory) across nodes, and a layer saved during the forward is copied after a CUDA event recorded
on the forward's stream.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvray.agent.handoff import (
    NO_BLOCK,
    PUSH_ENDPOINT,
    BlockTable,
    HandoffStep,
    LayerwiseSpec,
    LoadSpec,
    SendSpec,
    rank_engine_id,
    table_blocks,
)
from kvray.config import handoff_key_from_env
from kvray.errors import ConfigError, TicketError
from kvray.integrations.vllm.stats import KvrayConnectorStats, KvrayPromMetrics, take_stats
from kvray.integrations.vllm.tickets import (
    HANDOFF,
    PREFILL_ENGINE,
    PREFILL_REQUEST,
    RELEASE,
    HandoffKey,
    Held,
    Load,
    expiry,
    held_params,
    key_from,
    mint_handoff,
    read_hold,
    read_load,
    read_release,
)
from kvray.integrations.vllm.worker import CONNECTOR_KEYS, PREEMPT_WAIT_S, ConnectorWorker, settings_from
from kvray.layout import TensorParallel, ceil_div
from kvray.wire import Role

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

log = logging.getLogger("kvray.vllm")


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
    #: Worker side: the step's layer-wise requests have been handed to the worker.
    layerwise_begun: bool = False
    #: Prefill: hand-off ids of layer-wise requests vLLM preempted this step
    #: (`handle_preemptions`): their layer pushes end before their blocks are reused.
    preempted: set[str] = field(default_factory=set)


def _groups(block_ids: Any) -> BlockTable:
    """A request's block ids as vLLM gives them (one list per KV cache group, or one flat list
    to a connector of one group) as a block table: vLLM's null block (0, which vLLM never
    hands to a request: e.g. a sliding window's past) is `NO_BLOCK`."""
    if not block_ids:
        return ((),)
    groups = block_ids if isinstance(block_ids[0], (list, tuple)) else (block_ids,)
    return tuple(
        tuple(NO_BLOCK if block == NULL_BLOCK else int(block) for block in group) for group in groups
    )


class KvrayConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """kvray's vLLM connector: the scheduler side in the engine-core process, the worker side
    in each worker process (vLLM builds one of each). It supports vLLM's hybrid KV cache
    manager (`SupportsHMA`): a model with several KV cache groups (sliding-window and full
    attention layers) keeps them, and a request's blocks move per group."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        kv_heads = kv_heads_of(vllm_config)
        self.engine_id = f"vllm-{transfer.engine_id}"
        self.block_size = block_size_of(kv_cache_config, int(vllm_config.cache_config.block_size))
        lease_s = float(extra.get("lease_s", 60.0))
        # Both sides read the key: the scheduler reads and writes the tickets (and refuses to
        # start without it), the workers prove their push requests and withdrawals with it.
        key = key_from(extra, handoff_key_from_env())
        self._scheduler: _Scheduler | None = None
        self._worker: ConnectorWorker | None = None
        #: Blocks that failed to load since vLLM last asked (worker side).
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(self.engine_id, self.block_size, key, lease_s=lease_s)
        else:
            settings = settings_from({k: v for k, v in extra.items() if k not in CONNECTOR_KEYS})
            # A pure producer exposes nothing writable (least privilege); otherwise the engine
            # takes writes, and pushes too.
            worker_role = Role.PREFILL if transfer.kv_role == "kv_producer" else Role.DECODE
            tp = TensorParallel(size=self.tp_size, rank=_tp_rank(self.tp_size), kv_heads=kv_heads)
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
            _instrument(self._worker, extra)
            self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
            #: Each KV cache group's layer names (none known: one group of every layer).
            self._group_layers: list[list[str]] = [
                list(group.layer_names) for group in getattr(kv_cache_config, "kv_cache_groups", None) or ()
            ]

    # ---- worker side ------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[None] | None:
        if self._worker is None:
            return None
        return self._worker.allocation_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        num_blocks = self._num_blocks or next(iter(kv_caches.values())).shape[0]
        info = self._worker.register(kv_caches, num_blocks, self.block_size, self._group_layers)
        log.info(
            "kvray: engine %s registered %d layers, %d regions",
            info.engine_id,
            len(kv_caches),
            len(info.regions),
        )

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
            self._worker.begin(connector_metadata.step)

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
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvrayMetadata) or not meta.layerwise:
            return
        if not meta.layerwise_begun:
            meta.layerwise_begun = True
            self._worker.begin_layerwise(meta.layerwise)
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sent, received, errors, failed = self._worker.finished()
        if len(self._group_layers) <= 1:
            # vLLM takes block-level load errors from models of one KV cache group only; with
            # several, a failed request is reported (`failed_recving`) and nothing else.
            self._load_errors |= errors
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side ---------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every tensor-parallel rank's handshake, by rank: a held request's ticket names them all."""
        assert self._scheduler is not None
        ranks = [metadata.get(rank) for rank in range(self.tp_size)]
        handshakes = [handshake for handshake in ranks if isinstance(handshake, KvrayHandshake)]
        if len(handshakes) == len(ranks):
            self._scheduler.handshake = handshakes[0]
            self._scheduler.rank_handshakes = tuple(handshakes[1:])

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


class _Scheduler:
    """The scheduler side: which requests load from a prefill engine (decode) and which
    finished requests are held for a decode engine (prefill). Nothing here raises on a
    request's `kv_transfer_params` (client input): vLLM's scheduler would end the engine."""

    def __init__(self, engine_id: str, block_size: int, key: HandoffKey, *, lease_s: float = 60.0) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.key = key
        #: How long the workers hold a finished request: its `held` ticket expires with it.
        self.lease_s = lease_s
        self.handshake: KvrayHandshake | None = None
        #: Tensor parallelism: the handshakes of ranks 1, 2, ... (rank 0's is `handshake`).
        self.rank_handshakes: tuple[KvrayHandshake, ...] = ()
        #: Decode: local prefix-cache hits at the time of the match, per request, and the
        #: ticket it loads by (or why its ticket was refused: the load then fails at once).
        self._local_tokens: dict[str, int] = {}
        self._tickets: dict[str, Load | str] = {}
        #: This step's hand-offs so far (`KvrayMetadata.step`).
        self._step = HandoffStep()
        #: Requests whose hand-off the workers have not reported finished.
        self._held: set[str] = set()
        self._loading: set[str] = set()
        #: Prefill: the hand-off id of each request a decode engine will take, by vLLM's id,
        #: from its first allocation to its end (minted here, or the orchestrator's signed
        #: one); None: its hold ticket did not verify, so it is not held.
        self._keys: dict[str, str | None] = {}
        #: Prefill: decode-first requests not yet scheduled, by vLLM's id (layer-wise candidates).
        self._producing: dict[str, str] = {}
        #: Prefill: the decode engine a decode-first request's hold ticket names, by vLLM's id.
        self._bound: dict[str, str] = {}
        #: Prefill: requests whose layers the workers push during the forward.
        self._layered: set[str] = set()

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = _params(request)
        if params is None:
            return 0, False
        if params.get(RELEASE) is True:
            self._release(params)
            return 0, False
        if not params.get("do_remote_prefill") or not _KVRAY_LOAD_KEYS & params.keys():
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        try:
            load = read_load(self.key, params)
            if load.decode_engine not in ("", self.engine_id):
                raise TicketError(
                    f"the request's kvray ticket is for decode engine {load.decode_engine!r}, not "
                    f"{self.engine_id!r}: route it to the engine its orchestrator chose"
                )
            ticket: Load | str = load
        except TicketError as error:
            # The request waits for KV that will never come: the workers report its load
            # failed at once, and vLLM's kv_load_failure_policy decides (fail: an error).
            log.warning("kvray: request %s: %s", request.request_id, error)
            ticket = str(error)
        self._tickets[request.request_id] = ticket
        self._local_tokens[request.request_id] = num_computed_tokens
        return count, True

    def _release(self, params: Mapping[str, Any]) -> None:
        """A proxy hands back this engine's own ticket: the decode leg will not take it."""
        try:
            held = read_release(self.key, params)
        except TicketError as error:
            log.warning("kvray: a release was refused: %s", error)
            return
        handshake = self.handshake
        if handshake is not None and (held.engine, held.incarnation) == (
            handshake.engine_id,
            handshake.incarnation,
        ):
            self._step.released.add(held.request)

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = _params(request)
        if params is None:
            return
        if params.get("do_remote_decode") and request.request_id not in self._keys:
            self._keys[request.request_id] = self._hold_key(request, params)
        ticket = self._tickets.pop(request.request_id, None)
        local = self._local_tokens.pop(request.request_id, 0)
        if ticket is None or not params.get("do_remote_prefill"):
            return
        if isinstance(params, dict):
            params["do_remote_prefill"] = False  # once: a re-entry after the load loads nothing
        if num_external_tokens <= 0:
            return
        first = local // self.block_size
        count = ceil_div(local + num_external_tokens, self.block_size) - first
        table = tuple(group[first : first + count] for group in _groups(blocks.get_block_ids()))
        if isinstance(ticket, str):
            spec = LoadSpec.refused(request.request_id, table, ticket)
        else:
            spec = _load_spec(request.request_id, ticket, table, first)
        self._step.loads[request.request_id] = spec
        self._loading.add(request.request_id)

    def _withdraw(self, request_id: str, params: Mapping[str, Any], matched: Load | str | None) -> None:
        """`matched`: the ticket `matched` read (a string if it was refused), if it ran."""
        if isinstance(matched, str):
            return  # nothing to tell a prefill engine the params do not truly name
        ticket = matched
        if ticket is None:
            try:
                ticket = read_load(self.key, params)
            except TicketError:
                return
        self._step.withdrawn.append(_load_spec(request_id, ticket, (), 0))

    def _hold_key(self, request: Any, params: Mapping[str, Any]) -> str | None:
        """The hand-off id a request held for a decode engine goes by: the orchestrator's
        (signed: the decode engine was given it first) or a fresh one."""
        try:
            hold = read_hold(self.key, params)
        except TicketError as error:
            log.warning("kvray: request %s is not held for a decode engine: %s", request.request_id, error)
            return None
        if hold is None:
            return mint_handoff()
        self._producing[request.request_id] = hold.request
        self._bound[request.request_id] = hold.decode_engine
        return hold.request

    def finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = _params(request)
        self._producing.pop(request.request_id, None)
        matched = self._tickets.pop(request.request_id, None)
        self._local_tokens.pop(request.request_id, None)
        if params is not None and params.get("do_remote_prefill") and _KVRAY_LOAD_KEYS & params.keys():
            # Ended before its blocks were allocated (its load never began): the prefill engine
            # need not hold the request for the rest of its lease.
            self._withdraw(request.request_id, params, matched)
        if request.request_id in self._loading:
            # vLLM keeps the blocks of a request that ends while its KV loads until the
            # workers report the load finished; they stop waiting for it now.
            self._step.cancelled.add(request.request_id)
        allocated = request.request_id in self._keys
        key = self._keys.pop(request.request_id, None)
        if params is None or not params.get("do_remote_decode"):
            return False, None
        if not allocated:
            # Ended before it was scheduled: a decode engine given it first is refused at once.
            key = self._hold_key(request, params)
            self._producing.pop(request.request_id, None)
        decode_engine = self._bound.pop(request.request_id, "")
        if key is None:
            return False, None
        blocks = _groups(block_ids)
        succeeded = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        handshake = self.handshake
        if request.request_id in self._layered:
            # Layers may be in flight from these blocks: the workers end the push (or abort
            # it, if the request did not finish well) before vLLM may free them.
            self._layered.discard(request.request_id)
            self._step.sends[request.request_id] = SendSpec(
                request.request_id, blocks, key=key, failed=not succeeded, decode_engine=decode_engine
            )
            self._held.add(request.request_id)
            if not succeeded or handshake is None:
                return True, None
        elif not succeeded or not table_blocks(blocks) or handshake is None:
            self._step.dropped.add(key)
            return False, None
        else:
            self._step.sends[request.request_id] = SendSpec(
                request.request_id, blocks, key=key, decode_engine=decode_engine
            )
            self._held.add(request.request_id)
        held = Held(
            engine=handshake.engine_id,
            incarnation=handshake.incarnation,
            request=key,
            node=handshake.node,
            inbox=handshake.inbox,
            ranks=tuple((rank.incarnation, rank.inbox) for rank in self.rank_handshakes),
            expires=expiry(self.lease_s),
        )
        return True, held_params(self.key, held)

    def forget(self, request: Any) -> None:
        """What a request's failed hook may have left here: nothing of it is handed over."""
        request_id = getattr(request, "request_id", None)
        if not isinstance(request_id, str):
            return
        for table in (self._tickets, self._local_tokens, self._keys, self._producing, self._bound):
            table.pop(request_id, None)

    def refuse_load(self, request: Any, blocks: Any, num_external_tokens: int, error: BaseException) -> None:
        """`allocated` failed for `request`: if vLLM waits for its KV, its load fails at once
        (never a request left waiting for KV that no one sends)."""
        request_id = request.request_id
        promised = request_id in self._tickets
        self.forget(request)
        if not promised or num_external_tokens <= 0 or request_id in self._step.loads:
            return
        try:
            table = _groups(blocks.get_block_ids())
        except Exception:
            table = ((),)
        why = f"kvray could not set up the load: {error}"
        self._step.loads[request_id] = LoadSpec.refused(request_id, table, why)
        self._loading.add(request_id)

    def step(self, scheduler_output: Any) -> KvrayMetadata:
        meta = KvrayMetadata(
            step=self._step,
            layerwise=self._whole_prompts(scheduler_output),
            preempted=self._preempted(scheduler_output),
        )
        self._step = HandoffStep()
        return meta

    def _preempted(self, scheduler_output: Any) -> set[str]:
        """Hand-off ids of layer-wise requests vLLM preempted this step: their blocks go to
        other requests, so their layer pushes must end before this step's forward writes."""
        preempted: set[str] = set()
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if request_id in self._layered:
                self._layered.discard(request_id)
                key = self._keys.get(request_id)
                if key is not None:
                    preempted.add(key)
        return preempted

    def _whole_prompts(self, scheduler_output: Any) -> dict[str, LayerwiseSpec]:
        """This step's new requests for a decode engine whose whole prompt it computes (a
        prompt split over several steps is pushed whole once it is done)."""
        layerwise: dict[str, LayerwiseSpec] = {}
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            key = self._producing.pop(new.req_id, None)
            if key is None or new.prompt_token_ids is None or self.handshake is None:
                continue
            if new.num_computed_tokens + scheduled.get(new.req_id, 0) < len(new.prompt_token_ids):
                continue
            layerwise[new.req_id] = LayerwiseSpec(
                new.req_id, key, _groups(new.block_ids), decode_engine=self._bound.get(new.req_id, "")
            )
            self._layered.add(new.req_id)
        return layerwise

    def reported(self, output: Any) -> None:
        for request_id in getattr(output, "finished_sending", None) or ():
            self._held.discard(request_id)
        for request_id in getattr(output, "finished_recving", None) or ():
            self._loading.discard(request_id)

    def pending(self) -> bool:
        return bool(self._held or self._step)


#: vLLM's null block: never a request's, it stands where a group keeps no block.
NULL_BLOCK = 0


def block_size_of(kv_cache_config: Any, configured: int) -> int:
    """Tokens per block, as the engine's KV cache groups have it (the platform may choose
    another size than the one configured, e.g. 16 or 128 for MLA on a CPU). kvray pairs the two
    sides' blocks position by position in every group: groups of different block sizes are
    refused here, at start-up."""
    sizes = {
        int(group.kv_cache_spec.block_size)
        for group in getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if getattr(getattr(group, "kv_cache_spec", None), "block_size", None)
    }
    if len(sizes) > 1:
        raise ConfigError(
            f"the model's KV cache groups have blocks of {sorted(sizes)} tokens; kvray moves KV cache "
            "groups of one block size",
            block_sizes=sorted(sizes),
        )
    return sizes.pop() if sizes else configured


def kv_heads_of(vllm_config: Any) -> int:
    """The model's KV heads as kvray's `TensorParallel.kv_heads` has them (0: every rank caches
    the whole KV, an MLA latent), after refusing, at start-up, the parallel configurations
    kvray does not move: pipeline or context parallelism, and tensor-parallel sizes that do not
    divide the KV heads (vLLM would replicate heads across ranks)."""
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    tp_size = int(parallel.tensor_parallel_size)
    unsupported = {
        "pipeline_parallel_size": int(getattr(parallel, "pipeline_parallel_size", 1)),
        "prefill_context_parallel_size": int(getattr(parallel, "prefill_context_parallel_size", 1)),
        "decode_context_parallel_size": int(getattr(parallel, "decode_context_parallel_size", 1)),
    }
    beyond = {name: size for name, size in unsupported.items() if size != 1}
    if beyond:
        raise ConfigError(
            f"KvrayConnector moves KV between engines with tensor parallelism only; this engine has "
            f"{', '.join(f'{name}={size}' for name, size in beyond.items())}: run it with 1",
            **beyond,
        )
    if model is None or getattr(model, "use_mla", False):
        return 0
    kv_heads = int(model.get_total_num_kv_heads())
    if kv_heads % tp_size:
        raise ConfigError(
            f"tensor_parallel_size {tp_size} does not divide the model's {kv_heads} KV heads (vLLM "
            "would replicate heads across ranks); kvray moves KV split evenly by heads: use a "
            f"size that divides {kv_heads}",
            tensor_parallel_size=tp_size,
            kv_heads=kv_heads,
        )
    return kv_heads


def _tp_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


#: Any of these in a request's kv_transfer_params makes `do_remote_prefill` a kvray load.
_KVRAY_LOAD_KEYS = frozenset({PREFILL_ENGINE, PREFILL_REQUEST, HANDOFF})


def _load_spec(request_id: str, ticket: Load, block_ids: BlockTable, first_block: int) -> LoadSpec:
    """What the workers need to load a request by `ticket` into `block_ids`."""
    held = ticket.held
    return LoadSpec(
        request_id=request_id,
        prefill_engine=ticket.engine,
        prefill_incarnation=held.incarnation if held is not None else None,
        prefill_request_id=ticket.request,
        prefill_node=held.node if held is not None else "",
        prefill_inbox=held.inbox if held is not None else "",
        block_ids=block_ids,
        first_block=first_block,
        prefill_ranks=held.ranks if held is not None else (),
    )


def _instrument(worker: ConnectorWorker, extra: Mapping[str, Any]) -> None:
    """Install what `kv_connector_extra_config` asks for beyond the hand-off itself: a digest
    log (`kvray.bench.handoff_log`) and the seed bug (`kvray.faults`)."""
    if extra.get("digest_log"):
        from kvray.bench.handoff_log import DigestLog

        worker.observer = DigestLog(str(extra["digest_log"]), int(extra.get("digest_every", 1)))
    if extra.get("seed_bug"):
        from kvray.faults import inject_seed_bug

        inject_seed_bug(worker)


def _id(request: Any) -> str:
    return str(getattr(request, "request_id", "?"))[:200]


def _params(request: Any) -> Mapping[str, Any] | None:
    """A request's kv_transfer_params, if they are a mapping (anything else: no hand-off)."""
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, Mapping) and params else None
