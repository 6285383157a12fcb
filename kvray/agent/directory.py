"""The agent's directory client (fourth step of the data flow, seen from an engine): registering
this engine with the coordinator and keeping it registered, looking peers up, and the cache of
peers this engine writes to (least recently used forgotten first).

The coordinator is reached through `DirectoryService`, the typed interface it implements; a Ray
actor handle of it is wrapped by `RemoteDirectory`, and an object that implements the interface
in this process (a test's `Coordinator()`) is used as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from kvray.config import Settings
from kvray.errors import KvrayError, MetadataError, UnknownEngineError
from kvray.metrics import DirectoryEvent, EngineMetrics
from kvray.transport import Peer
from kvray.wire import EngineInfo, decode_engine_info, encode


class DirectoryService(Protocol):
    """What the coordinator answers (`kvray.coordinator.Coordinator` implements it)."""

    async def register(self, info_bytes: bytes, host: Any, secret: bytes) -> int: ...

    async def deregister(self, engine_id: str, incarnation: int, secret: bytes) -> bool: ...

    async def lookup(
        self, engine_id: str, timeout_s: float, incarnation: int | None = None
    ) -> tuple[bytes, Any]: ...

    async def heartbeat(self, engine_id: str, incarnation: int, secret: bytes) -> int | None: ...

    async def check(self, engine_id: str, incarnation: int) -> None: ...

    async def departed(self, known: list[tuple[str, int]]) -> list[tuple[str, int]]: ...


class RemoteDirectory:
    """A `DirectoryService` over a Ray actor handle (or anything called as one:
    `handle.method.remote(...)`, awaited)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def register(self, info_bytes: bytes, host: Any, secret: bytes) -> int:
        epoch: int = await self.handle.register.remote(info_bytes, host, secret)
        return epoch

    async def deregister(self, engine_id: str, incarnation: int, secret: bytes) -> bool:
        removed: bool = await self.handle.deregister.remote(engine_id, incarnation, secret)
        return removed

    async def lookup(
        self, engine_id: str, timeout_s: float, incarnation: int | None = None
    ) -> tuple[bytes, Any]:
        found: tuple[bytes, Any] = await self.handle.lookup.remote(engine_id, timeout_s, incarnation)
        return found

    async def heartbeat(self, engine_id: str, incarnation: int, secret: bytes) -> int | None:
        epoch: int | None = await self.handle.heartbeat.remote(engine_id, incarnation, secret)
        return epoch

    async def check(self, engine_id: str, incarnation: int) -> None:
        await self.handle.check.remote(engine_id, incarnation)

    async def departed(self, known: list[tuple[str, int]]) -> list[tuple[str, int]]:
        gone: list[tuple[str, int]] = await self.handle.departed.remote(known)
        return gone


def directory_service(coordinator: Any) -> DirectoryService:
    """`coordinator` as a `DirectoryService`: a Ray actor handle (its methods have `.remote`)
    is wrapped, an in-process implementation is used as it is."""
    if hasattr(getattr(coordinator, "register", None), "remote"):
        return RemoteDirectory(coordinator)
    service: DirectoryService = coordinator
    return service


