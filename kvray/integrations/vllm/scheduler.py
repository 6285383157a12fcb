"""The scheduler side of `KvrayConnector` (in vLLM's engine-core process): which requests load
their prompt's KV from a prefill engine (decode), which finished requests are held for a
decode engine (prefill), and each step's decisions for the workers (`KvrayMetadata`). It reads
and writes the signed tickets of `tickets`; nothing here raises on a request's
`kv_transfer_params` (client input): vLLM's scheduler would end the engine."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvray.agent.handoff import (
    NO_BLOCK,
    BlockTable,
    HandoffStep,
    LayerwiseSpec,
    LoadSpec,
    SendSpec,
    table_blocks,
)
from kvray.errors import TicketError
from kvray.integrations.vllm.metadata import KvrayHandshake, KvrayMetadata
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
    mint_handoff_id,
    read_hold,
    read_load,
    read_release,
)
from kvray.layout import ceil_div

log = logging.getLogger("kvray.vllm")

#: vLLM's null block: never a request's, it stands where a group keeps no block.
NULL_BLOCK = 0
#: Any of these in a request's kv_transfer_params makes `do_remote_prefill` a kvray load.
_KVRAY_LOAD_KEYS = frozenset({PREFILL_ENGINE, PREFILL_REQUEST, HANDOFF})


class ConnectorScheduler:
    """The scheduler side: which requests load from a prefill engine (decode) and which
    finished requests are held for a decode engine (prefill), under which hand-off id. Nothing
    here raises on a request's `kv_transfer_params` (client input): vLLM's scheduler would end
    the engine."""

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
        self._handoff_ids: dict[str, str | None] = {}
        #: Prefill: the hand-off ids of decode-first requests not yet scheduled, by vLLM's id
        #: (layer-wise candidates).
        self._producing: dict[str, str] = {}
        #: Prefill: the decode engine a decode-first request's hold ticket names, by vLLM's id.
        self._bound: dict[str, str] = {}
        #: Prefill: requests whose layers the workers push during the forward.
        self._layered: set[str] = set()

    def take_handshakes(self, handshakes: Sequence[object]) -> None:
        """Every tensor-parallel rank's handshake, rank by rank (vLLM's
        `set_xfer_handshake_metadata`): a held request's ticket names them all, so they are
        taken once every rank has sent its own."""
        ranks = [handshake for handshake in handshakes if isinstance(handshake, KvrayHandshake)]
        if ranks and len(ranks) == len(handshakes):
            self.handshake = ranks[0]
            self.rank_handshakes = tuple(ranks[1:])

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
            self._step.released.add(held.handoff_id)

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = _params(request)
        if params is None:
            return
        if params.get("do_remote_decode") and request.request_id not in self._handoff_ids:
            self._handoff_ids[request.request_id] = self._held_handoff_id(request, params)
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
        table = tuple(group[first : first + count] for group in block_table(blocks.get_block_ids()))
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

    def _held_handoff_id(self, request: Any, params: Mapping[str, Any]) -> str | None:
        """The hand-off id a request held for a decode engine goes by: the orchestrator's
        (signed: the decode engine was given it first) or a fresh one."""
        try:
            hold = read_hold(self.key, params)
        except TicketError as error:
            log.warning("kvray: request %s is not held for a decode engine: %s", request.request_id, error)
            return None
        if hold is None:
            return mint_handoff_id()
        self._producing[request.request_id] = hold.handoff_id
        self._bound[request.request_id] = hold.decode_engine
        return hold.handoff_id

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
        allocated = request.request_id in self._handoff_ids
        handoff_id = self._handoff_ids.pop(request.request_id, None)
        if params is None or not params.get("do_remote_decode"):
            return False, None
        if not allocated:
            # Ended before it was scheduled: a decode engine given it first is refused at once.
            handoff_id = self._held_handoff_id(request, params)
            self._producing.pop(request.request_id, None)
        decode_engine = self._bound.pop(request.request_id, "")
        if handoff_id is None:
            return False, None
        blocks = block_table(block_ids)
        succeeded = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        handshake = self.handshake
        if request.request_id in self._layered:
            # Layers may be in flight from these blocks: the workers end the push (or abort
            # it, if the request did not finish well) before vLLM may free them.
            self._layered.discard(request.request_id)
            self._step.sends[request.request_id] = SendSpec(
                request.request_id, blocks, key=handoff_id, failed=not succeeded, decode_engine=decode_engine
            )
            self._held.add(request.request_id)
            if not succeeded or handshake is None:
                return True, None
        elif not succeeded or not table_blocks(blocks) or handshake is None:
            self._step.dropped.add(handoff_id)
            return False, None
        else:
            self._step.sends[request.request_id] = SendSpec(
                request.request_id, blocks, key=handoff_id, decode_engine=decode_engine
            )
            self._held.add(request.request_id)
        held = Held(
            engine=handshake.engine_id,
            incarnation=handshake.incarnation,
            handoff_id=handoff_id,
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
        for table in (self._tickets, self._local_tokens, self._handoff_ids, self._producing, self._bound):
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
            table = block_table(blocks.get_block_ids())
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
                handoff_id = self._handoff_ids.get(request_id)
                if handoff_id is not None:
                    preempted.add(handoff_id)
        return preempted

    def _whole_prompts(self, scheduler_output: Any) -> dict[str, LayerwiseSpec]:
        """This step's new requests for a decode engine whose whole prompt it computes (a
        prompt split over several steps is pushed whole once it is done)."""
        layerwise: dict[str, LayerwiseSpec] = {}
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            handoff_id = self._producing.pop(new.req_id, None)
            if handoff_id is None or new.prompt_token_ids is None or self.handshake is None:
                continue
            if new.num_computed_tokens + scheduled.get(new.req_id, 0) < len(new.prompt_token_ids):
                continue
            layerwise[new.req_id] = LayerwiseSpec(
                new.req_id,
                handoff_id,
                block_table(new.block_ids),
                decode_engine=self._bound.get(new.req_id, ""),
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


def block_table(block_ids: Any) -> BlockTable:
    """A request's block ids as vLLM gives them (one list per KV cache group, or one flat list
    to a connector of one group) as a block table: vLLM's null block (0, which vLLM never
    hands to a request: e.g. a sliding window's past) is `NO_BLOCK`."""
    if not block_ids:
        return ((),)
    groups = block_ids if isinstance(block_ids[0], (list, tuple)) else (block_ids,)
    return tuple(
        tuple(NO_BLOCK if block == NULL_BLOCK else int(block) for block in group) for group in groups
    )


def _load_spec(request_id: str, ticket: Load, block_ids: BlockTable, first_block: int) -> LoadSpec:
    """What the workers need to load a request by `ticket` into `block_ids`."""
    held = ticket.held
    return LoadSpec(
        request_id=request_id,
        prefill_engine=ticket.engine,
        prefill_incarnation=held.incarnation if held is not None else None,
        prefill_request_id=ticket.handoff_id,
        prefill_node=held.node if held is not None else "",
        prefill_inbox=held.inbox if held is not None else "",
        block_ids=block_ids,
        first_block=first_block,
        prefill_ranks=held.ranks if held is not None else (),
    )


def _params(request: Any) -> Mapping[str, Any] | None:
    """A request's kv_transfer_params, if they are a mapping (anything else: no hand-off)."""
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, Mapping) and params else None
