"""kvray's Ray Serve LLM back-end without engines: a decode leg whose KV did not load (vLLM's
answer under kv_load_failure_policy "fail") is answered as a 502 naming the leg and the cause,
streaming as an error event that ends the stream, while every other answer passes unchanged;
`build_pd_app` gives Ray's P/D builder kvray's decode server; no configuration kvray's helpers
make holds the hand-off key, which reaches an `Engine` in a Ray actor through its environment;
and the back-end sets up and signs tickets on Ray 2.60's connector base and on the newer one
(engine-neutral `BaseConnectorBackend` without `kv_transfer_config`, `VLLMConnectorBackend` with
it), faked here as ray-project/ray's `python/ray/llm/_internal/serve/engines/vllm/kv_transfer/
base.py` reads in its newest version found (the search index's file id 59489297777, which named
no commit) over `engines/common/kv_transfer/base.py` (commit 12052023136c026a3eb65a9eb201b402acc2503b).

Skipped where Ray Serve LLM (vLLM, pyarrow) is not installed."""

from __future__ import annotations

import abc
import importlib.util
import json
import os
import random
import string
import sys
import types
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="Ray Serve LLM's back-end needs vLLM: pip install -e '.[vllm]'")
pytest.importorskip("pyarrow", reason="ray.serve.llm needs pyarrow: pip install -e '.[vllm]'")

import ray
from ray.llm._internal.serve.core.configs.openai_api_models import (
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
)
from vllm.exceptions import GenerationError

from kvray.config import HANDOFF_KEY_VARIABLE
from kvray.errors import ConfigError
from kvray.integrations.vllm import pd, serve_llm, tickets

KEY = tickets.new_key_hex()
ROLE = (
    'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, '
    '"finish_reason": null}]}\n\n'
)
TOKEN = 'data: {"choices": [{"index": 0, "text": " Paris", "finish_reason": null}]}\n\n'
#: vLLM 0.32's stream event for a request its engine ended in error (a failed KV load).
VLLM_ERROR = (
    'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
    '"param": null, "code": 500}}\n\n'
)
DONE = "data: [DONE]\n\n"


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_running() -> Iterator[None]:
    """Building Ray Serve LLM's app here starts a Ray in this process; the tests after this
    module start Ray their own way."""
    running = ray.is_initialized()
    yield
    if not running and ray.is_initialized():
        ray.shutdown()


class Answer:
    """A decode server's answer: yields `chunks`, then raises `error` if given; records closing."""

    def __init__(self, *chunks: Any, error: BaseException | None = None) -> None:
        self.chunks, self.error, self.closed = chunks, error, False

    async def run(self) -> AsyncGenerator[Any, None]:
        try:
            for chunk in self.chunks:
                yield chunk
            if self.error is not None:
                raise self.error
        finally:
            self.closed = True


async def answered(answer: Answer, *, stream: bool) -> list[Any]:
    return [chunk async for chunk in serve_llm.answer_failed_loads(answer.run(), stream=stream)]


def failure_of(error: Any) -> dict[str, Any]:
    body = (
        error.model_dump() if isinstance(error, ErrorResponse) else json.loads(error.removeprefix("data: "))
    )
    return dict(body["error"])


def assert_names_the_failed_load(error: dict[str, Any]) -> None:
    assert error["code"] == 502 and error["leg"] == "decode" and error["cause"] == "kv_load_failed", error
    # Ray's ingress keeps only the message (and the status): it names them too.
    assert "decode leg" in error["message"] and "kv_load_failed" in error["message"], error


