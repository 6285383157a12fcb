"""The worker side of `KvrayConnector` (runs in each vLLM worker process): the engine's KV cache
as one kvray backing, a kvray agent on an event loop of its own, and the two halves of a P/D
hand-off — the decode side reserves the blocks vLLM allocated and asks the prefill engine to
push; the prefill side pushes the finished request's blocks, once, then lets vLLM free them.

vLLM's forward path never waits for kvray: every agent call is submitted to the agent's loop
thread, and results come back through thread-safe sets that `get_finished` drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import threading
import time
import zlib
from collections.abc import Collection, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from kvray.agent import KVAgent, PushResult
from kvray.completion import CompletionInbox, CompletionOutbox
from kvray.config import Settings
from kvray.errors import (
    BackpressureError,
    ConfigError,
    KvrayError,
    NotExpectedError,
    StaleIncarnationError,
)
from kvray.layout import Geometry, KVLayout, LayerSpec
from kvray.memory import TORCH_DTYPES, Backing, create_shm_buffer
from kvray.owned import remove_owned
from kvray.wire import (
    EngineInfo,
    PushRequest,
    PushWithdrawn,
    Reservation,
    Role,
    decode_engine_info,
    decode_push_message,
    encode,
)

if TYPE_CHECKING:
    from kvray.serve.host import ReplicaEngine

log = logging.getLogger("kvray.vllm")

#: How long a push waits before asking again while the agent's transfer queue is full.
BACKPRESSURE_RETRY_S = 0.01

#: Key of a prefill engine's push-request inbox in its `EngineInfo.endpoints`.
PUSH_ENDPOINT = "push_requests"

T = TypeVar("T")
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class LoadSpec:
    """What the decode side's worker needs to receive one request (from its scheduler)."""

    request_id: str
    prefill_engine: str
    #: None: the orchestrator gave this engine the request first, naming the prefill engine
    #: alone; its current incarnation, node and inbox come from the coordinator.
    prefill_incarnation: int | None
    #: The hand-off's id at the prefill engine (minted by kvray, signed).
    prefill_request_id: str
    #: The prefill engine's Ray node and push-request inbox, as its ticket names them.
    prefill_node: str
    prefill_inbox: str
    #: The blocks vLLM allocated here for the request's pushed tokens, in order.
    block_ids: tuple[int, ...]
    #: Which of the prefill engine's blocks of the request the first of them takes.
    first_block: int
    #: Why the request's ticket was refused ("": it was not): its load fails at once.
    refusal: str = ""

    @classmethod
    def refused(cls, request_id: str, block_ids: tuple[int, ...], why: str) -> LoadSpec:
        return cls(request_id, "", None, "", "", "", block_ids, 0, refusal=why)


@dataclass(frozen=True)
class PrefillAddress:
    """Where a decode engine sends a push request: the prefill engine's id and incarnation,
    its Ray node and its push-request inbox on that node ("" if it has none)."""

    engine_id: str
    incarnation: int
    node_id: str
    inbox: str


@dataclass(frozen=True)
class SendSpec:
    """A finished request the prefill side holds for a decode engine (from its scheduler)."""

    #: vLLM's id of the request (reported back when its blocks may go).
    request_id: str
    block_ids: tuple[int, ...]
    #: The id decode engines ask for (the client's hand-off id); "" means `request_id`.
    key: str = ""
    #: The request did not finish well: end (abort) any push of it, send nothing.
    failed: bool = False

    @property
    def handoff(self) -> str:
        return self.key or self.request_id


@dataclass(frozen=True)
class LayerwiseSpec:
    """A request whose whole prompt this step computes, for a decode engine: each layer is
    pushed as the forward saves it, if the decode engine has asked by then (from its scheduler)."""

    request_id: str
    key: str
    block_ids: tuple[int, ...]


