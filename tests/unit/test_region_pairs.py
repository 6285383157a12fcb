"""`region_pairs`: how transports split an op table by (local region, remote region)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvray.transport.base import region_pairs


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=60))
def test_every_op_lands_in_exactly_its_pair(pairs: list[tuple[int, int]]) -> None:
    local = np.array([p[0] for p in pairs], dtype=np.int64)
    remote = np.array([p[1] for p in pairs], dtype=np.int64)
    seen = np.zeros(len(pairs), dtype=np.int64)
    for (local_index, remote_index), select in region_pairs(local, remote):
        chosen = np.arange(len(pairs))[select]
        assert chosen.size > 0
        assert (local[chosen] == local_index).all() and (remote[chosen] == remote_index).all()
        seen[chosen] += 1
    assert (seen == 1).all()


def test_one_region_each_side_needs_no_scan() -> None:
    zeros = np.zeros(5, dtype=np.int64)
    assert region_pairs(zeros, zeros) == [((0, 0), slice(None))]
