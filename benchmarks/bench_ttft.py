"""Time to first token of one long prompt, split into prefill compute, transfer and decode start,
for whole-request pushes and layer-wise pushes, over the shm and ray transports.

    python benchmarks/bench_ttft.py [--tokens 960] [--repeat 5] [--model mixed] [--json out.json]

For each mode: `compute` is the forward pass over the prompt on the prefill worker; `transfer`
is the push (layer-wise: from the first layer's write to the completion); `exposed` is the part
of the transfer left after the forward pass ended (what the user waits for); `decode start` is
from the prefill worker's answer to the decode worker holding the KV and generating its first
step; `ttft` is request start to first token at the router. Layer-wise pushing hides
`transfer - exposed` behind compute. Medians over the repeats; every run checks that the decode
side's tokens equal colocated generation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np
import ray

from kvray.config import Settings
from kvray.models.reference import MODEL_PRESETS, ReferenceModel
from kvray.workers import DecodeActor, PrefillActor


async def one_request(
    prefill: Any, decode: Any, model: ReferenceModel, prompt: list[int], layerwise: bool, index: int
) -> dict[str, Any]:
    request_id = f"ttft-{index}"
    started = time.perf_counter()
    reservation = await decode.reserve.remote(
        request_id, model.blocks_needed(len(prompt) + 2), kv_blocks=model.blocks_needed(len(prompt))
    )
    prefilled = await prefill.prefill.remote(prompt, reservation, layerwise=layerwise)
    first_token_at = time.perf_counter()
    decoded = await decode.decode.remote(request_id, prefilled.first_token, len(prompt), 2)
    return {
        "ttft_ms": (first_token_at - started) * 1e3,
        "compute_ms": prefilled.compute_s * 1e3,
        "transfer_ms": prefilled.transfer_s * 1e3,
        "exposed_ms": prefilled.exposed_transfer_s * 1e3,
        "decode_start_ms": (decoded.wait_s + decoded.decode_s) * 1e3,
        "nbytes": prefilled.nbytes,
        "tokens": decoded.tokens,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = MODEL_PRESETS[args.model]
    model = ReferenceModel(config)
    layout = model.layout(model.blocks_needed(args.tokens + 2) * 2 + 8)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, args.tokens)]
    rows = []
    for transport in ("shm", "ray"):
        settings = Settings(transport=transport)
        prefill = PrefillActor.remote("ttft-prefill", layout, settings, model=config)
        decode = DecodeActor.remote("ttft-decode", layout, settings, model=config)
        await asyncio.gather(prefill.start.remote(), decode.start.remote())
        reference = await decode.generate_colocated.remote(prompt, 2)
        for layerwise in (False, True):
            samples = [
                await one_request(prefill, decode, model, prompt, layerwise, i)
                for i in range(args.repeat + 1)
            ][1:]  # the first run warms up the pair (lookup, mappings)
            if any(sample["tokens"] != reference for sample in samples):
                raise SystemExit(
                    f"{transport} layerwise={layerwise}: tokens differ from colocated generation"
                )
            row: dict[str, Any] = {"transport": transport, "mode": "layer-wise" if layerwise else "whole"}
            for key in ("ttft_ms", "compute_ms", "transfer_ms", "exposed_ms", "decode_start_ms"):
                row[key] = statistics.median(sample[key] for sample in samples)
            row["nbytes"] = samples[0]["nbytes"]
            row["hidden_pct"] = (
                100.0 * (1 - row["exposed_ms"] / row["transfer_ms"]) if row["transfer_ms"] else 0
            )
            rows.append(row)
        for actor in (prefill, decode):
            ray.kill(actor)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=960)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="mixed")
    parser.add_argument("--json")
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    rows = asyncio.run(main_async(args))
    print(
        f"TTFT of a {args.tokens}-token prompt, model {args.model!r}, KV {rows[0]['nbytes'] / 2**20:.2f} "
        f"MiB, median of {args.repeat} runs (ms)"
    )
    print(
        f"{'transport':<9} {'mode':<10} {'ttft':>8} {'compute':>8} {'transfer':>9} {'exposed':>8} "
        f"{'hidden':>7} {'decode start':>13}"
    )
    for r in rows:
        print(
            f"{r['transport']:<9} {r['mode']:<10} {r['ttft_ms']:>8.1f} {r['compute_ms']:>8.1f} "
            f"{r['transfer_ms']:>9.2f} {r['exposed_ms']:>8.2f} {r['hidden_pct']:>6.0f}% "
            f"{r['decode_start_ms']:>13.1f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    main()
