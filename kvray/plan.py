"""Plan: which bytes go where (fifth step of the data flow). Pure code: no Ray, no devices.

Given the local and remote `EngineInfo` and a request's block ids, `plan_transfer` produces
write ops `(local_region, local_offset, remote_region, remote_offset, nbytes)`: one per
(layer, part, block), then contiguous runs merged. Between tensor-parallel ranks that hold
different KV heads (`KVLayout.tp`), one per (layer, piece of a block, block) instead: the pieces
hold the heads both ranks hold (`kvray.tensor_parallel`). Every op is bounds-checked against both
regions before the plan exists (invariant 2). Layer offsets come from an `OffsetCache` keyed
by `(engine, incarnation, layer, geometry)` (invariant 3): two layers of the same geometry
never share an entry, an unknown layer raises, and a new incarnation misses the cache.

The per-op loops run in C where `kvray._plan` is built (`pip install` builds it): sorting and
checking block ids, expanding rows into ops, merging, and the bounds check; for a pair of
engines planned before, a request's checks are one C call over rows derived once per pair
(`OffsetCache.pairing`). Each has a numpy twin here that gives the same answer; the twin runs
when the module is missing, and whenever a C check fails, so that every error is raised, and
worded, by the numpy code alone.

It is longer than kvray's other modules because each of those loops and its numpy twin are
kept side by side, where one can be read against the other.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple, cast

import numpy as np
import numpy.typing as npt

from kvray.errors import (
    BlockIdError,
    BoundsError,
    GeometryMismatchError,
    MetadataError,
    PlanError,
    UnknownLayerError,
)
from kvray.layout import Geometry, Int64Array, LayerPlacement, ceil_div
from kvray.tensor_parallel import HeadPiece, check_head_geometries, head_pieces, shared_heads
from kvray.validation import validate_engine_info
from kvray.wire import EngineInfo

_native: ModuleType | None
try:
    from kvray import _plan as _native
except ImportError:  # built by `pip install`; a source checkout without a build uses numpy alone
    _native = None


def native() -> bool:
    """True when the planner's C loops (`kvray._plan`) are built."""
    return _native is not None


class OffsetKey(NamedTuple):
    """Invariant 3's key: a layer's offsets belong to one engine incarnation and one layer."""

    engine_id: str
    incarnation: int
    layer: str
    geometry: Geometry


@dataclass(frozen=True)
class PartRows:
    """One row per (layer, part) of a list of layers: where block 0 of that part sits and the
    stride to the next block. Byte of block b = base + b * block_stride, in region `region`."""

    layers: tuple[str, ...]
    region: Int64Array
    base: Int64Array
    block_stride: Int64Array
    nbytes: Int64Array
    #: Index of the first row of each layer in `layers` (len(layers) + 1 entries).
    layer_starts: tuple[int, ...]


@dataclass(frozen=True)
class OpTable:
    """Write ops as parallel int64 arrays, sorted by local (region, offset)."""

    local_region: Int64Array
    local_offset: Int64Array
    remote_region: Int64Array
    remote_offset: Int64Array
    nbytes: Int64Array

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())

    def rows(self) -> list[tuple[int, int, int, int, int]]:
        """The ops as Python tuples (for tests and reports, not for hot paths)."""
        return list(
            zip(
                self.local_region.tolist(),
                self.local_offset.tolist(),
                self.remote_region.tolist(),
                self.remote_offset.tolist(),
                self.nbytes.tolist(),
                strict=True,
            )
        )


@dataclass(frozen=True)
class RequestRows:
    """A request's ops before expansion: op (row r, block i) copies `local.nbytes[r]` bytes
    from `local.base[r] + local_ids[i] * local.block_stride[r]` to the same arithmetic on the
    remote side. Both id arrays are validated and paired, in ascending local order. A GPU
    writer can expand them itself, so the host never builds one row per op."""

    local: PartRows
    remote: PartRows
    local_ids: Int64Array
    remote_ids: Int64Array
    #: What planning checked (invariant 2): the local and remote region lengths and both id
    #: arrays' bytes. A writer that sees the same lengths and ids need not check them again.
    checked: tuple[tuple[int, ...], tuple[int, ...], bytes] | None = None

    def ids_bytes(self) -> bytes:
        return self.local_ids.tobytes() + self.remote_ids.tobytes()

    def was_checked_against(self, local_lengths: tuple[int, ...], remote_lengths: tuple[int, ...]) -> bool:
        checked = self.checked
        return (
            checked is not None
            and checked[:2] == (local_lengths, remote_lengths)
            and checked[2] == self.ids_bytes()
        )

    @property
    def count(self) -> int:
        """Ops before merging: one per (layer, part) row and block."""
        return int(self.local.base.size * self.local_ids.size)


