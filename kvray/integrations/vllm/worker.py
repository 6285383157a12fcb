"""The worker side of `KvrayConnector` (runs in each vLLM worker process): the engine's KV cache
(as `cache_layout` reads it) as one kvray backing, a kvray agent on an event loop of its own,
and the hand-off (`kvray.agent.handoff.Handoff`) fed with the scheduler's decisions of each step
(`KvrayMetadata`, read, never written: what the worker has begun of a step it records itself).

vLLM's forward path never waits for kvray: every agent call is submitted to the agent's loop
thread, and results come back through thread-safe sets that `get_finished` drains.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvray.agent.handoff import (
    NO_BLOCK,
    AskProof,
    Handoff,
    HandoffObserver,
    HandoffStep,
    LayerwiseSpec,
    LoadSpec,
    table_blocks,
)
from kvray.agent.kvagent import KVAgent
from kvray.agent.lane import Answer as LaneAnswer
from kvray.agent.lane import DecodeLane, LaneAsk
from kvray.config import Settings
from kvray.errors import ConfigError
from kvray.integrations.vllm.agent_loop import AgentLoop
from kvray.integrations.vllm.cache_layout import CacheConfig, CacheLayout, layout_of
from kvray.integrity import sampled
from kvray.layout import TensorParallel, align_up
from kvray.memory import Backing, create_shm_buffer, cuda_pool_buffer
from kvray.metrics import IntervalSink, Outcome
from kvray.owned import remove_owned
from kvray.wire import EngineInfo, Role

if TYPE_CHECKING:
    from kvray.host.forwarded import ForwardedAgent
    from kvray.plan import OffsetCache

log = logging.getLogger("kvray.vllm")


@dataclass
class _Results:
    """What the agent's loop reports back to vLLM's thread (guarded by `lock`): the hand-off's
    `HandoffReports`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def sent(self, request_id: str) -> None:
        with self.lock:
            self.finished_sending.add(request_id)

    def loaded(self, spec: LoadSpec, *, failed: bool) -> None:
        with self.lock:
            self.finished_recving.add(spec.request_id)
            if failed:
                self.failed_recving.add(spec.request_id)
                self.load_errors.update(table_blocks(spec.block_ids))

    def take(self) -> tuple[set[str], set[str], set[int], set[str]]:
        with self.lock:
            taken = (self.finished_sending, self.finished_recving, self.load_errors, self.failed_recving)
            self.finished_sending, self.finished_recving = set(), set()
            self.load_errors, self.failed_recving = set(), set()
        return taken


#: How often, at most, `finished` has the agent's loop expire leases and take figures (seconds).
TICK_S = 0.01
#: How long vLLM's thread waits, by default, for a preempted request's layer copies (seconds).
PREEMPT_WAIT_S = 0.1
#: How much longer it waits for the agent's loop to answer at all.
PREEMPT_LOOP_SLACK_S = 0.5


