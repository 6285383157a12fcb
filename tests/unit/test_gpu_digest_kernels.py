"""The cuda_ipc kernels' content and placement digests (`kvray.content`, `kvray.placement`),
run by Triton's interpreter on the CPU against the definitions in numpy: the bytes a copy
stores, the canaries around them, and the two digests, for every element width a copy may
use, the row kernel and the op kernel (direct and staged), and a copy only hashing.

Triton interprets kernels only when TRITON_INTERPRET=1 was set before it was imported, so
`test_kernels_interpreted` runs this module's other tests in a child process that sets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_interpreted, in a child")

from kvray.content import destination_factor, hash_bytes, hash_ranges, pair_salt, region_seed  # noqa: E402
from kvray.placement import MASK64, ranges_digest, region_salt  # noqa: E402

SLOTS = 1024
CANARY = 0xA5
DTYPES = {0: torch.uint8, 1: torch.int16, 2: torch.int32}


@pytest.mark.skipif(INTERPRETED, reason="the child's own run")
def test_kernels_interpreted() -> None:
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert "9 passed" in child.stdout, child.stdout[-2000:]


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    from kvray.transport.cuda_ipc import triton_kernels

    return triton_kernels


def _bits(*values: int) -> list[int]:
    return [int(np.uint64(value).view(np.int64)) for value in values]


def _fold(kernels: ModuleType, slots: torch.Tensor) -> tuple[int, int]:
    out = torch.zeros(2, dtype=torch.int64)
    kernels.fold[(1,)](slots, out, SLOTS=SLOTS)
    assert not slots.any(), "the fold leaves the slots zero for the next write"
    content, placement = (int(value) & MASK64 for value in out.tolist())
    return content, placement


def _expected(
    src: np.ndarray, ops: list[tuple[int, int, int]], src_region: int, dst_region: int
) -> tuple[int, int]:
    seed, salt = region_seed(src_region), pair_salt(src_region, dst_region)
    content = 0
    for source, target, nbytes in ops:
        piece = hash_bytes(src[source : source + nbytes], source, seed)
        content = (content + piece * destination_factor(salt, target - source)) & MASK64
    starts = np.array([op[1] for op in ops], dtype=np.int64)
    sizes = np.array([op[2] for op in ops], dtype=np.int64)
    placement = ranges_digest(np.full(len(ops), dst_region, dtype=np.int64), starts, sizes)
    return content, placement


def _check_landed(dst: np.ndarray, src: np.ndarray, ops: list[tuple[int, int, int]]) -> None:
    covered = np.zeros(dst.size, dtype=bool)
    for source, target, nbytes in ops:
        assert (dst[target : target + nbytes] == src[source : source + nbytes]).all()
        covered[target : target + nbytes] = True
    assert (dst[~covered] == CANARY).all(), "a byte outside the ops was written"


@interpreted
@pytest.mark.parametrize("shift", [0, 1, 2])
def test_row_kernel_copies_and_digests(kernels: ModuleType, shift: int) -> None:
    rng = np.random.default_rng(shift)
    src = rng.integers(0, 256, 64 * 1024, dtype=np.uint8)
    dst = np.full(96 * 1024, CANARY, dtype=np.uint8)
    # Two rows (a K part and a V part), blocks of 3 KiB with a stride of 8 KiB: pieces cross
    # 4 KiB pages at other places in the source than in the destination.
    local_base, remote_base = [100, 4196], [12, 3100]
    local_stride, remote_stride, nbytes = [8192, 8192], [12288, 12288], [3072, 1040]
    local_ids, remote_ids = [3, 0, 5], [5, 1, 2]
    src_region, dst_region = 0, 1
    columns = [local_base, remote_base, local_stride, remote_stride, nbytes]
    hashing = (region_seed(src_region), pair_salt(src_region, dst_region), region_salt(dst_region))
    columns += [_bits(value, value) for value in hashing]  # the same for both rows
    rows = torch.tensor([value for column in columns for value in column], dtype=torch.int64)
    capacity = 4  # one more pair than the request: a program past the count copies nothing
    ids = torch.tensor([3, *local_ids, 0, *remote_ids, 0], dtype=torch.int64)
    slots = torch.zeros(2 * SLOTS, dtype=torch.int64)
    source = torch.from_numpy(src)
    target = torch.from_numpy(dst)
    kernels.copy_rows[(capacity, 2, 1)](
        source.view(DTYPES[shift]),
        target.view(DTYPES[shift]),
        rows,
        ids,
        slots,
        2,
        capacity,
        SHIFT=shift,
        PIECE=256 * 1024,
        BLOCK=4096 >> shift,
        VEC=1,
        DIGESTS=True,
        CONTENT=True,
        STORE=True,
    )
    ops = [
        (local_base[r] + lid * local_stride[r], remote_base[r] + rid * remote_stride[r], nbytes[r])
        for lid, rid in zip(local_ids, remote_ids, strict=True)
        for r in range(2)
    ]
    _check_landed(dst, src, ops)
    assert _fold(kernels, slots) == _expected(src, ops, src_region, dst_region)


@interpreted
@pytest.mark.parametrize("shift", [0, 2])
def test_op_kernel_copies_and_digests(kernels: ModuleType, shift: int) -> None:
    rng = np.random.default_rng(7 + shift)
    src = rng.integers(0, 256, 48 * 1024, dtype=np.uint8)
    ops = [(0, 20000, 4096), (4100, 100, 4096), (9000, 30000, 5000), (12288, 5000, 8000)]
    src_region, dst_region = 2, 0
    for store, staged, content in (
        (True, False, True),
        (False, False, True),
        (True, True, True),
        (True, False, False),
    ):
        dst = np.full(48 * 1024, CANARY, dtype=np.uint8)
        # Staged: the bytes go to a staging buffer packed from 0, but count as bound for (and
        # stored to) their final targets.
        targets = np.cumsum([0] + [op[2] for op in ops[:-1]]) if staged else [op[1] for op in ops]
        table = [op[0] for op in ops] + list(targets) + [op[2] for op in ops] + [op[1] for op in ops]
        table += _bits(region_seed(src_region), pair_salt(src_region, dst_region), region_salt(dst_region))
        slots = torch.zeros(2 * SLOTS, dtype=torch.int64)
        kernels.copy_pieces[(len(ops),)](
            torch.from_numpy(src).view(DTYPES[shift]),
            torch.from_numpy(dst).view(DTYPES[shift]),
            torch.tensor(table, dtype=torch.int64),
            slots,
            len(ops),
            SHIFT=shift,
            BLOCK=4096 >> shift,
            VEC=1,
            DIGESTS=True,
            CONTENT=content,
            STORE=store,
        )
        if store and not staged:
            _check_landed(dst, src, ops)
        elif not store:
            assert (dst == CANARY).all(), "a copy that only hashes stores nothing"
        expected = _expected(src, ops, src_region, dst_region)
        assert _fold(kernels, slots) == (expected if content else (0, expected[1]))


@interpreted
@pytest.mark.parametrize("shift", [0, 2])
def test_block_kernel_sums_each_rows_blocks_as_the_host_does(kernels: ModuleType, shift: int) -> None:
    """The held blocks' hash (`kvray.content.HeldDigests` on a GPU): one sum per (row, block),
    each the host's `hash_ranges` of those bytes at their own offsets, whatever the row's
    length (a row of two pieces, a row shorter than the longest, pieces crossing 4 KiB pages)."""
    rng = np.random.default_rng(11 + shift)
    src = rng.integers(0, 256, 96 * 1024, dtype=np.uint8)
    before = src.copy()
    start, stride, nbytes = [100, 6244], [12288, 12288], [6000, 1040]
    seeds = [region_seed(3), region_seed(3)]
    blocks = [4, 0, 7]
    table = torch.tensor(start + stride + nbytes + _bits(*seeds), dtype=torch.int64)
    sums = torch.zeros(2 * len(blocks), dtype=torch.int64)
    kernels.hash_blocks[(len(blocks), 2, 2)](
        torch.from_numpy(src).view(DTYPES[shift]),
        table,
        torch.tensor(blocks, dtype=torch.int64),
        sums,
        2,
        len(blocks),
        SHIFT=shift,
        PIECE=4096,
        BLOCK=4096 >> shift,
        VEC=1,
    )
    found = sums.numpy().view(np.uint64).reshape(2, len(blocks))
    for row in range(2):
        offsets = np.array([start[row] + block * stride[row] for block in blocks], dtype=np.int64)
        expected = hash_ranges(src, offsets, np.full(len(blocks), nbytes[row], dtype=np.int64), seeds[row])
        assert found[row].tolist() == expected
    assert np.array_equal(src, before), "the block kernel stores nothing"


@interpreted
def test_row_kernel_digests_see_a_moved_block(kernels: ModuleType) -> None:
    """A copy that reads or writes another block than the reference says gives other digests."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 32 * 1024, dtype=np.uint8)
    columns = [[0], [0], [4096], [4096], [4096]]
    columns += [_bits(region_seed(0)), _bits(pair_salt(0, 0)), _bits(region_salt(0))]
    rows = torch.tensor([value for column in columns for value in column], dtype=torch.int64)

    def digests(local: int, remote: int) -> tuple[int, int]:
        slots = torch.zeros(2 * SLOTS, dtype=torch.int64)
        kernels.copy_rows[(1, 1, 1)](
            torch.from_numpy(src).view(torch.int32),
            torch.zeros(8192, dtype=torch.int32),
            rows,
            torch.tensor([1, local, remote], dtype=torch.int64),
            slots,
            1,
            1,
            SHIFT=2,
            PIECE=256 * 1024,
            BLOCK=1024,
            VEC=1,
            DIGESTS=True,
            CONTENT=True,
            STORE=True,
        )
        return _fold(kernels, slots)

    right = digests(2, 3)
    assert right == _expected(src, [(8192, 12288, 4096)], 0, 0)
    read_wrong = digests(1, 3)
    wrote_wrong = digests(2, 4)
    assert read_wrong[0] != right[0] and read_wrong[1] == right[1]
    assert wrote_wrong[0] != right[0] and wrote_wrong[1] != right[1]


