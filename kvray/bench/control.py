"""Control-plane figures: what a request costs before and after its bytes move.

Plan building (cold: a fresh offset cache validates both engines first; cached: the usual case,
per request), against a naive per-op Python planner measured in the same run; ops per request
before and after merging, in both block orders, for scattered and contiguous block ids. The
completion latency (last byte written -> the decode side's `wait_for_kv` returns) is measured
by the kvray contender (`kvray.bench.kvray_transports`), where the two processes are.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvray.bench.workload import deepseek_request
from kvray.layout import BlockOrder, Int64Array, KVLayout, align_up, ceil_div
from kvray.plan import OffsetCache, plan_transfer
from kvray.wire import EngineInfo, RegionDescriptor, Role, TransportKind


def engine_info(layout: KVLayout, engine_id: str, role: Role) -> EngineInfo:
    """An engine description with one region exactly the layout's size (no memory needed)."""
    length = align_up(layout.nbytes, 4096)
    region = RegionDescriptor(
        engine_id=engine_id,
        incarnation=1,
        transport=TransportKind.SHM,
        index=0,
        address=0,
        length=length,
        remote_writable=role is Role.DECODE,
    )
    return EngineInfo(
        engine_id=engine_id,
        incarnation=1,
        role=role,
        node_id="bench",
        layout=layout,
        regions=(region,),
        placements=layout.placements(),
    )


def naive_plan(
    local: EngineInfo, remote: EngineInfo, local_blocks: list[int], remote_blocks: list[int]
) -> int:
    """One Python tuple per (layer, part, block), bounds-checked, merged in a loop: the baseline."""
    ops: list[tuple[int, int, int]] = []
    for spec in local.layout.layers:
        lp, rp = local.placements[spec.name], remote.placements[spec.name]
        for part in range(lp.parts):
            for lb, rb in zip(local_blocks, remote_blocks, strict=True):
                lo, ro = lp.byte_offset(part, lb), rp.byte_offset(part, rb)
                if ro + rp.part_nbytes > remote.regions[0].length:
                    raise ValueError("op out of bounds")
                ops.append((lo, ro, lp.part_nbytes))
    ops.sort()
    merged = [ops[0]]
    for lo, ro, n in ops[1:]:
        plo, pro, pn = merged[-1]
        if lo == plo + pn and ro == pro + pn:
            merged[-1] = (plo, pro, pn + n)
        else:
            merged.append((lo, ro, n))
    return len(merged)


def _timed_us(fn: Callable[[], object], repeat: int) -> list[float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e6)
    return samples


def plan_cases(
    local: EngineInfo, remote: EngineInfo, local_blocks: Int64Array, remote_blocks: Int64Array, repeat: int
) -> dict[str, list[float]]:
    """Microseconds per run of planning one request three ways: the naive Python planner, cold
    (a fresh offset cache, so validating both engines' descriptions is part of the cost) and
    cached (the usual case, per request)."""
    cache = OffsetCache()
    plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
    local_list, remote_list = local_blocks.tolist(), remote_blocks.tolist()
    return {
        "naive Python planner": _timed_us(
            lambda: naive_plan(local, remote, local_list, remote_list), max(3, repeat // 5)
        ),
        "cold": _timed_us(
            lambda: plan_transfer(local, remote, local_blocks, remote_blocks, cache=OffsetCache()), repeat
        ),
        "cached": _timed_us(
            lambda: plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache), repeat
        ),
    }


def plan_figures(tokens: int, repeat: int) -> dict[str, Any]:
    """Plan build times and op counts for a DeepSeek-V3 request of `tokens`, both block orders."""
    rows = []
    for order in BlockOrder:
        workload = deepseek_request(tokens, seed=2 + tokens, block_order=order)
        layout = workload.layout
        local, remote = (
            engine_info(layout, "prefill", Role.PREFILL),
            engine_info(layout, "decode", Role.DECODE),
        )
        src, dst = workload.src_ids(), workload.dst_ids()
        cache = OffsetCache()
        plan = plan_transfer(local, remote, src, dst, cache=cache)
        contiguous = plan_transfer(local, remote, np.arange(src.size), np.arange(src.size), cache=cache)
        cases = plan_cases(local, remote, src, dst, repeat)
        naive_median = statistics.median(cases["naive Python planner"])
        for case, samples in cases.items():
            median = statistics.median(samples)
            rows.append(
                {
                    "order": order.value,
                    "case": case,
                    "median_us": median,
                    "min_us": min(samples),
                    "max_us": max(samples),
                    "vs_naive": naive_median / median,
                }
            )
        ops = {
            "order": order.value,
            "unmerged": len(plan.unmerged),
            "merged_scattered": len(plan.ops),
            "merged_contiguous": len(contiguous.ops),
        }
        rows.append({"order": order.value, "case": "ops", **ops})
    return {
        "request": f"DeepSeek-V3, {tokens} tokens ({ceil_div(tokens, 64)} scattered blocks of 64, pool 1.5x)",
        "repeat": repeat,
        "rows": rows,
    }


def format_plan(figures: dict[str, Any]) -> str:
    lines = [f"\nplan building: {figures['request']}, {figures['repeat']} runs"]
    header = f"  {'order':<12}  {'case':<22}  {'median us':>9}  {'min us':>9}  {'max us':>9}  {'vs naive':>9}"
    lines += [header, "  " + "-" * (len(header) - 2)]
    for row in figures["rows"]:
        if row["case"] == "ops":
            continue
        lines.append(
            f"  {row['order']:<12}  {row['case']:<22}  {row['median_us']:>9.0f}  {row['min_us']:>9.0f}  "
            f"{row['max_us']:>9.0f}  {row['vs_naive']:>8.1f}x"
        )
    lines.append("ops per request (one per layer, part and block before merging):")
    for row in figures["rows"]:
        if row["case"] == "ops":
            lines.append(
                f"  {row['order']:<12} {row['unmerged']} -> {row['merged_scattered']} merged "
                f"(scattered ids), -> {row['merged_contiguous']} (contiguous ids)"
            )
    return "\n".join(lines)


def format_completion(latency: dict[str, list[float]]) -> str:
    lines = ["\ncompletion latency: writer's last byte written -> decode's wait_for_kv returns"]
    header = f"  {'path':<58}  {'p50 us':>8}  {'p90 us':>8}  {'min us':>8}  {'max us':>8}  {'runs':>5}"
    lines += [header, "  " + "-" * (len(header) - 2)]
    for path, samples in latency.items():
        if not samples:
            lines.append(f"  {path:<58}  no sample")
            continue
        microseconds = np.asarray(samples) * 1e6
        p50, p90 = np.percentile(microseconds, [50, 90])
        fastest, slowest = microseconds.min(), microseconds.max()
        lines.append(
            f"  {path:<58}  {p50:>8.0f}  {p90:>8.0f}  {fastest:>8.0f}  {slowest:>8.0f}  {len(samples):>5}"
        )
    return "\n".join(lines)
