"""The row kernel's shape on one GPU: GPU time of variants of `kvray.transport.cuda_ipc`'s row
kernel (bytes per loop step, warps, bytes per program, an unmasked main loop, streaming cache
hints, block ids read from pinned host memory instead of uploaded) against one plain copy of the
same bytes, for DeepSeek-V3 requests of 4k and 16k tokens; and the host time of the steps of
`copy_rows` against the same steps through the driver directly.

    python examples/bench_gpu_rows.py [--repeat 100]

GPU times are CUDA-event intervals with the launch queued behind a GPU sleep (so the host's
launch time is not in them), variants interleaved round by round; medians with the 10th and
90th percentiles. Every variant's output is compared with kvray's kernel's, from a
poisoned target. Prints one table. A variant without `tail` masks every loop step.
"""

# The closures timed below are called inside the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvray.layout import deepseek_v3
from kvray.memory import Backing, MemoryKind
from kvray.plan import OffsetCache, plan_transfer
from kvray.transport import cuda_ipc
from kvray.wire import Role, TransportKind


def variant_kernel() -> Any:
    import triton
    import triton.language as tl

    def copy_rows_variant(  # type: ignore[no-untyped-def]
        src,
        dst,
        rows,
        ids,
        num_rows,
        capacity,
        SHIFT: tl.constexpr,
        PIECE: tl.constexpr,
        BLOCK: tl.constexpr,
        VEC: tl.constexpr,
        TAIL: tl.constexpr,
        STREAMING: tl.constexpr,
    ):
        pair = tl.program_id(0)
        row = tl.program_id(1)
        skip = tl.program_id(2).to(tl.int64) * PIECE
        # Unmasked id loads: the buffer always holds `capacity` ids, so the three loads are
        # independent (one round trip when the ids sit in host memory).
        count = tl.load(ids)
        local_id = tl.load(ids + 1 + pair)
        remote_id = tl.load(ids + 1 + capacity + pair)
        live = pair < count
        local_base = tl.load(rows + row)
        remote_base = tl.load(rows + num_rows + row)
        local_stride = tl.load(rows + 2 * num_rows + row)
        remote_stride = tl.load(rows + 3 * num_rows + row)
        nbytes = tl.load(rows + 4 * num_rows + row)
        length = tl.minimum(nbytes - skip, PIECE) >> SHIFT
        length = tl.where(live, length, 0)
        source = (local_base + local_id * local_stride + skip) >> SHIFT
        target = (remote_base + remote_id * remote_stride + skip) >> SHIFT
        if VEC > 1:
            source = tl.multiple_of(source, VEC)
            target = tl.multiple_of(target, VEC)
            length = tl.multiple_of(length, VEC)
        if TAIL:
            full = length // BLOCK * BLOCK
            for start in tl.range(0, full, BLOCK):
                index = start + tl.arange(0, BLOCK)
                if STREAMING:
                    values = tl.load(src + source + index, eviction_policy="evict_first")
                    tl.store(dst + target + index, values, cache_modifier=".cs")
                else:
                    values = tl.load(src + source + index)
                    tl.store(dst + target + index, values)
            if full < length:
                index = full + tl.arange(0, BLOCK)
                mask = index < length
                values = tl.load(src + source + index, mask=mask)
                tl.store(dst + target + index, values, mask=mask)
        else:
            for start in tl.range(0, length, BLOCK):
                index = start + tl.arange(0, BLOCK)
                mask = index < length
                if STREAMING:
                    values = tl.load(src + source + index, mask=mask, eviction_policy="evict_first")
                    tl.store(dst + target + index, values, mask=mask, cache_modifier=".cs")
                else:
                    values = tl.load(src + source + index, mask=mask)
                    tl.store(dst + target + index, values, mask=mask)

    return triton.jit(copy_rows_variant)