@interpreted
def test_op_kernel_takes_the_landed_digest_of_bytes_as_they_must_land(kernels: ModuleType) -> None:
    """AT_BOUND: the bytes at their source, weighed as at the places they are bound for (a
    writer's blocks as they must land, `kvray.content.landed_digest`): equal to the landed
    digest of a buffer that holds them there, which is what the decode side reads."""
    from kvray.content import landed_digest

    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 40 * 1024, dtype=np.uint8)
    ops = [(0, 20000, 4096), (4100, 100, 4096), (9000, 30000, 5000)]
    dst_region = 2  # the bytes sit in some region of the writer's; only where they go counts
    table = [op[0] for op in ops] * 2 + [op[2] for op in ops] + [op[1] for op in ops]
    table += _bits(region_seed(dst_region), pair_salt(dst_region, dst_region), region_salt(dst_region))
    slots = torch.zeros(2 * SLOTS, dtype=torch.int64)
    kernels.copy_pieces[(len(ops),)](
        torch.from_numpy(src).view(torch.int32),
        torch.from_numpy(src).view(torch.int32),
        torch.tensor(table, dtype=torch.int64),
        slots,
        len(ops),
        SHIFT=2,
        BLOCK=1024,
        VEC=1,
        DIGESTS=True,
        CONTENT=True,
        STORE=False,
        AT_BOUND=True,
    )
    landed = np.zeros(48 * 1024, dtype=np.uint8)
    for source, target, nbytes in ops:
        landed[target : target + nbytes] = src[source : source + nbytes]
    at = np.array([op[1] for op in ops], dtype=np.int64)
    sizes = np.array([op[2] for op in ops], dtype=np.int64)
    regions = [landed, landed, landed]
    expected = landed_digest(regions, np.full(3, dst_region, dtype=np.int64), at, sizes)
    assert _fold(kernels, slots)[0] == expected
    # A byte that lands elsewhere, or differs, gives another value.
    landed[100] ^= 1
    assert landed_digest(regions, np.full(3, dst_region, dtype=np.int64), at, sizes) != expected
