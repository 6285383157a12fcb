"""GPU transfer benchmark: kvray's planner + cuda_ipc transport between two processes, one per
GPU (or both on one GPU), against the NVLink copy ceiling, one copy per block, and NCCL
send/recv of a gathered buffer. Runs without Ray (the GPU machine has none).

    python benchmarks/bench_gpu.py [--repeat 10] [--quick] [--same-gpu] [--json gpu.json]
                                 [--workload 4k ...] [--kvray-only]

Workloads: DeepSeek-V3-style requests (61 MLA layers + indexer, block 64, scattered block ids
out of a pool twice the request) of 4k and 16k tokens, and 4096 scattered 64 KiB blocks.
Contenders, each timed from a synchronized start to its bytes being in the decode GPU's memory:
- `ceiling`: one device-to-device copy of the same number of bytes between two plain
  allocations on the two GPUs (peer-to-peer over NVLink), or within the GPU;
- `before`: the op-table path every request took before the row kernel: the plan expanded and
  merged into one op per run on the host, the whole table uploaded, one kernel over it (one
  request, and a stream of 16 at most 4 in flight); and the row kernel launched through Triton
  with the ids uploaded per request, as before captured row copies (`replay_graphs=False`);
- `kvray cuda_ipc`: plan (offsets cached, as in steady state; the request's rows and block ids,
  checked) + the transport's write (checks, the block ids written into a captured row copy's
  pinned buffer and that CUDA graph replayed: the ids' upload and one kernel on the decode GPU
  that expands the rows into ops and reads the source over NVLink; event wait); also the write of
  an already planned request, 4 requests in flight at once (a burst: one pipeline fill and drain
  per 4), a stream of 16 requests at most 4 in flight (a decode engine's steady intake: per
  request, what a serving node sustains), the copy kernel queued 10 times back to back (the
  GPU-side rate), and the staged path used without peer access (gather kernel, one copy,
  scatter kernel);
- `kvray cuda_ipc, checked`: the same write with the copy hashing what it moves (`kvray.content`,
  placement and content digests, at the defaults), compared with the writer's reference taken
  once before (as `hold_digests` takes it when the KV is produced), one request and the stream;
  and with the reference hashed from the source on the GPU before every write;
- `naive`: one `copy_` per op of the same plan;
- `nccl`: gather into one buffer, `send`, `recv` on the decode process, scatter, ack.
The decode buffer is scrubbed before every run; after each contender's runs the decode process
compares every written op with the prefill's bytes (opened through IPC): a wrong byte fails.
"""

# The closures timed below are called inside the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kvray.config import Settings
from kvray.content import Stretches, stretch_rows
from kvray.layout import Geometry, KVLayout, LayerSpec, deepseek_v3
from kvray.memory import Backing, MemoryKind
from kvray.placement import Stored
from kvray.plan import OffsetCache, TransferPlan, plan_transfer
from kvray.transport import Peer
from kvray.transport.cuda_ipc import CudaIpcTransport, copy_ops, launch_copy
from kvray.wire import Role, decode_engine_info, encode

NCCL_PORT = 29533
#: Requests pushed concurrently in the burst and stream rows (planning overlaps the copies).
IN_FLIGHT = 4
#: Requests in the stream row: a decode engine's steady intake, at most IN_FLIGHT at a time, so
#: the pipeline's fill (the first request's host work) and drain count once per STREAM requests.
STREAM = 16
#: Copies queued back to back without waiting: the GPU-side rate of the transport's kernel.
BACK_TO_BACK = 10


def workloads(quick: bool) -> dict[str, tuple[KVLayout, int]]:
    """name -> (layout, blocks per request)."""
    scattered = KVLayout(
        layers=(
            LayerSpec(name="blocks", geometry=Geometry(block_size=64, entry_shape=(1024,), dtype="uint8")),
        ),
        num_blocks=8192,
    )
    if quick:
        return {"deepseek-v3 1k tokens": (deepseek_v3(32), 16)}
    return {
        "deepseek-v3 4k tokens": (deepseek_v3(128), 64),
        "deepseek-v3 16k tokens": (deepseek_v3(512), 256),
        "4096 x 64 KiB scattered": (scattered, 4096),
    }


# ---- the decode process ----------------------------------------------------------------------


