"""Wire: the msgspec structs engines and the coordinator exchange (control plane only).

Region descriptors say what a peer may write into; `EngineInfo` is what an engine publishes;
each receiver decodes one family: `Notice` (a decode engine's completion inbox), `WriteOps`
(a `ray`-transport write), `WriteClaim`, `VerbsHandshake`. Bytes from a peer are decoded here and
nowhere else, into these types only (never pickle). New fields go last, with defaults.

Which error means what:

- `WireDecodeError` (a `MetadataError`): the bytes are not one kvray message of the family the
  receiver expects. Larger than that family's bound (`MAX_NOTICE_BYTES`, `MAX_PUSH_REQUEST_BYTES`,
  `MAX_WRITE_OPS_BYTES`, `MAX_ENGINE_INFO_BYTES`, `MAX_HANDSHAKE_BYTES`), not msgpack, nested
  too deep, a missing, foreign or unknown `type` tag, a missing or mistyped field, or one
  field's value out of its own range (a region of length 0, a size past 2**62, more blocks,
  ops, layers or regions than the bounds below). It names the offending field where it can.
  Receivers count these as malformed and drop them.
- `MetadataError` (and its other subclasses): the message decoded, but the description as a
  whole cannot be honoured: regions of another engine or numbered out of order, two regions
  or two layers over the same bytes, a layer that leaves its region (`BoundsError`).
  `kvray.validation.validate_engine_info` raises these; the coordinator runs it on every
  registration and a writer on every peer before its first write.

The bounds keep one message cheap to decode and to validate: a peer cannot make a receiver
allocate or loop in proportion to a number it claims. Each family's byte bound is what its
longest sequences allow, and is checked before a byte is decoded.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Literal, TypeVar

import msgspec

from kvray.errors import MetadataError, UnknownLayerError, WireDecodeError
from kvray.layout import (
    MAX_BLOCKS,
    MAX_BYTES,
    MAX_LAYERS,
    ByteCount,
    KVLayout,
    LayerPlacement,
    TensorParallel,
)

#: Most regions one engine may publish (one per tensor of a non-shared backing: K and V of
#: every layer).
MAX_REGIONS = 2 * MAX_LAYERS
#: Most transport endpoints one engine may publish.
MAX_ENDPOINTS = 64
#: Largest encoded `EngineInfo` decoded at all (a thousand-layer model takes well under 1 MiB).
MAX_ENGINE_INFO_BYTES = 8 * 1024 * 1024
#: Most blocks one request may hold. A request's blocks hold its context: 2**20 blocks of 16
#: tokens is 16M tokens, past any model's context and past the whole pool of a vLLM engine on
#: a large GPU (tens of thousands to a few hundred thousand blocks).
MAX_REQUEST_BLOCKS = 1 << 20
#: Most ops one `ray` write lists: one per layer part and run of contiguous blocks, so a request
#: of some thousands of scattered blocks over a hundred layer parts comes near a million.
MAX_WRITE_OPS = 1 << 22
#: Largest encoded notice or write claim: ids, counters and a failure's reason (a TCP notice
#: frame and a local datagram carry no more either).
MAX_NOTICE_BYTES = 64 * 1024
#: Largest encoded push request: its reservation's block ids (5 bytes each at most: msgpack
#: writes a number below 2**32 in 5), the decode engine's `EngineInfo`, and ids and counters.
#: KV cache groups a push request's block table may name (an engine's groups share their blocks'
#: memory; each group has its own block ids, see `PushRequest.groups`).
MAX_BLOCK_GROUPS = 8
#: Its reservation's blocks, and as many again in its block table (5 bytes each at most).
MAX_PUSH_REQUEST_BYTES = MAX_REQUEST_BLOCKS * 10 + MAX_ENGINE_INFO_BYTES + MAX_NOTICE_BYTES
#: Largest encoded `WriteOps` header: 16 bytes an op (a region index, an offset past 4 GiB in
#: 9 bytes, a size in 5) leaves room for the rest.
MAX_WRITE_OPS_BYTES = MAX_WRITE_OPS * 16
#: Largest encoded verbs handshake.
MAX_HANDSHAKE_BYTES = 1024 * 1024

#: A block's index in its engine's pool, as it travels on the wire.
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_BLOCKS)]
#: A position of a block table (`PushRequest.groups`): a block id, or -1 for no block.
GroupBlockId = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_BLOCKS)]
#: Most tensor-parallel ranks of one engine kvray accepts from a peer.
MAX_TP_RANKS = 64
#: The longest proof a push request or withdrawal carries (an HMAC-SHA256 is 32 bytes).
MAX_PROOF_NBYTES = 64
#: A tensor-parallel rank, and a number of them, as messages carry them.
TPRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_RANKS)]
TPSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_RANKS)]
#: A layer's position in an engine's layout.
LayerIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAYERS)]
#: A 64-bit hash value (msgpack carries no larger integer).
Uint64 = Annotated[int, msgspec.Meta(ge=0)]
#: One column of a `WriteOps` header.
OpColumn = Annotated[list[ByteCount], msgspec.Meta(max_length=MAX_WRITE_OPS)]


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class TransportKind(enum.Enum):
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"
    VERBS = "verbs"
    RAY = "ray"
    #: In-process, for tests and embedding (`kvray.transport.loopback`); never across processes.
    LOOPBACK = "loopback"


class RegionDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """One registered region of one engine incarnation: what a peer needs to write into it."""

    engine_id: str
    incarnation: ByteCount
    transport: TransportKind
    index: ByteCount
    #: Virtual address of the region's first byte in the owner's process where a writer needs it
    #: (`verbs`); 0 where the transport reaches the region by offset (shm, ray, loopback).
    address: ByteCount
    length: ByteCount
    #: Transport handle: a shared-memory path, a CUDA IPC handle, empty for `ray`.
    handle: bytes = b""
    #: Byte offset of the region inside what `handle` names (file or CUDA allocation).
    handle_offset: ByteCount = 0
    #: Remote key (RDMA rkey); 0 where the transport has none.
    key: ByteCount = 0
    #: Writable by peers? Only a decode engine's regions are, in push mode (invariant 6).
    remote_writable: bool = False

    def __post_init__(self) -> None:
        values = {
            "incarnation": self.incarnation,
            "index": self.index,
            "address": self.address,
            "length": self.length,
            "handle_offset": self.handle_offset,
            "key": self.key,
        }
        out_of_range = {name: value for name, value in values.items() if not 0 <= value < MAX_BYTES}
        if out_of_range or self.length == 0:
            raise MetadataError(
                f"region descriptor of {self.engine_id!r} needs a positive length and values in "
                f"[0, 2**62): {out_of_range or {'length': self.length}}",
                engine_id=self.engine_id,
            )


class CudaIpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A `cuda_ipc` region's `handle`: what torch needs to open another process's CUDA storage
    (see torch.multiprocessing)."""

    device_uuid: str
    #: The cudaIpcMemHandle of the whole CUDA allocation the storage lives in.
    handle: bytes
    storage_size: ByteCount
    #: Byte offset of the storage inside that allocation.
    storage_offset: ByteCount
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


