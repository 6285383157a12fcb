"""The connector's hand-off on one GPU: `KvrayConnector`'s worker side in two Ray GPU actors (a
prefill and a decode engine, played as vLLM's GPU worker plays them: `tests/gpu/connector_actors`),
DeepSeek-V3's MLA cache (61 layers of 576 bf16 per token, 64 tokens a block, vLLM's [B, H, N, C]
views), against a same-GPU device copy of the same bytes measured in the same run.

    python benchmarks/bench_gpu_connector.py [--repeat 10] [--tokens 4096 16384] [--json out.json]
    PYTHONPATH=tests/gpu python benchmarks/bench_gpu_connector.py --device cpu [--tokens 64 1024]
    PYTHONPATH=tests/gpu python benchmarks/bench_gpu_connector.py --device cpu --layers 1 --block-size 16 \
        --pool 32768 --tokens 16384

`--layers`, `--block-size` and `--pool` change the cache (61 layers, 64 tokens a block, a pool of
one stream's blocks by default): a pool of an engine's real size, with each request's blocks
scattered over it, shows what grows with the pool and with the blocks of a request rather than
with its bytes.

`--device cpu` runs the same hand-off over CPU caches (the decode engine's in a shared-memory
file, the `shm` transport); a request of one block (64 tokens) is then almost all host time.
On either device routine hand-offs take the prefill engine's native lane (`kvray.agent.lane`:
on a GPU its C thread launches the pair's captured row copy); `--lane both` runs each length
without it first, then with it, as the baseline of the same run.

Per prompt length:
- `one request`: the prefill engine holds the request (taking its blocks' content digests,
  before the clock); the decode engine's step hands over the load (`bind_connector_metadata`);
  timed until its `get_finished` reports the request received
  (the push request, the plan, the cuda_ipc copy and the completion all inside), one at a time;
- `stream of 16`: 16 such loads handed over in one step, until all 16 are reported;
- `device copy`: one `copy_` of the request's bytes between two plain allocations on the GPU.
Ratios are the copy's time over the hand-off's (1.0: as fast as the copy), medians over the
repeats. Every hand-off's blocks are compared by GPU digests afterwards: a wrong byte fails.
Host CPU per hand-off: the CPU time of each engine's kvray event-loop thread over the timed
hand-offs of a kind (the prefill side's hold of each included), divided by their number; with the
native lane also the decode engine's own thread inside kvray's calls (`begin`, `finished`) and
the prefill engine's lane thread (which copies a request of up to 4 MiB itself on a CPU, and
launches the copy on a GPU) and, apart, on a GPU the lane's finisher (which waits for each copy's
event, the driver spinning meanwhile) and on a CPU the lane's hasher (the hold's content sums,
hashed by a worker thread of the loop's without the lane); the copy pool's threads are not in it. A shared
machine's noise moves it far less than it moves times on the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any

import torch

BLOCK_SIZE = 64
LAYERS = 61
STREAM = 16
#: How often the decode engine's thread asks for finished hand-offs (vLLM asks once a step).
POLL_S = 100e-6


class Engine:
    """A `VllmGpuWorker` with timing loops (runs in a Ray GPU actor)."""

    def __init__(
        self,
        engine_id: str,
        num_blocks: int,
        producer: bool,
        breakdown: bool = False,
        device: str = "cuda",
        layers: int = LAYERS,
        block_size: int = BLOCK_SIZE,
        lane: bool = True,
    ) -> None:
        from connector_actors import VllmGpuWorker

        if breakdown:
            from kvray.bench import step_times

            step_times.install()

        from kvray.config import Settings
        from tests.vllm_layouts import CacheShape

        shape = CacheShape(layers, num_blocks, block_size, 1, 576, torch.bfloat16)
        settings = Settings(transfer_timeout_s=60.0, max_concurrent_transfers=STREAM, native_lane=lane)
        self.device = device
        self.engine = VllmGpuWorker(engine_id, "LBNHC", shape, settings, producer=producer, device=device)
        self._engine_thread_s = 0.0

    def kvray_file(self) -> str:
        import kvray

        return str(kvray.__file__)

    def setup(self, seed: int) -> dict[str, Any]:
        self.engine.fill(seed)
        registered = self.engine.register()
        loop = self.engine.worker._loop
        assert loop is not None
        self._loop_clock = time.pthread_getcpuclockid(loop.run(_thread_ident()))
        return registered

    def loop_cpu(self) -> tuple[float, float, float, float, float]:
        """CPU seconds this engine's kvray has run so far: its event-loop thread, the engine's
        own thread inside kvray's calls (`begin`, `finished`), the native lane's thread, on a
        GPU the lane's finisher (which waits for each copy's event: the driver spins), and on
        a CPU the lane's hasher (which takes a hold's content sums)."""
        threads = {"kvray-lane": 0.0, "kvray-lane-gpu": 0.0, "kvray-lane-hash": 0.0}
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as comm:
                    name = comm.read().strip()
                if name not in threads:
                    continue
                with open(f"/proc/self/task/{task}/schedstat") as schedstat:
                    threads[name] += int(schedstat.read().split()[0]) / 1e9  # ns on the CPU
            except OSError:
                continue
        return (
            time.clock_gettime(self._loop_clock),
            self._engine_thread_s,
            threads["kvray-lane"],
            threads["kvray-lane-gpu"],
            threads["kvray-lane-hash"],
        )

    def lane_answers(self) -> dict[str, int]:
        return self.engine.lane_answers()

    def setup_fill(self, seed: int) -> None:
        self.engine.fill(seed)

    def hold(self, key: str, blocks: list[int]) -> None:
        self.engine.hold(key, key, blocks)

    def handoffs(self, prefill: dict[str, Any], batches: list[list[tuple[str, list[int]]]]) -> list[float]:
        """Seconds from handing each batch of loads over (one step) to the last one reported."""
        from connector_actors import load_specs

        from kvray.agent.handoff import HandoffStep

        worker = self.engine.worker
        times = []
        for batch in batches:
            loads = load_specs(prefill, [(key, key, blocks) for key, blocks in batch])
            waiting = set(loads)
            started = time.perf_counter()
            cpu = time.thread_time()
            worker.begin(HandoffStep(loads=loads))
            self._engine_thread_s += time.thread_time() - cpu
            while waiting:
                cpu = time.thread_time()
                _, received, _, failed = worker.finished()
                self._engine_thread_s += time.thread_time() - cpu
                if failed & waiting:
                    raise RuntimeError(f"hand-offs failed: {sorted(failed & waiting)}")
                waiting -= received
                if waiting:
                    time.sleep(POLL_S)
            times.append(time.perf_counter() - started)
        return times

    def digests(self, blocks: list[int]) -> dict[str, list[int]]:
        return self.engine.digests(blocks)

    def stamps(self) -> list[tuple[str, float]]:
        from kvray.bench import step_times

        return step_times.taken()

    def device_copy(self, nbytes: int, repeat: int) -> list[float]:
        source = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        target = torch.zeros_like(source)
        cuda = self.device == "cuda"
        times = []
        for _ in range(repeat + 2):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            target.copy_(source)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return times[2:]

    def shutdown(self) -> None:
        self.engine.shutdown()


async def _thread_ident() -> int:
    return threading.get_ident()


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(seconds) * 1e3,
        "min_ms": min(seconds) * 1e3,
        "max_ms": max(seconds) * 1e3,
    }


def run(
    tokens: int,
    repeat: int,
    remote: Any,
    breakdown: bool = False,
    device: str = "cuda",
    layers: int = LAYERS,
    block_size: int = BLOCK_SIZE,
    pool: int = 0,
    lane: bool = True,
) -> dict[str, Any]:
    import random

    import ray

    per_request = tokens // block_size
    runs = repeat + 2  # two warm-up runs of each
    # Both engines have room for one stream (or `pool` blocks); the decode engine's blocks are
    # reused once a hand-off into them is reported (as vLLM reuses them).
    num_blocks = max(pool, per_request * STREAM)
    shape = (layers, block_size)
    prefill = remote.remote(f"bench-p-{tokens}", num_blocks, True, breakdown, device, *shape, lane)
    decode = remote.remote(f"bench-d-{tokens}", num_blocks, False, breakdown, device, *shape, lane)
    p_info, _ = ray.get([prefill.setup.remote(1), decode.setup.remote(2)])
    kvray_file = ray.get(decode.kvray_file.remote())
    nbytes = per_request * layers * block_size * 576 * 2
    # A pool larger than a stream: each request's blocks scattered over it, as an engine's are.
    order = list(range(num_blocks))
    if num_blocks > per_request * STREAM:
        random.Random(7).shuffle(order)

    def blocks(index: int) -> list[int]:
        return order[index * per_request : (index + 1) * per_request]

    singles = [[(f"one-{tokens}-{i}", blocks(0))] for i in range(runs)]
    streams = [[(f"stream-{tokens}-{r}-{i}", blocks(i)) for i in range(STREAM)] for r in range(runs)]

    def handoffs(batches: list[list[tuple[str, list[int]]]]) -> list[float]:
        """Each batch held by the prefill engine just before it is handed over, as a finished
        request's blocks are. A hold takes its blocks' content digests (`KVAgent.hold_digests`:
        a kernel on the GPU, a thread on the CPU; the push's check then reads no source byte)
        and is given the time they take, so that a push never reads the digests of an earlier
        hold of the same blocks."""
        rate = 2e11 if device == "cuda" else 2e9
        times = []
        for batch in batches:
            ray.get([prefill.hold.remote(key, taken) for key, taken in batch])
            time.sleep(0.01 + len(batch) * nbytes / rate)
            times += ray.get(decode.handoffs.remote(p_info, [batch]))
        return times

    Clocks = tuple[float, float, float, float, float]

    def loop_cpu() -> list[Clocks]:
        return list(ray.get([prefill.loop_cpu.remote(), decode.loop_cpu.remote()]))

    def per_handoff_us(before: list[Clocks], after: list[Clocks], count: int) -> dict[str, float]:
        (p0, _, lane0, wait0, hash0), (d0, engine0, _, _, _) = before
        (p1, _, lane1, wait1, hash1), (d1, engine1, _, _, _) = after
        return {
            "prefill_us": (p1 - p0) / count * 1e6,
            "decode_us": (d1 - d0) / count * 1e6,
            "decode_engine_us": (engine1 - engine0) / count * 1e6,
            "prefill_lane_us": (lane1 - lane0) / count * 1e6,
            "prefill_finisher_us": (wait1 - wait0) / count * 1e6,
            "prefill_hasher_us": (hash1 - hash0) / count * 1e6,
        }

    ray.get([prefill.stamps.remote(), decode.stamps.remote()])  # set-up's stamps
    handoffs(singles[:2])  # warm-ups (a pair's first hand-off maps, plans and caches)
    before = loop_cpu()
    one = handoffs(singles[2:])
    one_cpu = per_handoff_us(before, loop_cpu(), len(one))
    steps: list[tuple[str, float]] = []
    if breakdown:
        from kvray.bench.step_times import timeline

        steps = timeline(ray.get(decode.stamps.remote()), ray.get(prefill.stamps.remote()))
    landed = ray.get(decode.digests.remote(blocks(0)))
    assert landed == ray.get(prefill.digests.remote(blocks(0))), "a hand-off's bytes differ"
    ray.get(decode.setup_fill.remote(3))  # scrubbed: the stream's bytes must land again
    handoffs(streams[:2])
    before = loop_cpu()
    many = handoffs(streams[2:])
    many_cpu = per_handoff_us(before, loop_cpu(), len(many) * STREAM)
    every = [block for index in range(STREAM) for block in blocks(index)]
    assert ray.get(decode.digests.remote(every)) == ray.get(prefill.digests.remote(every)), (
        "a stream's bytes differ"
    )
    copy = ray.get(decode.device_copy.remote(nbytes, repeat))
    answers = ray.get(decode.lane_answers.remote())
    ray.get([prefill.shutdown.remote(), decode.shutdown.remote()])
    for actor in (prefill, decode):
        ray.kill(actor)
    copy_s = statistics.median(copy)
    return {
        "tokens": tokens,
        "lane": lane,
        "lane_answers": answers,
        "nbytes": nbytes,
        "device_copy": summary(copy),
        "one_request": summary(one),
        "stream_of_16": summary(many),
        "one_request_ratio": copy_s / statistics.median(one),
        "stream_ratio": STREAM * copy_s / statistics.median(many),
        "one_request_steps_ms": steps,
        "one_request_loop_cpu": one_cpu,
        "stream_loop_cpu": many_cpu,
        "kvray": kvray_file,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument(
        "--tokens", type=int, nargs="+", help="prompt lengths (4096 16384; on the CPU 64 1024)"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the same hand-off over CPU caches (shm), where a short request's time is host time",
    )
    parser.add_argument("--layers", type=int, default=LAYERS, help="layers of the cache (61)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens a block (64)")
    parser.add_argument(
        "--pool", type=int, default=0, help="blocks of each engine's cache (default: one stream's)"
    )
    parser.add_argument(
        "--lane",
        choices=("on", "off", "both"),
        default="on",
        help="the native lane (Settings.native_lane); both: each length without, then with",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--breakdown", action="store_true", help="also time the hand-off's steps (kvray.bench.step_times)"
    )
    args = parser.parse_args()
    cpu = args.device == "cpu"
    tokens = args.tokens or ([64, 1024] if cpu else [4096, 16384])
    if not cpu and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu)")
        return 2
    import connector_actors
    import ray
    import ray.cloudpickle

    import tests.vllm_layouts

    ray.init(
        address="local", num_cpus=2, num_gpus=0 if cpu else 1, include_dashboard=False, log_to_driver=False
    )
    for module in (connector_actors, tests.vllm_layouts):
        ray.cloudpickle.register_pickle_by_value(module)
    remote = ray.remote(num_cpus=1)(Engine) if cpu else ray.remote(num_gpus=0.5)(Engine)
    shape = (args.layers, args.block_size, args.pool)
    lanes = {"on": [True], "off": [False], "both": [False, True]}[args.lane]
    results = [
        run(count, args.repeat, remote, args.breakdown, args.device, *shape, lane)
        for count in tokens
        for lane in lanes
    ]
    ray.shutdown()
    device = f"CPU ({os.cpu_count()} cores)" if cpu else torch.cuda.get_device_name(0)
    pool = args.pool or "a stream's"
    cache = "DeepSeek-V3 MLA cache"
    if shape != (LAYERS, BLOCK_SIZE, 0):
        cache = f"MLA cache of {args.layers} layers, {args.block_size} tokens a block, {pool} blocks"
    print(f"kvray connector hand-off on one {device}, {cache}, {args.repeat} runs each")
    print(f"kvray from {results[0]['kvray']}")
    header = (
        "tokens",
        "lane",
        "MiB",
        "copy ms",
        "one ms",
        "one min-max",
        "one x",
        "16 ms",
        "16 min-max",
        "16 x",
    )
    print("{:>7} {:>4} {:>6} {:>8} {:>8} {:>13} {:>6} {:>8} {:>15} {:>6}".format(*header))
    for row in results:
        one, many = row["one_request"], row["stream_of_16"]
        print(
            "{:>7} {:>4} {:>6.0f} {:>8.3f} {:>8.3f} {:>13} {:>6.2f} {:>8.3f} {:>15} {:>6.2f}".format(
                row["tokens"],
                "on" if row["lane"] else "off",
                row["nbytes"] / 2**20,
                row["device_copy"]["median_ms"],
                one["median_ms"],
                f"{one['min_ms']:.2f}-{one['max_ms']:.2f}",
                row["one_request_ratio"],
                many["median_ms"],
                f"{many['min_ms']:.2f}-{many['max_ms']:.2f}",
                row["stream_ratio"],
            )
        )
    print(
        "host CPU per hand-off (us): kvray's event-loop thread of each engine (the prefill's hold "
        "included), the prefill's lane threads, the decode engine's own thread in kvray's calls"
    )
    for row in results:
        one, many = row["one_request_loop_cpu"], row["stream_loop_cpu"]
        lane = "on" if row["lane"] else "off"
        print(
            f"{row['tokens']:>7} tokens, lane {lane}: one request prefill loop {one['prefill_us']:.0f} "
            f"+ lane {one['prefill_lane_us']:.0f} (finisher {one['prefill_finisher_us']:.0f}, hasher "
            f"{one['prefill_hasher_us']:.0f}), decode loop "
            f"{one['decode_us']:.0f} + engine thread {one['decode_engine_us']:.0f}; stream of 16 prefill "
            f"loop {many['prefill_us']:.0f} + lane {many['prefill_lane_us']:.0f} (finisher "
            f"{many['prefill_finisher_us']:.0f}, hasher {many['prefill_hasher_us']:.0f}), decode loop "
            f"{many['decode_us']:.0f} + engine thread {many['decode_engine_us']:.0f}"
        )
    for row in results:
        if row["lane"]:
            answers = ", ".join(f"{name} {count}" for name, count in sorted(row["lane_answers"].items()))
            print(f"{row['tokens']:>7} tokens, lane on: how the lane answered the decode engine: {answers}")
    for row in results:
        if row["one_request_steps_ms"]:
            steps = ", ".join(f"{name} {at:.3f}" for name, at in row["one_request_steps_ms"])
            print(f"{row['tokens']} tokens, one request, ms after the decode step began: {steps}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": device, "host": platform.node(), "results": results}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
