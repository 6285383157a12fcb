"""The `verbs` handshake (before a write across nodes): one reliable-connected queue pair per
(writer incarnation, decode incarnation), set up through the actor hosting the decode agent.

The writer creates its QP and sends `VerbsConnect` (its GID, QPN, PSN, MTU) to the decode
engine's host (`AgentHost.kvray_connect`); the decode side checks who asks (`read_request`,
`check_writer`), creates the facing QP, posts receives and takes it INIT -> RTR -> RTS
(`open_facing`), and answers `VerbsAccept` (its QPN, PSN and each region's address, length and
rkey); the writer checks the answer against the regions the engine published and takes its own
QP INIT -> RTR -> RTS (`connect`).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvray.errors import (
    KvrayError,
    MetadataError,
    RegionError,
    StaleIncarnationError,
    TransferTimeoutError,
    TransportError,
    WireDecodeError,
)
from kvray.transport.base import Peer
from kvray.transport.verbs.device import RECV_DEPTH, Device
from kvray.transport.verbs.requests import Chunk, RegisteredRegion
from kvray.wire import (
    EngineInfo,
    Role,
    VerbsAccept,
    VerbsConnect,
    VerbsRegionKey,
    decode_verbs_handshake,
    encode,
)

#: Who writes through a connection: (engine id, incarnation).
Writer = tuple[str, int]


@dataclass
class Connection:
    """The writer's end of a reliable connection to one decode engine incarnation."""

    engine_id: str
    incarnation: int
    writer: Writer
    qp: Any
    regions: tuple[VerbsRegionKey, ...]
    #: Chunks posted and not yet completed, oldest first.
    in_flight: list[Chunk] = field(default_factory=list)
    broken: str | None = None
    retired: bool = False

    def remote_regions(self) -> list[RegisteredRegion]:
        """The decode engine's regions as a work request names them (rkeys)."""
        return [RegisteredRegion(key.address, key.length, key.rkey) for key in self.regions]

    def retire(self, device: Device) -> None:
        """No new write uses it; its queue pair closes once no posted request is in flight."""
        self.retired = True
        if not self.in_flight:
            device.close_qp(self.qp)


@dataclass
class Accepted:
    """The decode side's end of a reliable connection from one writer incarnation."""

    src_engine: str
    src_incarnation: int
    dst_engine: str
    dst_incarnation: int
    qp: Any
    retired: bool = False


# ---- the writer's half ----------------------------------------------------------------------------


async def connect(device: Device, peer: Peer, writer: Writer, timeout_s: float) -> Connection:
    """A connection from `writer` to the decode engine `peer`, ready to write; the peer's host
    has `timeout_s` to answer."""
    info = peer.info
    if peer.host is None:
        raise TransportError(
            f"engine {info.engine_id!r} has no host actor to connect through; the verbs "
            "transport needs the peer's agent in an AgentHost actor",
            engine_id=info.engine_id,
        )
    qp = device.create_qp(access=0)
    psn = secrets.randbits(24)
    src_engine, src_incarnation = writer
    request = VerbsConnect(
        src_engine=src_engine,
        src_incarnation=src_incarnation,
        dst_engine=info.engine_id,
        dst_incarnation=info.incarnation,
        endpoint=device.endpoint,
        qp_num=int(qp.qp_num),
        psn=psn,
    )
    try:
        try:
            async with asyncio.timeout(timeout_s):
                reply_bytes = await peer.host.kvray_connect.remote(encode(request))
        except TimeoutError as error:
            raise TransferTimeoutError(
                f"engine {info.engine_id!r} did not answer an RDMA connection request within {timeout_s} s",
                engine_id=info.engine_id,
                timeout_s=timeout_s,
            ) from error
        except Exception as error:
            cause = getattr(error, "cause", None) or error
            if isinstance(cause, KvrayError):
                raise cause from error
            raise TransportError(
                f"engine {info.engine_id!r} refused an RDMA connection: {type(cause).__name__}: {cause}",
                engine_id=info.engine_id,
            ) from error
        reply = decode_verbs_handshake(reply_bytes)
        if not isinstance(reply, VerbsAccept):
            raise WireDecodeError("expected verbs_accept", field="$.type")
        check_reply(reply, info)
        device.connect_qp(qp, reply.endpoint, reply.qp_num, rq_psn=reply.psn, sq_psn=psn)
    except BaseException:
        device.close_qp(qp)
        raise
    return Connection(info.engine_id, info.incarnation, writer, qp, reply.regions)


