"""Prefill/decode with vLLM engines and `KvrayConnector`: an engine wrapper to run inside a Ray
actor (or in-process), and the P/D generation that the example, the tests and the benchmark
share. P runs the prompt (one token) and holds its KV; D gets P's `kv_transfer_params`, has
the KV pushed into the blocks it allocated, and decodes.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONNECTOR_MODULE = "kvray.integrations.vllm.connector"


@dataclass(frozen=True)
class ConnectorClass:
    """A vLLM KV connector class as a `kv_transfer_config` names it: the class `name`
    (`kv_connector`) in the module vLLM imports (`kv_connector_module_path`)."""

    name: str
    module: str


#: kvray's connector. Instrumented ones (a digest log, the seed bug) subclass it elsewhere:
#: `kvray.bench.handoff_log.DIGEST_LOG_CONNECTOR`, `kvray.faults.SEED_BUG_CONNECTOR`.
KVRAY_CONNECTOR = ConnectorClass("KvrayConnector", CONNECTOR_MODULE)
#: vLLM's CPU worker processes' OpenMP cores, one `|`-separated list per rank (vLLM reads it in
#: the engine core, as its multiprocessing executor starts the workers).
THREADS_BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


#: `kv_connector_extra_config` keys that name a hand-off key: the key itself (vLLM prints it at
#: start-up) or a file holding it; without either the connector takes KVRAY_HANDOFF_KEY.
KEY_NAMES = ("handoff_key", "handoff_key_file")
#: Where a Ray cluster keeps the hand-off key its engines share (Ray's internal KV store).
CLUSTER_KEY_NAMESPACE = "kvray"
CLUSTER_KEY_NAME = b"kvray/handoff_key"


def names_key(extra: Mapping[str, Any]) -> bool:
    """Whether a connector's extra config names its hand-off key itself (`KEY_NAMES`)."""
    return any(extra.get(name) is not None for name in KEY_NAMES)


def deployment_key() -> str:
    """The hand-off key of the engines this process configures: KVRAY_HANDOFF_KEY, else (when
    this process is connected to Ray) the Ray cluster's, else a fresh one. It is exported to
    KVRAY_HANDOFF_KEY, which processes started from here inherit, and, connected to Ray, kept as
    the cluster's (`cluster_key`), where `Engine` actors and Serve LLM replicas find it."""
    from kvray.config import HANDOFF_KEY_VARIABLE, handoff_key_from_env
    from kvray.integrations.vllm.tickets import new_key_hex

    key = handoff_key_from_env()
    if _ray_connected():
        key = cluster_key(key)
    elif key is None:
        key = new_key_hex()
    os.environ[HANDOFF_KEY_VARIABLE] = key
    return key


def cluster_key(key: str | None = None) -> str:
    """The hand-off key the engines of this Ray cluster share (in Ray's internal KV store): the
    one kept there, else `key` (a fresh one if None), kept from now on. `ConfigError` when `key`
    is not the one kept: the engines that read it would not trust this process's tickets."""
    import hmac

    from ray.experimental import internal_kv

    from kvray.config import HANDOFF_KEY_VARIABLE
    from kvray.errors import ConfigError
    from kvray.integrations.vllm.tickets import new_key_hex

    wanted = key or new_key_hex()
    internal_kv._internal_kv_put(
        CLUSTER_KEY_NAME, wanted.encode(), overwrite=False, namespace=CLUSTER_KEY_NAMESPACE
    )
    kept = kept_cluster_key()
    if kept is None:
        raise ConfigError(f"Ray's internal KV store lost kvray's hand-off key; set {HANDOFF_KEY_VARIABLE}")
    if key is not None and not hmac.compare_digest(kept, key):
        raise ConfigError(
            f"{HANDOFF_KEY_VARIABLE} is not the hand-off key this Ray cluster's engines share (kept in "
            "Ray's internal KV store by the first process that configured one): unset it here, or "
            "give every engine its key in their environment"
        )
    return kept


def kept_cluster_key() -> str | None:
    """The hand-off key this Ray cluster keeps, if any (`cluster_key`)."""
    from ray.experimental import internal_kv

    stored = internal_kv._internal_kv_get(CLUSTER_KEY_NAME, namespace=CLUSTER_KEY_NAMESPACE)
    return stored.decode() if stored else None


