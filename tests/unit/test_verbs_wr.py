"""Work requests of the verbs transport (`kvray.transport.verbs.requests`, pure code): every op's bytes
are written exactly once, from inside the local region to inside the remote one, within the
device's limits, signalled every N, the last one carrying the immediate."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.errors import BoundsError, ConfigError
from kvray.plan import OpTable
from kvray.transport.verbs.requests import (
    MAX_SGE_NBYTES,
    DeviceLimits,
    RegisteredRegion,
    WriteRequest,
    build_write_requests,
    transfer_tag,
)

LOCAL = [RegisteredRegion(0x10000, 1 << 20, 0x11), RegisteredRegion(0x900000, 1 << 16, 0x12)]
REMOTE = [RegisteredRegion(0x7F0000000000, 1 << 20, 0x21), RegisteredRegion(0x7F8000000000, 1 << 18, 0x22)]


def table(rows: list[tuple[int, int, int, int, int]]) -> OpTable:
    columns = np.array(rows, dtype=np.int64).reshape(-1, 5).T
    return OpTable(*(np.ascontiguousarray(column) for column in columns))


def byte_map(requests: list[WriteRequest]) -> dict[tuple[int, int], tuple[int, int]]:
    """(remote region, remote byte) -> (lkey, local address) for every byte the requests write."""
    written: dict[tuple[int, int], tuple[int, int]] = {}
    for request in requests:
        remote_offset = request.remote_address - REMOTE[request.remote_region].address
        for sge in request.sges:
            for step in range(sge.length):
                key = (request.remote_region, remote_offset + step)
                assert key not in written, f"remote byte {key} written twice"
                written[key] = (sge.lkey, sge.address + step)
            remote_offset += sge.length
    return written


@st.composite
def op_tables(draw: st.DrawFn) -> OpTable:
    """Ops inside the regions, disjoint on the remote side (as a planner makes them)."""
    rows = []
    used: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for _ in range(draw(st.integers(1, 12))):
        remote_region = draw(st.integers(0, 1))
        nbytes = draw(st.integers(1, 700))
        remote_offset = draw(st.integers(0, 2048 - nbytes))
        if any(start < remote_offset + nbytes and remote_offset < end for start, end in used[remote_region]):
            continue
        used[remote_region].append((remote_offset, remote_offset + nbytes))
        local_region = draw(st.integers(0, 1))
        local_offset = draw(st.integers(0, LOCAL[local_region].length - nbytes))
        rows.append((local_region, local_offset, remote_region, remote_offset, nbytes))
    if not rows:
        rows.append((0, 0, 0, 0, 1))
    return table(rows)


@settings(max_examples=150, deadline=None)
@given(
    ops=op_tables(),
    max_sge=st.integers(1, 5),
    max_message=st.integers(1, 1500),
    signal_every=st.integers(1, 6),
    immediate=st.integers(0, 2**32 - 1),
)
def test_requests_write_every_op_byte_once_inside_both_regions_within_limits(
    ops: OpTable, max_sge: int, max_message: int, signal_every: int, immediate: int
) -> None:
    limits = DeviceLimits(max_sge=max_sge, max_message_nbytes=max_message, signal_every=signal_every)
    requests = build_write_requests(ops, LOCAL, REMOTE, limits, immediate=immediate)

    expected: dict[tuple[int, int], tuple[int, int]] = {}
    for local_region, local_offset, remote_region, remote_offset, nbytes in ops.rows():
        for step in range(nbytes):
            region = LOCAL[local_region]
            expected[(remote_region, remote_offset + step)] = (
                region.key,
                region.address + local_offset + step,
            )
    assert byte_map(requests) == expected  # total bytes conserved, each to its own place
    for request in requests:
        remote = REMOTE[request.remote_region]
        assert request.rkey == remote.key
        assert remote.address <= request.remote_address
        assert request.remote_address + request.nbytes <= remote.address + remote.length
        assert 1 <= len(request.sges) <= max_sge
        assert 0 < request.nbytes <= max_message
        for sge in request.sges:
            region = next(r for r in LOCAL if r.key == sge.lkey)
            assert (
                region.address <= sge.address and sge.address + sge.length <= region.address + region.length
            )
            assert 0 < sge.length <= MAX_SGE_NBYTES
    for index, request in enumerate(requests):
        last = index == len(requests) - 1
        assert request.signalled == (last or (index + 1) % signal_every == 0)
        assert request.immediate == (immediate if last else None)


def test_remote_contiguous_runs_gather_scattered_local_pieces() -> None:
    # Three local pieces, one remote run: one WRITE with three SGEs.
    ops = table([(0, 4096, 0, 0, 100), (0, 0, 0, 100, 100), (1, 512, 0, 200, 56)])
    limits = DeviceLimits(max_sge=4, max_message_nbytes=1 << 20, signal_every=16)
    (request,) = build_write_requests(ops, LOCAL, REMOTE, limits, immediate=7)
    assert [(s.address - LOCAL[0 if s.lkey == 0x11 else 1].address, s.length) for s in request.sges] == [
        (4096, 100),
        (0, 100),
        (512, 56),
    ]
    assert request.remote_address == REMOTE[0].address and request.immediate == 7 and request.signalled


def test_a_large_op_is_cut_at_the_message_size_and_local_contiguity_merges_sges() -> None:
    ops = table([(0, 0, 0, 0, 1000), (0, 1000, 0, 1000, 24)])  # contiguous on both sides
    limits = DeviceLimits(max_sge=1, max_message_nbytes=256, signal_every=2)
    requests = build_write_requests(ops, LOCAL, REMOTE, limits, immediate=1)
    assert [r.nbytes for r in requests] == [256, 256, 256, 256]
    assert [r.signalled for r in requests] == [False, True, False, True]
    assert [len(r.sges) for r in requests] == [1, 1, 1, 1]


def test_ops_outside_a_region_are_refused_before_any_request_exists() -> None:
    limits = DeviceLimits(max_sge=2, max_message_nbytes=4096, signal_every=4)
    with pytest.raises(BoundsError):
        build_write_requests(
            table([(0, 0, 1, REMOTE[1].length - 10, 11)]), LOCAL, REMOTE, limits, immediate=0
        )
    with pytest.raises(BoundsError):
        build_write_requests(table([(1, LOCAL[1].length, 0, 0, 1)]), LOCAL, REMOTE, limits, immediate=0)
    with pytest.raises(BoundsError):
        build_write_requests(table([(0, 0, 2, 0, 1)]), LOCAL, REMOTE, limits, immediate=0)


def test_bad_limits_and_immediates_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        DeviceLimits(max_sge=0, max_message_nbytes=1, signal_every=1)
    limits = DeviceLimits(max_sge=1, max_message_nbytes=1, signal_every=1)
    with pytest.raises(ConfigError):
        build_write_requests(table([(0, 0, 0, 0, 1)]), LOCAL, REMOTE, limits, immediate=2**32)


def test_transfer_tag_is_32_bits_and_stable() -> None:
    assert transfer_tag("req-1") == transfer_tag("req-1")
    assert transfer_tag("req-1") != transfer_tag("req-2")
    assert all(0 <= transfer_tag(f"r{i}") < 2**32 for i in range(100))
