"""Coordinator (fourth step of the data flow): a named async Ray actor that keeps a versioned
directory of engines. No KV bytes pass through it.

Engines register their `EngineInfo` (msgspec bytes, validated here) and the actor hosting
them; peers look them up, waiting with a deadline for one that has not registered yet. An
engine whose actor dies is dropped: the coordinator holds a long-poll call on every
`AgentHost`, so Ray reports the death at once, and asks any other actor hosting an agent
whether it is alive every `LIVENESS_PROBE_S`. One that deregisters or closes is dropped too. After a
restart the directory is empty and carries a new epoch: agents notice through their
heartbeat and register again.

It remembers the last `MAX_DEPARTED` engine incarnations that left, so a lookup naming one of
them (a push into a reservation of a dead engine) fails at once instead of waiting for an
engine that cannot come back: a restarted engine is another incarnation.

An entry belongs to its registrant. Anyone who can call the actor can name any actor handle as
a host, so the registrant proves itself with a random secret it generates at start and sends
with `register`, `heartbeat` and `deregister` (never returned by any call). Only the holder of
that secret may re-register (the same contents again), heartbeat or deregister the entry; a
different secret may take the engine id only once the entry is gone (its actor died, or it
deregistered) or, for an engine registered outside any actor (a driver, which has no actor to
watch), once its heartbeat has lapsed for `lapse_s`. The same incarnation registered again with
other contents is refused: an incarnation names one set of regions for its whole life.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import ray

from kvray.config import TIMEOUT_CEILING_S, Settings
from kvray.errors import (
    KvrayError,
    RegistrationRefusedError,
    StaleIncarnationError,
    UnknownEngineError,
)
from kvray.validation import validate_engine_info
from kvray.wire import EngineInfo, Role, decode_engine_info

#: Seconds between two liveness probes of an engine whose actor is not an `AgentHost` (it has
#: no call the coordinator could hold open until the actor dies).
LIVENESS_PROBE_S = 1.0
#: Heartbeat periods without a heartbeat after which an engine registered outside any actor
#: counts as gone, so that another registrant may take its engine id.
LAPSED_HEARTBEATS = 5
#: Seconds a registration with another secret waits for a hosted entry to leave (its actor's
#: death is noticed within one liveness probe) before it is refused.
TAKEOVER_WAIT_S = 2 * LIVENESS_PROBE_S
#: The shortest registrant secret accepted, in bytes.
MIN_SECRET_BYTES = 16
#: The longest a lookup waits for an engine to register, whatever its caller asks: the longest
#: wait any deployment's `max_timeout_s` allows (an agent clamps to its own first).
MAX_LOOKUP_WAIT_S = TIMEOUT_CEILING_S
#: Engine incarnations that left, remembered so that a lookup naming one fails at once.
MAX_DEPARTED = 65536
#: Checks and clamps the waits callers ask of the coordinator (`Settings.deadline`).
_WAITS = Settings(max_timeout_s=MAX_LOOKUP_WAIT_S)


@dataclass
class _Entry:
    info: EngineInfo
    info_bytes: bytes
    host: Any
    watch: asyncio.Task[None] | None
    secret: bytes
    #: Event-loop time of the last registration or heartbeat.
    seen: float


def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise RegistrationRefusedError(
            f"a registrant proves itself with a random secret of at least {MIN_SECRET_BYTES} bytes "
            "(KVAgent sends one); none, or a shorter one, was given"
        )
    return secret


class Coordinator:
    """The directory. Use `get_or_create_coordinator` rather than constructing it.

    `lapse_s`: seconds without a heartbeat after which an entry registered outside any actor
    may be taken by another registrant."""

    def __init__(self, lapse_s: float = 10.0) -> None:
        self.epoch = secrets.randbits(62)
        self._engines: dict[str, _Entry] = {}
        self._changed = asyncio.Condition()
        self._lapse_s = _WAITS.deadline(lapse_s, 10.0, "lapse_s")
        self.dropped_dead = 0
        #: Engine incarnations that left (closed, died, or were replaced by a newer one), oldest first.
        self._departed: OrderedDict[tuple[str, int], None] = OrderedDict()

    async def register(self, info_bytes: bytes, host: Any, secret: bytes) -> int:
        """Add an engine, or replace the registrant's own entry with a newer incarnation (see
        the module docstring for who may replace whose). Returns the epoch."""
        secret = _check_secret(secret)
        info = decode_engine_info(info_bytes)
        validate_engine_info(info)
        old = self._engines.get(info.engine_id)
        if old is not None and not secrets.compare_digest(old.secret, secret):
            old = await self._take_over(info.engine_id, old, secret)
        if old is not None and old.info.incarnation == info.incarnation and old.info_bytes != info_bytes:
            raise RegistrationRefusedError(
                f"engine {info.engine_id!r} incarnation {info.incarnation} is registered with other "
                "contents; an incarnation's regions never change: start the engine again (a fresh "
                "incarnation) to publish new ones",
                engine_id=info.engine_id,
                incarnation=info.incarnation,
            )
        if old is not None and old.info.incarnation != info.incarnation:
            self._left(info.engine_id, old.info.incarnation)
            if old.watch is not None:
                old.watch.cancel()
        watch = None
        if host is not None and (
            old is None or old.info.incarnation != info.incarnation or old.watch is None
        ):
            watch = asyncio.get_running_loop().create_task(
                self._watch(info.engine_id, info.incarnation, host)
            )
        elif old is not None:
            watch = old.watch
        now = asyncio.get_running_loop().time()
        self._engines[info.engine_id] = _Entry(info, info_bytes, host, watch, secret, now)
        await self._notify()
        return self.epoch

    async def _take_over(self, engine_id: str, old: _Entry, secret: bytes) -> _Entry | None:
        """The entry a registration with another secret than `old`'s may replace: None once the
        old registrant is gone; raise while it lives."""
        loop = asyncio.get_running_loop()
        if old.host is None:
            if loop.time() - old.seen <= self._lapse_s:
                raise self._held(engine_id, old)
            self._drop(engine_id)
            return None
        try:
            async with asyncio.timeout(TAKEOVER_WAIT_S), self._changed:
                await self._changed.wait_for(lambda: self._engines.get(engine_id) is not old)
        except TimeoutError:
            raise self._held(engine_id, old) from None
        current = self._engines.get(engine_id)
        if current is not None and not secrets.compare_digest(current.secret, secret):
            raise self._held(engine_id, current)
        return current

    def _held(self, engine_id: str, entry: _Entry) -> RegistrationRefusedError:
        holder = "its actor is alive" if entry.host is not None else "its heartbeat is current"
        return RegistrationRefusedError(
            f"engine {engine_id!r} is registered by another agent and {holder}; only that agent "
            "may replace or remove it: pick another engine id, or stop that agent first",
            engine_id=engine_id,
            incarnation=entry.info.incarnation,
        )

    async def deregister(self, engine_id: str, incarnation: int, secret: bytes) -> bool:
        """Drop the caller's own engine incarnation; False if it was not (or no longer) registered."""
        secret = _check_secret(secret)
        entry = self._engines.get(engine_id)
        if entry is None or entry.info.incarnation != incarnation:
            return False
        if not secrets.compare_digest(entry.secret, secret):
            raise self._held(engine_id, entry)
        self._drop(engine_id)
        await self._notify()
        return True

    async def lookup(
        self, engine_id: str, timeout_s: float, incarnation: int | None = None
    ) -> tuple[bytes, Any]:
        """(engine info bytes, host actor) of `engine_id`, waiting up to `timeout_s` for it
        (0 or None: not at all; more than `MAX_LOOKUP_WAIT_S`: that long). NaN, infinities, negative
        values and non-numbers raise `ConfigError`: nothing waits forever. With `incarnation`
        (the caller wants that life of the engine), an incarnation that already left fails at
        once (`UnknownEngineError`), unless a newer one is registered (returned: the caller
        sees it is stale)."""
        timeout_s = _WAITS.deadline(timeout_s, 0.0, "timeout_s", allow_zero=True)
        if (
            engine_id not in self._engines
            and isinstance(incarnation, int)
            and (engine_id, incarnation) in self._departed
        ):
            raise UnknownEngineError(
                f"engine {engine_id!r} incarnation {incarnation} has left (it closed or its actor "
                "died) and no other incarnation is registered; nothing waits for it",
                engine_id=engine_id,
                incarnation=incarnation,
            )
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: engine_id in self._engines)
        except TimeoutError:
            raise UnknownEngineError(
                f"engine {engine_id!r} is not registered (waited {timeout_s} s for it); check the "
                "engine id and that its agent has started",
                engine_id=engine_id,
                timeout_s=timeout_s,
            ) from None
        entry = self._engines[engine_id]
        return entry.info_bytes, entry.host

    async def heartbeat(self, engine_id: str, incarnation: int, secret: bytes) -> int | None:
        """The epoch if the caller's incarnation is registered, else None (the caller registers
        again)."""
        secret = _check_secret(secret)
        entry = self._engines.get(engine_id)
        if (
            entry is None
            or entry.info.incarnation != incarnation
            or not secrets.compare_digest(entry.secret, secret)
        ):
            return None
        entry.seen = asyncio.get_running_loop().time()
        return self.epoch

    async def engines(self, role: str | None = None) -> list[bytes]:
        """Info bytes of every registered engine (of one role, if given)."""
        wanted = Role(role) if role is not None else None
        return [e.info_bytes for e in self._engines.values() if wanted is None or e.info.role is wanted]

    async def check(self, engine_id: str, incarnation: int) -> None:
        """Raise unless `engine_id` is registered with exactly `incarnation` (fencing)."""
        entry = self._engines.get(engine_id)
        if entry is None:
            raise UnknownEngineError(f"engine {engine_id!r} is not registered", engine_id=engine_id)
        if entry.info.incarnation != incarnation:
            raise StaleIncarnationError(
                f"engine {engine_id!r} is now incarnation {entry.info.incarnation}, not {incarnation}",
                engine_id=engine_id,
                incarnation=entry.info.incarnation,
                stale_incarnation=incarnation,
            )

    async def stats(self) -> dict[str, int]:
        return {"engines": len(self._engines), "dropped_dead": self.dropped_dead, "epoch": self.epoch}

    async def _watch(self, engine_id: str, incarnation: int, host: Any) -> None:
        """Hold a call on the engine's host (an `AgentHost`): it returns when the agent closes and
        fails when the actor dies. Any other actor is probed until it is dead (its agent's close
        deregisters it and cancels this). Either way the engine incarnation leaves the directory.
        A plain actor has no `kvray_watch`, so a failed call on it says nothing about its life."""
        died = False
        try:
            try:
                held = host.kvray_watch
            except AttributeError:  # an actor of the user's own, not an AgentHost
                await _probe_until_dead(host)
            else:
                await held.remote()
        except asyncio.CancelledError:
            return
        except Exception:
            died = True
        entry = self._engines.get(engine_id)
        if entry is not None and entry.info.incarnation == incarnation:
            self._drop(engine_id, watching=False)
            if died:
                self.dropped_dead += 1
            await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _drop(self, engine_id: str, watching: bool = True) -> None:
        entry = self._engines.pop(engine_id, None)
        if entry is None:
            return
        self._left(engine_id, entry.info.incarnation)
        if watching and entry.watch is not None:
            entry.watch.cancel()

    def _left(self, engine_id: str, incarnation: int) -> None:
        self._departed[(engine_id, incarnation)] = None
        self._departed.move_to_end((engine_id, incarnation))
        while len(self._departed) > MAX_DEPARTED:
            self._departed.popitem(last=False)

    async def departed(self, known: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Of the (engine id, incarnation) pairs an agent has cached, those no longer registered
        (the engine left, died, or registered a new incarnation): the agent forgets them and
        releases what it opened for them."""
        gone = []
        for engine_id, incarnation in known:
            if not isinstance(engine_id, str) or not isinstance(incarnation, int):
                continue
            entry = self._engines.get(engine_id)
            if entry is None or entry.info.incarnation != incarnation:
                gone.append((engine_id, incarnation))
        return gone


async def _probe_until_dead(host: Any) -> None:
    """Raise once the actor `host` is dead; Ray's built-in readiness call answers while it lives."""
    while True:
        await host.__ray_ready__.remote()
        await asyncio.sleep(LIVENESS_PROBE_S)


def get_or_create_coordinator(settings: Settings | None = None) -> Any:
    """The coordinator actor named in `settings`, created if absent.

    It is detached: its life does not hang on the process that happened to create it (an
    engine's actor, which may be killed), and Ray restarts it if it crashes.
    """
    settings = settings or Settings()
    actor_class = ray.remote(Coordinator)
    try:
        return actor_class.options(
            name=settings.coordinator_name,
            namespace=settings.namespace,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=-1,
            max_concurrency=10_000,
            num_cpus=0,
        ).remote(settings.heartbeat_s * LAPSED_HEARTBEATS)
    except ValueError as error:  # a race with another creator: the actor exists now
        try:
            return ray.get_actor(settings.coordinator_name, namespace=settings.namespace)
        except ValueError:
            raise KvrayError(f"cannot create or find the coordinator: {error}") from error
