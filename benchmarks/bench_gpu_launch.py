"""Where the host time of one cuda_ipc write goes, step by step, on one GPU (no IPC, no Ray):
events, the block-id upload, the row kernel's launch through Triton's JIT, through its compiled
handle and through a CUDA graph, the op-table kernel's launch, a torch copy's launch, the whole
`copy_rows` launched through Triton and replayed from its captured graph; and the GPU time of
the row kernel (across loop-step sizes and warp counts), the replayed copy, the op-table kernel
and one plain copy of the same bytes.

    python benchmarks/bench_gpu_launch.py [--repeat 200]

Host times are medians over `repeat` calls, each after a synchronize (so nothing queued ahead
delays it); GPU times are medians of CUDA-event intervals. Prints one table.
"""

# The closures timed below are called inside the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
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


def host_ms(run: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e3


def gpu_ms(run: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        run()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end))
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    rows_out: list[tuple[str, str, float]] = []
    rng = np.random.default_rng(0)
    for name, blocks, request in (("deepseek-v3 4k", 128, 64), ("deepseek-v3 16k", 512, 256)):
        layout = deepseek_v3(blocks)
        source = Backing.allocate(layout, MemoryKind.CUDA)
        target = Backing.allocate(layout, MemoryKind.CUDA)
        source.regions[0].tensor.random_(0, 256)
        target.regions[0].tensor.zero_()
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
        ops = plan.ops
        nbytes = ops.total_nbytes
        plain = torch.empty(nbytes, dtype=torch.uint8, device=device)
        count = int(rows.local_ids.size)
        ids = cuda_ipc.upload_table(device, np.array([count]), rows.local_ids, rows.remote_ids)
        op_table = cuda_ipc.upload_table(device, ops.local_offset, ops.remote_offset, ops.nbytes)
        unit = cuda_ipc.pick_unit(bases=(table.combined, dst.data_ptr(), src.data_ptr()))
        vec, unit = (2 if unit == 16 else 1), min(8, unit)
        kernel = cuda_ipc.rows_kernel()
        view_src, view_dst = src.view(cuda_ipc.UNIT_DTYPES[unit]), dst.view(cuda_ipc.UNIT_DTYPES[unit])
        grid = (count, table.num_rows, table.pieces)
        constants = {
            "SHIFT": unit.bit_length() - 1,
            "PIECE": cuda_ipc.MAX_PIECE_NBYTES,
            "BLOCK": 4096,
            "VEC": vec,
            "num_warps": 16,
        }
        kernel_args = (view_src, view_dst, table.table, ids, table.num_rows, count)

        def rows_jit() -> None:
            kernel[grid](*kernel_args, **constants)

        def ops_jit() -> None:
            cuda_ipc.copy_kernel()[(len(ops),)](
                view_src,
                view_dst,
                op_table,
                len(ops),
                SHIFT=unit.bit_length() - 1,
                BLOCK=2048,
                VEC=vec,
                num_warps=8,
            )

        def torch_copy() -> None:
            plain.copy_(src[:nbytes], non_blocking=True)

        def event_pair() -> None:
            event = torch.cuda.Event()
            event.record()
            torch.cuda.current_stream().wait_event(event)

        def upload() -> None:
            cuda_ipc.upload_table(device, np.array([count]), rows.local_ids, rows.remote_ids)

        def follow() -> None:
            cuda_ipc.follow_current(0, torch.cuda.current_stream())

        def full_copy_rows() -> None:
            cuda_ipc.copy_rows(dst, src, rows, table, replay=False)

        def replayed_copy_rows() -> None:
            cuda_ipc.copy_rows(dst, src, rows, table)

        rows_jit()
        ops_jit()
        measured: list[tuple[str, Callable[[], Any]]] = [
            ("host: event create+record+wait", event_pair),
            ("host: ids upload (pinned buffer, H2D)", upload),
            ("host: row kernel launch, Triton JIT", rows_jit),
            ("host: op kernel launch, Triton JIT", ops_jit),
            ("host: torch copy_ launch", torch_copy),
            ("host: follow_current (one kept event)", follow),
            ("host: copy_rows, Triton launch (upload, launch)", full_copy_rows),
            ("host: copy_rows, graph replay (ids, replay)", replayed_copy_rows),
        ]
        replayed_copy_rows()
        try:
            compiled = kernel.warmup(*kernel_args, grid=grid, **constants)

            def rows_compiled() -> None:
                compiled[grid](*kernel_args)

            rows_compiled()
            measured.append(("host: row kernel launch, compiled handle", rows_compiled))
        except Exception as error:  # the handle's call convention differs between Triton versions
            print(f"{name}: no compiled-handle launch ({type(error).__name__}: {error})")
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                rows_jit()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                rows_jit()
            measured.append(("host: row kernel as CUDA graph replay", graph.replay))
        except Exception as error:
            print(f"{name}: no graph ({type(error).__name__}: {error})")
        for label, run in measured:
            rows_out.append((name, label, host_ms(run, args.repeat)))
        for label, run in (
            ("gpu: row kernel", rows_jit),
            (
                "gpu: copy_rows, graph replay",
                lambda: torch.cuda.current_stream().wait_event(
                    cuda_ipc.copy_rows(dst, src, rows, table).done
                ),
            ),
            ("gpu: op-table kernel", ops_jit),
            ("gpu: one plain copy of the bytes", torch_copy),
        ):
            rows_out.append((name, label, gpu_ms(run, args.repeat)))
        # The row kernel's shape: bytes per loop step (BLOCK elements) and warps per program.
        for block, warps in ((2048, 8), (2048, 16), (4096, 8), (8192, 16), (8192, 32), (16384, 32)):
            shaped = {**constants, "BLOCK": block, "num_warps": warps}
            rows_out.append(
                (
                    name,
                    f"gpu: row kernel, BLOCK {block}, {warps} warps",
                    gpu_ms(lambda shaped=shaped: kernel[grid](*kernel_args, **shaped), args.repeat),
                )
            )
        landed = dst.clone()
        dst.zero_()
        rows_jit()
        torch.cuda.synchronize()
        by_ops = dst.clone()
        if not torch.equal(landed, by_ops):
            print(f"{name}: row kernel and op kernel wrote different bytes")
            return 1
        source.close()
        target.close()
    print(
        f"host-work breakdown, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"median of {args.repeat}"
    )
    for workload, label, value in rows_out:
        print(f"  {workload:<16} {label:<46} {value:8.4f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
