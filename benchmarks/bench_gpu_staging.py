"""GPU KV across nodes without RDMA: kvray's `ray` transport carrying CUDA-resident KV, staged
through pinned host memory, between a prefill and a decode agent on two Ray nodes of one GPU
machine (both nodes offer the GPU, so `auto` picks `ray`), against a pinned copy ceiling
measured in the same run.

    python benchmarks/bench_gpu_staging.py [--tokens 4096 16384] [--repeat 5] [--json PATH]

Workload: a DeepSeek-V3 MLA layout (61 layers of 576 bf16 per token, 64 tokens a block), one
request of 4k and of 16k tokens on scattered block ids out of pools twice the request.
Rows, each a median with its spread (min-max) over the runs:
- `pinned ceiling`: torch on one stream, the request's bytes device -> pinned host -> device
  between plain allocations (and each half alone): what staging through host memory costs at
  best, with no Ray and no gather;
- `kvray ray, whole push`: the prefill agent's push of the whole request (plan; chunks of about
  a layer gathered on the GPU into pinned buffers, each delivered through Ray's object store
  while the next one's copy runs; on the decode side each checked, copied to the GPU and
  scattered; then the completion notice), timed in the prefill actor until the push returns;
- `kvray ray, layer-wise`: one push per layer, all started at once (a forward pass that produced
  its layers back to back), then finish;
- staging steps alone, on one layer of the request in one process: the gather by kernel into
  device staging plus one device-to-host copy, against one device-to-host copy per op; and the
  receiver's copy into pinned memory, one host-to-device copy and a scatter kernel, against one
  host-to-device copy per op (these answer which copies the transport should use).
The decode region is zeroed before every push, and every push's bytes are compared on the decode
GPU with the prefill's pattern: a wrong byte fails the run.
"""

from __future__ import annotations

import os

# Ray reads this at import: with it off, both nodes of the local cluster use the loopback address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import argparse
import asyncio
import contextlib
import json
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvray.config import Settings
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.memory import MemoryKind
from kvray.plan import plan_transfer
from kvray.transport import cuda_staging
from kvray.wire import TransportKind
from kvray.workers import DecodeWorker, PrefillWorker

LAYERS = 61
BLOCK_TOKENS = 64
#: Runs of the staging steps alone (they take a millisecond or so each).
STEP_REPEAT = 20


def mla_layout(num_blocks: int) -> KVLayout:
    mla = Geometry(block_size=BLOCK_TOKENS, entry_shape=(576,), dtype="bfloat16")
    layers = tuple(LayerSpec(name=f"model.layers.{i}.self_attn.mla", geometry=mla) for i in range(LAYERS))
    return KVLayout(layers=layers, num_blocks=num_blocks)


def _pattern_like(view: torch.Tensor, shape: torch.Size, seed: int) -> torch.Tensor:
    """Seeded random bytes made on the GPU, the same in every process on this kind of GPU."""
    nbytes = int(np.prod(shape)) * view.element_size()
    generator = torch.Generator(device=view.device).manual_seed(seed)
    values = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=view.device, generator=generator)
    return values.view(view.dtype).reshape(shape)


