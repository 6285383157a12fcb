"""The floor under kvray's completion latency on this machine: how long the bare channels take,
with no kvray code, between two Ray async actors, from the sender's clock to a task waiting in
the receiver's event loop resuming.

    python examples/bench_completion_floor.py [--runs 200] [--json floor.json]

- `unix datagram`: a datagram into a socket the receiver's loop watches (`add_reader`), which
  resolves the future a task awaits; kvray's same-node path does this plus its checks.
- `tcp`: one small message over an open loopback TCP connection to a protocol whose
  `data_received` resolves the future; kvray's path across nodes does this plus its HMACs,
  its checks and a verdict.
- `ray call`: a call on the receiver's async method, which resolves the future (the call is not
  awaited, as a notice needs no answer to wake the receiver).

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


@ray.remote
class Receiver:
    """Waits for one wake-up at a time on each channel and stamps when its task resumes."""

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


@ray.remote
class Sender:
    async def open(self, path: str, port: int) -> None:
        self.datagrams = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.datagrams.connect(path)
        loop = asyncio.get_running_loop()
        self.transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)

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
    samples: dict[str, list[float]] = {"unix datagram": [], "tcp": [], "ray call": []}
    for run in range(args.runs + 10):
        for channel, values in samples.items():  # interleaved, so a noisy moment hits all
            ray.get(receiver.arm.remote())
            started = ray.get(sender.send.remote(channel, receiver, args.idle_ms / 1000))
            seen = ray.get(receiver.seen.remote())
            if run >= 10:  # warm-up
                values.append((seen - started) * 1e6)
    print(
        f"bare channel between two Ray async actors, sender's clock -> waiting task resumed, "
        f"microseconds ({os.cpu_count()} CPUs, {args.runs} runs each, "
        f"the sender idle {args.idle_ms} ms first)"
    )
    print(f"  {'channel':<16}{'p50':>8}{'p90':>8}{'min':>8}")
    for channel, values in samples.items():
        ordered = sorted(values)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        print(f"  {channel:<16}{statistics.median(values):>8.0f}{p90:>8.0f}{ordered[0]:>8.0f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "samples_us": samples}, out
            )


if __name__ == "__main__":
    main()