_cuda_ipc_handle_decoder = msgspec.msgpack.Decoder(CudaIpcHandle)


def decode_cuda_ipc_handle(data: bytes) -> CudaIpcHandle:
    return _decode(_cuda_ipc_handle_decoder, data, "CUDA IPC handle", MAX_HANDSHAKE_BYTES)


def writer_target(region: RegionDescriptor) -> tuple[bytes, int] | None:
    """What a same-node writer opens for `region`, and where the region starts inside it:
    (the shared-memory path, `handle_offset`) for `shm`; (the device and allocation handle,
    the byte offset inside that allocation) for `cuda_ipc`; None where writes go by address
    and key instead. Two regions must not share bytes here, whatever their addresses say."""
    if not region.handle:
        return None
    if region.transport is TransportKind.SHM:
        return b"shm:" + region.handle, region.handle_offset
    if region.transport is TransportKind.CUDA_IPC:
        handle = decode_cuda_ipc_handle(region.handle)
        allocation = b"cuda_ipc:" + handle.device_uuid.encode() + b":" + handle.handle
        return allocation, handle.storage_offset + region.handle_offset
    return None


class VerbsEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's RDMA port (`verbs` transport): how a queue pair reaches it. Published in
    `EngineInfo` (a peer with one has an RDMA device) and repeated in each handshake."""

    device: str
    port: ByteCount
    #: The port's GID at `gid_index`, as pyverbs writes it ('xxxx:xxxx:...:xxxx').
    gid: str
    gid_index: ByteCount
    #: The port's LID (InfiniBand; 0 on RoCE, which routes by GID).
    lid: ByteCount
    #: The port's active MTU (an IBV_MTU_* value, 1 = 256 bytes ... 5 = 4096 bytes).
    mtu: ByteCount
    #: IBV_LINK_LAYER_*: 1 InfiniBand, 2 Ethernet (RoCE).
    link_layer: ByteCount


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine publishes through the coordinator."""

    engine_id: str
    incarnation: ByteCount
    role: Role
    node_id: str
    layout: KVLayout
    regions: Annotated[tuple[RegionDescriptor, ...], msgspec.Meta(max_length=MAX_REGIONS)]
    #: Per layer: where its bytes sit relative to the start of its region.
    placements: Annotated[dict[str, LayerPlacement], msgspec.Meta(max_length=MAX_LAYERS)]
    #: Transport-specific connection data (e.g. an RDMA queue pair's number and GID).
    endpoints: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_ENDPOINTS)] = {}
    #: The engine's RDMA port, when it takes `verbs` writes (None: it has no RDMA device).
    verbs: VerbsEndpoint | None = None

    def placement(self, layer: str) -> LayerPlacement:
        try:
            return self.placements[layer]
        except KeyError:
            raise UnknownLayerError(
                f"engine {self.engine_id!r} (incarnation {self.incarnation}) has no layer {layer!r}",
                engine_id=self.engine_id,
                incarnation=self.incarnation,
                layer=layer,
            ) from None


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """A decode engine's promise to take one request's KV, handed to the writer with the work.

    It says where (the engine incarnation and the request's blocks there) and carries a random
    `token` the engine checks on every write and notice for the request, so only the holder of
    the reservation can complete it. `slot` names the request's entry in the engine's claim
    board (`kvray.notice.claims`), through which a writer on the same node proves, while it writes,
    that the engine still expects the request. It stays inside the cluster: a token is a
    capability, never part of what an engine publishes.
    """

    request_id: str
    engine_id: str
    incarnation: ByteCount
    blocks: Annotated[tuple[BlockId, ...], msgspec.Meta(max_length=MAX_REQUEST_BLOCKS)]
    token: ByteCount
    slot: ByteCount = 0
    #: The decode engine checks this request's KV and refuses it unchecked (`Settings.integrity`):
    #: the writer checks it whatever its own setting.
    integrity: bool = False


