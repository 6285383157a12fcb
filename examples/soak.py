"""Soak: thousands of randomized transfers between real Ray actors, every byte checked.

    python examples/soak.py                        # the full run: 10,000 transfers, 4 groups
    python examples/soak.py --transfers 500 --groups 2   # the quick variant CI runs
                                                   # (tests/reliability/test_soak.py)

A group is one decode worker and two prefill workers around one layout, one prefill pushing over
shm and one over ray. Group 0 uses the ready-made mixed layout (MLA, split K/V and indexer
layers); the others use random layouts (geometries, dtypes, layer counts); the groups alternate
block orders. Every request is random: 1..--max-blocks blocks into random free blocks, all
layers or a random subset, whole or layer-wise, up to --concurrency at once across the groups.

Canaries: every decode allocation (region, padding and slack) is filled with a seeded pattern,
and the decode actor keeps a copy. After each transfer it compares the request's blocks with the
bytes the prefill wrote (regenerated from the request's seed) and the blocks' unpushed layers
with the canary, restores the canary and frees the blocks; every --sweep transfers and at the
end it compares its whole allocation, outside the requests in flight, with the canary copy.

Reports transfers, bytes, corrupt bytes (must be 0), leaked blocks (must be 0: every pool full
and no request held at the end), failed transfers (must be 0) and the peak RSS growth of the
actors after the first sweep (warm-up). Exits non-zero if anything is not as it must be.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import ray

from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import BackpressureError, KvrayError
from kvray.layout import BlockOrder, Geometry, KVLayout, LayerSpec, mixed
from kvray.workers import DecodeWorker, PrefillWorker

ByteArray = npt.NDArray[np.uint8]
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8", "uint8")


def pattern(layout: KVLayout, count: int, seed: int) -> dict[str, ByteArray]:
    """The bytes a request of `count` blocks holds, per layer, in `read_blocks` order."""
    rng = np.random.default_rng(seed)
    return {
        spec.name: rng.integers(0, 256, count * spec.geometry.block_nbytes, dtype=np.uint8)
        for spec in layout.layers
    }


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class SoakPrefill(PrefillWorker):
    async def prepare(self, request_id: str, count: int, seed: int) -> list[int]:
        """Allocate the request's blocks and write its pattern into them (a forward pass)."""
        blocks = await self.allocate(request_id, count)
        await self.write_blocks(blocks, pattern(self.kvray_agent.layout, count, seed))
        return blocks

    async def rss_mib(self) -> float:
        return _rss_mib()


class SoakDecode(DecodeWorker):
    _canary: ByteArray

    async def arm(self, seed: int) -> None:
        """Fill the whole allocation with a seeded pattern and keep a copy of it."""
        await self.fill_region(seed)
        self._canary = self._allocation().copy()

    def _allocation(self) -> ByteArray:
        (region,) = self.kvray_agent.backing.regions
        assert region.allocation is not None
        return region.allocation.numpy()

    def _ranges(self, blocks: Sequence[int], layers: Sequence[str]) -> list[tuple[int, int]]:
        """Allocation byte ranges of the given blocks of the given layers."""
        backing = self.kvray_agent.backing
        region_offset = backing.regions[0].span.offset_in_allocation
        ranges = []
        for layer in layers:
            placement = backing.placements[layer]
            for block in blocks:
                for part in range(placement.parts):
                    start = region_offset + placement.byte_offset(part, block)
                    ranges.append((start, start + placement.part_nbytes))
        return ranges

    async def check_and_release(
        self, request_id: str, count: int, seed: int, layers: Sequence[str] | None
    ) -> int:
        """Corrupt bytes of one finished request: pushed layers against the pattern, the other
        layers of its blocks against the canary. Then the canary goes back and the blocks free."""
        layout = self.kvray_agent.layout
        blocks = self.requests[request_id]
        pushed = set(layers or layout.layer_names)
        expected = pattern(layout, count, seed)
        landed = await self.read_blocks(blocks, sorted(pushed))
        corrupt = sum(int(np.count_nonzero(landed[layer].reshape(-1) != expected[layer])) for layer in pushed)
        allocation = self._allocation()
        untouched = [layer for layer in layout.layer_names if layer not in pushed]
        for start, stop in self._ranges(blocks, untouched):
            corrupt += int(np.count_nonzero(allocation[start:stop] != self._canary[start:stop]))
        for start, stop in self._ranges(blocks, layout.layer_names):
            allocation[start:stop] = self._canary[start:stop]
        await self.release(request_id)
        return corrupt

    async def wait(self, request_id: str, timeout: float | None = None) -> Any:
        """A failed wait frees the request's blocks: put their canary back first, so a sweep
        counts corruption of live data, not a failed transfer's leftovers (reported apart)."""
        blocks = self.requests.get(request_id, [])
        try:
            return await super().wait(request_id, timeout)
        except BaseException:
            allocation = self._allocation()
            for start, stop in self._ranges(blocks, self.kvray_agent.layout.layer_names):
                allocation[start:stop] = self._canary[start:stop]
            raise

    async def sweep(self) -> int:
        """Bytes that differ from the canary anywhere outside the blocks of requests in flight."""
        allocation = self._allocation()
        outside = np.ones(allocation.size, dtype=bool)
        for blocks in self.requests.values():
            for start, stop in self._ranges(blocks, self.kvray_agent.layout.layer_names):
                outside[start:stop] = False
        return int(np.count_nonzero((allocation != self._canary) & outside))

    async def rss_mib(self) -> float:
        return _rss_mib()


