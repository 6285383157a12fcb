"""The benchmark's verification: a destination that does not hold the source's bytes, exactly
where they belong, is reported as a failure (and the row is FAILED), never measured."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import pytest

from kvray.bench.harness import Contender, Run, run_cases
from kvray.bench.results import format_case, summary_rows
from kvray.bench.verify import (
    compare_payload,
    expected_payload,
    fill_source,
    pattern_rows,
    scrub,
    verify_destination,
)
from kvray.bench.workload import KIB, Workload, deepseek_request, gather, scatter, uniform
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.progress import Progress


def small_cases() -> list[Workload]:
    return [uniform("a", "a", 256 * KIB, 16 * KIB, seed=1), deepseek_request(128, seed=5)]


def transferred(workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """(source pool, destination pool) after a correct transfer."""
    src = np.zeros(workload.region_nbytes, dtype=np.uint8)
    dst = np.zeros(workload.region_nbytes, dtype=np.uint8)
    fill_source(src, workload)
    scrub(dst, 0)
    scatter(dst, workload, workload.dst_ids(), gather(src, workload, workload.src_ids()))
    return src, dst


@pytest.mark.parametrize("workload", small_cases(), ids=lambda w: w.key)
def test_a_correct_transfer_passes(workload: Workload) -> None:
    src, dst = transferred(workload)
    verdict = verify_destination(dst, workload)
    assert verdict.ok, verdict.detail
    assert verdict.checked_nbytes == workload.nbytes
    assert compare_payload(gather(src, workload, workload.src_ids()), workload).ok


@pytest.mark.parametrize("workload", small_cases(), ids=lambda w: w.key)
def test_one_corrupted_byte_is_reported(workload: Workload) -> None:
    _, dst = transferred(workload)
    segment = workload.segments[-1]
    position = workload.blocks - 1
    target = segment.offset + workload.dst_blocks[position] * segment.block_stride + segment.nbytes // 2
    dst[target] ^= 0x01
    verdict = verify_destination(dst, workload)
    assert not verdict.ok
    assert verdict.bad_rows == 1
    assert verdict.first is not None
    assert (verdict.first.segment, verdict.first.position) == (segment.name, position)
    assert verdict.first.byte == segment.nbytes // 2
    assert verdict.first.dst_block == workload.dst_blocks[position]
    assert "1 wrong rows" in verdict.detail


def test_a_stale_destination_fails() -> None:
    workload = small_cases()[0]
    _, dst = transferred(workload)
    scrub(dst, 1)  # the next run's scrub, and no transfer after it
    verdict = verify_destination(dst, workload)
    assert not verdict.ok
    assert verdict.bad_rows == workload.blocks


def test_swapped_blocks_fail() -> None:
    workload = small_cases()[0]
    _, dst = transferred(workload)
    rows = dst.reshape(workload.layout.num_blocks, -1)
    first, second = workload.dst_blocks[0], workload.dst_blocks[1]
    rows[[first, second]] = rows[[second, first]]
    verdict = verify_destination(dst, workload)
    assert not verdict.ok and verdict.bad_rows == 2


def test_a_layer_written_into_another_layer_of_the_same_geometry_fails() -> None:
    """The seed bug: two layers of one geometry, the second written over the first's slot."""
    geometry = Geometry(block_size=16, entry_shape=(64,), dtype="uint8")
    layout = KVLayout(
        layers=(LayerSpec(name="dense0", geometry=geometry), LayerSpec(name="dense1", geometry=geometry)),
        num_blocks=8,
    )
    workload = Workload(
        key="t", family="t", title="t", layout=layout, src_blocks=(1, 5, 2), dst_blocks=(7, 0, 3), seed=9
    )
    _, dst = transferred(workload)
    dense0, dense1 = workload.segments
    for block in workload.dst_blocks:  # dense1's bytes land at dense0's address
        start0 = dense0.offset + block * dense0.block_stride
        start1 = dense1.offset + block * dense1.block_stride
        dst[start0 : start0 + dense0.nbytes] = dst[start1 : start1 + dense1.nbytes]
    verdict = verify_destination(dst, workload)
    assert not verdict.ok
    assert verdict.first is not None and verdict.first.segment == "dense0"


def test_a_short_or_wrong_payload_fails() -> None:
    workload = small_cases()[0]
    payload = expected_payload(workload)
    assert compare_payload(payload, workload).ok
    assert not compare_payload(payload[:-1], workload).ok
    shifted = np.roll(payload, 1)
    assert not compare_payload(shifted, workload).ok


def test_pattern_rows_are_unique() -> None:
    rows = pattern_rows(seed=3, first_row=0, count=512, row_nbytes=4096)
    assert len({row.tobytes() for row in rows}) == 512
    again = pattern_rows(seed=3, first_row=100, count=1, row_nbytes=4096)
    assert np.array_equal(again[0], rows[100])


class CorruptingContender(Contender):
    """An in-process contender that copies correctly except in run `corrupt_run`."""

    family = "test"
    names = ("honest", "corrupting")
    timed: ClassVar[Mapping[str, str]] = {"honest": "here", "corrupting": "here"}

    def __init__(self, corrupt_run: int) -> None:
        self.corrupt_run = corrupt_run

    def setup(self, workload: Workload) -> None:
        self.workload = workload
        self.src = np.zeros(workload.region_nbytes, dtype=np.uint8)
        self.dst = np.zeros(workload.region_nbytes, dtype=np.uint8)
        fill_source(self.src, workload)

    def run(self, name: str, run: int) -> Run:
        workload = self.workload
        scrub(self.dst, run)
        scatter(self.dst, workload, workload.dst_ids(), gather(self.src, workload, workload.src_ids()))
        if name == "corrupting" and run == self.corrupt_run:
            segment = workload.segments[0]
            self.dst[segment.offset + workload.dst_blocks[2] * segment.block_stride] ^= 0xFF
        return Run(0.001, verify_destination(self.dst, workload))


def test_a_corrupted_run_marks_the_row_failed() -> None:
    workload = small_cases()[0]
    results = run_cases([CorruptingContender(corrupt_run=2)], [workload], 1, {workload.key: 3}, Progress(8))
    by_name = {r.contender: r for r in results}
    assert by_name["honest"].ok
    assert not by_name["corrupting"].ok
    assert "run 2" in (by_name["corrupting"].failure or "")
    rows = summary_rows(results, workload)
    status = {row["contender"]: row["status"] for row in rows}
    assert status == {"honest": "ok", "corrupting": "FAILED"}
    table = format_case(rows, workload, 1, 3)
    assert "corrupting" in table and "FAILED: run 2: 1 wrong rows" in table


def test_a_contender_that_raises_fails_its_row() -> None:
    class Raising(CorruptingContender):
        def run(self, name: str, run: int) -> Run:
            if name == "corrupting":
                raise RuntimeError("transfer lost")
            return super().run(name, run)

    workload = small_cases()[0]
    results = run_cases([Raising(corrupt_run=-1)], [workload], 0, {workload.key: 2}, Progress(4))
    failed_row = next(r for r in results if r.contender == "corrupting")
    assert not failed_row.ok and "transfer lost" in (failed_row.failure or "")
