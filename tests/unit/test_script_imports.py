"""Every name the benchmarks and examples import from kvray exists where they import it from: a
module that moves breaks a script here, not when someone next runs it. Read with `ast`, so no
script runs."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")])


def kvray_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for each `from kvray... import name` anywhere in a script."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        if node.module.split(".")[0] == "kvray":
            found += [(node.module, alias.name) for alias in node.names]
    return found


def test_there_are_scripts_to_check() -> None:
    assert len(SCRIPTS) > 5 and any(kvray_imports(path) for path in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_kvray_name_a_script_imports_exists(path: Path) -> None:
    missing = []
    for module_name, name in kvray_imports(path):
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            if (error.name or "").split(".")[0] == "kvray":
                missing.append(f"{module_name} (no such module)")
            continue  # an optional dependency the script needs is not installed here
        if hasattr(module, name):
            continue
        try:
            importlib.import_module(f"{module_name}.{name}")
        except ImportError:
            missing.append(f"{module_name}.{name}")
    assert not missing, f"{path.relative_to(ROOT)} imports what kvray does not have: {missing}"