class ConnectorWorker:
    """One vLLM worker's kvray side. `role`: PREFILL takes no writes (a pure producer);
    DECODE takes writes and may push too (`kv_both`)."""

    def __init__(
        self,
        engine_id: str,
        role: Role,
        settings: Settings,
        lease_s: float,
        *,
        ray_address: str | None = None,
        node_id: str | None = None,
        tp: TensorParallel | None = None,
        proof: AskProof | None = None,
        preempt_wait_s: float = PREEMPT_WAIT_S,
    ) -> None:
        self.engine_id = engine_id
        #: The deployment's key: the proof on every push request and withdrawal (`Handoff`).
        self.proof = proof
        #: How long vLLM's thread waits for a preempted request's layer copies (`preempt`).
        self.preempt_wait_s = preempt_wait_s
        #: This worker's tensor-parallel rank of its engine (its cache holds that rank's heads).
        self.tp = tp or TensorParallel()
        self.role = role
        self.settings = settings
        self.lease_s = lease_s
        #: The Ray cluster to join (its GCS address), or None. Joined, the engine registers
        #: with kvray's coordinator through a host actor (`kvray.host.forwarded.ForwardedAgent`):
        #: peers find it by engine id, and engines on other nodes reach it (the `ray`
        #: transport, push requests and notices through the host). Not joined, peers know it
        #: only from `kv_transfer_params`, and both engines must share a node.
        self.ray_address = ray_address
        #: The Ray node the engine runs on, if the engine's launcher knows better than the
        #: Ray client this worker starts (e.g. several nodes of one machine).
        self.node_id = node_id
        #: Set before `register`: what watches the hand-offs (`kvray.bench.handoff_log`), and
        #: the agent's offset cache (None: its own; `kvray.faults` injects faulty ones).
        self.observer: HandoffObserver | None = None
        self.offset_cache: OffsetCache | None = None
        self._replica: ForwardedAgent | None = None
        self._shm_path: str | None = None
        #: The storage mapping `_shm_path` (its first byte's address).
        self._shm_storage = 0
        #: A GPU KV cache's own allocation, and the private pool it came from (kept as long).
        self._cuda_buffer: torch.Tensor | None = None
        self._cuda_pool: object | None = None
        #: A producer's CPU KV cache, aligned in an allocation of its own (exported to no one).
        self._cpu_buffer: torch.Tensor | None = None
        self._agent: KVAgent | None = None
        self._handoff: Handoff | None = None
        self._loop: AgentLoop | None = None
        self._results = _Results()
        #: The agent's records of `kvray.metrics.OPERATOR_METRICS` since vLLM last asked
        #: (`KvrayConnector.get_kv_connector_stats`).
        self.figures = IntervalSink()
        #: vLLM's KV cache as kvray moves it, once registered.
        self.cache: CacheLayout | None = None
        #: The vLLM layers saved so far in this step's forward, by kvray layer.
        self._saving: dict[str, set[str]] = {}
        #: This step's layer-wise requests (`begin`), and whether they have been handed to the
        #: hand-off (at the forward's first saved layer: `save_kv_layer`).
        self._step_layerwise: dict[str, LayerwiseSpec] = {}
        self._step_layerwise_begun = False
        #: KV cache groups of the registered cache, and the blocks that failed to load since
        #: vLLM last asked (`take_load_errors`).
        self._groups = 1
        self._load_errors: set[int] = set()
        #: Loads asked through prefill engines' native lanes, by request id (`begin`, `finished`).
        self._lane: DecodeLane | None = None
        self._lane_asks: dict[str, LaneAsk] = {}
        #: Figures of loads asked through lanes, for the agent's loop's next tick (`finished`).
        self._lane_figures: list[tuple[str, str, int, float]] = []
        self._next_tick = 0.0

    # ---- memory -------------------------------------------------------------------------

    @contextlib.contextmanager
    def allocation_context(self) -> Iterator[None]:
        """While vLLM allocates its KV cache (one `torch.zeros` of the whole size, on the CPU or
        a GPU), place that buffer where same-node writers can reach it and nothing else can be
        reached with it: on the CPU a kvray shared-memory file (an engine that takes writes), on
        a GPU a CUDA allocation of its own (a private memory pool: the allocation a CUDA IPC
        handle exports holds the KV cache and no other tensor). A pure producer's is aligned in
        an allocation of its own too (registered, exported to no one). Other allocations pass
        through."""
        original = torch.zeros
        worker = self

        def zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
            device = torch.device(kwargs.get("device") or "cpu")
            if (
                worker._shm_path is None
                and worker._cuda_buffer is None
                and worker._cpu_buffer is None
                and len(dims) == 1
                and kwargs.get("dtype") == torch.int8
                and int(dims[0]) >= 1 << 20
            ):
                if device.type == "cpu" and worker.role is Role.DECODE:
                    return worker._shared_buffer(int(dims[0]))
                if device.type == "cpu":
                    return worker._private_buffer(int(dims[0]))
                if device.type == "cuda":
                    return worker._pooled_buffer(int(dims[0]), device)
            return original(*size, **kwargs)

        torch.zeros = zeros
        try:
            yield
        finally:
            torch.zeros = original

    def _shared_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of zeroed int8 in a fresh kvray shared-memory file, at an aligned offset."""
        alignment = self.settings.alignment
        path, mapped = create_shm_buffer(self.settings.shm_dir, nbytes + alignment)
        self._shm_path = path
        self._shm_storage = mapped.untyped_storage().data_ptr()
        skip = -mapped.data_ptr() % alignment
        return mapped[skip : skip + nbytes].view(torch.int8)

    def _private_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of zeroed int8 at an aligned offset of a CPU allocation padded so that the
        aligned region around them lies inside it."""
        alignment = self.settings.alignment
        padded = torch.empty(nbytes + 2 * alignment, dtype=torch.int8)
        skip = -padded.data_ptr() % alignment
        self._cpu_buffer = padded[skip : skip + nbytes].zero_()
        return self._cpu_buffer

    def _pooled_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """`nbytes` of zeroed int8 at an aligned offset of a CUDA allocation of their own."""
        alignment = self.settings.gpu_alignment
        buffer, self._cuda_pool = cuda_pool_buffer(align_up(nbytes, alignment) + alignment, device)
        self._cuda_buffer = buffer
        skip = -buffer.data_ptr() % alignment
        return buffer[skip : skip + nbytes].view(torch.int8).zero_()

    def _check_cuda_cache(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """A decode engine's CUDA cache must be the buffer `allocation_context` placed, alone in
        its CUDA allocation as the driver knows it: a writer that opens the engine's IPC handle
        can reach the whole allocation, so nothing but the KV cache may live there."""
        placed = self._cuda_buffer
        if placed is None or any(
            tensor.untyped_storage().data_ptr() != placed.untyped_storage().data_ptr()
            for tensor in tensors.values()
        ):
            raise ConfigError(
                "vLLM allocated this decode engine's GPU KV cache outside "
                "KvrayConnector.get_mem_pool_context(); the CUDA allocation holding it may hold "
                "other tensors, which writers opening its IPC handle could reach. Use a vLLM whose "
                "GPU worker allocates the KV cache in the connector's context (0.32 or later), or "
                'kv_role "kv_producer" for an engine that only prefills'
            )
        from kvray.transport.cuda_ipc import cuda_allocation_range

        with torch.cuda.device(placed.device):
            start, nbytes = cuda_allocation_range(placed.data_ptr())
        # The pool is this buffer's alone; the caching allocator gives a request a segment of
        # its own, rounded up to 2 MiB, or of 20 MiB below 10 MiB, never more.
        segment = max(align_up(placed.numel(), 2 << 20), 20 << 20)
        if start != placed.data_ptr() or not placed.numel() <= nbytes <= segment:
            raise ConfigError(
                f"the GPU KV cache's CUDA allocation is {nbytes} bytes at {start:#x}, not the "
                f"{placed.numel()} bytes kvray allocated for it at {placed.data_ptr():#x}; refusing "
                "to export memory other tensors may share"
            )

    # ---- start and stop ---------------------------------------------------------------

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        block_size: int,
        group_layers: Sequence[Sequence[str]] = (),
    ) -> EngineInfo:
        """Describe vLLM's KV cache as one kvray backing and start the agent (`layout_of`:
        `group_layers` are the layers of each KV cache group)."""
        cache = self.cache = layout_of(kv_caches, num_blocks, block_size, group_layers, self.tp)
        self._groups = max(1, len(group_layers))
        layout, tensors = cache.layout, cache.tensors
        if self.role is Role.DECODE and any(tensor.is_cuda for tensor in tensors.values()):
            self._check_cuda_cache(tensors)
        shm_path = self._shm_path
        if shm_path is not None and any(
            tensor.untyped_storage().data_ptr() != self._shm_storage for tensor in tensors.values()
        ):
            # Not every layer lives in the placed buffer: each storage is its own region, in
            # this process's memory (writable by the `ray` transport, not `shm`).
            remove_owned(shm_path)  # mapped still: the memory stays until the buffer goes
            shm_path = self._shm_path = None
        backing = Backing.adopt(
            layout, tensors, settings=self.settings, shm_path=shm_path, strides=cache.strides
        )
        self._loop = AgentLoop(f"kvray-{self.engine_id}")
        if self.ray_address is not None:
            self._join_ray(self.ray_address)
        info = self._loop.run(self._start(backing), timeout=self.settings.lookup_timeout_s + 60)
        self._open_decode_lane()
        return info

    def _open_decode_lane(self) -> None:
        """Routine loads ask prefill engines' native lanes from this thread (`kvray.agent.lane`),
        where the deployment has a key and the cache can take a lane's copy."""
        proof, agent = self.proof, self.agent
        if self.role is not Role.DECODE or proof is None or not self.settings.native_lane:
            return
        self._lane = agent.decode_lane(
            lambda engine, incarnation: proof.lane_key(
                engine, incarnation, agent.engine_id, agent.incarnation
            )
        )

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], config: CacheConfig) -> EngineInfo:
        """`register` as vLLM's `register_kv_caches` calls for it, with what its configuration
        says of the cache (the number of blocks, when it does not say, from the tensors)."""
        num_blocks = config.num_blocks or next(iter(kv_caches.values())).shape[0]
        info = self.register(kv_caches, num_blocks, config.block_size, config.group_layers)
        log.info(
            "kvray: engine %s registered %d layers, %d regions",
            info.engine_id,
            len(kv_caches),
            len(info.regions),
        )
        return info

    def _join_ray(self, address: str) -> None:
        import ray

        if ray.is_initialized():
            return
        ray.init(address=address, namespace=self.settings.namespace, log_to_driver=False)
        # A Ray driver polls the cluster's error messages on a thread, to print them. In a
        # vLLM worker process that poll returns at once, every time: the thread spins and
        # keeps the GCS busy (most of a core). This process prints no one's errors, so stop
        # that thread (it ends once it sees the event; only it and the log printer, not
        # started here, watch it).
        worker = getattr(getattr(ray, "_private", None), "worker", None)
        stopped = getattr(getattr(worker, "global_worker", None), "threads_stopped", None)
        if isinstance(stopped, threading.Event):
            stopped.set()

    def _new_agent(self, backing: Backing, coordinator: Any = None) -> KVAgent:
        agent = KVAgent(
            self.engine_id,
            self.role,
            backing=backing,
            settings=self.settings,
            coordinator=coordinator,
            use_coordinator=coordinator is not None,
            offset_cache=self.offset_cache,
        )
        if self.node_id is not None:
            agent.node_id = self.node_id
        agent.metrics.tap(self.figures)
        self._handoff = Handoff(
            agent,
            self._results,
            lease_s=self.lease_s,
            joined=coordinator is not None,
            observer=self.observer,
            proof=self.proof,
        )
        return agent

    async def _start(self, backing: Backing) -> EngineInfo:
        # Every engine may prefill (kv_both too): its hand-off serves the push requests its
        # agent's mailboxes take, which the agent publishes as it starts.
        if self.ray_address is None:
            self._agent = self._new_agent(backing)
            return await self._agent.start()
        from kvray.host.forwarded import ForwardedAgent

        self._replica = await ForwardedAgent.start_agent(
            lambda directory: self._new_agent(backing, directory), self.settings
        )
        self._agent = self._replica.agent
        return self._agent.info

    @property
    def agent(self) -> KVAgent:
        assert self._agent is not None, "register() starts the agent"
        return self._agent

    @property
    def handoff(self) -> Handoff:
        assert self._handoff is not None, "register() starts the agent"
        return self._handoff

    @property
    def info(self) -> EngineInfo:
        assert self._agent is not None
        return self._agent.info

    def shutdown(self) -> None:
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        if self._loop is None:
            return
        with contextlib.suppress(Exception):
            self._loop.run(self._close(), timeout=30)
        self._loop.stop()
        self._loop = None

    async def _close(self) -> None:
        if self._handoff is not None:
            self._handoff.close()
        if self._replica is not None:
            await self._replica.close()  # closes the agent, then its host
        elif self._agent is not None:
            await self._agent.close()

    # ---- each step: from vLLM's thread to the agent's loop ---------------------------------

    def begin(self, step: HandoffStep, layerwise: Mapping[str, LayerwiseSpec] | None = None) -> None:
        """This step's new hand-offs, from the scheduler (`Handoff.step`), and its layer-wise
        requests, handed over as the forward saves its first layer (`save_kv_layer`)."""
        self._step_layerwise = dict(layerwise or {})
        self._step_layerwise_begun = False
        if self._loop is None or self._handoff is None or not step:
            return
        # Copied here: vLLM may reuse its collections once this returns.
        step = step.copy()
        if self._lane is not None and (step.loads or step.cancelled):
            self._ask_lanes(step)
        if step:
            self._loop.loop.call_soon_threadsafe(self._handoff.step, step)

    def _ask_lanes(self, step: HandoffStep) -> None:
        """Take this step's routine loads out of `step` by asking their prefill engines' lanes
        from this thread, and its cancellations of loads asked so (`finished` reports them)."""
        lane = self._lane
        assert lane is not None
        for request_id in list(step.cancelled):
            asked = self._lane_asks.get(request_id)
            if asked is not None:
                lane.cancel(asked)
                step.cancelled.discard(request_id)
        rate = self.settings.integrity_sample_rate
        for request_id, spec in list(step.loads.items()):
            table = spec.block_ids
            if (
                spec.refusal
                or spec.prefill_incarnation is None
                or spec.prefill_ranks
                or not spec.prefill_inbox
                or len(table) != 1
                or NO_BLOCK in table[0]
                or request_id in step.cancelled
                or sampled(request_id, rate)  # its landed bytes are hashed: the usual path
            ):
                continue
            blocks = np.fromiter(table[0], dtype=np.int64, count=len(table[0]))
            asked = lane.ask(
                request_id,
                spec,
                (spec.prefill_engine, spec.prefill_incarnation),
                spec.prefill_inbox,
                spec.prefill_request_id,
                blocks,
                spec.first_block,
            )
            if asked is not None:
                self._lane_asks[request_id] = asked
                del step.loads[request_id]

    def _lane_ended(self) -> None:
        """Report the loads asked through lanes that ended; hand those a lane could not take to
        the agent's loop (asked the usual way, as if they came this step)."""
        lane, loop, handoff = self._lane, self._loop, self._handoff
        assert lane is not None and loop is not None and handoff is not None
        usual: dict[str, LoadSpec] = {}
        withdrawn: list[LoadSpec] = []
        observed: list[tuple[LoadSpec, float]] = []
        for asked in lane.poll():
            self._lane_asks.pop(asked.request_id, None)
            spec = asked.spec
            assert isinstance(spec, LoadSpec)
            answer = "none" if asked.answer is None else asked.answer.name.lower()
            blocks = int(asked.blocks.size) if asked.failed is False and not asked.cancelled else 0
            self._lane_figures.append((answer, spec.prefill_engine, blocks, asked.seconds))
            if asked.failed is None:
                usual[spec.request_id] = spec
                continue
            if asked.cancelled and asked.answer not in (LaneAnswer.DONE, LaneAnswer.FAILED):
                withdrawn.append(spec)  # the prefill engine frees its hold now, not at its lease's end
            if asked.failed:
                log.warning("kvray: KV of %s did not arrive through the lane: %s", spec.request_id, asked.why)
            if asked.failed is False and not asked.cancelled and self.observer is not None:
                observed.append((spec, asked.seconds))  # reported once the observer saw it
                continue
            self._results.loaded(spec, failed=asked.failed)
        if usual or withdrawn:
            loop.loop.call_soon_threadsafe(handoff.step, HandoffStep(loads=usual, withdrawn=withdrawn))
        for spec, seconds in observed:
            loop.loop.call_soon_threadsafe(handoff.lane_loaded, spec, seconds)

    def _count_lane_loads(self, figures: list[tuple[str, str, int, float]]) -> None:
        """The agent's figures for loads asked through lanes (on its loop): each ask's answer,
        and for each load moved its bytes and its wait."""
        agent = self.agent
        block_nbytes = sum(layer.geometry.block_nbytes for layer in agent.layout.layers)
        for answer, prefill, blocks, seconds in figures:
            agent.metrics.lane_ask(answer)
            if blocks:
                agent.metrics.received(prefill, blocks * block_nbytes)
                agent.metrics.wait(Outcome.OK, seconds)

    def preempt(self, handoff_ids: Collection[str]) -> None:
        """vLLM preempted the layer-wise requests of these hand-off ids (before the step's
        forward): return once no layer copy reads their blocks, or after `preempt_wait_s`, a
        step's budget: a request whose copies still run then has its push aborted
        (`Handoff.preempt`), so vLLM's thread never waits on a slow copy."""
        if self._loop is None or self._handoff is None or not handoff_ids:
            return
        try:
            self._loop.run(
                self._handoff.preempt(set(handoff_ids), self.preempt_wait_s),
                timeout=self.preempt_wait_s + PREEMPT_LOOP_SLACK_S,
            )
        except TimeoutError:
            # The agent's loop is busy: the hand-off still aborts any push whose copies outlast
            # the wait, so the step may go on.
            log.warning(
                "kvray: preempted hand-offs %s: the agent's loop did not answer in time", sorted(handoff_ids)
            )

    def begin_layerwise(self, specs: Mapping[str, LayerwiseSpec]) -> None:
        """This step's forward computes these requests' whole prompts (before the first layer
        is saved)."""
        self._saving = {}
        if self._loop is not None and self._handoff is not None:
            self._loop.loop.call_soon_threadsafe(self._handoff.layerwise, dict(specs))

    def save_kv_layer(self, layer_name: str) -> None:
        """vLLM's forward has written layer `layer_name`'s KV of this step: with layer-wise
        requests this step (`begin`), they are handed over at the first layer, then each
        layer is pushed as it is saved (`save_layer`)."""
        if not self._step_layerwise:
            return
        if not self._step_layerwise_begun:
            self._step_layerwise_begun = True
            self.begin_layerwise(self._step_layerwise)
        self.save_layer(layer_name)

    def save_layer(self, layer_name: str) -> None:
        """The forward has written vLLM layer `layer_name`'s KV of this step; its kvray layer is
        pushed once every vLLM layer sharing it has been saved too (one, unless the model's KV
        cache groups share memory). The blocks are held until the push ends, so the copy runs
        on the agent's loop meanwhile."""
        if self._loop is None or self._handoff is None or self.cache is None:
            return
        layer = self.cache.layer_of.get(layer_name)
        if layer is None:
            return  # not a layer whose cache vLLM registered
        saved = self._saving.setdefault(layer, set())
        saved.add(layer_name)
        if saved != self.cache.users[layer]:
            return
        ready = None
        tensor = self.cache.tensors[layer]
        if tensor.is_cuda:
            # The layer's KV is written once the forward's stream gets here: its copies wait
            # for this event on the GPU, and this thread never waits for the GPU.
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(tensor.device))
        self._loop.loop.call_soon_threadsafe(self._handoff.save_layer, layer, ready)

    def finished(self) -> tuple[set[str], set[str], set[int], set[str]]:
        """(sent, received, blocks that failed to load, requests that failed to load) since the
        last call; held requests whose lease ended count as sent (their blocks may go)."""
        if self._loop is not None and self._handoff is not None:
            if self._lane_asks:
                self._lane_ended()
            now = time.monotonic()
            if now >= self._next_tick:
                # One hop to the agent's loop every `TICK_S` at most, not one per call: vLLM asks
                # every step, and each hop wakes the loop's thread.
                self._next_tick = now + TICK_S
                figures, self._lane_figures = self._lane_figures, []
                self._loop.loop.call_soon_threadsafe(self._tick, figures)
        return self._results.take()

    def _tick(self, lane_figures: list[tuple[str, str, int, float]]) -> None:
        """On the agent's loop: leases that ended, and the figures of loads asked through lanes."""
        assert self._handoff is not None
        self._handoff.expire()
        if lane_figures:
            self._count_lane_loads(lane_figures)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """`finished` as vLLM's `get_transfer_results` reports it: (sent, received, failed to
        receive); the blocks that failed to load wait for `take_load_errors`. vLLM takes
        block-level load errors from models of one KV cache group only; with several, a
        failed request is reported (`failed_recving`) and nothing else."""
        sent, received, errors, failed = self.finished()
        if self._groups == 1:
            self._load_errors |= errors
        return sent, received, failed

    def take_load_errors(self) -> set[int]:
        """The blocks that failed to load since the last call (`get_block_ids_with_load_errors`)."""
        errors, self._load_errors = self._load_errors, set()
        return errors


