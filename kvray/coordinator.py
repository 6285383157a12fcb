"""Coordinator (fourth step of the data flow): a named async Ray actor that keeps a versioned
directory of engines. No KV bytes pass through it.

Engines register their `EngineInfo` (msgspec bytes, validated here; its ids and endpoint strings
no longer than `MAX_ID_CHARS` and `MAX_ENDPOINT_CHARS`, its counts and its bytes within the
bounds of `kvray.wire`) and the actor hosting them; peers look them up, waiting with a deadline
for one that has not registered yet. Waiting lookups are kept per engine id, so a registration
wakes only those waiting for its engine.

An entry stays while something vouches for it:

- an engine hosted by an actor, while the actor lives: the coordinator holds a long-poll call
  on every `AgentHost`, so Ray reports the death at once, and asks any other actor hosting an
  agent whether it is alive every `LIVENESS_PROBE_S`;
- an engine registered outside any actor (a driver: nothing to watch), for a lease of `lapse_s`
  that each registration and heartbeat renews. Agents heartbeat every `heartbeat_s` and the
  coordinator's lease is `LAPSED_HEARTBEATS` of those. An entry whose lease runs out leaves
  (a driver that died without deregistering); an agent that was only late learns at its next
  heartbeat that it is no longer registered, and registers again.

One that deregisters leaves too. After a restart the directory is empty and carries a new
epoch: agents notice through their heartbeat and register again.

It remembers which engine incarnations left (deregistered, died, lease ran out, or replaced by a
newer one), so a lookup naming one of them (a push into a reservation of a dead engine) fails at
once instead of waiting for an engine that cannot come back: a restarted engine is another
incarnation. The memory is kept per engine id: the newest `DEPARTED_PER_ENGINE` incarnations of
each of the last `MAX_DEPARTED_ENGINES` engine ids to lose one. Re-registering one engine id
over and over costs that engine's record alone, and cannot push another engine's departures out.

An entry belongs to its registrant. Anyone who can call the actor can name any actor handle as
a host, so the registrant proves itself with a random secret it generates at start and sends
with `register`, `heartbeat` and `deregister` (never returned by any call). Only the holder of
that secret may re-register (the same contents again), heartbeat or deregister the entry; a
different secret may take the engine id only once the entry is gone (its actor died, it
deregistered, or its lease ran out). The same incarnation registered again with other contents
is refused: an incarnation names one set of regions for its whole life.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from kvray.config import TIMEOUT_CEILING_S, Settings
from kvray.errors import (
    KvrayError,
    MetadataError,
    RegistrationRefusedError,
    StaleIncarnationError,
    UnknownEngineError,
)
from kvray.validation import validate_engine_info
from kvray.wire import EngineInfo, Role, decode_engine_info

#: Seconds between two liveness probes of an engine whose actor is not an `AgentHost` (it has
#: no call the coordinator could hold open until the actor dies).
LIVENESS_PROBE_S = 1.0
#: Heartbeat periods an engine registered outside any actor is leased for: without a heartbeat
#: for that long it leaves the directory, and another registrant may take its engine id.
LAPSED_HEARTBEATS = 5
#: Seconds a registration with another secret waits for a hosted entry to leave (its actor's
#: death is noticed within one liveness probe) before it is refused.
TAKEOVER_WAIT_S = 2 * LIVENESS_PROBE_S
#: The shortest registrant secret accepted, in bytes.
MIN_SECRET_BYTES = 16
#: The longest a lookup waits for an engine to register, whatever its caller asks: the longest
#: wait any deployment's `max_timeout_s` allows (an agent clamps to its own first).
MAX_LOOKUP_WAIT_S = TIMEOUT_CEILING_S
#: Longest engine id, node id, layer name, endpoint name and RDMA device or GID string, in
#: characters, that a registration may carry (the coordinator keeps them, and serves them to
#: every lookup).
MAX_ID_CHARS = 256
#: Longest endpoint value (an address, a key, a file path), in characters.
MAX_ENDPOINT_CHARS = 4096
#: Engine incarnations that left, remembered per engine id (its newest ones)...
DEPARTED_PER_ENGINE = 8
#: ... for this many engine ids, those that lost one most recently.
MAX_DEPARTED_ENGINES = 65536
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
    #: The timer that ends the lease of an entry nothing watches (None while an actor is watched).
    lease: asyncio.TimerHandle | None = None


def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise RegistrationRefusedError(
            f"a registrant proves itself with a random secret of at least {MIN_SECRET_BYTES} bytes "
            "(KVAgent sends one); none, or a shorter one, was given"
        )
    return secret


def _shown(value: object) -> str:
    """`value` as an error message quotes it: its repr, cut short (a caller chose its length)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:64]}... ({len(text)} characters)"