def completion(finish_reason: str) -> CompletionResponse:
    return CompletionResponse(
        model="m",
        choices=[{"index": 0, "text": "", "finish_reason": finish_reason}],
        usage={"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
    )


async def test_a_failed_load_is_a_502_naming_the_leg_and_the_cause() -> None:
    # vLLM 0.32 raises as it builds the response; a response that says "error" is the same.
    for answer in (Answer(error=GenerationError()), Answer(completion("error"))):
        (error,) = await answered(answer, stream=False)
        assert isinstance(error, ErrorResponse) and error.error.code == 502
        assert_names_the_failed_load(failure_of(error))
        assert answer.closed
    # Streaming: the error event is the stream's last (Ray's ingress then ends it with [DONE]),
    # after whatever came before the first token (a chat stream's role chunk).
    for batches in ([[VLLM_ERROR, DONE]], [[ROLE], [VLLM_ERROR], [DONE]], [[ROLE, VLLM_ERROR, DONE]]):
        answer = Answer(*batches)
        chunks = await answered(answer, stream=True)
        events = [event for chunk in chunks for event in chunk]
        assert events[:-1] == ([ROLE] if ROLE in batches[0] else [])
        assert_names_the_failed_load(failure_of(events[-1]))
        assert answer.closed
    failed_choice = 'data: {"choices": [{"index": 0, "text": "", "finish_reason": "error"}]}\n\n'
    (chunk,) = await answered(Answer([failed_choice, DONE]), stream=True)
    assert_names_the_failed_load(failure_of(chunk[-1]))


async def test_every_other_answer_passes_unchanged() -> None:
    done = completion("length")
    assert await answered(Answer(done), stream=False) == [done]
    stream = ([ROLE], [TOKEN, TOKEN], [DONE])
    assert await answered(Answer(*stream), stream=True) == list(stream)
    # The prefill leg's error (the orchestrator yields it as it is), or a client's.
    for error in (500, 400):
        refused = ErrorResponse(error=ErrorInfo(message="prefill failed", type="X", code=error))
        assert await answered(Answer(refused), stream=False) == [refused]
        assert await answered(Answer(refused), stream=True) == [refused]
    client_error = 'data: {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}\n\n'
    assert await answered(Answer([client_error, DONE]), stream=True) == [[client_error, DONE]]
    # An error after output is not a failed load: it passes as vLLM sent it.
    late = ([TOKEN], [VLLM_ERROR, DONE])
    assert await answered(Answer(*late), stream=True) == list(late)
    with pytest.raises(GenerationError):
        await answered(Answer([TOKEN], error=GenerationError()), stream=True)
    # One Ray raises from another process (the prefill replica) is that leg's, not the load's.
    wrapped = ray.exceptions.RayTaskError("prefill", "traceback", GenerationError()).as_instanceof_cause()
    with pytest.raises(GenerationError):
        await answered(Answer(error=wrapped), stream=False)


@pytest.mark.usefixtures("own_ray")  # building the app starts a Ray in this process
def test_build_pd_app_gives_rays_builder_kvrays_decode_server(tmp_path: Path) -> None:
    from ray.llm._internal.serve.serving_patterns.prefill_decode import builder

    before = builder.PDDecodeServer, builder.DPPDDecodeServer
    app = serve_llm.build_pd_app(str(tmp_path))
    decode = app._bound_deployment.init_kwargs["llm_deployments"]["smollm2"]._bound_deployment
    assert decode.func_or_class is serve_llm.KvrayDecodeServer
    assert issubclass(serve_llm.KvrayDecodeServer, builder.PDDecodeServer)
    assert (builder.PDDecodeServer, builder.DPPDDecodeServer) == before  # swapped back


def helper_configs(tmp_path: Path) -> list[Any]:
    """Every configuration kvray's helpers make: the connector's, both of Serve LLM's
    deployments (the whole LLMConfig) and an app built with settings."""
    app = serve_llm.build_pd_app(
        str(tmp_path), prefill_extra={"lease_s": 30.0}, decode_extra={"lease_s": 30.0}
    )
    decode = app._bound_deployment.init_kwargs["llm_deployments"]["smollm2"]._bound_deployment
    prefill = decode.init_kwargs["prefill_server"]._bound_deployment
    return [
        pd.transfer_config(),
        pd.transfer_config({"transfer_timeout_s": 30.0}, kv_role="kv_consumer"),
        serve_llm.kv_transfer_config({"lease_s": 30.0}),
        *(d.init_kwargs["llm_config"].model_dump() for d in (decode, prefill)),
    ]


@pytest.mark.usefixtures("own_ray")  # building the app starts a Ray in this process
def test_no_config_kvrays_helpers_make_holds_the_hand_off_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HANDOFF_KEY_VARIABLE, KEY)
    for config in helper_configs(tmp_path):
        assert KEY not in json.dumps(config, default=repr), config
    assert pd.deployment_key() == KEY
    # Without one, the helpers make the process's key (exported for the engines it starts).
    monkeypatch.delenv(HANDOFF_KEY_VARIABLE)
    configs = helper_configs(tmp_path)
    made = pd.deployment_key()
    assert made and all(made not in json.dumps(config, default=repr) for config in configs)
    # A key the user names stays theirs (vLLM prints it; the environment is the better place).
    named = tickets.new_key_hex()
    given = pd.transfer_config({"handoff_key": named})
    assert given["kv_connector_extra_config"]["handoff_key"] == named
    assert serve_llm.replica_key(given["kv_connector_extra_config"]).tag("x") == tickets.HandoffKey.from_hex(
        named
    ).tag("x")


