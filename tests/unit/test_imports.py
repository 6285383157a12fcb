"""kvray's own imports follow the data flow (layout -> backing -> region -> coordinator -> plan ->
transport -> notice (completion) -> agent -> workers / serve / demo), the engine integrations import
no instrumentation or fault (those subclass the integrations' classes from outside), and no two
modules import each other, not even behind a deferred import: read from the source with `ast`, so
a new import against the flow fails here before it is reviewed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvray"

#: Each tier may import its own and the tiers before it, never a later one.
TIERS: list[tuple[str, ...]] = [
    # foundations: errors, settings, counters, the C extensions
    ("kvray.errors", "kvray.config", "kvray.metrics", "kvray._copy_pool", "kvray._plan"),
    # layouts, and placement digests (which ranges an executor stored to: pure arithmetic)
    ("kvray.layout", "kvray.placement"),
    # which KV heads TP ranks exchange (arithmetic on layouts)
    ("kvray.tensor_parallel",),
    # what engines publish (descriptors, engine info and its checks), the shm folder's entries,
    # and the table of peer calls (names and arguments, no Ray: channels and hosts read it)
    ("kvray.wire", "kvray.validation", "kvray.owned", "kvray.host.calls"),
    ("kvray.memory",),
    ("kvray.coordinator",),
    ("kvray.plan",),
    # the checksums a writer sends and the decode side checks (hashes over planned bytes)
    ("kvray.integrity", "kvray.content"),
    ("kvray.transport",),
    # completion: notice channels and claims
    ("kvray.notice",),
    ("kvray.agent",),
    # how peers reach an agent: the hosts made from the table of peer calls
    ("kvray.host",),
    # what is built on the agent: ready workers, the model, Serve, the command line, engines
    (
        "kvray.models",
        "kvray.workers",
        "kvray.serve",
        "kvray.demo",
        "kvray.faults",
        "kvray.progress",
        "kvray.bench",
        "kvray.doctor",
        "kvray.cli",
        "kvray.integrations",
        "kvray",
    ),
]


#: Imports forbidden inside the last tier: (importer, imported), each a module or package.
#: Instrumentation (`kvray.bench`: digest logs, timing) and deliberate faults (`kvray.faults`)
#: subclass an integration's classes and are loaded by module path (`DigestLogConnector`,
#: `SeedBugConnector`); the integrations never reach up for them.
FORBIDDEN: list[tuple[str, str]] = [
    ("kvray.integrations", "kvray.bench"),
    ("kvray.integrations", "kvray.faults"),
]


def within(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def tier_of(module: str) -> int:
    """The tier of a kvray module: that of the longest listed name it is or lies under."""
    best, best_length = -1, -1
    for index, names in enumerate(TIERS):
        for name in names:
            if within(module, name) and len(name) > best_length:
                best, best_length = index, len(name)
    if best < 0:
        raise AssertionError(f"{module} is in no tier of the data flow: add it to TIERS")
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, *, top_level_only: bool) -> set[str]:
    """The kvray modules a file imports (`from kvray import x` counts as `kvray.x` when x is a
    module); with `top_level_only`, only those run when the module itself is imported."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "kvray"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "kvray":
                continue
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                target = PACKAGE / Path(*candidate.split(".")[1:])
                # A module, a package, or a C extension (its .pyi stub is in the source tree).
                is_module = target.is_dir() or any(
                    target.with_suffix(suffix).exists() for suffix in (".py", ".pyi")
                )
                found.add(candidate if is_module else node.module)
    return found


def sources() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def against_the_flow(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} (tier {tier_of(module)}) imports {target} (tier {tier_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if tier_of(target) > tier_of(module)
    ]


def forbidden(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} imports {target} (forbidden: {importer} -> {imported})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        for importer, imported in FORBIDDEN
        if within(module, importer) and within(target, imported)
    ]


def import_graph(*, top_level_only: bool) -> dict[str, set[str]]:
    """Each kvray module's imports of other kvray modules. A package importing its own
    submodules to re-export them is left out; what matters is a submodule that needs its
    package's __init__ while that is still running it, or two modules each other."""
    modules = sources()
    graph = {
        name: {target for target in imports_of(path, top_level_only=top_level_only) if target in modules}
        - {name}
        for name, path in modules.items()
    }
    return {
        name: {target for target in targets if not name.startswith(target + ".")}
        for name, targets in graph.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle found by a depth-first walk (each reported once, from where it closes)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_every_import_follows_the_data_flow() -> None:
    graph = {name: imports_of(path, top_level_only=False) - {name} for name, path in sources().items()}
    assert against_the_flow(graph) == []


def test_the_integrations_import_no_instrumentation_and_no_fault() -> None:
    graph = {name: imports_of(path, top_level_only=False) - {name} for name, path in sources().items()}
    assert forbidden(graph) == []


def test_no_module_imports_itself_back() -> None:
    assert cycles(import_graph(top_level_only=True)) == []


def test_no_cycle_hides_behind_a_deferred_import() -> None:
    # An import inside a function only moves a cycle to run time (the verbs transport's
    # connections and write modules once needed each other that way).
    graph = import_graph(top_level_only=False)
    assert cycles(graph) == []
    assert "kvray.transport.verbs.write" not in graph["kvray.transport.verbs.connections"]


#: Modules of plain values and arithmetic: they import no event loop, Ray or device library, and
#: of kvray only modules as pure.
PURE = {"kvray.agent.handoff.specs"}
IMPURE_LIBRARIES = {"asyncio", "ray", "torch"}


def stdlib_and_third_party_imports(path: Path) -> set[str]:
    """The top-level packages of everything a file imports that is not kvray's."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found - {"kvray"}


def test_pure_modules_import_nothing_that_waits_or_touches_a_device() -> None:
    modules = sources()
    for name in sorted(PURE):
        path = modules[name]
        assert stdlib_and_third_party_imports(path) & IMPURE_LIBRARIES == set(), name
        assert imports_of(path, top_level_only=False) - PURE - {name} == set(), name


def test_the_hand_off_imports_no_engine_integration_and_no_instrumentation() -> None:
    handoff = {name: path for name, path in sources().items() if name.startswith("kvray.agent.handoff")}
    assert "kvray.agent.handoff.specs" in handoff and "kvray.agent.handoff.facade" in handoff
    for name, path in handoff.items():
        imported = imports_of(path, top_level_only=False)
        assert not {
            target for target in imported if target.startswith(("kvray.integrations", "kvray.bench"))
        }, name


def test_the_checks_catch_what_they_look_for() -> None:
    assert against_the_flow({"kvray.plan": {"kvray.agent.push"}}) == [
        "kvray.plan (tier 6) imports kvray.agent.push (tier 10)"
    ]
    assert against_the_flow({"kvray.agent.push": {"kvray.plan"}}) == []
    assert forbidden({"kvray.integrations.vllm.connector": {"kvray.bench.handoff_log", "kvray.faults"}}) == [
        "kvray.integrations.vllm.connector imports kvray.bench.handoff_log "
        "(forbidden: kvray.integrations -> kvray.bench)",
        "kvray.integrations.vllm.connector imports kvray.faults "
        "(forbidden: kvray.integrations -> kvray.faults)",
    ]
    assert forbidden({"kvray.bench.handoff_log": {"kvray.integrations.vllm.connector"}}) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    with pytest.raises(AssertionError, match="no tier"):
        tier_of("elsewhere.module")
