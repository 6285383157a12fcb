"""The decode side of the `verbs` transport (the completion step for RDMA): the queue pairs it
accepted from writers, and the immediates arriving on them matched against expected transfers.

A decode engine completes a request only once the writer's completion notice has come AND as
many immediates as it names from that writer incarnation (`arrivals`). Immediates on unknown or
retired queue pairs, for an old incarnation or for a request nobody expects are dropped and
counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvray.errors import BackpressureError, PlanError
from kvray.metrics import EngineMetrics, RdmaReceive
from kvray.transport.verbs.connections import Accepted, Writer
from kvray.transport.verbs.device import Device
from kvray.transport.verbs.requests import transfer_tag

#: A decode engine incarnation: (engine id, incarnation).
Engine = tuple[str, int]


@dataclass
class _Expected:
    """A request the decode side expects over RDMA: its immediates counted per writer."""

    request_id: str
    counts: Counter[Writer] = field(default_factory=Counter)
    #: (writer, immediates it must reach, future resolved once it has).
    waiters: list[tuple[Writer, int, asyncio.Future[None]]] = field(default_factory=list)

    def cancel(self) -> None:
        for _, _, waiter in self.waiters:
            if not waiter.done():
                waiter.cancel()


class Inbound:
    """What the decode engines served by one transport receive: the connections they accepted
    (by queue pair number) and, per engine incarnation, the transfers they expect (by tag)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics
        self.accepted: dict[int, Accepted] = {}
        self._expected: dict[Engine, dict[int, _Expected]] = {}

    # ---- connections ----

    def check_room(self, src_engine: str, dst_engine: str, limit: int) -> None:
        """Refuse a new writer once `limit` hold a connection (one connecting again replaces
        its own, so it always may)."""
        reconnecting = any(
            accepted.src_engine == src_engine and accepted.dst_engine == dst_engine
            for accepted in self.accepted.values()
        )
        if not reconnecting and len(self.accepted) >= limit:
            raise BackpressureError(
                f"engine {dst_engine!r} already holds RDMA connections from {len(self.accepted)} "
                f"writers (max_cached_peers); {src_engine!r} must wait until one closes, or raise "
                "max_cached_peers",
                engine_id=dst_engine,
                src_engine=src_engine,
                limit=limit,
            )

    def add(self, accepted: Accepted, device: Device) -> None:
        """Take a connection in, closing the one the same writer held before."""
        for qp_num, held in list(self.accepted.items()):
            if held.src_engine == accepted.src_engine and held.dst_engine == accepted.dst_engine:
                self.accepted.pop(qp_num)
                device.close_qp(held.qp)
        self.accepted[int(accepted.qp.qp_num)] = accepted
        self._metrics.rdma_connection_accepted()

    # ---- expected transfers ----

    def expect(self, engine: Engine, request_id: str) -> None:
        """Start counting the immediates of `request_id`'s transfers into this engine
        incarnation. Two expected requests whose tags collide are refused."""
        expected = self._expected.setdefault(engine, {})
        tag = transfer_tag(request_id)
        held = expected.get(tag)
        if held is not None:
            if held.request_id == request_id:
                return
            raise PlanError(
                f"requests {held.request_id!r} and {request_id!r} share the 32-bit RDMA transfer tag "
                f"{tag:#x}; give one of them another id",
                request_id=request_id,
            )
        expected[tag] = _Expected(request_id)

    async def arrivals(self, engine: Engine, request_id: str, writer: Writer, count: int) -> None:
        """Return once `count` immediates of `request_id` from that writer incarnation have
        arrived. On a reliable connection an immediate completes after every write posted
        before it has landed, so this is the decode side's own proof that the bytes are there.
        The caller bounds the wait (its `wait_for_kv` deadline)."""
        held = self._expected.get(engine, {}).get(transfer_tag(request_id))
        if held is None or held.request_id != request_id:
            raise PlanError(
                f"engine {engine[0]!r} does not expect RDMA writes for request {request_id!r}",
                request_id=request_id,
                engine_id=engine[0],
            )
        if held.counts[writer] >= count:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held.waiters.append((writer, count, waiter))
        await waiter

    def cancel(self, engine: Engine, request_id: str) -> None:
        expected = self._expected.get(engine, {})
        tag = transfer_tag(request_id)
        held = expected.get(tag)
        if held is None or held.request_id != request_id:
            return
        del expected[tag]
        held.cancel()

    def expected(self, engine: Engine) -> list[str]:
        """The requests an engine incarnation expects, by id."""
        return [held.request_id for held in self._expected.get(engine, {}).values()]

    # ---- completions ----

    def on_receive(self, wc: Any, device: Device) -> None:
        """A work completion from the receive queue: count its immediate, post another receive."""
        enums = device.api.enums
        accepted = self.accepted.get(wc.qp_num)
        if wc.status != enums.IBV_WC_SUCCESS:
            self._metrics.rdma_receive(RdmaReceive.FLUSHED)
            return
        if accepted is None or accepted.retired:
            self._metrics.rdma_receive(RdmaReceive.UNKNOWN_CONNECTION)
            return
        with contextlib.suppress(*device.api.errors):
            device.post_recv(accepted.qp)
        if wc.opcode != enums.IBV_WC_RECV_RDMA_WITH_IMM:
            self._metrics.rdma_receive(RdmaReceive.UNEXPECTED_OPCODE)
            return
        expected = self._expected.get((accepted.dst_engine, accepted.dst_incarnation))
        held = expected.get(wc.imm_data) if expected is not None else None
        if held is None:
            self._metrics.rdma_receive(RdmaReceive.UNKNOWN)
            return
        self._metrics.rdma_receive(RdmaReceive.MATCHED)
        writer = (accepted.src_engine, accepted.src_incarnation)
        held.counts[writer] += 1
        waiting = []
        for entry in held.waiters:
            entry_writer, needed, waiter = entry
            if entry_writer == writer and held.counts[writer] >= needed:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                waiting.append(entry)
        held.waiters = waiting

    def close(self, device: Device | None) -> None:
        if device is not None:
            for accepted in self.accepted.values():
                device.close_qp(accepted.qp)
        self.accepted.clear()
        for expected in self._expected.values():
            for held in expected.values():
                held.cancel()
        self._expected.clear()
