"""The decode side of the hand-off (from the scheduler's loads to the KV in the engine's blocks):
reserve the blocks, ask the prefill engine (each of its ranks) to push, wait for the KV while
watching the prefill engine, release, report; tell the prefill engine when a load is withdrawn.
Push requests and withdrawals go through the agent's push-request mailboxes
(`KVAgent.push_requests`, a `kvray.notice.NoticeSet`): the prefill engine's inbox on this node,
else its TCP listener or its host, whichever reaches it first. See `kvray.agent.handoff` for
the protocol.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvray.agent.handoff.events import HandoffEvent, Moved
from kvray.agent.handoff.side import Side, Wiring, reason_of
from kvray.agent.handoff.specs import (
    NO_BLOCK,
    HandoffStep,
    LoadSpec,
    PrefillAddress,
    rank_engine_id,
    table_blocks,
)
from kvray.agent.kvagent import KVAgent
from kvray.errors import (
    KvrayError,
    NotExpectedError,
    RequestCancelledError,
    StaleIncarnationError,
    TransportError,
)
from kvray.notice.local import PUSH_ENDPOINT
from kvray.tensor_parallel import source_ranks
from kvray.transport.base import Reachable
from kvray.wire import EngineInfo, PushMessage, PushRequest, PushWithdrawn, encode

log = logging.getLogger("kvray.handoff")


@dataclass(frozen=True)
class _TicketedInfo:
    """What a prefill engine's ticket says of it (`kvray.transport.base.PeerAddress`): its id,
    incarnation, node and push-request inbox."""

    engine_id: str
    incarnation: int
    node_id: str
    endpoints: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Ticketed:
    """A prefill engine as its ticket names it (`kvray.transport.base.Reachable`), for an inbox on
    this node that needs no lookup: no host."""

    info: _TicketedInfo
    host: None = None


def ticketed(prefill: PrefillAddress) -> Reachable:
    """The prefill engine at `prefill` as the push-request channels see it from its ticket."""
    endpoints = {PUSH_ENDPOINT: prefill.inbox} if prefill.inbox else {}
    return _Ticketed(_TicketedInfo(prefill.engine_id, prefill.incarnation, prefill.node_id, endpoints))


class DecodeSide(Side):
    """The decode side of one engine's hand-offs: loads, their push requests, withdrawals."""

    def __init__(self, wiring: Wiring) -> None:
        super().__init__(wiring)
        #: Loads still waiting, and those whose task has taken its first step.
        self._receiving: dict[str, asyncio.Task[None]] = {}
        self._loads_begun: set[str] = set()
        #: This engine's info and its encoding (`_encoded_info`).
        self._info_bytes: tuple[EngineInfo, bytes] | None = None

    def step(self, step: HandoffStep) -> None:
        """This side's part of a step: loads to start, loads that ended before they began
        (`withdrawn`: their prefill engines are told), and loads no longer wanted (`cancelled`,
        after the loads: a load may be handed over and cancelled in one step)."""
        for spec in step.loads.values():
            self.load(spec)
        for spec in step.withdrawn:
            self._spawn(self.withdraw(spec))
        for request_id in step.cancelled:
            self.cancel(request_id)

    def load(self, spec: LoadSpec) -> None:
        """Start receiving a request (reported through `HandoffReports.loaded`)."""
        task = self._receiving[spec.request_id] = self._spawn(self._receive(spec))
        task.add_done_callback(functools.partial(self._load_ended, spec))

    def lane_loaded(self, spec: LoadSpec, seconds: float) -> None:
        """A load a prefill engine's lane moved and the engine's thread checked: the observer
        sees it, its blocks still held, and then it is reported."""
        self._spawn(self._lane_observed(spec, seconds))

    async def _lane_observed(self, spec: LoadSpec, seconds: float) -> None:
        groups = tuple(tuple(block for block in group if block != NO_BLOCK) for group in spec.block_ids)
        try:
            handoff = spec.prefill_request_id
            await self._moved(Moved(HandoffEvent.RECEIVED, handoff, handoff, groups, seconds))
        finally:
            self.wiring.reports.loaded(spec, failed=False)

    def cancel(self, request_id: str) -> None:
        """The engine ended the request while its KV loads: stop waiting (its blocks are
        reported once no write of it can land)."""
        receiving = self._receiving.pop(request_id, None)
        if receiving is not None:
            receiving.cancel()

    def _load_ended(self, spec: LoadSpec, task: asyncio.Task[None]) -> None:
        """A load cancelled before its first step never ran its own reporting: report it here
        (it reserved nothing, so its blocks are simply free)."""
        if task.cancelled() and spec.request_id not in self._loads_begun:
            self._receiving.pop(spec.request_id, None)
            self.wiring.reports.loaded(spec, failed=False)
            if not spec.refusal:
                self._spawn(self.withdraw(spec))
        self._loads_begun.discard(spec.request_id)

    async def _receive(self, spec: LoadSpec) -> None:
        """Reserve the blocks, ask the prefill engine to push, wait, and report; the blocks are
        the engine's again only once no write of the request can land.

        With tensor parallelism (either side), this rank reserves its blocks once for each
        prefill rank holding heads it takes (`kvray.tensor_parallel.source_ranks`) and asks
        each to push its part; it tells every other prefill rank it takes nothing from it.
        The request has arrived once every part has."""
        agent = self.agent
        self._loads_begun.add(spec.request_id)
        ok = False
        reserved: list[str] = []
        cancelled = False
        try:
            if spec.refusal:
                raise NotExpectedError(
                    f"request {spec.request_id!r} was refused: {spec.refusal}", request_id=spec.request_id
                )
            prefills = await self._prefill_ranks(spec)
            sources = self._sources(len(prefills))
            own = agent.layout.tp
            blocks = table_blocks(spec.block_ids)
            asks: list[tuple[PrefillAddress, str, PushRequest]] = []
            for rank in sources:
                prefill = prefills[rank]
                part = spec.request_id if len(sources) == 1 else f"{spec.request_id}#tp{rank}"
                reservation = agent.expect(part, blocks)
                reserved.append(part)
                request = PushRequest(
                    request_id=spec.prefill_request_id,
                    src_engine=prefill.engine_id,
                    src_incarnation=prefill.incarnation,
                    reservation=reservation,
                    first_block=spec.first_block,
                    decode_info=self._encoded_info(),
                    groups=spec.block_ids if len(spec.block_ids) > 1 else (),
                    decode_rank=own.rank,
                    decode_ranks=own.size,
                    proof=self._prove(prefill.engine_id, spec.prefill_request_id),
                )
                asks.append((prefill, part, request))
            for rank, prefill in enumerate(prefills):
                if rank not in sources:
                    self._spawn(self._withdraw_from(spec, prefill))
            asked = time.perf_counter()
            # One deadline for the ask and the KV: a prefill engine busy enough to let its inbox
            # fill takes the ask late, not never (a gone one refuses the datagram at once).
            deadline = self.settings.transfer_timeout_s
            async with asyncio.timeout(deadline):
                for prefill, _, request in asks:
                    await self.ask(prefill, request, timeout_s=deadline)
            remaining = max(deadline - (time.perf_counter() - asked), 0.001)
            if len(asks) == 1:  # in this task: the completion resumes it directly
                prefill, part, _ = asks[0]
                await self._wait_while_prefill_lives(prefill, part, remaining)
            else:
                await _all_or_first_error(
                    self._wait_while_prefill_lives(prefill, part, remaining) for prefill, part, _ in asks
                )
            ok = True
            waited = time.perf_counter() - asked
            if self.wiring.observer is not None:  # its block lists are built for it alone
                await self._moved(
                    Moved(
                        HandoffEvent.RECEIVED,
                        spec.prefill_request_id,
                        spec.prefill_request_id,
                        tuple(
                            tuple(block for block in group if block != NO_BLOCK) for group in spec.block_ids
                        ),
                        waited,
                    )
                )
        except asyncio.CancelledError:
            # The engine ended the request while its KV loaded: release as below, report no
            # errors, and tell the prefill engine not to keep the request for a push no one takes.
            cancelled = True
            self._spawn(self.withdraw(spec))
            self._note(HandoffEvent.RECEIVE_CANCELLED, spec.request_id, spec.prefill_request_id)
        except Exception as error:
            log.warning("kvray: KV of %s did not arrive: %s", spec.request_id, error)
            self._note(
                HandoffEvent.RECEIVE_FAILED, spec.request_id, spec.prefill_request_id, reason_of(error)
            )
        finally:
            # From here on the load is not cancelled: a release must run to its end.
            self._receiving.pop(spec.request_id, None)
            for part in reserved:
                try:
                    await agent.release(part)
                except KvrayError as error:
                    ok = False
                    log.error("kvray: %s could not be released: %s", part, error)
                    # A writer may still write into the blocks: the engine keeps them (the
                    # request is not reported) until the agent's quarantine of it ends.
                    quarantined = agent.quarantined.get(part)
                    if quarantined is not None:
                        await quarantined.wait()
            # A cancelled request is gone: its blocks are free, not blocks to recompute.
            self.wiring.reports.loaded(spec, failed=not ok and not cancelled)

    def _sources(self, prefill_ranks: int) -> tuple[int, ...]:
        """The prefill ranks (of `prefill_ranks`) this rank takes KV from: the one rank of a
        prefill engine without tensor parallelism; else those holding heads of this rank's
        (assuming the prefill engine's model has this one's KV heads: its ranks check that
        when they plan, and refuse a decode engine of another model)."""
        own = self.agent.layout.tp
        if prefill_ranks == 1 and own.size == 1:
            return (0,)
        return source_ranks(own, prefill_ranks, own.kv_heads)

    def _prove(self, prefill_engine: str, handoff: str) -> bytes:
        return b"" if self.wiring.proof is None else self.wiring.proof.ask_proof(prefill_engine, handoff)

    def _encoded_info(self) -> bytes:
        """The agent's published info as push requests carry it, encoded once per incarnation."""
        info = self.agent.info
        if self._info_bytes is None or self._info_bytes[0] is not info:
            self._info_bytes = (info, encode(info))
        return self._info_bytes[1]

    async def _wait_while_prefill_lives(
        self, prefill: PrefillAddress, request_id: str, timeout: float
    ) -> None:
        """`wait_for_kv`, ended early with `TransportError` once the prefill engine is seen gone
        (asked every `heartbeat_s`): one that took the push request and then died would
        otherwise leave the request waiting until its deadline. The request stays reserved
        either way; the caller releases it.

        The wait runs in the calling task, so the completion resumes it with no task between;
        a watcher beside it ends the wait once the prefill engine is gone (`KVAgent.cancel`,
        which leaves a wait whose KV is in as it is)."""
        gone = ""

        async def watch() -> None:
            nonlocal gone
            while True:
                await asyncio.sleep(self.settings.heartbeat_s)
                why = await self.gone(prefill)
                if why:
                    gone = why
                    self.agent.cancel(request_id)
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.agent.wait_for_kv(request_id, timeout=timeout)
        except RequestCancelledError:
            if not gone:
                raise
            raise TransportError(
                f"prefill engine {prefill.engine_id!r} went away while request {request_id!r} "
                f"waited for its KV: {gone}",
                engine_id=prefill.engine_id,
                request_id=request_id,
            ) from None
        finally:
            watcher.cancel()

    async def _prefill_ranks(self, spec: LoadSpec) -> list[PrefillAddress]:
        """Where the prefill engine's ranks take push requests: as its own ticket names them,
        else (the request came here first) from the coordinator, which knows each rank's
        incarnation, inbox and how many ranks the engine has."""
        if spec.prefill_incarnation is not None:
            first = PrefillAddress(
                spec.prefill_engine, spec.prefill_incarnation, spec.prefill_node, spec.prefill_inbox
            )
            others = [
                PrefillAddress(
                    rank_engine_id(spec.prefill_engine, rank), incarnation, spec.prefill_node, inbox
                )
                for rank, (incarnation, inbox) in enumerate(spec.prefill_ranks, start=1)
            ]
            return [first, *others]
        if not self.wiring.joined:
            raise NotExpectedError(
                f"request {spec.request_id!r} names prefill engine {spec.prefill_engine!r} alone: only "
                "an engine that joined Ray (ray_address) can look it up; give this engine the "
                "prefill engine's kv_transfer_params instead",
                engine_id=spec.prefill_engine,
            )
        addresses: list[PrefillAddress] = []
        ranks = 1
        while len(addresses) < ranks:
            engine_id = rank_engine_id(spec.prefill_engine, len(addresses))
            peer = await self.agent.peer(engine_id, wait_s=self.settings.lookup_timeout_s)
            info = peer.info
            tp = info.layout.tp
            if not addresses:
                ranks = tp.size
            if (tp.rank, tp.size) != (len(addresses), ranks) or info.engine_id != engine_id:
                raise StaleIncarnationError(
                    f"engine {engine_id!r} is registered as rank {tp.rank} of {tp.size}, not rank "
                    f"{len(addresses)} of prefill engine {spec.prefill_engine!r}'s {ranks}",
                    engine_id=engine_id,
                )
            addresses.append(
                PrefillAddress(
                    info.engine_id, info.incarnation, info.node_id, info.endpoints.get(PUSH_ENDPOINT, "")
                )
            )
        return addresses

    # ---- how push requests reach a prefill engine ------------------------------------------

    async def ask(
        self, prefill: PrefillAddress, message: PushMessage, *, timeout_s: float | None = None
    ) -> None:
        """Send a push request or withdrawal to the prefill engine at `prefill`, through the
        first push-request channel that reaches it (`KVAgent.push_requests`), within
        `timeout_s` (default `notify_timeout_s`)."""
        peer = await self._reached(prefill)
        await self.agent.push_requests.send(peer, message, timeout_s=timeout_s)

    async def _reached(self, prefill: PrefillAddress) -> Reachable:
        """The prefill engine as its push requests reach it: as its ticket names it where that
        names its inbox on this node (no lookup); else as the coordinator lists it (engines that
        joined Ray), at the incarnation the request names: its published listener and host."""
        agent = self.agent
        if prefill.inbox and prefill.node_id == agent.node_id:
            return ticketed(prefill)
        if not self.wiring.joined:
            raise NotExpectedError(
                f"prefill engine {prefill.engine_id!r} runs on node {prefill.node_id!r} and this decode "
                f"engine on {agent.node_id!r}: engines on different nodes must both join Ray "
                "(kv_connector_extra_config ray_address)",
                engine_id=prefill.engine_id,
            )
        peer = await agent.peer(prefill.engine_id, wait_s=self.settings.notify_timeout_s)
        if peer.info.incarnation != prefill.incarnation:
            raise StaleIncarnationError(
                f"prefill engine {prefill.engine_id!r} restarted (incarnation {peer.info.incarnation}, "
                f"the request names {prefill.incarnation}): its KV of the request is gone",
                engine_id=prefill.engine_id,
            )
        return peer

    async def gone(self, prefill: PrefillAddress) -> str:
        """Why the prefill engine can no longer push ("" while it may): on this node, its
        inbox has no reader; elsewhere (engines that joined Ray), the coordinator no longer
        lists its incarnation. Without an answer in time it may still push."""
        if prefill.inbox and prefill.node_id == self.agent.node_id:
            if self.agent.push_requests.listening(ticketed(prefill)) is not False:
                return ""
            return f"its push-request inbox {prefill.inbox} has no reader: the engine closed or died"
        return await departed(self.agent, prefill, joined=self.wiring.joined)

    async def withdraw(self, spec: LoadSpec) -> None:
        """Tell the prefill engine (each of its ranks) this engine will not take the request
        (best effort, bounded: otherwise its lease frees it)."""
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                prefills = await self._prefill_ranks(spec)
        except Exception as error:
            log.info(
                "kvray: could not withdraw %s from its prefill engine: %s", spec.request_id, reason_of(error)
            )
            return
        await asyncio.gather(*(self._withdraw_from(spec, prefill) for prefill in prefills))

    async def _withdraw_from(self, spec: LoadSpec, prefill: PrefillAddress) -> None:
        """Tell one prefill rank this rank will not take the request from it."""
        own = self.agent.layout.tp
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                withdrawn = PushWithdrawn(
                    request_id=spec.prefill_request_id,
                    src_engine=prefill.engine_id,
                    src_incarnation=prefill.incarnation,
                    proof=self._prove(prefill.engine_id, spec.prefill_request_id),
                    decode_rank=own.rank,
                    decode_ranks=own.size,
                )
                await self.ask(prefill, withdrawn)
        except Exception as error:
            log.info(
                "kvray: could not withdraw %s from prefill engine %s: %s",
                spec.request_id,
                prefill.engine_id,
                reason_of(error),
            )


async def _all_or_first_error(waits: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run `waits` together; the first to fail cancels the others, and its error is raised
    (not an exception group: one cause is the load's)."""
    try:
        async with asyncio.TaskGroup() as group:
            for wait in waits:
                group.create_task(wait)
    except BaseExceptionGroup as failed:
        first = failed.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


async def departed(agent: KVAgent, prefill: PrefillAddress, *, joined: bool) -> str:
    """Why the prefill engine at `prefill` can no longer push, as the coordinator knows it ("":
    it lists its incarnation, or gives no answer in time, or this engine has not joined Ray)."""
    if not joined:
        return ""
    try:
        async with asyncio.timeout(agent.settings.notify_timeout_s):
            gone = await agent.departed([(prefill.engine_id, prefill.incarnation)])
    except Exception:  # the coordinator is restarting or slow: no news
        return ""
    if gone:
        return "the coordinator no longer lists its incarnation: the engine closed, died or restarted"
    return ""
