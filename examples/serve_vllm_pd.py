"""Serve SmolLM2-135M disaggregated with Ray Serve LLM (`build_pd_openai_app`) and kvray moving the
KV from the prefill replica's vLLM cache into the decode replica's: an OpenAI-compatible server
(`/v1/completions`, `/v1/chat/completions`, streaming) on this machine.

    python examples/serve_vllm_pd.py [--port 8000] [--once]

Then, from another shell:

    curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

or with the OpenAI client: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`.
`--once` answers that one completion, prints it and stops (a check that it all works).
Needs the vllm extra (see the README's *vLLM* section). Starts a local Ray of its own.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx
import ray
from ray import serve

from kvray.integrations.vllm.model import smollm2
from kvray.integrations.vllm.serve_llm import build_pd_app, wait_until_serving
from kvray.serve import wait_for_stop_signal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--once", action="store_true", help="answer one completion, then stop")
    args = parser.parse_args()
    model = str(smollm2())
    # Logical CPUs: each engine takes a bundle of one, plus the replicas and the ingress.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        started = time.perf_counter()
        serve.run(build_pd_app(model), blocking=False)
        url = f"http://127.0.0.1:{args.port}"
        wait_until_serving(url)
        print(f"serving {model} as 'smollm2' at {url}/v1 (prefill and decode replicas, KV by kvray), "
              f"up in {time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
        if args.once:
            body = {
                "model": "smollm2",
                "prompt": "The capital of France is",
                "max_tokens": 16,
                "temperature": 0,
            }
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
            print(reply.json()["choices"][0]["text"] if reply.status_code == 200 else reply.text)
            return 0 if reply.status_code == 200 else 1
        print("Ctrl-C or SIGTERM stops it", flush=True)
        stopped_by = wait_for_stop_signal()
        print(f"{stopped_by.name}: shutting down", flush=True)
        return 0
    finally:
        # Also after a Ctrl-C during start-up (a KeyboardInterrupt), so no replica outlives it.
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
