"""The batched CPU copy under both CPU transports (`kvray.transport.cpu_copy`): every op's bytes go
exactly where they are sent, on the calling thread or over a few threads (the C extension's
pool of pthreads claiming ops from one job, or the ctypes fallback's equal shares on Python
threads), through either implementation alike."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvray.layout import ceil_div
from kvray.placement import Stored
from kvray.transport import cpu_copy

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
    if implementation == "native" and not cpu_copy.native():
        pytest.skip("kvray._copy_pool (the C extension) is not built here")
    if implementation == "native":
        return mock.patch.multiple(
            cpu_copy, _scatter_copy=cpu_copy._scatter_copy, _start_copy=cpu_copy._start_copy
        )
    return mock.patch.multiple(cpu_copy, _scatter_copy=None, _start_copy=None)


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
        cpu_copy.scatter_copy(dst.ctypes.data, src.ctypes.data, *columns(ops))
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
        mock.patch.object(cpu_copy, "copy_threads", lambda: threads),
        mock.patch.object(cpu_copy, "_PARALLEL_THRESHOLD", threshold),
        mock.patch.object(cpu_copy, "_CLAIM_NBYTES", claim),
    ):
        asyncio.run(cpu_copy.scatter_copy_async(dst.ctypes.data, src.ctypes.data, *columns(ops)))
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize("threads", [2, 3, 4])
async def test_large_ops_are_split_into_balanced_shares(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback (no C extension): few large ops of odd sizes; ops longer than a share are
    split, at most one call per thread, and no thread gets more than two shares' worth of bytes."""
    monkeypatch.setattr(cpu_copy, "_scatter_copy", None)
    monkeypatch.setattr(cpu_copy, "_start_copy", None)
    monkeypatch.setattr(cpu_copy, "copy_threads", lambda: threads)
    monkeypatch.setattr(cpu_copy, "_PARALLEL_THRESHOLD", 1)
    calls: list[int] = []
    original = cpu_copy.scatter_copy

    def counting(
        dst_base: int,
        src_base: int,
        dst_offsets: np.ndarray,
        src_offsets: np.ndarray,
        nbytes: np.ndarray,
        *copy: Any,
    ) -> Stored:
        calls.append(int(np.asarray(nbytes).sum()))
        return original(dst_base, src_base, dst_offsets, src_offsets, nbytes, *copy)

    monkeypatch.setattr(cpu_copy, "scatter_copy", counting)
    ops = [(0, 5, 1001), (3000, 0, 777), (1500, 2000, 1333)]
    dst, src = buffers(5000, ops, seed=threads)
    expected = reference(dst, src, ops)
    total = sum(nbytes for _, _, nbytes in ops)

    await cpu_copy.scatter_copy_async(dst.ctypes.data, src.ctypes.data, *columns(ops))

    np.testing.assert_array_equal(dst, expected)
    share = ceil_div(total, threads)
    assert sum(calls) == total
    assert len(calls) <= threads
    assert max(calls) <= 2 * share


def native_module() -> Any:
    if not cpu_copy.native():
        pytest.skip("kvray._copy_pool (the C extension) is not built here")
    import kvray._copy_pool

    return kvray._copy_pool


def wait_over(job: Any) -> None:
    """Block until the job's eventfd says every thread has left it."""
    ready, _, _ = select.select([job.fileno()], [], [], 10)
    assert ready, "the copy pool did not finish a tiny job in 10 s"
    assert job.over


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_pool_copies_every_piece_once_and_signals_when_every_thread_left(threads: int) -> None:
    """Ops split into many pieces for a few threads: the bytes are right, the job is complete,
    and the eventfd turns readable only once no thread is in the job."""
    native = native_module()
    ops = [(0, 5, 1001), (3000, 0, 777), (1500, 2000, 1333), (4900, 0, 0)]
    dst, src = buffers(5000, ops, seed=threads)
    expected = reference(dst, src, ops)

    job = native.start_copy(dst.ctypes.data, src.ctypes.data, *columns(ops), threads, 100)
    wait_over(job)

    assert job.complete
    assert not job.notice_sent  # there was none to send
    np.testing.assert_array_equal(dst, expected)