def _index(view: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(list(blocks), dtype=torch.long, device=view.device)


@contextlib.contextmanager
def _copies_per_op(per_op: bool) -> Iterator[None]:
    saved = cuda_staging.PER_OP_COPIES
    if per_op:
        cuda_staging.PER_OP_COPIES = 1 << 40
    try:
        yield
    finally:
        cuda_staging.PER_OP_COPIES = saved


class BenchPrefill(PrefillWorker):
    async def fill(self, request_id: str, seed: int) -> None:
        agent = self.kvray_agent
        blocks = self._held(request_id)
        for i, layer in enumerate(agent.layout.layer_names):
            view = agent.backing.view(layer)
            index = _index(view, blocks)
            view[index] = _pattern_like(view, view[index].shape, seed + i)
        torch.cuda.synchronize()

    async def timed_push(self, reservation: Any, request_id: str, layerwise: bool) -> dict[str, Any]:
        agent = self.kvray_agent
        blocks = self._held(request_id)
        torch.cuda.synchronize()
        started = time.perf_counter()
        if layerwise:
            await asyncio.gather(
                *(agent.push_layer(reservation, layer, blocks) for layer in agent.layout.layer_names)
            )
            result = await agent.finish(reservation.request_id)
        else:
            result = await agent.push(reservation, blocks)
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "transport": result.transport.value, "nbytes": result.nbytes}

    async def ceiling(self, nbytes: int, repeat: int) -> dict[str, list[float]]:
        """Device -> pinned -> device of `nbytes` on one stream, and each half alone, in seconds."""
        device = torch.device("cuda", torch.cuda.current_device())
        source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        runs: dict[str, list[float]] = {"round trip": [], "D2H": [], "H2D": []}
        for index in range(repeat + 1):
            for name in runs:
                torch.cuda.synchronize()
                started = time.perf_counter()
                with torch.cuda.stream(stream):
                    if name != "H2D":
                        pinned.copy_(source, non_blocking=True)
                    if name != "D2H":
                        target.copy_(pinned, non_blocking=True)
                stream.synchronize()
                if index > 0:
                    runs[name].append(time.perf_counter() - started)
        if not torch.equal(source, target):
            raise AssertionError("the ceiling's copy did not round-trip the bytes")
        del source, pinned, target
        torch.cuda.empty_cache()
        return runs

    async def staging_steps(self, request_id: str, repeat: int) -> dict[str, Any]:
        """The transport's copies for one layer of the request, each way two ways, in seconds."""
        agent = self.kvray_agent
        blocks = self._held(request_id)
        info = agent.info
        plan = plan_transfer(info, info, blocks, blocks, [agent.layout.layer_names[0]])
        (chunk,) = cuda_staging.chunk_ops(plan.ops, cuda_staging.chunk_nbytes(plan.nbytes, 1))
        sources = [region.tensor for region in agent.backing.regions]
        device = sources[0].device
        slots = cuda_staging.PinnedSlots()
        runs: dict[str, list[float]] = {}
        payloads: dict[bool, np.ndarray] = {}
        for per_op in (False, True):
            name = "gather: one D2H copy per op" if per_op else "gather: kernel + one D2H copy"
            runs[name] = []
            with _copies_per_op(per_op):
                for index in range(repeat + 1):
                    gathers = cuda_staging.DeviceGathers(sources, device, slots)
                    started = time.perf_counter()
                    gathered = gathers.start(chunk)
                    await gathers.wait([gathered])
                    if index > 0:
                        runs[name].append(time.perf_counter() - started)
                    payloads[per_op] = gathers.payload(gathered).copy()
                    gathers.release(gathered)
        if not np.array_equal(payloads[False], payloads[True]):
            raise AssertionError("the kernel gather and the per-op gather disagree")
        payload = payloads[False]
        for per_op in (False, True):
            name = (
                "receive: pinned + one H2D copy per op"
                if per_op
                else "receive: pinned + H2D + scatter kernel"
            )
            runs[name] = []
            with _copies_per_op(per_op):
                for index in range(repeat + 1):
                    started = time.perf_counter()
                    # Back where the bytes came from: the same bytes, so the request stays intact.
                    await cuda_staging.receive_payload(
                        sources, chunk.local_region, chunk.local_offset, chunk.nbytes, payload, slots
                    )
                    if index > 0:
                        runs[name].append(time.perf_counter() - started)
        return {"nbytes": chunk.total_nbytes, "ops": len(chunk), "runs": runs}