def random_layout(rng: random.Random, num_blocks: int, order: BlockOrder) -> KVLayout:
    """A layout of 1..6 layers of random geometries (some repeated, as real models repeat them)."""
    geometries = [
        Geometry(
            block_size=rng.choice([1, 3, 8, 16]),
            entry_shape=rng.choice([(rng.randint(1, 96),), (rng.randint(1, 8), rng.randint(1, 64))]),
            dtype=rng.choice(DTYPES),
            parts=rng.choice([1, 2]),
        )
        for _ in range(rng.randint(1, 3))
    ]
    layers = tuple(
        LayerSpec(name=f"layers.{i}", geometry=rng.choice(geometries)) for i in range(rng.randint(1, 6))
    )
    return KVLayout(layers=layers, num_blocks=num_blocks, block_order=order)


@dataclass
class SoakReport:
    transfers: int = 0
    nbytes: int = 0
    corrupt_bytes: int = 0
    leaked_blocks: int = 0
    failed: int = 0
    retried: int = 0
    peak_rss_growth_mib: float = 0.0
    seconds: float = 0.0
    by_transport: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    groups: list[str] = field(default_factory=list)
    #: Resident MiB of all actors after each sweep (the first one is the baseline).
    rss_mib: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {
            **{name: dict(value) if isinstance(value, Counter) else value for name, value in fields.items()},
            "line": self.line(),
        }

    @property
    def ok(self) -> bool:
        return self.corrupt_bytes == 0 and self.leaked_blocks == 0 and self.failed == 0

    def line(self) -> str:
        return (
            f"[kvray soak] transfers={self.transfers} bytes={self.nbytes} corrupt_bytes={self.corrupt_bytes} "
            f"leaked_blocks={self.leaked_blocks} failed={self.failed} "
            f"peak_rss_growth={self.peak_rss_growth_mib:.1f} MiB "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.by_transport.items()))}; "
            f"{', '.join(f'{k} {v}' for k, v in sorted(self.by_kind.items()))}; "
            f"{len(self.groups)} groups; {self.seconds:.0f} s)"
        )


@dataclass
class _Group:
    layout: KVLayout
    decode_id: str
    decode: Any
    prefills: list[Any]


