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


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imported_distributions(paths) -> set[str]:
    """The distributions providing the top-level modules imported anywhere in ``paths`` (python files)."""
    modules = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
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
    unused = runtime - package
    assert not unused, f"declared in pyproject.toml, imported nowhere in jodpo/: {sorted(unused)}"
    extras = project["optional-dependencies"]
    for extra in set(extras) - {"test"}:  # jodpo's optional features (wandb, plot)
        unused = {_name(r) for r in extras[extra]} - package
        assert not unused, f"the {extra} extra declares what jodpo/ never imports: {sorted(unused)}"
    # the test extra: what the tests import, and the optional features' packages, so that their tests run
    test_extra = {_name(r) for r in extras["test"]}
    unused = test_extra - _imported_distributions((ROOT / "tests").rglob("*.py")) - package - {"pytest-xdist"}
    assert not unused, f"in the test extra, imported by no test: {sorted(unused)}"
