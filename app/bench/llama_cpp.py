"""llama.cpp for the benchmarks that compare against it (`bench compare`, `bench complete`): where
its binaries are, and `localbatch bench setup-llama-cpp`, which builds a pinned release for this
CPU into the user cache.

The build fetches llama.cpp's sources from GitHub: a network action, taken only at that explicit
command, as `localbatch pull` is for models. It needs cmake and a C++ compiler. The instruction
sets are chosen from this CPU's flags (GGML_NATIVE off), never AMX: some VMs list AMX and fault on
its first instruction. `--llama-cpp DIR` names an existing build instead."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

import platformdirs

from app.engine.types.errors import LocalbatchError

# llama.cpp release b11312: the llama.cpp that llama-cpp-python 0.3.36 vendors, the one the
# figures in docs/benchmarks.md were measured against.
LLAMA_CPP_TAG = "b11312"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
SOURCE_URL = f"https://github.com/ggml-org/llama.cpp/archive/{LLAMA_CPP_COMMIT}.tar.gz"
TARGETS = ("llama-batched-bench", "llama-server")
SETUP_HINT = "run `localbatch bench setup-llama-cpp` to build it, or pass --llama-cpp DIR (an existing build)"

# (the /proc/cpuinfo flag, the ggml option it turns on), in ggml's order.
ISA_OPTIONS = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
               ("avx512f", "GGML_AVX512"), ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512vbmi", "GGML_AVX512_VBMI"),
               ("avx512_bf16", "GGML_AVX512_BF16"))
NEVER_ON = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")

Log = Callable[[str], None]


def default_dir() -> Path:
    """Where `setup-llama-cpp` builds: the user cache, one folder per pinned release."""
    return Path(platformdirs.user_cache_dir("localbatch")) / "llama.cpp" / LLAMA_CPP_TAG


def isa_options(flags: Iterable[str]) -> list[str]:
    """cmake options for a CPU listing `flags`: each instruction set on where listed, AVX-512 parts
    only with AVX-512F, AMX always off."""
    have = set(flags)
    if "avx512f" not in have:
        have -= {f for f, _ in ISA_OPTIONS if f.startswith("avx512")}
    return (["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if flag in have else 'OFF'}" for flag, opt in ISA_OPTIONS]
            + [f"-D{opt}=OFF" for opt in NEVER_ON])


def configure_cmd(source: Path, build: Path, flags: Iterable[str]) -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", *isa_options(flags)]


def build_cmd(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", *TARGETS]


def binary(name: str, llama_cpp: str | Path | None = None) -> Path:
    """llama.cpp's `name` in `llama_cpp` (a build folder, its bin/ or a folder holding the binary;
    default: `setup-llama-cpp`'s build). Raises with what to run when it is not there."""
    base = Path(llama_cpp).expanduser() if llama_cpp else default_dir() / "build"
    for path in (base / "bin" / name, base / name, base / "build" / "bin" / name):
        if path.is_file():
            return path
    where = f"in --llama-cpp {base}" if llama_cpp else f"at {base / 'bin' / name}"
    raise LocalbatchError(f"no llama.cpp {name} {where}: {SETUP_HINT}")


def missing_tools() -> list[str]:
    """The build's tools this machine lacks."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    return missing


def fetch_sources(dest: Path, log: Log) -> Path:
    """llama.cpp at LLAMA_CPP_COMMIT from GitHub, unpacked under `dest`; returns the source folder."""
    log(f"downloading llama.cpp {LLAMA_CPP_TAG} ({LLAMA_CPP_COMMIT[:9]}) from {SOURCE_URL}")
    try:
        with urllib.request.urlopen(SOURCE_URL, timeout=60) as r:
            data = r.read()
    except OSError as e:
        raise LocalbatchError(f"could not download llama.cpp from {SOURCE_URL}: {e}; build it elsewhere "
                              "and pass --llama-cpp DIR") from None
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        top = {m.name.split("/", 1)[0] for m in tar.getmembers()}
        if top != {f"llama.cpp-{LLAMA_CPP_COMMIT}"}:
            raise LocalbatchError(f"{SOURCE_URL} did not hold llama.cpp at {LLAMA_CPP_COMMIT} (found {sorted(top)})")
        if any(m.name.startswith("/") or ".." in Path(m.name).parts for m in tar.getmembers()):
            raise LocalbatchError(f"{SOURCE_URL} holds paths outside its folder; not unpacked")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)
    return dest / top.pop()


def setup(where: Path, flags: Iterable[str], jobs: int, log: Log = print) -> Path:
    """Fetch and build the pinned llama.cpp into `where`; returns its bin/ folder."""
    missing = missing_tools()
    if missing:
        raise LocalbatchError(f"building llama.cpp needs {' and '.join(missing)}; install them, or pass "
                              "--llama-cpp DIR (an existing build) to the benchmark")
    where.mkdir(parents=True, exist_ok=True)
    source, build = where / "src", where / "build"
    if not (source / "CMakeLists.txt").is_file():
        unpacked = fetch_sources(where, log)
        shutil.rmtree(source, ignore_errors=True)
        unpacked.rename(source)
    for cmd in (configure_cmd(source, build, flags), build_cmd(build, jobs)):
        log("$ " + " ".join(cmd))
        if subprocess.run(cmd).returncode != 0:
            raise LocalbatchError(f"`{' '.join(cmd[:3])} ...` failed (its output is above); fix that and run "
                                  "`localbatch bench setup-llama-cpp` again")
    return build / "bin"
