"""The main job: disaggregated generation on Ray, checked token for token against colocated
generation.

Starts (or joins) a Ray cluster, N prefill and M decode workers around the reference model, runs
a workload of prompts both ways and prints what an operator wants to see: the exact-match rate
(must be 100%), the requests the decode side's integrity check refused (`kvray.integrity`:
none), a per-layer KV digest check, bytes moved, transfer speed, time to first token and
per-token latency percentiles, and the transport chosen per worker pair. Exits non-zero when
any output or any layer's bytes differ, or a request was refused, so a Ray job running it
fails loudly.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvray.config import Settings
from kvray.errors import ConfigError, KVIntegrityError
from kvray.layout import BlockOrder
from kvray.memory import MemoryKind
from kvray.models.reference import MODEL_PRESETS, ReferenceModel, encode_text
from kvray.progress import Progress
from kvray.wire import Role

_TEXTS = (
    "Disaggregated inference splits prefill from decode.",
    "The KV cache of every layer must land at its own address.",
    "Two layers with one geometry are still two layers.",
    "Ray actors move blocks between workers.",
    "A region never reaches outside its allocation.",
)


def make_prompts(count: int, block_size: int, seed: int = 0, max_len: int = 72) -> list[list[int]]:
    """Prompts of varied lengths: one token, exactly one block, one past a block, and random
    lengths (text and random tokens) crossing block boundaries."""
    rng = np.random.default_rng(seed)
    fixed = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1]
    prompts: list[list[int]] = []
    for index in range(count):
        length = fixed[index] if index < len(fixed) else int(rng.integers(2, max_len + 1))
        if index % 2:
            text = encode_text(" ".join(_TEXTS[(index + k) % len(_TEXTS)] for k in range(4)))
            prompts.append(text[:length])
        else:
            prompts.append([int(t) for t in rng.integers(0, 256, length)])
    return prompts


@dataclass
class RequestOutcome:
    prompt_len: int
    tokens: list[int]
    reference: list[int]
    ttft_s: float
    tpot_s: float
    transfer_s: float
    exposed_transfer_s: float
    compute_s: float
    nbytes: int
    transport: str
    pair: tuple[str, str]
    layerwise: bool
    bad_layers: list[str] = field(default_factory=list)
    #: The layers the decode side's integrity check found wrong: the request was refused, not
    #: decoded (`tokens` is empty).
    refused_layers: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.tokens == self.reference


def _percentiles(values: Sequence[float]) -> str:
    if not values:
        return "-"
    p50, p90, p99 = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
    return f"p50 {p50:.2f} ms, p90 {p90:.2f} ms, p99 {p99:.2f} ms"


def _placement(args: argparse.Namespace) -> tuple[MemoryKind | None, float]:
    """The workers' KV memory and each worker's share of a GPU. On `cuda`, every worker is a
    Ray GPU actor with its KV backing and its model on the GPU; the workers share the GPUs
    Ray offers, so a single GPU holds them all (and cuda_ipc moves KV within it)."""
    if args.device == "cpu":
        return None, 0.0
    import ray

    gpus = float(ray.cluster_resources().get("GPU", 0))  # type: ignore[no-untyped-call]
    if gpus <= 0:
        raise ConfigError(
            "--device cuda needs a Ray cluster with a GPU, and this one has none; start Ray on a "
            "GPU machine (or pass --device cpu)"
        )
    workers = args.prefill + args.decode
    # Whole GPUs where there are enough, else an equal share of each.
    share = 1.0 if gpus >= workers else min(1.0, gpus / workers)
    return MemoryKind.CUDA, share


async def run_demo(args: argparse.Namespace) -> list[RequestOutcome]:
    import ray

    from kvray.faults import SeedBugOffsetCache
    from kvray.workers import DecodeActor, PrefillActor, placement_options

    config = MODEL_PRESETS[args.model]
    model = ReferenceModel(config)
    order = BlockOrder(args.block_order)
    layout = model.layout(args.blocks, order)
    # The demo checks every request's KV (the library's default samples), or none.
    overrides: dict[str, Any] = {
        "transport": args.transport,
        "integrity": not args.no_integrity,
        "integrity_sample_rate": 0.0 if args.no_integrity else 1.0,
    }
    settings = Settings.from_env(**overrides)
    fault = SeedBugOffsetCache() if args.inject_seed_bug else None
    memory, num_gpus = _placement(args)
    prefills: list[Any] = [
        PrefillActor.options(**placement_options(Role.PREFILL, num_gpus)).remote(
            f"demo-prefill-{i}", layout, settings, memory=memory, model=config, offset_cache=fault
        )
        for i in range(args.prefill)
    ]
    decodes: list[Any] = [
        DecodeActor.options(**placement_options(Role.DECODE, num_gpus)).remote(
            f"demo-decode-{j}", layout, settings, memory=memory, model=config
        )
        for j in range(args.decode)
    ]
    await asyncio.gather(*(actor.start.remote() for actor in prefills + decodes))

    prompts = make_prompts(args.prompts, config.block_size, args.seed)
    progress = Progress(len(prompts), "colocated")
    limit = asyncio.Semaphore(args.concurrency)

    async def reference(index: int, prompt: list[int]) -> list[int]:
        async with limit:
            tokens: list[int] = await decodes[index % len(decodes)].generate_colocated.remote(
                prompt, args.max_new_tokens
            )
            progress.step()
            return tokens

    references = await asyncio.gather(*(reference(i, p) for i, p in enumerate(prompts)))
    progress = Progress(len(prompts), "disaggregated")

    async def disaggregated(index: int, prompt: list[int]) -> RequestOutcome:
        request_id = f"demo-{index}"
        p, d = index % len(prefills), (index // len(prefills)) % len(decodes)
        layerwise = args.push == "layerwise" or (args.push == "both" and index % 2 == 1)
        async with limit:
            started = time.perf_counter()
            total_blocks = model.blocks_needed(len(prompt) + args.max_new_tokens)
            reservation = await decodes[d].reserve.remote(
                request_id, total_blocks, kv_blocks=model.blocks_needed(len(prompt))
            )
            prefilled = await prefills[p].prefill.remote(prompt, reservation, layerwise=layerwise)
            ttft = time.perf_counter() - started
            try:
                decoded = await decodes[d].decode.remote(
                    request_id, prefilled.first_token, len(prompt), args.max_new_tokens
                )
            except KVIntegrityError as refused:  # (Ray's task error is an instance of its cause)
                progress.step()
                return _refused(
                    prompt, references[index], prefilled, (f"prefill-{p}", f"decode-{d}"), refused
                )
            progress.step()
        bad_layers = [
            layer for layer, digest in prefilled.kv_digest.items() if decoded.kv_digest.get(layer) != digest
        ]
        return RequestOutcome(
            prompt_len=len(prompt),
            tokens=decoded.tokens,
            reference=references[index],
            ttft_s=ttft,
            tpot_s=decoded.decode_s / max(1, args.max_new_tokens - 1),
            transfer_s=prefilled.transfer_s,
            exposed_transfer_s=prefilled.exposed_transfer_s,
            compute_s=prefilled.compute_s,
            nbytes=prefilled.nbytes,
            transport=prefilled.transport.value,
            pair=(f"prefill-{p}", f"decode-{d}"),
            layerwise=layerwise,
            bad_layers=bad_layers,
        )

    outcomes = await asyncio.gather(*(disaggregated(i, p) for i, p in enumerate(prompts)))
    for actor in prefills + decodes:
        await actor.close.remote()
        ray.kill(actor)
    return list(outcomes)


def _refused(
    prompt: list[int], reference: list[int], prefilled: Any, pair: tuple[str, str], error: KVIntegrityError
) -> RequestOutcome:
    """A request the decode side refused to decode: its KV did not land as it was sent."""
    return RequestOutcome(
        prompt_len=len(prompt),
        tokens=[],
        reference=reference,
        ttft_s=0.0,
        tpot_s=0.0,
        transfer_s=prefilled.transfer_s,
        exposed_transfer_s=prefilled.exposed_transfer_s,
        compute_s=prefilled.compute_s,
        nbytes=prefilled.nbytes,
        transport=prefilled.transport.value,
        pair=pair,
        layerwise=False,
        refused_layers=list(error.facts.get("layers", ())),
    )


def summarize(outcomes: Sequence[RequestOutcome], args: argparse.Namespace, seconds: float) -> bool:
    """Print the summary table; True when every output and every layer's bytes matched."""
    exact = sum(outcome.exact for outcome in outcomes)
    refused = [outcome for outcome in outcomes if outcome.refused_layers]
    decoded = [outcome for outcome in outcomes if not outcome.refused_layers]
    digest_bad = [outcome for outcome in outcomes if outcome.bad_layers]
    total_bytes = sum(outcome.nbytes for outcome in outcomes)
    speeds = [o.nbytes / o.transfer_s / 1e9 for o in outcomes if o.transfer_s > 0]
    pairs = Counter((*outcome.pair, outcome.transport) for outcome in outcomes)
    by_mode = Counter("layer-wise" if o.layerwise else "whole-request" for o in outcomes)
    rate = 100.0 * exact / max(1, len(outcomes))
    print()
    print(
        f"kvray demo: model {args.model!r}, {args.block_order}, {args.prefill} prefill x "
        f"{args.decode} decode workers on {args.device}, {len(outcomes)} prompts, "
        f"{args.max_new_tokens} new tokens each" + (" -- SEED BUG INJECTED" if args.inject_seed_bug else "")
    )
    rows = [
        (
            "prompts",
            f"{len(outcomes)} (lengths {min(o.prompt_len for o in outcomes)}.."
            f"{max(o.prompt_len for o in outcomes)} tokens)",
        ),
        ("exact match, disaggregated vs colocated", f"{rate:.1f}% ({exact}/{len(outcomes)})"),
        (
            "KV integrity, checked before decoding",
            ("placement only (--no-integrity)" if args.no_integrity else "every request arrived intact")
            if not refused
            else f"{len(refused)} requests refused, not decoded, e.g. layers {refused[0].refused_layers[:3]}",
        ),
        (
            "KV digest, prefill vs decode, per layer",
            "all layers equal"
            if not digest_bad
            else f"{len(digest_bad)} requests differ, e.g. layers {digest_bad[0].bad_layers[:3]}",
        ),
        ("pushes", ", ".join(f"{count} {mode}" for mode, count in sorted(by_mode.items()))),
        ("bytes moved", f"{total_bytes / 2**20:.2f} MiB"),
        ("transfer speed per request", f"median {statistics.median(speeds):.3f} GB/s" if speeds else "-"),
        ("time to first token", _percentiles([o.ttft_s for o in decoded])),
        ("  of which prefill compute", _percentiles([o.compute_s for o in decoded])),
        ("  of which transfer after compute", _percentiles([o.exposed_transfer_s for o in decoded])),
        ("time per output token", _percentiles([o.tpot_s for o in decoded])),
        ("wall time", f"{seconds:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("  transport per pair:")
    for (prefill, decode, transport), count in sorted(pairs.items()):
        print(f"    {prefill} -> {decode}: {transport} ({count} requests)")
    ok = exact == len(outcomes) and not digest_bad and not refused
    print(f"RESULT: {'PASS' if ok else 'FAIL'}: exact match {rate:.1f}%")
    return ok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="mixed")
    parser.add_argument("--block-order", choices=[o.value for o in BlockOrder], default="layer_major")
    parser.add_argument("--blocks", type=int, default=512, help="KV blocks per worker")
    parser.add_argument("--transport", choices=["auto", "shm", "cuda_ipc", "ray"], default="auto")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the workers keep their KV and run the model (cuda: Ray GPU actors sharing the "
        "GPUs, KV moved by cuda_ipc)",
    )
    parser.add_argument(
        "--push",
        choices=["both", "whole", "layerwise"],
        default="both",
        help="whole-request pushes, layer-wise pushes, or alternate",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--inject-seed-bug",
        action="store_true",
        help="cache offsets by geometry only (the bug kvray prevents) and watch it fail",
    )
    parser.add_argument(
        "--no-integrity",
        action="store_true",
        help="check only where the KV was stored, not its bytes (no content digests, no "
        "checksums); placement is checked on every transfer regardless, so --inject-seed-bug "
        "is still refused",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (default: RAY_ADDRESS if set, else a new local Ray)",
    )


def main(args: argparse.Namespace) -> int:
    import ray

    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            num_gpus: int | None = None
            if args.device == "cuda":
                import torch

                # Every GPU torch sees, whether or not Ray's own detection finds them.
                num_gpus = torch.cuda.device_count()
            ray.init(address="local", include_dashboard=False, log_to_driver=False, num_gpus=num_gpus)
    started = time.perf_counter()
    outcomes = asyncio.run(run_demo(args))
    ok = summarize(outcomes, args, time.perf_counter() - started)
    return 0 if ok else 1


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvray demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def run(argv: Sequence[str] | None = None) -> int:
    return main(parse(argv))


__all__ = ["make_prompts", "run", "run_demo", "summarize"]