def test_the_pool_sends_the_notice_after_the_last_byte(tmp_path: Path) -> None:
    """The datagram goes once, from the thread that completed the last op: by the time it can
    be read, every byte is in place."""
    native = native_module()
    inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    inbox.bind(str(tmp_path / "inbox"))
    outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ops = [(offset * 4096, (offset * 7919) % 300 * 4096, 4096) for offset in range(300)]
    dst, src = buffers(300 * 4096, ops, seed=1)
    expected = reference(dst, src, ops)
    try:
        notice = (outbox.fileno(), os.fsencode(str(tmp_path / "inbox")), b"done")
        job = native.start_copy(dst.ctypes.data, src.ctypes.data, *columns(ops), 2, 4096, notice)
        inbox.settimeout(10)
        assert inbox.recv(64) == b"done"
        # The notice is sent before the threads leave: the bytes, not the job's end, are its cue.
        np.testing.assert_array_equal(dst, expected)
        wait_over(job)
        assert job.notice_sent
        inbox.setblocking(False)
        with pytest.raises(BlockingIOError):
            inbox.recv(64)
    finally:
        inbox.close()
        outbox.close()


def test_an_undeliverable_notice_is_reported_not_raised(tmp_path: Path) -> None:
    native = native_module()
    outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ops = [(0, 0, 64)]
    dst, src = buffers(64, ops, seed=2)
    expected = reference(dst, src, ops)
    try:
        notice = (outbox.fileno(), os.fsencode(str(tmp_path / "nobody")), b"done")
        job = native.start_copy(dst.ctypes.data, src.ctypes.data, *columns(ops), 1, 64, notice)
        wait_over(job)
    finally:
        outbox.close()
    assert job.complete and not job.notice_sent
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"dst_offsets": [-8]}, "negative"),
        ({"nbytes": [-1]}, "negative"),
        ({"src_offsets": [0, 0]}, "one length"),
        ({"threads": 0}, "threads"),
        ({"threads": 9}, "threads"),
        ({"piece": 0}, "threads"),
        ({"notice": (0, b"", b"x")}, "notice path"),
        ({"notice": (0, b"x" * 200, b"x")}, "notice path"),
    ],
)
def test_the_pool_refuses_bad_input_before_copying_a_byte(arguments: dict[str, Any], message: str) -> None:
    native = native_module()
    dst = np.zeros(64, dtype=np.uint8)
    src = np.full(64, 7, dtype=np.uint8)
    call: dict[str, Any] = {"dst_offsets": [0], "src_offsets": [0], "nbytes": [16], "threads": 2, "piece": 8}
    call.update(arguments)
    with pytest.raises(ValueError, match=message):
        native.start_copy(
            dst.ctypes.data,
            src.ctypes.data,
            np.array(call["dst_offsets"], dtype=np.int64),
            np.array(call["src_offsets"], dtype=np.int64),
            np.array(call["nbytes"], dtype=np.int64),
            call["threads"],
            call["piece"],
            call.get("notice"),
        )
    assert not dst.any()


def test_many_jobs_at_once_share_the_pool() -> None:
    """More jobs than threads, all in flight together: each completes, each byte right. Every
    job's source stays referenced until it is over (the pool reads it until then)."""
    native = native_module()
    jobs = []
    for seed in range(12):
        ops = [(block * 512, ((block * 5 + seed) % 40) * 512, 512) for block in range(40)]
        dst, src = buffers(40 * 512, ops, seed=seed)
        expected = reference(dst, src, ops)
        job = native.start_copy(dst.ctypes.data, src.ctypes.data, *columns(ops), 3, 256)
        jobs.append((job, dst, src, expected))
    for job, dst, _src, expected in jobs:
        wait_over(job)
        assert job.complete
        np.testing.assert_array_equal(dst, expected)


