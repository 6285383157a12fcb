"""Ray Serve application: an HTTP router, a prefill and a decode deployment around the reference
model, each prefill and decode replica embedding a kvray agent (where users meet kvray).

Needs the `serve` extra (`pip install -e '.[serve]'`). Build it with `build_app(args)`, the
application builder `serve run examples/serve_config.yaml` imports.

    POST /generate {"prompt": [token ids] | "text": "...", "max_tokens": N}
      Router: checks the request (bad input: 400, nothing reserved, nothing written)
        └─ Decode replica (whichever Serve picks): reserves the request's blocks, expects its KV
             └─ Prefill replica (whichever Serve picks): forward pass over the prompt, pushes
                the KV layer by layer into those blocks (the decode replica's engine id,
                incarnation and block ids travel in the call), returns the first token
           wait_for_kv, greedy decode, free the blocks
      <─ {"tokens": [...], "text": "...", "decode_engine": ..., "prefill_engine": ..., ...}

Why the decode replica drives. A Serve handle call goes to *some* replica of a deployment, never
to one the caller names, so a router cannot reserve blocks on one decode replica and later
send the first token to the same one. Instead one decode call does the whole decode side and,
holding its blocks, asks a prefill replica (through its own handle) to fill them: the engine id
it sends is its own, so the push lands where the blocks are. Serve's routing still chooses both
replicas (least loaded of two), and a replica that is gone is no longer chosen.

Peers reach a replica through its host. A Serve replica's actor is Serve's own wrapper, without
kvray's entry points, so each replica starts a small `ReplicaHost` actor that stands in for it:
the coordinator registers the engine with the host as its actor, holds its watch call on it and
drops the engine when it returns (the agent closed) or fails (the host died; it is owned by the
replica, so Ray ends it with the replica). `ray`-transport writes and completion notices that
reach the host are forwarded into the replica over a long-poll call the replica keeps open
(on one node, shared-memory writes and completions do not pass through it).

Scaling in place: `build_app` versions its deployments by `deployment_version`, which only the
replica counts leave unchanged, so redeploying with another count keeps the running replicas.
Scaling up, a new replica starts its engine (fresh incarnation) and registers; scaling down,
Serve calls `__del__`, which closes the agent (deregisters) and the host.

Deadlines: the router bounds the whole request (`request_timeout_s`); the decode replica bounds
the prefill call and `wait_for_kv` by what is left of it, and the prefill replica's pushes too.
Serve's HTTP proxy bounds the request including its body (`http_options.request_timeout_s` of
the Serve config), so a client that trickles its body cannot hold a router slot forever.

Bounds: the router reads at most `max_body_bytes` of a body (the Content-Length header is checked
first, then the bytes as they arrive, so a missing or lying header cannot make it buffer more),
and checks the prompt's length before it looks at a token. Every deployment works on at most
`max_ongoing_requests` requests per replica and lets `max_queued_requests` more wait at each
caller; past that Serve answers 503 at once.

A failed request answers a JSON body `{"error": ..., "type": ..., "request_id": ...}`. The
message of a failure behind the router is a fixed public sentence: the details (remote
tracebacks, engine and node names) go to the Serve log under the request id. `type` is one of
the names below or a kvray error class (`kvray.errors`), never a wrapper's name:

    400  BadRequest (malformed or out of range: nothing was reserved or written), or ConfigError /
         PlanError from a replica
    404  NotFound (another path), 405 MethodNotAllowed (another method)
    413  PayloadTooLarge (the body is over `max_body_bytes`)
    502  a peer failed the transfer (the KV did not arrive): TransportError, WriteFailedError,
         MetadataError, ... (the kvray class)
    503  no capacity right now: BackpressureError (kvray), BackPressureError (Serve's queue
         bound), DeploymentUnavailableError; or ReplicaDied: retry. (Serve's proxy answers its own
         queue bound with a plain-text 503.)
    504  TransferTimeoutError: the request passed its deadline
    500  InternalError, or another kvray error: anything else

Health: `check_health` raises when the agent is closed, its host is gone, or the coordinator
does not have this engine incarnation registered (Serve replaces a replica after three failed
checks in a row; a coordinator restart is re-registered within a heartbeat).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvray.config import Settings
from kvray.coordinator import get_or_create_coordinator
from kvray.errors import (
    BackpressureError,
    ConfigError,
    KvrayError,
    MetadataError,
    PlanError,
    TransferTimeoutError,
    TransportError,
    WriteFailedError,
)
from kvray.layout import BlockOrder
from kvray.models.reference import MODEL_PRESETS, ModelConfig, ReferenceModel, decode_text
from kvray.wire import Reservation
from kvray.workers import DecodeWorker, PrefillWorker

#: Serve writes this logger's records into each replica's log file.
logger = logging.getLogger("ray.serve")

# ---- options and the HTTP body ---------------------------------------------------------------


class ServeOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The application's arguments (`args:` of a Serve config, or `build_app`'s mapping)."""

    #: A reference model preset (`kvray.models.MODEL_PRESETS`).
    model: str = "mixed"
    #: KV blocks per prefill and per decode replica.
    num_blocks: int = 512
    block_order: BlockOrder = BlockOrder.LAYER_MAJOR
    #: Push each layer as the forward pass produces it (else the whole request after it).
    layerwise: bool = True
    #: The most new tokens one request may ask for.
    max_tokens: int = 256
    #: Seconds a request may take from the router's view, transfer and decoding included.
    request_timeout_s: float = 30.0
    prefill_replicas: int = 1
    decode_replicas: int = 1
    #: CPUs each prefill and decode replica asks Ray for (the router asks for none).
    replica_cpus: float = 1.0
    #: kvray settings of every replica (`args.settings`, over KVRAY_* variables of the builder).
    settings: Settings = msgspec.field(default_factory=Settings)
    #: The largest request body the router reads, in bytes; a larger one answers 413.
    max_body_bytes: int = 1 << 20
    #: Requests one replica of each deployment works on at once (Serve's option of that name).
    max_ongoing_requests: int = 5
    #: Requests that may wait for a replica of each deployment at each caller (the HTTP proxy,
    #: a handle); past that Serve answers 503 (Serve's option of that name).
    max_queued_requests: int = 64

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise ConfigError(
                f"model must be one of {sorted(MODEL_PRESETS)}, got {self.model!r}", setting="model"
            )
        for name in (
            "num_blocks",
            "max_tokens",
            "prefill_replicas",
            "decode_replicas",
            "max_body_bytes",
            "max_ongoing_requests",
            "max_queued_requests",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}", setting=name)
        timeout_s = self.settings.deadline(self.request_timeout_s, 0.0, "request_timeout_s")
        if timeout_s != self.request_timeout_s:
            raise ConfigError(
                f"request_timeout_s={self.request_timeout_s} is longer than the settings' "
                f"max_timeout_s={self.settings.max_timeout_s}",
                setting="request_timeout_s",
                value=self.request_timeout_s,
            )
        if self.replica_cpus < 0:
            raise ConfigError(f"replica_cpus must not be negative, got {self.replica_cpus}")

    @property
    def model_config(self) -> ModelConfig:
        return MODEL_PRESETS[self.model]

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None = None) -> ServeOptions:
        """Options from a Serve config's `args`; `settings` go over the KVRAY_* variables."""
        values = dict(args or {})
        overrides = values.pop("settings", None) or {}
        if not isinstance(overrides, Mapping):
            raise ConfigError(f"args.settings must be a mapping of kvray settings, got {overrides!r}")
        settings = Settings.from_env(**overrides)
        try:
            return msgspec.convert({**values, "settings": settings}, cls, strict=False)
        except msgspec.ValidationError as error:
            cause = error.__cause__
            if isinstance(cause, ConfigError):
                raise ConfigError(f"kvray serve args: {cause.message}", **cause.facts) from None
            raise ConfigError(f"kvray serve args: {error}") from None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of `POST /generate`: token ids (`prompt`) or `text`, not both."""

    prompt: list[int] | None = None
    text: str | None = None
    max_tokens: int = 16


def tokenize(text: str, vocab_size: int) -> list[int]:
    """The trivial tokenizer of text prompts: each UTF-8 byte modulo the vocabulary (the
    reference models' vocabulary is 256, so a byte is its own token)."""
    return [byte % vocab_size for byte in text.encode("utf-8")]


def prompt_tokens(request: GenerateRequest, options: ServeOptions) -> list[int]:
    """The prompt's token ids, checked against the model and the replicas' block pools."""
    config = options.model_config
    if (request.prompt is None) == (request.text is None):
        raise ConfigError('give the prompt as either "prompt" (token ids) or "text", not both or neither')
    if not 1 <= request.max_tokens <= options.max_tokens:
        raise ConfigError(
            f"max_tokens must lie in [1, {options.max_tokens}], got {request.max_tokens}",
            max_tokens=request.max_tokens,
        )
    # The length first, so an over-long prompt is refused before any token is looked at. A
    # character is at least one UTF-8 byte, so a text too long in characters is too long in tokens.
    least_tokens = len(request.prompt) if request.prompt is not None else len(request.text or "")
    _check_positions(least_tokens, request, config)
    tokens = request.prompt if request.prompt is not None else tokenize(request.text or "", config.vocab_size)
    _check_positions(len(tokens), request, config)
    if not tokens:
        raise ConfigError("the prompt is empty; give at least one token")
    bad = [token for token in tokens if not 0 <= token < config.vocab_size]
    if bad:
        raise ConfigError(f"token ids must lie in [0, {config.vocab_size}), got {bad[:5]}", tokens=bad[:5])
    blocks = -(-(len(tokens) + request.max_tokens) // config.block_size)
    if blocks > options.num_blocks:
        raise ConfigError(
            f"the request needs {blocks} KV blocks, a replica has {options.num_blocks}",
            blocks=blocks,
        )
    return list(tokens)


def _check_positions(prompt_tokens: int, request: GenerateRequest, config: ModelConfig) -> None:
    # Decode caches the prompt and every new token but the last.
    if prompt_tokens + request.max_tokens - 1 > config.max_positions:
        raise ConfigError(
            f"{prompt_tokens} prompt tokens and {request.max_tokens} new tokens exceed the model's "
            f"{config.max_positions} positions",
            prompt_tokens=prompt_tokens,
            max_tokens=request.max_tokens,
        )


@dataclass(frozen=True)
class PrefillReply:
    """What a prefill replica answers for one request."""

    engine_id: str
    first_token: int
    transport: str
    nbytes: int
    compute_s: float
    exposed_transfer_s: float
    #: Per layer, a hash of the prompt's blocks as prefill wrote them.
    kv_digest: dict[str, str]


@dataclass(frozen=True)
class GenerateReply:
    """What a decode replica answers for one request."""

    tokens: list[int]
    decode_engine: str
    prefill: PrefillReply
    #: From the decode call to the first token (blocks reserved, prefill answered).
    ttft_s: float
    decode_s: float


# ---- the actor that stands in for a replica ----------------------------------------------------


class HostCall(enum.Enum):
    """Calls a `ReplicaHost` forwards into its replica's agent."""

    DELIVER = "deliver"
    NOTIFY = "notify"
    CLAIM = "claim"


class ReplicaHost:
    """The Ray actor peers and the coordinator call for an agent that lives in a Serve replica.

    `kvray_watch` returns when the replica closes its agent (or fails when this actor dies with
    the replica that owns it); `kvray_deliver`, `kvray_notify` and `kvray_claim` are queued for
    the replica, which takes them with `take` and answers with `answer`, each within a deadline.

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
            raise KvrayError("this engine's Serve replica has closed its agent; nothing was delivered")
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


class ReplicaDirectory:
    """The coordinator as the agent of a Serve replica sees it: the same calls, made on the
    named coordinator actor (found again by name after it dies), except that a registration
    names the replica's `ReplicaHost` as the engine's actor."""

    def __init__(self, settings: Settings, host: Any) -> None:
        self._settings = settings
        self._host = host
        self._actor: Any = None
        self.register = _RemoteMethod(self._register)
        self.deregister = _RemoteMethod(self._calling("deregister"))
        self.heartbeat = _RemoteMethod(self._calling("heartbeat"))
        self.lookup = _RemoteMethod(self._calling("lookup"))
        self.check = _RemoteMethod(self._calling("check"))
        self.engines = _RemoteMethod(self._calling("engines"))

    async def _register(self, info_bytes: bytes, host: Any, secret: bytes) -> Any:
        return await self._call("register", info_bytes, self._host, secret)

    def _calling(self, method: str) -> Callable[..., Awaitable[Any]]:
        async def call(*args: Any) -> Any:
            return await self._call(method, *args)

        return call

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


class _RemoteMethod:
    """`.remote(...)` returning an awaitable, as an actor method does."""

    def __init__(self, call: Callable[..., Awaitable[Any]]) -> None:
        self.remote = call


# ---- a replica's engine ------------------------------------------------------------------------


#: The worker a replica engine runs.
W = TypeVar("W", PrefillWorker, DecodeWorker)


class ReplicaEngine(Generic[W]):
    """A prefill or decode worker (block pool, agent, model) inside a Serve replica, and its host.

    `await ReplicaEngine.start(...)` creates the host, starts the agent (fresh incarnation,
    registered through the host) and the loop that serves forwarded calls; `close` undoes it."""

    #: Seconds one `take` long-poll waits for forwarded calls before asking again.
    POLL_S = 5.0

    def __init__(
        self, worker: W, host: Any, owner_token: bytes, directory: ReplicaDirectory, settings: Settings
    ) -> None:
        self.worker: W = worker
        self.host = host
        self._owner_token = owner_token
        self.directory = directory
        self.settings = settings
        self._pump: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._pump_error: BaseException | None = None

    @classmethod
    async def start(cls, worker_class: type[W], engine_id: str, options: ServeOptions) -> ReplicaEngine[W]:
        settings = options.settings
        # Owned by this replica (not detached): Ray ends it when the replica dies.
        owner_token = secrets.token_bytes(32)
        host = _HostActor.options(num_cpus=0).remote(settings, owner_token)
        config = options.model_config
        layout = ReferenceModel(config).layout(options.num_blocks, options.block_order)
        directory = ReplicaDirectory(settings, host)
        worker: W = worker_class(engine_id, layout, settings, model=config, coordinator=directory)
        engine = cls(worker, host, owner_token, directory, settings)
        try:
            await worker.start()
        except BaseException:
            await engine.close()
            raise
        engine._pump = asyncio.get_running_loop().create_task(engine._serve_host())
        return engine

    @property
    def engine_id(self) -> str:
        return self.worker.kvray_agent.engine_id

    async def check_health(self) -> None:
        """Raise unless the agent runs, its host answers and the coordinator has this incarnation."""
        agent = self.worker.kvray_agent
        if not agent.started:
            raise KvrayError(f"engine {self.engine_id!r}: the kvray agent is not running")
        if self._pump is None or self._pump.done():
            raise KvrayError(
                f"engine {self.engine_id!r}: its host actor is gone ({self._pump_error!r}); peers "
                "cannot reach this replica"
            )
        bound = self.settings.notify_timeout_s
        try:
            async with asyncio.timeout(bound):
                await self.directory.check.remote(self.engine_id, agent.incarnation)
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
        await self.worker.close()
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
        agent = self.worker.kvray_agent
        value: Any = None
        error: BaseException | None = None
        try:
            if call is HostCall.DELIVER:
                value = await agent.deliver(*args)
            elif call is HostCall.CLAIM:
                await agent.claim(*args)
            else:
                await agent.notify(*args)
        except Exception as failure:
            error = failure
        try:
            async with asyncio.timeout(self.settings.notify_timeout_s):
                await self.host.answer.remote(self._owner_token, call_id, value, error)
        except Exception:  # the host is gone; its caller's call failed with it
            pass


def _engine_id() -> str:
    """`<app>-<deployment>-<replica id>`: unique per replica (a replacement gets a new id)."""
    context = serve.get_replica_context()
    return f"{context.app_name}-{context.deployment}-{context.replica_id.unique_id}"


# ---- the deployments ---------------------------------------------------------------------------


class _EngineReplica:
    """What every prefill and decode replica answers besides its own work: Serve's health
    checks, its stats, and its removal (`__del__`: the engine deregisters)."""

    engine: ReplicaEngine[Any]

    async def stats(self) -> dict[str, Any]:
        """This replica's engine id, agent counters and block pool (e.g. for `handle.broadcast`)."""
        return {"engine_id": self.engine.engine_id, **await self.engine.worker.stats()}

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def __del__(self) -> None:
        await self.engine.close()


class PrefillReplica(_EngineReplica):
    """Runs prompts and pushes their KV into the decode replica named in the call."""

    # Serve awaits an async constructor: the replica is ready once its engine is registered.
    async def __init__(self, options: ServeOptions) -> None:  # type: ignore[misc]
        self.options = options
        self.engine = await ReplicaEngine.start(PrefillWorker, _engine_id(), options)

    async def prefill(
        self, tokens: Sequence[int], reservation: Reservation, timeout_s: float
    ) -> PrefillReply:
        result = await self.engine.worker.prefill(
            tokens, reservation, layerwise=self.options.layerwise, timeout=timeout_s
        )
        return PrefillReply(
            engine_id=self.engine.engine_id,
            first_token=result.first_token,
            transport=result.transport.value,
            nbytes=result.nbytes,
            compute_s=result.compute_s,
            exposed_transfer_s=result.exposed_transfer_s,
            kv_digest=result.kv_digest,
        )


class DecodeReplica(_EngineReplica):
    """The decode side of a request in one call: reserve blocks, have a prefill replica fill
    them, wait for the KV, decode, free the blocks."""

    async def __init__(self, options: ServeOptions, prefill: Any) -> None:  # type: ignore[misc]
        self.options = options
        self.prefill = prefill
        self.model = ReferenceModel(options.model_config)
        self.engine = await ReplicaEngine.start(DecodeWorker, _engine_id(), options)

    async def generate(
        self, request_id: str, tokens: Sequence[int], max_tokens: int, timeout_s: float
    ) -> GenerateReply:
        worker = self.engine.worker
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.settings.deadline(timeout_s, 0.0, "timeout_s")
        started = time.perf_counter()
        reservation = await worker.reserve(
            request_id,
            self.model.blocks_needed(len(tokens) + max_tokens),
            kv_blocks=self.model.blocks_needed(len(tokens)),
        )
        try:
            prefilled: PrefillReply = await _call_with_deadline(
                self.prefill.prefill.remote(list(tokens), reservation, max(0.001, deadline - loop.time())),
                deadline - loop.time(),
                f"the prefill of {request_id!r}",
            )
        except BaseException:
            # Returns once no write for the request can land (a cancelled caller waits too).
            await worker.release(request_id)
            raise
        first_token_s = time.perf_counter() - started
        # Frees the blocks on every path; the KV normally arrived before prefill answered.
        decoded = await worker.decode(
            request_id, prefilled.first_token, len(tokens), max_tokens, max(0.001, deadline - loop.time())
        )
        differ = sorted(
            layer for layer, digest in prefilled.kv_digest.items() if decoded.kv_digest.get(layer) != digest
        )
        if differ:
            raise WriteFailedError(
                f"the KV of {request_id!r} arrived at {self.engine.engine_id!r} different from what "
                f"{prefilled.engine_id!r} wrote, in layers {differ}",
                request_id=request_id,
                layers=differ,
            )
        return GenerateReply(
            tokens=decoded.tokens,
            decode_engine=self.engine.engine_id,
            prefill=prefilled,
            ttft_s=first_token_s,
            decode_s=decoded.decode_s,
        )


class Router:
    """HTTP ingress: `POST /generate`; checks the request, hands it to a decode replica."""

    def __init__(self, options: ServeOptions, decode: Any) -> None:
        self.options = options
        self.decode = decode

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        root = str(request.scope.get("root_path", ""))
        if root and path.startswith(root):
            path = path[len(root) :]
        if path.rstrip("/") != "/generate":
            return _error_response(404, "NotFound", f"no route {path!r}; POST /generate", None)
        if request.method != "POST":
            return _error_response(405, "MethodNotAllowed", "use POST /generate", None)
        request_id = f"serve-{secrets.token_hex(8)}"
        limit = self.options.max_body_bytes
        raw = await read_body(request, limit)
        if raw is None:
            message = f"the request body is over {limit} bytes; a prompt fits in far less"
            return _error_response(413, "PayloadTooLarge", message, request_id)
        try:
            body = msgspec.json.decode(raw, type=GenerateRequest)
            tokens = prompt_tokens(body, self.options)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            return _error_response(400, "BadRequest", f"invalid request body: {error}", request_id)
        except ConfigError as error:
            return _error_response(400, "BadRequest", str(error), request_id)
        timeout_s = self.options.request_timeout_s
        try:
            # The decode replica keeps to `timeout_s` and says what failed; allow its answer the
            # time of one control message on top before giving up on it.
            reply: GenerateReply = await _call_with_deadline(
                self.decode.generate.remote(request_id, tokens, body.max_tokens, timeout_s),
                timeout_s + self.options.settings.notify_timeout_s,
                f"request {request_id!r}",
            )
        except Exception as error:
            status, kind, message = http_error(error)
            logger.warning("request %s failed (%d %s): %s", request_id, status, kind, error)
            return _error_response(status, kind, message, request_id)
        return JSONResponse(
            {
                "request_id": request_id,
                "tokens": reply.tokens,
                "text": decode_text([token % 256 for token in reply.tokens]),
                "prompt_tokens": len(tokens),
                "decode_engine": reply.decode_engine,
                "prefill_engine": reply.prefill.engine_id,
                "transport": reply.prefill.transport,
                "kv_bytes": reply.prefill.nbytes,
                "ttft_ms": round(reply.ttft_s * 1e3, 2),
                "decode_ms": round(reply.decode_s * 1e3, 2),
            }
        )


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None if it is over `limit` bytes: the declared Content-Length is
    checked first, then the bytes as they arrive, so a client without the header (chunked) or
    with a wrong one never makes the router hold more than `limit` bytes and one chunk."""
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _call_with_deadline(response: Any, timeout_s: float, what: str) -> Any:
    """Await a deployment response; past `timeout_s` cancel it and raise TransferTimeoutError."""
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            return await response
    except TimeoutError:
        response.cancel()
        raise TransferTimeoutError(
            f"{what} passed its {timeout_s:.3g} s deadline", timeout_s=timeout_s
        ) from None
    except asyncio.CancelledError:
        response.cancel()
        raise


#: The public message of each answer to a failure behind the router, by status: what happened
#: and what to do, nothing about the cluster (the details are logged under the request id).
PUBLIC_MESSAGES: dict[int, str] = {
    400: "the request cannot be served as given; check it against the API",
    500: "internal error; the server log has the details under this request id",
    502: "a peer failed the KV transfer of this request; retry",
    503: "no capacity right now; retry later",
    504: "the request passed its deadline; retry, or ask for fewer tokens",
}


def http_error(error: BaseException) -> tuple[int, str, str]:
    """(HTTP status, error type, public message) for a failure behind the router. The type is a
    kvray error class name (`kvray.errors`) or one of the names documented in this module, never
    the name of a Ray wrapper; the message is fixed per status (see `PUBLIC_MESSAGES`)."""
    cause = _kvray_cause(error)
    if cause is not None:
        name = _kvray_class(cause).__name__
        if isinstance(cause, ConfigError | PlanError):
            status = 400
        elif isinstance(cause, BackpressureError):
            status = 503
        elif isinstance(cause, TransferTimeoutError):
            status = 504
        elif isinstance(cause, TransportError | MetadataError):
            status = 502
        else:
            status = 500
        return status, name, PUBLIC_MESSAGES[status]
    if _caused_by(error, ray.exceptions.RayActorError | serve.exceptions.ReplicaUnavailableError):
        return 503, "ReplicaDied", "a replica serving this request died before answering; retry"
    if _caused_by(error, serve.exceptions.BackPressureError):
        return 503, "BackPressureError", PUBLIC_MESSAGES[503]
    if _caused_by(error, serve.exceptions.DeploymentUnavailableError):
        return 503, "DeploymentUnavailableError", PUBLIC_MESSAGES[503]
    return 500, "InternalError", PUBLIC_MESSAGES[500]


def _kvray_class(error: KvrayError) -> type[KvrayError]:
    """The kvray class of `error`: Ray re-raises a remote error as a class derived from both its
    own wrapper and the original, named after both."""
    for cls in type(error).__mro__:
        if cls.__module__ == KvrayError.__module__ and issubclass(cls, KvrayError):
            return cls
    return KvrayError


def _caused_by(error: BaseException, kinds: Any) -> bool:
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, kinds):
            return True
        seen = getattr(seen, "cause", None) or seen.__cause__
    return False


def _kvray_cause(error: BaseException) -> KvrayError | None:
    """The kvray error behind a failure that crossed one or more Ray calls, if any."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, KvrayError):
            return seen
        if isinstance(seen, ray.exceptions.RayActorError):
            return None
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None


def _error_response(status: int, kind: str, message: str, request_id: str | None) -> JSONResponse:
    return JSONResponse({"error": message, "type": kind, "request_id": request_id}, status_code=status)


# ---- the application -------------------------------------------------------------------------


@functools.cache
def _source_digest() -> str:
    """kvray's Python sources as this process first read them. Read once: a process runs the
    code it imported, and a new deploying process (the script rerun, `serve run`) reads edits."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(package).as_posix().encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def deployment_version(options: ServeOptions) -> str:
    """The code version of every deployment of `build_app(options)`: a digest of kvray's
    sources and of the options less the replica counts. Redeploying with only
    `prefill_replicas` or `decode_replicas` changed keeps it, so Serve scales in place; any
    other change (code or options) restarts every replica with it."""
    fields = msgspec.to_builtins(options)
    del fields["prefill_replicas"], fields["decode_replicas"]
    digest = hashlib.sha256(_source_digest().encode())
    digest.update(msgspec.json.encode(fields))
    return digest.hexdigest()[:32]


def build_app(args: Mapping[str, Any] | ServeOptions | None = None) -> Any:
    """The Serve application (`serve.Application`) for `args` (see `ServeOptions`)."""
    options = args if isinstance(args, ServeOptions) else ServeOptions.from_args(args)
    # Without an explicit version `serve.run` gives each deployment a random one, so a redeploy
    # that only changes a replica count replaces every replica. Ray 2.60 took `version` out of
    # the public options but still honours it with `_internal=True` (a config deploy, `serve
    # deploy`, versions by its own digest of the import path and args instead).
    version = deployment_version(options)
    replica_actor_options = {"num_cpus": options.replica_cpus}
    bounds: dict[str, Any] = {
        "max_ongoing_requests": options.max_ongoing_requests,
        "max_queued_requests": options.max_queued_requests,
    }
    prefill = (
        serve.deployment(
            name="Prefill",
            num_replicas=options.prefill_replicas,
            ray_actor_options=replica_actor_options,
            **bounds,
        )(PrefillReplica)
        .options(version=version, _internal=True)
        .bind(options)
    )
    decode = (
        serve.deployment(
            name="Decode",
            num_replicas=options.decode_replicas,
            ray_actor_options=replica_actor_options,
            **bounds,
        )(DecodeReplica)
        .options(version=version, _internal=True)
        .bind(options, prefill)
    )
    router = serve.deployment(name="Router", ray_actor_options={"num_cpus": 0}, **bounds)(Router)
    return router.options(version=version, _internal=True).bind(options, decode)


__all__ = [
    "DecodeReplica",
    "GenerateReply",
    "GenerateRequest",
    "PrefillReplica",
    "PrefillReply",
    "ReplicaDirectory",
    "ReplicaEngine",
    "ReplicaHost",
    "Router",
    "ServeOptions",
    "build_app",
    "deployment_version",
    "http_error",
    "prompt_tokens",
    "read_body",
    "tokenize",
]
