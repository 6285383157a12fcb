"""Library host: a kvray agent inside a Ray Serve replica of any engine, reachable by its peers.

The agent's step in the data flow is unchanged; this module only gives it what a Ray actor
would: an actor for peers and the coordinator to call (`ReplicaHost`), a registration naming
that actor (`ReplicaDirectory`), and the replica-side loop that runs forwarded calls
(`ReplicaEngine`).

Peers reach a replica through its host. A Serve replica's actor is Serve's own wrapper, without
kvray's entry points, so each replica starts a small `ReplicaHost` actor that stands in for it:
the coordinator registers the engine with the host as its actor, holds its watch call on it and
drops the engine when it returns (the agent closed) or fails (the host died; it is owned by the
replica, so Ray ends it with the replica). Calls that reach the host (`ray`-transport writes,
completion notices, writers' claims and RDMA connection requests) are forwarded into the replica
over a long-poll call the replica keeps open (on one node, shared-memory writes and completions
do not pass through it).

    class MyDecode:                                  # a Serve deployment of your engine
        async def __init__(self) -> None:
            self.kv = await ReplicaEngine.start(replica_engine_id(), Role.DECODE, my_layout)
            self.model = MyModel(self.kv.agent.backing.views)   # your compute, on kvray's views
        async def check_health(self) -> None:
            await self.kv.check_health()
        async def __del__(self) -> None:
            await self.kv.close()                    # deregisters, closes the host

Health: `check_health` raises when the agent is closed, its host is gone, or the coordinator
does not have this engine incarnation registered (Serve replaces a replica after three failed
checks in a row; a coordinator restart is re-registered within a heartbeat).
"""

from __future__ import annotations

import asyncio
import enum
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import ray

from kvray.agent import DirectoryService, KVAgent
from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import (
    AgentNotRunningError,
    BackpressureError,
    KvrayError,
    MetadataError,
    NotExpectedError,
    TransferTimeoutError,
)
from kvray.layout import KVLayout
from kvray.memory import Backing, MemoryKind
from kvray.wire import Role

# ---- the actor that stands in for a replica ----------------------------------------------------


class HostCall(enum.Enum):
    """Calls a `ReplicaHost` forwards into its replica's agent."""

    DELIVER = "deliver"
    NOTIFY = "notify"
    CLAIM = "claim"
    CONNECT = "connect"
    REQUEST_PUSH = "request_push"


class ReplicaHost:
    """The Ray actor peers and the coordinator call for an agent that lives in a Serve replica.

    `kvray_watch` returns when the replica closes its agent (or fails when this actor dies with
    the replica that owns it); `kvray_deliver`, `kvray_notify`, `kvray_claim` and
    `kvray_connect` (and `kvray_request_push`, for engines that take push requests) are
    queued for the replica, which takes them with `take` and answers with
    `answer`, each within a deadline.

    `owner_token` is a random secret of the replica that creates the host: `take` and `answer`
    require it, so no other Ray client can take or answer a forwarded call, and call ids are
    random, so none can be guessed. At most `settings.max_queued_transfers` forwarded calls are
    outstanding at once (more are refused with `BackpressureError`), and a call whose caller
    gave up (its deadline passed) leaves the queue at once."""

    def __init__(self, settings: Settings, owner_token: bytes) -> None:
        self._settings = settings
        self._owner_token = owner_token
        self._closed = asyncio.Event()
        #: Calls not taken yet, by call id, oldest first.
        self._queued: dict[str, tuple[HostCall, tuple[Any, ...]]] = {}
        self._queue_changed = asyncio.Condition()
        #: Every outstanding call (queued or taken), by call id.
        self._answers: dict[str, asyncio.Future[Any]] = {}

    async def kvray_watch(self) -> None:
        await self._closed.wait()

    async def kvray_deliver(self, header: bytes, payload: npt.NDArray[np.uint8]) -> int:
        written: int = await self._forward(
            HostCall.DELIVER, (header, payload), self._settings.transfer_timeout_s
        )
        return written

    async def kvray_notify(self, message: bytes) -> None:
        await self._forward(HostCall.NOTIFY, (message,), self._settings.notify_timeout_s)

    async def kvray_claim(self, message: bytes) -> None:
        await self._forward(HostCall.CLAIM, (message,), self._settings.notify_timeout_s)

    async def kvray_connect(self, request: bytes) -> bytes:
        reply: bytes = await self._forward(HostCall.CONNECT, (request,), self._settings.notify_timeout_s)
        return reply

    async def kvray_request_push(self, message: bytes) -> None:
        """A decode engine on another node asks this (prefill) engine to push a request's KV
        (`kvray.wire.PushRequest`); the engine answers with the push itself, or a refusal."""
        await self._forward(HostCall.REQUEST_PUSH, (message,), self._settings.notify_timeout_s)

    async def take(self, owner_token: bytes, wait_s: float) -> list[tuple[str, HostCall, tuple[Any, ...]]]:
        """The calls queued for the replica; waits up to `wait_s` for the first."""
        self._check_owner(owner_token)
        try:
            async with asyncio.timeout(wait_s), self._queue_changed:
                await self._queue_changed.wait_for(lambda: bool(self._queued))
                calls = [(call_id, call, args) for call_id, (call, args) in self._queued.items()]
                self._queued.clear()
        except TimeoutError:
            return []
        return calls

    async def answer(self, owner_token: bytes, call_id: str, value: Any, error: BaseException | None) -> None:
        self._check_owner(owner_token)
        future = self._answers.get(call_id)
        if future is None or future.done():  # its caller gave up
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    async def close(self) -> None:
        self._closed.set()

    async def ping(self) -> bool:
        return not self._closed.is_set()

    def _check_owner(self, owner_token: object) -> None:
        if not isinstance(owner_token, bytes) or not secrets.compare_digest(owner_token, self._owner_token):
            raise KvrayError(
                "only the Serve replica that owns this host may take or answer its forwarded calls"
            )

    async def _forward(self, call: HostCall, args: tuple[Any, ...], timeout_s: float) -> Any:
        if self._closed.is_set():
            raise AgentNotRunningError(
                "this engine's Serve replica has closed its agent; nothing was delivered"
            )
        bound = self._settings.max_queued_transfers
        if len(self._answers) >= bound:
            raise BackpressureError(
                f"{bound} forwarded calls already wait for this Serve replica; retry later",
                queued=len(self._answers),
            )
        call_id = secrets.token_hex(16)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._answers[call_id] = future
        async with self._queue_changed:
            self._queued[call_id] = (call, args)
            self._queue_changed.notify_all()
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            raise TransferTimeoutError(
                f"the Serve replica did not take a forwarded {call.value} call within {timeout_s} s",
                timeout_s=timeout_s,
            ) from None
        finally:
            del self._answers[call_id]
            self._queued.pop(call_id, None)