async def test_a_cancelled_pool_copy_returns_only_once_every_thread_is_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancel `scatter_copy_async` while the pool's threads are held: the cancellation is
    delivered only after they have copied and left."""
    native = native_module()
    monkeypatch.setattr(cpu_copy, "_PARALLEL_THRESHOLD", 1)
    gate = threading.Event()
    entered = threading.Event()
    admitted: list[int] = []

    def hold(low: int, high: int, total: int) -> bool:
        entered.set()
        assert gate.wait(10)
        admitted.append(total)
        return True

    ops = [(block * 1024, block * 1024, 1024) for block in range(64)]
    dst, src = buffers(64 * 1024, ops, seed=3)
    expected = reference(dst, src, ops)
    native.set_worker_hook(hold)
    try:
        task = asyncio.create_task(
            cpu_copy.scatter_copy_async(dst.ctypes.data, src.ctypes.data, *columns(ops), 2)
        )
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        asyncio.get_running_loop().call_later(0.2, gate.set)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.is_set() and sum(admitted) == 64 * 1024  # every claim went through the hook
    finally:
        native.set_worker_hook(None)
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize(
    ("dst_offset", "nbytes"), [(-8, 16), (0, -1)], ids=["negative-offset", "negative-length"]
)
def test_ctypes_fallback_refuses_what_the_c_extension_refuses(dst_offset: int, nbytes: int) -> None:
    """Run in a child process: without the check, the fallback scribbles or crashes."""
    if cpu_copy.native():
        dst = np.zeros(64, dtype=np.uint8)
        with pytest.raises(ValueError):
            cpu_copy.scatter_copy(
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
        sys.modules["kvray._copy_pool"] = None  # no C extension: the fallback path
        spec = importlib.util.spec_from_file_location("copy_fallback", {cpu_copy.__file__!r})
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


def test_pool_threads_are_named_and_leave_signals_to_the_interpreter() -> None:
    """The pool's pthreads show up as `kvray-copy` and block every signal: a Ctrl-C or a
    SIGTERM from Ray reaches a thread Python handles signals on, never a copy thread."""
    native = native_module()
    ops = [(0, 0, 64)]
    dst, src = buffers(64, ops, seed=4)
    wait_over(native.start_copy(dst.ctypes.data, src.ctypes.data, *columns(ops), 2, 64))
    pool = []
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # a thread that ended since the listing (another test's)
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("Name", "").strip() == "kvray-copy":
            pool.append(int(fields["SigBlk"].strip(), 16))
    assert pool, "no thread named kvray-copy"
    for signal_number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD, signal.SIGALRM):
        bit = 1 << (int(signal_number) - 1)
        assert all(blocked & bit for blocked in pool), f"{signal_number.name} not blocked: {pool}"


async def test_a_loop_that_cannot_watch_the_job_still_waits_for_its_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If the event loop refuses to watch the job's eventfd, the error surfaces only after the
    pool's threads are out: the caller may release the memory the moment it sees the error."""
    native = native_module()
    monkeypatch.setattr(cpu_copy, "_PARALLEL_THRESHOLD", 1)
    ops = [(block * 1024, block * 1024, 1024) for block in range(64)]
    dst, src = buffers(64 * 1024, ops, seed=5)
    expected = reference(dst, src, ops)
    loop = asyncio.get_running_loop()

    def refuse(*_: object) -> None:
        raise RuntimeError("no readers on this loop")

    def slow(low: int, high: int, total: int) -> bool:
        time.sleep(0.01)
        return True

    monkeypatch.setattr(loop, "add_reader", refuse)
    native.set_worker_hook(slow)
    try:
        with pytest.raises(RuntimeError, match="no readers"):
            await cpu_copy.scatter_copy_async(dst.ctypes.data, src.ctypes.data, *columns(ops), 2)
        np.testing.assert_array_equal(dst, expected)  # every byte already there
    finally:
        native.set_worker_hook(None)