@dataclass(frozen=True)
class TransferPlan:
    """The ops that move a request's blocks of `layers` from one engine to another.

    A planned request carries its `rows` (checked against both regions, invariant 2) and
    expands them into op tables only when something reads `ops` or `unmerged`; a plan built
    from op tables directly (`from_ops`) carries those instead."""

    src_engine: str
    src_incarnation: int
    dst_engine: str
    dst_incarnation: int
    layers: tuple[str, ...]
    #: The request's rows and block ids (None for a plan built from op tables).
    rows: RequestRows | None = None
    #: The request the plan moves, when the caller names it (the receiver may fence on it).
    request_id: str = ""
    #: The secret of the request's reservation, shown to a receiver that checks writes.
    token: int = 0
    #: (merged ops, unmerged ops, layer starts) of a plan built from op tables.
    tables: tuple[OpTable, OpTable, tuple[int, ...]] | None = None
    #: The write's copy hashes what it moves (`kvray.content`), where its transport can
    #: (`Transport.hashes`): the request's content is checked that way.
    hashed: bool = False

    def __post_init__(self) -> None:
        if (self.rows is None) == (self.tables is None):
            raise PlanError("a transfer plan carries either its rows or its op tables, exactly one")

    @classmethod
    def from_ops(
        cls,
        src_engine: str,
        src_incarnation: int,
        dst_engine: str,
        dst_incarnation: int,
        layers: tuple[str, ...],
        ops: OpTable,
        unmerged: OpTable,
        layer_starts: tuple[int, ...],
    ) -> TransferPlan:
        return cls(
            src_engine,
            src_incarnation,
            dst_engine,
            dst_incarnation,
            layers,
            tables=(ops, unmerged, layer_starts),
        )

    @functools.cached_property
    def _tables(self) -> tuple[OpTable, OpTable, tuple[int, ...]]:
        if self.tables is not None:
            return self.tables
        rows = self.rows
        assert rows is not None
        unmerged, in_order = _expand(rows.local, rows.remote, rows.local_ids, rows.remote_ids)
        layer_starts = tuple((np.asarray(rows.local.layer_starts) * rows.local_ids.size).tolist())
        return merge_ops(unmerged, in_order), unmerged, layer_starts

    @property
    def ops(self) -> OpTable:
        """Ops merged across blocks and layers where both sides are contiguous."""
        return self._tables[0]

    @property
    def unmerged(self) -> OpTable:
        """Ops before merging: one per (layer, part, block)."""
        return self._tables[1]

    @property
    def layer_starts(self) -> tuple[int, ...]:
        """Index in `unmerged` of each layer's first op (len(layers) + 1 entries)."""
        return self._tables[2]

    @property
    def unmerged_count(self) -> int:
        """len(unmerged), without expanding the rows."""
        return self.rows.count if self.rows is not None else len(self.unmerged)

    @property
    def nbytes(self) -> int:
        if self.rows is not None:
            return int(self.rows.local.nbytes.sum()) * int(self.rows.local_ids.size)
        return self.ops.total_nbytes

    def layer_ops(self, layer: str) -> OpTable:
        """One layer's ops, merged within the layer."""
        try:
            index = self.layers.index(layer)
        except ValueError:
            raise UnknownLayerError(f"layer {layer!r} is not part of this plan", layer=layer) from None
        start, stop = self.layer_starts[index], self.layer_starts[index + 1]
        unmerged = self.unmerged
        return merge_ops(
            OpTable(
                unmerged.local_region[start:stop],
                unmerged.local_offset[start:stop],
                unmerged.remote_region[start:stop],
                unmerged.remote_offset[start:stop],
                unmerged.nbytes[start:stop],
            )
        )


@dataclass(frozen=True)
class Pairing:
    """What planning reads of one pair of engine incarnations and list of layers, derived once
    (`OffsetCache.pairing`): the layers, both sides' rows and region lengths, and what the one
    C call of `plan_transfer` takes besides the ids."""

    layers: tuple[str, ...]
    local: PartRows
    remote: PartRows
    local_lengths: tuple[int, ...]
    remote_lengths: tuple[int, ...]
    #: The rest of `kvray._plan.plan_ids`' arguments: both pool sizes, then each side's rows
    #: as one 4 x rows int64 array (region, base, stride, bytes) and its region lengths.
    native_args: tuple[int, int, Int64Array, Int64Array, Int64Array, Int64Array]
    #: The model-wide (first KV head, count) moved, between TP ranks that hold different heads
    #: (the rows are then slices of blocks, `head_rows`); None when whole blocks move.
    heads: tuple[int, int] | None = None


# ---- the offset cache ----------------------------------------------------------------------


