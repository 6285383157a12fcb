"""What every step of an agent shares: the engine's identity, memory and settings, its metrics,
and the background tasks it must cancel when it closes."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvray.config import Settings
from kvray.content import landed_between
from kvray.errors import AgentNotRunningError
from kvray.integrity import THREAD_MIN_BYTES
from kvray.memory import Backing, MemoryKind, SourceReady
from kvray.metrics import EngineMetrics
from kvray.wire import EngineInfo, Role


def node_id() -> str:
    """This node's id: Ray's, inside a Ray worker; the host name otherwise."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # outside a Ray worker: the host name is the node
        pass
    return socket.gethostname()


def node_address() -> str | None:
    """This node's IP address as Ray knows it, inside a Ray worker; None outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:  # outside a Ray worker: no address known to peers
        pass
    return None


#: Block ids as callers give them.
Blocks = Sequence[int] | npt.NDArray[np.integer]


@dataclass
class Engine:
    """One engine as its agent's steps see it."""

    engine_id: str
    role: Role
    settings: Settings
    backing: Backing
    node_id: str
    metrics: EngineMetrics
    incarnation: int = 0
    #: What the engine published, once it has started.
    published: EngineInfo | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Tasks running on the engine's behalf (notices, releases), cancelled when it closes.
    background: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def info(self) -> EngineInfo:
        if self.published is None:
            raise AgentNotRunningError(
                f"agent {self.engine_id!r} has not started; await agent.start() first",
                engine_id=self.engine_id,
            )
        return self.published

    @property
    def running(self) -> bool:
        return self.published is not None and not self.closed.is_set()

    def check_running(self) -> None:
        if not self.running:
            raise AgentNotRunningError(
                f"agent {self.engine_id!r} is not running; "
                + ("it has closed" if self.closed.is_set() else "await agent.start() first"),
                engine_id=self.engine_id,
            )

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background until it ends or the engine closes."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


async def landed_in(
    backing: Backing,
    src_region: npt.NDArray[np.int64],
    src_offset: npt.NDArray[np.int64],
    dst_region: npt.NDArray[np.int64],
    dst_offset: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    ready: SourceReady = None,
) -> int | None:
    """The landed digest (`kvray.content.landed_between`) of bytes in `backing`'s memory: on a
    worker thread when large, on the GPU by the `cuda_ipc` op kernel storing nothing (after
    `ready`, what says a writer's source bytes are written); None where that kernel cannot run
    (GPU memory without Triton)."""
    if backing.kind is MemoryKind.CUDA:
        from kvray.transport.cuda_staging import triton_available

        if not triton_available():
            return None
        from kvray.transport.cuda_ipc.ops import landed_digest

        tensors = [region.tensor for region in backing.regions]
        return await landed_digest(tensors, src_region, src_offset, dst_region, dst_offset, nbytes, ready)
    regions = [region.tensor.numpy() for region in backing.regions]
    arguments = (regions, src_region, src_offset, dst_region, dst_offset, nbytes)
    if int(nbytes.sum()) < THREAD_MIN_BYTES:
        return landed_between(*arguments)
    return await asyncio.to_thread(landed_between, *arguments)
