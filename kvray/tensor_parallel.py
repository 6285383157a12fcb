"""Tensor parallelism: which KV heads move between two engines that are TP ranks of one model
(the arithmetic `kvray.plan` slices blocks with, step 5 of the data flow). Pure code: no Ray, no
devices.

Each side splits the model's KV heads evenly over its ranks (`KVLayout.tp`), and the two sides'
TP sizes may differ: a decode rank then reads its heads from one or several prefill ranks, each
of which writes only the heads both hold, into the decode rank's blocks.

- `source_ranks` / `reader_ranks`: which prefill ranks a decode rank reads from, and back.
- `shared_heads`: whether two ranks exchange whole blocks, or which heads (model-wide) they share.
- `check_head_geometries`: two ranks' layers order a block alike but for the number of heads.
- `head_runs`: where some of a rank's heads sit in one block of a layer, read from its
  `Geometry.block_layout`; `pair_runs`: which bytes of one side's runs go to which of the other's.
- `head_pieces`: both, for one layer of a pair of ranks: what `kvray.plan` makes its rows of.

A cache TP replicates (`kv_heads` 0: an MLA latent) is moved as whole blocks from one prefill
rank: `source_ranks` names which.

Errors: `LayoutError` for a TP configuration or block layout that cannot be (a size that does
not divide the heads, a layout whose axes do not add up to its geometry); `GeometryMismatchError`
for two sides that cannot exchange their KV (different models' heads, blocks ordered unalike);
`PlanError` for two ranks that share no head.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from kvray.errors import GeometryMismatchError, LayoutError, PlanError
from kvray.layout import HEAD_AXIS, BlockAxis, Geometry, TensorParallel, block_axes


class HeadRun(NamedTuple):
    """Bytes [offset, offset + nbytes) of part `part` of a block."""

    part: int
    offset: int
    nbytes: int


class HeadPiece(NamedTuple):
    """`nbytes` from (`local_part`, `local_offset`) of a local block to (`remote_part`,
    `remote_offset`) of the paired remote block."""

    local_part: int
    local_offset: int
    remote_part: int
    remote_offset: int
    nbytes: int


# ---- ranks ----------------------------------------------------------------------------------


def describe(tp: TensorParallel) -> str:
    """A TP configuration in words, as errors name it: "TP 2 with 4 KV heads"."""
    if tp.sharded:
        return f"TP {tp.size} with {tp.kv_heads} KV heads"
    return f"TP {tp.size} with a replicated cache (0 KV heads)"


def check_same_model(
    src: TensorParallel, dst: TensorParallel, src_name: str = "prefill", dst_name: str = "decode"
) -> None:
    """Both sides split the same number of KV heads (or both replicate the cache), else
    `GeometryMismatchError` naming both configurations."""
    if src.kv_heads != dst.kv_heads:
        raise GeometryMismatchError(
            f"{src_name} {describe(src)}, {dst_name} {describe(dst)}: both sides must hold one "
            "model's KV heads (the same total, or 0 on both for a replicated cache)",
            src_tp_size=src.size,
            src_kv_heads=src.kv_heads,
            dst_tp_size=dst.size,
            dst_kv_heads=dst.kv_heads,
        )


def _spanned(first_head: int, count: int, heads_per_rank: int) -> tuple[int, ...]:
    """The ranks of `heads_per_rank` heads each that hold any of heads [first_head, +count)."""
    first_rank = first_head // heads_per_rank
    last_rank = (first_head + count - 1) // heads_per_rank
    return tuple(range(first_rank, last_rank + 1))


def source_ranks(dst: TensorParallel, src_size: int, src_kv_heads: int) -> tuple[int, ...]:
    """The source (prefill) ranks, of `src_size`, that destination rank `dst` reads from: those
    holding any of its heads; for a replicated cache exactly one, `dst.rank % src_size`."""
    src = TensorParallel(size=src_size, kv_heads=src_kv_heads)
    check_same_model(src, dst)
    if not dst.sharded:
        return (dst.rank % src.size,)
    return _spanned(dst.first_head, dst.local_heads, src.local_heads)


def reader_ranks(src: TensorParallel, dst_size: int, dst_kv_heads: int) -> tuple[int, ...]:
    """The destination (decode) ranks, of `dst_size`, that read from source rank `src`: the
    inverse of `source_ranks`. Empty where no rank reads from it (a replicated cache from more
    source ranks than there are destination ranks)."""
    dst = TensorParallel(size=dst_size, kv_heads=dst_kv_heads)
    check_same_model(src, dst)
    if not src.sharded:
        return tuple(rank for rank in range(dst.size) if rank % src.size == src.rank)
    return _spanned(src.first_head, src.local_heads, dst.local_heads)


def shared_heads(
    src: TensorParallel, dst: TensorParallel, src_name: str = "prefill", dst_name: str = "decode"
) -> tuple[int, int] | None:
    """None when the two ranks exchange whole blocks (both TP 1, a replicated cache, or the
    same heads), else the model-wide (first head, count) both hold. `PlanError` naming which
    ranks hold which heads when they share none."""
    if src.size == 1 and dst.size == 1:
        return None
    check_same_model(src, dst, src_name, dst_name)
    if not src.sharded or (src.size, src.rank) == (dst.size, dst.rank):
        return None
    first = max(src.first_head, dst.first_head)
    end = min(src.first_head + src.local_heads, dst.first_head + dst.local_heads)
    if end <= first:
        raise PlanError(
            f"{src_name} (TP rank {src.rank} of {src.size}) holds KV heads [{src.first_head}, "
            f"{src.first_head + src.local_heads}) and {dst_name} (TP rank {dst.rank} of {dst.size}) "
            f"holds [{dst.first_head}, {dst.first_head + dst.local_heads}): they share no head, so "
            f"nothing of one belongs in the other (source_ranks says which ranks pair)",
            src_tp_rank=src.rank,
            dst_tp_rank=dst.rank,
        )
    return first, end - first


# ---- bytes of heads in a block ----------------------------------------------------------------


class _HeadAxes(NamedTuple):
    axes: tuple[BlockAxis, ...]
    #: Index of the head axis in `axes`.
    head: int
    #: How many of the outermost axes number the block's parts.
    part_axes: int


def _head_axes(geometry: Geometry) -> _HeadAxes:
    """A geometry's block axes with its head axis and parts axes found, after checking that the
    axes add up to its parts, entries and tokens."""
    layout = geometry.block_layout
    axes = block_axes(layout)
    heads = [index for index, axis in enumerate(axes) if axis.label == HEAD_AXIS]
    if len(heads) != 1:
        raise LayoutError(
            f"block layout {layout!r} has {len(heads)} KV-head axes {HEAD_AXIS!r}: a block is split "
            "between TP ranks along exactly one",
            block_layout=layout,
        )
    block_elements = geometry.parts * geometry.block_size * math.prod(geometry.entry_shape)
    if math.prod(axis.size for axis in axes) != block_elements:
        raise LayoutError(
            f"block layout {layout!r} has {math.prod(axis.size for axis in axes)} elements, but its "
            f"geometry's block has {block_elements} ({geometry.parts} parts x {geometry.block_size} "
            f"tokens x {geometry.entry_shape})",
            block_layout=layout,
        )
    # The parts are the outermost axes: the fewest whose sizes multiply to `parts`.
    part_axes, outer_elements = 0, 1
    while outer_elements < geometry.parts:
        outer_elements *= axes[part_axes].size
        part_axes += 1
    if outer_elements != geometry.parts:
        raise LayoutError(
            f"block layout {layout!r}: no outermost axes multiply to the geometry's {geometry.parts} parts",
            block_layout=layout,
        )
    return _HeadAxes(axes, heads[0], part_axes)


def head_runs(geometry: Geometry, first: int, count: int) -> list[HeadRun]:
    """The byte runs of one block of a layer that hold its heads [first, first + count) (indices
    among the heads this engine holds), in element order: the axes outside the heads, then the
    heads, then the axes inside them. Runs that touch within a part are one run. `LayoutError`
    for a geometry without a head axis or whose block layout does not add up to it."""
    found = _head_axes(geometry)
    axes, head = found.axes, found.head
    head_count = axes[head].size
    if first < 0 or count < 1 or first + count > head_count:
        raise LayoutError(
            f"heads [{first}, {first + count}) are not among the {head_count} of block layout "
            f"{geometry.block_layout!r}",
            block_layout=geometry.block_layout,
        )
    itemsize = geometry.itemsize
    outside = math.prod(axis.size for axis in axes[:head])
    inside = math.prod(axis.size for axis in axes[head + 1 :])
    part_elements = math.prod(axis.size for axis in axes[found.part_axes :])
    runs: list[HeadRun] = []
    for outer_index in range(outside):
        # The selected heads of one index of the outer axes are one stretch of elements in the
        # block's order; the parts cut it where it crosses from one part into the next.
        start = (outer_index * head_count + first) * inside
        remaining = count * inside
        while remaining:
            part, in_part = divmod(start, part_elements)
            elements = min(remaining, part_elements - in_part)
            offset, nbytes = in_part * itemsize, elements * itemsize
            if runs and runs[-1].part == part and runs[-1].offset + runs[-1].nbytes == offset:
                runs[-1] = HeadRun(part, runs[-1].offset, runs[-1].nbytes + nbytes)
            else:
                runs.append(HeadRun(part, offset, nbytes))
            start += elements
            remaining -= elements
    return runs


def pair_runs(local: Sequence[HeadRun], remote: Sequence[HeadRun]) -> list[HeadPiece]:
    """Both sides' runs walked in order, cut where either side's run ends: each piece's bytes
    are the same elements on both sides (both lists in one element order). The totals must
    match (`GeometryMismatchError` otherwise)."""
    local_total = sum(run.nbytes for run in local)
    remote_total = sum(run.nbytes for run in remote)
    if local_total != remote_total:
        raise GeometryMismatchError(
            f"the local runs hold {local_total} bytes and the remote runs {remote_total}",
            local_nbytes=local_total,
            remote_nbytes=remote_total,
        )
    pieces: list[HeadPiece] = []
    local_index = remote_index = 0
    local_done = remote_done = 0  # bytes of the current run of each side already paired
    while local_index < len(local):
        local_run, remote_run = local[local_index], remote[remote_index]
        nbytes = min(local_run.nbytes - local_done, remote_run.nbytes - remote_done)
        pieces.append(
            HeadPiece(
                local_run.part,
                local_run.offset + local_done,
                remote_run.part,
                remote_run.offset + remote_done,
                nbytes,
            )
        )
        local_done += nbytes
        remote_done += nbytes
        if local_done == local_run.nbytes:
            local_index, local_done = local_index + 1, 0
        if remote_done == remote_run.nbytes:
            remote_index, remote_done = remote_index + 1, 0
    return pieces


def check_head_geometries(
    layer: str, local: Geometry, remote: Geometry, local_name: str = "local", remote_name: str = "remote"
) -> None:
    """Two TP ranks' geometries of one layer can exchange heads: the same dtype and tokens per
    block, a head axis on both, and the same other axes in the same order (labels and sizes).
    Where both hold more than one head the head axis must sit at the same place too; a head
    axis of size 1 may sit anywhere, since it does not change the order of the other elements.
    `GeometryMismatchError` naming the layer and both geometries otherwise."""

    def refuse(reason: str) -> GeometryMismatchError:
        return GeometryMismatchError(
            f"layer {layer!r} cannot move between TP ranks: {reason} ({local_name}: {local}, "
            f"{remote_name}: {remote})",
            layer=layer,
            local=str(local),
            remote=str(remote),
        )

    if (local.dtype, local.block_size) != (remote.dtype, remote.block_size):
        raise refuse("dtype or tokens per block differ")
    try:
        local_axes, remote_axes = _head_axes(local), _head_axes(remote)
    except LayoutError as error:
        raise refuse(str(error)) from None
    local_others = [axis for axis in local_axes.axes if axis.label != HEAD_AXIS]
    remote_others = [axis for axis in remote_axes.axes if axis.label != HEAD_AXIS]
    if local_others != remote_others:
        raise refuse("their blocks order the elements differently")
    local_heads = local_axes.axes[local_axes.head].size
    remote_heads = remote_axes.axes[remote_axes.head].size
    if local_heads > 1 and remote_heads > 1 and local_axes.head != remote_axes.head:
        raise refuse("their blocks keep the heads at different places")


@functools.lru_cache(maxsize=256)
def head_pieces(
    local: Geometry, local_tp: TensorParallel, remote: Geometry, remote_tp: TensorParallel
) -> tuple[HeadPiece, ...]:
    """What one block of a layer moves between two ranks that share some heads (after
    `check_head_geometries`): the pieces of the heads both hold, from the local block to the
    remote one. Cached: a model's layers mostly share a few geometries."""
    shared = shared_heads(local_tp, remote_tp)
    if shared is None:
        raise PlanError("head_pieces is for ranks that hold different heads; these move whole blocks")
    first, count = shared
    return tuple(
        pair_runs(
            head_runs(local, first - local_tp.first_head, count),
            head_runs(remote, first - remote_tp.first_head, count),
        )
    )