def test_an_engine_in_a_ray_actor_takes_the_clusters_key_into_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Inside an actor Ray is initialized and the driver's KVRAY_HANDOFF_KEY is not inherited.
    monkeypatch.delenv(HANDOFF_KEY_VARIABLE, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(pd, "kept_cluster_key", lambda: KEY)
    pd._export_cluster_key({"kv_connector": "KvrayConnector", "kv_connector_extra_config": {"lease_s": 30.0}})
    assert os.environ[HANDOFF_KEY_VARIABLE] == KEY
    # A config that names its key, or a process that has one, is left as it is.
    monkeypatch.setenv(HANDOFF_KEY_VARIABLE, "other")
    pd._export_cluster_key({})
    assert os.environ[HANDOFF_KEY_VARIABLE] == "other"
    monkeypatch.delenv(HANDOFF_KEY_VARIABLE)
    pd._export_cluster_key({"kv_connector_extra_config": {"handoff_key": KEY}})
    assert HANDOFF_KEY_VARIABLE not in os.environ
    # A cluster that keeps none: the engine says how to give it one.
    monkeypatch.setattr(pd, "kept_cluster_key", lambda: None)
    with pytest.raises(ConfigError, match="runtime_env"):
        pd._export_cluster_key({})


# --- Ray's connector bases -------------------------------------------------------------------


def newer_ray_base() -> types.ModuleType:
    """`ray.llm._internal.serve.engines.vllm.kv_transfer.base` shaped as newer Ray has it: the
    neutral base (from `engines.common.kv_transfer.base`) carries no `kv_transfer_config`, the
    vLLM subclass `VLLMConnectorBackend` adds it, and the helpers kvray imports are here."""

    class BaseConnectorBackend(abc.ABC):
        requires_peer_binding: bool = False
        concurrent_handoff: bool = False

        def __init__(self, llm_config: Any) -> None:
            self.llm_config = llm_config

        def _get_unique_suffix(self, len: int = 6) -> str:
            return "".join(random.choices(string.ascii_letters + string.digits, k=len))

        @abc.abstractmethod
        def prepare_prefill_request(self, *, request: Any, peer: dict[str, Any] | None) -> Any: ...

        @abc.abstractmethod
        def prepare_decode_request(
            self, *, request: Any, peer: dict[str, Any] | None, prefill_response: Any
        ) -> Any: ...

        def setup(self) -> None:  # noqa: B027 - as Ray's: an optional hook
            pass

        def replica_metadata(self) -> dict[str, Any]:
            return {}

    class VLLMConnectorBackend(BaseConnectorBackend):
        @property
        def kv_transfer_config(self) -> dict[str, Any]:
            config = self.llm_config.engine_kwargs.get("kv_transfer_config")
            assert config is not None, "In Connector backend, kv_transfer_config is not set"
            return dict(config)

    def base_prefill_kv_transfer_params() -> dict[str, Any]:
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
        }

    def clamp_request_to_single_token(request: Any) -> None:
        request.max_tokens = 1
        if hasattr(request, "max_completion_tokens"):
            request.max_completion_tokens = 1
        request.stream = False
        if hasattr(request, "stream_options"):
            request.stream_options = None

    module = types.ModuleType("ray.llm._internal.serve.engines.vllm.kv_transfer.base")
    for value in (BaseConnectorBackend, VLLMConnectorBackend, base_prefill_kv_transfer_params):
        setattr(module, value.__name__, value)
    module.clamp_request_to_single_token = clamp_request_to_single_token  # type: ignore[attr-defined]
    return module


