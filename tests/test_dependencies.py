"""What `appliance/` imports is installed by the base install: no test-only package."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported_modules() -> dict[str, set[str]]:
    """Returns each top-level module imported anywhere in appliance/, with the files importing it."""
    found: dict[str, set[str]] = {}
    for path in (REPO / "appliance").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(REPO)))
    return found


def normalized(requirement: str) -> str:
    name = re.split(r"[\[=<>!~; ]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def base_distributions() -> set[str]:
    """Returns the distributions the base install asks for (dependencies and the backend extras)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return {normalized(r) for r in [*project["dependencies"], *extras.get("cpu", []), *extras.get("cuda", [])]}


def menubar_extra() -> set[str]:
    """Returns the menubar extra's distributions (rumps: macOS only, imported only by
    appliance/menubar/app.py, which `omlx menubar` loads behind an ImportError check)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {normalized(r) for r in project["optional-dependencies"].get("menubar", [])}


def test_appliance_imports_only_runtime_dependencies():
    dists_of = packages_distributions()
    base = base_distributions()
    missing = {}
    for module, files in imported_modules().items():
        if module == "appliance" or module in sys.stdlib_module_names:
            continue
        if normalized(module) in menubar_extra():
            assert files == {"appliance/menubar/app.py"}, f"{module} is imported outside the menu bar: {files}"
            continue
        dists = {normalized(d) for d in dists_of.get(module, [])}
        if not dists & base:
            missing[module] = sorted(files)
    assert not missing, f"imported by appliance/ but not a runtime dependency in pyproject.toml: {missing}"


def test_test_extra_is_not_needed_by_the_package():
    """The check above has teeth: it sees the test-only packages the suite itself uses."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    test_only = {normalized(r) for r in project["optional-dependencies"]["test"]} - base_distributions()
    assert "pytest" in test_only
    assert "pytest" not in imported_modules()
