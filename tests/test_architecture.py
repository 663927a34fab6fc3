"""The layering of docs/architecture.md, read from the code: every ``import`` of jodpo's modules (inside functions
too), and the rules the layers keep. A new module goes in a layer by where it lives (``LAYER_OF``); an import
that breaks a rule fails here with the edge that breaks it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jodpo"

# The layers, lowest first; a module may import its own layer and the layers before it.
LAYERS = ("errors", "models", "algorithm", "parallel", "program", "commands")
COMMANDS = {"jodpo.train", "jodpo.evaluate", "jodpo.generate", "jodpo.plot", "jodpo.assets"}


def layer_of(module: str) -> str:
    """The layer of a module of jodpo, by its place in the package."""
    if module == "jodpo.errors":
        return "errors"
    if module == "jodpo" or module in COMMANDS or module.startswith("jodpo.configs"):
        return "commands"  # the package's face re-exports the functional API; recipes sit above everything
    for package, layer in (("jodpo.models", "models"), ("jodpo.parallel", "parallel"),
                           ("jodpo.program", "program"), ("jodpo.tasks", "program")):
        if module == package or module.startswith(package + "."):
            return layer
    return "algorithm"  # the modules at the top of the package that are not commands


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def jodpo_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The jodpo modules ``path`` imports, anywhere in it (a function's body included). ``from jodpo.x import y`` is
    an edge to ``jodpo.x.y`` when that is a module, else to ``jodpo.x``."""
    out = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "jodpo"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "jodpo":
                continue
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if m in known}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = jodpo_modules()
    return {m: imports(p, set(modules)) - {m} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles(graph):
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_each_layer_imports_only_the_layers_before_it(graph):
    # jodpo/__init__ imports its submodules' names, so every submodule's import of jodpo.x passes through it: the
    # face is exempt as a target (its own imports are checked: it is the commands layer).
    bad = [f"{m} ({layer_of(m)}) imports {n} ({layer_of(n)})" for m, targets in graph.items() for n in sorted(targets)
           if n != "jodpo" and LAYERS.index(layer_of(n)) > LAYERS.index(layer_of(m))]
    assert not bad, "imports against the layering of docs/architecture.md:\n" + "\n".join(bad)


def test_errors_is_a_leaf_and_the_layers_are_all_in_use(graph):
    assert graph["jodpo.errors"] == set()
    assert {layer_of(m) for m in graph} == set(LAYERS)


def test_models_hold_one_module_per_family():
    families = {p.stem for p in (PACKAGE / "models" / "families").glob("*.py")} - {"__init__"}
    from jodpo.models.families import FAMILIES
    assert families == {f.module for f in FAMILIES.values()}, "each family module registers one Family"


def test_test_files_import_helpers_not_each_other():
    """Shared test code lives in helper modules (tests/*.py not named test_*), never in another test file."""
    bad = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            bad += [f"{path.name} imports {n}" for n in names if n.startswith("tests." + "test_")]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ("from tests." + "test_") in node.value:
                bad.append(f"{path.name} runs code that imports from another test file")
    assert not bad, "\n".join(bad)


def test_no_module_is_named_like_the_standard_library():
    import sys

    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    assert not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)
