"""Results: what each contender measured on each case, summarized into the table, the JSON and
the plot the command writes."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvray.bench.verify import Verdict
from kvray.bench.workload import Workload

#: GB/s figures use GB = 1e9 bytes.
GB = 1e9


@dataclass
class CaseResult:
    """One contender on one case: its timed runs and the verdict of every run."""

    contender: str
    #: The contender family (the module that measured it): memcpy, kvray, ray, nixl.
    family: str
    case: str
    nbytes: int
    #: Seconds of each timed run (warm-up runs are not here).
    seconds: list[float] = field(default_factory=list)
    #: One verdict per run, warm-up runs included.
    verdicts: list[Verdict] = field(default_factory=list)
    #: Where the clock ran.
    timed: str = ""
    #: Facts a reader may want (ops, the push time on the sending side, ...).
    facts: dict[str, Any] = field(default_factory=dict)
    #: Set when the contender raised: the run is FAILED, like a wrong byte.
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.seconds) and all(v.ok for v in self.verdicts)

    @property
    def failure(self) -> str | None:
        if self.error is not None:
            return self.error
        for run, verdict in enumerate(self.verdicts):
            if not verdict.ok:
                return f"run {run}: {verdict.detail}"
        if not self.seconds:
            return "no timed run"
        return None

    def gb_per_s(self) -> tuple[float, float, float]:
        """(median, slowest, fastest) GB/s over the timed runs."""
        if not self.seconds:
            return (0.0, 0.0, 0.0)
        median = statistics.median(self.seconds)
        return (
            self.nbytes / median / GB,
            self.nbytes / max(self.seconds) / GB,
            self.nbytes / min(self.seconds) / GB,
        )


@dataclass(frozen=True)
class Skipped:
    """A contender that could not run here, and the one-sentence reason."""

    family: str
    contenders: tuple[str, ...]
    reason: str


def describe(error: BaseException) -> str:
    """One line for a contender that raised (a Ray task error is described by its cause)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


BASELINE = "memcpy, 1 thread"


def summary_rows(results: Sequence[CaseResult], workload: Workload) -> list[dict[str, Any]]:
    """Table rows for one case: GB/s median, min, max and the ratio to one-thread memcpy."""
    baseline = next((r for r in results if r.contender == BASELINE and r.ok), None)
    baseline_median = statistics.median(baseline.seconds) if baseline else None
    rows = []
    for result in results:
        median_gb, min_gb, max_gb = result.gb_per_s()
        median_s = statistics.median(result.seconds) if result.seconds else None
        rows.append(
            {
                "case": workload.key,
                "contender": result.contender,
                "family": result.family,
                "status": "ok" if result.ok else "FAILED",
                "failure": result.failure,
                "timed": result.timed,
                "runs": len(result.seconds),
                "median_ms": median_s * 1e3 if median_s else None,
                "median_gb_s": median_gb,
                "min_gb_s": min_gb,
                "max_gb_s": max_gb,
                "vs_memcpy": baseline_median / median_s if baseline_median and median_s else None,
                "seconds": result.seconds,
                "verified_runs": sum(1 for v in result.verdicts if v.ok),
                "checked_runs": len(result.verdicts),
                "facts": result.facts,
            }
        )
    return rows


def format_case(rows: Sequence[dict[str, Any]], workload: Workload, warmup: int, repeat: int) -> str:
    lines = [
        f"\n({workload.family}) {workload.title}: {workload.nbytes / 2**20:.1f} MiB, "
        f"{workload.descriptors} block copies, {warmup} warm-up + {repeat} timed runs",
    ]
    # Each figure's header names its unit: time and throughput sit side by side, and the
    # throughput's min and max are of GB/s (the fastest run is the max), not of milliseconds.
    header = (
        f"  {'contender':<46}  {'median ms':>9}  {'median GB/s':>11}  {'min GB/s':>8}  {'max GB/s':>8}  "
        f"{'vs memcpy':>9}  verified"
    )
    lines += [header, "  " + "-" * (len(header) - 2)]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"  {row['contender']:<46}  FAILED: {row['failure']}")
            continue
        ratio = f"{row['vs_memcpy']:.2f}x" if row["vs_memcpy"] is not None else "-"
        lines.append(
            f"  {row['contender']:<46}  {row['median_ms']:>9.2f}  {row['median_gb_s']:>11.2f}  "
            f"{row['min_gb_s']:>8.2f}  {row['max_gb_s']:>8.2f}  {ratio:>9}  "
            f"{row['verified_runs']}/{row['checked_runs']} runs"
        )
    return "\n".join(lines)


def plot(path: str, rows: Sequence[dict[str, Any]], workloads: Sequence[Workload], title: str) -> str | None:
    """GB/s against block size per contender (workloads a and c); None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvray[bench]')"
    sizes = {w.key: w.block_nbytes for w in workloads if w.family in ("a", "c")}
    by_contender: dict[str, list[tuple[int, float, float, float]]] = {}
    for row in rows:
        if row["case"] in sizes and row["status"] == "ok":
            by_contender.setdefault(row["contender"], []).append(
                (sizes[row["case"]], row["median_gb_s"], row["min_gb_s"], row["max_gb_s"])
            )
    if not by_contender:
        return "no contender finished a sweep case"
    figure, axes = plt.subplots(figsize=(11, 5.5))
    for contender, points in by_contender.items():
        points.sort()
        x = [p[0] / 1024 for p in points]
        y = [p[1] for p in points]
        low = [p[1] - p[2] for p in points]
        high = [p[3] - p[1] for p in points]
        style = "-" if contender.startswith("kvray") else "--" if contender.startswith("memcpy") else ":"
        axes.errorbar(x, y, yerr=[low, high], label=contender, linestyle=style, marker="o", capsize=3)
    axes.set_xscale("log", base=2)
    ticks = sorted({size / 1024 for size in sizes.values()})
    axes.set_xticks(ticks, [f"{tick:g}" for tick in ticks])
    axes.set_yscale("log")
    axes.set_xlabel("block size (KiB)")
    axes.set_ylabel("GB/s (median, bars: min-max)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None
