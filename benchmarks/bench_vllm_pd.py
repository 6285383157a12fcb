"""Benchmark: a prefill/decode pair of vLLM engines with `KvrayConnector` against a single engine,
for prompts of 128, 512 and 2048 tokens (random token ids, fresh for every run, so no prefix
cache helps either side). Per length, medians with min and max over the runs:

- KV transfer: the prefill engine's push (plan, write, notify) and the decode engine's wait,
  from sending its push request to the KV in its cache (the connector's transfer log);
- time to first token: a single engine's (one request, one token) against the pair's (the
  prefill engine's pass, then the decode engine's first token after the hand-off);
- decode first, layer by layer (`decode_first`): the decode engine takes the request first and
  asks; the prefill engine pushes each layer as its forward saves it. Its TTFT (from giving the
  decode engine the request, once it has asked, to its first token) and the tail: from the
  last layer's KV in the prefill's cache to the decode side told it may decode.

With `--integrity`, also what the integrity check costs (`Settings.integrity`, `kvray.content`):
a second prefill engine that checks nothing but placement (`integrity` off, no sampled
checksums) hands fresh prompts of each length to the same decode engine (which asks for no
check itself), interleaved with the checked pair's (every request checked, the default; no
sampled checksums either), and the push, the decode side's wait (which includes its check) and
the TTFT are set side by side. No run digests the KV (the
connector's digest log only times the hand-offs here): a digest would be timed with kvray.

    python benchmarks/bench_vllm_pd.py [--runs 5] [--lengths 128 512 2048] [--integrity] [--lane on|off]
                                       [--json PATH]

Needs the vllm extra (see the README's *vLLM* section).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray

from kvray.bench.handoff_log import DIGEST_LOG_CONNECTOR
from kvray.integrations.vllm.model import smollm2
from kvray.integrations.vllm.pd import Engine, decode_first, prefill_then_decode, transfer_config


def kv_bytes(tokens: int) -> int:
    """SmolLM2's KV for `tokens` as vLLM's CPU cache holds it: whole blocks of 128 tokens, 30
    layers, 3 KV heads of 64 values for K and V, float32."""
    blocks = -(-tokens // 128)
    return blocks * 128 * 30 * 3 * 64 * 2 * 4


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def records(log: Path, key: str = "seconds") -> dict[str, float]:
    found: dict[str, float] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record.get(key) is not None:
                found[record["prefill_request"]] = float(record[key])
    return found


def asked(log: Path, marks: list[float]) -> Callable[[list[str]], None]:
    """Wait until the prefill engine holds the decode engine's push request for every hand-off;
    then note the time in `marks`."""

    def wait(handoffs: list[str]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = log.read_text().splitlines() if log.exists() else []
            held = {json.loads(line)["request"] for line in lines if '"asked"' in line}
            if set(handoffs) <= held:
                marks.append(time.perf_counter())
                return
            time.sleep(0.002)
        raise TimeoutError("the decode engine did not ask within 60 s")

    return wait


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--integrity", action="store_true", help="also an unchecked prefill engine: the check's cost"
    )
    parser.add_argument(
        "--lane",
        choices=("on", "off"),
        default="on",
        help="routine hand-offs through the prefill engine's native lane (kvray's default) or not",
    )
    args = parser.parse_args()
    max_model_len = max(args.lengths) + 64
    model = str(smollm2())
    ray.init(include_dashboard=False, log_to_driver=False)
    logs = Path(tempfile.mkdtemp(prefix="kvray-vllm-bench-"))
    actor = ray.remote(num_cpus=0)(Engine)
    # The log gives each hand-off's times; no request's KV is digested (the digest runs on the
    # decode side's path to its first token, and would be timed with kvray).
    digests = {"digest_every": 10**9}
    common = {"integrity_sample_rate": 0.0, "native_lane": args.lane == "on"}
    prefill = actor.remote(
        model,
        transfer_config(
            {**digests, **common, "digest_log": str(logs / "p.jsonl")}, connector=DIGEST_LOG_CONNECTOR
        ),
        max_model_len=max_model_len,
    )
    # Each writer's setting decides whether its requests are checked: the decode engine asks none.
    decode = actor.remote(
        model,
        transfer_config(
            {**digests, **common, "integrity": False, "digest_log": str(logs / "d.jsonl")},
            connector=DIGEST_LOG_CONNECTOR,
        ),
        max_model_len=max_model_len,
    )
    single = actor.remote(model, None, max_model_len=max_model_len)
    engines = [prefill, decode, single]
    unchecked = None
    if args.integrity:
        config = {**digests, **common, "digest_log": str(logs / "p-unchecked.jsonl"), "integrity": False}
        unchecked = actor.remote(
            model, transfer_config(config, connector=DIGEST_LOG_CONNECTOR), max_model_len=max_model_len
        )
        engines.append(unchecked)
    ray.get([engine.processes.remote() for engine in engines])
    rng = np.random.default_rng(0)
    vocabulary = 49000  # inside SmolLM2's 49,152 tokens, clear of the special ones at the end

    results: dict[int, dict[str, Any]] = {}
    for length in args.lengths:
        single_ttft, pair_ttft, first_ttft, requests, layered = [], [], [], [], []
        off_ttft, off_requests = [], []
        for run in range(args.runs + 1):  # the first run of each length warms up, untimed
            prompt = rng.integers(0, vocabulary, length).tolist()
            began = time.perf_counter()
            ray.get(single.generate.remote([prompt], 1))
            alone = time.perf_counter() - began
            began = time.perf_counter()
            handoff = prefill_then_decode(prefill, decode, [prompt], 1)
            both = time.perf_counter() - began
            marks: list[float] = []
            # A prompt of its own: the engines' prefix caches hold the one above.
            other = rng.integers(0, vocabulary, length).tolist()
            first = decode_first(prefill, decode, [other], 1, before_prefill=asked(logs / "p.jsonl", marks))
            layerwise = time.perf_counter() - marks[-1]
            if unchecked is not None:
                began = time.perf_counter()
                plain = prefill_then_decode(
                    unchecked, decode, [rng.integers(0, vocabulary, length).tolist()], 1
                )
                if run:
                    off_ttft.append(time.perf_counter() - began)
                    off_requests.append((plain.prefill[0].kv_transfer_params or {})["kvray_prefill_request"])
            if run:
                single_ttft.append(alone)
                pair_ttft.append(both)
                first_ttft.append(layerwise)
                requests.append((handoff.prefill[0].kv_transfer_params or {})["kvray_prefill_request"])
                layered.append((first.prefill[0].kv_transfer_params or {})["kvray_prefill_request"])
        pushed, waited = records(logs / "p.jsonl"), records(logs / "d.jsonl")
        tails = records(logs / "p.jsonl", "tail_seconds")
        push_s = [pushed[request] for request in requests if request in pushed]
        wait_s = [waited[request] for request in requests if request in waited]
        tail_s = [tails[request] for request in layered if request in tails]
        results[length] = {
            "single_ttft_s": spread(single_ttft),
            "pd_ttft_s": spread(pair_ttft),
            "push_s": spread(push_s),
            "decode_wait_s": spread(wait_s),
            "ttft_ratio": statistics.median(pair_ttft) / statistics.median(single_ttft),
            "layerwise_ttft_s": spread(first_ttft),
            "layerwise_tail_s": spread(tail_s),
            "layerwise_requests": len(tail_s),
            "layerwise_ttft_ratio": statistics.median(first_ttft) / statistics.median(single_ttft),
        }
        if unchecked is not None:
            pushed_off = records(logs / "p-unchecked.jsonl")
            results[length]["unchecked"] = {
                "push_s": spread([pushed_off[r] for r in off_requests if r in pushed_off]),
                "decode_wait_s": spread([waited[r] for r in off_requests if r in waited]),
                "pd_ttft_s": spread(off_ttft),
            }
    failed = [
        line
        for log in (logs / "p.jsonl", logs / "d.jsonl")
        for line in (log.read_text().splitlines() if log.exists() else [])
        if '"error"' in line
    ]
    if failed:
        print(f"{len(failed)} hand-offs failed; the figures would not measure kvray:", *failed[:5], sep="\n")
        return 1
    print(f"vLLM P/D with kvray vs a single engine, {args.runs} runs per length (medians [min, max], ms)")
    keys = ("push_s", "decode_wait_s", "single_ttft_s", "pd_ttft_s", "layerwise_tail_s", "layerwise_ttft_s")
    titles = ("push (P)", "wait (D)", "TTFT single", "TTFT P/D", "layer-wise tail", "TTFT layer-wise")
    print(f"{'tokens':>6}  " + "  ".join(f"{title:>22}" for title in titles) + "  ratios")
    for length, row in results.items():
        cells = [
            f"{row[key]['median'] * 1e3:7.1f} [{row[key]['min'] * 1e3:5.1f}, {row[key]['max'] * 1e3:5.1f}]"
            for key in keys
        ]
        ratios = f"{row['ttft_ratio']:.2f}x {row['layerwise_ttft_ratio']:.2f}x"
        print(f"{length:>6}  " + "  ".join(f"{cell:>22}" for cell in cells) + f"  {ratios}")
    if unchecked is not None:
        print("\nthe integrity check's cost: one decode engine, checked vs unchecked prefill (medians, ms)")
        print(
            f"{'tokens':>6}  {'KV bytes':>9}  {'push on':>8} {'off':>7}  {'wait on':>8} {'off':>7}  "
            f"{'wait +':>10}  {'TTFT P/D on':>11} {'off':>7}"
        )
        for length, row in results.items():
            off = row["unchecked"]
            # The decode side's wait spans the whole transfer: its push request, the push, the
            # notice and (checked) its own hash.
            on_s, off_s = row["decode_wait_s"]["median"], off["decode_wait_s"]["median"]
            print(
                f"{length:>6}  {kv_bytes(length) / 2**20:7.1f}Mi  {row['push_s']['median'] * 1e3:8.1f} "
                f"{off['push_s']['median'] * 1e3:7.1f}  {row['decode_wait_s']['median'] * 1e3:8.1f} "
                f"{off['decode_wait_s']['median'] * 1e3:7.1f}  {(on_s / off_s - 1) * 100:+9.1f}%  "
                f"{row['pd_ttft_s']['median'] * 1e3:11.1f} {off['pd_ttft_s']['median'] * 1e3:7.1f}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": args.runs, "results": results}, indent=2))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
