"""The package's imports go one way: shared types at the bottom, then kernels, the file and text
readers, structured output, the runtime, the core, the API; above them the UI, the server and the
clients, which see the engine only through `EngineClient` and the shared types; on top the CLI
and the benchmarks, which put an engine together.

Every import in app/ is read with ast (inside functions and TYPE_CHECKING blocks too) and must
point to the importing module's own layer or one below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"

# Lowest first. A module belongs to the longest prefix listed.
LAYERS = [
    ("app.engine.types",),
    ("app.kernels",),
    ("app.engine.gguf", "app.engine.text"),
    ("app.engine.structured",),
    ("app.engine.runtime",),
    ("app.engine.core",),
    ("app.engine.api",),
    ("app.ui", "app.server", "app.clients", "app.testing", "app.tools"),
    ("app.cli", "app.bench"),  # the entry points put an engine together: anything below
]
# Package roots that only re-export lazily (`app/__init__`, `app/engine/__init__`, lazy_exports).
UNLAYERED = ("app", "app.engine", "app.lazy_exports")
# What the top layer may use of the engine besides the API and the types: the model store (list,
# pull and resolve model files; no engine state).
TOP_MAY_USE = ("app.engine.gguf.catalog", "app.engine.gguf.pull")
TOP = len(LAYERS) - 2  # the UI, the server, the clients


def layer_of(module: str) -> int | None:
    best, rank = "", None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    return rank


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return [(line, name) for line, name in out if name == "app" or name.startswith("app.")]


def violations() -> list[str]:
    found = []
    for path in sorted(APP.rglob("*.py")):
        source = module_name(path)
        if source in UNLAYERED:
            continue
        rank = layer_of(source)
        assert rank is not None, f"{source} is in no layer: add it to LAYERS"
        for line, target in imports(path):
            target_rank = layer_of(target)
            if target in UNLAYERED or target_rank is None:
                continue
            if rank == TOP and target_rank < TOP:  # past EngineClient
                allowed = target_rank in (0, TOP - 1) or target.startswith(TOP_MAY_USE)
                if not allowed:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {target} (past EngineClient)")
            elif target_rank > rank:
                found.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {target} (a layer above)")
    return found


def test_imports_only_go_down() -> None:
    assert violations() == []


def test_no_module_imports_another_ones_private_names() -> None:
    found = []
    for path in sorted(APP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("app."):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {', '.join(private)} from {node.module}")
    assert found == []


@pytest.mark.parametrize("module, rank", [
    ("app.engine.types.errors", 0), ("app.kernels.cpu_qgemm", 1), ("app.engine.gguf.loader", 2),
    ("app.engine.runtime.model_runner", 4), ("app.engine.core.scheduler", 5), ("app.ui.app", TOP),
])
def test_modules_land_in_their_layer(module: str, rank: int) -> None:
    assert layer_of(module) == rank