def _strings(info: EngineInfo) -> Iterator[tuple[str, str, int]]:
    """(what it is, the string, its limit) for every string of `info` whose length its sender
    chooses, but for region handles (bounded with the whole message by `kvray.wire`)."""
    yield "engine id", info.engine_id, MAX_ID_CHARS
    yield "node id", info.node_id, MAX_ID_CHARS
    for region in info.regions:
        yield f"region {region.index}'s engine id", region.engine_id, MAX_ID_CHARS
    for spec in info.layout.layers:
        yield "layer name", spec.name, MAX_ID_CHARS
    for name in info.placements:
        yield "placement's layer name", name, MAX_ID_CHARS
    for name, value in info.endpoints.items():
        yield "endpoint name", name, MAX_ID_CHARS
        yield f"value of endpoint {_shown(name)}", value, MAX_ENDPOINT_CHARS
    if info.verbs is not None:
        yield "RDMA device name", info.verbs.device, MAX_ID_CHARS
        yield "RDMA GID", info.verbs.gid, MAX_ID_CHARS


def check_registration_sizes(info: EngineInfo) -> None:
    """Refuse (`MetadataError`) a registration carrying a string longer than the coordinator
    keeps; the error names it, its length and the limit. The number of regions, layers and
    endpoints, and the size of the whole registration, are bounded by `kvray.wire` when it is
    decoded (`MAX_REGIONS`, `MAX_LAYERS`, `MAX_ENDPOINTS`, `MAX_ENGINE_INFO_BYTES`)."""
    for what, value, limit in _strings(info):
        if len(value) > limit:
            engine = _shown(info.engine_id)
            raise MetadataError(
                f"engine {engine} registers a {what} of {len(value)} characters; the coordinator "
                f"takes at most {limit}",
                engine_id=engine,
                field=what,
                length=len(value),
                limit=limit,
            )