def decode_main(conn: Connection, device: int, nccl: bool) -> None:
    torch.cuda.set_device(device)
    transport = CudaIpcTransport(Settings())
    group = None
    if nccl:
        import torch.distributed as dist

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{NCCL_PORT}", rank=1, world_size=2)
        group = dist
    backing: Backing | None = None
    source_peer: Peer | None = None
    while True:
        message = conn.recv()
        command = message[0]
        if command == "layout":
            if backing is not None:
                backing.close()
            backing = Backing.allocate(message[1], MemoryKind.CUDA, device=f"cuda:{device}")
            info = backing.engine_info(
                "decode",
                message[2],
                Role.DECODE,
                "node",
                transport.register(backing, "decode", message[2], remote_writable=True),
            )
            conn.send(encode(info))
        elif command == "source":
            source_peer = Peer(decode_engine_info(message[1]))
            conn.send("ok")
        elif command == "verify":
            _, remote_offsets, local_offsets, nbytes = message
            assert backing is not None and source_peer is not None
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
            target = backing.regions[0].tensor
            source = transport._open(source_peer, 0).region.to(target.device)
            bad = sum(
                not torch.equal(target[ro : ro + n], source[lo : lo + n])
                for ro, lo, n in zip(
                    remote_offsets.tolist(), local_offsets.tolist(), nbytes.tolist(), strict=True
                )
            )
            conn.send(bad)
        elif command == "nccl":
            _, count, remote_offsets, nbytes, repeat = message
            assert backing is not None and group is not None
            target = backing.regions[0].tensor
            staging = torch.empty(count, dtype=torch.uint8, device=f"cuda:{device}")
            staged_offsets = np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
            ack = torch.ones(1, device=f"cuda:{device}")
            for _ in range(repeat):
                group.recv(staging, src=0)
                launch_copy(target, staging, remote_offsets, staged_offsets, nbytes)
                torch.cuda.synchronize()
                group.send(ack, dst=0)
        elif command == "stop":
            break
    conn.send("bye")


# ---- the prefill process (this one) ----------------------------------------------------------


def sync_all() -> None:
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)


def timed(run: Callable[[], None], scrub: Callable[[], None], repeat: int, warmup: int = 2) -> list[float]:
    samples = []
    for index in range(warmup + repeat):
        scrub()
        sync_all()
        start = time.perf_counter()
        run()
        sync_all()
        if index >= warmup:
            samples.append(time.perf_counter() - start)
    return samples


def host_breakdown(
    transport: CudaIpcTransport,
    local: Any,
    remote: Any,
    local_blocks: Any,
    remote_blocks: Any,
    cache: OffsetCache,
    source: Backing,
    peer: Peer,
    loop: asyncio.AbstractEventLoop,
    repeat: int = 50,
) -> dict[str, float]:
    """Median host milliseconds of each step of one request on the row path: planning, the
    checks, the launch (ids upload included), and the whole write with its wait; and the op
    table's expansion and merge that the row path no longer does."""
    from kvray.transport.base import check_write
    from kvray.transport.cuda_ipc import copy_rows

    samples: dict[str, list[float]] = {}

    def note(step: str, started: float) -> float:
        now = time.perf_counter()
        samples.setdefault(step, []).append((now - started) * 1e3)
        return now

    for _ in range(repeat):
        sync_all()
        started = time.perf_counter()
        plan = plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
        started = note("plan", started)
        check_write(plan, source, peer)
        started = note("check", started)
        rows = plan.rows
        assert rows is not None
        direct = transport._direct_rows(rows, source, peer)
        assert direct is not None
        src, opened, table = direct
        started = note("open+table", started)
        copy_rows(opened.region, src, rows, table)
        started = note("launch", started)
        sync_all()
        started = time.perf_counter()
        loop.run_until_complete(transport.write(plan, source, peer))
        note("write", started)
        sync_all()
        started = time.perf_counter()
        _ = plan.ops
        note("op-table expand+merge (not done)", started)
    return {step: statistics.median(values) for step, values in samples.items()}


