"""`kvray bench`: kvray's transfers against the alternatives a user would pick instead, measured
side by side in one run on one machine, every destination byte verified.

Workloads (`kvray.bench.workload`): (a) 64 MiB as 4096 scattered 16 KiB blocks; (b) a
DeepSeek-V3-style request (61 MLA layers + indexer) of 2k and 8k tokens; (c) a block-size sweep
from 4 KiB to 1 MiB at 64 MiB (its 16 KiB point is (a)). Contenders, each in its own module:

- `memcpy`: one-thread and all-thread memcpy in one process (the ceiling; one thread is the
  baseline of every ratio) and kvray's batched copy in-process;
- `kvray_transports`: kvray's shm and ray transports between two actors;
- `ray_baselines`: Ray's object store (numpy gather/scatter; and the bare payload as a
  reference) and Ray Direct Transport over gloo;
- `nixl_ucx`: NIXL's UCX back-end (WRITE + notification), where NIXL is installed.

Each run is preceded by a scrub of the destination and followed by a byte-for-byte check
(`kvray.bench.verify`); a wrong byte marks the row FAILED and the command exits 1. Medians,
min-max spread, GB/s and the ratio to one-thread memcpy go to a table on stdout, everything to a
JSON file, GB/s against block size to a PNG plot (matplotlib, optional). Control-plane figures
(`kvray.bench.control`): plan build time, ops before/after merging, completion latency.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
from typing import Any

import numpy as np

from kvray.bench import control
from kvray.bench.results import CaseResult, Skipped, format_case, plot, summary_rows
from kvray.bench.workload import MIB, Workload, workloads
from kvray.progress import Progress

FAMILIES = ("memcpy", "kvray", "ray-object-store", "rdt-gloo", "nixl", "control")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: small cases (8 MiB), 1 warm-up and 2 timed runs"
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed runs of workload (a) (default 15; larger cases fewer)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs before them (default 2)")
    parser.add_argument(
        "--only", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="contender families to run"
    )
    parser.add_argument(
        "--cases", nargs="+", metavar="KEY", help="run only these cases (a, b-2k, c-4KiB, ...)"
    )
    parser.add_argument("--json", default="kvray-bench.json", metavar="PATH", help="results for machines")
    parser.add_argument("--plot", default="kvray-bench.png", metavar="PATH", help="GB/s vs block size (PNG)")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.02,
        metavar="SECONDS",
        help="quiet time before each run, so one contender's clean-up does not land in the next's timing",
    )
    parser.add_argument("--address", help="join this Ray cluster instead of starting a local one")


def repeats_for(cases: list[Workload], repeat: int) -> dict[str, int]:
    """Timed runs per case: `repeat` for 64 MiB and smaller, fewer for larger requests (at least 3)."""
    return {w.key: max(3, min(repeat, round(repeat * 64 * MIB / w.nbytes))) for w in cases}


def main(args: argparse.Namespace) -> int:
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeat = args.repeat if args.repeat is not None else (2 if args.quick else 15)
    if repeat < 1 or warmup < 0:
        print("kvray bench: --repeat must be at least 1 and --warmup at least 0", file=sys.stderr)
        return 2
    cases = workloads(args.quick)
    if args.cases:
        unknown = sorted(set(args.cases) - {w.key for w in cases})
        if unknown:
            print(f"kvray bench: unknown cases {unknown}; have {[w.key for w in cases]}", file=sys.stderr)
            return 2
        cases = [w for w in cases if w.key in args.cases]
    repeats = repeats_for(cases, repeat) if not args.quick else {w.key: repeat for w in cases}
    families = [f for f in FAMILIES if f in args.only]
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC)
    print(
        f"kvray bench: {len(cases)} cases x {len(families)} contender families, {warmup} warm-up + "
        f"{repeat} timed runs (fewer for large cases), {os.cpu_count()} CPUs, GB = 1e9 bytes"
    )

    plan: dict[str, Any] | None = None
    if "control" in families:
        plan = control.plan_figures(512 if args.quick else 8192, 5 if args.quick else 30)

    results, skipped, latency = _run_transfers(args, families, cases, warmup, repeats)

    rows: list[dict[str, Any]] = []
    for workload in cases:
        case_rows = summary_rows([r for r in results if r.case == workload.key], workload)
        rows += case_rows
        if case_rows:
            print(format_case(case_rows, workload, warmup, repeats[workload.key]))
    for skip in skipped:
        print(f"\nSKIPPED {', '.join(skip.contenders)}: {skip.reason}")
    if plan is not None:
        print(control.format_plan(plan))
    if latency:
        print(control.format_completion(latency))

    failures = [row for row in rows if row["status"] != "ok"]
    plot_skip = None
    if rows and args.plot:
        plot_skip = plot(
            args.plot,
            rows,
            cases,
            f"kvray bench, {started:%Y-%m-%d}, {os.cpu_count()} CPUs: scattered blocks, "
            f"{cases[0].nbytes // MIB} MiB per transfer",
        )
        print(f"\nplot: {args.plot}" if plot_skip is None else f"\nplot skipped: {plot_skip}")
    if args.json:
        document = {
            "benchmark": "kvray bench",
            "date": started.isoformat(timespec="seconds"),
            "quick": args.quick,
            "machine": _machine(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "gb": 1e9,
            "warmup": warmup,
            "repeats": repeats,
            "baseline": "memcpy, 1 thread",
            "cases": [_case_json(w) for w in cases],
            "results": rows,
            "skipped": [
                {"family": s.family, "contenders": list(s.contenders), "reason": s.reason} for s in skipped
            ],
            "plan": plan,
            "completion_latency_s": latency,
            "plot": args.plot if plot_skip is None else None,
            "plot_skipped": plot_skip,
            "failures": [
                {"case": r["case"], "contender": r["contender"], "failure": r["failure"]} for r in failures
            ],
        }
        with open(args.json, "w") as out:
            json.dump(document, out, indent=1)
        print(f"results: {args.json}")
    if failures:
        print(
            f"\nVERIFICATION FAILED: {len(failures)} rows: "
            + "; ".join(f"{r['contender']} on {r['case']}: {r['failure']}" for r in failures),
            file=sys.stderr,
        )
        print("RESULT: FAIL")
        return 1
    print("RESULT: PASS (every destination byte of every run verified)")
    return 0


def _run_transfers(
    args: argparse.Namespace, families: list[str], cases: list[Workload], warmup: int, repeats: dict[str, int]
) -> tuple[list[CaseResult], list[Skipped], dict[str, list[float]]]:
    import ray

    from kvray.bench.harness import Contender, run_cases
    from kvray.bench.kvray_transports import KvrayTransports
    from kvray.bench.memcpy import InProcessCopies
    from kvray.bench.nixl_ucx import NixlUcx
    from kvray.bench.ray_baselines import ObjectStore, RdtGloo

    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        # "local": a fresh cluster even where another one on this machine would be picked up.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    settle_s = 0.01 if args.quick else args.settle
    kvray_contender = KvrayTransports(completion_runs=5 if args.quick else 30)
    candidates: list[Contender] = [InProcessCopies(), kvray_contender, ObjectStore(), RdtGloo(), NixlUcx()]
    if "control" in families and "kvray" not in families:
        # Completion latency needs kvray's actors: run them on workload (a) only, untabled.
        families = [*families, "kvray"]
        cases_for_kvray_only = [w for w in cases if w.family == "a"]
    else:
        cases_for_kvray_only = None
    contenders: list[Contender] = []
    skipped: list[Skipped] = []
    results: list[CaseResult] = []
    try:
        for contender in candidates:
            if contender.family not in families:
                continue
            reason = contender.start()
            if reason is None:
                contenders.append(contender)
            else:
                skipped.append(Skipped(contender.family, contender.names, reason))
        if cases_for_kvray_only is not None:
            progress = Progress(sum(warmup + repeats[w.key] for w in cases_for_kvray_only) * 2)
            run_cases([kvray_contender], cases_for_kvray_only, warmup, repeats, progress, settle_s)
        else:
            turns = sum(len(c.names) for c in contenders)
            progress = Progress(sum(warmup + repeats[w.key] for w in cases) * turns)
            results = run_cases(contenders, cases, warmup, repeats, progress, settle_s)
        progress.close()
    finally:
        for contender in contenders:
            with contextlib.suppress(Exception):  # an actor already gone: nothing to release
                contender.close()
        ray.shutdown()
    return results, skipped, kvray_contender.latency


def _case_json(workload: Workload) -> dict[str, Any]:
    return {
        "key": workload.key,
        "family": workload.family,
        "title": workload.title,
        "nbytes": workload.nbytes,
        "blocks": workload.blocks,
        "block_nbytes": workload.block_nbytes,
        "segments": len(workload.segments),
        "block_copies": workload.descriptors,
        "pool_blocks": workload.layout.num_blocks,
        "block_order": workload.layout.block_order.value,
    }


def _machine() -> dict[str, Any]:
    import ray
    import torch

    import kvray
    from kvray.config import Settings
    from kvray.transport.cpu_copy import copy_threads, native

    try:
        from importlib.metadata import version

        nixl_version: str | None = version("nixl")
    except Exception:
        nixl_version = None
    return {
        "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "nixl": nixl_version,
        "kvray": kvray.__version__,
        "kvray_copy_threads": Settings.from_env().copy_threads or copy_threads(),
        "kvray_native_copy": native(),
    }
