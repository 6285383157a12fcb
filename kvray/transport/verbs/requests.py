"""Work requests of the `verbs` transport: a plan's op table as RDMA WRITE work requests.

Pure code (no pyverbs, no devices), so its arithmetic carries the property tests. Ops are
ordered by remote address; a run of ops that is contiguous on the remote side becomes one
WRITE whose scatter-gather list gathers the local pieces, cut wherever the device's limits
(SGEs per request, bytes per message) say. Every Nth request is signalled, and the last one
is a WRITE WITH IMMEDIATE, signalled, carrying the transfer's tag.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvray.errors import ConfigError
from kvray.plan import OpTable, check_op_table

#: An SGE's length is a 32-bit field; no message is cut longer than this, whatever the device says.
MAX_SGE_NBYTES = 2**31
#: Immediate data is 32 bits.
IMMEDIATE_LIMIT = 2**32


@dataclass(frozen=True, slots=True)
class RegisteredRegion:
    """A registered region as a work request names it: its first byte's address in the
    address space of its memory region (the MR's), its length, and its key (lkey or rkey)."""

    address: int
    length: int
    key: int


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """What one work request may carry, and how often one is signalled."""

    #: Scatter-gather entries per send work request (the QP's max_send_sge).
    max_sge: int
    #: Bytes per message (the port's max_msg_sz).
    max_message_nbytes: int
    #: Every Nth work request asks for a completion (the last one always does).
    signal_every: int

    def __post_init__(self) -> None:
        for name in ("max_sge", "max_message_nbytes", "signal_every"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"verbs {name} must be at least 1, got {value}", setting=name, value=value)


@dataclass(frozen=True, slots=True)
class ScatterGather:
    """One SGE: `length` bytes at `address` of the local memory region with `lkey`."""

    address: int
    length: int
    lkey: int


@dataclass(frozen=True, slots=True)
class WriteRequest:
    """One RDMA WRITE: the gathered SGEs land back to back from `remote_address` on."""

    remote_region: int
    remote_address: int
    rkey: int
    sges: tuple[ScatterGather, ...]
    signalled: bool
    #: Row in the op table of the first op this request writes (for error messages).
    first_op: int = 0
    #: The transfer's tag on the last request (WRITE WITH IMMEDIATE); None on the others.
    immediate: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(sge.length for sge in self.sges)


def transfer_tag(request_id: str) -> int:
    """The 32-bit tag a transfer's immediate carries: a digest of its request id, which both
    sides know, so the receiver can match it against the requests it expects."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "big")


def build_write_requests(
    ops: OpTable,
    local: Sequence[RegisteredRegion],
    remote: Sequence[RegisteredRegion],
    limits: DeviceLimits,
    *,
    immediate: int,
    local_engine: str = "local",
    remote_engine: str = "remote",
) -> list[WriteRequest]:
    """The work requests that write every op of `ops` (bounds-checked first, a `BoundsError`
    before anything exists), the last one carrying `immediate`."""
    if not 0 <= immediate < IMMEDIATE_LIMIT:
        raise ConfigError(f"an immediate is 32 bits, got {immediate}", setting="immediate", value=immediate)
    if not remote:
        raise ConfigError("a write needs at least one remote region", setting="remote", value=0)
    check_op_table(
        ops,
        [region.length for region in local],
        [region.length for region in remote],
        local_engine=local_engine,
        remote_engine=remote_engine,
    )
    message_cap = min(limits.max_message_nbytes, MAX_SGE_NBYTES)
    order = np.lexsort((ops.remote_offset, ops.remote_region))
    requests: list[_Pending] = []
    current: _Pending | None = None
    for row in order.tolist():
        remote_index = int(ops.remote_region[row])
        local_region = local[int(ops.local_region[row])]
        local_address = local_region.address + int(ops.local_offset[row])
        remote_offset = int(ops.remote_offset[row])
        remaining = int(ops.nbytes[row])
        while remaining:
            if current is None or not current.continues(remote_index, remote_offset, message_cap):
                current = _Pending(remote_index, remote_offset, row)
                requests.append(current)
            room = message_cap - current.nbytes
            if not current.extends_last(local_address, local_region.key):
                if len(current.sges) == limits.max_sge:
                    current = _Pending(remote_index, remote_offset, row)
                    requests.append(current)
                    room = message_cap
                current.sges.append([local_address, 0, local_region.key])
            piece = min(remaining, room)
            current.sges[-1][1] += piece
            current.nbytes += piece
            local_address += piece
            remote_offset += piece
            remaining -= piece
    if not requests:  # nothing to write: the immediate still travels, as a zero-byte WRITE
        requests.append(_Pending(0, 0, 0))
    last = len(requests) - 1
    return [
        WriteRequest(
            remote_region=pending.remote_region,
            remote_address=remote[pending.remote_region].address + pending.remote_offset,
            rkey=remote[pending.remote_region].key,
            sges=tuple(ScatterGather(address, length, lkey) for address, length, lkey in pending.sges),
            signalled=index == last or (index + 1) % limits.signal_every == 0,
            first_op=pending.first_op,
            immediate=immediate if index == last else None,
        )
        for index, pending in enumerate(requests)
    ]


class _Pending:
    """A work request being filled: a remote start and the SGEs gathered so far."""

    __slots__ = ("first_op", "nbytes", "remote_offset", "remote_region", "sges")

    def __init__(self, remote_region: int, remote_offset: int, first_op: int) -> None:
        self.remote_region = remote_region
        self.remote_offset = remote_offset
        self.first_op = first_op
        self.nbytes = 0
        #: [address, length, lkey] per SGE.
        self.sges: list[list[int]] = []

    def continues(self, remote_region: int, remote_offset: int, message_cap: int) -> bool:
        """Do bytes for `remote_offset` of `remote_region` go on in this request?"""
        return (
            remote_region == self.remote_region
            and remote_offset == self.remote_offset + self.nbytes
            and self.nbytes < message_cap
        )

    def extends_last(self, local_address: int, lkey: int) -> bool:
        """Do local bytes at `local_address` continue the last SGE?"""
        if not self.sges:
            return False
        address, length, key = self.sges[-1]
        return key == lkey and address + length == local_address


@dataclass
class Chunk:
    """Posted work requests whose last one is signalled: done when its completion arrives
    (the writes, `write.py`, post them; a connection, `connections.py`, keeps them in flight)."""

    first_wr_id: int
    last_wr_id: int
    requests: list[WriteRequest]
    first_index: int
    total: int
    future: asyncio.Future[None]
