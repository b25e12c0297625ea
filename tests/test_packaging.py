"""The wheel: every module under app/, the Textual CSS and every chat template (the top-level
assets/ directory ships as app/assets), and an installed wheel reads its own copies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS = REPO_ROOT / "assets"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built offline from a copy of the sources, so no build/ or *.egg-info lands in the checkout
    (and no stale build/lib from an earlier build leaks into it)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("app", "assets"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(root / "dist"), str(src)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = (root / "dist").glob("localbatch-*.whl")
    return path


def wheel_names(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as zf:
        return set(zf.namelist())


def test_wheel_holds_assets(wheel):
    names = wheel_names(wheel)
    templates = sorted(p.name for p in (ASSETS / "chat_templates").glob("*.jinja"))
    assert templates  # gemma3, llama3, chatml, ...
    expected = {"app/assets/localbatch.tcss", *(f"app/assets/chat_templates/{t}" for t in templates)}
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith("assets/") for n in names)  # no top-level `assets` package


def test_wheel_holds_every_module(wheel):
    """pyproject lists the packages (app.assets comes from outside app/): one left out fails here."""
    names = wheel_names(wheel)
    modules = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "app").rglob("*.py")}
    assert modules <= names, sorted(modules - names)


def test_installed_wheel_reads_its_assets(wheel, tmp_path):
    """Installed into a fresh venv (dependencies from the running environment's site-packages) and
    run outside the checkout: ASSETS_DIR (which the TUI's CSS and the chat templates are read
    from) is the wheel's own app/assets."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    # The running environment's packages (a venv's, not the base interpreter's, which is all that
    # --system-site-packages would expose), after the new venv's own. Plain paths: the .pth files
    # in them (the editable install of this checkout) are not processed.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    running = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    (Path(purelib) / "running_env.pth").write_text("".join(f"{p}\n" for p in running))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = """
import json, sys
from pathlib import Path
import app
from app.ui.app import LocalbatchApp
site = Path(app.__file__).parent
assert site.parent.is_relative_to(Path(sys.prefix)), site
assert app.ASSETS_DIR == site / "assets", app.ASSETS_DIR
assert Path(LocalbatchApp.CSS_PATH) == site / "assets" / "localbatch.tcss" and Path(LocalbatchApp.CSS_PATH).is_file()
print(json.dumps(sorted(p.name for p in (app.ASSETS_DIR / "chat_templates").glob("*.jinja"))))
"""
    # -P: not even the current directory goes on sys.path; only the venv's app can be imported.
    run = subprocess.run([str(python), "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == sorted(p.name for p in (ASSETS / "chat_templates").glob("*.jinja"))
