"""Writes of the `verbs` transport (the write step across nodes): a plan's work requests posted
on a connection, and their completions settled.

Requests are posted in chunks that each end in a signalled one, no more outstanding than the
queue pair is deep. A failed work completion is a `WriteFailedError` naming the peer and the
op; a write that fails or is cancelled moves its QP to the error state and returns only once
every request it posted has completed (or been flushed), so no request outlives the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any

from kvray.errors import TransportError, WriteFailedError
from kvray.metrics import EngineMetrics
from kvray.transport.verbs.connections import Connection
from kvray.transport.verbs.device import Device
from kvray.transport.verbs.requests import Chunk, WriteRequest


class InFlight:
    """The work requests posted on one device's connections and not yet completed.

    `wake()` tells the completion poller that work may complete; `broken(connection)` that a
    connection failed, so no later write uses it (its failure is kept on it, `broken`)."""

    def __init__(
        self,
        device: Device,
        metrics: EngineMetrics,
        *,
        wake: Callable[[], None],
        broken: Callable[[Connection], None],
        drain_timeout_s: float,
    ) -> None:
        self._device = device
        self._metrics = metrics
        self._wake = wake
        self._broken = broken
        self._drain_timeout_s = drain_timeout_s
        #: Chunks by the id of their last (signalled) work request.
        self._chunks: dict[int, tuple[Connection, Chunk]] = {}
        self._wr_ids = itertools.count(1)

    def __bool__(self) -> bool:
        return bool(self._chunks)

    async def post(self, connection: Connection, requests: list[WriteRequest]) -> None:
        """Post `requests` in chunks that each end in a signalled one, at most a queue pair's
        depth outstanding; on failure or cancellation, flush and wait for every posted one."""
        depth = self._device.queue_depth()
        ours: list[Chunk] = []
        #: Chunks of this write not yet awaited, oldest first, and their work requests.
        window: list[Chunk] = []
        outstanding = 0
        try:
            start = 0
            while start < len(requests):
                if connection.broken is not None:
                    raise broken_error(connection)
                stop = start + 1
                while stop < len(requests) and not requests[stop - 1].signalled:
                    stop += 1
                while window and outstanding + (stop - start) > depth:
                    oldest = window.pop(0)
                    await oldest.future
                    outstanding -= len(oldest.requests)
                chunk = self._post_chunk(connection, requests, start, stop)
                ours.append(chunk)
                window.append(chunk)
                outstanding += stop - start
                start = stop
            for chunk in window:
                await chunk.future
        except BaseException:
            await self._drain(connection, ours)
            raise

    def _post_chunk(
        self, connection: Connection, requests: list[WriteRequest], start: int, stop: int
    ) -> Chunk:
        api = self._device.api
        enums = api.enums
        chunk_requests = requests[start:stop]
        first_wr_id = next(self._wr_ids)
        wr_ids = [first_wr_id] + [next(self._wr_ids) for _ in chunk_requests[1:]]
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        chunk = Chunk(wr_ids[0], wr_ids[-1], chunk_requests, start, len(requests), future)
        connection.in_flight.append(chunk)
        self._chunks[chunk.last_wr_id] = (connection, chunk)
        last = len(chunk_requests) - 1
        try:
            for position, (wr_id, request) in enumerate(zip(wr_ids, chunk_requests, strict=True)):
                sges = [api.SGE(sge.address, sge.length, sge.lkey) for sge in request.sges]
                with_immediate = request.immediate is not None
                wr = api.SendWR(
                    wr_id=wr_id,
                    opcode=enums.IBV_WR_RDMA_WRITE_WITH_IMM if with_immediate else enums.IBV_WR_RDMA_WRITE,
                    num_sge=len(sges),
                    imm_data=request.immediate or 0,
                    sg=sges,
                    send_flags=enums.IBV_SEND_SIGNALED if request.signalled or position == last else 0,
                )
                wr.set_wr_rdma(request.rkey, request.remote_address)
                connection.qp.post_send(wr)
        except api.errors as error:
            # Posting failed (queue full, QP not ready): what was posted still completes, the
            # rest never will. Mark the connection broken and let the completions settle it.
            connection.broken = f"posting a work request failed: {error}"
            self._set_error(connection)
            if position == 0:
                self._finish(connection, chunk, broken_error(connection))
        self._wake()
        return chunk

    def on_send(self, wc: Any) -> None:
        """A work completion from the send queue."""
        entry = self._chunks.get(wc.wr_id)
        if wc.status != self._device.api.enums.IBV_WC_SUCCESS:
            self._metrics.rdma_send_error()
            connection, chunk = self._chunk_of(wc.wr_id)
            if connection is None or chunk is None:
                return
            request = chunk.requests[wc.wr_id - chunk.first_wr_id]
            index = chunk.first_index + wc.wr_id - chunk.first_wr_id
            status = status_name(wc.status)
            if connection.broken is None:
                connection.broken = status
            self._set_error(connection)
            error = WriteFailedError(
                f"RDMA WRITE {index + 1} of {chunk.total} to engine {connection.engine_id!r} "
                f"(incarnation {connection.incarnation}) failed: {status} (vendor error "
                f"{wc.vendor_err:#x}); it wrote {request.nbytes} bytes at remote region "
                f"{request.remote_region} address {request.remote_address:#x} from op "
                f"{request.first_op}",
                engine_id=connection.engine_id,
                op=request.first_op,
                work_request=index,
                status=int(wc.status),
            )
            self._finish(connection, chunk, error)
            return
        if entry is not None:
            self._finish(entry[0], entry[1], None)

    def fail_all(self, reason: str) -> None:
        """Nothing can complete any more on this device: every chunk in flight fails."""
        for connection, chunk in list(self._chunks.values()):
            connection.broken = reason
            self._finish(connection, chunk, broken_error(connection))

    def _chunk_of(self, wr_id: int) -> tuple[Connection | None, Chunk | None]:
        for connection, chunk in self._chunks.values():
            if chunk.first_wr_id <= wr_id <= chunk.last_wr_id:
                return connection, chunk
        return None, None

    def _finish(self, connection: Connection, chunk: Chunk, error: BaseException | None) -> None:
        self._chunks.pop(chunk.last_wr_id, None)
        with contextlib.suppress(ValueError):
            connection.in_flight.remove(chunk)
        if not chunk.future.done():
            if error is None:
                chunk.future.set_result(None)
            else:
                chunk.future.set_exception(error)
        if connection.retired and not connection.in_flight:
            self._device.close_qp(connection.qp)

    def _set_error(self, connection: Connection) -> None:
        """No later write uses the connection, and everything still queued on it completes as
        flushed."""
        self._broken(connection)
        self._device.set_error(connection.qp)

    async def _drain(self, connection: Connection, chunks: list[Chunk]) -> None:
        """After a failure or cancellation: flush the QP and wait until no posted request of
        this write can still move a byte."""
        pending = [chunk.future for chunk in chunks if not chunk.future.done()]
        for chunk in chunks:
            if chunk.future.done() and not chunk.future.cancelled():
                chunk.future.exception()  # retrieved: the first failure is what the caller sees
        if not pending:
            return
        if connection.broken is None:
            connection.broken = "a write on it was cancelled or failed"
        self._set_error(connection)
        self._wake()
        waiting = asyncio.gather(*pending, return_exceptions=True)
        try:
            async with asyncio.timeout(self._drain_timeout_s):
                await asyncio.shield(waiting)
        except TimeoutError as error:
            raise TransportError(
                f"work requests to engine {connection.engine_id!r} were neither completed nor "
                f"flushed within {self._drain_timeout_s} s of moving the queue pair to the "
                "error state; the device is not answering",
                engine_id=connection.engine_id,
            ) from error
        except asyncio.CancelledError:
            await waiting  # cancelled again: still wait for the flush
            raise


def broken_error(connection: Connection) -> WriteFailedError:
    return WriteFailedError(
        f"the RDMA connection to engine {connection.engine_id!r} (incarnation "
        f"{connection.incarnation}) broke: {connection.broken}; it is dropped and the next "
        "write connects again",
        engine_id=connection.engine_id,
    )


#: enum ibv_wc_status, in order (its values are fixed by the verbs ABI).
_WC_STATUS = [
    "SUCCESS",
    "LOC_LEN_ERR",
    "LOC_QP_OP_ERR",
    "LOC_EEC_OP_ERR",
    "LOC_PROT_ERR",
    "WR_FLUSH_ERR",
    "MW_BIND_ERR",
    "BAD_RESP_ERR",
    "LOC_ACCESS_ERR",
    "REM_INV_REQ_ERR",
    "REM_ACCESS_ERR",
    "REM_OP_ERR",
    "RETRY_EXC_ERR",
    "RNR_RETRY_EXC_ERR",
    "LOC_RDD_VIOL_ERR",
    "REM_INV_RD_REQ_ERR",
    "REM_ABORT_ERR",
    "INV_EECN_ERR",
    "INV_EEC_STATE_ERR",
    "FATAL_ERR",
    "RESP_TIMEOUT_ERR",
    "GENERAL_ERR",
    "TM_ERR",
    "TM_RNDV_INCOMPLETE",
]


def status_name(status: int) -> str:
    if 0 <= status < len(_WC_STATUS):
        return f"IBV_WC_{_WC_STATUS[status]}"
    return f"work completion status {status}"
