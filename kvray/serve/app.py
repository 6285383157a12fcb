"""Reference application: an HTTP router, a prefill and a decode deployment around the reference
model, each replica's agent a forwarded one (`kvray.host.forwarded`).

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

Each replica runs a reference-model worker (`kvray.workers`) whose agent a `ForwardedAgent`
holds: peers reach the replica through its `ForwardingHost` actor (see `kvray.host`), and
`check_health` follows the engine's.

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
    504  TransferTimeoutError: the router's deadline passed before the decode replica answered
         (`request_timeout_s`, plus one control message); or the decode replica reported one:
         the KV did not arrive within the replica's deadline. The message says which
    500  InternalError, or another kvray error: anything else
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvray.agent import KVAgent
from kvray.config import Settings
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
from kvray.host.forwarded import ForwardedAgent, ForwardedDirectory
from kvray.layout import BlockOrder, ceil_div
from kvray.models.reference import MODEL_PRESETS, ModelConfig, ReferenceModel, decode_text
from kvray.serve.host import replica_engine_id
from kvray.wire import Reservation
from kvray.workers import DecodeWorker, PrefillResult, PrefillWorker

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
    blocks = ceil_div(len(tokens) + request.max_tokens, config.block_size)
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
class GenerateReply:
    """What a decode replica answers for one request."""

    tokens: list[int]
    decode_engine: str
    prefill: PrefillResult
    #: From the decode call to the first token (blocks reserved, prefill answered).
    ttft_s: float
    decode_s: float


# ---- the deployments ---------------------------------------------------------------------------


#: The reference-model worker a replica runs.
W = TypeVar("W", PrefillWorker, DecodeWorker)


async def start_worker(
    worker_class: type[W], engine_id: str, options: ServeOptions
) -> tuple[W, ForwardedAgent]:
    """A reference-model worker of `options` whose agent a `ForwardedAgent` hosts in this process
    (a Serve replica), started and registered; `close` the engine to undo it."""
    config = options.model_config
    layout = ReferenceModel(config).layout(options.num_blocks, options.block_order)
    built: list[W] = []

    def worker_agent(directory: ForwardedDirectory) -> KVAgent:
        worker = worker_class(engine_id, layout, options.settings, model=config, coordinator=directory)
        built.append(worker)
        return worker.kvray_agent

    engine = await ForwardedAgent.start_agent(worker_agent, options.settings)
    (worker,) = built
    return worker, engine


class _EngineReplica(Generic[W]):
    """What every prefill and decode replica answers besides its own work: Serve's health
    checks, its stats, and its removal (`__del__`: the engine deregisters)."""

    worker: W
    engine: ForwardedAgent

    async def stats(self) -> dict[str, Any]:
        """This replica's engine id, agent counters and block pool (e.g. for `handle.broadcast`)."""
        return {"engine_id": self.engine.engine_id, **await self.worker.stats()}

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def __del__(self) -> None:
        await self.engine.close()


class PrefillReplica(_EngineReplica[PrefillWorker]):
    """Runs prompts and pushes their KV into the decode replica named in the call."""

    # Serve awaits an async constructor: the replica is ready once its engine is registered.
    async def __init__(self, options: ServeOptions) -> None:  # type: ignore[misc]
        self.options = options
        self.worker, self.engine = await start_worker(PrefillWorker, replica_engine_id(), options)

    async def prefill(
        self, tokens: Sequence[int], reservation: Reservation, timeout_s: float
    ) -> PrefillResult:
        return await self.worker.prefill(
            tokens, reservation, layerwise=self.options.layerwise, timeout=timeout_s
        )


