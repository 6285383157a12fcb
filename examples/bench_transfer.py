"""Transfer benchmark: 64 MiB of KV as 4096 scattered 16 KiB blocks pushed from a prefill actor into
a decode actor on one node, over kvray's `shm` and `ray` transports, against one-thread memcpy.

    python examples/bench_transfer.py [--repeat 10] [--warmup 2] [--quick] [--json out.json]
                                      [--address ADDR]

Contenders, all measured in this one run:

- `torch memcpy, 1 thread` (the baseline every ratio is taken against): `dst.copy_(src)` of the
  whole payload between two pre-faulted tensors, `torch.set_num_threads(1)`, inside a Ray actor
  (a process of the same kind as the workers).
- `scatter_copy, 1 thread`: the same scattered block copy done in that actor with
  `kvray.transport._copy.scatter_copy` (the C batched copy the CPU transports use).
- `scatter_copy_async, N threads`: the same, through `scatter_copy_async`, i.e. the copy the shm
  transport runs, with its threads (`copy_threads()`), minus planning and the completion notice.
- per transport, `push (actor)`: `PushResult.seconds` from `PrefillWorker.push` (plan + write +
  completion notice, timed inside the prefill actor), and `push+wait (driver)`: wall time in the
  driver from submitting `DecodeWorker.wait` and `PrefillWorker.push` until both have returned.

Every push writes over a decode region scrubbed with a random pattern (outside the timing); after
the timed repeats the last request's decode blocks are read back and compared with the prefill
blocks, and any difference aborts with exit status 1. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
import torch

import kvray
from kvray.config import Settings
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.transport._copy import copy_threads, native, scatter_copy, scatter_copy_async
from kvray.wire import TransportKind
from kvray.workers import DecodeActor, PrefillActor

LAYER = "kv"
GEOMETRY = Geometry(block_size=16, entry_shape=(1024,), dtype="uint8")  # 16 KiB per block
DEADLINE_S = 30.0
PREFILL_SEED, DECODE_SEED, DATA_SEED = 1, 2, 3


@dataclass(frozen=True)
class Workload:
    blocks: int
    pool_blocks: int

    @property
    def block_nbytes(self) -> int:
        return GEOMETRY.block_nbytes

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_nbytes

    def layout(self) -> KVLayout:
        return KVLayout(layers=(LayerSpec(name=LAYER, geometry=GEOMETRY),), num_blocks=self.pool_blocks)


@dataclass(frozen=True)
class Contender:
    name: str
    #: Where the clock ran: "actor" (inside a Ray actor) or "driver" (this process).
    timed_in: str
    seconds: list[float]


class VerificationError(RuntimeError):
    """The decode blocks do not hold the prefill blocks' bytes."""


class ReferenceCopier:
    """Baselines in a Ray actor: one-thread memcpy and the scattered copy, on pre-faulted memory."""

    def __init__(self, pool_nbytes: int) -> None:
        torch.set_num_threads(1)
        # Pre-fault every page of both buffers, so the clock sees copies, not page faults.
        self.src = torch.randint(0, 256, (pool_nbytes,), dtype=torch.uint8)
        self.dst = torch.zeros(pool_nbytes, dtype=torch.uint8)

    def memcpy(self, nbytes: int, warmup: int, repeat: int) -> tuple[list[float], bool]:
        """Seconds per timed copy, and whether the last copy produced the right bytes."""
        src, dst = self.src[:nbytes], self.dst[:nbytes]
        samples: list[float] = []
        for run in range(warmup + repeat):
            started = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - started
            if run >= warmup:
                samples.append(elapsed)
        return samples, torch.equal(dst, src)

    def scatter(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        block_nbytes: int,
        warmup: int,
        repeat: int,
        threaded: bool,
    ) -> tuple[list[float], bool]:
        """Block i of src_blocks to block i of dst_blocks, ops sorted by source as a plan sorts them."""
        src_ids = np.asarray(src_blocks, dtype=np.int64)
        dst_ids = np.asarray(dst_blocks, dtype=np.int64)
        order = np.argsort(src_ids, kind="stable")
        src_offsets = src_ids[order] * block_nbytes
        dst_offsets = dst_ids[order] * block_nbytes
        nbytes = np.full(src_ids.size, block_nbytes, dtype=np.int64)
        src_base, dst_base = self.src.data_ptr(), self.dst.data_ptr()

        async def timed_async() -> list[float]:
            samples: list[float] = []
            for _ in range(warmup + repeat):
                started = time.perf_counter()
                await scatter_copy_async(dst_base, src_base, dst_offsets, src_offsets, nbytes)
                samples.append(time.perf_counter() - started)
            return samples[warmup:]

        if threaded:
            samples = asyncio.run(timed_async())
        else:
            samples = []
            for run in range(warmup + repeat):
                started = time.perf_counter()
                scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes)
                elapsed = time.perf_counter() - started
                if run >= warmup:
                    samples.append(elapsed)
        blocks_src = self.src.view(-1, block_nbytes)[torch.from_numpy(src_ids)]
        blocks_dst = self.dst.view(-1, block_nbytes)[torch.from_numpy(dst_ids)]
        return samples, torch.equal(blocks_src, blocks_dst)


