"""kvray's completion latency against its floor on this machine, in one run: how long the bare
channels take, with no kvray code, between two Ray async actors, from the sender's clock to a
task waiting in the receiver's event loop resuming; and how long kvray's notice paths take
between the same two actors, from the writer's clock just before `finish` (the notice alone:
the layer's bytes were written by an earlier call) to the decode side's `wait_for_kv` returning.

    python benchmarks/bench_completion_floor.py [--runs 200] [--idle-ms 2] [--json floor.json]

- `unix datagram`: a datagram into a socket the receiver's loop watches (`add_reader`), which
  resolves the future a task awaits; kvray's same-node path does this plus its checks.
- `tcp`: one small message over an open loopback TCP connection to a protocol whose
  `data_received` resolves the future; kvray's path across nodes does this plus its HMACs,
  its checks and a verdict.
- `ray call`: a call on the receiver's async method, which resolves the future (the call is not
  awaited, as a notice needs no answer to wake the receiver).
- `kvray same node`: a prefill agent's `finish` into a decode agent on its node (its inbox).
- `kvray other node`: the same from a prefill agent that says it runs on another node, so its
  notice goes over the decode engine's authenticated TCP listener (as across nodes).

The ratios printed last are kvray's medians over their floors': the same-node path over the
datagram's, the other-node path over the TCP connection's. Each sample of every channel is
taken in turn, so a noisy moment of a shared machine hits them all.

Both clocks are `time.perf_counter` (CLOCK_MONOTONIC, one clock for every process of the
machine). Compare with `kvray bench`'s completion latency rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import ray

from kvray.agent import KVAgent
from kvray.config import Settings
from kvray.host import AgentHost
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.memory import MemoryKind
from kvray.wire import EngineInfo, Reservation, Role

#: One small layer: the notice, not the bytes, is what is timed.
LAYOUT = KVLayout(
    layers=(LayerSpec(name="layer0", geometry=Geometry(block_size=16, entry_shape=(64,), dtype="uint8")),),
    num_blocks=8,
)
#: Where the writer whose notices take the path across nodes says it runs.
OTHER_NODE = "bench-another-node"
SAME_NODE = "kvray same node"
OTHER_NODES = "kvray other node"
#: Which floor each kvray path is compared with.
FLOOR_OF = {SAME_NODE: "unix datagram", OTHER_NODES: "tcp"}


@ray.remote
class Receiver(AgentHost):
    """Waits for one wake-up at a time on each channel and stamps when its task resumes; hosts
    the decode agent (an `AgentHost`, so the writer on "another node" can write through Ray)."""

    async def open(self) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self.waiting: asyncio.Future[None] | None = None
        self.folder = tempfile.mkdtemp(prefix="floor-")
        self.path = os.path.join(self.folder, "inbox.sock")
        self.datagrams = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.datagrams.setblocking(False)
        self.datagrams.bind(self.path)
        loop.add_reader(self.datagrams.fileno(), self._datagram)
        receiver = self

        class Stream(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                receiver._wake()

        self.server = await loop.create_server(Stream, "127.0.0.1", 0)
        return self.path, int(self.server.sockets[0].getsockname()[1])

    def _datagram(self) -> None:
        try:
            self.datagrams.recv(4096)
        except OSError:
            return
        self._wake()

    def _wake(self) -> None:
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(None)

    async def arm(self) -> None:
        self.waiting = asyncio.get_running_loop().create_future()
        self.resumed = asyncio.get_running_loop().create_task(self._resumed(self.waiting))

    async def _resumed(self, waiting: asyncio.Future[None]) -> float:
        await waiting
        return time.perf_counter()

    async def notify(self) -> None:
        self._wake()

    async def seen(self) -> float:
        return await asyncio.wait_for(self.resumed, 10)

    async def open_agent(self) -> EngineInfo:
        settings = Settings.from_env(notice_host="127.0.0.1", transfer_timeout_s=30.0)
        self.kvray_agent = KVAgent(
            "floor-decode",
            Role.DECODE,
            LAYOUT,
            memory=MemoryKind.SHM,
            settings=settings,
            use_coordinator=False,
        )
        return await self.kvray_agent.start()

    async def expect(self, request_id: str) -> Reservation:
        reservation = self.kvray_agent.expect(request_id, [1])
        self.resumed = asyncio.get_running_loop().create_task(self._kv(request_id))
        return reservation

    async def _kv(self, request_id: str) -> float:
        try:
            await self.kvray_agent.wait_for_kv(request_id, 10)
            return time.perf_counter()
        finally:
            await self.kvray_agent.release(request_id)


@ray.remote
class Sender:
    async def open(self, path: str, port: int) -> None:
        self.datagrams = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.datagrams.connect(path)
        loop = asyncio.get_running_loop()
        self.transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)

    async def open_agents(self, decode: EngineInfo, receiver: Any) -> None:
        """A writer on the decode engine's node, and one that says it runs on another."""
        self.agents: dict[str, KVAgent] = {}
        for path, node in ((SAME_NODE, decode.node_id), (OTHER_NODES, OTHER_NODE)):
            agent = KVAgent(f"floor-prefill-{node}", Role.PREFILL, LAYOUT, use_coordinator=False)
            agent.node_id = node
            await agent.start()
            agent.add_peer(decode, receiver)
            self.agents[path] = agent

    async def write(self, path: str, reservation: Reservation) -> None:
        await self.agents[path].push_layer(reservation, "layer0", [2], timeout=10)

    async def finish(self, path: str, request_id: str, idle_s: float) -> float:
        if idle_s:
            await asyncio.sleep(idle_s)
        started = time.perf_counter()
        await self.agents[path].finish(request_id, timeout=10)
        return started

    async def send(self, channel: str, receiver: Any, idle_s: float) -> float:
        if idle_s:
            await asyncio.sleep(idle_s)
        started = time.perf_counter()
        if channel == "unix datagram":
            self.datagrams.send(b"done")
        elif channel == "tcp":
            self.transport.write(b"done")
        else:
            receiver.notify.remote()
        return started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="the sender waits this long before sending, so the receiver is idle when it arrives "
        "(as a decode engine waiting for KV is), not still busy with the call that armed it",
    )
    parser.add_argument("--json", help="write the samples here")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    receiver = Receiver.remote()  # type: ignore[attr-defined]
    sender = Sender.remote()  # type: ignore[attr-defined]
    path, port = ray.get(receiver.open.remote())
    ray.get(sender.open.remote(path, port))
    decode = ray.get(receiver.open_agent.remote())
    ray.get(sender.open_agents.remote(decode, receiver))
    samples: dict[str, list[float]] = {
        "unix datagram": [],
        "tcp": [],
        "ray call": [],
        SAME_NODE: [],
        OTHER_NODES: [],
    }
    idle_s = args.idle_ms / 1000
    for run in range(args.runs + 10):
        for channel, values in samples.items():  # interleaved, so a noisy moment hits all
            if channel in FLOOR_OF:
                request_id = f"{channel}-{run}"
                reservation = ray.get(receiver.expect.remote(request_id))
                ray.get(sender.write.remote(channel, reservation))
                started = ray.get(sender.finish.remote(channel, request_id, idle_s))
            else:
                ray.get(receiver.arm.remote())
                started = ray.get(sender.send.remote(channel, receiver, idle_s))
            seen = ray.get(receiver.seen.remote())
            if run >= 10:  # warm-up
                values.append((seen - started) * 1e6)
    print(
        f"sender's clock -> waiting task resumed, between two Ray async actors, microseconds "
        f"({os.cpu_count()} CPUs, {args.runs} runs each, the sender idle {args.idle_ms} ms first)"
    )
    print(f"  {'channel':<18}{'p10 us':>8}{'p50 us':>8}{'p90 us':>8}{'min us':>8}")
    for channel, values in samples.items():
        ordered = sorted(values)
        p10, p90 = ordered[int(0.1 * (len(ordered) - 1))], ordered[int(0.9 * (len(ordered) - 1))]
        print(f"  {channel:<18}{p10:>8.0f}{statistics.median(values):>8.0f}{p90:>8.0f}{ordered[0]:>8.0f}")
    print("kvray over its floor (p50 / p50; the spread is kvray's p10-p90 over the floor's p50)")
    for path, floor in FLOOR_OF.items():
        base = statistics.median(samples[floor])
        ordered = sorted(samples[path])
        p10, p90 = ordered[int(0.1 * (len(ordered) - 1))], ordered[int(0.9 * (len(ordered) - 1))]
        print(
            f"  {path} / {floor}: {statistics.median(ordered) / base:.2f}x "
            f"({p10 / base:.2f}-{p90 / base:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "samples_us": samples}, out
            )


if __name__ == "__main__":
    main()