class TransferNotice(msgspec.Struct, frozen=True, kw_only=True):
    """What every notice to a decode engine says: which transfer of which request, from which
    writer incarnation to which decode incarnation, under which reservation."""

    transfer_id: str
    request_id: str
    src_engine: str
    src_incarnation: int
    dst_engine: str
    dst_incarnation: int
    #: The secret of the decode engine's `Reservation`: a notice without it is dropped.
    token: ByteCount = 0


class TransferDone(TransferNotice, frozen=True, kw_only=True, tag="done"):
    """Sent to the decode engine after every byte of a transfer has been written."""

    nbytes: int
    #: True when this is the last part of the request (layer-wise pushes send several).
    final: bool = True
    #: Proofs of arrival the writer's transport gives the decode side for the request's writes
    #: (`Transport.arrival_proofs`): it completes the request only once that many have come.
    arrival_proofs: ByteCount = 0
    #: The hash of each layer's bytes as the writer read them (`kvray.integrity`): its
    #: algorithm ("" when the transfer was not checked), the layers (indices into the decode
    #: engine's layout) and their values. The decode side takes the request only when the
    #: bytes as landed hash the same.
    checksum: Literal["", "xxh3_64", "wsum64"] = ""
    checksum_layers: Annotated[tuple[LayerIndex, ...], msgspec.Meta(max_length=MAX_LAYERS)] = ()
    checksum_values: Annotated[tuple[Uint64, ...], msgspec.Meta(max_length=MAX_LAYERS)] = ()
    #: The writer's tensor-parallel rank (None: it holds every head this engine holds), which
    #: says what part of each block it wrote.
    src_tp: TensorParallel | None = None
    #: The layers the transfer moved (indices into the decode engine's layout), and the
    #: placement digest of the ranges the writer's executor stored to (`kvray.placement`; a
    #: receiving executor's own adds to it). The decode side takes the request only when the
    #: sum equals the digest of where its own layout puts those layers' parts of the
    #: reservation's blocks. `placement` stays last: the C copy pool writes it into the
    #: encoded notice's final 8 bytes.
    layers: Annotated[tuple[LayerIndex, ...], msgspec.Meta(max_length=MAX_LAYERS)] = ()
    #: The content digest of the transfer the writer computed from its own blocks and both
    #: engines' layouts (`kvray.content.Stretches`; None: not computed, then `checksum` is set
    #: when the transfer is checked), and the one its executor computed while copying (None:
    #: its copy does not hash; a receiving executor's own adds to it). The decode side takes
    #: the request only when the two agree.
    #: For a transfer whose copy does not hash (`verbs`): the landed digest of the bytes as
    #: they must sit in the decode engine's blocks (`kvray.content.landed_digest`), which the
    #: decode side computes over what landed, after the last write.
    landed: Uint64 | None = None
    reference: Uint64 | None = None
    content: Uint64 | None = None
    placement: Uint64 = 0