async def run_soak(
    transfers: int,
    *,
    seed: int = 0,
    groups: int = 4,
    concurrency: int = 16,
    max_blocks: int = 6,
    sweep: int = 250,
    progress: Callable[[str], None] | None = None,
) -> SoakReport:
    """Run the soak on the Ray this process is connected to; the actors are killed after."""
    started = time.perf_counter()
    rng = random.Random(seed)
    num_blocks = concurrency * max_blocks  # a group never runs out, whichever requests land on it
    shm = Settings(transport="shm", coordinator_name="kvray-soak", transfer_timeout_s=120.0)
    ray_ = Settings(transport="ray", coordinator_name="kvray-soak", transfer_timeout_s=120.0)
    decode_actor, prefill_actor = ray.remote(SoakDecode), ray.remote(SoakPrefill)
    report = SoakReport()
    built: list[_Group] = []
    for g in range(groups):
        order = BlockOrder.BLOCK_MAJOR if g % 2 else BlockOrder.LAYER_MAJOR
        layout = mixed(num_blocks, order) if g == 0 else random_layout(rng, num_blocks, order)
        decode_id = f"soak-{seed}-d{g}"
        built.append(
            _Group(
                layout,
                decode_id,
                decode_actor.remote(decode_id, layout, shm, pool_seed=seed + g),
                [
                    prefill_actor.remote(f"soak-{seed}-p{g}-shm", layout, shm, pool_seed=seed + g + 100),
                    prefill_actor.remote(f"soak-{seed}-p{g}-ray", layout, ray_, pool_seed=seed + g + 200),
                ],
            )
        )
        report.groups.append(
            f"{order.value} {len(layout.layers)} layers, {layout.nbytes // num_blocks} bytes a block"
        )
    actors = [actor for group in built for actor in (group.decode, *group.prefills)]
    try:
        await get_or_create_coordinator(shm).stats.remote()  # up before a dozen engines register
        await asyncio.gather(*(actor.start.remote() for actor in actors))
        await asyncio.gather(*(group.decode.arm.remote(seed + 1000 + g) for g, group in enumerate(built)))
        slots = asyncio.Semaphore(concurrency)

        async def one(index: int) -> None:
            draw = random.Random(seed * 1_000_003 + index)
            group = draw.choice(built)
            prefill = draw.choice(group.prefills)
            names = group.layout.layer_names
            count = draw.randint(1, max_blocks)
            layers = None if draw.random() < 0.6 else draw.sample(names, draw.randint(1, len(names)))
            layerwise = draw.random() < 0.3
            pattern_seed = draw.getrandbits(32)
            request_id = f"soak-{index}"
            async with slots:
                for attempt in range(100):
                    try:
                        await prefill.prepare.remote(request_id, count, pattern_seed)
                        break
                    except BackpressureError:  # the pool is busy: wait, as a scheduler would
                        report.retried += 1
                        await asyncio.sleep(0.01 * (attempt + 1))
                try:
                    reservation = await group.decode.reserve.remote(request_id, count, layers=layers)
                    waiting = group.decode.wait.remote(request_id, 120.0)
                    pushed = await prefill.push.remote(reservation, layers=layers, layerwise=layerwise)
                    await waiting
                except KvrayError as error:
                    report.failed += 1
                    if report.failed == 1:
                        print("FIRST FAILURE", str(error)[-6000:])
                    return
                report.corrupt_bytes += await group.decode.check_and_release.remote(
                    request_id, count, pattern_seed, layers
                )
            report.transfers += 1
            report.nbytes += pushed.nbytes
            report.by_transport[pushed.transport.value] += 1
            report.by_kind["layer-wise" if layerwise else "whole"] += 1

        async def rss() -> list[float]:
            """Resident MiB of the decodes, the shm prefills and the ray prefills."""
            roles = [[group.decode for group in built], [group.prefills[0] for group in built]]
            roles.append([group.prefills[1] for group in built])
            return [float(sum(await asyncio.gather(*(a.rss_mib.remote() for a in role)))) for role in roles]

        baseline: float | None = None
        for batch_start in range(0, transfers, sweep):
            await asyncio.gather(*(one(i) for i in range(batch_start, min(transfers, batch_start + sweep))))
            report.corrupt_bytes += sum(await asyncio.gather(*(g.decode.sweep.remote() for g in built)))
            by_role = await rss()
            resident = sum(by_role)
            if baseline is None:
                baseline = resident
            report.peak_rss_growth_mib = max(report.peak_rss_growth_mib, resident - baseline)
            report.rss_mib.append(round(resident, 1))
            if progress is not None:
                decodes, shm_prefills, ray_prefills = by_role
                progress(
                    f"  {report.transfers}/{transfers} transfers, {report.nbytes / 2**20:.0f} MiB, "
                    f"corrupt {report.corrupt_bytes}, failed {report.failed}, actors' RSS {resident:.0f} "
                    f"MiB (decodes {decodes:.0f}, shm prefills {shm_prefills:.0f}, ray prefills "
                    f"{ray_prefills:.0f})"
                )
        stats = await asyncio.gather(*(actor.stats.remote() for actor in actors))
        report.leaked_blocks = sum(s["used_blocks"] for s in stats) + sum(s["requests"] for s in stats)
    finally:
        for actor in actors:
            ray.kill(actor)
    report.seconds = time.perf_counter() - started
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-blocks", type=int, default=6)
    parser.add_argument("--sweep", type=int, default=250, help="transfers between full canary sweeps")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--address", help="join this Ray cluster (default: start a local one)")
    args = parser.parse_args(argv)
    ray.init(address=args.address or "local", include_dashboard=False, log_to_driver=False)
    try:
        report = asyncio.run(
            run_soak(
                args.transfers,
                seed=args.seed,
                groups=args.groups,
                concurrency=args.concurrency,
                max_blocks=args.max_blocks,
                sweep=args.sweep,
                progress=print,
            )
        )
    finally:
        ray.shutdown()
    print(report.line())
    if report.errors:
        print(f"  failures: {dict(report.errors)}")
    for description in report.groups:
        print(f"  group: {description}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report.to_json(), out, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