ReferenceActor = ray.remote(ReferenceCopier)


def gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def compare_blocks(
    transport: str,
    prefill_bytes: npt.NDArray[np.uint8],
    decode_bytes: npt.NDArray[np.uint8],
    prefill_blocks: Sequence[int],
    decode_blocks: Sequence[int],
) -> None:
    """Raise unless decode block i holds exactly prefill block i's bytes, for every i."""
    count = len(prefill_blocks)
    expected = prefill_bytes.reshape(count, -1)
    actual = decode_bytes.reshape(count, -1)
    if expected.shape != actual.shape:
        raise VerificationError(
            f"{transport}: read {actual.shape} bytes from decode, {expected.shape} from prefill"
        )
    bad = np.flatnonzero((expected != actual).any(axis=1))
    if bad.size:
        at = int(bad[0])
        raise VerificationError(
            f"{transport}: {bad.size} of {count} blocks differ; first at request position {at} "
            f"(prefill block {prefill_blocks[at]} -> decode block {decode_blocks[at]})"
        )


@dataclass(frozen=True)
class TransportRun:
    pushed: Contender
    waited: Contender
    facts: dict[str, Any]
    prefill_blocks: list[int]
    decode_blocks: list[int]


def bench_transport(transport: TransportKind, workload: Workload, warmup: int, repeat: int) -> TransportRun:
    """Push one request's blocks warmup + repeat times, each into a fresh decode reservation."""
    settings = Settings(transport=transport.value)
    layout = workload.layout()
    prefill_id, decode_id = f"bench-prefill-{transport.value}", f"bench-decode-{transport.value}"
    prefill: Any = PrefillActor.remote(prefill_id, layout, settings, pool_seed=PREFILL_SEED)
    decode: Any = DecodeActor.remote(decode_id, layout, settings, pool_seed=DECODE_SEED)
    try:
        ray.get([prefill.start.remote(), decode.start.remote()])
        # One request id on both sides (the completion names it): the prefill side keeps its
        # blocks across pushes, the decode side reserves and releases them around each push.
        request = f"bench-{transport.value}"
        prefill_blocks: list[int] = ray.get(prefill.allocate.remote(request, workload.blocks))
        ray.get(prefill.fill_random.remote(request, DATA_SEED))
        actor_seconds: list[float] = []
        driver_seconds: list[float] = []
        ops = unmerged_ops = 0
        decode_blocks: list[int] = []
        for run in range(warmup + repeat):
            decode_blocks, incarnation = ray.get(decode.reserve.remote(request, workload.blocks))
            ray.get(decode.fill_region.remote(1000 + run))  # scrub: nothing stale can pass the check
            started = time.perf_counter()
            waited = decode.wait.remote(request, DEADLINE_S)
            pushed = prefill.push.remote(
                request, decode_id, decode_blocks, incarnation, timeout=DEADLINE_S, keep_blocks=True
            )
            result, completion = ray.get([pushed, waited])
            elapsed = time.perf_counter() - started
            if result.transport is not transport:
                raise RuntimeError(f"asked for {transport.value}, the push used {result.transport.value}")
            if result.nbytes != workload.nbytes or completion.nbytes != workload.nbytes:
                raise VerificationError(
                    f"{transport.value}: pushed {result.nbytes} bytes, decode saw {completion.nbytes}, "
                    f"expected {workload.nbytes}"
                )
            ops, unmerged_ops = result.ops, result.unmerged_ops
            if run >= warmup:
                actor_seconds.append(result.seconds)
                driver_seconds.append(elapsed)
            if run < warmup + repeat - 1:  # the last push's blocks are checked below
                ray.get(decode.release.remote(request))
        prefill_bytes = ray.get(prefill.read_blocks.remote(prefill_blocks, [LAYER]))[LAYER]
        decode_bytes = ray.get(decode.read_blocks.remote(decode_blocks, [LAYER]))[LAYER]
        compare_blocks(transport.value, prefill_bytes, decode_bytes, prefill_blocks, decode_blocks)
        ray.get([decode.release.remote(request), prefill.release.remote(request)])
        prefill_stats, decode_stats = ray.get([prefill.stats.remote(), decode.stats.remote()])
        for side, stats in (("prefill", prefill_stats), ("decode", decode_stats)):
            if stats["used_blocks"] or stats["requests"]:
                raise RuntimeError(f"{transport.value}: {side} still holds blocks after the run: {stats}")
        facts = {
            "ops_merged": ops,
            "ops_unmerged": unmerged_ops,
            "verified_blocks": len(decode_blocks),
            "pushes_ok": prefill_stats.get("pushes_ok", 0),
            "completions_ok": decode_stats.get("completions_ok", 0),
        }
        return TransportRun(
            Contender(f"kvray {transport.value}: push", "actor", actor_seconds),
            Contender(f"kvray {transport.value}: push+wait", "driver", driver_seconds),
            facts,
            prefill_blocks,
            decode_blocks,
        )
    finally:
        ray.get([prefill.close.remote(), decode.close.remote()])
        ray.kill(prefill)
        ray.kill(decode)