class TransferFailed(TransferNotice, frozen=True, kw_only=True, tag="failed"):
    """Sent to the decode engine when a transfer it waits for cannot complete."""

    reason: str


#: What a decode engine's completion inbox (and `AgentHost.kvray_notify`) takes.
Notice = TransferDone | TransferFailed


class WriteOps(msgspec.Struct, frozen=True, kw_only=True, tag="write_ops"):
    """Header of a `ray`-transport write: the ops whose gathered bytes travel beside it.

    Offsets are relative to the destination's region `region`; the payload holds the ops'
    bytes back to back in this order.
    """

    transfer_id: str
    dst_engine: str
    dst_incarnation: int
    regions: OpColumn
    remote_offsets: OpColumn
    nbytes: OpColumn
    #: The request the bytes belong to: the receiver takes writes only for requests it expects.
    request_id: str = ""
    #: The secret of the decode engine's `Reservation`: a write without it is refused.
    token: ByteCount = 0
    #: Each op's region and offset in the writer's memory: the receiver hashes the bytes it
    #: scatters as the bytes there (`kvray.content`). Empty: not hashed.
    src_regions: OpColumn = msgspec.field(default_factory=list)
    src_offsets: OpColumn = msgspec.field(default_factory=list)


class WriteClaim(msgspec.Struct, frozen=True, kw_only=True, tag="claim"):
    """A writer on another node asks the decode engine, before its first one-sided write of a
    request (`verbs`), to hold the request's blocks for it until its notice (done or failed)
    arrives: the engine refuses if it no longer expects the request under this token."""

    request_id: str
    token: ByteCount
    src_engine: str
    src_incarnation: ByteCount
    dst_engine: str
    dst_incarnation: ByteCount


