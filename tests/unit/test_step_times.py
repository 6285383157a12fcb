"""`kvray.bench.step_times`: the hand-off's steps stamped where it is installed, and the median
timeline of hand-offs run one at a time."""

from __future__ import annotations

import pytest

from kvray.bench import step_times


def test_the_timeline_is_the_median_offset_of_each_steps_first_stamp() -> None:
    decode = []
    prefill = []
    for run in range(5):
        start = 10.0 * run
        decode += [("begin>", start), ("expect>", start + 0.001), ("loaded>", start + 0.004 + run * 1e-4)]
        prefill += [
            ("begin>", start - 1),
            ("push>", start + 0.002),
            ("push<", start + 0.003),
            ("push>", start + 0.0035),
        ]
    steps = dict(step_times.timeline(decode, prefill, skip=1))
    assert steps["D begin>"] == 0.0
    assert steps["D expect>"] == pytest.approx(1.0)
    assert steps["P push>"] == pytest.approx(2.0)  # the first start of the step in each hand-off
    assert steps["P push<"] == pytest.approx(3.0)
    assert steps["D loaded>"] == pytest.approx(4.25)
    assert "P begin>" not in steps  # the prefill engine's own steps (its holds) are not the hand-off's
    assert next(name for name, _ in step_times.timeline(decode, prefill)) == "D begin>"


def test_installing_stamps_the_steps_once() -> None:
    from kvray.agent.handoff.prefill import PrefillSide

    before = PrefillSide.take
    try:
        step_times.install()
        wrapped = PrefillSide.take
        step_times.install()
        assert PrefillSide.take is wrapped and wrapped is not before
    finally:
        PrefillSide.take = before  # type: ignore[method-assign]
        step_times.taken()