def bench_references(
    workload: Workload, src_blocks: list[int], dst_blocks: list[int], warmup: int, repeat: int
) -> list[Contender]:
    copier: Any = ReferenceActor.remote(workload.pool_blocks * workload.block_nbytes)
    calls = {
        "torch memcpy, 1 thread": copier.memcpy.remote(workload.nbytes, warmup, repeat),
        "scatter_copy, 1 thread": copier.scatter.remote(
            src_blocks, dst_blocks, workload.block_nbytes, warmup, repeat, False
        ),
        f"scatter_copy_async, {copy_threads()} threads": copier.scatter.remote(
            src_blocks, dst_blocks, workload.block_nbytes, warmup, repeat, True
        ),
    }
    contenders = []
    try:
        for name, call in calls.items():  # an actor runs its calls one at a time, in order
            samples, correct = ray.get(call)
            if not correct:
                raise VerificationError(f"reference {name!r} copied the wrong bytes")
            contenders.append(Contender(name, "actor", samples))
    finally:
        ray.kill(copier)
    return contenders


def summarize(contenders: list[Contender], nbytes: int) -> list[dict[str, Any]]:
    baseline = statistics.median(contenders[0].seconds)
    rows = []
    for contender in contenders:
        median = statistics.median(contender.seconds)
        rows.append(
            {
                **asdict(contender),
                "median_ms": median * 1e3,
                "median_gb_s": gb_per_s(nbytes, median),
                "min_gb_s": gb_per_s(nbytes, max(contender.seconds)),
                "max_gb_s": gb_per_s(nbytes, min(contender.seconds)),
                "vs_memcpy_1t": baseline / median,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], workload: Workload, warmup: int, repeat: int) -> None:
    print(
        f"\nkvray transfer: {workload.nbytes / 2**20:.1f} MiB as {workload.blocks} x "
        f"{workload.block_nbytes // 1024} KiB scattered blocks (pool {workload.pool_blocks}), "
        f"{warmup} warm-up + {repeat} timed runs, {os.cpu_count()} CPUs; GB/s with GB = 1e9 bytes"
    )
    header = (
        f"{'contender':<34} {'timed in':<8} {'median ms':>9} {'median':>7} {'min':>7} {'max':>7} "
        f"{'vs memcpy':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['name']:<34} {row['timed_in']:<8} {row['median_ms']:>9.2f} {row['median_gb_s']:>7.2f} "
            f"{row['min_gb_s']:>7.2f} {row['max_gb_s']:>7.2f} {row['vs_memcpy_1t']:>8.2f}x"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before them")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 MiB, 1 warm-up, 2 repeats")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--address", help="join this Ray cluster instead of starting one")
    args = parser.parse_args()
    workload = Workload(blocks=4096, pool_blocks=8192)
    warmup, repeat = args.warmup, args.repeat
    if args.quick:
        workload = Workload(blocks=512, pool_blocks=1024)
        warmup, repeat = 1, 2
    if repeat < 1 or warmup < 0:
        parser.error("--repeat must be at least 1 and --warmup at least 0")

    load_before = os.getloadavg()
    if args.address:
        ray.init(address=args.address)
    else:
        # "local": a fresh cluster even where another one on this machine would be picked up.
        ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        transports = {
            transport: bench_transport(transport, workload, warmup, repeat)
            for transport in (TransportKind.SHM, TransportKind.RAY)
        }
        # The references copy between the block ids of the shm run's last push.
        shm = transports[TransportKind.SHM]
        contenders = bench_references(workload, shm.prefill_blocks, shm.decode_blocks, warmup, repeat)
    except VerificationError as error:
        print(f"\nVERIFICATION FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    for run in transports.values():
        contenders += [run.pushed, run.waited]
    rows = summarize(contenders, workload.nbytes)
    print_table(rows, workload, warmup, repeat)
    print(
        f"memcpy and scatter_copy references timed inside a Ray actor; all {len(transports)} transports "
        f"verified byte for byte ({workload.blocks} blocks each); kvray C copy built: {native()}"
    )
    if args.json:
        results = {
            "benchmark": "bench_transfer",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
            "numpy": np.__version__,
            "kvray": kvray.__version__,
            "kvray_copy_threads": copy_threads(),
            "kvray_native_copy": native(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "workload": {
                "nbytes": workload.nbytes,
                "blocks": workload.blocks,
                "block_nbytes": workload.block_nbytes,
                "pool_blocks": workload.pool_blocks,
                "geometry": {
                    "block_size": GEOMETRY.block_size,
                    "entry_shape": GEOMETRY.entry_shape,
                    "dtype": GEOMETRY.dtype,
                },
            },
            "warmup": warmup,
            "repeat": repeat,
            "gb": 1e9,
            "baseline": contenders[0].name,
            "contenders": rows,
            "transports": {kind.value: run.facts for kind, run in transports.items()},
        }
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