class PushRequest(msgspec.Struct, frozen=True, kw_only=True, tag="push_request"):
    """A decode engine asks a prefill engine to push one finished request's KV into the blocks
    it reserved (engine integrations where the decode side learns of the request first, e.g.
    vLLM's). Fenced by both incarnations: the prefill engine pushes only a request it holds
    under `src_incarnation`, into `reservation` (which carries the decode side's token)."""

    #: The request's id at the prefill engine.
    request_id: str
    src_engine: str
    src_incarnation: ByteCount
    reservation: Reservation
    #: The prefill engine's block (in the request's block list) the reservation's first
    #: block takes: blocks the decode side already holds (its own prefix cache) are skipped.
    first_block: ByteCount = 0
    #: The decode engine's encoded `EngineInfo`, where no coordinator is shared.
    decode_info: bytes = b""
    #: Engines whose KV cache has several groups (e.g. sliding-window and full-attention
    #: layers): the decode engine's block ids per group, position by position from
    #: `first_block`, -1 where it keeps no block (outside a sliding window). Its non-negative
    #: entries, in order, are the reservation's blocks. Empty: one group, the reservation's.
    groups: Annotated[
        tuple[Annotated[tuple[GroupBlockId, ...], msgspec.Meta(max_length=MAX_REQUEST_BLOCKS)], ...],
        msgspec.Meta(max_length=MAX_BLOCK_GROUPS),
    ] = ()
    #: Which tensor-parallel rank of the decode engine asks, of how many: each rank of a decode
    #: engine sends every rank of the prefill engine one message (this, or a `PushWithdrawn`
    #: where it reads none of that rank's KV), so a prefill rank knows when all have answered.
    decode_rank: TPRank = 0
    decode_ranks: TPSize = 1
    #: That the message comes from an engine of the prefill engine's deployment: an HMAC over
    #: the prefill engine and hand-off id under the deployment's key
    #: (`kvray.agent.handoff.AskProof`); empty where the engines share no key.
    proof: Annotated[bytes, msgspec.Meta(max_length=MAX_PROOF_NBYTES)] = b""


class PushWithdrawn(msgspec.Struct, frozen=True, kw_only=True, tag="push_withdrawn"):
    """A decode engine will not take a request it was to ask for (it ended before its blocks
    were reserved, or its load was cancelled): the prefill engine frees the request's blocks
    (or refuses to hold them) instead of keeping them for its lease. `request_id` is the
    hand-off id, which only the two engines know."""

    request_id: str
    src_engine: str
    src_incarnation: ByteCount
    #: As in `PushRequest`: the decode rank that will not ask, of how many, and the proof.
    decode_rank: TPRank = 0
    decode_ranks: TPSize = 1
    proof: Annotated[bytes, msgspec.Meta(max_length=MAX_PROOF_NBYTES)] = b""


#: What a decode engine sends a prefill engine about one request.
PushMessage = PushRequest | PushWithdrawn


class VerbsRegionKey(msgspec.Struct, frozen=True, kw_only=True):
    """One region of a decode engine as its RDMA memory region exposes it."""

    index: ByteCount
    #: Address of the region's first byte in the memory region's address space.
    address: ByteCount
    length: ByteCount
    rkey: ByteCount


class VerbsConnect(msgspec.Struct, frozen=True, kw_only=True, tag="verbs_connect"):
    """A writer asks a decode engine for a reliable-connected queue pair facing its own."""

    src_engine: str
    src_incarnation: ByteCount
    dst_engine: str
    dst_incarnation: ByteCount
    endpoint: VerbsEndpoint
    qp_num: ByteCount
    psn: ByteCount


class VerbsAccept(msgspec.Struct, frozen=True, kw_only=True, tag="verbs_accept"):
    """The decode engine's answer: its queue pair (ready to receive) and its regions' keys."""

    dst_engine: str
    dst_incarnation: ByteCount
    endpoint: VerbsEndpoint
    qp_num: ByteCount
    psn: ByteCount
    regions: Annotated[tuple[VerbsRegionKey, ...], msgspec.Meta(max_length=MAX_REGIONS)]


VerbsHandshake = VerbsConnect | VerbsAccept

_message_encoder = msgspec.msgpack.Encoder()
_notice_decoder = msgspec.msgpack.Decoder(Notice)
_engine_decoder = msgspec.msgpack.Decoder(EngineInfo)
_handshake_decoder = msgspec.msgpack.Decoder(VerbsHandshake)
# The families of one struct decode through the union of every tagged message: msgspec requires
# a struct's tag only where it must choose among a union's members, so a `WriteOps` decoded on
# its own would pass without its tag. The tag comes first in every encoding, so the union costs
# one lookup.
_tagged_decoder = msgspec.msgpack.Decoder(
    TransferDone
    | TransferFailed
    | WriteOps
    | WriteClaim
    | PushRequest
    | PushWithdrawn
    | VerbsConnect
    | VerbsAccept
)

T = TypeVar("T")
Tagged = TypeVar("Tagged", WriteOps, WriteClaim, PushRequest)


