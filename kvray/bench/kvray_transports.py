"""kvray's own contenders: the `shm` and `ray` transports between two Ray actors.

A decode actor hosts a `KVAgent` with a shared-memory backing (an `AgentHost`, so `ray`
writes can reach it); a prefill actor hosts two prefill agents over one CPU backing, one agent
pinned to each transport. One run: the decode agent expects the request; the prefill actor
stamps the clock and pushes (plan + write + completion notice); the decode actor stamps the
clock when its `wait_for_kv` returns. Both stamps come from `time.perf_counter`
(CLOCK_MONOTONIC: one clock for every process of the machine), so a run is timed from the
writer's first step to the moment the reader may use the KV. The request's block ids reach
`push` as the int64 arrays an engine's block table holds, made before the clock starts (as
NIXL's descriptor lists are).

Each transport runs twice, with every request's KV checked (the default, `kvray.content`: the
copy hashes what it moves, against the digests the writer took from its blocks when their KV was
held, `KVAgent.hold_digests`, before the clock starts) and without it (placement only), so the
table shows what the check costs in the same run.

Completion latency is measured on the same actors, without the integrity check: the prefill
side pushes layer by layer (`push_layer`: the bytes only), stamps the clock after the last
byte, then `finish`es (the completion notice alone); the decode side stamps when `wait_for_kv`
returns. The path across
nodes is measured on this node by a third prefill agent that says it runs on another node: it
writes with the `ray` transport and sends its notice over the decode engine's TCP listener, as a
writer on another node does; and by a bare Ray call on the decode actor, the path a notice takes
when the listener cannot be reached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import ray

from kvray.agent import KVAgent
from kvray.bench.harness import Contender, Run
from kvray.bench.verify import Verdict, fill_source, scrub, verify_destination
from kvray.bench.workload import Workload
from kvray.config import Settings
from kvray.host import AgentHost
from kvray.memory import Backing, MemoryKind
from kvray.notice.actor import ActorChannel
from kvray.wire import Reservation, Role

SHM = "kvray shm"
RAY = "kvray ray transport"
#: The same with every request's KV checked (`Settings.integrity`, the default; the rows above
#: turn it off): against them, in the same run, what the check costs (the copy's hashing and the
#: writer's sums; the slow sampled re-hash is off in both).
SHM_CHECKED = "kvray shm, every request checked"
RAY_CHECKED = "kvray ray transport, every request checked"
_TRANSPORT = {SHM: "shm", RAY: "ray", SHM_CHECKED: "shm", RAY_CHECKED: "ray"}
_CHECKED = {SHM_CHECKED, RAY_CHECKED}
DEADLINE_S = 60.0
TIMED = "writer's first step -> reader's wait_for_kv returns (two actors)"

#: Completion-latency paths, as the table names them.
COMPLETION_SHM = "shm: Unix datagram socket (same node)"
COMPLETION_RAY = "ray transport, same node: Unix datagram socket"
COMPLETION_TCP = "another node's writer: TCP notice listener"
COMPLETION_RAY_CALL = "another node's writer: Ray actor call (listener unreachable)"
#: The completion-latency writer on "another node" whose notices go by an actor call.
CALLING = "actor-call"
#: Where the completion-latency writer on "another node" says it runs.
OTHER_NODE = "bench-another-node"


class KvrayDecode(AgentHost):
    """The receiving engine: one decode agent per case, shared-memory backing."""

    async def setup(self, workload: Workload) -> tuple[str, int]:
        self.workload = workload
        # It asks for no check itself: each writer's setting decides, one row checked, one not.
        self.kvray_agent = KVAgent(
            f"bench-decode-{workload.key}",
            Role.DECODE,
            workload.layout,
            memory=MemoryKind.SHM,
            settings=Settings.from_env(integrity=False),
        )
        info = await self.kvray_agent.start()
        self.waits: dict[str, asyncio.Task[float]] = {}
        self.pool = self.kvray_agent.backing.regions[0].tensor.numpy()
        return info.engine_id, info.incarnation

    async def prepare(self, run: int, request_id: str) -> Reservation:
        """Scrub the destination, expect the run's request and start waiting for it, so the
        wait is in place (as a decode engine's is) before the writer starts."""
        scrub(self.pool, run)
        return self.expect(request_id)

    def expect(self, request_id: str) -> Reservation:
        reservation = self.kvray_agent.expect(request_id, self.workload.dst_ids())
        self.waits[request_id] = asyncio.get_running_loop().create_task(self._wait(request_id))
        return reservation

    async def _wait(self, request_id: str) -> float:
        try:
            await self.kvray_agent.wait_for_kv(request_id, DEADLINE_S)
            return time.perf_counter()
        finally:
            await self.kvray_agent.release(request_id)

    async def seen(self, request_id: str) -> float:
        """The clock when the request's KV was there (`wait_for_kv` returned)."""
        return await self.waits.pop(request_id)

    async def verify(self) -> Verdict:
        return verify_destination(self.pool, self.workload)

    async def teardown(self) -> None:
        await self.kvray_agent.close()
        del self.pool


class KvrayPrefill:
    """The sending engine: one prefill agent per transport over one CPU backing."""

    async def setup(self, workload: Workload) -> None:
        self.workload = workload
        self.src_ids, self.dst_ids = workload.src_ids(), workload.dst_ids()
        backing = Backing.allocate(workload.layout, MemoryKind.CPU)
        fill_source(backing.regions[0].tensor.numpy(), workload)
        self.agents: dict[str, KVAgent] = {}
        for name, transport in _TRANSPORT.items():
            checked = name in _CHECKED
            agent = KVAgent(
                f"bench-prefill-{transport}{'-checked' if checked else ''}-{workload.key}",
                Role.PREFILL,
                backing=backing,
                settings=Settings.from_env(transport=transport, integrity=checked, integrity_sample_rate=0.0),
            )
            await agent.start()
            self.agents[name] = agent
        self.far_writer = KVAgent(
            f"bench-prefill-far-{workload.key}",
            Role.PREFILL,
            backing=backing,
            settings=Settings.from_env(transport="ray", integrity=False, integrity_sample_rate=0.0),
        )
        self.far_writer.node_id = OTHER_NODE
        await self.far_writer.start()
        # Another node's writer whose notices go by a call on the decode engine's actor first
        # (as when its listener cannot be reached).
        call_settings = Settings.from_env(transport="ray", integrity=False, integrity_sample_rate=0.0)
        self.calling_writer = KVAgent(
            f"bench-prefill-call-{workload.key}",
            Role.PREFILL,
            backing=backing,
            settings=call_settings,
            notices=[ActorChannel(call_settings)],
        )
        self.calling_writer.node_id = OTHER_NODE
        await self.calling_writer.start()

    async def hold(self, name: str) -> None:
        """A checked writer takes its blocks' digests as an engine does when their KV is held."""
        if name in _CHECKED:
            await self.agents[name].hold_digests(self.src_ids)

    async def push(self, name: str, reservation: Reservation) -> dict[str, Any]:
        agent = self.agents[name]
        started = time.perf_counter()
        result = await agent.push(reservation, self.src_ids, timeout=DEADLINE_S)
        if result.transport.value != _TRANSPORT[name]:
            raise RuntimeError(f"{name}: the push used {result.transport.value}")
        return {
            "started": started,
            "push_s": result.seconds,
            "ops": result.ops,
            "unmerged_ops": result.unmerged_ops,
        }

    async def push_layerwise(self, name: str | None, reservation: Reservation) -> float:
        """Every layer's bytes, then the completion notice alone; returns the clock between
        (`name` None: from the writer on "another node"; `CALLING`: the one whose notices go
        by an actor call)."""
        if name is None:
            agent = self.far_writer
        elif name == CALLING:
            agent = self.calling_writer
        else:
            agent = self.agents[name]
        for layer in self.workload.layout.layer_names:
            await agent.push_layer(reservation, layer, self.src_ids, timeout=DEADLINE_S)
        written = time.perf_counter()
        await agent.finish(reservation.request_id, timeout=DEADLINE_S)
        return written

    async def teardown(self) -> None:
        for agent in self.agents.values():
            await agent.close()
        self.agents.clear()
        await self.far_writer.close()
        await self.calling_writer.close()


DecodeActor = ray.remote(KvrayDecode)
PrefillActor = ray.remote(KvrayPrefill)


class KvrayTransports(Contender):
    family = "kvray"
    names = (SHM, SHM_CHECKED, RAY, RAY_CHECKED)
    timed: ClassVar[Mapping[str, str]] = dict.fromkeys(names, TIMED)

    def __init__(self, completion_runs: int) -> None:
        self.completion_runs = completion_runs
        self.latency: dict[str, list[float]] = {
            COMPLETION_SHM: [],
            COMPLETION_RAY: [],
            COMPLETION_TCP: [],
            COMPLETION_RAY_CALL: [],
        }

    def start(self) -> str | None:
        self.decode: Any = DecodeActor.remote()
        self.prefill: Any = PrefillActor.remote()
        self.actors = (self.prefill, self.decode)
        return None

    def setup(self, workload: Workload) -> None:
        self.workload = workload
        self.dst_engine, self.incarnation = ray.get(self.decode.setup.remote(workload))
        ray.get(self.prefill.setup.remote(workload))

    def run(self, name: str, run: int) -> Run:
        checked = "-checked" if name in _CHECKED else ""
        request_id = f"{self.workload.key}-{_TRANSPORT[name]}{checked}-{run}"
        reservation = ray.get(self.decode.prepare.remote(run, request_id))
        ray.get(self.prefill.hold.remote(name))
        facts = ray.get(self.prefill.push.remote(name, reservation))
        seen_at = ray.get(self.decode.seen.remote(request_id))
        verdict = ray.get(self.decode.verify.remote())
        return Run(
            seen_at - facts["started"],
            verdict,
            {"ops_merged": facts["ops"], "ops_unmerged": facts["unmerged_ops"]},
            {"push_s": facts["push_s"]},
        )

    def teardown(self) -> None:
        if self.workload.family == "a" and self.completion_runs:
            self._completion_latency()
        super().teardown()

    def _completion_latency(self) -> None:
        paths = (
            (COMPLETION_SHM, SHM),
            (COMPLETION_RAY, RAY),
            (COMPLETION_TCP, None),
            (COMPLETION_RAY_CALL, CALLING),
        )
        for path, name in paths:
            for run in range(self.completion_runs + 1):  # the first is a warm-up
                request_id = f"{self.workload.key}-completion-{len(self.latency[path])}-{run}-{name}"
                reservation = ray.get(self.decode.prepare.remote(run, request_id))
                sent = self.prefill.push_layerwise.remote(name, reservation)
                written_at = ray.get(sent)
                seen_at = ray.get(self.decode.seen.remote(request_id))
                if run:
                    self.latency[path].append(seen_at - written_at)
