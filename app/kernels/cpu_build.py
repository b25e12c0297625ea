"""Builds the C kernels of the CPU path (every `cpu_*.c` beside this file) once per machine into
one library in the user cache dir with the system C compiler, and loads it with ctypes.

The sources ship in the package; the build takes a few seconds at the first start, or ahead of it
with `localbatch doctor`. Without a compiler, or on a CPU without AVX2/FMA/F16C, `load` returns None
(with one warning) and the callers keep their torch paths. The library is built with -fopenmp: its
runtime is the libgomp torch has already loaded, so its threads are torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from app.kernels.cpu_info import cpu_flags  # also read as cpu_build.cpu_flags (device, doctor)

log = logging.getLogger(__name__)

# No FMA contraction: where a kernel replaces torch's separate multiplies and adds it must round
# the same way (explicit _mm256_fmadd_ps calls stay fused).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_CPU_FLAGS = ("avx2", "fma", "f16c")


@dataclass(frozen=True)
class KernelLibrary:
    """What became of the C kernels on this machine: `lib` None when they are off, and why."""

    lib: ctypes.CDLL | None
    reason: str  # "" when built; else one line naming what is missing
    path: Path | None = None
    compiler: str | None = None
    build_s: float = 0.0  # 0 when the cache already held it


@functools.lru_cache(maxsize=1)
def library() -> KernelLibrary:
    """Every `cpu_*.c` beside this module compiled into one shared library (cached per machine by
    the sources', compiler's and flags' hash) and loaded; built once per process at first use."""
    if not cpu_supports():
        missing = [f for f in _CPU_FLAGS if f not in cpu_flags()]
        return KernelLibrary(None, f"this CPU lacks {', '.join(missing) or 'x86 flags'} (the C kernels need AVX2, FMA, F16C)")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return KernelLibrary(None, "no C compiler found (install gcc or set CC)")
    sources = sorted(Path(__file__).parent.glob("cpu_*.[ch]"))
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sources) + " ".join([compiler, *FLAGS]).encode())
    path = _cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    start = time.perf_counter()
    try:
        built = not path.exists()
        if built:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            c_files = [str(f) for f in sources if f.suffix == ".c"]
            subprocess.run([compiler, *FLAGS, *c_files, "-o", str(tmp), "-lm"], check=True, capture_output=True,
                           timeout=300)
            os.replace(tmp, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        lines = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip().splitlines()
        detail = next((line for line in lines if "error" in line), lines[0] if lines else str(e))
        return KernelLibrary(None, f"{compiler} could not build them: {detail}", path, compiler)
    return KernelLibrary(lib, "", path, compiler, time.perf_counter() - start if built else 0.0)


def load(signatures: dict[str, list], restypes: dict[str, type] | None = None) -> ctypes.CDLL | None:
    """The kernel library with each function in `signatures` given its ctypes argument types and
    its return type from `restypes` (void if not there); None if it cannot be built here (logged
    once as a warning: the torch paths serve, about 3x slower)."""
    kernels = library()
    if kernels.lib is None:
        _warn_once(kernels.reason)
        return None
    for name, argtypes in signatures.items():
        fn = getattr(kernels.lib, name)
        fn.argtypes, fn.restype = argtypes, (restypes or {}).get(name)
    return kernels.lib


@functools.lru_cache(maxsize=1)
def _warn_once(reason: str) -> None:
    log.warning("the CPU C kernels are off: %s; the torch kernels serve instead (about 3x slower)", reason)


def cpu_supports() -> bool:
    """AVX2, FMA and F16C, as /proc/cpuinfo lists them (not Linux: no way to tell, so False)."""
    return all(flag in cpu_flags() for flag in _CPU_FLAGS)


def _cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("localbatch")) / "kernels"
