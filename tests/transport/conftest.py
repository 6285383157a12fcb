"""Fixtures of the transport contract suite: one suite, run against every transport kvray builds.

Both ends of every transfer live in this process, so no Ray cluster is needed: the destination
is a decode engine's shared-memory backing, the source a prefill engine's CPU backing, and for
the `ray` transport a `LocalHost` stands in for the Ray actor that hosts the decode agent. The
receiving half it runs is kvray's own `apply_write`, so the destination's checks are the real ones.

`TransportUnderTest` builds engines, plans and peers the way an agent would, and the `assert_*`
helpers check a destination byte for byte: the written blocks hold the source's bytes, and every
other byte of the allocation (other blocks, padding, the slack around the region) still holds
the canary it was filled with.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle
import threading
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import pytest_asyncio
import torch

from kvray.config import Settings
from kvray.errors import TransportUnavailableError, UnknownEngineError
from kvray.layout import KVLayout
from kvray.memory import Backing, MemoryKind
from kvray.placement import Stored
from kvray.plan import OffsetCache, OpTable, TransferPlan, plan_transfer
from kvray.transport import Peer, Receiver, Transport, transport_class
from kvray.transport.base import OpsCheck
from kvray.wire import EngineInfo, Role, TransportKind

ByteArray = npt.NDArray[np.uint8]

#: How the suite reaches a peer, per transport. A transport kvray builds and this machine can run,
#: but that has no entry here, fails the suite (it needs a harness) rather than skipping silently.
HARNESS_KINDS = frozenset({TransportKind.SHM, TransportKind.RAY, TransportKind.VERBS})

#: The `verbs` transport on the FAKE device of tests/transport/fake_verbs.py (no hardware needed);
#: the plain `verbs` parameter runs the same suite through real pyverbs and an RDMA device.
FAKE_VERBS = "verbs-fake"

#: Transports whose availability check is skipped here, and why.
BYPASS_AVAILABILITY = {
    # RayTransport.unavailable_reason asks for ray.is_initialized(); the contract suite delivers
    # through an in-process LocalHost instead of an actor, so it runs without a Ray cluster.
    TransportKind.RAY: "delivered through the in-process LocalHost, not a Ray actor",
}


def _transport_params() -> list[Any]:
    """Every TransportKind this kvray build has a back-end for (kinds it does not build are covered
    by the registry test); a back-end that fails to import is a skip carrying the registry's reason."""
    params = []
    for kind in TransportKind:
        try:
            transport_class(kind)
        except TransportUnavailableError as error:
            if error.__cause__ is None:  # not part of this build: nothing to run
                continue
            params.append(pytest.param(kind, id=kind.value, marks=pytest.mark.skip(reason=str(error))))
            continue
        params.append(pytest.param(kind, id=kind.value))
        if kind is TransportKind.VERBS:
            params.append(pytest.param(FAKE_VERBS, id=FAKE_VERBS))
    return params


TRANSPORT_PARAMS = _transport_params()


# ---- an in-process stand-in for the Ray actor hosting the decode agent --------------------------