class OffsetCache:
    """Validated per-layer offsets of engine incarnations, keyed by invariant 3's `OffsetKey`."""

    def __init__(self) -> None:
        self._layers: dict[OffsetKey, LayerPlacement] = {}
        self._rows: dict[tuple[str, int, tuple[str, ...]], PartRows] = {}
        self._pairs: dict[tuple[str, int, str, int, tuple[str, ...] | None], tuple[str, ...]] = {}
        self._pairings: dict[tuple[str, int, str, int, tuple[str, ...] | None], Pairing] = {}
        self._engines: dict[str, tuple[int, EngineInfo]] = {}
        self.hits = 0
        self.misses = 0

    def key(self, info: EngineInfo, layer: str) -> OffsetKey:
        return OffsetKey(info.engine_id, info.incarnation, layer, info.layout.layer(layer).geometry)

    def placement(self, info: EngineInfo, layer: str) -> LayerPlacement:
        self._admit(info)
        key = self.key(info, layer)
        cached = self._layers.get(key)
        if cached is None:
            cached = info.placement(layer)
            self._layers[key] = cached
        return cached

    def rows(self, info: EngineInfo, layers: tuple[str, ...]) -> PartRows:
        self._admit(info)
        rows_key = (info.engine_id, info.incarnation, layers)
        cached = self._rows.get(rows_key)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        region: list[int] = []
        base: list[int] = []
        stride: list[int] = []
        nbytes: list[int] = []
        layer_starts = [0]
        for layer in layers:
            placement = self.placement(info, layer)
            for part in range(placement.parts):
                region.append(placement.region)
                base.append(placement.offset + part * placement.part_stride)
                stride.append(placement.block_stride)
                nbytes.append(placement.part_nbytes)
            layer_starts.append(len(base))
        cached = PartRows(
            layers,
            np.array(region, dtype=np.int64),
            np.array(base, dtype=np.int64),
            np.array(stride, dtype=np.int64),
            np.array(nbytes, dtype=np.int64),
            tuple(layer_starts),
        )
        self._rows[rows_key] = cached
        return cached

    def compatible(
        self, local: EngineInfo, remote: EngineInfo, layers: Sequence[str] | None = None
    ) -> tuple[str, ...]:
        """`check_compatible` once per pair of engine incarnations and list of layers."""
        self._admit(local)
        self._admit(remote)
        pair_key = _pair_key(local, remote, layers)
        names = self._pairs.get(pair_key)
        if names is None:
            names = check_compatible(local, remote, pair_key[4])
            self._pairs[pair_key] = names
        return names

    def forget(self, engine_id: str) -> None:
        """Drop every entry of an engine (it deregistered or died)."""
        self._engines.pop(engine_id, None)
        self._layers = {k: v for k, v in self._layers.items() if k.engine_id != engine_id}
        self._rows = {k: v for k, v in self._rows.items() if k[0] != engine_id}
        self._pairs = {k: v for k, v in self._pairs.items() if engine_id not in (k[0], k[2])}
        self._pairings = {k: v for k, v in self._pairings.items() if engine_id not in (k[0], k[2])}

    def known_pairing(
        self, local: EngineInfo, remote: EngineInfo, layers: Sequence[str] | None = None
    ) -> Pairing | None:
        """The `pairing` of these engine incarnations and layers if planning has derived it
        already, else None."""
        self._admit(local)
        self._admit(remote)
        pairing = self._pairings.get(_pair_key(local, remote, layers))
        if pairing is not None:
            self.hits += 2  # both sides' rows, served from the cache
        return pairing

    def pairing(self, local: EngineInfo, remote: EngineInfo, layers: Sequence[str] | None = None) -> Pairing:
        """`compatible`, both sides' `rows` and their region lengths, once per pair of engine
        incarnations and list of layers."""
        known = self.known_pairing(local, remote, layers)
        if known is not None:
            return known
        names = self.compatible(local, remote, layers)
        # Whether blocks move whole or as slices of heads is fixed by the two incarnations'
        # `layout.tp` (`_admit` holds each incarnation to one EngineInfo), so the pair's key
        # tells the two apart. Slices depend on both sides: they are kept here, never in `rows`.
        heads = shared_heads(local.layout.tp, remote.layout.tp, repr(local.engine_id), repr(remote.engine_id))
        if heads is None:
            local_rows, remote_rows = self.rows(local, names), self.rows(remote, names)
        else:
            local_rows, remote_rows = self.head_rows(local, remote, names)
        local_lengths = tuple(region.length for region in local.regions)
        remote_lengths = tuple(region.length for region in remote.regions)
        pairing = Pairing(
            names,
            local_rows,
            remote_rows,
            local_lengths,
            remote_lengths,
            (
                local.layout.num_blocks,
                remote.layout.num_blocks,
                _row_table(local_rows),
                np.array(local_lengths, dtype=np.int64),
                _row_table(remote_rows),
                np.array(remote_lengths, dtype=np.int64),
            ),
            heads,
        )
        self._pairings[_pair_key(local, remote, layers)] = pairing
        return pairing

    def head_rows(
        self, local: EngineInfo, remote: EngineInfo, layers: tuple[str, ...]
    ) -> tuple[PartRows, PartRows]:
        """Both sides' rows between TP ranks that hold different heads: one per (layer, piece
        of a block holding heads both ranks hold, `kvray.tensor_parallel.head_pieces`), at the
        piece's bytes of each block and the layer's block stride. Not cached on their own: the
        pair's `pairing` keeps them."""
        self.misses += 2
        placed: list[tuple[LayerPlacement, LayerPlacement, HeadPiece]] = []
        layer_starts = [0]
        for layer in layers:
            local_placement = self.placement(local, layer)
            remote_placement = self.placement(remote, layer)
            pieces = head_pieces(
                local.layout.layer(layer).geometry,
                local.layout.tp,
                remote.layout.layer(layer).geometry,
                remote.layout.tp,
            )
            placed += [(local_placement, remote_placement, piece) for piece in pieces]
            layer_starts.append(len(placed))
        nbytes = np.array([piece.nbytes for _, _, piece in placed], dtype=np.int64)

        def part_rows(rows: list[tuple[LayerPlacement, int, int]]) -> PartRows:
            """One side's rows from (placement, part, offset in the part) per piece."""
            return PartRows(
                layers,
                np.array([placement.region for placement, _, _ in rows], dtype=np.int64),
                np.array(
                    [
                        placement.offset + part * placement.part_stride + offset
                        for placement, part, offset in rows
                    ],
                    dtype=np.int64,
                ),
                np.array([placement.block_stride for placement, _, _ in rows], dtype=np.int64),
                nbytes,
                tuple(layer_starts),
            )

        return (
            part_rows([(mine, piece.local_part, piece.local_offset) for mine, _, piece in placed]),
            part_rows([(theirs, piece.remote_part, piece.remote_offset) for _, theirs, piece in placed]),
        )

    def __len__(self) -> int:
        return len(self._layers)

    def _admit(self, info: EngineInfo) -> None:
        """Validate an engine incarnation once; a new incarnation evicts the old one's entries."""
        known = self._engines.get(info.engine_id)
        if known is not None and known[0] == info.incarnation:
            if known[1] is not info and known[1] != info:
                raise MetadataError(
                    f"engine {info.engine_id!r} incarnation {info.incarnation} was published twice "
                    "with different contents; an engine must take a new incarnation when its memory "
                    "changes",
                    engine_id=info.engine_id,
                    incarnation=info.incarnation,
                )
            return
        validate_engine_info(info)
        if known is not None:
            self.forget(info.engine_id)
        self._engines[info.engine_id] = (info.incarnation, info)


