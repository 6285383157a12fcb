"""`KvrayConnector`: kvray as a vLLM KV connector (v1 interface), loaded by module path:

    --kv-transfer-config '{"kv_connector": "KvrayConnector",
                           "kv_connector_module_path": "kvray.integrations.vllm.connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

`kv_connector_extra_config` keys are `kvray.Settings` fields (e.g. `transfer_timeout_s`, or
`transport`: auto, shm or ray, the transport this engine's pushes take), plus
`lease_s` (how long a prefill engine holds a finished request's blocks for a decode engine),
`digest_log` (a file to append per-layer digests of the KV each side sent and received, to
compare them, and each side's time), `digest_every` (hash one request in this many) and
`seed_bug` (plan with offsets cached by geometry alone: the bug kvray exists to stop, for
demonstrations), `ray_address` (a Ray cluster's GCS address: the worker joins it and registers
with kvray's coordinator, so engines on other nodes reach it) and `node_id` (the Ray node the
engine runs on, when its launcher knows it).

The hand-off is kvray's push: the decode side reserves, the prefill side writes into it.

    client -> P   request with kv_transfer_params {"do_remote_decode": true}, max_tokens 1
    P scheduler   request_finished: holds the blocks, returns params naming P's engine,
                  incarnation, request and info (they reach the client as kv_transfer_params)
    client -> D   the request with those params
    D scheduler   get_num_new_matched_tokens: the prompt's tokens load asynchronously;
                  update_state_after_alloc: the blocks vLLM allocated for them
    D worker      expects the request (a Reservation over those blocks) and sends P a
                  PushRequest (fenced by both incarnations, carrying D's token)
    P worker      pushes its blocks of the request into the reservation (plan per layer and
                  geometry, one-sided write, notify); reports the request finished sending
    D worker      wait_for_kv, release; reports it finished receiving (or failed: its blocks
                  are load errors, and vLLM's kv_load_failure_policy applies)

A prefill engine frees a held request's blocks once it has pushed them, or when no decode
engine asked within `lease_s`. On one node the `shm` transport writes straight into the decode
engine's KV cache (kvray places it in a shared-memory file) and push requests and notices go
through Unix datagram sockets; across nodes both engines join Ray (`ray_address`), the KV goes
by the `ray` transport and the messages through each engine's host actor.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvray.errors import ConfigError
from kvray.integrations.vllm.worker import (
    CONNECTOR_KEYS,
    ConnectorWorker,
    LayerwiseSpec,
    LoadSpec,
    SendSpec,
    settings_from,
)
from kvray.layout import ceil_div
from kvray.wire import Role, encode

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

log = logging.getLogger("kvray.vllm")

#: The kv_transfer_params keys kvray reads and writes.
PREFILL_ENGINE = "kvray_prefill_engine"
PREFILL_INCARNATION = "kvray_prefill_incarnation"
PREFILL_REQUEST = "kvray_prefill_request"
PREFILL_INFO = "kvray_prefill_info"
#: A hand-off id the client chooses and gives both engines (decode first: see below).
HANDOFF = "kvray_handoff"


@dataclass
class KvrayHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells its scheduler once its agent has started."""

    engine_id: str
    incarnation: int
    info: bytes


@dataclass
class KvrayMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's hand-offs, from the scheduler to the workers."""

    loads: dict[str, LoadSpec] = field(default_factory=dict)
    sends: dict[str, SendSpec] = field(default_factory=dict)
    #: Requests whose whole prompt this step computes, while a decode engine may wait for
    #: their KV: their layers are pushed as the forward saves them.
    layerwise: dict[str, LayerwiseSpec] = field(default_factory=dict)
    #: Worker side: the step's layer-wise requests have been handed to the worker.
    layerwise_begun: bool = False
    #: Prefill: hand-off keys of requests that ended with no KV to push (aborted, failed): a
    #: decode engine's push request for one is refused at once, not held for the lease.
    dropped: set[str] = field(default_factory=set)
    #: Decode: requests that ended (aborted) while their KV was loading: their wait ends now,
    #: and their blocks go back once no write of theirs can land.
    cancelled: set[str] = field(default_factory=set)


