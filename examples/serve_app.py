"""kvray's Ray Serve application, run from Python: deploy it, send prompts over HTTP, check every
answer against colocated generation, then exit (or keep serving with --keep).

    python examples/serve_app.py                       # local Ray, port 8000, 1 prefill x 2 decode
    python examples/serve_app.py --keep --port 8001    # then: curl -X POST 127.0.0.1:8001/generate ...

Needs the serve extra (`pip install -e '.[serve]'`). Exits 1 unless every answer matched.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from kvray.memory import Backing, MemoryKind
from kvray.models.reference import MODEL_PRESETS, ReferenceModel
from kvray.serve import ServeOptions, build_app, wait_for_stop_signal
from kvray.serve.app import tokenize

PROMPTS = (
    "Disaggregated inference splits prefill from decode.",
    "The KV cache of every layer must land at its own address.",
    "Two layers with one geometry are still two layers.",
    "Ray actors move blocks between workers.",
    "A region never reaches outside its allocation.",
    "Hello kvray",
)


def colocated(model: ReferenceModel, tokens: list[int], max_tokens: int, num_blocks: int) -> list[int]:
    backing = Backing.allocate(model.layout(num_blocks), MemoryKind.CPU)
    try:
        blocks = list(range(model.blocks_needed(len(tokens) + max_tokens)))
        return model.generate(tokens, backing.views, blocks, max_tokens)
    finally:
        backing.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", type=int, default=1, help="prefill replicas")
    parser.add_argument("--decode", type=int, default=2, help="decode replicas")
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="mixed")
    parser.add_argument("--transport", choices=["auto", "shm", "ray"], default="auto")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--replica-cpus", type=float, default=0.5)
    parser.add_argument(
        "--keep", action="store_true", help="keep serving after the check (Ctrl-C or SIGTERM stops)"
    )
    parser.add_argument(
        "--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else local)"
    )
    args = parser.parse_args()

    import ray
    from ray import serve

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    options = ServeOptions.from_args(
        {
            "model": args.model,
            "prefill_replicas": args.prefill,
            "decode_replicas": args.decode,
            "replica_cpus": args.replica_cpus,
            "settings": {"transport": args.transport},
        }
    )
    started = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app(options), name="kvray", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}/generate"
    print(f"kvray Serve app ready at {url} in {time.perf_counter() - started:.1f} s")

    model = ReferenceModel(options.model_config)

    def ask(text: str) -> tuple[str, dict[str, Any], bool]:
        response = requests.post(url, json={"text": text, "max_tokens": args.max_tokens}, timeout=120)
        reply: dict[str, Any] = response.json()
        if response.status_code != 200:
            return text, reply, False
        tokens = tokenize(text, options.model_config.vocab_size)
        return text, reply, reply["tokens"] == colocated(model, tokens, args.max_tokens, options.num_blocks)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(ask, PROMPTS))
    for text, reply, ok in results:
        where = f"{reply.get('prefill_engine')} -> {reply.get('decode_engine')} ({reply.get('transport')})"
        print(
            f"  {'ok ' if ok else 'BAD'} {text[:40]!r:44} {where}" if "tokens" in reply else f"  BAD {reply}"
        )
    matched = sum(ok for _, _, ok in results)
    print(
        f"RESULT: {'PASS' if matched == len(results) else 'FAIL'}: {matched}/{len(results)} equal colocated"
    )
    if args.keep:
        print(f'serving; try: curl -X POST {url} -d \'{{"text": "Hello kvray", "max_tokens": 8}}\'')
        wait_for_stop_signal()
    serve.shutdown()
    return 0 if matched == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
