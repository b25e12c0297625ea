"""No class in app/ui/ over `MAX_METHODS` methods: a widget is a view, the chat's logic lives in the
Textual-free session model (app/ui/session/). Run as a script it prints every class's count and the
modules' lines: `python tests/ui/test_class_size.py`."""

from __future__ import annotations

import ast
from pathlib import Path

UI = Path(__file__).resolve().parents[2] / "app" / "ui"
MAX_METHODS = 25


def method_counts(root: Path = UI) -> dict[str, int]:
    """'module.py:Class' -> the functions defined in its body (properties and dunders included)."""
    counts = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                counts[f"{path.relative_to(root)}:{node.name}"] = len(methods)
    return counts


def module_lines(root: Path = UI) -> dict[str, int]:
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}


def test_no_ui_class_over_the_limit() -> None:
    over = {name: n for name, n in method_counts().items() if n > MAX_METHODS}
    assert not over, f"classes over {MAX_METHODS} methods (move logic into app/ui/session/ or a helper): {over}"


def test_the_counter_counts_a_class_body_only(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "class A:\n    x = 1\n    def f(self):\n        def inner(): pass\n    async def g(self): pass\n"
        "    @property\n    def p(self): return 1\n    class B:\n        def h(self): pass\n"
    )
    assert method_counts(tmp_path) == {"m.py:A": 3, "m.py:B": 1}


if __name__ == "__main__":
    counts = method_counts()
    print("| class | methods |\n|---|---|")
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if n >= 15:
            print(f"| {name} | {n} |")
    print("\n| module | lines |\n|---|---|")
    for name, n in module_lines().items():
        print(f"| {name} | {n} |")