def transfer_config(
    extra: Mapping[str, Any] | None = None,
    *,
    kv_role: str = "kv_both",
    failure_policy: str = "fail",
    connector: ConnectorClass = KVRAY_CONNECTOR,
) -> dict[str, Any]:
    """The `--kv-transfer-config` of an engine using `KvrayConnector` (or `connector`, a
    subclass of it, loaded by module path). It holds no hand-off key
    (vLLM prints the config at start-up): the engines take this process's (`deployment_key`)
    from their environment, processes started from here by inheriting KVRAY_HANDOFF_KEY, an
    `Engine` in a Ray actor from the cluster, so engines configured by one process trust each
    other's tickets. A key `extra` names (`KEY_NAMES`) is kept, and used instead."""
    extra = dict(extra or {})
    if not names_key(extra):
        deployment_key()
    return {
        "kv_connector": connector.name,
        "kv_connector_module_path": connector.module,
        "kv_role": kv_role,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": extra,
    }


@dataclass(frozen=True)
class Generation:
    """One request's output."""

    prompt: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    #: Per generated token, the top log-probabilities by token id (when asked for).
    logprobs: tuple[dict[int, float], ...] | None = None


class Engine:
    """One vLLM engine (`vllm.LLM`), with `KvrayConnector` unless `transfer` is None. Meant to
    be the body of a Ray actor (`ray.remote(num_cpus=0)(Engine)`): vLLM starts its own engine
    core and worker processes under it.

    `dtype` is float32 by default: a decode engine computes a request's first token from the
    prompt's KV loaded into its cache, which in bfloat16 rounds differently from the prefill
    pass that produced the KV (a single engine's own prefix cache does the same), so greedy
    text can part from a single engine's even though every byte of the KV arrived; float32
    keeps the two paths to the same tokens.

    `join_ray`: inside a Ray actor (the default there), the connector's worker joins the same
    Ray cluster and registers with kvray's coordinator, naming the actor's node: engines on
    other nodes then reach it (the `ray` transport). Outside Ray, or with False, the engines
    know each other only from `kv_transfer_params` and must share a node. `engine_options`: more
    `vllm.LLM` arguments (e.g. `num_gpu_blocks_override`, a small KV cache).

    With `tensor_parallel_size` (or `pipeline_parallel_size`) above 1 in `engine_options`, the
    ranks run under vLLM's multiprocessing executor unless `distributed_executor_backend` names
    another (vLLM would take its Ray executor in an actor placed in a placement group), and on a
    CPU each rank gets its share of this process's cores (`cpu_thread_binding`) unless
    `VLLM_CPU_OMP_THREADS_BIND` is set: vLLM's own binding wants a NUMA node per rank."""

    def __init__(
        self,
        model: str,
        transfer: Mapping[str, Any] | None = None,
        *,
        max_model_len: int = 2048,
        kv_cache_gib: int = 1,
        dtype: str = "float32",
        join_ray: bool | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local folder: never fetch
        from vllm import LLM
        from vllm.config import KVTransferConfig

        options: dict[str, Any] = dict(engine_options or {})
        ranks = int(options.get("tensor_parallel_size", 1)) * int(options.get("pipeline_parallel_size", 1))
        if ranks > 1:
            options.setdefault("distributed_executor_backend", "mp")
        #: The engine's kvray engine id ("" without a connector): what a client names in a
        #: decode engine's `kvray_prefill_engine` to hand it a request first (`decode_first`).
        self.kv_engine = ""
        if transfer is not None:
            _export_cluster_key(transfer)
            config = _joined(transfer, join_ray)
            config["engine_id"] = config.get("engine_id") or uuid.uuid4().hex
            self.kv_engine = f"vllm-{config['engine_id']}"
            options["kv_transfer_config"] = KVTransferConfig(**config)
        with _cpu_threads_bound(ranks):
            self.llm = LLM(
                model=model,
                dtype=dtype,
                max_model_len=max_model_len,
                enforce_eager=True,
                disable_log_stats=False,  # kv_cache_usage_perc: see blocks_in_use
                **options,
            )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int,
        params: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        ignore_eos: bool = False,
        logprobs: int | None = None,
    ) -> list[Generation]:
        """Greedy generations of `prompts` (text, or token ids), each with its
        `kv_transfer_params` (if any); `ignore_eos`: every one `max_tokens` long; `logprobs`:
        each generated token's top log-probabilities too."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = params if params is not None else [None] * len(prompts)
        sampling = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
                extra_args=None if p is None else {"kv_transfer_params": dict(p)},
            )
            for p in params
        ]
        inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False)
        return [
            Generation(
                prompt=prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>",
                token_ids=tuple(output.outputs[0].token_ids),
                text=output.outputs[0].text,
                finish_reason=output.outputs[0].finish_reason,
                kv_transfer_params=output.kv_transfer_params,
                logprobs=_logprobs(output.outputs[0].logprobs),
            )
            for prompt, output in zip(prompts, outputs, strict=True)
        ]

    def chat(self, conversations: Sequence[Sequence[Mapping[str, str]]], max_tokens: int) -> list[str]:
        """Greedy answers to chat conversations (the model's chat template applied)."""
        from vllm import SamplingParams

        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outputs = self.llm.chat([list(map(dict, c)) for c in conversations], sampling, use_tqdm=False)
        return [output.outputs[0].text for output in outputs]

    def blocks_in_use(self) -> float:
        """The fraction of the engine's KV cache blocks held by requests, read once one more
        one-token request has run (vLLM publishes the gauge as a step ends): 0.0 when nothing,
        a request held for a decode engine included, holds a block."""
        self.generate(["."], 1)
        gauges = [metric for metric in self.llm.get_metrics() if metric.name == "vllm:kv_cache_usage_perc"]
        return float(gauges[0].value) if gauges else float("nan")

    def kvray_counter(self, name: str, **labels: str) -> float:
        """The sum of kvray's counter `name` (`vllm:kvray_<name>_total` as scraped) on this engine's
        metrics over the samples whose labels include `labels`, as vLLM last published them."""
        total = 0.0
        for metric in self.llm.get_metrics():
            if metric.name in (f"vllm:kvray_{name}", f"vllm:kvray_{name}_total") and all(
                metric.labels.get(key) == value for key, value in labels.items()
            ):
                total += float(getattr(metric, "value", 0.0))
        return total

    def kv_engine_id(self) -> str:
        return self.kv_engine

    def node_id(self) -> str:
        """The Ray node this engine runs on ("" outside Ray)."""
        if not _ray_connected():
            return ""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def processes(self) -> list[int]:
        """The pids of this engine's own processes (engine core, workers), for fault tests."""
        import psutil

        return [child.pid for child in psutil.Process().children(recursive=True)]


def cpu_thread_binding(ranks: int, cpus: Sequence[int] | None = None) -> str:
    """A `VLLM_CPU_OMP_THREADS_BIND` value giving each of `ranks` worker processes its own
    consecutive share of `cpus` (default: the cores this process may run on), the first ranks one
    more where they do not divide: "0|1" for 2 ranks on cores 0 and 1. With fewer cores than
    ranks, ranks share cores in turn."""
    allowed = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if ranks < 1 or not allowed:
        raise ValueError(f"cannot bind {ranks} ranks to cores {allowed}")
    if len(allowed) < ranks:
        return "|".join(str(allowed[rank % len(allowed)]) for rank in range(ranks))
    share, extra = divmod(len(allowed), ranks)
    per_rank: list[str] = []
    first = 0
    for rank in range(ranks):
        count = share + (1 if rank < extra else 0)
        per_rank.append(",".join(str(cpu) for cpu in allowed[first : first + count]))
        first += count
    return "|".join(per_rank)


@contextlib.contextmanager
def _cpu_threads_bound(ranks: int) -> Iterator[None]:
    """`VLLM_CPU_OMP_THREADS_BIND` set for `ranks` CPU workers while vLLM starts them, where
    there are several ranks, vLLM runs on the CPU and the variable is unset. Only around the
    start: the engine core inherits it then, and a later engine of this process with another
    number of ranks must not (vLLM asserts one list per rank)."""
    if ranks <= 1 or THREADS_BIND_VARIABLE in os.environ:
        yield
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    os.environ[THREADS_BIND_VARIABLE] = cpu_thread_binding(ranks)
    try:
        yield
    finally:
        os.environ.pop(THREADS_BIND_VARIABLE, None)


def _logprobs(positions: Any) -> tuple[dict[int, float], ...] | None:
    """vLLM's per-position logprobs as plain numbers (they cross Ray)."""
    if positions is None:
        return None
    return tuple(
        {int(token): float(entry.logprob) for token, entry in position.items()} for position in positions
    )


def _export_cluster_key(transfer: Mapping[str, Any]) -> None:
    """Give the engine core this process starts its hand-off key in the environment: where the
    config names none and KVRAY_HANDOFF_KEY is unset here (a Ray actor does not inherit its
    driver's environment), the Ray cluster's, which `transfer_config` kept there."""
    from kvray.config import HANDOFF_KEY_VARIABLE, handoff_key_from_env
    from kvray.errors import ConfigError

    if names_key(transfer.get("kv_connector_extra_config") or {}) or handoff_key_from_env() is not None:
        return
    if not _ray_connected():
        return  # the connector refuses to start, saying how to give it a key
    key = kept_cluster_key()
    if key is None:
        raise ConfigError(
            f"this engine has no hand-off key: {HANDOFF_KEY_VARIABLE} is unset in its process and the "
            "Ray cluster keeps none; build its config with transfer_config() once connected to Ray, "
            f"or set {HANDOFF_KEY_VARIABLE} in the actor's runtime_env"
        )
    os.environ[HANDOFF_KEY_VARIABLE] = key


def _ray_connected() -> bool:
    """Whether this process is connected to Ray; False where Ray is not installed (a GPU
    machine may run vLLM engines without it)."""
    try:
        import ray
    except ImportError:
        return False
    return bool(ray.is_initialized())


def _joined(transfer: Mapping[str, Any], join_ray: bool | None) -> dict[str, Any]:
    """`transfer` with the Ray cluster and node of the calling actor in the connector's extra
    config, when it is to join Ray."""
    if not join_ray and not _ray_connected():
        return dict(transfer)  # an engine of a machine without Ray (or outside it)
    import ray

    in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    if not (in_actor if join_ray is None else join_ray):
        return dict(transfer)
    context = ray.get_runtime_context()
    extra = {
        "ray_address": context.gcs_address,
        "node_id": context.get_node_id(),
        **dict(transfer.get("kv_connector_extra_config") or {}),
    }
    return {**transfer, "kv_connector_extra_config": extra}


@dataclass(frozen=True)
class Handoff:
    """A P/D generation of a batch: the outputs and how long each half took."""

    prefill: list[Generation]
    decode: list[Generation]
    prefill_s: float
    decode_s: float


def prefill_then_decode(
    prefill: Any, decode: Any, prompts: Sequence[str | Sequence[int]], max_tokens: int
) -> Handoff:
    """Run `prompts` on the prefill engine (one token, KV held for the decode side), then on
    the decode engine with the prefill's `kv_transfer_params`. `prefill`/`decode` are `Engine`
    Ray actor handles or `Engine` objects."""
    started = time.perf_counter()
    first = _call(prefill, "generate", list(prompts), 1, [{"do_remote_decode": True}] * len(prompts))
    middle = time.perf_counter()
    params = [generation.kv_transfer_params for generation in first]
    second = _call(decode, "generate", list(prompts), max_tokens, params)
    return Handoff(first, second, middle - started, time.perf_counter() - middle)


def decode_first(
    prefill: Any,
    decode: Any,
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int,
    *,
    before_prefill: Callable[[list[str]], None] | None = None,
    handoffs: Sequence[str] | None = None,
    logprobs: int | None = None,
) -> Handoff:
    """Give the decode engine the requests first, naming the prefill engine and a hand-off id
    per request; then run them on the prefill engine. The decode engine reserves its blocks and
    asks before the prefill's forward, so each layer is pushed as the forward saves it (a
    prompt the prefill computes over several steps is pushed once it is done). Both engines must
    have joined Ray (`Engine(join_ray=...)`): the decode engine finds the prefill engine through
    kvray's coordinator. `before_prefill(handoff ids)` runs between the two (e.g. to wait until
    the prefill engine holds every push request). `handoffs`: the hand-off ids (minted here by
    default); `logprobs`: the decode side's generations carry each token's top ones.
    `prefill`/`decode` are `Engine` Ray actor handles."""
    import ray

    from kvray.integrations.vllm.tickets import HandoffKey, hold_params, load_params, mint_handoff_id

    key = HandoffKey.from_hex(deployment_key())
    handoffs = list(handoffs) if handoffs is not None else [mint_handoff_id() for _ in prompts]
    engine, decoder = ray.get([prefill.kv_engine_id.remote(), decode.kv_engine_id.remote()])
    started = time.perf_counter()
    decoding = decode.generate.remote(
        list(prompts),
        max_tokens,
        [load_params(key, engine, handoff, decode_engine=decoder) for handoff in handoffs],
        logprobs=logprobs,
    )
    if before_prefill is not None:
        before_prefill(handoffs)
    first = ray.get(
        prefill.generate.remote(
            list(prompts), 1, [hold_params(key, handoff, decode_engine=decoder) for handoff in handoffs]
        )
    )
    middle = time.perf_counter()
    second = ray.get(decoding)
    return Handoff(first, second, middle - started, time.perf_counter() - middle)


def _call(engine: Any, method: str, *args: Any) -> Any:
    bound = getattr(engine, method)
    remote = getattr(bound, "remote", None)
    if remote is None:
        return bound(*args)
    import ray

    return ray.get(remote(*args))