_HostActor = ray.remote(ReplicaHost)


class ReplicaDirectory(DirectoryService):
    """The coordinator as the agent of a Serve replica sees it (a `DirectoryService`): the
    named coordinator actor (found again by name after it dies), except that a registration
    names the replica's `ReplicaHost` as the engine's actor."""

    def __init__(self, settings: Settings, host: Any) -> None:
        self._settings = settings
        self._host = host
        self._actor: Any = None

    async def register(self, info_bytes: bytes, host: Any, secret: bytes) -> int:
        epoch: int = await self._call("register", info_bytes, self._host, secret)
        return epoch

    async def deregister(self, engine_id: str, incarnation: int, secret: bytes) -> bool:
        removed: bool = await self._call("deregister", engine_id, incarnation, secret)
        return removed

    async def lookup(self, engine_id: str, timeout_s: float) -> tuple[bytes, Any]:
        found: tuple[bytes, Any] = await self._call("lookup", engine_id, timeout_s)
        return found

    async def heartbeat(self, engine_id: str, incarnation: int, secret: bytes) -> int | None:
        epoch: int | None = await self._call("heartbeat", engine_id, incarnation, secret)
        return epoch

    async def check(self, engine_id: str, incarnation: int) -> None:
        await self._call("check", engine_id, incarnation)

    async def departed(self, known: list[tuple[str, int]]) -> list[tuple[str, int]]:
        gone: list[tuple[str, int]] = await self._call("departed", known)
        return gone

    async def _call(self, method: str, *args: Any) -> Any:
        if self._actor is None:
            self._actor = await asyncio.to_thread(get_or_create_coordinator, self._settings)
        actor = self._actor
        try:
            return await getattr(actor, method).remote(*args)
        except ray.exceptions.RayActorError:
            if self._actor is actor:  # killed or restarting: look it up by name next time
                self._actor = None
            raise


# ---- a replica's engine ------------------------------------------------------------------------


