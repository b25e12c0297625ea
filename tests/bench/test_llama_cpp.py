"""`localbatch bench setup-llama-cpp`: the instruction sets chosen from the CPU's flags (never AMX),
the cmake command lines, and the message when llama.cpp is missing. Nothing is downloaded or built."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bench import llama_cpp
from app.engine.types.errors import LocalbatchError

AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
SAPPHIRE_RAPIDS_VM = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512vbmi",
                                  "amx_bf16", "amx_int8", "amx_tile"}


def options(flags: set[str]) -> dict[str, str]:
    return dict(o.removeprefix("-D").split("=") for o in llama_cpp.isa_options(flags))


def test_an_avx2_machine_gets_avx2_and_no_avx512():
    o = options(AVX2_ONLY)
    assert o["GGML_NATIVE"] == "OFF"
    assert all(o[k] == "ON" for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C"))
    assert all(o[k] == "OFF" for k in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI"))


def test_avx512_vnni_is_used_and_amx_never_even_where_listed():
    o = options(SAPPHIRE_RAPIDS_VM)
    assert all(o[k] == "ON" for k in ("GGML_AVX2", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"))
    assert all(o[k] == "OFF" for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    assert not any("AMX" in opt and opt.endswith("=ON") for opt in llama_cpp.isa_options(SAPPHIRE_RAPIDS_VM))


def test_avx512_parts_need_avx512f():
    assert options(AVX2_ONLY | {"avx512_vnni"})["GGML_AVX512_VNNI"] == "OFF"


def test_the_build_commands_name_the_pinned_sources_and_targets(tmp_path):
    configure = llama_cpp.configure_cmd(tmp_path / "src", tmp_path / "build", AVX2_ONLY)
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    assert "-DCMAKE_BUILD_TYPE=Release" in configure and "-DGGML_NATIVE=OFF" in configure
    build = llama_cpp.build_cmd(tmp_path / "build", 2)
    assert build[:3] == ["cmake", "--build", str(tmp_path / "build")] and "-j" in build
    assert build[build.index("--target") + 1:] == ["llama-batched-bench", "llama-server"]
    assert len(llama_cpp.LLAMA_CPP_COMMIT) == 40 and llama_cpp.LLAMA_CPP_COMMIT in llama_cpp.SOURCE_URL
    assert llama_cpp.SOURCE_URL.startswith("https://github.com/ggml-org/llama.cpp/")
    assert llama_cpp.LLAMA_CPP_TAG in str(llama_cpp.default_dir())


def test_a_missing_build_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "default_dir", lambda: tmp_path / "cache")
    with pytest.raises(LocalbatchError) as e:
        llama_cpp.binary("llama-batched-bench")
    message = str(e.value)
    assert "localbatch bench setup-llama-cpp" in message and "--llama-cpp DIR" in message
    assert "shared" not in message and "\n" not in message
    with pytest.raises(LocalbatchError, match="--llama-cpp"):
        llama_cpp.binary("llama-server", tmp_path / "elsewhere")


@pytest.mark.parametrize("layout", ["bin", "", "build/bin"])
def test_an_existing_build_is_found_in_its_usual_layouts(tmp_path, layout):
    folder = tmp_path / layout if layout else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "llama-server").write_text("")
    assert llama_cpp.binary("llama-server", tmp_path) == folder / "llama-server"


def test_setup_without_cmake_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: None)
    monkeypatch.setattr(llama_cpp, "fetch_sources", lambda *a: pytest.fail("nothing is downloaded"))
    with pytest.raises(LocalbatchError, match="cmake") as e:
        llama_cpp.setup(tmp_path, AVX2_ONLY, 1, log=lambda line: None)
    assert "--llama-cpp DIR" in str(e.value)


def test_setup_runs_configure_then_build_on_fetched_sources(tmp_path, monkeypatch):
    ran = []

    def fetched(dest: Path, log) -> Path:  # noqa: ANN001
        src = dest / "llama.cpp-x"
        src.mkdir()
        (src / "CMakeLists.txt").write_text("")
        return src

    monkeypatch.setattr(llama_cpp, "missing_tools", lambda: [])
    monkeypatch.setattr(llama_cpp, "fetch_sources", fetched)
    monkeypatch.setattr(llama_cpp.subprocess, "run", lambda cmd: ran.append(cmd) or type("R", (), {"returncode": 0}))
    assert llama_cpp.setup(tmp_path, SAPPHIRE_RAPIDS_VM, 2, log=lambda line: None) == tmp_path / "build" / "bin"
    assert [cmd[1] for cmd in ran] == ["-S", "--build"] and ran[0][2] == str(tmp_path / "src")
    assert "-DGGML_AMX_INT8=OFF" in ran[0]


def test_compare_and_complete_check_for_llama_cpp_before_anything_runs(tmp_path, monkeypatch, capsys):
    from app.cli import main

    monkeypatch.setattr(llama_cpp, "default_dir", lambda: tmp_path)
    for argv in (["bench", "compare"], ["bench", "complete", "--compare-llama-server"],
                 ["bench", "compare", "--llama-cpp", str(tmp_path / "nowhere")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "setup-llama-cpp" in err and "Traceback" not in err
