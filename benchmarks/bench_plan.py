"""Plan-building benchmark: a DeepSeek-V3-style request (61 MLA layers + indexer) of 128 scattered
blocks, planned cold (fresh offset cache: validation + tables) and cached, against a naive
per-op Python planner measured in the same run; op counts before/after merging in both orders.
The cases are `kvray bench`'s control-plane figures (`kvray.bench.control`), here over a pool
and a request size of your choice.

    python benchmarks/bench_plan.py [--pool 1024] [--blocks 128] [--repeat 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from kvray.bench.control import engine_info, plan_cases
from kvray.layout import BlockOrder, deepseek_v3
from kvray.plan import OffsetCache, plan_transfer
from kvray.wire import Role


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=1024, help="blocks per engine pool")
    parser.add_argument("--blocks", type=int, default=128, help="blocks per request")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    local_blocks = rng.permutation(args.pool)[: args.blocks].astype(np.int64)
    remote_blocks = rng.permutation(args.pool)[: args.blocks].astype(np.int64)
    results = []
    print(
        f"plan: deepseek-v3 (61 MLA + indexer), pool {args.pool} blocks, request {args.blocks} "
        f"scattered blocks, {args.repeat} runs; microseconds"
    )
    print(
        f"{'order':<12} {'case':<22} {'median us':>9} {'min us':>9} {'max us':>9} {'vs naive':>9} "
        f"{'ops':>6} {'merged':>6} {'contig':>6}"
    )
    for order in BlockOrder:
        layout = deepseek_v3(args.pool, order)
        local, remote = (
            engine_info(layout, "prefill", Role.PREFILL),
            engine_info(layout, "decode", Role.DECODE),
        )
        cache = OffsetCache()
        plan = plan_transfer(local, remote, local_blocks, remote_blocks, cache=cache)
        contiguous = plan_transfer(local, remote, np.arange(args.blocks), np.arange(args.blocks), cache=cache)
        cases = plan_cases(local, remote, local_blocks, remote_blocks, args.repeat)
        naive_median = statistics.median(cases["naive Python planner"])
        for case, samples in cases.items():
            median = statistics.median(samples)
            row = {
                "order": order.value,
                "case": case,
                "median_us": median,
                "min_us": min(samples),
                "max_us": max(samples),
                "speedup_vs_naive": naive_median / median,
                "ops_unmerged": len(plan.unmerged),
                "ops_merged": len(plan.ops),
                "ops_contiguous": len(contiguous.ops),
            }
            results.append(row)
            print(
                f"{order.value:<12} {case:<22} {median:>9.0f} {min(samples):>9.0f} {max(samples):>9.0f} "
                f"{naive_median / median:>8.1f}x {len(plan.unmerged):>6} {len(plan.ops):>6} "
                f"{len(contiguous.ops):>6}"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