def _first_group(block_ids: Any) -> list[int]:
    """A request's block ids of its (only) KV cache group."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) != 1:
            raise ConfigError("kvray moves models with one KV cache group (no hybrid attention yet)")
        return list(block_ids[0])
    return list(block_ids)


class KvrayConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvray's vLLM connector: the scheduler side in the engine-core process, the worker side
    in each worker process (vLLM builds one of each)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ConfigError("KvrayConnector runs with tensor_parallel_size 1 (one worker per engine)")
        self.engine_id = f"vllm-{transfer.engine_id}"
        self.block_size = int(vllm_config.cache_config.block_size)
        lease_s = float(extra.get("lease_s", 60.0))
        self._scheduler: _Scheduler | None = None
        self._worker: ConnectorWorker | None = None
        #: Blocks that failed to load since vLLM last asked (worker side).
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(self.engine_id, self.block_size)
        else:
            settings = settings_from({k: v for k, v in extra.items() if k not in CONNECTOR_KEYS})
            # A pure producer exposes nothing writable (least privilege); otherwise the engine
            # takes writes, and pushes too.
            worker_role = Role.PREFILL if transfer.kv_role == "kv_producer" else Role.DECODE
            self._worker = ConnectorWorker(
                self.engine_id,
                worker_role,
                settings,
                lease_s,
                digest_log=extra.get("digest_log"),
                digest_every=int(extra.get("digest_every", 1)),
                seed_bug=bool(extra.get("seed_bug", False)),
                ray_address=extra.get("ray_address"),
                node_id=extra.get("node_id"),
            )
            self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)

    # ---- worker side ------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[None] | None:
        if self._worker is None or self._worker.role is not Role.DECODE:
            return None
        return self._worker.allocation_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        num_blocks = self._num_blocks or next(iter(kv_caches.values())).shape[0]
        info = self._worker.register(kv_caches, num_blocks, self.block_size)
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
        return KvrayHandshake(info.engine_id, info.incarnation, encode(info))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The step's hand-offs go to the agent here, before the forward: vLLM calls
        # start_load_kv once the forward is launched when no load is synchronous, which on a
        # CPU engine is once it has run, so a held request's push (or a decode engine's ask)
        # would wait a whole forward pass. Handing them over only schedules work on the
        # agent's loop; the forward does not wait for it.
        if self._worker is not None and isinstance(connector_metadata, KvrayMetadata):
            meta = connector_metadata
            self._worker.begin(meta.loads, meta.sends, dropped=meta.dropped, cancelled=meta.cancelled)

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
        assert self._scheduler is not None
        handshake = metadata.get(0)
        if isinstance(handshake, KvrayHandshake):
            self._scheduler.handshake = handshake

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvrayMetadata:
        assert self._scheduler is not None
        return self._scheduler.step(scheduler_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.reported(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending()


class _Scheduler:
    """The scheduler side: which requests load from a prefill engine (decode) and which
    finished requests are held for a decode engine (prefill)."""

    def __init__(self, engine_id: str, block_size: int) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.handshake: KvrayHandshake | None = None
        #: Decode: local prefix-cache hits at the time of the match, per request.
        self._local_tokens: dict[str, int] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._sends: dict[str, SendSpec] = {}
        #: Requests whose hand-off the workers have not reported finished.
        self._held: set[str] = set()
        self._loading: set[str] = set()
        #: Prefill: requests a decode engine will take, not yet scheduled, by vLLM's id: their
        #: hand-off key (the client's `kvray_handoff`, else the request id).
        self._producing: dict[str, str] = {}
        #: Prefill: requests whose layers the workers push during the forward.
        self._layered: set[str] = set()
        #: This step's `KvrayMetadata.dropped` and `cancelled`.
        self._dropped: set[str] = set()
        self._cancelled: set[str] = set()

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or PREFILL_ENGINE not in params:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_tokens[request.request_id] = num_computed_tokens
        return count, True

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._producing[request.request_id] = str(params.get(HANDOFF) or request.request_id)
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # once: a re-entry after the load loads nothing
        if num_external_tokens <= 0:
            return
        local = self._local_tokens.pop(request.request_id, 0)
        first = local // self.block_size
        count = ceil_div(local + num_external_tokens, self.block_size) - first
        block_ids = _first_group(blocks.get_block_ids())[first : first + count]
        self._loads[request.request_id] = LoadSpec(
            request_id=request.request_id,
            prefill_engine=str(params[PREFILL_ENGINE]),
            # Decode first, the client knows the prefill engine's name alone (and the hand-off
            # id); the worker then finds its current incarnation through the coordinator.
            prefill_incarnation=int(params[PREFILL_INCARNATION]) if PREFILL_INCARNATION in params else None,
            prefill_request_id=str(params.get(PREFILL_REQUEST) or params.get(HANDOFF) or ""),
            prefill_info=base64.b64decode(params[PREFILL_INFO]) if PREFILL_INFO in params else b"",
            block_ids=tuple(block_ids),
            first_block=first,
        )
        self._loading.add(request.request_id)

    def finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._producing.pop(request.request_id, None)
        if request.request_id in self._loading:
            # vLLM keeps the blocks of a request that ends while its KV loads until the
            # workers report the load finished; they stop waiting for it now.
            self._cancelled.add(request.request_id)
        if not params or not params.get("do_remote_decode"):
            return False, None
        key = str(params.get(HANDOFF) or request.request_id)
        blocks = _first_group(block_ids)
        succeeded = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if request.request_id in self._layered:
            # Layers may be in flight from these blocks: the workers end the push (or abort
            # it, if the request did not finish well) before vLLM may free them.
            self._layered.discard(request.request_id)
            self._sends[request.request_id] = SendSpec(
                request.request_id, tuple(blocks), key=key, failed=not succeeded
            )
            self._held.add(request.request_id)
            if not succeeded or self.handshake is None:
                return True, None
        elif not succeeded or not blocks or self.handshake is None:
            self._dropped.add(key)
            return False, None
        else:
            self._sends[request.request_id] = SendSpec(request.request_id, tuple(blocks), key=key)
            self._held.add(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PREFILL_ENGINE: self.handshake.engine_id,
            PREFILL_INCARNATION: self.handshake.incarnation,
            PREFILL_REQUEST: key,
            PREFILL_INFO: base64.b64encode(self.handshake.info).decode(),
        }

    def step(self, scheduler_output: Any) -> KvrayMetadata:
        meta = KvrayMetadata(
            loads=self._loads,
            sends=self._sends,
            layerwise=self._whole_prompts(scheduler_output),
            dropped=self._dropped,
            cancelled=self._cancelled,
        )
        self._loads, self._sends, self._dropped, self._cancelled = {}, {}, set(), set()
        return meta

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
            layerwise[new.req_id] = LayerwiseSpec(new.req_id, key, tuple(_first_group(new.block_ids)))
            self._layered.add(new.req_id)
        return layerwise

    def reported(self, output: Any) -> None:
        for request_id in getattr(output, "finished_sending", None) or ():
            self._held.discard(request_id)
        for request_id in getattr(output, "finished_recving", None) or ():
            self._loading.discard(request_id)

    def pending(self) -> bool:
        return bool(self._held or self._loads or self._sends or self._dropped or self._cancelled)
