"""Placement digests: which destination bytes a transfer's executor stored to, as one number.

Every executor (the C copy pool, the ray receiver's scatter, the loopback copy, the cuda_ipc
and verbs writers' op tables) adds up, for each range it stored to, a value of the range's
region and ends. The decode side computes the same sum over the ranges its own layout and
reservation say the transfer must fill (`kvray.integrity.landed_pieces`), without the writer's
plan, and takes the request only when the two agree: a layer written over another (the seed
bug), a block written twice or never, or an executor that stored to other addresses than its
plan named all change the sum. It costs O(ops), never a read of the bytes.

A range [start, start + nbytes) of region r is worth F(r, start + nbytes) - F(r, start)
(mod 2**64), F a 64-bit mixing function of the region and the address: the values of ranges
laid end to end telescope, so however an executor splits or merges its ops (pieces for its
threads, runs of adjacent blocks) the sum is the sum over the bytes it covered, each counted
as often as it was stored to.
"""

from __future__ import annotations

from types import ModuleType
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from kvray.layout import Int64Array

_native: ModuleType | None
try:
    from kvray import _plan as _native
except ImportError:  # built by `pip install`; a source checkout without a build uses numpy alone
    _native = None

MASK64: Final = (1 << 64) - 1
#: Region r's addresses are mixed with (r + 1) << 48: regions are shorter than 2**48 bytes.
REGION_SHIFT: Final = 48
#: What a notice carries before its executor has filled it in: the C copy pool's thread writes
#: the sums into the notice's last bytes (msgpack's uint64 form, which this value forces): the
#: placement in the final 8, the content digest (`TransferDone.content`) just before its name.
PLACEHOLDER: Final = MASK64
PLACEHOLDER_BYTES: Final = b"\xcf" + b"\xff" * 8

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def region_salt(region: int) -> int:
    """What region `region`'s addresses are mixed with (the C executor takes it as is)."""
    return (region + 1) << REGION_SHIFT


def mix_array(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer, elementwise (uint64 arithmetic wraps mod 2**64)."""
    z = values
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def ranges_digest(region: Int64Array, start: Int64Array, nbytes: Int64Array) -> int:
    """The placement digest of the ranges [start, start + nbytes) of `region` (arrays of one
    length): what an executor that stored to exactly these ranges reports."""
    if _native is not None:
        return int(
            _native.placement_digest(_int64(region), _int64(start), _int64(nbytes), None, None, REGION_SHIFT)
        )
    return ranges_digest_numpy(region, start, nbytes)


def runs_digest(
    region: Int64Array, start: Int64Array, nbytes: Int64Array, stride: Int64Array, blocks: Int64Array
) -> int:
    """The placement digest of runs (region, start, nbytes, stride: one entry a run) repeated at
    each block id b of `blocks`, the ranges [start + b * stride, + nbytes): where a layout puts
    a request's bytes, without building the ranges."""
    if _native is not None:
        return int(
            _native.placement_digest(
                _int64(region), _int64(start), _int64(nbytes), _int64(stride), _int64(blocks), REGION_SHIFT
            )
        )
    count = blocks.size
    starts = start[None, :] + blocks[:, None] * stride[None, :]
    return ranges_digest_numpy(np.tile(region, count), starts.ravel(), np.tile(nbytes, count))


def _int64(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return np.ascontiguousarray(values, dtype=np.int64)


def ranges_digest_numpy(region: Int64Array, start: Int64Array, nbytes: Int64Array) -> int:
    """`ranges_digest` in numpy: the C twin's reference, and the digest where it is not built."""
    if start.size == 0:
        return 0
    salt = (region.astype(np.uint64) + np.uint64(1)) << np.uint64(REGION_SHIFT)
    begin = start.astype(np.uint64)
    end = begin + nbytes.astype(np.uint64)
    with np.errstate(over="ignore"):
        worth = mix_array(salt ^ end) - mix_array(salt ^ begin)
    return int(worth.sum(dtype=np.uint64))


class Stored(NamedTuple):
    """What an executor reports of a write: the placement digest of the ranges it stored to
    and, where it hashed the bytes as it copied them, their content digest (`kvray.content`;
    None where it did not)."""

    placement: int
    content: int | None = None

    def plus(self, other: Stored) -> Stored:
        """Both writes' digests together (a content digest only if both have one)."""
        content = (
            None if self.content is None or other.content is None else (self.content + other.content) & MASK64
        )
        return Stored((self.placement + other.placement) & MASK64, content)


#: A write with nothing stored yet (the start of a sum).
NOTHING: Final = Stored(0, 0)


#: How a notice's content digest placeholder ends: then the placement's field name and value.
CONTENT_TAIL: Final = PLACEHOLDER_BYTES + b"\xa9placement" + PLACEHOLDER_BYTES


def filled(message: bytes, stored: Stored) -> bytes:
    """An encoded notice with its placeholders (`PLACEHOLDER`) replaced by `stored`'s values, as
    the C copy pool's thread fills them: the placement in the last 8 bytes, the content digest
    in the 8 before the placement's name, where the notice has placeholders there."""
    if not message.endswith(PLACEHOLDER_BYTES):
        return message
    if stored.content is not None and message.endswith(CONTENT_TAIL):
        content = stored.content.to_bytes(8, "big")
        message = message[:-27] + content + message[-19:]
    return message[:-8] + stored.placement.to_bytes(8, "big")
