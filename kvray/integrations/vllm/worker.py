"""The worker side of `KvrayConnector` (runs in each vLLM worker process): the engine's KV cache
as one kvray backing, a kvray agent on an event loop of its own, and the hand-off
(`kvray.agent.handoff.Handoff`) fed with the scheduler's decisions of each step.

vLLM's forward path never waits for kvray: every agent call is submitted to the agent's loop
thread, and results come back through thread-safe sets that `get_finished` drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Collection, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvray.agent.handoff import (
    AskProof,
    Handoff,
    HandoffObserver,
    HandoffStep,
    LayerwiseSpec,
    LoadSpec,
    table_blocks,
)
from kvray.agent.kvagent import KVAgent
from kvray.config import Settings
from kvray.errors import ConfigError, LayoutError
from kvray.layout import HEAD_AXIS, MAX_PARTS, Geometry, KVLayout, LayerSpec, TensorParallel, align_up
from kvray.memory import (
    TORCH_DTYPES,
    Backing,
    BlockStrides,
    check_adopted_disjoint,
    create_shm_buffer,
    cuda_pool_buffer,
)
from kvray.metrics import IntervalSink
from kvray.owned import remove_owned
from kvray.wire import EngineInfo, Role

if TYPE_CHECKING:
    from kvray.host.forwarded import ForwardedAgent
    from kvray.plan import OffsetCache

log = logging.getLogger("kvray.vllm")

T = TypeVar("T")
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class CacheLayout:
    """vLLM's KV cache as kvray moves it: one kvray layer per distinct per-layer tensor (vLLM's
    KV cache groups share memory: with sliding-window and full-attention groups, one tensor
    is the cache of one layer of each group, and a block id belongs to one group at a time),
    named after the first vLLM layer that uses it."""

    layout: KVLayout
    #: vLLM's tensors, by kvray layer.
    tensors: dict[str, torch.Tensor]
    #: How each tensor lays out its blocks (`Backing.adopt`).
    strides: dict[str, BlockStrides]
    #: The kvray layer of each vLLM layer.
    layer_of: dict[str, str]
    #: The vLLM layers of each kvray layer: it is pushed once the forward has saved them all.
    users: dict[str, frozenset[str]]


def layout_of(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    group_layers: Sequence[Sequence[str]] = (),
    tp: TensorParallel | None = None,
) -> CacheLayout:
    """kvray's layout of vLLM's real per-layer cache tensors (`CacheLayout`), on the CPU or a
    GPU. A block of a layer must be one contiguous run or a few runs one stride apart
    (`block_runs`); what lies inside a run is vLLM's business, since whole blocks move, but its
    order is part of the geometry. Tensors that are one another's memory (the same storage,
    offset, shape, strides and dtype) are one kvray layer; tensors that overlap otherwise are
    refused. `tp`: this worker's tensor-parallel rank of its engine. `group_layers`: each KV
    cache group's layers; every group must cover every kvray
    layer (its blocks are then moved in all of them), else the model is refused here, at
    start-up, naming the groups."""
    layers: list[LayerSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    strides: dict[str, BlockStrides] = {}
    layer_of: dict[str, str] = {}
    users: dict[str, set[str]] = {}
    by_memory: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in kv_caches.items():
        memory = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        shared = by_memory.get(memory)
        if shared is not None:
            layer_of[name] = shared
            users[shared].add(name)
            continue
        geometry, strides[name] = block_runs(name, tensor, num_blocks, block_size)
        layers.append(LayerSpec(name=name, geometry=geometry))
        tensors[name] = tensor
        by_memory[memory] = layer_of[name] = name
        users[name] = {name}
    layout = KVLayout(layers=tuple(layers), num_blocks=num_blocks, tp=tp or TensorParallel())
    _check_disjoint(layout, tensors, strides)
    _check_groups(group_layers, layer_of, list(tensors))
    return CacheLayout(
        layout,
        tensors,
        strides,
        layer_of,
        {name: frozenset(names) for name, names in users.items()},
    )


def _axis_names(rank: int, block_axis: int) -> tuple[str, ...]:
    """Names of a cache tensor's axes (for `Geometry.block_layout`): vLLM's [B, H, N, C] views
    (every KV cache layout of vLLM 0.32 and later: blocks, KV heads, tokens, K and V content),
    its earlier backends' [2, B, N, H, D] (K and V apart, FlashAttention), [B, 2, N, H, D]
    (FlashInfer) and [B, N, C] (an MLA latent); other shapes by position."""
    if rank == 4 and block_axis == 0:
        return ("B", "H", "N", "C")
    if rank == 5:
        return ("KV", "B", "N", "H", "D") if block_axis == 1 else ("B", "KV", "N", "H", "D")
    if rank == 3 and block_axis == 0:
        return ("B", "N", "C")
    return tuple(f"d{axis}" for axis in range(rank))


def block_runs(
    name: str, tensor: torch.Tensor, num_blocks: int, block_size: int
) -> tuple[Geometry, BlockStrides]:
    """A vLLM layer tensor's kvray geometry and block strides.

    The block axis is the first (`[num_blocks, ...]`, or `num_blocks` × kernel blocks that
    split each block evenly), or the second after a K/V axis of 2 (`[2, num_blocks, ...]`).
    Within a block, the innermost axes that are dense in memory make one run; the axes outside
    them must step by one stride, and they number the block's parts (K and V, or the KV heads
    of a layout that keeps the heads outside the blocks). Whatever does not fit (an element
    stride inside a run, parts at two strides) is refused here, at start-up."""
    if tensor.dtype not in _DTYPE_NAMES:
        raise ConfigError(f"layer {name!r} caches {tensor.dtype}, which kvray does not know", layer=name)
    shape, steps = list(tensor.shape), list(tensor.stride())
    split_kv = len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks
    names = list(_axis_names(len(shape), 1 if split_kv else 0))
    if shape and shape[0] == num_blocks:
        block_axis = 0
    elif split_kv:
        block_axis = 1
    elif len(shape) >= 2 and shape[0] > num_blocks and shape[0] % num_blocks == 0:
        # Kernel blocks: vLLM splits each block into `ratio` smaller ones for the kernels.
        ratio = shape[0] // num_blocks
        shape = [num_blocks, ratio, *shape[1:]]
        steps = [steps[0] * ratio, steps[0], *steps[1:]]
        names = [names[0], "K", *names[1:]]
        block_axis = 0
    else:
        raise ConfigError(
            f"vLLM's KV cache of layer {name!r} has shape {tuple(tensor.shape)}: kvray needs the "
            f"block axis ({num_blocks} blocks) first, or second after a K/V axis of 2",
            layer=name,
        )
    # The axes inside a block, outer to inner in memory (axes of one element say nothing).
    inner = sorted(
        (
            (steps[axis], shape[axis], names[axis])
            for axis in range(len(shape))
            if axis != block_axis and shape[axis] > 1
        ),
        key=lambda axis: -axis[0],
    )
    outer = list(inner)
    run_elements = 1
    while outer and outer[-1][0] == run_elements:
        run_elements *= outer.pop()[1]
    if run_elements == 1 and outer:
        raise ConfigError(
            f"vLLM's KV cache of layer {name!r} (shape {tuple(tensor.shape)}, strides "
            f"{tuple(tensor.stride())}) has no contiguous innermost axis; kvray moves blocks as runs "
            "of contiguous bytes",
            layer=name,
        )
    parts, part_step = 1, 0
    if outer:
        part_step = expected = outer[-1][0]
        for step, size, _ in reversed(outer):
            if step != expected:
                raise ConfigError(
                    f"vLLM's KV cache of layer {name!r} (shape {tuple(tensor.shape)}, strides "
                    f"{tuple(tensor.stride())}) keeps a block's parts at more than one stride; kvray "
                    "moves a block as runs one stride apart",
                    layer=name,
                )
            parts *= size
            expected = step * size
    if run_elements % block_size:
        raise ConfigError(
            f"layer {name!r}: a run of {run_elements} elements is not whole tokens of blocks of {block_size}",
            layer=name,
        )
    # A rank holding one KV head still says where its heads are (TP planning slices blocks by
    # them), at one place for every layout: its stride says nothing, and one head orders no bytes.
    holds_one_head = any(
        axis != block_axis and names[axis] == HEAD_AXIS and shape[axis] == 1 for axis in range(len(shape))
    )
    part_axes = [f"{label}{size}" for _, size, label in outer]
    run_axes = [f"{label}{size}" for _, size, label in inner[len(outer) :]]
    block_layout = " ".join([*part_axes, *([f"{HEAD_AXIS}1"] if holds_one_head else []), *run_axes])
    if parts > MAX_PARTS:
        raise ConfigError(
            f"layer {name!r}: a block is {parts} separate runs, more than the {MAX_PARTS} kvray moves",
            layer=name,
        )
    itemsize = tensor.element_size()
    geometry = Geometry(
        block_size=block_size,
        entry_shape=(run_elements // block_size,),
        dtype=_DTYPE_NAMES[tensor.dtype],
        parts=parts,
        block_layout=block_layout,
    )
    return geometry, BlockStrides(part_step * itemsize, steps[block_axis] * itemsize)


def _check_disjoint(
    layout: KVLayout, tensors: Mapping[str, torch.Tensor], strides: Mapping[str, BlockStrides]
) -> None:
    """Two kvray layers must not share a byte: a write into one would land in the other."""
    try:
        check_adopted_disjoint(layout, tensors, strides)
    except LayoutError as error:
        raise ConfigError(
            f"vLLM's KV caches of two layers overlap without being the same tensor; kvray cannot "
            f"move them apart ({error})"
        ) from None


def _check_groups(
    group_layers: Sequence[Sequence[str]], layer_of: Mapping[str, str], kvray_layers: Sequence[str]
) -> None:
    """Every KV cache group must have a layer in every kvray layer: a block id of any group is
    then moved in every kvray layer, which is that group's KV and no other's."""
    everything = set(kvray_layers)
    for index, names in enumerate(group_layers):
        unknown = sorted(set(names) - set(layer_of))
        if unknown:
            raise ConfigError(
                f"KV cache group {index} names layers vLLM registered no cache for: {unknown[:3]}",
                group=index,
            )
        covered = {layer_of[name] for name in names}
        if len(group_layers) > 1 and covered != everything:
            raise ConfigError(
                f"KV cache group {index} ({len(names)} layers) does not share its memory with the "
                f"other groups' layers ({len(everything - covered)} of {len(everything)} layer "
                "caches hold none of its blocks): kvray moves models whose KV cache groups share "
                "one cache per layer position (vLLM's hybrid KV cache manager with groups of one "
                "page size), not groups of different shapes",
                group=index,
            )


class AgentLoop:
    """An asyncio event loop on a daemon thread of its own, for the agent."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def run(self, work: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `work` on the loop and wait for it here (set-up and shut-down only)."""
        return self.submit(work).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            # Releases the loop's selector and self-pipe; a loop whose thread did not stop in
            # time is left to that daemon thread.
            self.loop.close()


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

    # ---- memory -------------------------------------------------------------------------

    @contextlib.contextmanager
    def allocation_context(self) -> Iterator[None]:
        """While vLLM allocates its KV cache (one `torch.zeros` of the whole size, on the CPU or
        a GPU), place that buffer where same-node writers can reach it and nothing else can be
        reached with it: on the CPU a kvray shared-memory file (an engine that takes writes), on
        a GPU a CUDA allocation of its own (a private memory pool: the allocation a CUDA IPC
        handle exports holds the KV cache and no other tensor; a pure producer's is aligned
        there too, and exported to no one). Other allocations pass through."""
        original = torch.zeros
        worker = self

        def zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
            device = torch.device(kwargs.get("device") or "cpu")
            if (
                worker._shm_path is None
                and worker._cuda_buffer is None
                and len(dims) == 1
                and kwargs.get("dtype") == torch.int8
                and int(dims[0]) >= 1 << 20
            ):
                if device.type == "cpu" and worker.role is Role.DECODE:
                    return worker._shared_buffer(int(dims[0]))
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
        return self._loop.run(self._start(backing), timeout=self.settings.lookup_timeout_s + 60)

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

    def begin(self, step: HandoffStep) -> None:
        """This step's new hand-offs, from the scheduler (`Handoff.step`)."""
        if self._loop is None or self._handoff is None or not step:
            return
        # Copied here: vLLM may reuse its collections once this returns.
        self._loop.loop.call_soon_threadsafe(self._handoff.step, step.copy())

    def preempt(self, keys: Collection[str]) -> None:
        """vLLM preempted these layer-wise requests (before the step's forward): return once no
        layer copy reads their blocks, or after `preempt_wait_s`, a step's budget: a request
        whose copies still run then has its push aborted (`Handoff.preempt`), so vLLM's thread
        never waits on a slow copy."""
        if self._loop is None or self._handoff is None or not keys:
            return
        try:
            self._loop.run(
                self._handoff.preempt(set(keys), self.preempt_wait_s),
                timeout=self.preempt_wait_s + PREEMPT_LOOP_SLACK_S,
            )
        except TimeoutError:
            # The agent's loop is busy: the hand-off still aborts any push whose copies outlast
            # the wait, so the step may go on.
            log.warning("kvray: preempted requests %s: the agent's loop did not answer in time", sorted(keys))

    def begin_layerwise(self, specs: Mapping[str, LayerwiseSpec]) -> None:
        """This step's forward computes these requests' whole prompts (before the first layer
        is saved)."""
        self._saving = {}
        if self._loop is not None and self._handoff is not None:
            self._loop.loop.call_soon_threadsafe(self._handoff.layerwise, dict(specs))

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
            self._loop.loop.call_soon_threadsafe(self._handoff.expire)
        return self._results.take()


#: `kv_connector_extra_config` keys of the connector itself; every other key is a setting.
CONNECTOR_KEYS = frozenset(
    {
        "lease_s",
        "digest_log",
        "digest_every",
        "seed_bug",
        "ray_address",
        "node_id",
        "handoff_key",
        "handoff_key_file",
        "preempt_wait_s",
    }
)


def settings_from(extra: Mapping[str, Any]) -> Settings:
    """`kvray.Settings` from the environment, then the connector's `kv_connector_extra_config`
    (keys named like the settings' fields); an unknown key is an error, not ignored."""
    import msgspec

    settings = Settings.from_env()
    known = {field.name for field in msgspec.structs.fields(Settings)}
    chosen = {key: value for key, value in extra.items() if key not in CONNECTOR_KEYS}
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