def ids_kernel() -> Any:
    """One program that copies the block ids from pinned host memory into the GPU's buffer:
    as kvray's captured copy does, here in one program."""
    import triton
    import triton.language as tl

    def fetch_ids(host, device_ids, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(device_ids + offsets, tl.load(host + offsets, mask=mask), mask=mask)

    return triton.jit(fetch_ids)


# (label, BLOCK elements, warps, PIECE bytes, TAIL, STREAMING)
SHAPES: list[tuple[str, int, int, int, bool, bool]] = [
    ("B4096 w16 P256K masked", 4096, 16, 256 * 1024, False, False),
    ("B4096 w16 P256K tail", 4096, 16, 256 * 1024, True, False),
    ("B4096 w16 P256K stream", 4096, 16, 256 * 1024, False, True),
    ("B4096 w8 P256K tail", 4096, 8, 256 * 1024, True, False),
    ("B2048 w8 P256K tail", 2048, 8, 256 * 1024, True, False),
    ("B2048 w4 P256K tail", 2048, 4, 256 * 1024, True, False),
    ("B2048 w16 P256K tail", 2048, 16, 256 * 1024, True, False),
    ("B1024 w4 P256K", 1024, 4, 256 * 1024, False, False),
    ("B1024 w8 P256K", 1024, 8, 256 * 1024, False, False),
    ("B1024 w4 P24K", 1024, 4, 24 * 1024, False, False),
    ("B1024 w8 P24K", 1024, 8, 24 * 1024, False, False),
    ("B1024 w4 P8K", 1024, 4, 8 * 1024, False, False),
    ("B1024 w8 P8K", 1024, 8, 8 * 1024, False, False),
    ("B512 w4 P4K", 512, 4, 4 * 1024, False, False),
    ("B2048 w8 P16K tail", 2048, 8, 16 * 1024, True, False),
    ("B1024 w4 P24K stream", 1024, 4, 24 * 1024, False, True),
    ("B4096 w16 P36K tail", 4096, 16, 36 * 1024, True, False),
]

SLEEP_CYCLES = 400_000


def triton_next_power(n: int) -> int:
    return 1 << (n - 1).bit_length()


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def gpu_interval(run: Callable[[], Any]) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    begin.record()
    run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def host_interval(run: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed * 1e3


def summary(values: list[float]) -> str:
    return (
        f"{statistics.median(values):8.4f} ms  p10 {percentile(values, 0.1):8.4f}  "
        f"p90 {percentile(values, 0.9):8.4f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=100)
    args = parser.parse_args()
    lines: list[str] = []
    failures = 0
    rng = np.random.default_rng(0)
    kernel = variant_kernel()
    fetch = ids_kernel()
    lib = cuda_ipc.libcuda()
    for name, blocks, request in (("deepseek-v3 4k", 128, 64), ("deepseek-v3 16k", 512, 256)):
        layout = deepseek_v3(blocks)
        source = Backing.allocate(layout, MemoryKind.CUDA)
        target = Backing.allocate(layout, MemoryKind.CUDA)
        source.regions[0].tensor.random_(0, 256)
        infos = [
            backing.engine_info(
                engine,
                1,
                role,
                "node",
                backing.region_descriptors(engine, 1, TransportKind.CUDA_IPC, remote_writable=True),
            )
            for backing, engine, role in ((source, "p", Role.PREFILL), (target, "d", Role.DECODE))
        ]
        cache = OffsetCache()
        local_ids = rng.permutation(blocks)[:request]
        remote_ids = rng.permutation(blocks)[:request]
        plan = plan_transfer(infos[0], infos[1], local_ids, remote_ids, cache=cache)
        rows = plan.rows
        assert rows is not None
        src, dst = source.regions[0].tensor, target.regions[0].tensor
        device = dst.device
        table = cuda_ipc.row_table(rows, device)
        nbytes = plan.ops.total_nbytes
        plain = torch.empty(nbytes, dtype=torch.uint8, device=device)
        count = int(rows.local_ids.size)
        capacity = cuda_ipc.capacity_for(count)
        host_ids = torch.zeros(1 + 2 * capacity, dtype=torch.int64, pin_memory=True)
        staging = host_ids.numpy()
        staging[0] = count
        staging[1 : 1 + count] = rows.local_ids
        staging[1 + capacity : 1 + capacity + count] = rows.remote_ids
        ids = host_ids.to(device)
        fetched = torch.zeros_like(ids)

        def fetch_then_copy() -> None:
            fetch[(1,)](host_ids, fetched, host_ids.numel(), BLOCK=triton_next_power(host_ids.numel()))
            launch(SHAPES[1], fetched)

        unit = cuda_ipc.pick_unit(bases=(table.combined, dst.data_ptr(), src.data_ptr()))
        vec, unit = (2 if unit == 16 else 1), min(8, unit)
        view_src, view_dst = src.view(cuda_ipc.UNIT_DTYPES[unit]), dst.view(cuda_ipc.UNIT_DTYPES[unit])

        def launch(shape: tuple[str, int, int, int, bool, bool], id_table: torch.Tensor) -> None:
            _, block, warps, piece, tail, streaming = shape
            pieces = -(-int(rows.local.nbytes.max()) // piece)
            kernel[(capacity, table.num_rows, pieces)](
                view_src,
                view_dst,
                table.table,
                id_table,
                table.num_rows,
                capacity,
                SHIFT=unit.bit_length() - 1,
                PIECE=piece,
                BLOCK=block,
                VEC=vec,
                TAIL=tail,
                STREAMING=streaming,
                num_warps=warps,
            )

        # The reference bytes: kvray's kernel into a poisoned target.
        dst.fill_(0xA5)
        cuda_ipc.launch_rows_kernel(dst, src, table, ids, capacity)
        torch.cuda.synchronize()
        expected = dst.clone()

        def check(label: str) -> None:
            nonlocal failures
            torch.cuda.synchronize()
            if not torch.equal(dst, expected):
                failures += 1
                print(f"WRONG BYTES: {name} / {label}")
            dst.fill_(0xA5)
            torch.cuda.synchronize()

        contenders: dict[str, Callable[[], Any]] = {
            "plain copy of the bytes": lambda: plain.copy_(src[:nbytes], non_blocking=True),
            "kvray launch_rows_kernel": lambda: cuda_ipc.launch_rows_kernel(dst, src, table, ids, capacity),
        }
        for shape in SHAPES:
            contenders[shape[0]] = lambda shape=shape: launch(shape, ids)
        # Ids read by the kernel from pinned host memory (no upload).
        try:
            dst.fill_(0xA5)
            launch(SHAPES[0], host_ids)
            check("host ids")
            contenders["B4096 w16 P256K, host ids"] = lambda: launch(SHAPES[0], host_ids)
            contenders["B1024 w4 P24K, host ids"] = lambda: launch(SHAPES[9], host_ids)
        except Exception as error:
            print(f"{name}: no host ids ({type(error).__name__}: {error})")
        # Captured copies: kvray's (ids kernel + row kernel), the kernel alone with ids on the GPU,
        # and the kernel alone reading the pinned ids.
        capture_stream = torch.cuda.Stream()
        graphs: dict[str, torch.cuda.CUDAGraph] = {}
        for label, body in (
            ("graph: kvray (ids fetch + kernel)", None),
            ("graph: kernel, ids on GPU", lambda: launch(SHAPES[0], ids)),
            ("graph: kernel, host ids", lambda: launch(SHAPES[0], host_ids)),
            ("graph: kernel B1024 w4 P24K, host ids", lambda: launch(SHAPES[9], host_ids)),
            ("graph: kernel tail, ids on GPU", lambda: launch(SHAPES[1], ids)),
            ("graph: ids kernel + kernel tail", fetch_then_copy),
        ):
            try:
                if body is None:
                    row_graph = cuda_ipc.capture_rows(dst, src, table, capacity)
                    row_graph.staging[:] = staging
                    graphs[label] = row_graph.graph
                    continue
                body()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(capture_stream):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        body()
                    finally:
                        graph.capture_end()
                graphs[label] = graph
            except Exception as error:
                print(f"{name}: no {label} ({type(error).__name__}: {error})")
        for label, graph in graphs.items():
            contenders[label] = graph.replay
        samples: dict[str, list[float]] = {label: [] for label in contenders}
        for label, run in contenders.items():
            run()
            if label != "plain copy of the bytes":
                check(label)
        for _ in range(args.repeat):
            for label, run in contenders.items():
                samples[label].append(gpu_interval(run))
        for label in contenders:
            lines.append(f"{name:<16} gpu  {label:<42} {summary(samples[label])}")
        # Ids changed in the pinned buffer between replays land: two requests alternating.
        for checked in ("graph: kernel, host ids", "graph: ids kernel + kernel tail"):
            if checked not in graphs:
                continue
            other_local = rng.permutation(blocks)[:request]
            other_remote = rng.permutation(blocks)[:request]
            other = plan_transfer(infos[0], infos[1], other_local, other_remote, cache=cache).rows
            assert other is not None
            dst.fill_(0xA5)
            cuda_ipc.launch_rows(dst, src, other, table)
            torch.cuda.synchronize()
            other_expected = dst.clone()
            for turn in range(20):
                first = turn % 2 == 0
                chosen = rows if first else other
                dst.fill_(0xA5)
                torch.cuda.synchronize()
                staging[1 : 1 + count] = chosen.local_ids
                staging[1 + capacity : 1 + capacity + count] = chosen.remote_ids
                graphs[checked].replay()
                torch.cuda.synchronize()
                if not torch.equal(dst, expected if first else other_expected):
                    failures += 1
                    print(f"WRONG BYTES: {name} / {checked}, replay {turn}")
            staging[1 : 1 + count] = rows.local_ids
            staging[1 + capacity : 1 + capacity + count] = rows.remote_ids

        # Host time of copy_rows' steps, and the same through the driver.
        dst.fill_(0xA5)
        target_stream = cuda_ipc.copy_stream(0)
        cuda_ipc.copy_rows(dst, src, rows, table)
        row_graph = cuda_ipc.idle_graph(dst, src, table, capacity)
        assert row_graph is not None
        produced = torch.cuda.Event()
        produced.record()
        done = torch.cuda.Event()
        done.record(target_stream)
        torch.cuda.synchronize()
        for function, arguments in (
            ("cuEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
            ("cuStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
            ("cuGraphLaunch", [ctypes.c_void_p, ctypes.c_void_p]),
        ):
            getattr(lib, function).argtypes = arguments
        exec_handle = row_graph.graph.raw_cuda_graph_exec()
        stream_handle = target_stream.cuda_stream
        produced_handle, done_handle = produced.cuda_event, done.cuda_event

        def lean() -> None:
            current = torch._C._cuda_getCurrentRawStream(0)
            lib.cuEventRecord(produced_handle, current)
            lib.cuStreamWaitEvent(stream_handle, produced_handle, 0)
            row_graph.staging[0] = count
            row_graph.staging[1 : 1 + count] = rows.local_ids
            row_graph.staging[1 + capacity : 1 + capacity + count] = rows.remote_ids
            lib.cuGraphLaunch(exec_handle, stream_handle)
            lib.cuEventRecord(done_handle, stream_handle)

        def staging_writes() -> None:
            row_graph.staging[0] = count
            row_graph.staging[1 : 1 + count] = rows.local_ids
            row_graph.staging[1 + capacity : 1 + capacity + count] = rows.remote_ids

        def contexts() -> None:
            with torch.cuda.device(dst.device), torch.cuda.stream(target_stream):
                pass

        host_steps: dict[str, Callable[[], Any]] = {
            "copy_rows (replay)": lambda: cuda_ipc.copy_rows(dst, src, rows, table),
            "follow_current": lambda: cuda_ipc.follow_current(0, target_stream),
            "device+stream contexts": contexts,
            "idle_graph": lambda: cuda_ipc.idle_graph(dst, src, table, capacity),
            "staging writes": staging_writes,
            "graph.replay (torch)": row_graph.graph.replay,
            "event.record (torch)": lambda: done.record(target_stream),
            "four driver calls (replay without event nodes)": lean,
        }
        host_samples: dict[str, list[float]] = {label: [] for label in host_steps}
        for _ in range(3 * args.repeat):
            for label, run in host_steps.items():
                host_samples[label].append(host_interval(run))
        for label in host_steps:
            lines.append(f"{name:<16} host {label:<42} {summary(host_samples[label])}")
        check("lean")
        source.close()
        target.close()
    print(
        f"row kernel shapes, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.repeat} rounds"
    )
    for line in lines:
        print(line)
    print("all bytes verified" if failures == 0 else f"{failures} WRONG")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