class BenchDecode(DecodeWorker):
    async def zero(self) -> None:
        for region in self.kvray_agent.backing.regions:
            region.tensor.zero_()
        torch.cuda.synchronize()

    async def wrong_layers(self, blocks: Sequence[int], seed: int) -> list[str]:
        agent = self.kvray_agent
        wrong = []
        for i, layer in enumerate(agent.layout.layer_names):
            view = agent.backing.view(layer)
            landed = view[_index(view, blocks)]
            expected = _pattern_like(view, landed.shape, seed + i)
            if not torch.equal(landed.view(torch.uint8), expected.view(torch.uint8)):
                wrong.append(layer)
        return wrong


def _stats(samples: Sequence[float], nbytes: int, ceiling_s: float | None) -> dict[str, Any]:
    median = statistics.median(samples)
    return {
        "median_ms": median * 1e3,
        "min_ms": min(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
        "runs": len(samples),
        "gb_per_s": nbytes / median / 1e9,
        "x_ceiling": None if ceiling_s is None else median / ceiling_s,
    }


def _row(name: str, stats: dict[str, Any]) -> str:
    ratio = "" if stats["x_ceiling"] is None else f"{stats['x_ceiling']:9.2f}"
    spread = f"{stats['min_ms']:.2f}-{stats['max_ms']:.2f}"
    return f"  {name:44s} {stats['median_ms']:10.2f} {spread:>19s} {stats['gb_per_s']:8.2f} {ratio}".rstrip()


def _machine() -> dict[str, Any]:
    import ray

    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "triton": cuda_staging.triton_available(),
        "dev_shm_free_gib": None if shm is None else round(shm.free / 2**30, 1),
    }


def _cluster(object_store_nbytes: int) -> Any:
    """Two Ray nodes on this machine (loopback addresses), each offering the GPU."""
    import ray
    from ray.cluster_utils import Cluster

    node = {
        "num_cpus": 4,
        "num_gpus": 1,
        "node_ip_address": "127.0.0.1",
        "object_store_memory": object_store_nbytes,
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node, "resources": {"node_a": 10}, "include_dashboard": False},
    )
    cluster.add_node(**node, resources={"node_b": 10})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, namespace="kvray-bench-staging")
    return cluster


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    largest_blocks = max(args.tokens) // BLOCK_TOKENS
    layout = mla_layout(2 * largest_blocks)
    request_nbytes = largest_blocks * LAYERS * layout.layers[0].geometry.block_nbytes
    cluster = _cluster(max(4 << 30, 3 * request_nbytes))
    try:
        settings = Settings(
            transport="auto", transfer_timeout_s=300.0, coordinator_name="kvray-bench-staging"
        )
        prefill = (
            ray.remote(BenchPrefill)
            .options(num_gpus=0.5, resources={"node_a": 1})
            .remote("bench-p", layout, settings, memory=MemoryKind.CUDA, pool_seed=1)
        )
        decode = (
            ray.remote(BenchDecode)
            .options(num_gpus=0.5, resources={"node_b": 1})
            .remote("bench-d", layout, settings, memory=MemoryKind.CUDA, pool_seed=2)
        )
        started = ray.get([prefill.start.remote(), decode.start.remote()])
        if started[0]["node_id"] == started[1]["node_id"]:
            raise AssertionError("the two agents landed on one Ray node")
        report: dict[str, Any] = {"machine": _machine(), "workloads": []}
        for tokens in args.tokens:
            report["workloads"].append(_workload(prefill, decode, tokens, args.repeat))
        return report
    finally:
        ray.shutdown()
        cluster.shutdown()


