"""Placement digests (`kvray.placement`): the value of a set of destination ranges does not
depend on how an executor splits or merges them, every executor computes it alike (numpy, the C
copy's single thread, the C pool's threads, the Python fallback), and any change in where bytes
go (a range moved, dropped, stored twice, another region) changes it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.content import destination_factor, hash_bytes, pair_salt, region_seed
from kvray.faults import executor_offset_bug
from kvray.placement import PLACEHOLDER_BYTES, Stored, ranges_digest, region_salt
from kvray.transport import cpu_copy
from kvray.wire import TransferDone, encode


def digest(region: int, starts: list[int], sizes: list[int]) -> int:
    return ranges_digest(
        np.full(len(starts), region, dtype=np.int64),
        np.array(starts, dtype=np.int64),
        np.array(sizes, dtype=np.int64),
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(1, 1 << 20)), min_size=1, max_size=20),
    st.integers(0, 7),
    st.data(),
)
def test_splitting_a_range_anywhere_keeps_its_value(
    ranges: list[tuple[int, int]], region: int, data: st.DataObject
) -> None:
    starts, sizes = [], []
    for start, size in ranges:
        cut = data.draw(st.integers(0, size))
        starts += [start, start + cut]
        sizes += [cut, size - cut]
    assert digest(region, starts, sizes) == digest(region, [s for s, _ in ranges], [n for _, n in ranges])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(1, 1 << 16)), min_size=2, max_size=12))
def test_a_range_moved_dropped_doubled_or_in_another_region_changes_the_value(
    ranges: list[tuple[int, int]],
) -> None:
    starts, sizes = [s for s, _ in ranges], [n for _, n in ranges]
    value = digest(0, starts, sizes)
    assert digest(0, [starts[0] + 1, *starts[1:]], sizes) != value  # moved by one byte
    assert digest(0, starts[1:], sizes[1:]) != value  # dropped
    assert digest(0, [*starts, starts[0]], [*sizes, sizes[0]]) != value  # stored twice
    assert digest(1, starts, sizes) != value  # another region
    # The seed bug's shape: the second range's bytes stored over the first's place instead.
    if sizes[0] == sizes[1] and starts[0] != starts[1]:
        assert digest(0, [starts[0], *starts[2:], starts[0]], [sizes[0], *sizes[2:], sizes[1]]) != value


def _buffers(size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(size)
    return rng.integers(0, 256, size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)


OPS = (
    np.array([0, 70_000, 300_000, 1_000_000], dtype=np.int64),  # destination
    np.array([500_000, 0, 2_000_000, 90_000], dtype=np.int64),  # source
    np.array([60_000, 200_000, 600_000, 3_500_000], dtype=np.int64),
)


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
async def test_every_executor_reports_the_digests_of_what_it_stored(
    native: bool, threads: int, staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placement digest of where the bytes went and the content digest of the bytes as at
    their source offsets (`kvray.content`, checked against numpy's definition), alike from the
    C copy (one thread or the pool's) and the Python fallback; an executor storing elsewhere
    (`executor_offset_bug`) reports other values."""
    if native and not cpu_copy.native():
        pytest.skip("the C copy pool is not built")
    if not native:
        monkeypatch.setattr(cpu_copy, "_scatter_copy", None)
        monkeypatch.setattr(cpu_copy, "_start_copy", None)
    src, dst = _buffers(6_000_000)
    dst_offsets, src_offsets, nbytes = OPS
    # Staged: the bytes are read from `src` where they were packed, hashed as at `logical`.
    logical = src_offsets + 12_345_676 if staged else None
    hashing = cpu_copy.Hashing.between(2, 3, logical)

    async def copy() -> Stored:
        return await cpu_copy.scatter_copy_async(
            dst.ctypes.data,
            src.ctypes.data,
            dst_offsets,
            src_offsets,
            nbytes,
            threads,
            salt=region_salt(3),
            base=Stored(5, 9),
            hashing=hashing,
        )

    stored = await copy()
    at = src_offsets if logical is None else logical
    expected = 9
    for to, start, where, size in zip(dst_offsets, src_offsets, at, nbytes, strict=True):
        assert np.array_equal(dst[to : to + size], src[start : start + size])
        value = hash_bytes(src[start : start + size], int(where), region_seed(2))
        expected += destination_factor(pair_salt(2, 3), int(to - where)) * value
    placement = (5 + ranges_digest(np.full(4, 3, dtype=np.int64), dst_offsets, nbytes)) % 2**64
    assert stored == Stored(placement, expected % 2**64)
    dst[:] = 0
    with executor_offset_bug():
        faulty = await copy()
    assert faulty.placement != stored.placement and faulty.content != stored.content
    assert not np.array_equal(dst[1_000_000:4_500_000], src[90_000:3_590_000])


def test_the_content_digest_catches_what_plain_sums_miss() -> None:
    """Structured corruptions with zero sum and zero first moment (+1 -2 +1 on three words,
    equal-sum blocks swapped, paired word swaps), a zeroed stretch and one flipped bit each
    change the value; so does the same bytes bound elsewhere."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    seed = region_seed(0)
    value = hash_bytes(data, 4096, seed)
    words = data.view("<u4").copy()
    for corrupt in range(5):
        changed = words.copy()
        if corrupt == 0:  # +1 -2 +1
            changed[100:103] += np.array([1, -2, 1], dtype=np.int64).astype(np.uint32)
        elif corrupt == 1:  # two blocks of equal sum swapped
            changed[:16], changed[16:32] = words[16:32], words[:16]
        elif corrupt == 2:  # paired word swaps
            changed[[10, 11, 50, 51]] = words[[11, 10, 51, 50]]
        elif corrupt == 3:  # a zeroed stretch
            changed[2048:4096] = 0
        else:  # one flipped bit
            changed[777] ^= np.uint32(1 << 31)
        assert not np.array_equal(changed, words)
        assert hash_bytes(changed.view(np.uint8), 4096, seed) != value, corrupt
    assert destination_factor(pair_salt(0, 1), 0) != destination_factor(pair_salt(0, 1), 64)


async def test_the_pool_thread_writes_the_digest_into_the_notice_it_sends(tmp_path: object) -> None:
    """A whole push's early notice ends in the placeholder; the C pool's thread that copies the
    last byte overwrites it with the job's digest (plus `base`) before sending the datagram."""
    if not cpu_copy.native():
        pytest.skip("the C copy pool is not built")
    import socket

    notice = TransferDone(
        transfer_id="t", request_id="r", src_engine="p", src_incarnation=1, dst_engine="d",
        dst_incarnation=2, nbytes=1, layers=(0,), placement=2**64 - 1,
    )  # fmt: skip
    message = encode(notice)
    assert message.endswith(PLACEHOLDER_BYTES)
    path = f"{tmp_path}/inbox"
    inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    inbox.bind(path)
    outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    class Datagram:
        sent = False

        def datagram(self) -> tuple[int, bytes, bytes]:
            return outbox.fileno(), path.encode(), message

        def __call__(self, stored: Stored) -> None:
            raise AssertionError("the C thread sends it")

    src, dst = _buffers(6_000_000)
    early = Datagram()
    placement = await cpu_copy.scatter_copy_async(
        dst.ctypes.data, src.ctypes.data, *OPS, 2, then=early, salt=region_salt(0), base=Stored(7, 0)
    )
    assert early.sent
    received = inbox.recv(65536)
    assert received[:-8] == message[:-8] and int.from_bytes(received[-8:], "big") == placement.placement
    from kvray.wire import decode_notice

    assert decode_notice(received).placement == placement.placement
    inbox.close()
    outbox.close()