def _actor_died(error: BaseException) -> bool:
    """True when a Ray call failed because the actor it went to is dead."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # no Ray, no actors
        return False
    return isinstance(error, RayActorError)


def current_actor() -> Any:
    """The Ray actor this code runs in, or None (the driver, or no Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().current_actor
    except Exception:  # the driver, or no Ray: no host actor
        pass
    return None


class Directory:
    """One engine's view of the directory: its own registration and the peers it knows.

    `on_forget(engine_id)` is called whenever a peer is forgotten, so that what was opened or
    computed for it (mappings, connections, offsets, claim boards) goes with it."""

    def __init__(
        self,
        engine_id: str,
        settings: Settings,
        service: DirectoryService | None,
        metrics: EngineMetrics,
        on_forget: Callable[[str], None],
        *,
        by_name: bool = False,
    ) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.service = service
        self.metrics = metrics
        self._on_forget = on_forget
        #: True when `service` was found by its Ray name: a dead one is replaced the same way.
        self._by_name = by_name
        #: Peers looked up or added, least recently used first (at most `max_cached_peers`).
        self._peers: OrderedDict[str, Peer] = OrderedDict()
        #: Proves to the coordinator that this agent registered its engine entry (only the holder
        #: may replace or remove it); sent to the coordinator alone, never published.
        self.secret = secrets.token_bytes(32)
        self.epoch: int | None = None
        self._info: EngineInfo | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    # ---- this engine ------------------------------------------------------------------

    def attach(self, service: DirectoryService, *, by_name: bool = False) -> None:
        """Use `service` from now on (`by_name`: it was found by its Ray name, and a dead one is
        replaced the same way)."""
        self.service = service
        self._by_name = by_name

    async def register(self, info: EngineInfo) -> None:
        """Publish `info` and keep it published (re-registering whenever the coordinator no
        longer knows it) until `deregister`."""
        if self.service is None:
            return
        self._info = info
        await self._register()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def _register(self) -> None:
        assert self.service is not None and self._info is not None
        # A coordinator that was just created is a fresh process still starting: allow it as long
        # as a lookup may wait.
        try:
            async with asyncio.timeout(self.settings.lookup_timeout_s):
                self.epoch = await self.service.register(encode(self._info), current_actor(), self.secret)
        except TimeoutError as error:
            raise MetadataError(
                f"the coordinator did not answer the registration of {self.engine_id!r} within "
                f"{self.settings.lookup_timeout_s} s",
                engine_id=self.engine_id,
            ) from error

    async def deregister(self) -> None:
        """Stop the heartbeat and remove this engine's entry (best effort, bounded)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.service is None or self._info is None:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await self.service.deregister(self.engine_id, self._info.incarnation, self.secret)

    async def _beat(self) -> None:
        """Re-register whenever the coordinator no longer knows this incarnation (it restarted),
        and forget cached peers that have left."""
        assert self._info is not None
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                assert self.service is not None
                async with asyncio.timeout(self.settings.heartbeat_s * 5):
                    epoch = await self.service.heartbeat(self.engine_id, self._info.incarnation, self.secret)
                    if epoch is None:
                        await self._register()
                        self.metrics.directory(DirectoryEvent.REREGISTERED)
                        for engine_id in list(self._peers):
                            self.forget(engine_id)
                    elif self._peers:
                        await self._forget_departed()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # coordinator restarting: try again next beat
                self.metrics.directory(DirectoryEvent.HEARTBEAT_FAILED)
                if self._by_name and _actor_died(error):
                    # Gone for good (killed, or it died with its owner): find or create its
                    # successor by name; the next beat registers this engine there.
                    with contextlib.suppress(Exception):
                        from kvray.coordinator import get_or_create_coordinator

                        self.service = RemoteDirectory(get_or_create_coordinator(self.settings))
                        self.metrics.directory(DirectoryEvent.COORDINATOR_REPLACED)

    async def _forget_departed(self) -> None:
        """Forget the cached peers whose incarnation the coordinator no longer lists (they closed,
        died or restarted): their mappings, handles and connections hold memory until then."""
        assert self.service is not None
        known = [(engine_id, peer.info.incarnation) for engine_id, peer in self._peers.items()]
        for engine_id, incarnation in await self.departed(known):
            peer = self._peers.get(engine_id)
            if peer is not None and peer.info.incarnation == incarnation:  # not looked up anew since
                self.forget(engine_id)
                self.metrics.directory(DirectoryEvent.PEER_DEPARTED)

    async def departed(self, peers: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Which of `peers` (engine id, incarnation) the coordinator no longer lists; none
        without a coordinator."""
        if self.service is None or not peers:
            return []
        return await self.service.departed(peers)

    # ---- peers ------------------------------------------------------------------------

    def add(self, peer: Peer) -> None:
        """Cache a peer; past `max_cached_peers`, the least recently used one is forgotten."""
        engine_id = peer.info.engine_id
        known = self._peers.get(engine_id)
        if known is not None and known == peer:
            # The same peer told again (every push request carries its decode engine's info):
            # the object cached stays, and with it what is kept per peer object.
            self._peers.move_to_end(engine_id)
            return
        if known is not None:
            self.forget(engine_id)  # replaced: what was opened for the old info goes with it
        self._peers[engine_id] = peer
        self._peers.move_to_end(engine_id)
        while len(self._peers) > self.settings.max_cached_peers:
            self.forget(next(iter(self._peers)))

    def forget(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)
        self._on_forget(engine_id)

    def cached(self, engine_id: str) -> Peer | None:
        """The engine's published info and host if cached; nothing is asked of the coordinator."""
        peer = self._peers.get(engine_id)
        if peer is not None:
            self._peers.move_to_end(engine_id)
        return peer

    async def peer(
        self, engine_id: str, *, wait_s: float | None = None, incarnation: int | None = None
    ) -> Peer:
        """The engine's published info and host: cached, else asked of the coordinator, which
        waits up to `wait_s` (default `lookup_timeout_s`) for the engine to register; with
        `incarnation`, not at all once that incarnation has left (`UnknownEngineError`)."""
        peer = self.cached(engine_id)
        if peer is not None:
            return peer
        if self.service is None:
            raise UnknownEngineError(
                f"engine {engine_id!r} is unknown to agent {self.engine_id!r} and there is no "
                "coordinator to ask (start Ray, or add_peer() it)",
                engine_id=engine_id,
            )
        wait = self.settings.deadline(wait_s, self.settings.lookup_timeout_s, "wait_s", allow_zero=True)
        # The coordinator bounds its own wait; this bounds a coordinator that does not answer.
        bound = wait + self.settings.notify_timeout_s
        try:
            async with asyncio.timeout(bound):
                info_bytes, host = await self.service.lookup(engine_id, wait, incarnation)
        except KvrayError:
            raise
        except TimeoutError as error:
            raise MetadataError(
                f"the coordinator did not answer a lookup of engine {engine_id!r} within {bound} s",
                engine_id=engine_id,
            ) from error
        except Exception as error:  # a dead or restarting coordinator
            raise MetadataError(
                f"cannot look engine {engine_id!r} up: the coordinator is unreachable "
                f"({type(error).__name__})",
                engine_id=engine_id,
            ) from error
        peer = Peer(decode_engine_info(info_bytes), host)
        self.add(peer)
        return peer

    async def current(self, engine_id: str, incarnation: int, *, wait_s: float | None = None) -> Peer:
        """The peer, looked up afresh when what is cached is another incarnation than the one
        asked for (the cache may be behind); the caller checks the incarnation it gets. An
        incarnation the coordinator saw leave fails at once instead of being waited for."""
        peer = await self.peer(engine_id, wait_s=wait_s, incarnation=incarnation)
        if peer.info.incarnation != incarnation and self.service is not None:
            self.forget(engine_id)
            peer = await self.peer(engine_id, wait_s=wait_s, incarnation=incarnation)
        return peer

    async def check(self, engine_id: str, incarnation: int) -> None:
        """Raise (`UnknownEngineError`, `StaleIncarnationError`) unless the coordinator lists
        exactly that incarnation of the engine; a coordinator that does not answer within
        `notify_timeout_s` raises `TimeoutError`. Only with a coordinator (`service`)."""
        assert self.service is not None
        async with asyncio.timeout(self.settings.notify_timeout_s):
            await self.service.check(engine_id, incarnation)
