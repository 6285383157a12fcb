"""NIXL with its UCX back-end: one-sided WRITE with a notification, between two processes.

The initiator and the target are Ray actors (two processes). Per case each creates a NIXL agent
with the UCX back-end and registers its whole pool (DRAM); the target's metadata reaches the
initiator through the driver; the initiator prepares two descriptor lists once per case, one
descriptor per block and segment on each side (what a KV connector built on NIXL does). One
run: the initiator stamps the clock, makes the transfer from the prepared lists
(`make_prepped_xfer("WRITE", ..., notif_msg)`), posts it and polls it to DONE; the target polls
its notifications and stamps the clock when the run's notification is there.

The agents run without NIXL's progress thread: with it (the default), its busy-polling thread
takes a whole core, which on a 2-core machine halves NIXL's own throughput and slows every
other contender; without it, progress is made by the polling calls. NIXL is optional
(`pip install 'kvray[bench]'`): where it does not import or start, the contender is skipped
with the reason.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import threading
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import ray

from kvray.bench.harness import Contender, Run
from kvray.bench.verify import Verdict, fill_source, scrub, verify_destination
from kvray.bench.workload import Workload

NIXL_UCX = "NIXL, UCX back-end (WRITE + notification)"
DEADLINE_S = 60.0
#: Pause between two notification polls: short next to any transfer here, and it leaves the
#: initiator the CPU the polling would otherwise take.
_POLL_S = 20e-6
TIMED = "initiator's first step -> target sees the notification (two actors)"


def _new_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _descriptors(base: int, workload: Workload, blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """One (address, length, device 0) row per block and segment, segment by segment."""
    rows = []
    for segment in workload.segments:
        addresses = base + segment.offset + blocks * segment.block_stride
        rows.append(
            np.stack([addresses, np.full(blocks.size, segment.nbytes), np.zeros(blocks.size)], axis=1)
        )
    table: npt.NDArray[np.int64] = np.concatenate(rows).astype(np.int64)
    return table


class NixlEndpoint:
    """Either side of the NIXL transfer (the driver decides which methods it calls)."""

    def __init__(self) -> None:
        self.agent: Any = None
        self.registered: Any = None
        self.watch: concurrent.futures.Future[float] = concurrent.futures.Future()

    def probe(self) -> str | None:
        """None when NIXL imports and a UCX agent starts here, else why not."""
        try:
            agent = _new_agent("kvray-bench-probe")
        except Exception as error:
            return f"NIXL does not start here: {type(error).__name__}: {error}"
        if "UCX" not in agent.backends:
            return f"NIXL has no UCX back-end here (plugins: {', '.join(agent.get_plugin_list())})"
        del agent
        return None

    def setup(self, name: str, workload: Workload, source: bool) -> tuple[bytes, int]:
        self.teardown()
        self.workload = workload
        self.pool = np.zeros(workload.region_nbytes, dtype=np.uint8)
        if source:
            fill_source(self.pool, workload)
        self.agent = _new_agent(name)
        base = int(self.pool.ctypes.data)
        self.registered = self.agent.register_memory([(base, self.pool.size, 0, "")], "DRAM")
        return self.agent.get_agent_metadata(), base

    # ---- initiator --------------------------------------------------------------------

    def connect(self, target_metadata: bytes, target_base: int) -> None:
        self.remote = self.agent.add_remote_agent(target_metadata)
        workload = self.workload
        local = _descriptors(int(self.pool.ctypes.data), workload, workload.src_ids())
        remote = _descriptors(target_base, workload, workload.dst_ids())
        self.local_side = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        self.remote_side = self.agent.prep_xfer_dlist(self.remote, remote, "DRAM")
        self.indices = np.arange(local.shape[0], dtype=np.int32)

    def write(self, tag: str) -> float:
        """One WRITE of every descriptor with a notification; returns the clock at its start."""
        started = time.perf_counter()
        handle = self.agent.make_prepped_xfer(
            "WRITE", self.local_side, self.indices, self.remote_side, self.indices, tag.encode()
        )
        state = self.agent.transfer(handle)
        deadline = started + DEADLINE_S
        while state == "PROC" and time.perf_counter() < deadline:
            state = self.agent.check_xfer_state(handle)
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        return started

    # ---- target -----------------------------------------------------------------------

    def scrub(self, run: int) -> None:
        scrub(self.pool, run)

    def arm(self, initiator: str, tag: str) -> None:
        """Start polling for the run's notification (how NIXL users learn of a write) on a
        thread, before the initiator starts: the target is waiting, as a decode engine is."""
        self.watch = concurrent.futures.Future()
        threading.Thread(target=self._poll, args=(initiator, tag.encode(), self.watch), daemon=True).start()

    def _poll(self, initiator: str, tag: bytes, found: concurrent.futures.Future[float]) -> None:
        deadline = time.perf_counter() + DEADLINE_S
        try:
            while not self.agent.check_remote_xfer_done(initiator, tag):
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"no NIXL notification {tag!r} within {DEADLINE_S} s")
                time.sleep(_POLL_S)
            found.set_result(time.perf_counter())
        except BaseException as error:
            found.set_exception(error)

    def seen(self) -> float:
        """The clock when the notification was there."""
        return self.watch.result(timeout=DEADLINE_S + 5)

    def verify(self) -> Verdict:
        return verify_destination(self.pool, self.workload)

    def teardown(self) -> None:
        if self.agent is not None and self.registered is not None:
            self.agent.deregister_memory(self.registered)
        self.agent = None
        self.registered = None


NixlActor = ray.remote(NixlEndpoint)


class NixlUcx(Contender):
    family = "nixl"
    names = (NIXL_UCX,)
    timed: ClassVar[Mapping[str, str]] = {NIXL_UCX: TIMED}

    def start(self) -> str | None:
        if importlib.util.find_spec("nixl") is None:
            return "NIXL is not installed (pip install 'kvray[bench]', or pip install nixl)"
        self.initiator: Any = NixlActor.remote()
        self.target: Any = NixlActor.remote()
        self.actors = (self.initiator, self.target)
        probe: Any = self.initiator.probe
        return ray.get(probe.remote())  # type: ignore[no-any-return]

    def setup(self, workload: Workload) -> None:
        self.workload = workload
        self.names_now = (f"kvray-bench-initiator-{workload.key}", f"kvray-bench-target-{workload.key}")
        metadata, base = ray.get(self.target.setup.remote(self.names_now[1], workload, False))
        ray.get(self.initiator.setup.remote(self.names_now[0], workload, True))
        ray.get(self.initiator.connect.remote(metadata, base))

    def run(self, name: str, run: int) -> Run:
        tag = f"{self.workload.key}/{run};"
        ray.get(self.target.scrub.remote(run))
        ray.get(self.target.arm.remote(self.names_now[0], tag))
        started = ray.get(self.initiator.write.remote(tag))
        seen_at = ray.get(self.target.seen.remote())
        return Run(
            seen_at - started,
            ray.get(self.target.verify.remote()),
            {"descriptors": self.workload.descriptors},
        )