def serve_llm_over(base: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """kvray's serve_llm module as imported where Ray's connector base module is `base`."""
    monkeypatch.setitem(sys.modules, base.__name__, base)
    name = "kvray_serve_llm_over_newer_ray"
    spec = importlib.util.spec_from_file_location(name, serve_llm.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def in_a_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    act_as_replica(monkeypatch)


def act_as_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Serve replica's back-end reads of Ray: its cluster and node, and the key."""
    context = types.SimpleNamespace(gcs_address="127.0.0.1:6379", get_node_id=lambda: "node-a")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv(HANDOFF_KEY_VARIABLE, KEY)


def check_backend(backend_class: type, base: type) -> None:
    """Set up on a deployment's config: the config the engine gets names kvray's engine and Ray
    cluster, holds no key, and the tickets the back-end signs verify under the key."""
    assert issubclass(backend_class, base)
    transfer = serve_llm.kv_transfer_config({"lease_s": 30.0})
    llm_config = types.SimpleNamespace(engine_kwargs={"kv_transfer_config": transfer, "max_model_len": 64})
    backend = backend_class(llm_config)
    backend.setup()
    extra = transfer["kv_connector_extra_config"]  # set up in place: the engine gets this dict
    assert transfer["engine_id"].startswith("serve-") and extra["ray_address"] == "127.0.0.1:6379"
    assert extra["node_id"] == "node-a" and KEY not in json.dumps(transfer)
    engine = backend.replica_metadata()[serve_llm.ENGINE_KEY]
    assert engine == f"vllm-{transfer['engine_id']}"
    request = CompletionRequest(model="m", prompt="The capital of France is", max_tokens=8, stream=True)
    prefill = backend.prepare_prefill_request(request=request, peer={serve_llm.ENGINE_KEY: engine})
    decode = backend.prepare_decode_request(
        request=request, peer={serve_llm.ENGINE_KEY: engine}, prefill_response=None
    )
    key = tickets.HandoffKey.from_hex(KEY)
    handoff = tickets.read_hold(key, prefill.kv_transfer_params)
    assert prefill.max_tokens == 1 and not prefill.stream
    assert handoff == tickets.Hold(handoff.handoff_id, decode_engine=engine)  # this replica decodes
    assert tickets.read_load(key, decode.kv_transfer_params) == tickets.Load(
        engine=engine, handoff_id=handoff.handoff_id, decode_engine=engine
    )
    too_long = CompletionRequest(model="m", prompt="x", max_tokens=65)
    backend.prepare_prefill_request(request=too_long, peer=None)
    with pytest.raises(Exception, match="more than the model's context") as refused:
        backend.prepare_decode_request(
            request=too_long, peer={serve_llm.ENGINE_KEY: engine}, prefill_response=None
        )
    assert type(refused.value).__name__ == "DecodeLegRefused" and refused.value.status_code == 400
    unconfigured = backend_class(types.SimpleNamespace(engine_kwargs={}))
    with pytest.raises(ConfigError, match="kv_transfer_config"):
        unconfigured.setup()


@pytest.mark.usefixtures("in_a_replica")
def test_the_backend_on_the_installed_rays_connector_base() -> None:
    from ray.llm._internal.serve.engines.vllm.kv_transfer.base import BaseConnectorBackend

    check_backend(serve_llm.KvrayConnectorBackend, BaseConnectorBackend)


@pytest.mark.usefixtures("in_a_replica")
def test_the_backend_on_newer_rays_engine_neutral_connector_base(monkeypatch: pytest.MonkeyPatch) -> None:
    base = newer_ray_base()
    assert not hasattr(base.BaseConnectorBackend, "kv_transfer_config")
    newer = serve_llm_over(base, monkeypatch)
    check_backend(newer.KvrayConnectorBackend, base.BaseConnectorBackend)


@pytest.mark.parametrize(
    ("config", "kvray"),
    [
        ({"kv_connector": "KvrayConnector"}, True),
        ({"kv_connector": "DigestLogConnector", "kv_connector_module_path": "kvray.bench.handoff_log"}, True),
        ({"kv_connector": "SeedBugConnector", "kv_connector_module_path": "kvray.faults"}, True),
        ({"kv_connector": "KvrayConnector", "kv_connector_module_path": "kvray.bench.handoff_timing"}, True),
        ({"kv_connector": "NixlConnector"}, False),
        ({"kv_connector": "KvrayConnector", "kv_connector_module_path": "kvray.no_such_module"}, False),
        ({"kv_connector": "DigestLog", "kv_connector_module_path": "kvray.bench.handoff_log"}, False),
    ],
)
def test_the_back_end_takes_kvrays_connector_and_its_subclasses_only(
    config: dict[str, Any], kvray: bool
) -> None:
    assert serve_llm.is_kvray_connector(config) is kvray


@pytest.mark.usefixtures("own_ray")  # building the app starts a Ray in this process
def test_an_app_of_an_instrumented_connector_is_served_by_kvrays_back_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    from kvray.bench.handoff_log import DIGEST_LOG_CONNECTOR

    # A key named here: no process or cluster key is looked up or made.
    logs = {"digest_log": str(tmp_path / "log.jsonl"), "handoff_key": KEY}
    app = serve_llm.build_pd_app(
        str(tmp_path), prefill_extra=logs, decode_extra=logs, connector=DIGEST_LOG_CONNECTOR
    )
    decode = app._bound_deployment.init_kwargs["llm_deployments"]["smollm2"]._bound_deployment
    prefill = decode.init_kwargs["prefill_server"]._bound_deployment
    for deployment in (decode, prefill):
        transfer = deployment.init_kwargs["llm_config"].engine_kwargs["kv_transfer_config"]
        assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (
            "DigestLogConnector",
            "kvray.bench.handoff_log",
        )
    assert (
        KVConnectorBackendFactory.get_backend_class("DigestLogConnector") is serve_llm.KvrayConnectorBackend
    )
    act_as_replica(monkeypatch)  # the app is built; its replica sets up
    backend = serve_llm.KvrayConnectorBackend(
        types.SimpleNamespace(engine_kwargs={"kv_transfer_config": dict(transfer)})
    )
    backend.setup()
    assert backend.replica_metadata()[serve_llm.ENGINE_KEY].startswith("vllm-serve-")


def test_the_back_end_is_registered_again_with_each_ray_the_process_joins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ray's registry answers "registered" from this process's cache: an app built after the
    # process left one Ray for another would be served without kvray's back-end there.
    from ray.experimental import internal_kv
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory
    from ray.llm._internal.serve.utils import registry

    cluster: dict[bytes, bytes] = {}  # the internal KV of the Ray the process is connected to
    for module in (registry, internal_kv):
        monkeypatch.setattr(module, "_internal_kv_initialized", lambda: True)
        monkeypatch.setattr(module, "_internal_kv_exists", lambda key, **_: key in cluster)
    monkeypatch.setattr(registry, "_internal_kv_put", lambda key, value, **_: cluster.__setitem__(key, value))
    monkeypatch.setattr(registry, "_internal_kv_get", lambda key, **_: cluster.get(key))
    monkeypatch.setattr(registry, "_internal_kv_del", lambda key, **_: cluster.pop(key, None))
    name = "KvrayRegisteredTwiceConnector"
    key = registry._make_key(serve_llm.BACKEND_CATEGORY, name)
    try:
        serve_llm.register(name)
        assert key in cluster
        serve_llm.register(name)  # the same Ray: nothing to do
        cluster.clear()  # another Ray
        serve_llm.register(name)
        assert key in cluster
        assert KVConnectorBackendFactory.get_backend_class(name) is serve_llm.KvrayConnectorBackend
    finally:
        KVConnectorBackendFactory.unregister_backend(name)
