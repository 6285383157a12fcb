"""The row kernel's shape on one GPU: GPU time of `kvray.transport.cuda_ipc`'s row kernel launched
with other shapes (elements per loop step, warps, bytes per program; block ids read from pinned
host memory instead of the GPU) and of kvray's captured row copy, against one plain copy of the
same bytes, for DeepSeek-V3 requests of 4k and 16k tokens; and the host time of the steps of
`copy_rows` against the same steps through the driver directly.

    python benchmarks/bench_gpu_rows.py [--repeat 100]

GPU times are CUDA-event intervals with the launch queued behind a GPU sleep (so the host's
launch time is not in them), variants interleaved round by round; medians with the 10th and
90th percentiles. Every variant's output is compared with kvray's launch's, from a
poisoned target. Prints one table.
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

# (label, BLOCK elements per loop step, warps, PIECE bytes per program); the first is kvray's.
SHAPES: list[tuple[str, int, int, int]] = [
    ("B4096 w16 P256K (kvray)", 4096, 16, cuda_ipc.MAX_PIECE_NBYTES),
    ("B4096 w8 P256K", 4096, 8, 256 * 1024),
    ("B2048 w16 P256K", 2048, 16, 256 * 1024),
    ("B2048 w8 P256K", 2048, 8, 256 * 1024),
    ("B2048 w4 P256K", 2048, 4, 256 * 1024),
    ("B1024 w8 P256K", 1024, 8, 256 * 1024),
    ("B1024 w4 P256K", 1024, 4, 256 * 1024),
    ("B4096 w16 P36K", 4096, 16, 36 * 1024),
    ("B1024 w8 P24K", 1024, 8, 24 * 1024),
    ("B1024 w4 P24K", 1024, 4, 24 * 1024),
    ("B2048 w8 P16K", 2048, 8, 16 * 1024),
    ("B1024 w8 P8K", 1024, 8, 8 * 1024),
    ("B1024 w4 P8K", 1024, 4, 8 * 1024),
    ("B512 w4 P4K", 512, 4, 4 * 1024),
]
#: The small-piece shape also timed reading its block ids from pinned host memory.
HOST_IDS_SHAPE = next(index for index, shape in enumerate(SHAPES) if shape[0] == "B1024 w4 P24K")


SLEEP_CYCLES = 400_000


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
    kernel = cuda_ipc.rows_kernel()
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

        unit = cuda_ipc.pick_unit(bases=(table.combined, dst.data_ptr(), src.data_ptr()))
        vec, unit = (2 if unit == 16 else 1), min(8, unit)
        view_src, view_dst = src.view(cuda_ipc.UNIT_DTYPES[unit]), dst.view(cuda_ipc.UNIT_DTYPES[unit])

        def launch(shape: tuple[str, int, int, int], id_table: torch.Tensor) -> None:
            _, block, warps, piece = shape
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
            contenders[f"{SHAPES[0][0]}, host ids"] = lambda: launch(SHAPES[0], host_ids)
            contenders[f"{SHAPES[HOST_IDS_SHAPE][0]}, host ids"] = lambda: launch(
                SHAPES[HOST_IDS_SHAPE], host_ids
            )
        except Exception as error:
            print(f"{name}: no host ids ({type(error).__name__}: {error})")
        # Captured copies: kvray's (ids fetch kernel + row kernel), the row kernel alone with ids on
        # the GPU, and the row kernel alone reading the pinned ids.
        capture_stream = torch.cuda.Stream()
        graphs: dict[str, torch.cuda.CUDAGraph] = {}
        for label, body in (
            ("graph: kvray (ids fetch + kernel)", None),
            ("graph: kernel, ids on GPU", lambda: launch(SHAPES[0], ids)),
            ("graph: kernel, host ids", lambda: launch(SHAPES[0], host_ids)),
            ("graph: kernel B1024 w4 P24K, host ids", lambda: launch(SHAPES[HOST_IDS_SHAPE], host_ids)),
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
        for checked in ("graph: kernel, host ids", "graph: kernel B1024 w4 P24K, host ids"):
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