class DecodeReplica(_EngineReplica[DecodeWorker]):
    """The decode side of a request in one call: reserve blocks, have a prefill replica fill
    them, wait for the KV, decode, free the blocks."""

    async def __init__(self, options: ServeOptions, prefill: Any) -> None:  # type: ignore[misc]
        self.options = options
        self.prefill = prefill
        self.model = ReferenceModel(options.model_config)
        self.worker, self.engine = await start_worker(DecodeWorker, replica_engine_id(), options)

    async def generate(
        self, request_id: str, tokens: Sequence[int], max_tokens: int, timeout_s: float
    ) -> GenerateReply:
        worker = self.worker
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.settings.deadline(timeout_s, 0.0, "timeout_s")
        started = time.perf_counter()
        reservation = await worker.reserve(
            request_id,
            self.model.blocks_needed(len(tokens) + max_tokens),
            kv_blocks=self.model.blocks_needed(len(tokens)),
        )
        try:
            prefilled: PrefillResult = await _call_with_deadline(
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
            logger.warning("request %s failed (%d %s): %s", request_id, status, kind, failure_detail(error))
            return _error_response(status, kind, message, request_id)
        return JSONResponse(
            {
                "request_id": request_id,
                "tokens": reply.tokens,
                "text": decode_text([token % 256 for token in reply.tokens]),
                "prompt_tokens": len(tokens),
                "decode_engine": reply.decode_engine,
                "prefill_engine": reply.prefill.engine_id,
                "transport": reply.prefill.transport.value,
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
    """Await a deployment response; past `timeout_s` cancel it and raise TransferTimeoutError.

    Cancelling the task that awaits a `DeploymentResponse` stops only the wait: the replica
    called goes on (holding blocks, pushing) unless `response.cancel()` is called, so every
    way out calls it. This can go once Serve cancels a response whose awaiting task is
    cancelled (its parent-request cancellation covers only a whole request, not a deadline
    inside one).

    Only this deadline's expiry raises a new error: a TimeoutError the callee raised (a
    TransferTimeoutError it reports crosses the call as one) is its own, and propagates as is."""
    scope = asyncio.timeout(max(0.0, timeout_s))
    try:
        async with scope:
            return await response
    except TimeoutError as error:
        # The scope's own TimeoutError is raised from the cancellation it caused.
        if not (scope.expired() and isinstance(error.__cause__, asyncio.CancelledError)):
            raise
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

#: The public message of a 504 that a replica reported: its KV transfer passed the replica's
#: deadline, which may be shorter than the request's (a lookup, a notice).
KV_TIMEOUT_MESSAGE = "the KV of this request did not arrive in time; retry"


def http_error(error: BaseException) -> tuple[int, str, str]:
    """(HTTP status, error type, public message) for a failure behind the router. The type is a
    kvray error class name (`kvray.errors`) or one of the names documented in this module, never
    the name of a Ray wrapper; the message is fixed per status (see `PUBLIC_MESSAGES`), but for
    a timeout a replica reported (`KV_TIMEOUT_MESSAGE`)."""
    # A replica that died answers ReplicaDied, whatever error its death carries.
    cause = _cause(error, KvrayError, stop=(ray.exceptions.RayActorError,))
    if cause is not None:
        name = _kvray_class(cause).__name__
        if isinstance(cause, ConfigError | PlanError):
            status = 400
        elif isinstance(cause, BackpressureError):
            status = 503
        elif isinstance(cause, TransferTimeoutError):
            if _from_replica(error):
                return 504, name, KV_TIMEOUT_MESSAGE
            status = 504
        elif isinstance(cause, TransportError | MetadataError):
            status = 502
        else:
            status = 500
        return status, name, PUBLIC_MESSAGES[status]
    if _cause(error, (ray.exceptions.RayActorError, serve.exceptions.ReplicaUnavailableError)):
        return 503, "ReplicaDied", "a replica serving this request died before answering; retry"
    if _cause(error, serve.exceptions.BackPressureError):
        return 503, "BackPressureError", PUBLIC_MESSAGES[503]
    if _cause(error, serve.exceptions.DeploymentUnavailableError):
        return 503, "DeploymentUnavailableError", PUBLIC_MESSAGES[503]
    return 500, "InternalError", PUBLIC_MESSAGES[500]


def failure_detail(error: BaseException) -> str:
    """What the Serve log says of a failure behind the router, after its status and type: whose
    deadline a timeout was (the router's own wait, or one a replica reported), then the error."""
    if _cause(error, TransferTimeoutError, stop=(ray.exceptions.RayActorError,)) is None:
        return str(error)
    if _from_replica(error):
        return (
            "the decode replica reported a TransferTimeoutError: the KV did not arrive within the "
            f"replica's deadline: {error}"
        )
    return f"no answer from the decode replica within the router's own deadline: {error}"


def _from_replica(error: BaseException) -> bool:
    # A replica's error reaches the router re-raised by Ray (`RayTaskError`); an error raised in
    # the router itself (its own deadline) never crossed a Ray call.
    return _cause(error, ray.exceptions.RayTaskError) is not None


def _kvray_class(error: KvrayError) -> type[KvrayError]:
    """The kvray class of `error`: Ray re-raises a remote error as a class derived from both its
    own wrapper and the original, named after both."""
    for cls in type(error).__mro__:
        if cls.__module__ == KvrayError.__module__ and issubclass(cls, KvrayError):
            return cls
    return KvrayError


E = TypeVar("E", bound=BaseException)


def _cause(
    error: BaseException, kinds: type[E] | tuple[type[E], ...], stop: tuple[type[BaseException], ...] = ()
) -> E | None:
    """The first error of `kinds` behind a failure that crossed one or more Ray calls (Ray's
    `cause`, then Python's `__cause__`), looking no further than an error of a `stop` type."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, kinds):
            return seen
        if isinstance(seen, stop):
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
    package = Path(__file__).resolve().parents[1]  # kvray/, above serve/
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
    replica_cpus = {"num_cpus": options.replica_cpus}
    prefill = _deployment(
        PrefillReplica,
        options,
        name="Prefill",
        num_replicas=options.prefill_replicas,
        ray_actor_options=replica_cpus,
    ).bind(options)
    decode = _deployment(
        DecodeReplica,
        options,
        name="Decode",
        num_replicas=options.decode_replicas,
        ray_actor_options=replica_cpus,
    ).bind(options, prefill)
    router = _deployment(Router, options, name="Router", ray_actor_options={"num_cpus": 0})
    return router.bind(options, decode)


def _deployment(cls: type, options: ServeOptions, **deployment_options: Any) -> Any:
    """`cls` as a deployment of `build_app(options)`: bounded and versioned by the options."""
    deployment = serve.deployment(
        max_ongoing_requests=options.max_ongoing_requests,
        max_queued_requests=options.max_queued_requests,
        **deployment_options,
    )(cls)
    # Without an explicit version `serve.run` gives each deployment a random one, so a redeploy
    # that only changes a replica count would replace every replica. Serve's public `options`
    # refuse `version`; `_internal=True` is its private way in. This can go once `serve.run`
    # keeps the replicas of a deployment whose code and options are unchanged (a config deploy,
    # `serve deploy`, already versions by its own digest of the import path and args).
    return deployment.options(version=deployment_version(options), _internal=True)
