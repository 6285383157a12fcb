"""Benchmark: Ray Serve LLM's P/D application with kvray moving the KV, against a single-engine Serve
LLM deployment of the same model, over HTTP with streamed completions. Per concurrency (1, 4, 8
clients), the same prompts on both, each generating exactly `--new-tokens` (end of sequence
ignored): time to first token (TTFT) and inter-token latency (ITL, the gaps between streamed
tokens), p50 and p90 over the requests, and whether every P/D answer equals the single engine's
(greedy; a mismatch marks the row FAILED).

    python benchmarks/bench_serve_llm.py [--requests 16] [--new-tokens 32] [--json PATH]

Needs the vllm extra (see the README's *vLLM* section). Starts a local Ray of its own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app

from kvray.integrations.vllm.model import smollm2
from kvray.integrations.vllm.prompts import load_prompts
from kvray.integrations.vllm.serve_llm import build_pd_app, wait_until_serving

PORT = 8031


def single_app(model: str) -> Any:
    config = LLMConfig(
        model_loading_config={"model_id": "smollm2", "model_source": model},
        engine_kwargs={"dtype": "float32", "max_model_len": 2048, "enforce_eager": True},
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config={"num_replicas": 1},
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}},
    )
    return build_openai_app({"llm_configs": [config]})


def stream(url: str, prompt: str, new_tokens: int) -> dict[str, Any]:
    """One streamed completion: its text, TTFT and the gaps between later chunks (seconds)."""
    # ignore_eos: the instruct model ends some raw prompts at once; every request makes
    # `new_tokens`, so each has a first token and gaps to measure.
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0}
    body.update(stream=True, ignore_eos=True)
    started = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600.0) as reply:
        if reply.status_code != 200:
            return {"error": f"HTTP {reply.status_code}"}
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = json.loads(line[len("data: ") :])["choices"][0]["text"]
                if text:
                    arrivals.append(time.perf_counter())
                    pieces.append(text)
    if not arrivals:
        return {"error": "no tokens"}
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return {"text": "".join(pieces), "ttft": arrivals[0] - started, "gaps": gaps}


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": float("nan"), "p90": float("nan")}
    cut = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else ordered * 9
    return {"p50": statistics.median(ordered), "p90": cut[8]}


def run(url: str, prompts: list[str], clients: int, new_tokens: int) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(lambda prompt: stream(url, prompt, new_tokens), prompts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = str(smollm2())
    ray.init(num_cpus=12, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_pd_app(model), name="pd", route_prefix="/pd", blocking=False)
    serve.run(single_app(model), name="single", route_prefix="/single", blocking=False)
    urls = {"pd": f"http://127.0.0.1:{PORT}/pd", "single": f"http://127.0.0.1:{PORT}/single"}
    for url in urls.values():
        wait_until_serving(url)
    prompts = load_prompts()
    for url in urls.values():  # warm both up, untimed
        run(url, prompts[:2], 2, 4)
    rows: list[dict[str, Any]] = []
    offset = 2
    for clients in args.clients:
        # Prompts neither side has seen: no prefix cache helps either.
        batch = [prompts[(offset + i) % len(prompts)] for i in range(args.requests)]
        offset += args.requests
        results = {name: run(url, batch, clients, args.new_tokens) for name, url in urls.items()}
        errors = [r["error"] for rs in results.values() for r in rs if "error" in r]
        equal = sum(
            "error" not in p and "error" not in s and p["text"] == s["text"]
            for p, s in zip(results["pd"], results["single"], strict=True)
        )
        row: dict[str, Any] = {"clients": clients, "requests": len(batch), "equal": equal, "errors": errors}
        for name, rs in results.items():
            ok = [r for r in rs if "error" not in r]
            row[name] = {
                "ttft_s": percentiles([r["ttft"] for r in ok]),
                "itl_s": percentiles([gap for r in ok for gap in r["gaps"]]),
            }
        rows.append(row)
    print(f"Ray Serve LLM, P/D with kvray vs a single engine, {args.requests} streamed requests per row, "
          f"{args.new_tokens} new tokens (ms)")  # fmt: skip
    print(f"{'clients':>7}  {'TTFT p50/p90 single':>20}  {'TTFT p50/p90 P/D':>18}  "
          f"{'ITL p50/p90 single':>19}  {'ITL p50/p90 P/D':>16}  equal")  # fmt: skip
    failed = False
    for row in rows:
        cells = [
            f"{row[name][metric]['p50'] * 1e3:.0f}/{row[name][metric]['p90'] * 1e3:.0f}"
            for metric in ("ttft_s", "itl_s")
            for name in ("single", "pd")
        ]
        verdict = f"{row['equal']}/{row['requests']}"
        if row["equal"] != row["requests"]:
            verdict += f" FAILED {row['errors'][:2]}"
            failed = True
        widths = (20, 18, 19, 16)
        line = "  ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths, strict=True))
        print(f"{row['clients']:>7}  {line}  {verdict}")
    if args.json is not None:
        args.json.write_text(json.dumps({"new_tokens": args.new_tokens, "rows": rows}, indent=2))
    serve.shutdown()
    ray.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