class _RemoteMethod:
    """`actor.method` of a Ray actor handle: `.remote(...)` returns an awaitable."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def remote(self, *args: Any) -> Any:
        return self._function(*args)


class LocalHost:
    """IN-PROCESS STAND-IN for a Ray actor hosting a decode agent (an `AgentHost`), for tests only.

    `kvray_deliver.remote(header, payload)` runs `kvray.transport.ray.apply_write` on the
    destination backing right here. It mimics what Ray does around the call: the payload
    arrives as a read-only array (as numpy arrays come out of the object store), and an error
    raised by the receiving half crosses back pickled and wrapped in a `RayTaskError` that is
    also an instance of its cause (`RayTaskError.as_instanceof_cause`), as `await ref` raises it.
    """

    def __init__(self, backing: Backing, engine_id: str, incarnation: int) -> None:
        self.backing = backing
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.deliveries = 0
        self.kvray_deliver = _RemoteMethod(self._deliver)

    async def _deliver(self, header: bytes, payload: ByteArray) -> int:
        from kvray.transport.ray import apply_write

        self.deliveries += 1
        received = np.array(payload, copy=True)
        received.flags.writeable = False
        try:
            return await apply_write(self.backing, self.engine_id, self.incarnation, bytes(header), received)
        except Exception as error:
            raise _as_ray_task_error(error) from None


class LocalVerbsHost:
    """IN-PROCESS STAND-IN for the Ray actor hosting a decode agent, for the `verbs` transport:
    `kvray_connect.remote(request)` answers the handshake with the transport's own `accept` for
    `receiver` (the suite's one transport is both the writer and the decode side, its queue pairs
    connected to each other). Errors cross back as Ray would carry them."""

    def __init__(self, transport: Transport, receiver: Receiver) -> None:
        self.transport = transport
        self.receiver = receiver
        self.connects = 0
        self.kvray_connect = _RemoteMethod(self._connect)

    async def _connect(self, request: bytes) -> bytes:
        self.connects += 1
        try:
            return await self.transport.accept(self.receiver, bytes(request))
        except Exception as error:
            raise _as_ray_task_error(error) from None


def _as_ray_task_error(error: Exception) -> Exception:
    import ray.exceptions

    crossed = pickle.loads(pickle.dumps(error))
    wrapped: Exception = ray.exceptions.RayTaskError("kvray_deliver", "(in-process)", crossed)
    return wrapped.as_instanceof_cause()  # type: ignore[attr-defined, no-any-return]


# ---- engines, transports, plans, and byte checks --------------------------------------------------


@dataclass
class Engine:
    """One side of a transfer: its backing and the info it publishes."""

    engine_id: str
    incarnation: int
    role: Role
    backing: Backing
    info: EngineInfo


class EngineReceiver:
    """IN-PROCESS STAND-IN for the agent a receiving transport serves (`kvray.transport.Receiver`):
    one engine's info (read when asked: tests may forge it) and backing; writers are looked up in
    `writers` (the suite's directory); every request is admitted and its ops are not checked."""

    def __init__(self, engine: Engine, writers: Callable[[str, int], Awaitable[EngineInfo]]) -> None:
        self.engine = engine
        self._writers = writers

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def backing(self) -> Backing:
        return self.engine.backing

    @contextlib.asynccontextmanager
    async def admit(self, request_id: str, token: int) -> AsyncIterator[OpsCheck]:
        yield lambda regions, offsets, nbytes: None

    async def writer(self, engine_id: str, incarnation: int) -> EngineInfo:
        return await self._writers(engine_id, incarnation)


@dataclass
class TransportUnderTest:
    """A transport, the engines it moves bytes between, and the checks of what it wrote."""

    kind: TransportKind
    transport: Transport
    rng: np.random.Generator
    backings: list[Backing] = field(default_factory=list)
    #: False where a device, not this process, moves the bytes (real RDMA): no copy to gate.
    in_process_copies: bool = True
    #: The fake RDMA network, for the `verbs-fake` parameter.
    fabric: Any = None
    _incarnations: Iterator[int] = field(default_factory=lambda: itertools.count(101))
    #: The latest engine made under each id: the directory a decode side checks writers in.
    engines: dict[str, Engine] = field(default_factory=dict)

    # ---- engines and plans ----

    def _engine(
        self, backing: Backing, engine_id: str, role: Role, incarnation: int | None, remote_writable: bool
    ) -> Engine:
        self.backings.append(backing)
        incarnation = next(self._incarnations) if incarnation is None else incarnation
        regions = self.transport.register(backing, engine_id, incarnation, remote_writable=remote_writable)
        info = backing.engine_info(engine_id, incarnation, role, "node-a", regions)
        engine = Engine(engine_id, incarnation, role, backing, info)
        self.engines[engine_id] = engine
        self.refill(engine)
        return engine

    def source(
        self, layout: KVLayout, *, engine_id: str = "prefill-0", backing: Backing | None = None
    ) -> Engine:
        """A prefill engine: a CPU backing of random bytes, nothing remotely writable."""
        backing = backing or Backing.allocate(layout, MemoryKind.CPU)
        return self._engine(backing, engine_id, Role.PREFILL, None, False)

    def destination(
        self,
        layout: KVLayout,
        *,
        engine_id: str = "decode-0",
        incarnation: int | None = None,
        backing: Backing | None = None,
        remote_writable: bool = True,
    ) -> Engine:
        """A decode engine: a shared-memory backing (unless given one) whose allocation, slack
        included, is filled with random canary bytes."""
        backing = backing or Backing.allocate(layout, MemoryKind.SHM)
        return self._engine(backing, engine_id, Role.DECODE, incarnation, remote_writable)

    def peer(self, engine: Engine, info: EngineInfo | None = None) -> Peer:
        """How a writer reaches `engine`, optionally through an older or forged `info`."""
        host: Any = None
        if self.kind is TransportKind.RAY:
            host = LocalHost(engine.backing, engine.engine_id, engine.incarnation)
        elif self.kind is TransportKind.VERBS:
            host = LocalVerbsHost(self.transport, self.receiver(engine))
        return Peer(info or engine.info, host=host)

    def receiver(self, engine: Engine) -> EngineReceiver:
        """`engine` as the transport's receiving half sees it (its agent, in a real run)."""
        return EngineReceiver(engine, self.registered)

    async def registered(self, engine_id: str, incarnation: int) -> EngineInfo:
        """An engine's current registration, as a decode agent's directory lookup returns it."""
        engine = self.engines.get(engine_id)
        if engine is None:
            raise UnknownEngineError(f"engine {engine_id!r} is not registered", engine_id=engine_id)
        return engine.info

    def plan(
        self,
        source: Engine,
        destination: Engine,
        local_blocks: Sequence[int] | npt.NDArray[np.int64],
        remote_blocks: Sequence[int] | npt.NDArray[np.int64],
        layers: Sequence[str] | None = None,
        cache: OffsetCache | None = None,
    ) -> TransferPlan:
        return plan_transfer(source.info, destination.info, local_blocks, remote_blocks, layers, cache)

    async def write(self, plan: TransferPlan, source: Engine, destination: Engine) -> None:
        await self.transport.write(plan, source.backing, self.peer(destination))

    def scattered(self, num_blocks: int, count: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Random distinct local and remote block ids, in unrelated orders."""
        local = self.rng.choice(num_blocks, size=count, replace=False).astype(np.int64)
        remote = self.rng.choice(num_blocks, size=count, replace=False).astype(np.int64)
        return local, remote

    # ---- bytes ----

    @staticmethod
    def allocation(engine: Engine | Backing, index: int = 0) -> ByteArray:
        """The whole allocation region `index` lies in (region plus slack), as a live numpy view."""
        backing = engine.backing if isinstance(engine, Engine) else engine
        allocation = backing.regions[index].allocation
        assert allocation is not None
        return allocation.numpy()

    def refill(self, engine: Engine) -> None:
        """Fresh random bytes in every allocation, slack included (source data or canary)."""
        for index in range(len(engine.backing.regions)):
            target = self.allocation(engine, index)
            target[:] = np.frombuffer(self.rng.bytes(target.size), dtype=np.uint8)

    def snapshot(self, engine: Engine) -> list[ByteArray]:
        return [self.allocation(engine, index).copy() for index in range(len(engine.backing.regions))]

    @staticmethod
    def maps(path: str) -> list[tuple[int, int, int]]:
        """(start, end, file offset) of every mapping of the file `path` in this process."""
        mappings = []
        real = os.path.realpath(path)
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip().removesuffix(" (deleted)") in (path, real):
                    start, end = (int(value, 16) for value in fields[0].split("-"))
                    mappings.append((start, end, int(fields[2], 16)))
        return mappings

    def assert_unchanged(
        self, engine: Engine, before: Sequence[ByteArray], what: str = "destination"
    ) -> None:
        for index, (was, now) in enumerate(zip(before, self.snapshot(engine), strict=True)):
            if not np.array_equal(was, now):
                first = int(np.flatnonzero(was != now)[0])
                region_offset = first - engine.backing.regions[index].span.offset_in_allocation
                raise AssertionError(
                    f"{what} region {index} changed at allocation byte {first} (region offset "
                    f"{region_offset}); {int((was != now).sum())} bytes differ"
                )

    def assert_landed(
        self,
        plan: TransferPlan,
        source: Engine,
        destination: Engine,
        before: Sequence[ByteArray],
        local_blocks: Sequence[int] | npt.NDArray[np.int64],
        remote_blocks: Sequence[int] | npt.NDArray[np.int64],
    ) -> None:
        """Every planned block of every planned layer holds the source's bytes, and nothing else in
        the destination's allocations changed: no other block or layer, no padding, no slack."""
        local = np.asarray(local_blocks, dtype=np.int64)
        remote = np.asarray(remote_blocks, dtype=np.int64)
        for layer in plan.layers:
            if not np.array_equal(block_bytes(source, layer, local), block_bytes(destination, layer, remote)):
                bad = [
                    int(remote_block)
                    for local_block, remote_block in zip(local, remote, strict=True)
                    if not np.array_equal(
                        block_bytes(source, layer, np.array([local_block])),
                        block_bytes(destination, layer, np.array([remote_block])),
                    )
                ]
                raise AssertionError(
                    f"layer {layer!r}: remote blocks {bad[:8]} do not hold the source's bytes"
                )
        masks = written_masks(plan.ops, destination.backing)
        layers_block_nbytes = sum(
            destination.backing.layout.layer(name).geometry.block_nbytes for name in plan.layers
        )
        written = sum(int(mask.sum()) for mask in masks)
        assert written == remote.size * layers_block_nbytes, (
            f"the plan's ops cover {written} bytes, but {remote.size} blocks of {len(plan.layers)} "
            f"layers are {remote.size * layers_block_nbytes}"
        )
        for index, (mask, was) in enumerate(zip(masks, before, strict=True)):
            changed = (self.allocation(destination, index) != was) & ~mask
            if changed.any():
                first = int(np.flatnonzero(changed)[0])
                region = destination.backing.regions[index]
                region_offset = first - region.span.offset_in_allocation
                where = "inside" if 0 <= region_offset < region.nbytes else "OUTSIDE"
                raise AssertionError(
                    f"region {index}: {int(changed.sum())} bytes the plan does not name changed, the "
                    f"first at region offset {region_offset} ({where} the region)"
                )


def written_masks(ops: OpTable, backing: Backing) -> list[npt.NDArray[np.bool_]]:
    """Per region of the destination, which bytes of its allocation the ops write."""
    masks = []
    for index, region in enumerate(backing.regions):
        allocation_nbytes = TransportUnderTest.allocation(backing, index).size
        select = ops.remote_region == index
        # Remote offsets are relative to the region's start, which lies inside the allocation.
        starts = ops.remote_offset[select] + region.span.offset_in_allocation
        ends = starts + ops.nbytes[select]
        mask = np.zeros(allocation_nbytes, dtype=np.bool_)
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            mask[start:end] = True
        masks.append(mask)
    return masks


def block_bytes(engine: Engine, layer: str, blocks: npt.NDArray[np.int64]) -> ByteArray:
    """The bytes of `blocks` of one layer's typed view, as uint8 (random bf16 bytes include NaNs)."""
    view = engine.backing.view(layer)
    parts = engine.backing.layout.layer(layer).geometry.parts
    selected = view[:, blocks] if parts == 2 else view[blocks]
    return selected.contiguous().view(torch.uint8).numpy()


# ---- fixtures ---------------------------------------------------------------------------------------


def _seed(text: str) -> int:
    """A stable seed per test (Python's str hash changes between runs)."""
    return zlib.crc32(text.encode())


def _open(kind: TransportKind | str, request: pytest.FixtureRequest) -> TransportUnderTest:
    settings = Settings()
    rng = np.random.default_rng(_seed(request.node.nodeid))
    if kind == FAKE_VERBS:
        from fake_verbs import FakeFabric

        from kvray.transport.verbs import VerbsTransport

        fabric = FakeFabric()
        transport = VerbsTransport(settings, api=fabric.api(), gpudirect=fabric.gpudirect)
        return TransportUnderTest(TransportKind.VERBS, transport, rng, fabric=fabric)
    assert isinstance(kind, TransportKind)
    cls = transport_class(kind)
    if kind not in BYPASS_AVAILABILITY:
        reason = cls.unavailable_reason(settings)
        if reason is not None:
            pytest.skip(f"transport {kind.value} is unavailable here: {reason}")
    if kind not in HARNESS_KINDS:
        pytest.fail(f"transport {kind.value} runs here but the contract suite has no harness for it yet")
    return TransportUnderTest(kind, cls(settings), rng, in_process_copies=kind is not TransportKind.VERBS)


async def _close(under_test: TransportUnderTest) -> None:
    await under_test.transport.close()
    for backing in under_test.backings:
        backing.close()
    if under_test.fabric is not None:
        under_test.fabric.gpudirect.close()


@pytest_asyncio.fixture(params=TRANSPORT_PARAMS, loop_scope="function")
async def tut(request: pytest.FixtureRequest) -> AsyncIterator[TransportUnderTest]:
    """The transport under test, one per kvray back-end; closed, and its backings freed, after."""
    under_test = _open(request.param, request)
    yield under_test
    await _close(under_test)


@pytest_asyncio.fixture(loop_scope="function")
async def shm(request: pytest.FixtureRequest) -> AsyncIterator[TransportUnderTest]:
    """The shm transport alone, for what only it has (mappings of a peer's file)."""
    under_test = _open(TransportKind.SHM, request)
    yield under_test
    await _close(under_test)


@pytest_asyncio.fixture(loop_scope="function")
async def verbs_fake(request: pytest.FixtureRequest) -> AsyncIterator[TransportUnderTest]:
    """The verbs transport on the FAKE RDMA device alone, for what only it has."""
    under_test = _open(FAKE_VERBS, request)
    yield under_test
    await _close(under_test)


@pytest_asyncio.fixture(loop_scope="function")
async def ray_side(request: pytest.FixtureRequest) -> AsyncIterator[TransportUnderTest]:
    """The ray transport alone, for its receiving half (`apply_write`)."""
    under_test = _open(TransportKind.RAY, request)
    yield under_test
    await _close(under_test)


# ---- watching the copies a transport issues ---------------------------------------------------------


def _mapped_ranges(writable: bool) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1][0] != "r" or (writable and fields[1][1] != "w"):
                continue
            start, end = (int(value, 16) for value in fields[0].split("-"))
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
    return ranges


def _inside(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(low <= start and end <= high for low, high in ranges)


class CopyGuard:
    """Wraps the batched copy the transports call so a copy that would leave mapped memory is
    refused (and recorded) instead of crashing or corrupting the test process. Only a safety net:
    the assertions of a test never rely on it."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.refused: list[str] = []

    async def __call__(
        self, dst_base: int, src_base: int, dst_offsets: Any, src_offsets: Any, nbytes: Any, **copy: Any
    ) -> Stored:
        writable, readable = _mapped_ranges(writable=True), _mapped_ranges(writable=False)
        for dst, src, count in zip(
            np.asarray(dst_offsets).tolist(),
            np.asarray(src_offsets).tolist(),
            np.asarray(nbytes).tolist(),
            strict=True,
        ):
            # Python ints: no int64 wrap-around here.
            problem = None
            if dst < 0 or src < 0 or count < 0:
                problem = f"negative offset or length ({dst}, {src}, {count})"
            elif not _inside(writable, dst_base + dst, dst_base + dst + count):
                problem = f"destination [{dst_base + dst:#x}, +{count}) is not mapped writable"
            elif not _inside(readable, src_base + src, src_base + src + count):
                problem = f"source [{src_base + src:#x}, +{count}) is not mapped"
            if problem is not None:
                self.refused.append(problem)
                raise RuntimeError(f"test copy guard refused a copy: {problem}")
        stored: Stored = await self.original(dst_base, src_base, dst_offsets, src_offsets, nbytes, **copy)
        return stored


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> CopyGuard:
    """Put a `CopyGuard` in front of every transport's batched copy."""
    import kvray.transport.ray
    import kvray.transport.shm

    copy_guard = CopyGuard(kvray.transport.shm.scatter_copy_async)
    for module in (kvray.transport.shm, kvray.transport.ray):
        monkeypatch.setattr(module, "scatter_copy_async", copy_guard)
    return copy_guard


class GatedCopies:
    """Stands in for `cpu_copy.scatter_copy` (what the copy threads run): each copy waits at a gate.
    A copy that would start after the write that issued it has already returned, or whose
    destination is no longer the memory it was when the copy was issued (`where` names what
    holds an address range, e.g. which file is mapped there), is recorded and skipped, not run."""

    def __init__(self, original: Callable[..., Stored]) -> None:
        self.original = original
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.late: list[int] = []
        self.unsafe: list[int] = []
        self.write_task: asyncio.Task[Any] | None = None
        self.where: Callable[[int, int], object] | None = None

    def __call__(
        self, dst_base: int, src_base: int, dst_offsets: Any, src_offsets: Any, nbytes: Any, *copy: Any
    ) -> Stored:
        """The fallback's copy threads (Python) call this."""
        low = dst_base + int(np.min(dst_offsets))
        high = dst_base + int(np.max(np.asarray(dst_offsets) + np.asarray(nbytes)))
        if self.admit(low, high, int(np.asarray(nbytes).sum())):
            return self.original(dst_base, src_base, dst_offsets, src_offsets, nbytes, *copy)
        return Stored(0, 0)

    def admit(self, low: int, high: int, total: int) -> bool:
        """Wait at the gate, then say whether the copy of [low, high) may run. The C pool's
        threads call this (`kvray._copy_pool.set_worker_hook`) before each batch of ops they claim."""
        with self.lock:
            self.running += 1
        try:
            issued_into = self.where(low, high) if self.where is not None else None
            self.entered.set()
            assert self.gate.wait(10), "the test never opened the gate"
            if self.write_task is not None and self.write_task.done():
                self.late.append(total)  # the write already returned: its buffers may be gone
                return False
            if self.where is not None and (issued_into is None or self.where(low, high) != issued_into):
                self.unsafe.append(total)
                return False
            return True
        finally:
            with self.lock:
                self.running -= 1

    async def drained(self) -> None:
        for _ in range(1000):
            with self.lock:
                if self.running == 0:
                    return
            await asyncio.sleep(0.01)
        raise AssertionError("copies still running 10 s after the gate opened")


@pytest.fixture(params=["pool", "python-threads"])
def gated(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[GatedCopies]:
    """Every batched copy goes through two threads (threshold 1) and a `GatedCopies`: the C
    copy pool's threads, or the fallback's Python threads."""
    from kvray.transport import cpu_copy

    gated_copies = GatedCopies(cpu_copy.scatter_copy)
    monkeypatch.setattr(cpu_copy, "scatter_copy", gated_copies)
    monkeypatch.setattr(cpu_copy, "_PARALLEL_THRESHOLD", 1)
    monkeypatch.setattr(cpu_copy, "copy_threads", lambda: 2)
    if request.param == "python-threads":
        monkeypatch.setattr(cpu_copy, "_start_copy", None)
        yield gated_copies
        return
    if not cpu_copy.native():
        pytest.skip("kvray._copy_pool (the C extension) is not built here")
    import kvray._copy_pool

    kvray._copy_pool.set_worker_hook(gated_copies.admit)
    try:
        yield gated_copies
    finally:
        kvray._copy_pool.set_worker_hook(None)