def _workload(prefill: Any, decode: Any, tokens: int, repeat: int) -> dict[str, Any]:
    import ray

    blocks = tokens // BLOCK_TOKENS
    source_id = f"source-{tokens}"
    ray.get(prefill.allocate.remote(source_id, blocks))
    seed = tokens
    ray.get(prefill.fill.remote(source_id, seed))
    ceiling = ray.get(prefill.ceiling.remote(blocks * LAYERS * BLOCK_TOKENS * 576 * 2, repeat))
    nbytes = 0
    pushes: dict[str, list[float]] = {"whole": [], "layer-wise": []}
    for mode in pushes:
        for run_index in range(repeat + 1):  # the first run of each mode warms up
            request_id = f"{tokens}-{mode}-{run_index}"
            ray.get(decode.zero.remote())
            reservation = ray.get(decode.reserve.remote(request_id, blocks))
            waiting = decode.wait.remote(request_id, 300.0)
            result = ray.get(prefill.timed_push.remote(reservation, source_id, mode == "layer-wise"))
            ray.get(waiting)
            if result["transport"] != TransportKind.RAY.value:
                raise AssertionError(f"the push went over {result['transport']}, not ray")
            wrong = ray.get(decode.wrong_layers.remote(list(reservation.blocks), seed))
            if wrong:
                raise AssertionError(f"{request_id}: layers {wrong[:4]} hold wrong bytes at the decode GPU")
            ray.get(decode.release.remote(request_id))
            nbytes = result["nbytes"]
            if run_index > 0:
                pushes[mode].append(result["seconds"])
    steps = ray.get(prefill.staging_steps.remote(source_id, STEP_REPEAT))
    ray.get(prefill.release.remote(source_id))
    ceiling_s = statistics.median(ceiling["round trip"])
    rows = {
        "pinned ceiling: D2H + H2D, one stream": _stats(ceiling["round trip"], nbytes, ceiling_s),
        "  D2H into pinned": _stats(ceiling["D2H"], nbytes, None),
        "  H2D from pinned": _stats(ceiling["H2D"], nbytes, None),
        "kvray ray, whole push": _stats(pushes["whole"], nbytes, ceiling_s),
        f"kvray ray, layer-wise ({LAYERS} pushes + finish)": _stats(pushes["layer-wise"], nbytes, ceiling_s),
    }
    step_rows = {name: _stats(samples, steps["nbytes"], None) for name, samples in steps["runs"].items()}
    return {
        "tokens": tokens,
        "blocks": blocks,
        "nbytes": nbytes,
        "rows": rows,
        "staging_steps": {"nbytes": steps["nbytes"], "ops": steps["ops"], "rows": step_rows},
    }


def format_report(report: dict[str, Any], repeat: int) -> str:
    machine = report["machine"]
    lines = [
        "GPU KV over the ray transport, staged through pinned host memory (two Ray nodes, one GPU)",
        f"{machine['date']}, {machine['gpu']}, {machine['cpus']} CPUs, torch {machine['torch']}, "
        f"Ray {machine['ray']}, Triton {'yes' if machine['triton'] else 'no'}, "
        f"/dev/shm free {machine['dev_shm_free_gib']} GiB",
    ]
    header = f"  {'':44s} {'median ms':>10s} {'min-max ms':>19s} {'GB/s':>8s} {'x ceiling':>9s}"
    for workload in report["workloads"]:
        lines += [
            "",
            f"DeepSeek-V3 MLA, {workload['tokens']} tokens ({workload['blocks']} scattered blocks x "
            f"{LAYERS} layers, {workload['nbytes'] / 1e6:.1f} MB), {repeat} runs",
            header,
        ]
        lines += [_row(name, stats) for name, stats in workload["rows"].items()]
        steps = workload["staging_steps"]
        lines += [
            f"  staging steps alone, one layer ({steps['nbytes'] / 1e6:.2f} MB, {steps['ops']} ops), "
            f"{STEP_REPEAT} runs:",
        ]
        lines += [_row(f"  {name}", stats) for name, stats in steps["rows"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="request sizes")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each push (after one warm-up)")
    parser.add_argument("--json", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_staging needs a CUDA device", file=sys.stderr)
        return 2
    if any(tokens % BLOCK_TOKENS or tokens <= 0 for tokens in args.tokens):
        parser.error(f"--tokens must be positive multiples of {BLOCK_TOKENS}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    report = run(args)
    print(format_report(report, args.repeat))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"repeat": args.repeat, **report}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
