"""Every third-party module that app/, tests/ and benchmarks/ import is declared in pyproject.toml
(dependencies or an extra), so a package installed by hand cannot hide a missing install step."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("app", "tests", "benchmarks", "tools")
FIRST_PARTY = {"app", "tests"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _normalize(re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0])


def declared_distributions() -> set[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {_requirement_name(s) for s in specs}


def imported_modules() -> dict[str, set[str]]:
    """Top-level module -> the files importing it (absolute imports only; a script's
    siblings are first party)."""
    found: dict[str, set[str]] = {}
    for folder in SOURCE_DIRS:
        for path in (REPO_ROOT / folder).rglob("*.py"):
            siblings = {p.stem for p in path.parent.glob("*.py")}
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in FIRST_PARTY or top in siblings or top in sys.stdlib_module_names:
                        continue
                    found.setdefault(top, set()).add(path.relative_to(REPO_ROOT).as_posix())
    return found


def test_every_import_is_declared():
    declared = declared_distributions()
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, files in imported_modules().items():
        dists = {_normalize(d) for d in providers.get(module, [])} or {_normalize(module)}
        if not dists & declared:
            missing[module] = sorted(files)[:3]
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_check_sees_imports():
    """Guards the scan itself: it finds the known third-party imports and no first-party ones."""
    modules = imported_modules()
    assert {"torch", "textual", "gguf", "pytest"} <= modules.keys()
    assert not FIRST_PARTY & modules.keys()