def layout_of(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_size: int
) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    """A kvray layout read from vLLM's real per-layer cache tensors, and the tensors viewed as
    that layout's shapes. A block of a layer must be one contiguous run (`[num_blocks, ...]`)
    or two, K and V (`[2, num_blocks, ...]`); what lies inside a block is vLLM's business,
    since whole blocks move."""
    layers: list[LayerSpec] = []
    views: dict[str, torch.Tensor] = {}
    for name, tensor in kv_caches.items():
        if not tensor.is_contiguous():
            raise ConfigError(
                f"vLLM's KV cache of layer {name!r} is not contiguous (strides {tensor.stride()}); "
                "kvray moves whole blocks of a contiguous per-layer cache",
                layer=name,
            )
        if tensor.dtype not in _DTYPE_NAMES:
            raise ConfigError(f"layer {name!r} caches {tensor.dtype}, which kvray does not know", layer=name)
        shape: tuple[int, ...]
        if tensor.dim() >= 2 and tensor.shape[0] == num_blocks:
            parts, shape = 1, (num_blocks, block_size)
        elif tensor.dim() >= 3 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
            parts, shape = 2, (2, num_blocks, block_size)
        else:
            raise ConfigError(
                f"vLLM's KV cache of layer {name!r} has shape {tuple(tensor.shape)}: kvray needs the "
                f"block axis ({num_blocks} blocks) first, or second after a K/V axis of 2",
                layer=name,
            )
        per_token = tensor.numel() // (parts * num_blocks * block_size)
        if per_token * parts * num_blocks * block_size != tensor.numel():
            raise ConfigError(
                f"layer {name!r}: {tensor.numel()} elements are not whole tokens of blocks of {block_size}",
                layer=name,
            )
        geometry = Geometry(
            block_size=block_size, entry_shape=(per_token,), dtype=_DTYPE_NAMES[tensor.dtype], parts=parts
        )
        layers.append(LayerSpec(name=name, geometry=geometry))
        views[name] = tensor.view(*shape, per_token)
    return KVLayout(layers=tuple(layers), num_blocks=num_blocks), views


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
class _Sending:
    """A finished request the prefill side holds, until pushed or its lease ends."""

    spec: SendSpec
    lease_ends: float
    pushing: bool = False


@dataclass
class _Layered:
    """A request pushed layer by layer during its forward (loop thread only)."""

    spec: LayerwiseSpec
    #: Layers the forward has saved so far, in order.
    saved: list[str] = field(default_factory=list)
    #: The decode engine's push request, once it has come, and the blocks it takes.
    request: PushRequest | None = None
    blocks: tuple[int, ...] = ()
    pushes: list[asyncio.Task[int]] = field(default_factory=list)
    #: When the forward saved the last layer (`time.perf_counter`).
    last_saved: float = 0.0


