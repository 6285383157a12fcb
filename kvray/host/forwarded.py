"""An agent whose process is not a Ray actor of kvray's (a Serve replica, a vLLM worker, any
process): a small actor stands in for it, and peer calls reaching that actor are forwarded into
the process (steps six and seven arrive here, then go on to the agent).

    ForwardingHost     the stand-in actor: a `kvray_<name>` method per peer call queues the
                       call for the agent's process and waits for its answer, within a deadline
    ForwardedDirectory the coordinator as that agent sees it: a registration names the
                       stand-in actor as the engine's actor
    ForwardedAgent     the process's side: the agent, its stand-in actor and its registration,
                       and the loop that takes forwarded calls and runs them on the agent

The coordinator registers the engine with its `ForwardingHost` as its actor, holds its watch
call on it and drops the engine when it returns (the agent closed) or fails (the host died; it
is owned by the agent's process, so Ray ends it with the process). Calls are forwarded over a
long-poll call the process keeps open; on one node, shared-memory writes and completions do not
pass through the host at all.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import ray

from kvray.agent import DirectoryService, KVAgent
from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import (
    AgentNotRunningError,
    BackpressureError,
    KvrayError,
    MetadataError,
    TransferTimeoutError,
)
from kvray.host.calls import HostMethod, PeerCall, add_peer_calls
from kvray.layout import KVLayout
from kvray.memory import Backing, MemoryKind
from kvray.wire import Role

#: A forwarded call as the agent's process takes it: (call id, call, arguments).
ForwardedCall = tuple[str, PeerCall, tuple[Any, ...]]


class ForwardingHost:
    """The Ray actor peers and the coordinator call for an agent whose process is not an actor
    of kvray's.

    `kvray_watch` returns when the process closes its agent (or fails when this actor dies with
    the process that owns it); each peer call (`PeerCall`: `kvray_deliver`, `kvray_notify`, ...)
    is queued for the process, which takes it with `take` and answers with `answer`, within the
    call's deadline.

    `owner_token` is a random secret of the process that creates the host: `take` and `answer`
    require it, so no other Ray client can take or answer a forwarded call, and call ids are
    random, so none can be guessed. At most `settings.max_queued_transfers` forwarded calls are
    outstanding at once (more are refused with `BackpressureError`), and a call whose caller
    gave up (its deadline passed) leaves the queue at once."""

    def __init__(self, settings: Settings, owner_token: bytes) -> None:
        self._settings = settings
        self._owner_token = owner_token
        self._closed = asyncio.Event()
        #: Calls not taken yet, by call id, oldest first.
        self._queued: dict[str, tuple[PeerCall, tuple[Any, ...]]] = {}
        self._queue_changed = asyncio.Condition()
        #: Every outstanding call (queued or taken), by call id.
        self._answers: dict[str, asyncio.Future[Any]] = {}

    async def kvray_watch(self) -> None:
        await self._closed.wait()

    async def take(self, owner_token: bytes, wait_s: float) -> list[ForwardedCall]:
        """The calls queued for the agent's process; waits up to `wait_s` for the first."""
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
            raise KvrayError("only the process that owns this host may take or answer its forwarded calls")

    async def _forward(self, call: PeerCall, args: tuple[Any, ...]) -> Any:
        if self._closed.is_set():
            raise AgentNotRunningError("this engine's process has closed its agent; nothing was delivered")
        bound = self._settings.max_queued_transfers
        if len(self._answers) >= bound:
            raise BackpressureError(
                f"{bound} forwarded calls already wait for this engine's process; retry later",
                queued=len(self._answers),
            )
        timeout_s = call.timeout_s(self._settings)
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
                f"the engine's process did not take a forwarded {call.host_method} call within {timeout_s} s",
                timeout_s=timeout_s,
            ) from None
        finally:
            del self._answers[call_id]
            self._queued.pop(call_id, None)


def _forward_to_process(call: PeerCall) -> HostMethod:
    async def entry_point(self: ForwardingHost, *args: Any) -> Any:
        return await self._forward(call, args)

    return entry_point