def bench(args: argparse.Namespace, decode_device: int) -> list[dict[str, Any]]:
    torch.cuda.set_device(0)
    use_nccl = decode_device != 0 and not args.no_nccl
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=decode_main, args=(child, decode_device, use_nccl))
    process.start()
    dist: Any = None
    if use_nccl:
        import torch.distributed as dist

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{NCCL_PORT}", rank=0, world_size=2)
    transport = CudaIpcTransport(Settings())
    # The row path as it was before captured copies: the ids uploaded and the kernel launched
    # through Triton for every request.
    launching = CudaIpcTransport(Settings(), replay_graphs=False)
    loop = asyncio.new_event_loop()
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    chosen = {
        name: workload
        for name, workload in workloads(args.quick).items()
        if not args.workload or any(part in name for part in args.workload)
    }
    for incarnation, (name, (layout, request_blocks)) in enumerate(chosen.items(), start=1):
        conn.send(("layout", layout, incarnation))
        remote = decode_engine_info(conn.recv())
        source = Backing.allocate(layout, MemoryKind.CUDA, device="cuda:0")
        generator = torch.Generator(device="cuda:0").manual_seed(incarnation)
        source.regions[0].tensor.copy_(
            torch.randint(
                0, 256, (source.regions[0].nbytes,), dtype=torch.uint8, device="cuda:0", generator=generator
            )
        )
        # A new incarnation per workload, so the decode process opens this source, not the last one.
        local = source.engine_info(
            "prefill",
            incarnation,
            Role.PREFILL,
            "node",
            transport.register(source, "prefill", incarnation, remote_writable=True),  # for verification
        )
        conn.send(("source", encode(local)))
        conn.recv()
        peer = Peer(remote)
        local_blocks = rng.permutation(layout.num_blocks)[:request_blocks]
        remote_blocks = rng.permutation(layout.num_blocks)[:request_blocks]
        cache = OffsetCache()
        plan = plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
        ops = plan.ops
        total = ops.total_nbytes
        target = transport._open(peer, 0).region
        src = source.regions[0].tensor

        def scrub() -> None:
            target.fill_(0xA5)

        def verify(label: str) -> int:
            conn.send(("verify", ops.remote_offset, ops.local_offset, ops.nbytes))
            bad = int(conn.recv())
            if bad:
                print(
                    f"VERIFICATION FAILED: {name} / {label}: {bad} of {len(ops)} ops differ", file=sys.stderr
                )
            return bad

        def kvray_write() -> None:
            fresh = plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
            loop.run_until_complete(transport.write(fresh, source, peer))

        def as_op_table(planned: TransferPlan) -> TransferPlan:
            """The plan as op tables expanded and merged on the host (what every request paid
            before the row kernel): the transport uploads the whole table and copies by op."""
            return TransferPlan.from_ops(
                planned.src_engine,
                planned.src_incarnation,
                planned.dst_engine,
                planned.dst_incarnation,
                planned.layers,
                planned.ops,
                planned.unmerged,
                planned.layer_starts,
            )

        def op_table_write() -> None:
            fresh = as_op_table(plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache))
            loop.run_until_complete(transport.write(fresh, source, peer))

        async def one_op_table_request() -> None:
            fresh = as_op_table(plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache))
            await transport.write(fresh, source, peer)

        async def op_table_stream() -> None:
            gate = asyncio.Semaphore(IN_FLIGHT)

            async def admitted() -> None:
                async with gate:
                    await one_op_table_request()

            await asyncio.gather(*(admitted() for _ in range(STREAM)))

        def op_table_streamed() -> None:
            loop.run_until_complete(op_table_stream())

        def launched_write() -> None:
            fresh = plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
            loop.run_until_complete(launching.write(fresh, source, peer))

        async def launched_stream() -> None:
            gate = asyncio.Semaphore(IN_FLIGHT)

            async def admitted() -> None:
                async with gate:
                    fresh = plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
                    await launching.write(fresh, source, peer)

            await asyncio.gather(*(admitted() for _ in range(STREAM)))

        def launched_streamed() -> None:
            loop.run_until_complete(launched_stream())

        def kvray_transport() -> None:
            loop.run_until_complete(transport.write(plan, source, peer))

        # Checked: the copy hashes what it moves (`kvray.content`); the writer's reference is
        # taken apart (as `hold_digests` takes it, when the KV is produced), or, in the last
        # row, by hashing the source on the GPU before each write (`Transport.reference`).
        stretches = Stretches(
            stretch_rows(layout, source.placements, remote.layout, remote.placement, plan.layers),
            local_blocks,
            remote_blocks,
        )
        reference = loop.run_until_complete(transport.reference(stretches, source))
        digest_mismatches = [0]

        def compare(stored: Stored, expected: int) -> None:
            if stored.content != expected:
                digest_mismatches[0] += 1

        def checked_plan() -> TransferPlan:
            return replace(
                plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache), hashed=True
            )

        def checked_write() -> None:
            fresh = checked_plan()
            compare(loop.run_until_complete(transport.write(fresh, source, peer)), reference)

        async def one_checked_request() -> None:
            fresh = checked_plan()
            compare(await transport.write(fresh, source, peer), reference)

        async def checked_stream() -> None:
            gate = asyncio.Semaphore(IN_FLIGHT)

            async def admitted() -> None:
                async with gate:
                    await one_checked_request()

            await asyncio.gather(*(admitted() for _ in range(STREAM)))

        def kvray_checked_stream() -> None:
            loop.run_until_complete(checked_stream())

        async def referenced_request() -> None:
            expected = await transport.reference(stretches, source)
            fresh = checked_plan()
            compare(await transport.write(fresh, source, peer), expected)

        def kvray_referenced_write() -> None:
            loop.run_until_complete(referenced_request())

        async def one_request() -> None:
            fresh = plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
            await transport.write(fresh, source, peer)

        async def in_flight() -> None:
            await asyncio.gather(*(one_request() for _ in range(IN_FLIGHT)))

        def kvray_steady() -> None:
            loop.run_until_complete(in_flight())

        async def stream() -> None:
            gate = asyncio.Semaphore(IN_FLIGHT)

            async def admitted() -> None:
                async with gate:
                    await one_request()

            await asyncio.gather(*(admitted() for _ in range(STREAM)))

        def kvray_stream() -> None:
            loop.run_until_complete(stream())

        def kvray_back_to_back() -> None:
            for _ in range(BACK_TO_BACK):
                copy_ops(target, src, ops.remote_offset, ops.local_offset, ops.nbytes)

        def kvray_staged() -> None:
            copy_ops(target, src, ops.remote_offset, ops.local_offset, ops.nbytes, direct=False).synchronize()

        def naive() -> None:
            for ro, lo, n in zip(
                ops.remote_offset.tolist(), ops.local_offset.tolist(), ops.nbytes.tolist(), strict=True
            ):
                target[ro : ro + n].copy_(src[lo : lo + n], non_blocking=True)

        # The ceiling: one copy of the same bytes between two plain allocations on the two GPUs
        # (peer-to-peer over NVLink; on one GPU, a device-local copy).
        plain = torch.empty(total, dtype=torch.uint8, device=target.device)

        def ceiling() -> None:
            plain.copy_(src[:total], non_blocking=True)

        results: dict[str, tuple[list[float], int]] = {}
        results["ceiling: one D2D copy"] = (timed(ceiling, scrub, args.repeat), 0)
        ceiling_bad = 0 if torch.equal(plain, src[:total].to(plain.device)) else 1
        results["ceiling: one D2D copy"] = (results["ceiling: one D2D copy"][0], ceiling_bad)
        plan_samples = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
            plan_samples.append(time.perf_counter() - start)
        contenders: tuple[tuple[str, Callable[[], None], int], ...] = (
            ("before: op-table plan + write", op_table_write, 1),
            (f"before: op-table stream of {STREAM}", op_table_streamed, STREAM),
            ("before: rows, launched: plan + write", launched_write, 1),
            (f"before: rows, launched: stream of {STREAM}", launched_streamed, STREAM),
            ("kvray cuda_ipc: plan + write", kvray_write, 1),
            ("kvray cuda_ipc: write (planned)", kvray_transport, 1),
            ("kvray cuda_ipc, checked: plan + write", checked_write, 1),
            (f"kvray cuda_ipc, checked: stream of {STREAM}", kvray_checked_stream, STREAM),
            ("kvray cuda_ipc, checked, reference hashed per write", kvray_referenced_write, 1),
            (f"kvray cuda_ipc: {IN_FLIGHT} requests in flight", kvray_steady, IN_FLIGHT),
            (f"kvray cuda_ipc: stream of {STREAM}, {IN_FLIGHT} in flight", kvray_stream, STREAM),
            (f"kvray copy kernel, {BACK_TO_BACK} queued", kvray_back_to_back, BACK_TO_BACK),
            ("kvray kernels, staged (no peer reads)", kvray_staged, 1),
        )
        for label, run, per_run in contenders:
            if args.kvray_only and not label.startswith("kvray cuda_ipc"):
                continue
            digest_mismatches[0] = 0
            samples = [sample / per_run for sample in timed(run, scrub, args.repeat)]
            results[label] = (samples, verify(label) + digest_mismatches[0])
            if digest_mismatches[0]:
                print(f"DIGEST MISMATCH: {name} / {label}: {digest_mismatches[0]} writes", file=sys.stderr)
        if not args.kvray_only:
            naive_repeat = max(2, args.repeat // 4)
            results["naive: one copy per op"] = (timed(naive, scrub, naive_repeat, warmup=1), verify("naive"))
        if use_nccl and not args.kvray_only:
            staging = torch.empty(total, dtype=torch.uint8, device="cuda:0")
            staged = np.concatenate(([0], np.cumsum(ops.nbytes)[:-1])).astype(np.int64)
            ack = torch.zeros(1, device="cuda:0")
            nccl_repeat = args.repeat + 2
            conn.send(("nccl", total, ops.remote_offset, ops.nbytes, nccl_repeat))

            def nccl() -> None:
                launch_copy(staging, src, staged, ops.local_offset, ops.nbytes)
                dist.send(staging, dst=1)
                dist.recv(ack, src=1)

            results["nccl send/recv (gather + scatter)"] = (
                timed(nccl, scrub, args.repeat, warmup=2),
                verify("nccl"),
            )
        breakdown = host_breakdown(
            transport, local, remote, local_blocks, remote_blocks, cache, source, peer, loop
        )
        ceiling_median = statistics.median(results["ceiling: one D2D copy"][0])
        print(
            f"{name} ({'same GPU' if decode_device == 0 else '2 GPUs'}): planning alone "
            f"median {statistics.median(plan_samples) * 1e3:.3f} ms for {len(ops)} ops; host work per "
            f"request (median ms): {', '.join(f'{step} {ms:.3f}' for step, ms in breakdown.items())}",
            flush=True,
        )
        for contender, (samples, bad) in results.items():
            median = statistics.median(samples)
            rows.append(
                {
                    "workload": name,
                    "contender": contender,
                    "bytes": total,
                    "ops": len(ops),
                    "unmerged_ops": len(plan.unmerged),
                    "median_ms": median * 1e3,
                    "min_ms": min(samples) * 1e3,
                    "max_ms": max(samples) * 1e3,
                    "gb_per_s": total / median / 1e9,
                    "vs_ceiling": ceiling_median / median,
                    "verified": bad == 0,
                    "bad_ops": bad,
                    "same_gpu": decode_device == 0,
                }
            )
        source.close()
    loop.close()
    conn.send(("stop",))
    conn.recv()
    process.join(60)
    if use_nccl:
        dist.destroy_process_group()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--same-gpu", action="store_true", help="only prefill and decode on one GPU")
    parser.add_argument("--no-nccl", action="store_true")
    parser.add_argument(
        "--workload", action="append", help="only the workloads whose name contains this (repeatable)"
    )
    parser.add_argument(
        "--kvray-only", action="store_true", help="only the ceiling and kvray's own rows (no baselines)"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    setups = [0] if args.same_gpu or gpus < 2 else [1, 0]
    rows: list[dict[str, Any]] = []
    for decode_device in setups:
        rows += bench(args, decode_device)
    print(
        f"kvray GPU transfer benchmark: {torch.cuda.get_device_name(0)} x {gpus}, torch {torch.__version__}, "
        f"{args.repeat} timed runs after warm-up; GB = 1e9 bytes"
    )
    print(
        f"{'setup':<9} {'workload':<24} {'contender':<34} {'MiB':>7} {'ops':>6} {'median ms':>10} "
        f"{'median GB/s':>11} {'min GB/s':>8} {'max GB/s':>8} {'vs ceiling':>10} ok"
    )
    for r in rows:
        low, high = r["bytes"] / r["max_ms"] / 1e6, r["bytes"] / r["min_ms"] / 1e6
        print(
            f"{'same GPU' if r['same_gpu'] else '2 GPUs':<9} {r['workload']:<24} {r['contender']:<34} "
            f"{r['bytes'] / 2**20:>7.1f} {r['ops']:>6} {r['median_ms']:>10.3f} {r['gb_per_s']:>11.1f} "
            f"{low:>8.1f} {high:>8.1f} {r['vs_ceiling']:>9.2f}x {'yes' if r['verified'] else 'NO'}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name(0),
                    "gpus": gpus,
                    "torch": torch.__version__,
                    "host": platform.node(),
                    "cpus": os.cpu_count(),
                    "rows": rows,
                },
                out,
                indent=2,
            )
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
