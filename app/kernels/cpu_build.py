"""Builds the C kernels of the CPU path (`cpu_*.c` beside this file) once per machine into the
user cache dir with the system C compiler, and loads them with ctypes.

The sources ship in the package; a build takes about a second at the first start. Without a
compiler, or on a CPU without AVX2/FMA/F16C, `load` returns None and the callers keep their torch
paths. The libraries are built with -fopenmp: their runtime is the libgomp torch has already
loaded, so their threads are torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

# No FMA contraction: where a kernel replaces torch's separate multiplies and adds it must round
# the same way (explicit _mm256_fmadd_ps calls stay fused).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_CPU_FLAGS = ("avx2", "fma", "f16c")


def load(source_name: str, signatures: dict[str, list], restypes: dict[str, type] | None = None
         ) -> ctypes.CDLL | None:
    """`source_name` (a C file beside this module) built and loaded, with each function in
    `signatures` given its ctypes argument types and its return type from `restypes` (void if not
    there); None if it cannot be built here."""
    if not cpu_supports():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: the CPU C kernels (%s) are off", source_name)
        return None
    source = Path(__file__).with_name(source_name)
    # What it may include: the shared header, and (cpu_forward.c) the other kernels' sources.
    includes = b"".join(f.read_bytes() for f in sorted(source.parent.glob("cpu_*.[ch]")) if f != source)
    digest = hashlib.sha256(source.read_bytes() + includes + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{source.stem}-{digest}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            subprocess.run([compiler, *FLAGS, str(source), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace")[:500]
        log.warning("could not build the CPU C kernels %s (%s %s); the torch path serves instead", source_name, e,
                    detail)
        return None
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, (restypes or {}).get(name)
    return lib


def cpu_supports() -> bool:
    """AVX2, FMA and F16C, as /proc/cpuinfo lists them (not Linux: no way to tell, so False)."""
    return all(flag in cpu_flags() for flag in _CPU_FLAGS)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The x86 feature flags /proc/cpuinfo lists; empty where it has none (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def _cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("localbatch")) / "kernels"