class ReplicaEngine:
    """A kvray agent inside a Serve replica, its `ReplicaHost` actor and its registration.

    For any engine: `await ReplicaEngine.start(engine_id, role, layout)` allocates the backing
    (or give `backing=`, the engine's own), starts the agent (fresh incarnation, registered
    through the host) and the loop that runs forwarded calls on it. The engine's own compute
    reads and writes `agent.backing.views` and moves KV with `agent` (decode: `expect`,
    `wait_for_kv`, `release`; prefill: `push`, or `push_layer` then `finish`). An engine whose
    agent is built by an object of its own starts with `start_agent` instead. The replica's
    `check_health` and `__del__` call `check_health` and `close`."""

    #: Seconds one `take` long-poll waits for forwarded calls before asking again.
    POLL_S = 5.0

    def __init__(
        self,
        agent: KVAgent,
        host: Any,
        owner_token: bytes,
        directory: ReplicaDirectory,
        settings: Settings,
        on_push_request: Callable[[bytes], None] | None = None,
    ) -> None:
        self.agent = agent
        self.host = host
        self._owner_token = owner_token
        self.directory = directory
        self.settings = settings
        self._pump: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._pump_error: BaseException | None = None
        self._on_push_request = on_push_request

    @classmethod
    async def start(
        cls,
        engine_id: str,
        role: Role,
        layout: KVLayout | None = None,
        *,
        backing: Backing | None = None,
        memory: MemoryKind | None = None,
        settings: Settings | None = None,
    ) -> ReplicaEngine:
        """An engine over `layout` (kvray allocates the backing) or the caller's `backing`."""
        settings = settings or Settings.from_env()

        def agent(directory: ReplicaDirectory) -> KVAgent:
            return KVAgent(
                engine_id,
                role,
                layout,
                backing=backing,
                memory=memory,
                settings=settings,
                coordinator=directory,
            )

        return await cls.start_agent(agent, settings)

    @classmethod
    async def start_agent(
        cls,
        make_agent: Callable[[ReplicaDirectory], KVAgent],
        settings: Settings,
        *,
        endpoints: Mapping[str, str] | None = None,
        on_push_request: Callable[[bytes], None] | None = None,
    ) -> ReplicaEngine:
        """An engine around the agent `make_agent(directory)` returns, built with
        `coordinator=directory` (so it registers with the host as its actor) and `settings`.
        `endpoints` are published with the agent's (`KVAgent.start`); `on_push_request`, if
        given, takes the push requests peers send through the host (on the agent's loop)."""
        # Owned by this replica (not detached): Ray ends it when the replica dies.
        owner_token = secrets.token_bytes(32)
        host: Any = _HostActor.options(num_cpus=0).remote(settings, owner_token)
        directory = ReplicaDirectory(settings, host)
        try:
            agent = make_agent(directory)
        except BaseException:
            ray.kill(host)
            raise
        engine = cls(agent, host, owner_token, directory, settings, on_push_request)
        try:
            await agent.start(endpoints=endpoints)
        except BaseException:
            await engine.close()
            raise
        engine._pump = asyncio.get_running_loop().create_task(engine._serve_host())
        return engine

    @property
    def engine_id(self) -> str:
        return self.agent.engine_id

    async def check_health(self) -> None:
        """Raise unless the agent runs, its host answers and the coordinator has this incarnation."""
        if not self.agent.started:
            raise AgentNotRunningError(
                f"engine {self.engine_id!r}: the kvray agent is not running", engine_id=self.engine_id
            )
        if self._pump is None or self._pump.done():
            raise KvrayError(
                f"engine {self.engine_id!r}: its host actor is gone ({self._pump_error!r}); peers "
                "cannot reach this replica"
            )
        bound = self.settings.notify_timeout_s
        try:
            async with asyncio.timeout(bound):
                await self.directory.check(self.engine_id, self.agent.incarnation)
        except TimeoutError:
            raise MetadataError(
                f"engine {self.engine_id!r}: the coordinator did not answer within {bound} s",
                engine_id=self.engine_id,
            ) from None
        except KvrayError as error:
            raise MetadataError(
                f"engine {self.engine_id!r} is not registered with the coordinator: {error}",
                engine_id=self.engine_id,
            ) from error

    async def close(self) -> None:
        """Close the agent (deregisters), stop serving forwarded calls, close the host."""
        await self.agent.close()
        if self._pump is not None:
            self._pump.cancel()
        for task in list(self._serving):
            task.cancel()
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await self.host.close.remote()
        except Exception:  # gone already: nothing to close
            pass
        ray.kill(self.host)

    async def _serve_host(self) -> None:
        """Take the calls forwarded by the host and run each on the agent, until the host dies."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout(self.POLL_S + self.settings.notify_timeout_s):
                    calls = await self.host.take.remote(self._owner_token, self.POLL_S)
            except TimeoutError:  # a slow answer: ask again (a dead host raises instead)
                continue
            except ray.exceptions.RayActorError as error:
                self._pump_error = error
                return
            for call_id, call, args in calls:
                task = loop.create_task(self._serve_call(call_id, call, args))
                self._serving.add(task)
                task.add_done_callback(self._serving.discard)

    async def _serve_call(self, call_id: str, call: HostCall, args: tuple[Any, ...]) -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            value = await self._run(call, args)
        except Exception as failure:
            error = failure
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await self.host.answer.remote(self._owner_token, call_id, value, error)
        except Exception:  # the host is gone; its caller's call failed with it
            pass

    async def _run(self, call: HostCall, args: tuple[Any, ...]) -> Any:
        """What `AgentHost` answers for the same call on an actor of its own."""
        agent = self.agent
        match call:
            case HostCall.DELIVER:
                return await agent.deliver(*args)
            case HostCall.NOTIFY:
                return await agent.notify(*args)
            case HostCall.CLAIM:
                return await agent.claim(*args)
            case HostCall.CONNECT:
                return await agent.accept_connection(*args)
            case HostCall.REQUEST_PUSH:
                if self._on_push_request is None:
                    raise NotExpectedError(
                        f"engine {self.engine_id!r} takes no push requests", engine_id=self.engine_id
                    )
                return self._on_push_request(*args)


def replica_engine_id() -> str:
    """`<app>-<deployment>-<replica id>` of the Serve replica calling it: unique per replica (a
    replacement gets a new id), so an engine id for `ReplicaEngine.start`."""
    from ray import serve

    context = serve.get_replica_context()
    return f"{context.app_name}-{context.deployment}-{context.replica_id.unique_id}"