def decode_push_message(data: bytes) -> PushMessage:
    """What a decode engine sends a prefill engine's push inbox: a request or a withdrawal."""
    message = _decode(_tagged_decoder, data, "push request", MAX_PUSH_REQUEST_BYTES)
    if not isinstance(message, (PushRequest, PushWithdrawn)):
        tag = type(message).__struct_config__.tag
        raise WireDecodeError(
            f"invalid kvray push request: got a {tag!r} message - at `$.type`", field="$.type"
        )
    return message


def encode(
    value: Notice
    | WriteOps
    | EngineInfo
    | RegionDescriptor
    | VerbsHandshake
    | WriteClaim
    | PushRequest
    | PushWithdrawn,
) -> bytes:
    return _message_encoder.encode(value)


def decode_notice(data: bytes) -> Notice:
    return _decode(_notice_decoder, data, "notice", MAX_NOTICE_BYTES)


def decode_notice_or_none(data: bytes) -> Notice | None:
    """`decode_notice` for the usual case, in fewer steps: None where `decode_notice` would
    raise (it then says why)."""
    if type(data) is not bytes or len(data) > MAX_NOTICE_BYTES:
        return None
    try:
        return _notice_decoder.decode(data)
    except Exception:  # refused below, by decode_notice, with the reason
        return None


def decode_write_ops(data: bytes) -> WriteOps:
    return _decode_tagged(WriteOps, data, "write_ops header", MAX_WRITE_OPS_BYTES)


def decode_engine_info(data: bytes) -> EngineInfo:
    return _decode(_engine_decoder, data, "engine info", MAX_ENGINE_INFO_BYTES)


def decode_write_claim(data: bytes) -> WriteClaim:
    return _decode_tagged(WriteClaim, data, "write claim", MAX_NOTICE_BYTES)


def decode_push_request(data: bytes) -> PushRequest:
    return _decode_tagged(PushRequest, data, "push request", MAX_PUSH_REQUEST_BYTES)


def decode_verbs_handshake(data: bytes) -> VerbsHandshake:
    return _decode(_handshake_decoder, data, "verbs handshake", MAX_HANDSHAKE_BYTES)


def _decode_tagged(family: type[Tagged], data: bytes, what: str, max_nbytes: int) -> Tagged:
    message = _decode(_tagged_decoder, data, what, max_nbytes)
    if not isinstance(message, family):
        tag = type(message).__struct_config__.tag
        raise WireDecodeError(
            f"invalid kvray {what}: got a {tag!r} message - at `$.type`",
            what=what,
            field="$.type",
        )
    return message


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str, max_nbytes: int) -> T:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireDecodeError(f"a kvray {what} must arrive as bytes, got {type(data).__name__}", what=what)
    nbytes = memoryview(data).nbytes
    if nbytes > max_nbytes:
        raise WireDecodeError(
            f"a kvray {what} of {nbytes} bytes is larger than the {max_nbytes} kvray accepts",
            what=what,
            field=None,
            nbytes=nbytes,
        )
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as error:
        field = _field_of(str(error))
        raise WireDecodeError(f"invalid kvray {what}: {error}", what=what, field=field) from None
    except msgspec.DecodeError as error:
        raise WireDecodeError(f"malformed kvray {what}: {error}", what=what, field=None) from None
    except RecursionError:
        # Unknown fields are skipped, not refused, so their depth is the sender's to choose.
        raise WireDecodeError(f"malformed kvray {what}: nested too deep", what=what, field=None) from None
    except MetadataError as error:
        # A struct's own check (e.g. a region of length 0) refused a decoded value.
        raise WireDecodeError(
            f"invalid kvray {what}: {error}", what=what, field=None, engine_id=error.facts.get("engine_id")
        ) from None


_FIELD_PATH = re.compile(r"at (?:`key` in )?`(\$[^`]*)`$")


def _field_of(message: str) -> str | None:
    """The `$.path` msgspec names in a validation message (`$` for a missing top-level field)."""
    match = _FIELD_PATH.search(message)
    if match is not None:
        return match.group(1)
    missing = re.match(r"Object missing required field `([^`]+)`$", message)
    if missing is not None:
        return f"$.{missing.group(1)}"
    return None
