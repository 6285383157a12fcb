"""The ceiling: copies inside one process, no second process, no transport.

`memcpy, 1 thread` (the baseline every ratio is taken against) and `memcpy, all threads` copy
the request's bytes as one contiguous buffer with torch (`dst.copy_(src)`, one thread or every
core); `kvray batched copy, in-process` copies the scattered blocks between two pools with the
C batched copy kvray's CPU transports use, on kvray's merged ops: the shm transport minus the
second process, the planning and the completion. All buffers are touched before the clock
starts, so the clock sees copies, not page faults.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import ray
import torch

from kvray.bench.harness import Contender, Run
from kvray.bench.results import BASELINE
from kvray.bench.verify import (
    Verdict,
    compare_payload,
    expected_payload,
    fill_source,
    scrub,
    verify_destination,
)
from kvray.bench.workload import Workload
from kvray.config import Settings
from kvray.plan import plan_transfer
from kvray.transport.cpu_copy import copy_threads, scatter_copy_async
from kvray.wire import Role

ALL_THREADS = f"memcpy, {os.cpu_count()} threads"
COPY_THREADS = Settings.from_env().copy_threads or copy_threads()
KVRAY_IN_PROCESS = f"kvray batched copy, in-process ({COPY_THREADS} thread{'s' if COPY_THREADS > 1 else ''})"


class InProcessCopier:
    """Both ends in one process (an async actor: kvray's copy awaits its threads)."""

    async def setup(self, workload: Workload) -> None:
        from kvray.bench.control import engine_info

        torch.set_num_threads(1)
        self.workload = workload
        self.src_pool = np.zeros(workload.region_nbytes, dtype=np.uint8)
        self.dst_pool = np.zeros(workload.region_nbytes, dtype=np.uint8)
        fill_source(self.src_pool, workload)
        self.src_payload = expected_payload(workload)
        self.dst_payload = np.zeros(workload.nbytes, dtype=np.uint8)
        layout = workload.layout
        plan = plan_transfer(
            engine_info(layout, "src", Role.PREFILL),
            engine_info(layout, "dst", Role.DECODE),
            workload.src_ids(),
            workload.dst_ids(),
        )
        self.ops = plan.ops
        self.facts = {"ops_unmerged": len(plan.unmerged), "ops_merged": len(plan.ops)}

    async def run(self, name: str, run: int) -> tuple[float, Verdict, dict[str, Any]]:
        if name == KVRAY_IN_PROCESS:
            scrub(self.dst_pool, run)
            ops = self.ops
            started = time.perf_counter()
            await scatter_copy_async(
                int(self.dst_pool.ctypes.data),
                int(self.src_pool.ctypes.data),
                ops.remote_offset,
                ops.local_offset,
                ops.nbytes,
                COPY_THREADS,
            )
            elapsed = time.perf_counter() - started
            return elapsed, verify_destination(self.dst_pool, self.workload), self.facts
        torch.set_num_threads(1 if name == BASELINE else os.cpu_count() or 1)
        scrub(self.dst_payload, run)
        src, dst = torch.from_numpy(self.src_payload), torch.from_numpy(self.dst_payload)
        started = time.perf_counter()
        dst.copy_(src)
        elapsed = time.perf_counter() - started
        torch.set_num_threads(1)
        return elapsed, compare_payload(self.dst_payload, self.workload), {}

    async def teardown(self) -> None:
        del self.src_pool, self.dst_pool, self.src_payload, self.dst_payload


InProcessActor = ray.remote(InProcessCopier)


class InProcessCopies(Contender):
    family = "memcpy"
    names = (BASELINE, ALL_THREADS, KVRAY_IN_PROCESS)
    timed: ClassVar[Mapping[str, str]] = {name: "one process" for name in names}

    def start(self) -> str | None:
        self.actor: Any = InProcessActor.remote()
        self.actors = (self.actor,)
        return None

    def setup(self, workload: Workload) -> None:
        ray.get(self.actor.setup.remote(workload))

    def run(self, name: str, run: int) -> Run:
        seconds, verdict, facts = ray.get(self.actor.run.remote(name, run))
        return Run(seconds, verdict, facts)