class Coordinator:
    """The directory. Use `get_or_create_coordinator` rather than constructing it.

    `lapse_s`: the lease of an entry registered outside any actor: seconds without a
    registration or heartbeat after which it leaves the directory."""

    def __init__(self, lapse_s: float = 10.0) -> None:
        self.epoch = secrets.randbits(62)
        self._engines: dict[str, _Entry] = {}
        self._lapse_s = _WAITS.deadline(lapse_s, 10.0, "lapse_s")
        self.dropped_dead = 0
        #: Entries dropped because their lease ran out.
        self.expired = 0
        #: Per engine id, its incarnations that left (closed, died, lease ran out, or replaced by a
        #: newer one), oldest first; engine ids in the order they last lost one.
        self._departed: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        #: Per engine id, the futures of calls waiting for its entry to change (`_next_change`).
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}

    async def register(self, info_bytes: bytes, host: Any, secret: bytes) -> int:
        """Add an engine, or replace the registrant's own entry with a newer incarnation (see
        the module docstring for who may replace whose). Returns the epoch."""
        secret = _check_secret(secret)
        info = decode_engine_info(info_bytes)
        check_registration_sizes(info)
        validate_engine_info(info)
        old = self._engines.get(info.engine_id)
        if old is not None and not secrets.compare_digest(old.secret, secret):
            old = await self._take_over(info.engine_id, old, secret)
        # From here to `_store` nothing awaits: `old` is the entry being replaced.
        same = old is not None and old.info.incarnation == info.incarnation
        if old is not None and same and old.info_bytes != info_bytes:
            raise RegistrationRefusedError(
                f"engine {info.engine_id!r} incarnation {info.incarnation} is registered with other "
                "contents; an incarnation's regions never change: start the engine again (a fresh "
                "incarnation) to publish new ones",
                engine_id=info.engine_id,
                incarnation=info.incarnation,
            )
        if old is not None and not same:
            self._left(info.engine_id, old.info.incarnation)
            if old.watch is not None:
                old.watch.cancel()
        watch = None
        if old is not None and same and old.watch is not None:
            watch = old.watch
        elif host is not None:
            watch = asyncio.get_running_loop().create_task(
                self._watch(info.engine_id, info.incarnation, host)
            )
        now = asyncio.get_running_loop().time()
        self._store(info.engine_id, _Entry(info, info_bytes, host, watch, secret, now))
        return self.epoch

    async def _take_over(self, engine_id: str, old: _Entry, secret: bytes) -> _Entry | None:
        """The entry a registration with another secret than `old`'s may replace: None once the
        old registrant is gone; raise while it lives."""
        if old.watch is None:
            if not self._lease_over(old):
                raise self._held(engine_id, old)
            self.expired += 1
            self._drop(engine_id)
            return None
        try:
            async with asyncio.timeout(TAKEOVER_WAIT_S):
                while self._engines.get(engine_id) is old:
                    await self._next_change(engine_id)
        except TimeoutError:
            raise self._held(engine_id, old) from None
        current = self._engines.get(engine_id)
        if current is not None and not secrets.compare_digest(current.secret, secret):
            raise self._held(engine_id, current)
        return current

    def _held(self, engine_id: str, entry: _Entry) -> RegistrationRefusedError:
        holder = "its actor is alive" if entry.watch is not None else "its heartbeat is current"
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
        return True

    async def lookup(
        self, engine_id: str, timeout_s: float, incarnation: int | None = None
    ) -> tuple[bytes, Any]:
        """(engine info bytes, host actor) of `engine_id`, waiting up to `timeout_s` for it
        (0 or None: not at all; more than `MAX_LOOKUP_WAIT_S`: that long). NaN, infinities, negative
        values and non-numbers raise `ConfigError`: nothing waits forever. With `incarnation`
        (the caller wants that life of the engine), an incarnation that already left fails at
        once (`UnknownEngineError`), unless a newer one is registered (returned: the caller
        sees it is stale). So does an engine id no registration could carry (not a string, or
        longer than `MAX_ID_CHARS`)."""
        timeout_s = _WAITS.deadline(timeout_s, 0.0, "timeout_s", allow_zero=True)
        if not isinstance(engine_id, str) or len(engine_id) > MAX_ID_CHARS:
            raise UnknownEngineError(
                f"no engine is registered as {_shown(engine_id)}: an engine id is a string of at most "
                f"{MAX_ID_CHARS} characters",
                engine_id=_shown(engine_id),
                limit=MAX_ID_CHARS,
            )
        self._refuse_departed(engine_id, incarnation)
        try:
            async with asyncio.timeout(timeout_s):
                while engine_id not in self._engines:
                    await self._next_change(engine_id)
                    # Registered and gone again before this call ran: its incarnation may have left.
                    self._refuse_departed(engine_id, incarnation)
        except TimeoutError:
            raise UnknownEngineError(
                f"engine {engine_id!r} is not registered (waited {timeout_s} s for it); check the "
                "engine id and that its agent has started",
                engine_id=engine_id,
                timeout_s=timeout_s,
            ) from None
        entry = self._engines[engine_id]
        return entry.info_bytes, entry.host

    def _refuse_departed(self, engine_id: str, incarnation: int | None) -> None:
        """Raise `UnknownEngineError` if `incarnation` of `engine_id` left and no incarnation of
        it is registered: a lookup naming it does not wait."""
        if (
            engine_id not in self._engines
            and isinstance(incarnation, int)
            and incarnation in self._departed.get(engine_id, ())
        ):
            raise UnknownEngineError(
                f"engine {engine_id!r} incarnation {incarnation} has left (it closed, its actor "
                "died or its lease ran out) and no other incarnation is registered; nothing waits for it",
                engine_id=engine_id,
                incarnation=incarnation,
            )

    async def heartbeat(self, engine_id: str, incarnation: int, secret: bytes) -> int | None:
        """Renew the caller's entry: the epoch if its incarnation is registered, else None (the
        caller registers again)."""
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
            raise UnknownEngineError(
                f"engine {_shown(engine_id)} is not registered", engine_id=_shown(engine_id)
            )
        if entry.info.incarnation != incarnation:
            raise StaleIncarnationError(
                f"engine {engine_id!r} is now incarnation {entry.info.incarnation}, not {incarnation}",
                engine_id=engine_id,
                incarnation=entry.info.incarnation,
                stale_incarnation=incarnation,
            )

    async def stats(self) -> dict[str, int]:
        """Registered engines, those dropped for their actor's death and for their lease, the
        engine incarnations remembered as departed, and the epoch."""
        return {
            "engines": len(self._engines),
            "dropped_dead": self.dropped_dead,
            "expired": self.expired,
            "departed": sum(len(incarnations) for incarnations in self._departed.values()),
            "epoch": self.epoch,
        }

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

    async def _next_change(self, engine_id: str) -> None:
        """Return once `engine_id`'s entry has been stored or dropped."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(engine_id, set())
        waiters.add(future)
        try:
            await future
        finally:
            waiters.discard(future)
            if not waiters and self._waiters.get(engine_id) is waiters:
                del self._waiters[engine_id]

    def _wake(self, engine_id: str) -> None:
        """Wake the calls waiting for `engine_id`'s entry to change (and no others)."""
        for future in self._waiters.pop(engine_id, ()):
            if not future.done():
                future.set_result(None)

    def _store(self, engine_id: str, entry: _Entry) -> None:
        replaced = self._engines.get(engine_id)
        if replaced is not None and replaced.lease is not None:
            replaced.lease.cancel()
        if entry.watch is None:
            self._lease_until(engine_id, entry, entry.seen + self._lapse_s)
        self._engines[engine_id] = entry
        self._wake(engine_id)

    def _lease_over(self, entry: _Entry) -> bool:
        return asyncio.get_running_loop().time() - entry.seen > self._lapse_s

    def _lease_until(self, engine_id: str, entry: _Entry, due: float) -> None:
        entry.lease = asyncio.get_running_loop().call_at(due, self._lease_ended, engine_id, entry, due)

    def _lease_ended(self, engine_id: str, entry: _Entry, due: float) -> None:
        """The lease of an entry nothing watches, due at `due`, was due: drop the entry, unless a
        heartbeat renewed it since (then check again when the renewed lease is due). Renewal is
        judged against `due`, not the clock: a timer may fire a clock tick early, and would
        otherwise be set again for the same moment until the clock moved on."""
        if self._engines.get(engine_id) is not entry:
            return
        renewed = entry.seen + self._lapse_s
        if renewed > due:
            self._lease_until(engine_id, entry, renewed)
            return
        self.expired += 1
        self._drop(engine_id)

    def _drop(self, engine_id: str, watching: bool = True) -> None:
        entry = self._engines.pop(engine_id, None)
        if entry is None:
            return
        self._left(engine_id, entry.info.incarnation)
        if entry.lease is not None:
            entry.lease.cancel()
        if watching and entry.watch is not None:
            entry.watch.cancel()
        self._wake(engine_id)

    def _left(self, engine_id: str, incarnation: int) -> None:
        """Remember that `incarnation` of `engine_id` left: among that engine's newest few, and
        the engine id among those that lost one most recently."""
        remembered = [known for known in self._departed.pop(engine_id, ()) if known != incarnation]
        remembered.append(incarnation)
        self._departed[engine_id] = tuple(remembered[-DEPARTED_PER_ENGINE:])
        while len(self._departed) > MAX_DEPARTED_ENGINES:
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
