"""Disaggregated prefill/decode with vLLM and kvray: a prefill and a decode vLLM engine, each in a
Ray actor, the prompt's KV pushed by kvray (`KvrayConnector`) from the prefill engine's KV cache
into the decode engine's, and a third engine alone for reference. Prints, per prompt, whether the
P/D tokens equal the single engine's, the time to first token both ways (each engine's first
sight of the prompt) and the KV transfer time, then a few generations. Last, the whole batch
decode first: the decode engine takes every request before the prefill engine runs it, and each
layer is pushed as the prefill's forward saves it (those whose decode engine asked in time).

    python examples/vllm_pd.py [--prompts N] [--new-tokens N]
    ray job submit --working-dir . -- python examples/vllm_pd.py

Needs the vllm extra (see the README's *vLLM* section). Exit status 1 if any prompt differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

from kvray.bench.handoff_log import DIGEST_LOG_CONNECTOR
from kvray.integrations.vllm.model import smollm2
from kvray.integrations.vllm.pd import Engine, decode_first, prefill_then_decode, transfer_config
from kvray.integrations.vllm.prompts import load_prompts


def transfer_seconds(log: Path) -> dict[str, float]:
    """Prefill request id -> seconds from the decode side's push request to its KV's arrival."""
    seconds: dict[str, float] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if record.get("seconds") is not None:
                seconds[record["prefill_request"]] = float(record["seconds"])
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=0, help="how many prompts (0: all)")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    prompts = load_prompts()[: args.prompts or None]
    model = str(smollm2())
    ray.init(include_dashboard=False, log_to_driver=False)
    logs = Path(tempfile.mkdtemp(prefix="kvray-vllm-"))
    actor = ray.remote(num_cpus=0)(Engine)
    started = time.perf_counter()
    prefill = actor.remote(
        model, transfer_config({"digest_log": str(logs / "prefill.jsonl")}, connector=DIGEST_LOG_CONNECTOR)
    )
    decode = actor.remote(
        model, transfer_config({"digest_log": str(logs / "decode.jsonl")}, connector=DIGEST_LOG_CONNECTOR)
    )
    alone = actor.remote(model, None)
    ray.get([engine.processes.remote() for engine in (prefill, decode, alone)])
    print(f"prefill, decode and single vLLM engines up in {time.perf_counter() - started:.0f} s ({model})")

    rows = []
    for prompt in prompts:
        # First sight of the prompt on every engine: its time to first token, both ways.
        began = time.perf_counter()
        ray.get(alone.generate.remote([prompt], 1))
        single_ttft = time.perf_counter() - began
        first = prefill_then_decode(prefill, decode, [prompt], 1)
        request = (first.prefill[0].kv_transfer_params or {}).get("kvray_prefill_request", "")
        # Then the whole generation both ways (the engines' prefix caches now hold the prompt:
        # the decode engine loads only what its own cache lacks).
        single = ray.get(alone.generate.remote([prompt], args.new_tokens))[0]
        handoff = prefill_then_decode(prefill, decode, [prompt], args.new_tokens)
        rows.append(
            {
                "prompt": prompt,
                "equal": handoff.decode[0].token_ids == single.token_ids,
                "request": request,
                "single_ttft_s": single_ttft,
                "pd_ttft_s": first.prefill_s + first.decode_s,
                "text": handoff.decode[0].text,
            }
        )
    seconds = transfer_seconds(logs / "decode.jsonl")
    print(f"\n{'#':>3}  {'equal':5}  {'TTFT single':>11}  {'TTFT P/D':>9}  {'transfer':>9}  prompt")
    for number, row in enumerate(rows, start=1):
        transfer = seconds.get(str(row["request"]))
        print(
            f"{number:>3}  {'yes' if row['equal'] else 'NO':5}  {row['single_ttft_s'] * 1e3:9.0f}ms"
            f"  {row['pd_ttft_s'] * 1e3:7.0f}ms  "
            f"{'-' if transfer is None else f'{transfer * 1e3:7.1f}ms':>9}  {str(row['prompt'])[:48]!r}"
        )
    equal = sum(bool(row["equal"]) for row in rows)
    transfers = [seconds[str(row["request"])] for row in rows if str(row["request"]) in seconds]
    print(f"\nexact match with a single engine: {equal}/{len(rows)} prompts")
    if transfers:
        median_ms = statistics.median(transfers) * 1e3
        print(f"KV transfer (decode asks -> KV in its cache): median {median_ms:.1f} ms")
    print("\nsome generations (P/D):")
    for row in [row for row in rows if str(row["text"]).strip()][:3]:
        print(f"  {str(row['prompt'])[:60]!r}\n    -> {str(row['text'])[:120]!r}")
    # Decode first, the whole batch at once, as a client would dispatch it.
    singles = ray.get(alone.generate.remote(prompts, args.new_tokens))
    batch = decode_first(prefill, decode, prompts, args.new_tokens)
    batch_equal = sum(a.token_ids == b.token_ids for a, b in zip(singles, batch.decode, strict=True))
    keys = {(g.kv_transfer_params or {}).get("kvray_prefill_request") for g in batch.prefill}
    sent = [json.loads(line) for line in (logs / "prefill.jsonl").read_text().splitlines()]
    layerwise = sum(
        1 for r in sent if r["side"] == "sent" and r["prefill_request"] in keys and r["layerwise"]
    )
    print(
        f"\ndecode first, {len(prompts)} requests at once: {batch_equal}/{len(prompts)} equal a single "
        f"engine's; {layerwise} pushed layer by layer during the prefill's forward, the rest once it ended"
    )
    ray.shutdown()
    return 0 if equal == len(rows) and batch_equal == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