def check_reply(reply: VerbsAccept, info: EngineInfo) -> None:
    """The decode engine answered for the incarnation the plan is for, with its published regions."""
    if (reply.dst_engine, reply.dst_incarnation) != (info.engine_id, info.incarnation):
        raise StaleIncarnationError(
            f"engine {info.engine_id!r} answered the RDMA connection as {reply.dst_engine!r} "
            f"incarnation {reply.dst_incarnation}, not incarnation {info.incarnation}; look it up again",
            engine_id=info.engine_id,
            incarnation=reply.dst_incarnation,
            stale_incarnation=info.incarnation,
        )
    published = info.regions
    keys = reply.regions
    if len(keys) != len(published) or any(
        key.index != index or key.length != region.length or (region.key and region.key != key.rkey)
        for index, (key, region) in enumerate(zip(keys, published, strict=False))
    ):
        raise MetadataError(
            f"engine {info.engine_id!r} answered the RDMA connection with regions that are not the "
            "ones it published; look it up again",
            engine_id=info.engine_id,
        )


# ---- the decode side's half -----------------------------------------------------------------------


def read_request(request: bytes, info: EngineInfo) -> VerbsConnect:
    """A `VerbsConnect` addressed to the engine `info` describes, which must be a decode engine
    whose regions are all remotely writable."""
    message = decode_verbs_handshake(request)
    if not isinstance(message, VerbsConnect):
        raise WireDecodeError("expected verbs_connect", field="$.type")
    if (message.dst_engine, message.dst_incarnation) != (info.engine_id, info.incarnation):
        raise StaleIncarnationError(
            f"an RDMA connection request for engine {message.dst_engine!r} incarnation "
            f"{message.dst_incarnation} reached engine {info.engine_id!r} incarnation "
            f"{info.incarnation}; the writer must look the engine up again",
            engine_id=info.engine_id,
            incarnation=info.incarnation,
            stale_incarnation=message.dst_incarnation,
        )
    if info.role is not Role.DECODE or not all(region.remote_writable for region in info.regions):
        raise RegionError(
            f"engine {info.engine_id!r} ({info.role.value}) exposes no writable region and takes "
            "no RDMA connections",
            engine_id=info.engine_id,
        )
    return message


async def check_writer(
    message: VerbsConnect, registered: Callable[[str, int], Awaitable[EngineInfo]]
) -> None:
    """Refuse a connection request whose claimed writer is not a registered prefill engine at
    the incarnation it names (`registered(engine_id, incarnation)` returns that engine's
    current registration, or raises)."""
    writer = await registered(message.src_engine, message.src_incarnation)
    if writer.engine_id != message.src_engine or writer.role is not Role.PREFILL:
        raise MetadataError(
            f"an RDMA connection request names writer {message.src_engine!r}, which is "
            f"registered as a {writer.role.value} engine; only prefill engines write",
            engine_id=message.src_engine,
        )
    if writer.incarnation != message.src_incarnation:
        raise StaleIncarnationError(
            f"an RDMA connection request names incarnation {message.src_incarnation} of "
            f"writer {message.src_engine!r}, which is registered at incarnation "
            f"{writer.incarnation}; the writer must register before it connects",
            engine_id=message.src_engine,
            incarnation=writer.incarnation,
            stale_incarnation=message.src_incarnation,
        )


def open_facing(device: Device, message: VerbsConnect) -> tuple[Any, int]:
    """A queue pair facing the writer's, which may write into this device's remotely writable
    memory, with receives posted for its immediates; and its first packet sequence number."""
    qp = device.create_qp(access=device.api.enums.IBV_ACCESS_REMOTE_WRITE)
    psn = secrets.randbits(24)
    try:
        for _ in range(RECV_DEPTH):
            device.post_recv(qp)
        device.connect_qp(qp, message.endpoint, message.qp_num, rq_psn=message.psn, sq_psn=psn)
    except BaseException:
        device.close_qp(qp)
        raise
    return qp, psn
