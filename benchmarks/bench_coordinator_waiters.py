"""Coordinator wake-ups: how long one engine registration holds the coordinator's event loop while
N lookups wait for other engines, and whether re-registering one engine many times makes the
coordinator forget another engine's departure. Measured in-process (the `Coordinator` class on
this process's event loop, no Ray actor), for the coordinator of this working tree and, with
`--before REV`, the one of git revision REV, in the same run.

    python benchmarks/bench_coordinator_waiters.py [--waiters 0,1000,8000] [--repeat 20]
        [--before REV] [--flood 70000] [--out results.txt] [--json results.json]

`--before REV` loads `kvray/coordinator.py` as it is at REV (`git show`) as the baseline; leave it
out to measure the current coordinator alone. While the change is uncommitted, `--before HEAD`
is the coordinator before it; once committed, name the commit before it (`--before HEAD~1`).

Per N, each coordinator gets N lookups waiting (each for an engine id of its own, none of which
registers), then `--repeat` registrations of fresh engine ids, the two coordinators taking turns
(the order alternating), so a noisy moment of a shared machine hits both. Two times per
registration:

- `call`: the `register` call itself, until it returns;
- `settled`: until the event loop has run everything the registration scheduled (the lookups it
  woke checking and going back to waiting): what the actor's next call waits behind. This is the
  figure the ratio compares.

The departed check registers and deregisters a "victim" engine, then registers one other engine
`--flood` times with a fresh incarnation each time (each making the previous one depart), then
looks up the victim's incarnation with a 1 s deadline: it should be refused at once ("has
left"), not waited for.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import importlib.util
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

import kvray.coordinator as current_module
from kvray.bench.control import engine_info
from kvray.errors import UnknownEngineError
from kvray.layout import llama_gqa
from kvray.wire import EngineInfo, Role, encode

ROOT = Path(__file__).resolve().parents[1]
#: Long enough that no waiting lookup times out during a run.
WAIT_S = 3600.0
#: The deadline of the departed check's lookup: a forgotten departure waits this long.
DEPARTED_LOOKUP_S = 1.0


def load_before(rev: str) -> ModuleType:
    """`kvray/coordinator.py` as it is at git revision `rev`, as module `kvray._coordinator_before`."""
    source = subprocess.check_output(["git", "show", f"{rev}:kvray/coordinator.py"], cwd=ROOT)
    name = "kvray._coordinator_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = f"{rev}:kvray/coordinator.py"
    sys.modules[name] = module  # dataclasses look their module up while the source runs
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def as_engine(info: EngineInfo, engine_id: str, incarnation: int) -> bytes:
    """`info` under another engine id and incarnation (its region with it), encoded."""
    regions = tuple(
        msgspec.structs.replace(region, engine_id=engine_id, incarnation=incarnation)
        for region in info.regions
    )
    return encode(
        msgspec.structs.replace(info, engine_id=engine_id, incarnation=incarnation, regions=regions)
    )


async def settled() -> None:
    """Return once the event loop has nothing else ready to run (timers and I/O aside).

    Reads asyncio's ready queue (`BaseEventLoop._ready`): a benchmark's look inside, not an API."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(0)
        if not loop._ready:  # type: ignore[attr-defined]
            return


async def with_waiters(module: ModuleType, count: int, tag: str) -> tuple[Any, list[asyncio.Future[Any]]]:
    """A coordinator of `module` with `count` lookups waiting, each for an absent engine of its own."""
    coordinator = module.Coordinator()
    waiting = [asyncio.ensure_future(coordinator.lookup(f"absent-{tag}-{n}", WAIT_S)) for n in range(count)]
    await settled()
    return coordinator, waiting


async def time_registration(coordinator: Any, info_bytes: bytes) -> tuple[float, float]:
    """(call ms, settled ms) of one registration."""
    secret = secrets.token_bytes(32)
    started = time.perf_counter()
    await coordinator.register(info_bytes, None, secret)
    returned = time.perf_counter()
    await settled()
    done = time.perf_counter()
    return (returned - started) * 1e3, (done - started) * 1e3


async def measure_waiters(
    modules: dict[str, ModuleType], info: EngineInfo, counts: list[int], repeat: int
) -> list[dict[str, Any]]:
    rows = []
    for count in counts:
        gc.collect()
        setups = {label: await with_waiters(module, count, label) for label, module in modules.items()}
        samples: dict[str, list[tuple[float, float]]] = {label: [] for label in modules}
        labels = list(modules)
        for turn in range(repeat):
            order = labels if turn % 2 == 0 else labels[::-1]
            for label in order:
                coordinator, _ = setups[label]
                info_bytes = as_engine(info, f"bench-{label}-{count}-{turn}", 1)
                samples[label].append(await time_registration(coordinator, info_bytes))
        for label in labels:
            _, waiting = setups[label]
            for lookup in waiting:
                lookup.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            assert not any(lookup.done() and not lookup.cancelled() for lookup in waiting)
            calls = [call for call, _ in samples[label]]
            settles = [settle for _, settle in samples[label]]
            rows.append(
                {
                    "coordinator": label,
                    "waiters": count,
                    "registrations": repeat,
                    "call_median_ms": statistics.median(calls),
                    "settled_median_ms": statistics.median(settles),
                    "settled_min_ms": min(settles),
                    "settled_max_ms": max(settles),
                }
            )
    return rows


