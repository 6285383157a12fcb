"""P/D through real vLLM engines in this process (no Ray needed): per model, a single engine, a
prefill engine (`kv_producer`) and a decode engine (`kv_both`) with kvray's connector (its
digest-logging subclass: every request's per-layer digests, as sent and as received), greedy.
Prints per model: prompts whose P/D tokens equal the single engine's (where they part, the single
engine's top-two logprob gap there), the per-layer digests equal or not, blocks held afterwards
on each engine, time to first token single and P/D (each engine's first sight of the prompt),
and the KV transfer time (the decode engine's ask to its KV in the cache). Last, the prefill
engine is killed with requests held for the decode engine, which must fail them (no text made
up) within `GONE_WITHIN_S` and hold no block. On a vLLM that cannot be told of a failed load of a
model of several KV cache groups (0.26) such a model must be refused at start-up
(`kvray.integrations.vllm.compat`). Exit status 1 if any check fails.

On the GPU machine (`run_on_device.sh vllm`): bf16, `cuda_ipc`, the engines sharing the GPU.
On a CPU (`--device cpu`, float32 as kvray's tests run): the `shm` transport. Any vLLM kvray
supports (0.26 and 0.32 are proven).

    python tests/gpu/vllm_pd_engines.py [--device cuda|cpu] [--models NAME ...] [--prompts N]
        [--cache DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: A model folder is built by `kvray model NAME --cache DIR` (SmolLM2's tokenizer files in DIR).
MODELS = ("tiny-llama-gqa", "tiny-hybrid", "tiny-deepseek")
NEW_TOKENS = 16
TOP_LOGPROBS = 2
#: In bf16 (the GPU), how close the single engine's top two logprobs may be where P/D takes the
#: other token: the decode engine computes the last prompt token over the loaded KV by another
#: kernel path than the single engine's prefill, and bf16 rounds the two apart by about this much.
BF16_NEAR_TIE = 0.1
#: The models of several KV cache groups.
SEVERAL_GROUPS = frozenset({"tiny-hybrid"})
#: How soon the decode engine must fail requests whose prefill engine was killed (seconds).
GONE_WITHIN_S = 15.0


def engine_options(name: str, device: str) -> dict[str, Any]:
    from kvray.integrations.vllm.model import MODELS as RECIPES

    if device == "cpu":
        return dict(RECIPES[name].engine_options)
    # Three engines share the GPU; FlashAttention 3 on Hopper (FlashMLA for the MLA model).
    options: dict[str, Any] = {"gpu_memory_utilization": 0.25}
    if name != "tiny-deepseek":
        options["attention_backend"] = "FLASH_ATTN"
    return options


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_parting(single: Any, pd: Any) -> dict[str, Any] | None:
    """Where P/D's tokens part from the single engine's: the position and the single engine's
    gap between its top two logprobs there (a near tie vLLM's arithmetic may flip)."""
    for position, (ours, theirs) in enumerate(zip(single.token_ids, pd.token_ids, strict=False)):
        if ours != theirs:
            gap = None
            if single.logprobs is not None and position < len(single.logprobs):
                top = sorted(single.logprobs[position].values(), reverse=True)
                gap = top[0] - top[1] if len(top) > 1 else None
            return {"position": position, "gap": gap}
    if len(single.token_ids) != len(pd.token_ids):
        return {"position": min(len(single.token_ids), len(pd.token_ids)), "gap": None}
    return None


def stop(*engines: Any) -> None:
    """Shut the engines' cores down now (the next model's engines need the memory)."""
    import gc

    for engine in engines:
        try:
            engine.llm.llm_engine.engine_core.shutdown()
        except Exception as error:  # already gone: nothing holds its memory
            print(f"engine shutdown: {type(error).__name__}: {error}", flush=True)
    gc.collect()


def run_model(name: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from kvray.bench.handoff_log import DIGEST_LOG_CONNECTOR
    from kvray.integrations.vllm.model import MODELS as RECIPES
    from kvray.integrations.vllm.pd import Engine, prefill_then_decode, transfer_config
    from kvray.integrations.vllm.prompts import load_prompts

    recipe = RECIPES[name]
    model = str(recipe.build(args.cache))
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    options = engine_options(name, args.device)
    extra = {"transfer_timeout_s": 60.0, "integrity_sample_rate": 1.0, "digest_every": 1}

    def start(role: str | None, log: str = "") -> Engine:
        transfer = None
        if role is not None:
            transfer = transfer_config(
                {**extra, "digest_log": str(logs / f"{name}-{log}.jsonl")},
                kv_role=role,
                connector=DIGEST_LOG_CONNECTOR,
            )
        return Engine(
            model, transfer, dtype=dtype, max_model_len=1024, join_ray=False, engine_options=options
        )

    import psutil

    from kvray.integrations.vllm import compat

    def children() -> set[int]:
        return {child.pid for child in psutil.Process().children(recursive=True)}

    began = time.perf_counter()
    try:
        single = start(None)
    except Exception as error:  # this vLLM does not run the model here (e.g. MLA on a CPU before 0.27)
        return {"model": name, "not_run": f"{type(error).__name__}: {error}"}
    before = children()
    try:
        prefill = start("kv_producer", "prefill")
    except Exception as error:
        stop(single)
        expected = name in SEVERAL_GROUPS and not compat.REPORTS_FAILED_RECEIVES
        return {"model": name, "refused": f"{type(error).__name__}: {error}", "expected": expected}
    prefill_processes = children() - before
    decode = start("kv_both", "decode")
    up_s = time.perf_counter() - began
    prompts = load_prompts()[: args.prompts]
    rows = []
    for prompt in prompts:
        started = time.perf_counter()
        single.generate([prompt], 1)
        single_ttft = time.perf_counter() - started
        started = time.perf_counter()
        prefill_then_decode(prefill, decode, [prompt], 1)
        pd_ttft = time.perf_counter() - started
        alone = single.generate([prompt], NEW_TOKENS, logprobs=TOP_LOGPROBS)[0]
        handoff = prefill_then_decode(prefill, decode, [prompt], NEW_TOKENS)
        pd = handoff.decode[0]
        rows.append(
            {
                "equal": pd.token_ids == alone.token_ids,
                "parting": first_parting(alone, pd),
                "single_ttft_s": single_ttft,
                "pd_ttft_s": pd_ttft,
            }
        )
    held = {"prefill": prefill.blocks_in_use(), "decode": decode.blocks_in_use()}
    # The prefill engine killed while it holds requests for the decode engine.
    chosen = prompts[:2]
    first = prefill.generate(chosen, 1, [{"do_remote_decode": True}] * len(chosen))
    for pid in prefill_processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    started = time.perf_counter()
    orphaned = decode.generate(chosen, NEW_TOKENS, [generation.kv_transfer_params for generation in first])
    killed = {
        "waited_s": time.perf_counter() - started,
        "answers": [(generation.finish_reason, len(generation.token_ids)) for generation in orphaned],
        "decode_held": decode.blocks_in_use(),
    }
    sent = {
        record["prefill_request"]: record["layers"]
        for record in read_log(logs / f"{name}-prefill.jsonl")
        if "layers" in record
    }
    received = {
        record["prefill_request"]: record["layers"]
        for record in read_log(logs / f"{name}-decode.jsonl")
        if "layers" in record
    }
    transfer = [
        float(record["seconds"])
        for record in read_log(logs / f"{name}-decode.jsonl")
        if record.get("seconds") is not None
    ]
    stop(single, prefill, decode)
    return {
        "killed_prefill": killed,
        "model": name,
        "up_s": up_s,
        "prompts": len(rows),
        "equal": sum(row["equal"] for row in rows),
        "partings": [row["parting"] for row in rows if not row["equal"]],
        "digests_received": len(received),
        "digests_equal": bool(received) and all(sent.get(key) == layers for key, layers in received.items()),
        "held": held,
        "single_ttft_ms": statistics.median(row["single_ttft_s"] for row in rows) * 1e3,
        "pd_ttft_ms": statistics.median(row["pd_ttft_s"] for row in rows) * 1e3,
        "transfer_ms": statistics.median(transfer) * 1e3 if transfer else None,
        "near_tie": max(recipe.near_tie, BF16_NEAR_TIE) if args.device == "cuda" else recipe.near_tie,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--cache", default=None, help="the built models' folder (kvray model --cache)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm

    print(f"vLLM {vllm.__version__}, device {args.device}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="kvray-vllm-pd-"))
    results = []
    failed = False
    for name in args.models:
        try:
            result = run_model(name, args, logs)
        except Exception as error:  # the next model still runs; this one failed
            import traceback

            traceback.print_exc()
            results.append({"model": name, "error": f"{type(error).__name__}: {error}"})
            print(f"{name}: FAILED: {type(error).__name__}: {error}", flush=True)
            failed = True
            continue
        results.append(result)
        if "not_run" in result:
            print(f"{name}: this vLLM does not start a single engine of it here: {result['not_run']}")
            continue
        if "refused" in result:
            failed |= not result["expected"]
            verdict = "as it must be on this vLLM" if result["expected"] else "FAILED"
            print(f"{name}: refused at start-up ({verdict}): {result['refused']}", flush=True)
            continue
        killed = result["killed_prefill"]
        ok = (
            result["digests_equal"]
            and result["held"] == {"prefill": 0.0, "decode": 0.0}
            and all(
                parting["gap"] is not None and parting["gap"] <= result["near_tie"]
                for parting in result["partings"]
            )
            and killed["waited_s"] < GONE_WITHIN_S
            and all(answer == ("error", 0) for answer in killed["answers"])
            and killed["decode_held"] == 0.0
        )
        failed |= not ok
        print(
            f"{name}: {result['equal']}/{result['prompts']} P/D equal to the single engine "
            f"(partings {result['partings']}, near tie allowed {result['near_tie']}); digests "
            f"{'equal' if result['digests_equal'] else 'DIFFER'} over {result['digests_received']} requests; "
            f"blocks held {result['held']}; TTFT single {result['single_ttft_ms']:.1f} ms, P/D "
            f"{result['pd_ttft_ms']:.1f} ms; KV transfer {result['transfer_ms'] or float('nan'):.2f} ms; "
            f"engines up in "
            f"{result['up_s']:.0f} s; prefill engine killed: its requests {killed['answers']} after "
            f"{killed['waited_s']:.1f} s, decode blocks held {killed['decode_held']}; "
            f"{'ok' if ok else 'FAILED'}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