@dataclass
class _Results:
    """What the agent's loop reports back to vLLM's thread (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def take(self) -> tuple[set[str], set[str], set[int], set[str]]:
        with self.lock:
            taken = (self.finished_sending, self.finished_recving, self.load_errors, self.failed_recving)
            self.finished_sending, self.finished_recving = set(), set()
            self.load_errors, self.failed_recving = set(), set()
        return taken


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
        digest_log: str | None = None,
        digest_every: int = 1,
        seed_bug: bool = False,
        ray_address: str | None = None,
        node_id: str | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.role = role
        self.settings = settings
        self.lease_s = lease_s
        #: Where to append per-layer digests of every request's KV as sent and as received
        #: (JSON lines), to compare both sides; None: no digests.
        self.digest_log = digest_log
        #: Hash one request in this many (chosen by the prefill request's id, so both sides
        #: hash the same ones); every request's times are logged.
        self.digest_every = max(1, digest_every)
        #: Plan with offsets cached by block geometry alone (`kvray.faults`): the bug kvray
        #: exists to stop, for demonstrations and the tests that must catch it.
        self.seed_bug = seed_bug
        #: The Ray cluster to join (its GCS address), or None. Joined, the engine registers
        #: with kvray's coordinator through a host actor (`kvray.serve.host.ReplicaEngine`):
        #: peers find it by engine id, and engines on other nodes reach it (the `ray`
        #: transport, push requests and notices through the host). Not joined, peers know it
        #: only from `kv_transfer_params`, and both engines must share a node.
        self.ray_address = ray_address
        #: The Ray node the engine runs on, if the engine's launcher knows better than the
        #: Ray client this worker starts (e.g. several nodes of one machine).
        self.node_id = node_id
        self._replica: ReplicaEngine | None = None
        self._shm_path: str | None = None
        #: The storage mapping `_shm_path` (its first byte's address).
        self._shm_storage = 0
        self._agent: KVAgent | None = None
        self._loop: AgentLoop | None = None
        self._inbox: CompletionInbox | None = None
        self._outbox: CompletionOutbox | None = None
        self._results = _Results()
        #: Loop thread only: requests held for a decode engine, and push requests that came
        #: before their request's hand-over from the scheduler.
        self._sending: dict[str, _Sending] = {}
        self._early: dict[str, tuple[PushRequest, float]] = {}
        #: Loop thread only: requests pushed layer by layer (by hand-off key), and those whose
        #: forward runs in this step.
        self._layered: dict[str, _Layered] = {}
        self._this_step: list[_Layered] = []
        #: Loop thread only: hand-off keys that will never have KV here, until when a push
        #: request for one is refused at once; and the decode side's loads still waiting.
        self._dropped: dict[str, float] = {}
        self._receiving: dict[str, asyncio.Task[None]] = {}
        #: Loop thread only: loads whose task has taken its first step.
        self._loads_begun: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- memory -------------------------------------------------------------------------

    @contextlib.contextmanager
    def allocation_context(self) -> Iterator[None]:
        """While vLLM allocates its KV cache (one `torch.zeros` of the whole size on CPU),
        place that buffer in a kvray shared-memory file, so that prefill engines on this node
        write straight into it. Other allocations pass through."""
        original = torch.zeros
        worker = self

        def zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
            device = torch.device(kwargs.get("device") or "cpu")
            if (
                worker._shm_path is None
                and len(dims) == 1
                and kwargs.get("dtype") == torch.int8
                and device.type == "cpu"
                and int(dims[0]) >= 1 << 20
            ):
                return worker._shared_buffer(int(dims[0]))
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

    # ---- start and stop ---------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_size: int) -> EngineInfo:
        """Describe vLLM's KV cache as one kvray backing and start the agent."""
        layout, views = layout_of(kv_caches, num_blocks, block_size)
        shm_path = self._shm_path
        if shm_path is not None and any(
            view.untyped_storage().data_ptr() != self._shm_storage for view in views.values()
        ):
            # Not every layer lives in the placed buffer: each storage is its own region, in
            # this process's memory (writable by the `ray` transport, not `shm`).
            remove_owned(shm_path)  # mapped still: the memory stays until the buffer goes
            shm_path = self._shm_path = None
        backing = Backing.adopt(layout, views, settings=self.settings, shm_path=shm_path)
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
        cache = None
        if self.seed_bug:
            from kvray.faults import SeedBugOffsetCache

            cache = SeedBugOffsetCache()
        agent = KVAgent(
            self.engine_id,
            self.role,
            backing=backing,
            settings=self.settings,
            coordinator=coordinator,
            use_coordinator=coordinator is not None,
            offset_cache=cache,
        )
        if self.node_id is not None:
            agent.node_id = self.node_id
        return agent

    async def _start(self, backing: Backing) -> EngineInfo:
        # Every engine may prefill (kv_both too): decode engines on this node reach it through
        # this inbox (others through its host actor, when it has joined Ray).
        self._inbox = CompletionInbox(self.settings.shm_dir, self._on_push_request)
        self._outbox = CompletionOutbox(self.settings.shm_dir)
        endpoints = {PUSH_ENDPOINT: self._inbox.path}
        if self.ray_address is None:
            self._agent = self._new_agent(backing)
            return await self._agent.start(endpoints=endpoints)
        from kvray.serve.host import ReplicaEngine

        self._replica = await ReplicaEngine.start_agent(
            lambda directory: self._new_agent(backing, directory),
            self.settings,
            endpoints=endpoints,
            on_push_request=self._on_push_request,
        )
        self._agent = self._replica.agent
        return self._agent.info

    @property
    def agent(self) -> KVAgent:
        assert self._agent is not None, "register() starts the agent"
        return self._agent

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
        for task in list(self._tasks):
            task.cancel()
        if self._inbox is not None:
            self._inbox.close()
        if self._outbox is not None:
            self._outbox.close()
        if self._replica is not None:
            await self._replica.close()  # closes the agent, then its host
        elif self._agent is not None:
            await self._agent.close()

    # ---- each step --------------------------------------------------------------------

    def begin(
        self,
        loads: Mapping[str, LoadSpec],
        sends: Mapping[str, SendSpec],
        *,
        dropped: Collection[str] = (),
        cancelled: Collection[str] = (),
        released: Collection[str] = (),
        withdrawn: Collection[LoadSpec] = (),
    ) -> None:
        """This step's new hand-offs, from the scheduler (called from vLLM's thread): loads
        and sends to start, hand-offs that will never have KV (`dropped`, by key), loads no
        longer wanted (`cancelled`, by request id), held requests a proxy released
        (`released`, by key: their decode leg failed) and loads that ended before they began
        (`withdrawn`: their prefill engine is told not to hold them)."""
        if self._loop is None or not (loads or sends or dropped or cancelled or released or withdrawn):
            return
        self._loop.loop.call_soon_threadsafe(
            self._begin,
            dict(loads),
            dict(sends),
            set(dropped),
            set(cancelled),
            set(released),
            list(withdrawn),
        )

    def _begin(
        self,
        loads: dict[str, LoadSpec],
        sends: dict[str, SendSpec],
        dropped: set[str],
        cancelled: set[str],
        released: set[str],
        withdrawn: list[LoadSpec],
    ) -> None:
        now = time.monotonic()
        for spec in sends.values():
            self._hold(spec, now, dropped)
        for key in dropped:
            self._dropped[key] = now + self.lease_s
            early = self._early.pop(key, None)
            if early is not None:
                self._spawn(self._refuse(early[0], _ENDED_WITHOUT_KV))
        for key in released:
            sending = self._sending.get(key)
            if sending is not None and not sending.pushing:
                del self._sending[key]
                self._spent(key, now)
                self._done_sending(sending.spec.request_id)
        for load in loads.values():
            task = self._receiving[load.request_id] = self._spawn(self._receive(load))
            task.add_done_callback(functools.partial(self._load_ended, load))
        for request_id in cancelled:
            receiving = self._receiving.pop(request_id, None)
            if receiving is not None:
                receiving.cancel()
        for load in withdrawn:
            self._spawn(self._withdraw_load(load))

    def _hold(self, spec: SendSpec, now: float, dropped: set[str]) -> None:
        """Hold a finished request for its decode engine, unless its hand-off id is taken:
        a second request under one id ends at once and never replaces the first."""
        key = spec.handoff
        layered = self._layered.get(key)
        if layered is not None and layered.spec.request_id == spec.request_id:
            del self._layered[key]
            if layered.request is not None:
                self._spawn(self._finish_layered(layered, spec))
                return
            if key in self._dropped:  # the decode engine withdrew while the forward ran
                self._done_sending(spec.request_id)
                return
        elif layered is not None or key in self._sending or key in self._dropped:
            log.warning("kvray: hand-off %s is taken; request %s is not held", key, spec.request_id)
            self._done_sending(spec.request_id)
            return
        if spec.failed:
            self._done_sending(spec.request_id)
            dropped.add(key)
            return
        self._sending[key] = _Sending(spec, now + self.lease_s)
        early = self._early.pop(key, None)
        if early is not None:
            self._spawn(self._push(early[0]))

    def _spent(self, key: str, now: float) -> None:
        """A hand-off id whose request is gone: asks and holds under it are refused a lease long."""
        self._dropped[key] = now + self.lease_s

    def _load_ended(self, spec: LoadSpec, task: asyncio.Task[None]) -> None:
        """A load cancelled before its first step never ran its own reporting: report it here
        (it reserved nothing, so its blocks are simply free)."""
        if task.cancelled() and spec.request_id not in self._loads_begun:
            self._receiving.pop(spec.request_id, None)
            with self._results.lock:
                self._results.finished_recving.add(spec.request_id)
            if not spec.refusal:
                self._spawn(self._withdraw_load(spec))
        self._loads_begun.discard(spec.request_id)

    def preempt(self, keys: Collection[str]) -> None:
        """vLLM preempted these layer-wise requests (from vLLM's thread, before the step's
        forward): return once no layer copy reads their blocks. The decode engine's ask is
        kept; the request is pushed whole once it runs again and finishes."""
        if self._loop is None or not keys:
            return
        try:
            self._loop.run(self._preempt(set(keys)), timeout=self.settings.transfer_timeout_s + 5.0)
        except TimeoutError:
            log.error("kvray: layer copies of preempted requests %s did not end in time", sorted(keys))

    async def _preempt(self, keys: set[str]) -> None:
        for key in keys:
            layered = self._layered.pop(key, None)
            if layered is None:
                continue
            self._log_event("preempted", layered.spec.request_id, key)
            if layered in self._this_step:
                self._this_step.remove(layered)
            await asyncio.gather(*layered.pushes, return_exceptions=True)
            if layered.request is None:
                continue
            assert self._agent is not None
            await self._agent.forget_layers(layered.request.reservation.request_id)
            self._early[key] = (layered.request, time.monotonic())

    def begin_layerwise(self, specs: Mapping[str, LayerwiseSpec]) -> None:
        """This step's forward computes these requests' whole prompts (from vLLM's thread,
        before the first layer is saved)."""
        if self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._begin_layerwise, dict(specs))

    def save_layer(self, layer_name: str) -> None:
        """The forward has written `layer_name`'s KV of this step (from vLLM's thread); the
        blocks are held until the push ends, so the copy runs on the agent's loop meanwhile."""
        if self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._save_layer, layer_name)

    def finished(self) -> tuple[set[str], set[str], set[int], set[str]]:
        """(sent, received, blocks that failed to load, requests that failed to load) since the
        last call; held requests whose lease ended count as sent (their blocks may go)."""
        if self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._expire)
        return self._results.take()

    def _expire(self) -> None:
        now = time.monotonic()
        for key, sending in list(self._sending.items()):
            if not sending.pushing and sending.lease_ends <= now:
                del self._sending[key]
                self._done_sending(sending.spec.request_id)
                log.warning("kvray: no decode engine asked for %s within its lease; freed", key)
        for key, until in list(self._dropped.items()):
            if until <= now:
                del self._dropped[key]
        # A decode engine may ask before the prefill engine has even seen the request.
        grace = self.lease_s
        for request_id, (request, arrived) in list(self._early.items()):
            if arrived + grace <= now:
                del self._early[request_id]
                self._spawn(self._refuse(request, "the prefill engine holds no such finished request"))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _done_sending(self, request_id: str) -> None:
        with self._results.lock:
            self._results.finished_sending.add(request_id)

    # ---- decode side ------------------------------------------------------------------

    async def _receive(self, spec: LoadSpec) -> None:
        """Reserve the blocks, ask the prefill engine to push, wait, and report; the blocks are
        vLLM's again only once no write of the request can land."""
        agent = self._agent
        assert agent is not None
        self._loads_begun.add(spec.request_id)
        ok = False
        reserved = False
        cancelled = False
        try:
            if spec.refusal:
                raise NotExpectedError(
                    f"request {spec.request_id!r} was refused: {spec.refusal}", request_id=spec.request_id
                )
            prefill = await self._prefill_engine(spec)
            if prefill.engine_id != spec.prefill_engine or spec.prefill_incarnation not in (
                None,
                prefill.incarnation,
            ):
                raise StaleIncarnationError(
                    f"request {spec.request_id!r} names prefill engine {spec.prefill_engine!r} "
                    f"incarnation {spec.prefill_incarnation}, but the coordinator knows "
                    f"{prefill.engine_id!r} incarnation {prefill.incarnation}",
                    engine_id=spec.prefill_engine,
                )
            reservation = agent.expect(spec.request_id, list(spec.block_ids))
            reserved = True
            request = PushRequest(
                request_id=spec.prefill_request_id,
                src_engine=prefill.engine_id,
                src_incarnation=prefill.incarnation,
                reservation=reservation,
                first_block=spec.first_block,
                decode_info=encode(agent.info),
            )
            asked = time.perf_counter()
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await self._send_to_prefill(prefill, encode(request))
            await agent.wait_for_kv(spec.request_id, timeout=self.settings.transfer_timeout_s)
            ok = True
            waited = time.perf_counter() - asked
            await self._record("received", spec.prefill_request_id, spec.block_ids, None, seconds=waited)
        except asyncio.CancelledError:
            # vLLM ended the request while its KV loaded: release as below, report no errors,
            # and tell the prefill engine not to keep the request for a push no one takes.
            cancelled = True
            self._spawn(self._withdraw_load(spec))
            self._log_event("receive cancelled", spec.request_id, spec.prefill_request_id)
        except Exception as error:
            log.warning("kvray: KV of %s did not arrive: %s", spec.request_id, error)
            self._log_event("receive failed", spec.request_id, spec.prefill_request_id, error=_why(error))
        finally:
            # From here on the load is not cancelled: a release must run to its end.
            self._receiving.pop(spec.request_id, None)
            if reserved:
                try:
                    await agent.release(spec.request_id)
                except KvrayError as error:
                    ok = False
                    log.error("kvray: %s could not be released: %s", spec.request_id, error)
                    # A writer may still write into the blocks: vLLM keeps them (the request
                    # is not reported) until the agent's quarantine of it ends.
                    quarantined = agent.quarantined.get(spec.request_id)
                    if quarantined is not None:
                        await quarantined.wait()
            with self._results.lock:
                self._results.finished_recving.add(spec.request_id)
                # A cancelled request is gone: its blocks are free, not blocks to recompute.
                if not ok and not cancelled:
                    self._results.failed_recving.add(spec.request_id)
                    self._results.load_errors.update(spec.block_ids)

    async def _prefill_engine(self, spec: LoadSpec) -> PrefillAddress:
        """Where the prefill engine takes push requests: as its own ticket names it, else (the
        request came here first) from the coordinator."""
        if spec.prefill_incarnation is not None:
            return PrefillAddress(
                spec.prefill_engine, spec.prefill_incarnation, spec.prefill_node, spec.prefill_inbox
            )
        agent = self._agent
        assert agent is not None
        if self._replica is None:
            raise NotExpectedError(
                f"request {spec.request_id!r} names prefill engine {spec.prefill_engine!r} alone: only "
                "an engine that joined Ray (ray_address) can look it up; give this engine the "
                "prefill engine's kv_transfer_params instead",
                engine_id=spec.prefill_engine,
            )
        peer = await agent.peer(spec.prefill_engine, wait_s=self.settings.lookup_timeout_s)
        info = peer.info
        return PrefillAddress(
            info.engine_id, info.incarnation, info.node_id, info.endpoints.get(PUSH_ENDPOINT, "")
        )

    async def _withdraw_load(self, spec: LoadSpec) -> None:
        """Tell the prefill engine this engine will not take the request (best effort, bounded:
        otherwise its lease frees it)."""
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                prefill = await self._prefill_engine(spec)
                withdrawn = PushWithdrawn(
                    request_id=spec.prefill_request_id,
                    src_engine=prefill.engine_id,
                    src_incarnation=prefill.incarnation,
                )
                await self._send_to_prefill(prefill, encode(withdrawn))
        except Exception as error:
            log.info("kvray: could not withdraw %s from its prefill engine: %s", spec.request_id, _why(error))

    async def _send_to_prefill(self, prefill: PrefillAddress, message: bytes) -> None:
        """Send a push request or withdrawal: through the prefill engine's inbox on this node,
        else through its host actor (found by the coordinator, which must know this
        incarnation)."""
        agent = self._agent
        assert agent is not None and self._outbox is not None
        if prefill.inbox and prefill.node_id == agent.node_id:
            await self._outbox.send(prefill.inbox, message)
            return
        if self._replica is None:
            raise NotExpectedError(
                f"prefill engine {prefill.engine_id!r} runs on node {prefill.node_id!r} and this decode "
                f"engine on {agent.node_id!r}: engines on different nodes must both join Ray "
                "(kv_connector_extra_config ray_address)",
                engine_id=prefill.engine_id,
            )
        peer = await agent.peer(prefill.engine_id, wait_s=self.settings.notify_timeout_s)
        if peer.info.incarnation != prefill.incarnation:
            raise StaleIncarnationError(
                f"prefill engine {prefill.engine_id!r} restarted (incarnation {peer.info.incarnation}, "
                f"the request names {prefill.incarnation}): its KV of the request is gone",
                engine_id=prefill.engine_id,
            )
        if peer.host is None:
            raise NotExpectedError(
                f"prefill engine {prefill.engine_id!r} has no host actor to take push requests",
                engine_id=prefill.engine_id,
            )
        await peer.host.kvray_request_push.remote(message)

    def _learn_peer(self, request: PushRequest) -> None:
        """Check the decode engine's info a push request carries against its reservation, and
        take it, unless this engine has joined Ray: then the coordinator is the one to ask (it
        knows the engine's host actor, which the `ray` transport and notices from another node
        need)."""
        assert self._agent is not None
        if not request.decode_info:
            return
        decode = decode_engine_info(request.decode_info)
        reservation = request.reservation
        if (decode.engine_id, decode.incarnation) != (reservation.engine_id, reservation.incarnation):
            raise NotExpectedError(
                "a push request's decode info does not match its reservation", request_id=request.request_id
            )
        if self._replica is None:
            self._agent.add_peer(decode)

    # ---- prefill side -----------------------------------------------------------------

    def _on_push_request(self, message: bytes) -> None:
        """A decode engine's push request, from the inbox (on the loop thread)."""
        try:
            request = decode_push_message(message)
        except KvrayError as error:
            log.warning("kvray: dropped a malformed push request: %s", error)
            return
        assert self._agent is not None  # the inbox opens once the agent has started
        if (request.src_engine, request.src_incarnation) != (self.engine_id, self._agent.incarnation):
            if isinstance(request, PushRequest):
                self._spawn(self._refuse(request, "it names another incarnation of this prefill engine"))
            return
        if isinstance(request, PushWithdrawn):
            self._withdraw(request.request_id)
            return
        layered = self._layered.get(request.request_id)
        if layered is not None and layered.request is None:
            self._start_layered(layered, request)
        elif request.request_id in self._sending:
            self._spawn(self._push(request))
        elif request.request_id in self._dropped:
            self._spawn(self._refuse(request, _ENDED_WITHOUT_KV))
        elif len(self._early) >= self.settings.max_expected_requests or request.request_id in self._early:
            self._spawn(self._refuse(request, "too many push requests wait for their requests here"))
        else:  # the request may not have reached this engine yet, or its hand-over is a step behind
            self._early[request.request_id] = (request, time.monotonic())
            self._log_event("asked", request.request_id, request.request_id)

    def _withdraw(self, key: str) -> None:
        """The decode engine will not take hand-off `key`: free it if held and not being pushed,
        and refuse to hold it (or push it) later."""
        now = time.monotonic()
        self._early.pop(key, None)
        sending = self._sending.get(key)
        if sending is not None:
            if sending.pushing:
                return  # the push ends it either way
            del self._sending[key]
            self._done_sending(sending.spec.request_id)
        layered = self._layered.get(key)
        if layered is not None and layered.request is not None:
            return  # its layers are being pushed: the decode side refuses them, and it ends
        self._spent(key, now)
        self._log_event("withdrawn", key, key)

    async def _push(self, request: PushRequest) -> None:
        agent = self._agent
        assert agent is not None
        sending = self._sending.get(request.request_id)
        if sending is None or sending.pushing:
            await self._refuse(request, "the request is not held here, or is already being pushed")
            return
        sending.pushing = True
        reservation = request.reservation
        try:
            blocks = _taken_blocks(request, sending.spec.block_ids)
            self._learn_peer(request)
            result = await self._push_when_room(agent, reservation, blocks, sending.lease_ends)
            await self._record("sent", request.request_id, blocks, result, layerwise=False)
        except Exception as error:  # the push told the decode side, or this does
            log.warning("kvray: push of %s failed: %s", request.request_id, error)
            self._log_event("push failed", request.request_id, request.request_id, error=_why(error))
            if not isinstance(error, KvrayError) or isinstance(error, NotExpectedError):
                await agent.abort(reservation, _why(error))
        finally:
            if self._sending.get(request.request_id) is sending:
                del self._sending[request.request_id]
                self._spent(request.request_id, time.monotonic())
            self._done_sending(sending.spec.request_id)

    # ---- prefill side, layer by layer -------------------------------------------------

    def _begin_layerwise(self, specs: dict[str, LayerwiseSpec]) -> None:
        self._this_step = []
        for spec in specs.values():
            if spec.key in self._layered or spec.key in self._sending or spec.key in self._dropped:
                log.warning(
                    "kvray: hand-off %s is taken; request %s is not pushed", spec.key, spec.request_id
                )
                continue
            layered = self._layered[spec.key] = _Layered(spec)
            self._this_step.append(layered)
            early = self._early.pop(spec.key, None)
            if early is not None:
                self._start_layered(layered, early[0])

    def _save_layer(self, layer_name: str) -> None:
        now = time.perf_counter()
        for layered in self._this_step:
            layered.saved.append(layer_name)
            layered.last_saved = now
            if layered.request is not None:
                self._push_layer(layered, layer_name)

    def _start_layered(self, layered: _Layered, request: PushRequest) -> None:
        """The decode engine asked while the forward runs: push the layers saved so far now,
        the others as they are saved, and finish when vLLM hands the finished request over."""
        try:
            layered.blocks = _taken_blocks(request, layered.spec.block_ids)
            self._learn_peer(request)
        except Exception as error:
            self._spawn(self._refuse(request, _why(error)))
            return
        layered.request = request
        for layer_name in layered.saved:
            self._push_layer(layered, layer_name)

    def _push_layer(self, layered: _Layered, layer_name: str) -> None:
        assert layered.request is not None
        push = self._layer_when_room(layered.request.reservation, layer_name, layered.blocks)
        layered.pushes.append(asyncio.get_running_loop().create_task(push))

    async def _layer_when_room(self, reservation: Reservation, layer_name: str, blocks: Sequence[int]) -> int:
        """Push one layer, waiting while the agent's queue of transfers is full (a decode engine
        that asks once many forwards have saved every layer queues each of their layers at
        once), up to a lease from now."""
        agent = self._agent
        assert agent is not None
        until = time.monotonic() + self.lease_s
        while True:
            try:
                return await agent.push_layer(reservation, layer_name, np.asarray(blocks))
            except BackpressureError:
                if time.monotonic() >= until:
                    raise
                await asyncio.sleep(BACKPRESSURE_RETRY_S)

    async def _finish_layered(self, layered: _Layered, spec: SendSpec) -> None:
        """Wait for the request's layer pushes, push any layer the forward did not save, and
        finish (or abort, if anything failed or the request did not finish well); then the
        request's blocks may go."""
        agent = self._agent
        request = layered.request
        assert agent is not None and request is not None
        reservation = request.reservation
        try:
            outcomes = await asyncio.gather(*layered.pushes, return_exceptions=True)
            failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if spec.failed:
                raise NotExpectedError(
                    f"prefill request {spec.request_id!r} did not finish", request_id=spec.request_id
                )
            if failures:
                raise failures[0]
            pushed = set(layered.saved)
            for layer_name in agent.layout.layer_names:
                if layer_name not in pushed:
                    await agent.push_layer(reservation, layer_name, np.asarray(layered.blocks))
            result = await agent.finish(reservation.request_id)
            # From the last layer's KV in the prefill's cache to the decode side told it may
            # decode: what the layer-wise push leaves after the forward.
            tail = time.perf_counter() - layered.last_saved
            await self._record("sent", request.request_id, layered.blocks, result, layerwise=True, tail=tail)
        except Exception as error:
            log.warning("kvray: layer-wise push of %s failed: %s", request.request_id, error)
            self._log_event("push failed", request.request_id, request.request_id, error=_why(error))
            with contextlib.suppress(Exception):
                await agent.abort(reservation, _why(error))
        finally:
            self._spent(layered.spec.key, time.monotonic())
            self._done_sending(spec.request_id)

    async def _record(
        self,
        side: str,
        prefill_request: str,
        blocks: Sequence[int],
        result: PushResult | None,
        *,
        seconds: float | None = None,
        layerwise: bool | None = None,
        tail: float | None = None,
    ) -> None:
        """Append the per-layer digests of a request's blocks and how long its side of the
        transfer took (see `digest_log`), hashing on a thread: the loop keeps moving other
        requests' KV meanwhile. The caller holds the blocks until this returns."""
        if self.digest_log is None or self._agent is None:
            return
        digests = await asyncio.to_thread(self._digests, prefill_request, blocks)
        self._log_event(
            side,
            result.request_id if result is not None else prefill_request,
            prefill_request,
            seconds=result.seconds if result is not None else seconds,
            transport=result.transport.value if result is not None else None,
            layerwise=layerwise,
            tail_seconds=tail,
            layers=digests,
        )

    def _digests(self, prefill_request: str, blocks: Sequence[int]) -> dict[str, str]:
        """Per-layer SHA-256 of the request's blocks, for one request in `digest_every`."""
        assert self._agent is not None
        if zlib.crc32(prefill_request.encode()) % self.digest_every != 0:
            return {}
        index = torch.as_tensor(list(blocks), dtype=torch.long)
        digests = {}
        for name, view in self._agent.backing.views.items():
            block_axis = view.dim() - 3  # [(2,) blocks, tokens, entry]
            picked = view.index_select(block_axis, index).contiguous().view(torch.uint8)
            digests[name] = hashlib.sha256(picked.numpy().tobytes()).hexdigest()
        return digests

    def _log_event(self, side: str, request_id: str, prefill_request: str, **fields: Any) -> None:
        """Append one JSON line to the digest log (if any): a hand-off's digests and times, a
        push request waiting for its request ("asked"), or why a hand-off failed ("error")."""
        if self.digest_log is None:
            return
        record = {"side": side, "request": request_id, "prefill_request": prefill_request, **fields}
        with contextlib.suppress(OSError), open(self.digest_log, "a") as file:
            file.write(json.dumps(record) + "\n")

    @staticmethod
    async def _push_when_room(
        agent: KVAgent, reservation: Reservation, blocks: Sequence[int], until: float
    ) -> PushResult:
        """Push, waiting while the agent's queue of transfers is full (a batch of decode
        requests asks for many at once), up to the request's lease."""
        while True:
            try:
                return await agent.push(reservation, np.asarray(blocks, dtype=np.int64))
            except BackpressureError:
                if time.monotonic() >= until:
                    raise
                await asyncio.sleep(BACKPRESSURE_RETRY_S)

    async def _refuse(self, request: PushRequest, why: str) -> None:
        """Tell the decode side at once that its request's KV will not come."""
        agent = self._agent
        if agent is None:
            return
        with contextlib.suppress(Exception):
            with contextlib.suppress(KvrayError):  # a mismatched info: tell the reservation's engine
                self._learn_peer(request)
            await agent.abort(request.reservation, f"push of {request.request_id!r} refused: {why}")


def _taken_blocks(request: PushRequest, held: Sequence[int]) -> tuple[int, ...]:
    """The blocks of a held request that a push request's reservation takes."""
    count = len(request.reservation.blocks)
    blocks = tuple(held[request.first_block : request.first_block + count])
    if len(blocks) != count:
        raise NotExpectedError(
            f"request {request.request_id!r} holds {len(held)} blocks here; the decode engine "
            f"reserved {count} from block {request.first_block}",
            request_id=request.request_id,
        )
    return blocks


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


#: Why a push request for a dropped hand-off is refused.
_ENDED_WITHOUT_KV = "the prefill request ended without its KV"

#: `kv_connector_extra_config` keys of the connector itself; every other key is a setting.
CONNECTOR_KEYS = frozenset(
    {"lease_s", "digest_log", "digest_every", "seed_bug", "ray_address", "node_id", "handoff_key"}
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
