"""pyproject.toml declares what jodpo imports: every runtime dependency is imported by the package (none declared
and unused), each optional extra is imported by the package, and the test extra holds what the tests (and the
optional features they test) import."""
import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# declared by jodpo though jodpo imports them not itself: a dependency needs them on a path of jodpo's and declares
# them optional
NEEDED_BY_DEPENDENCIES = {"jinja2": "transformers renders chat templates (chat datasets) with it"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _guarded(tree) -> set[int]:
    """ids of the import nodes inside a ``try`` that catches ImportError: optional, used when there (torch for a
    .bin checkpoint the user has)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(isinstance(h.type, ast.Name) and h.type.id in (
                "ImportError", "ModuleNotFoundError") for h in node.handlers):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imported_distributions(paths, optional: bool = True) -> set[str]:
    """The distributions providing the top-level modules imported anywhere in ``paths`` (python files); without
    ``optional``, not those imported only where an ImportError is caught."""
    modules = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        skip = set() if optional else _guarded(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    providers = importlib.metadata.packages_distributions()
    return {_name(d) for m in modules - set(sys.stdlib_module_names) for d in providers.get(m, ())}


def test_every_declared_dependency_is_imported():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    package = _imported_distributions((ROOT / "jodpo").rglob("*.py"))
    unused = runtime - package - set(NEEDED_BY_DEPENDENCIES)
    assert not unused, f"declared in pyproject.toml, imported nowhere in jodpo/: {sorted(unused)}"
    extras = project["optional-dependencies"]
    for extra in set(extras) - {"test"}:  # jodpo's optional features (wandb, plot)
        unused = {_name(r) for r in extras[extra]} - package
        assert not unused, f"the {extra} extra declares what jodpo/ never imports: {sorted(unused)}"
    # the test extra: what the tests import, and the optional features' packages, so that their tests run
    test_extra = {_name(r) for r in extras["test"]}
    unused = test_extra - _imported_distributions((ROOT / "tests").rglob("*.py")) - package - {"pytest-xdist"}
    assert not unused, f"in the test extra, imported by no test: {sorted(unused)}"


def test_every_distribution_jodpo_imports_is_declared_and_installed_with_it():
    """A fresh install (only the runtime dependencies) has what jodpo's own code imports; optional features' packages
    are in their extras. The installed metadata (``importlib.metadata.requires``) says the same as pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    optional = {_name(r) for extra, reqs in project["optional-dependencies"].items() if extra != "test" for r in reqs}
    missing = _imported_distributions((ROOT / "jodpo").rglob("*.py"), optional=False) - runtime - optional - {"jodpo"}
    assert not missing, f"jodpo/ imports what pyproject.toml does not declare: {sorted(missing)}"
    installed = {_name(r) for r in importlib.metadata.requires("jodpo") if "extra ==" not in r}
    assert installed == runtime, "the installed jodpo's metadata is stale: reinstall (bash scripts/env.sh does)"