async def check_departed(module: ModuleType, info: EngineInfo, flood: int) -> dict[str, Any]:
    """Re-register one engine `flood` times, then look up another engine's departed incarnation."""
    coordinator = module.Coordinator()
    victim_secret = secrets.token_bytes(32)
    await coordinator.register(as_engine(info, "victim", 7), None, victim_secret)
    assert await coordinator.deregister("victim", 7, victim_secret)
    flooder = secrets.token_bytes(32)
    started = time.perf_counter()
    for incarnation in range(1, flood + 1):
        await coordinator.register(as_engine(info, "flood", incarnation), None, flooder)
    flood_s = time.perf_counter() - started
    started = time.perf_counter()
    try:
        await coordinator.lookup("victim", DEPARTED_LOOKUP_S, 7)
        verdict = "FOUND (wrong: it deregistered)"
    except UnknownEngineError as error:
        verdict = "refused at once (has left)" if "has left" in str(error) else "FORGOTTEN (waited)"
    lookup_ms = (time.perf_counter() - started) * 1e3
    stats = await coordinator.stats()
    return {
        "flood": flood,
        "flood_s": flood_s,
        "victim_lookup": verdict,
        "victim_lookup_ms": lookup_ms,
        "departed_remembered": stats.get("departed"),
        "refused_at_once": verdict.startswith("refused"),
    }


def header(args: argparse.Namespace) -> list[str]:
    command = "python benchmarks/bench_coordinator_waiters.py " + " ".join(sys.argv[1:])
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "kvray/coordinator.py"], cwd=ROOT
    ).returncode
    tree = f"HEAD {head}" + (" + uncommitted kvray/coordinator.py" if dirty else "")
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return [
        command.strip(),
        f"{now}; {platform.machine()}, {os.cpu_count()} CPUs, load average {load}; Python "
        f"{platform.python_version()}; current = working tree ({tree})"
        + (f", before = git {args.before}" if args.before else ""),
    ]


def report(rows: list[dict[str, Any]], departed: dict[str, dict[str, Any]], repeat: int) -> list[str]:
    lines = [
        "",
        f"one register while N lookups wait for other engine ids, {repeat} registrations each, ms",
        f"{'waiters':>7}  {'coordinator':<11} {'call p50':>9} {'settled p50':>11} {'min':>9} {'max':>9}"
        f" {'before/current':>14}",
    ]
    by = {(row["waiters"], row["coordinator"]): row for row in rows}
    for row in rows:
        base = by.get((row["waiters"], "before"))
        ratio = ""
        if base is not None and row["coordinator"] == "current":
            ratio = f"{base['settled_median_ms'] / row['settled_median_ms']:.1f}x"
        lines.append(
            f"{row['waiters']:>7}  {row['coordinator']:<11} {row['call_median_ms']:>9.3f} "
            f"{row['settled_median_ms']:>11.3f} {row['settled_min_ms']:>9.3f} {row['settled_max_ms']:>9.3f} "
            f"{ratio:>14}"
        )
    lines += [
        "",
        "departed memory: one engine re-registered with fresh incarnations, then another's departed",
    ]
    lines.append(
        f"{'coordinator':<11} {'flood':>7} {'flood s':>8} {'lookup ms':>10} {'remembered':>10}  verdict"
    )
    for label, result in departed.items():
        remembered = "-" if result["departed_remembered"] is None else str(result["departed_remembered"])
        lines.append(
            f"{label:<11} {result['flood']:>7} {result['flood_s']:>8.1f} {result['victim_lookup_ms']:>10.1f} "
            f"{remembered:>10}  {result['victim_lookup']}"
        )
    return lines


async def run(args: argparse.Namespace) -> int:
    modules = {"current": current_module}
    if args.before:
        modules = {"before": load_before(args.before), **modules}
    info = engine_info(llama_gqa(64, num_layers=2), "bench", Role.PREFILL)
    counts = [int(count) for count in args.waiters.split(",")]
    lines = header(args)
    for line in lines:
        print(line)
    rows = await measure_waiters(modules, info, counts, args.repeat)
    departed = {label: await check_departed(module, info, args.flood) for label, module in modules.items()}
    body = report(rows, departed, args.repeat)
    for line in body:
        print(line)
    if args.out:
        Path(args.out).write_text("\n".join(lines + body) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"waiters": rows, "departed": departed}, indent=2) + "\n")
    return 0 if departed["current"]["refused_at_once"] else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", default="0,1000,8000", help="comma-separated counts of waiting lookups")
    parser.add_argument("--repeat", type=int, default=20, help="registrations timed per count")
    parser.add_argument("--before", metavar="REV", help="also measure kvray/coordinator.py at git REV")
    parser.add_argument("--flood", type=int, default=70_000, help="re-registrations of the departed check")
    parser.add_argument("--out", help="write the printed report here too")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
