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


# --------------------------------------------------------------------------------------------------
# benchmarks/: modules that import each other by plain name (``python benchmarks/bench.py`` puts their folder first
# on sys.path), and jodpo as the installed package, by its public names only
# --------------------------------------------------------------------------------------------------

BENCHMARKS = ROOT / "benchmarks"


def benchmark_modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(BENCHMARKS.glob("*.py"))}


def top_level_imports(source: str) -> set[str]:
    """The first component of every absolute import in ``source``, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def private_jodpo_names(source: str) -> list[str]:
    """jodpo's names with a leading underscore that ``source`` imports (``from jodpo.x import _y``, ``import jodpo._x``)
    or reads off a name it imported from jodpo (``ts._y`` after ``from jodpo import train_step as ts``)."""
    tree, bound, bad = ast.parse(source), set(), []
    private = lambda name: name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "jodpo":
                    bad += [a.name] * any(private(p) for p in a.name.split("."))
                    bound.add(a.asname or "jodpo")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "jodpo":
            for a in node.names:
                if any(private(p) for p in node.module.split(".") + [a.name]):
                    bad.append(f"{node.module}.{a.name}")
                bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and private(node.attr):
            bad.append(f"{node.value.id}.{node.attr}")
    return bad


def edits_sys_path(source: str) -> bool:
    """Whether ``source`` touches ``sys.path`` (or ``site.addsitedir``): benchmarks need neither."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "addsitedir":
            return True
    return False


def test_the_benchmark_checks_find_what_they_look_for():
    assert private_jodpo_names("from jodpo.program.loop import _rewards\nimport jodpo._x\n"
                               "from jodpo import train_step as ts\nts._single\njodpo.__version__\nts.jit_online_step\n"
                               ) == ["jodpo.program.loop._rewards", "jodpo._x", "ts._single"]
    assert private_jodpo_names("from jodpo.program.loop import sampled_rewards\nimport numpy as np\nnp._x\n") == []
    assert edits_sys_path("import sys\nsys.path.insert(0, 'x')") and edits_sys_path("from sys import path")
    assert not edits_sys_path("import sys\nsys.argv[1:]")


def test_benchmarks_import_in_no_cycle():
    modules = benchmark_modules()
    graph = {m: (top_level_imports(p.read_text()) & set(modules)) - {m} for m, p in modules.items()}
    assert graph["harness"] == set(), "the harness is shared by every benchmark and imports none of them"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in benchmarks/: " + " -> ".join(cycle)


def test_benchmarks_use_jodpos_public_names_and_leave_sys_path_alone():
    bad = {m: private_jodpo_names(p.read_text()) for m, p in benchmark_modules().items()}
    assert not any(bad.values()), f"private jodpo names in benchmarks/ (make them public in jodpo, documented): {bad}"
    edits = [m for m, p in benchmark_modules().items() if edits_sys_path(p.read_text())]
    assert not edits, f"benchmarks/ {edits} edit sys.path: run them as python benchmarks/NAME.py, import jodpo installed"


def test_benchmark_modules_shadow_nothing_importable():
    """The benchmarks' folder comes first on their sys.path, so a module named like the standard library's or an
    installed package's would hide it from every import, jodpo's and its dependencies' included."""
    import importlib.machinery
    import sys

    others = [p for p in sys.path if Path(p or ".").resolve() != BENCHMARKS]
    clash = {m for m in benchmark_modules() if m in sys.stdlib_module_names or m in sys.builtin_module_names
             or importlib.machinery.PathFinder.find_spec(m, others) is not None}
    assert not clash, f"benchmarks/ modules named like importable ones: {sorted(clash)}"
