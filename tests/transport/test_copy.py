"""The batched CPU copy under both CPU transports (`kvray.transport._copy`): every op's bytes go
exactly where they are sent, on the calling thread or over a few threads (claiming ops from a
shared cursor with the C extension, cut into shares with the ctypes fallback), through either
implementation alike."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvray.transport import _copy

IMPLEMENTATIONS = [
    pytest.param("native", id="native"),
    pytest.param("ctypes", id="ctypes-fallback"),
]


@st.composite
def copy_problems(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """A source size and ops (dst_offset, src_offset, nbytes) whose destinations do not overlap
    (so the result does not depend on order), in a random order; sources may overlap."""
    src_nbytes = draw(st.integers(1, 600))
    lengths = draw(st.lists(st.integers(0, 80).map(lambda n: min(n, src_nbytes)), min_size=1, max_size=24))
    gaps = draw(st.lists(st.integers(0, 20), min_size=len(lengths), max_size=len(lengths)))
    ops = []
    cursor = 0
    for length, gap in zip(lengths, gaps, strict=True):
        cursor += gap
        src_offset = draw(st.integers(0, src_nbytes - length))
        ops.append((cursor, src_offset, length))
        cursor += length
    order = draw(st.permutations(range(len(ops))))
    return src_nbytes, [ops[index] for index in order]


def reference(dst: np.ndarray, src: np.ndarray, ops: list[tuple[int, int, int]]) -> np.ndarray:
    expected = dst.copy()
    for dst_offset, src_offset, nbytes in ops:
        expected[dst_offset : dst_offset + nbytes] = src[src_offset : src_offset + nbytes]
    return expected


def columns(ops: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    table = np.array(ops, dtype=np.int64).reshape(-1, 3)
    return table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy()


def buffers(src_nbytes: int, ops: list[tuple[int, int, int]], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dst_nbytes = max(dst_offset + nbytes for dst_offset, _, nbytes in ops) + 16
    dst = rng.integers(0, 256, dst_nbytes, dtype=np.uint8)
    src = rng.integers(0, 256, src_nbytes, dtype=np.uint8)
    return dst, src


def use(implementation: str) -> mock._patch[object]:
    if implementation == "native" and not _copy.native():
        pytest.skip("kvray._copy (the C extension) is not built here")
    replacement = _copy._scatter_copy if implementation == "native" else None
    return mock.patch.object(_copy, "_scatter_copy", replacement)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=copy_problems(), seed=st.integers(0, 2**32 - 1))
def test_scatter_copy(
    implementation: str, problem: tuple[int, list[tuple[int, int, int]]], seed: int
) -> None:
    src_nbytes, ops = problem
    dst, src = buffers(src_nbytes, ops, seed)
    expected = reference(dst, src, ops)
    with use(implementation):
        _copy.scatter_copy(dst.ctypes.data, src.ctypes.data, *columns(ops))
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    problem=copy_problems(),
    seed=st.integers(0, 2**32 - 1),
    threads=st.integers(1, 5),
    threshold=st.sampled_from([1, 64, 1 << 30]),
    claim=st.sampled_from([1, 7, 64, 1 << 20]),
)
def test_scatter_copy_async_in_shares(
    implementation: str,
    problem: tuple[int, list[tuple[int, int, int]]],
    seed: int,
    threads: int,
    threshold: int,
    claim: int,
) -> None:
    src_nbytes, ops = problem
    dst, src = buffers(src_nbytes, ops, seed)
    expected = reference(dst, src, ops)
    with (
        use(implementation),
        mock.patch.object(_copy, "copy_threads", lambda: threads),
        mock.patch.object(_copy, "_PARALLEL_THRESHOLD", threshold),
        mock.patch.object(_copy, "_CLAIM_NBYTES", claim),
    ):
        asyncio.run(_copy.scatter_copy_async(dst.ctypes.data, src.ctypes.data, *columns(ops)))
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize("threads", [2, 3, 4])
async def test_large_ops_are_split_into_balanced_shares(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback (no C extension): few large ops of odd sizes; ops longer than a share are
    split, at most one call per thread, and no thread gets more than two shares' worth of bytes."""
    monkeypatch.setattr(_copy, "_scatter_copy", None)
    monkeypatch.setattr(_copy, "copy_threads", lambda: threads)
    monkeypatch.setattr(_copy, "_PARALLEL_THRESHOLD", 1)
    calls: list[int] = []
    original = _copy.scatter_copy

    def counting(
        dst_base: int, src_base: int, dst_offsets: np.ndarray, src_offsets: np.ndarray, nbytes: np.ndarray
    ) -> None:
        calls.append(int(np.asarray(nbytes).sum()))
        original(dst_base, src_base, dst_offsets, src_offsets, nbytes)

    monkeypatch.setattr(_copy, "scatter_copy", counting)
    ops = [(0, 5, 1001), (3000, 0, 777), (1500, 2000, 1333)]
    dst, src = buffers(5000, ops, seed=threads)
    expected = reference(dst, src, ops)
    total = sum(nbytes for _, _, nbytes in ops)

    await _copy.scatter_copy_async(dst.ctypes.data, src.ctypes.data, *columns(ops))

    np.testing.assert_array_equal(dst, expected)
    share = -(-total // threads)
    assert sum(calls) == total
    assert len(calls) <= threads
    assert max(calls) <= 2 * share


@pytest.mark.parametrize("threads", [2, 3])
async def test_threads_claim_ops_from_one_cursor(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C copy on several threads: every thread on the same split ops and the same cursor,
    all returned when the copy does; every op is claimed and counted done once, exactly one
    thread says it completed the batch, and the bytes are right."""
    if not _copy.native():
        pytest.skip("kvray._copy (the C extension) is not built here")
    monkeypatch.setattr(_copy, "copy_threads", lambda: threads)
    monkeypatch.setattr(_copy, "_PARALLEL_THRESHOLD", 1)
    monkeypatch.setattr(_copy, "_CLAIM_NBYTES", 100)
    calls: list[tuple[int, np.ndarray, bool]] = []
    native = _copy._scatter_copy
    assert native is not None

    def recording(*args: object) -> bool | None:
        finished = native(*args)
        calls.append((int(np.asarray(args[4]).size), args[5], bool(finished)))  # type: ignore[arg-type]
        return finished  # type: ignore[no-any-return]

    monkeypatch.setattr(_copy, "_scatter_copy", recording)
    ops = [(0, 5, 1001), (3000, 0, 777), (1500, 2000, 1333)]
    dst, src = buffers(5000, ops, seed=threads)
    expected = reference(dst, src, ops)

    await _copy.scatter_copy_async(dst.ctypes.data, src.ctypes.data, *columns(ops))

    np.testing.assert_array_equal(dst, expected)
    assert len(calls) == threads
    pieces = sum(-(-nbytes // 100) for _, _, nbytes in ops)
    assert {count for count, _, _ in calls} == {pieces}
    cursor = calls[0][1]
    assert all(other is cursor for _, other, _ in calls)
    assert int(cursor[0]) >= pieces and int(cursor[1]) == pieces
    assert sum(finished for _, _, finished in calls) == 1


@pytest.mark.parametrize(
    ("dst_offset", "nbytes"), [(-8, 16), (0, -1)], ids=["negative-offset", "negative-length"]
)
def test_ctypes_fallback_refuses_what_the_c_extension_refuses(dst_offset: int, nbytes: int) -> None:
    """Run in a child process: without the check, the fallback scribbles or crashes."""
    if _copy.native():
        dst = np.zeros(64, dtype=np.uint8)
        with pytest.raises(ValueError):
            _copy.scatter_copy(
                dst.ctypes.data + 32,
                dst.ctypes.data,
                np.array([dst_offset]),
                np.array([0]),
                np.array([nbytes]),
            )
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        import numpy as np
        sys.modules["kvray._copy"] = None  # no C extension: the fallback path
        spec = importlib.util.spec_from_file_location("copy_fallback", {_copy.__file__!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert not module.native()
        buffer = np.zeros(64, dtype=np.uint8)
        try:
            module.scatter_copy(buffer.ctypes.data + 32, buffer.ctypes.data,
                                np.array([{dst_offset}]), np.array([0]), np.array([{nbytes}]))
        except ValueError:
            print("refused")
        else:
            print("copied")
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, (
        f"the fallback crashed the process (exit {child.returncode}): {child.stderr[-500:]}"
    )
    assert child.stdout.strip() == "refused"