def _pair_key(
    local: EngineInfo, remote: EngineInfo, layers: Sequence[str] | None
) -> tuple[str, int, str, int, tuple[str, ...] | None]:
    """The key of a pair of engine incarnations and list of layers (None: every layer)."""
    return (
        local.engine_id,
        local.incarnation,
        remote.engine_id,
        remote.incarnation,
        None if layers is None else tuple(layers),
    )


# ---- planning ------------------------------------------------------------------------------


def check_compatible(
    local: EngineInfo, remote: EngineInfo, layers: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The layers to move, after checking both sides have each with the same geometry; or,
    between TP ranks that hold different heads (`layout.tp`), geometries that differ only in
    how many heads they hold (`kvray.tensor_parallel.check_head_geometries`), and heads that
    both ranks hold."""
    names = tuple(local.layout.layer_names if layers is None else layers)
    if not names:
        raise PlanError("a transfer needs at least one layer")
    if len(set(names)) != len(names):
        raise PlanError(f"layers repeat in the request: {names}", layers=names)
    sliced = (
        shared_heads(local.layout.tp, remote.layout.tp, repr(local.engine_id), repr(remote.engine_id))
        is not None
    )
    for name in names:
        local_geometry = local.layout.layer(name).geometry
        try:
            remote_geometry = remote.layout.layer(name).geometry
        except UnknownLayerError:
            raise UnknownLayerError(
                f"engine {remote.engine_id!r} has no layer {name!r}; both sides of a transfer need "
                "the same layer names",
                engine_id=remote.engine_id,
                layer=name,
            ) from None
        if sliced:
            check_head_geometries(
                name, local_geometry, remote_geometry, repr(local.engine_id), repr(remote.engine_id)
            )
        elif local_geometry != remote_geometry:
            raise GeometryMismatchError(
                f"layer {name!r} has geometry {local_geometry} on {local.engine_id!r} but "
                f"{remote_geometry} on {remote.engine_id!r}",
                layer=name,
                local=str(local_geometry),
                remote=str(remote_geometry),
            )
    return names


def block_ids(
    blocks: Sequence[int] | npt.NDArray[np.integer], num_blocks: int, side: str, engine: str
) -> Int64Array:
    """Validated block ids of one side: 1-D, non-empty, in [0, num_blocks), no duplicates."""
    if type(blocks) in (tuple, list) and 0 < len(blocks) <= _SHORT_REQUEST:
        # A short request's ids checked in Python: each numpy call costs more than the whole
        # check here, above all on a cold cache (a hand-off's first touch of this code).
        plain = cast(Sequence[int], blocks)
        if (
            all(type(block) is int for block in plain)
            and min(plain) >= 0
            and max(plain) < num_blocks
            and len(set(plain)) == len(plain)
        ):
            return np.array(plain, dtype=np.int64)
    elif (
        _native is not None
        and type(blocks) is np.ndarray
        and blocks.dtype == np.int64
        and blocks.ndim == 1
        and blocks.flags.c_contiguous
    ):
        # An engine's own int64 ids (a hold's, say) checked in one C pass, without a copy.
        if _native.check_id_array(blocks, num_blocks):
            return cast(Int64Array, blocks)
    elif _native is not None and type(blocks) in (tuple, list):
        # A long request's ids checked in one C pass (no pool-sized count, no sort); anything
        # it does not take is the numpy twin's below, which says what is wrong.
        checked = np.empty(len(blocks), dtype=np.int64)
        if _native.check_ids(blocks, checked, num_blocks):
            return checked
    try:
        ids = np.asarray(blocks)
    except (ValueError, TypeError) as error:
        raise BlockIdError(f"{side} block ids are not a flat list of integers: {error}", side=side) from None
    if ids.ndim != 1 or ids.size == 0:
        raise BlockIdError(f"{side} block ids must be a non-empty 1-D list", side=side, engine_id=engine)
    if ids.dtype.kind not in "iu":
        raise BlockIdError(f"{side} block ids must be integers, got {ids.dtype}", side=side, engine_id=engine)
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) >= 2**63:
        raise BlockIdError(f"{side} block id {int(ids.max())} is out of range", side=side, engine_id=engine)
    ids = ids.astype(np.int64, copy=False)
    out_of_range = ids[(ids < 0) | (ids >= num_blocks)]
    if out_of_range.size:
        raise BlockIdError(
            f"{side} block id {int(out_of_range[0])} is outside engine {engine!r}'s pool of "
            f"{num_blocks} blocks",
            side=side,
            engine_id=engine,
            block=int(out_of_range[0]),
            num_blocks=num_blocks,
        )
    repeated = _first_repeat(ids, num_blocks)
    if repeated is not None:
        raise BlockIdError(
            f"{side} block id {repeated} appears more than once", side=side, engine_id=engine, block=repeated
        )
    return ids


#: Requests of at most this many blocks have their ids checked in Python (`block_ids`).
_SHORT_REQUEST = 128
#: Above this many pool slots per id, sorting the ids finds a repeat sooner than counting over
#: the pool (whose count array grows with the engine, not with the request).
_COUNT_SLOTS_PER_ID = 16


def _first_repeat(ids: Int64Array, num_blocks: int) -> int | None:
    """The smallest id that `ids` (each in [0, num_blocks)) holds more than once, or None."""
    if num_blocks <= _COUNT_SLOTS_PER_ID * ids.size:
        counts = np.bincount(ids, minlength=num_blocks)
        return int(np.flatnonzero(counts > 1)[0]) if counts.max() > 1 else None
    ordered = np.sort(ids)
    repeats = ordered[1:][ordered[1:] == ordered[:-1]]
    return int(repeats[0]) if repeats.size else None


def plan_transfer(
    local: EngineInfo,
    remote: EngineInfo,
    local_blocks: Sequence[int] | npt.NDArray[np.integer],
    remote_blocks: Sequence[int] | npt.NDArray[np.integer],
    layers: Sequence[str] | None = None,
    cache: OffsetCache | None = None,
) -> TransferPlan:
    """Write ops moving `local_blocks` of `layers` into the remote's `remote_blocks`."""
    cache = cache if cache is not None else OffsetCache()
    # Blocks in ascending local order: each row's ops then come out sorted by local offset
    # (a layer's block stride is positive), which usually spares the merge its sort.
    known = cache.known_pairing(local, remote, layers)
    ids = paired_ids(known, local_blocks, remote_blocks) if known is not None else None
    if known is not None and ids is not None:
        pairing = known
        local_ids, remote_ids = ids[0], ids[1]
    else:
        # A pair's first request, or one the one-call check refused: step by step, the ids
        # before any offset, each check saying what is wrong.
        cache.compatible(local, remote, layers)
        local_ids, remote_ids, remote_span = _paired_ids(local, remote, local_blocks, remote_blocks)
        checked_by_c = known is not None and _native is not None
        pairing = cache.pairing(local, remote, layers)
        check_row_bounds(pairing.local, local_ids, local, "local", (int(local_ids[0]), int(local_ids[-1])))
        check_row_bounds(pairing.remote, remote_ids, remote, "remote", remote_span)
        if checked_by_c:
            raise PlanError(
                f"kvray._plan refused a request that the numpy checks accept: {local_ids}, {remote_ids}"
            )
    # The ops (one per (layer, part) row × block, in that order, then merged) are expanded
    # from these rows when first read; a GPU writer reads the rows alone.
    return TransferPlan(
        src_engine=local.engine_id,
        src_incarnation=local.incarnation,
        dst_engine=remote.engine_id,
        dst_incarnation=remote.incarnation,
        layers=pairing.layers,
        rows=RequestRows(
            pairing.local,
            pairing.remote,
            local_ids,
            remote_ids,
            checked=(
                pairing.local_lengths,
                pairing.remote_lengths,
                ids.tobytes() if ids is not None else local_ids.tobytes() + remote_ids.tobytes(),
            ),
        ),
    )


def paired_ids(
    pairing: Pairing,
    local_blocks: Sequence[int] | npt.NDArray[np.integer],
    remote_blocks: Sequence[int] | npt.NDArray[np.integer],
) -> Int64Array | None:
    """Both sides' ids, paired in ascending local order (2 x n), after every check planning
    makes (ids in their pools without repeats, every row inside its regions at both ends), in
    one C call: one request's planning is a few dozen numpy calls otherwise. Ids already in
    1-D int64 arrays go in as they are. None when the C loops are not built or a check fails:
    the numpy twin then plans, or says what is wrong."""
    if _native is None:
        return None
    if type(local_blocks) is np.ndarray and type(remote_blocks) is np.ndarray:
        try:
            ids = np.empty((2, len(local_blocks)), dtype=np.int64)
            return ids if _native.plan_ids(local_blocks, remote_blocks, ids, *pairing.native_args) else None
        except (TypeError, ValueError, BufferError):  # not int64 buffers of one length
            pass
    local_ids, remote_ids = _id_array(local_blocks), _id_array(remote_blocks)
    if local_ids is None or remote_ids is None or local_ids.size != remote_ids.size:
        return None
    ids = np.empty((2, local_ids.size), dtype=np.int64)
    return ids if _native.plan_ids(local_ids, remote_ids, ids, *pairing.native_args) else None


def _row_table(rows: PartRows) -> Int64Array:
    return np.ascontiguousarray(np.stack([rows.region, rows.base, rows.block_stride, rows.nbytes]))


def _id_array(blocks: Sequence[int] | npt.NDArray[np.integer]) -> Int64Array | None:
    """A request's block ids as contiguous int64 if they look like ids at all (the C check takes
    it from there), else None: `block_ids` then says what is wrong."""
    try:
        ids = np.asarray(blocks)
    except (ValueError, TypeError):
        return None
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        return None
    # A uint64 id past int64 wraps negative here, and the range check refuses it.
    return np.ascontiguousarray(ids.astype(np.int64, copy=False))


def _paired_ids(
    local: EngineInfo,
    remote: EngineInfo,
    local_blocks: Sequence[int] | npt.NDArray[np.integer],
    remote_blocks: Sequence[int] | npt.NDArray[np.integer],
) -> tuple[Int64Array, Int64Array, tuple[int, int]]:
    """Both sides' validated block ids, paired and in ascending local order, and the smallest
    and largest remote id."""
    if _native is not None:
        local_ids, remote_ids = _id_array(local_blocks), _id_array(remote_blocks)
        if local_ids is not None and remote_ids is not None and local_ids.size == remote_ids.size:
            sorted_local, paired_remote = np.empty_like(local_ids), np.empty_like(remote_ids)
            remote_span = _native.sort_blocks(
                local_ids,
                remote_ids,
                local.layout.num_blocks,
                remote.layout.num_blocks,
                sorted_local,
                paired_remote,
            )
            if remote_span is not None:
                return sorted_local, paired_remote, remote_span
    # The numpy twin; it also raises the error that says what is wrong with the ids.
    local_ids = block_ids(local_blocks, local.layout.num_blocks, "local", local.engine_id)
    remote_ids = block_ids(remote_blocks, remote.layout.num_blocks, "remote", remote.engine_id)
    if local_ids.size != remote_ids.size:
        raise BlockIdError(
            f"{local_ids.size} local blocks cannot map onto {remote_ids.size} remote blocks",
            local_count=int(local_ids.size),
            remote_count=int(remote_ids.size),
        )
    if _native is not None:
        raise PlanError(
            f"kvray._plan refused block ids that the numpy check accepts: {local_ids}, {remote_ids}"
        )
    order = np.argsort(local_ids, kind="stable")  # timsort: quickest on the sorted runs ids mostly come in
    remote_ids = remote_ids[order]
    return local_ids[order], remote_ids, (int(remote_ids.min()), int(remote_ids.max()))


def _expand(
    local_rows: PartRows, remote_rows: PartRows, local_ids: Int64Array, remote_ids: Int64Array
) -> tuple[OpTable, bool | None]:
    """One op per (row, block), rows outer; and whether they are sorted by local (region,
    offset), when that came for free (None: not known)."""
    count = local_ids.size
    if _native is not None:
        unmerged = OpTable(*(np.empty(local_rows.base.size * count, dtype=np.int64) for _ in range(5)))
        in_order = _native.expand_ops(
            local_rows.region,
            local_rows.base,
            local_rows.block_stride,
            remote_rows.region,
            remote_rows.base,
            remote_rows.block_stride,
            local_rows.nbytes,
            local_ids,
            remote_ids,
            unmerged.local_region,
            unmerged.local_offset,
            unmerged.remote_region,
            unmerged.remote_offset,
            unmerged.nbytes,
        )
        return unmerged, bool(in_order)
    local_offset = (local_rows.base[:, None] + local_ids[None, :] * local_rows.block_stride[:, None]).ravel()
    remote_offset = (
        remote_rows.base[:, None] + remote_ids[None, :] * remote_rows.block_stride[:, None]
    ).ravel()
    unmerged = OpTable(
        np.repeat(local_rows.region, count),
        local_offset,
        np.repeat(remote_rows.region, count),
        remote_offset,
        np.repeat(local_rows.nbytes, count),
    )
    return unmerged, None


def check_row_bounds(
    rows: PartRows, ids: Int64Array, info: EngineInfo, side: str, span: tuple[int, int] | None = None
) -> None:
    """Invariant 2 for every op of one side at once: an op's offset is `base + id * stride`,
    linear in the block id, so the ops of a row lie between the offsets of its smallest and its
    largest block id (`span`, when the caller knows them). Checking those two ends of every row
    covers each op exactly; where one fails, the full per-op check names it."""
    check_rows(rows, ids, [r.length for r in info.regions], side=side, engine_id=info.engine_id, span=span)


def check_rows(
    rows: PartRows,
    ids: Int64Array,
    lengths: Sequence[int],
    *,
    side: str,
    engine_id: str,
    span: tuple[int, int] | None = None,
) -> None:
    """`check_row_bounds` against given region lengths (a writer's own view of them)."""
    if ids.size == 0:
        raise BlockIdError(f"{side} block ids must be a non-empty 1-D list", side=side, engine_id=engine_id)
    low, high = span if span is not None else (int(ids.min()), int(ids.max()))
    # Offsets are computed in int64 below: ids that could wrap them are refused first.
    # In Python ints: numpy's abs of int64's smallest value is that value again.
    strides = rows.block_stride
    largest_stride = max(int(strides.max()), -int(strides.min())) if strides.size else 0
    if low < 0 or high * largest_stride >= 2**62:
        raise BlockIdError(
            f"{side} block ids span [{low}, {high}], outside any region of engine {engine_id!r}",
            side=side,
            engine_id=engine_id,
        )
    outside = None
    if _native is not None:
        try:
            lengths_array = np.asarray(lengths, dtype=np.int64)
            outside = _native.rows_outside(
                rows.region, rows.base, rows.block_stride, rows.nbytes, low, high, lengths_array
            )
        except (TypeError, ValueError, OverflowError):  # not int64 arrays of one length: numpy decides
            outside = None
        if outside is not None and outside < 0:
            return
    first = rows.base + low * rows.block_stride
    last = rows.base + high * rows.block_stride
    regions = np.concatenate([rows.region, rows.region])
    nbytes = np.concatenate([rows.nbytes, rows.nbytes])
    try:
        check_ops(regions, np.concatenate([first, last]), nbytes, lengths, side=side, engine_id=engine_id)
    except BoundsError:
        count = ids.size
        offsets = (rows.base[:, None] + ids[None, :] * rows.block_stride[:, None]).ravel()
        check_ops(
            np.repeat(rows.region, count),
            offsets,
            np.repeat(rows.nbytes, count),
            lengths,
            side=side,
            engine_id=engine_id,
        )
        raise
    if outside is not None:
        # The C check saw an offset numpy's int64 arithmetic wraps into range: still outside.
        raise BoundsError(
            f"{side} row {outside} of engine {engine_id!r} reaches past int64 at block ids [{low}, {high}]",
            side=side,
            engine_id=engine_id,
            op=outside,
        )


def _sort_order(region: Int64Array, offset: Int64Array, known_sorted: bool | None) -> Int64Array | None:
    """The order that sorts ops by (region, offset), or None when they already are. One int64
    key `region * span + offset` makes that a single argsort, cheaper than lexsort, where it
    cannot wrap; offsets up to 2**62 in several regions can, and then lexsort decides."""
    if known_sorted or region.size < 2:
        return None
    largest_region = int(region.max())
    span = int(offset.max()) + 1
    if int(region.min()) < 0 or int(offset.min()) < 0 or largest_region * span + span > 2**63 - 1:
        order: Int64Array = np.lexsort((offset, region))
        if known_sorted is None and bool((order[1:] > order[:-1]).all()):
            return None
        return order
    key = offset if largest_region == 0 else region * span + offset
    if known_sorted is None and bool((key[1:] >= key[:-1]).all()):
        return None
    return np.argsort(key, kind="stable")


def merge_ops(ops: OpTable, in_order: bool | None = None) -> OpTable:
    """Sort by local (region, offset) and merge each op into the previous one where both its
    source and destination continue the previous op's bytes. `in_order`: whether the ops are
    already sorted, when the caller knows (None: look)."""
    if len(ops) == 0:
        return ops
    order = _sort_order(ops.local_region, ops.local_offset, in_order)
    if _native is not None:
        columns = (ops.local_region, ops.local_offset, ops.remote_region, ops.remote_offset, ops.nbytes)
        merged = [np.empty(len(ops), dtype=np.int64) for _ in range(5)]
        try:
            count = _native.merge_ops(
                *(np.ascontiguousarray(c, dtype=np.int64) for c in columns), order, *merged
            )
        except (TypeError, ValueError):  # not int64 columns: the numpy twin copes
            pass
        else:
            return OpTable(*(column[:count] for column in merged))
    return _merge_numpy(ops, order)


def _merge_numpy(ops: OpTable, order: Int64Array | None) -> OpTable:
    if order is None:
        local_region, local_offset = ops.local_region, ops.local_offset
        remote_region, remote_offset, nbytes = ops.remote_region, ops.remote_offset, ops.nbytes
    else:
        local_region = ops.local_region[order]
        local_offset = ops.local_offset[order]
        remote_region = ops.remote_region[order]
        remote_offset = ops.remote_offset[order]
        nbytes = ops.nbytes[order]
    continues = (
        (local_region[1:] == local_region[:-1])
        & (remote_region[1:] == remote_region[:-1])
        & (local_offset[1:] == local_offset[:-1] + nbytes[:-1])
        & (remote_offset[1:] == remote_offset[:-1] + nbytes[:-1])
    )
    run_starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return OpTable(
        local_region[run_starts],
        local_offset[run_starts],
        remote_region[run_starts],
        remote_offset[run_starts],
        np.add.reduceat(nbytes, run_starts),
    )


def split_ops(
    dst_offsets: Int64Array, src_offsets: Int64Array, nbytes: Int64Array, piece_nbytes: int
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The same copies, in order, with every op longer than `piece_nbytes` cut into pieces of at
    most `piece_nbytes` (so that the threads or kernel programs sharing a batch get even work)."""
    pieces = ceil_div(nbytes, piece_nbytes)
    op = np.repeat(np.arange(nbytes.size, dtype=np.int64), pieces)
    first_piece = np.concatenate(([0], np.cumsum(pieces)[:-1])).astype(np.int64)
    delta = (np.arange(op.size, dtype=np.int64) - first_piece[op]) * piece_nbytes
    return (
        dst_offsets[op] + delta,
        src_offsets[op] + delta,
        np.minimum(nbytes[op] - delta, piece_nbytes),
    )


def check_ops(
    region: Int64Array,
    offset: Int64Array,
    nbytes: Int64Array,
    region_lengths: Sequence[int],
    *,
    side: str,
    engine_id: str,
) -> None:
    """Invariant 2 for one side: every op names an existing region, has a positive size, and
    lies inside that region. Written so that no sum can overflow int64: the end of an op is
    never computed, only compared as `offset <= length - nbytes` with `nbytes <= length`."""
    lengths = np.asarray(region_lengths, dtype=np.int64)
    if _native is not None:
        try:
            if _native.first_outside(region, offset, nbytes, lengths) < 0:
                return
        except (TypeError, ValueError):  # not int64 arrays of one length: the numpy twin decides
            pass
    bad_region = (region < 0) | (region >= lengths.size)
    if bad_region.any():
        at = int(np.flatnonzero(bad_region)[0])
        raise BoundsError(
            f"{side} op {at} names region {int(region[at])} of engine {engine_id!r}, "
            f"which has {lengths.size}",
            side=side,
            engine_id=engine_id,
            op=at,
        )
    length = lengths[region]
    outside = (nbytes <= 0) | (nbytes > length) | (offset < 0) | (offset > length - nbytes)
    if outside.any():
        at = int(np.flatnonzero(outside)[0])
        raise BoundsError(
            f"{side} op {at} ({int(nbytes[at])} bytes at offset {int(offset[at])}) leaves region "
            f"{int(region[at])} of engine {engine_id!r} ({int(length[at])} bytes)",
            side=side,
            engine_id=engine_id,
            op=at,
            offset=int(offset[at]),
            nbytes=int(nbytes[at]),
            region_length=int(length[at]),
        )


def check_op_table(
    ops: OpTable,
    local_lengths: Sequence[int],
    remote_lengths: Sequence[int],
    *,
    local_engine: str,
    remote_engine: str,
) -> None:
    """Invariant 2 for both sides of an op table, given each side's region lengths."""
    check_ops(
        ops.local_region, ops.local_offset, ops.nbytes, local_lengths, side="local", engine_id=local_engine
    )
    check_ops(
        ops.remote_region,
        ops.remote_offset,
        ops.nbytes,
        remote_lengths,
        side="remote",
        engine_id=remote_engine,
    )


def check_bounds(ops: OpTable, local: EngineInfo, remote: EngineInfo) -> None:
    """Invariant 2: every op lies inside its local and its remote region, or nothing is planned."""
    check_op_table(
        ops,
        [r.length for r in local.regions],
        [r.length for r in remote.regions],
        local_engine=local.engine_id,
        remote_engine=remote.engine_id,
    )


# ---- what a request may touch ---------------------------------------------------------------


def request_spans(rows: PartRows, blocks: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The bytes a request's blocks occupy across `rows` (every layer and part of an engine),
    as (region, start, end) spans sorted by region and start, merged where they touch or overlap:
    the only bytes a write for the request may change."""
    count = blocks.size
    starts = (rows.base[:, None] + rows.block_stride[:, None] * blocks[None, :]).ravel()
    ends = starts + np.repeat(rows.nbytes, count)
    regions = np.repeat(rows.region, count)
    merged_region: list[Int64Array] = []
    merged_start: list[Int64Array] = []
    merged_end: list[Int64Array] = []
    for region in np.unique(regions).tolist():
        select = regions == region
        order = np.argsort(starts[select], kind="stable")
        region_starts = starts[select][order]
        region_ends = ends[select][order]
        # A span opens wherever it starts past every earlier span's end.
        reach = np.maximum.accumulate(region_ends)
        opens = np.ones(region_starts.size, dtype=bool)
        opens[1:] = region_starts[1:] > reach[:-1]
        first = np.flatnonzero(opens)
        last = np.append(first[1:], region_starts.size) - 1
        merged_region.append(np.full(first.size, region, dtype=np.int64))
        merged_start.append(region_starts[first])
        merged_end.append(reach[last])
    return (
        np.concatenate(merged_region),
        np.concatenate(merged_start),
        np.concatenate(merged_end),
    )


def check_ops_within(
    spans: tuple[Int64Array, Int64Array, Int64Array],
    regions: Int64Array,
    offsets: Int64Array,
    nbytes: Int64Array,
    *,
    request_id: str,
    engine_id: str,
) -> None:
    """Every op [offset, offset + nbytes) of region `regions[i]` lies inside one span of
    `request_spans`, else `BoundsError` naming the first op that does not. Offsets and sizes
    were checked against their regions first (below 2**62 each), so their sum cannot overflow."""
    span_region, span_start, span_end = spans
    inside = np.zeros(regions.size, dtype=bool)
    for region in np.unique(regions).tolist():
        select = regions == region
        mine = span_region == region
        starts, ends = span_start[mine], span_end[mine]
        where = np.searchsorted(starts, offsets[select], side="right") - 1
        found = where >= 0
        clipped = np.where(found, where, 0)
        inside[select] = found & (offsets[select] + nbytes[select] <= ends[clipped]) if starts.size else False
    outside = np.flatnonzero(~inside)
    if outside.size:
        at = int(outside[0])
        raise BoundsError(
            f"a write for request {request_id!r} reaches bytes [{int(offsets[at])}, "
            f"{int(offsets[at]) + int(nbytes[at])}) of region {int(regions[at])} of engine {engine_id!r}, "
            "outside the blocks reserved for it; nothing was written",
            request_id=request_id,
            engine_id=engine_id,
            region=int(regions[at]),
            offset=int(offsets[at]),
            nbytes=int(nbytes[at]),
        )
