"""Prompts for the vLLM integration's tests and examples: questions, instructions, arithmetic word
problems and long multi-paragraph tasks, shipped with the package (`pd_prompts.json`)."""

from __future__ import annotations

from importlib.resources import files

import msgspec

#: Every prompt's length in SmolLM2's tokens, as plain text and in its chat template alike
#: (inclusive bounds), so prompts fill from a fraction of one KV block to several.
PROMPT_TOKENS = (20, 1000)

_PROMPTS_FILE = "pd_prompts.json"


def load_prompts() -> list[str]:
    """The prompts, in file order. A long prompt is stored as a list of paragraphs, joined here
    with blank lines."""
    raw = files("kvray.integrations.vllm").joinpath(_PROMPTS_FILE).read_bytes()
    entries = msgspec.json.decode(raw, type=list[str | list[str]])
    return [entry if isinstance(entry, str) else "\n\n".join(entry) for entry in entries]