add_peer_calls(ForwardingHost, _forward_to_process)


@functools.cache
def _host_actor_class() -> Any:
    return ray.remote(ForwardingHost)


class ForwardedDirectory(DirectoryService):
    """The coordinator as a forwarded agent sees it (a `DirectoryService`): the named
    coordinator actor (found again by name after it dies), except that a registration names the
    agent's `ForwardingHost` as the engine's actor."""

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

    async def lookup(
        self, engine_id: str, timeout_s: float, incarnation: int | None = None
    ) -> tuple[bytes, Any]:
        found: tuple[bytes, Any] = await self._call("lookup", engine_id, timeout_s, incarnation)
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


class ForwardedAgent:
    """A kvray agent in a process that is not a Ray actor of kvray's, its `ForwardingHost`
    actor and its registration.

    For any engine: `await ForwardedAgent.start(engine_id, role, layout)` allocates the backing
    (or give `backing=`, the engine's own), starts the agent (fresh incarnation, registered
    through the host) and the loop that runs forwarded calls on it. The engine's own compute
    reads and writes `agent.backing.views` and moves KV with `agent` (decode: `expect`,
    `wait_for_kv`, `release`; prefill: `push`, or `push_layer` then `finish`). An engine whose
    agent is built by an object of its own starts with `start_agent` instead. The process's
    health check and shutdown call `check_health` and `close`."""

    #: Seconds one `take` long-poll waits for forwarded calls before asking again.
    POLL_S = 5.0

    def __init__(
        self,
        agent: KVAgent,
        host: Any,
        owner_token: bytes,
        directory: ForwardedDirectory,
        settings: Settings,
    ) -> None:
        self.agent = agent
        self.host = host
        self._owner_token = owner_token
        self.directory = directory
        self.settings = settings
        self._pump: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._pump_error: BaseException | None = None

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
    ) -> ForwardedAgent:
        """An engine over `layout` (kvray allocates the backing) or the caller's `backing`."""
        settings = settings or Settings.from_env()

        def agent(directory: ForwardedDirectory) -> KVAgent:
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
        make_agent: Callable[[ForwardedDirectory], KVAgent],
        settings: Settings,
        *,
        endpoints: Mapping[str, str] | None = None,
        on_push_request: Callable[[bytes], None] | None = None,
    ) -> ForwardedAgent:
        """An engine around the agent `make_agent(directory)` returns, built with
        `coordinator=directory` (so it registers with the host as its actor) and `settings`.
        `endpoints` are published with the agent's (`KVAgent.start`); `on_push_request`, if
        given, takes the push requests peers send (`KVAgent.serve_push_requests`)."""
        # Owned by this process (not detached): Ray ends it when the process dies.
        owner_token = secrets.token_bytes(32)
        host: Any = _host_actor_class().options(num_cpus=0).remote(settings, owner_token)
        directory = ForwardedDirectory(settings, host)
        try:
            agent = make_agent(directory)
        except BaseException:
            ray.kill(host)
            raise
        if on_push_request is not None:
            agent.serve_push_requests(on_push_request)
        engine = cls(agent, host, owner_token, directory, settings)
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
                "cannot reach this engine"
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
                    calls: list[ForwardedCall] = await self.host.take.remote(self._owner_token, self.POLL_S)
            except TimeoutError:  # a slow answer: ask again (a dead host raises instead)
                continue
            except ray.exceptions.RayActorError as error:
                self._pump_error = error
                return
            for call_id, call, args in calls:
                task = loop.create_task(self._serve_call(call_id, call, args))
                self._serving.add(task)
                task.add_done_callback(self._serving.discard)

    async def _serve_call(self, call_id: str, call: PeerCall, args: tuple[Any, ...]) -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            # What an `AgentHost` runs for the same call on an actor of its own.
            value = await getattr(self.agent, call.agent_method)(*args)
        except Exception as failure:
            error = failure
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await self.host.answer.remote(self._owner_token, call_id, value, error)
        except Exception:  # the host is gone; its caller's call failed with it
            pass