#: `kv_connector_extra_config` keys of the connector itself; every other key is a setting.
CONNECTOR_KEYS = frozenset(
    {
        "lease_s",
        "ray_address",
        "node_id",
        "handoff_key",
        "handoff_key_file",
        "preempt_wait_s",
    }
)
#: Keys of the connectors that instrument kvray's, by the connector that reads them (its
#: `kv_connector` and `kv_connector_module_path`): `KvrayConnector` itself refuses them.
INSTRUMENTATION_KEYS = {
    "digest_log": ("DigestLogConnector", "kvray.bench.handoff_log"),
    "digest_every": ("DigestLogConnector", "kvray.bench.handoff_log"),
    "seed_bug": ("SeedBugConnector", "kvray.faults"),
}


def settings_from(extra: Mapping[str, Any], connector_keys: Collection[str] = CONNECTOR_KEYS) -> Settings:
    """`kvray.Settings` from the environment, then the connector's `kv_connector_extra_config`
    (keys named like the settings' fields; `connector_keys` are the connector's own); an
    unknown key is an error, not ignored."""
    import msgspec

    settings = Settings.from_env()
    known = {field.name for field in msgspec.structs.fields(Settings)}
    chosen = {key: value for key, value in extra.items() if key not in connector_keys}
    instrumentation = sorted(set(chosen) & INSTRUMENTATION_KEYS.keys())
    if instrumentation:
        key = instrumentation[0]
        connector, module = INSTRUMENTATION_KEYS[key]
        raise ConfigError(
            f"kv_connector_extra_config key {key!r} is read by {connector}, not by KvrayConnector: "
            f'load that connector by module path ("kv_connector": "{connector}", '
            f'"kv_connector_module_path": "{module}"); it takes every other key KvrayConnector takes',
            key=key,
            connector=connector,
            module=module,
        )
    unknown = sorted(set(chosen) - known)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has keys kvray does not know: {unknown}; use kvray.Settings "
            f"field names ({', '.join(sorted(known))})",
            unknown=unknown,
        )
    try:
        return msgspec.convert({**msgspec.structs.asdict(settings), **chosen}, Settings)
    except msgspec.ValidationError as error:
        raise ConfigError(f"kv_connector_extra_config: {error}") from None
