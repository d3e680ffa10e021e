"""The shared llama.cpp build (one compile for llama-cpp-python and llama-server): its cache keys,
what is reused, what is refused. The real compile runs in tests/integration/test_llama_server.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeflow.common import llama_cpp_build, settings
from forgeflow.common.errors import InfraError, ToolMissingError


@pytest.fixture()
def cache(monkeypatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("FORGEFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_results(wheel: bool = True, server: bool = True) -> tuple[Path, Path]:
    w = llama_cpp_build.wheel_dir() / "llama_cpp_python-0.0-py3-none-linux_x86_64.whl"
    s = llama_cpp_build.server_dir() / "bin" / "llama-server"
    for path, wanted in ((w, wheel), (s, server)):
        if wanted:
            path.parent.mkdir(parents=True)
            path.write_text("cached")
    return w, s


def test_both_results_are_kept_under_one_tag_that_names_every_option(monkeypatch, cache: Path) -> None:
    """A build made with other options (CMake arguments, targets, wheel exclusions, the hook, version)
    is never taken for this one."""
    tag = llama_cpp_build.build_tag()
    version = settings.LLAMA_CPP_PYTHON_VERSION
    assert llama_cpp_build.wheel_dir() == cache / "wheels" / f"llama-cpp-python-{version}-{tag}"
    assert llama_cpp_build.server_dir() == cache / f"llama-server-{version}-{tag}"
    changes = [(settings, "LLAMA_CPP_CMAKE_ARGS", ("-DGGML_NATIVE=ON",)),
               (settings, "LLAMA_CPP_PYTHON_VERSION", "0.0.1"),
               (llama_cpp_build, "SERVER_CMAKE_ARGS", llama_cpp_build.SERVER_CMAKE_ARGS[:-1]),
               (llama_cpp_build, "BUILD_TARGETS", ("llama",)),
               (llama_cpp_build, "WHEEL_EXCLUDE", ()),
               (llama_cpp_build, "CMAKE_HOOK", "")]
    for module, name, value in changes:
        with monkeypatch.context() as patch:
            patch.setattr(module, name, value)
            assert llama_cpp_build.build_tag() != tag, name
    # the tag is not the old wheel-only or server-only one: caches of the two-compile era are not reused
    assert tag != settings.llama_cpp_build_tag()


def test_the_build_turns_the_server_on_and_keeps_mtmd_in_the_wheel() -> None:
    """llama.cpp's tools add tools/mtmd themselves, so llama-cpp-python's own copy (LLAVA_BUILD) is off
    and the hook installs llama.cpp's mtmd into llama_cpp/lib instead (llama_cpp.mtmd_cpp loads it)."""
    args = set(llama_cpp_build.SERVER_CMAKE_ARGS)
    assert {"-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAVA_BUILD=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DCMAKE_BUILD_RPATH=$ORIGIN"} <= args
    assert "llama_cpp_python_install_target mtmd" in llama_cpp_build.CMAKE_HOOK
    assert {"llama", "ggml", "mtmd", "llama-server"} <= set(llama_cpp_build.BUILD_TARGETS)


def test_a_cached_build_is_returned_without_compiling(monkeypatch, cache: Path) -> None:
    wheel, server = _fake_results()
    monkeypatch.setattr(llama_cpp_build, "_compile", lambda *a: pytest.fail("compiled although cached"))
    assert llama_cpp_build.build() == llama_cpp_build.BuildResult(wheel, server, 0.0, 0.0)


def test_a_missing_half_builds_again_and_keeps_the_other(monkeypatch, cache: Path) -> None:
    """Only the wheel cached (say, the server folder was deleted): one build fills in the server; the
    kept wheel is not replaced."""
    wheel, _ = _fake_results(server=False)
    monkeypatch.setattr(llama_cpp_build, "download_sdist", lambda version: cache / "sdist.tar.gz")

    def fake_compile(tarball: Path, work: Path, jobs: int | None) -> None:
        (work / "wheel").mkdir()
        (work / "wheel" / "llama_cpp_python-0.0-py3-none-linux_x86_64.whl").write_text("new")

    def fake_collect(built: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "llama-server").write_text("new")

    monkeypatch.setattr(llama_cpp_build, "_compile", fake_compile)
    monkeypatch.setattr(llama_cpp_build, "_collect_server", fake_collect)
    result = llama_cpp_build.build()
    assert result.wheel == wheel and wheel.read_text() == "cached"
    assert result.server.read_text() == "new" and result.server.parent.parent == llama_cpp_build.server_dir()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no work folder left


def test_a_missing_compiler_is_named(monkeypatch, cache: Path) -> None:
    import shutil

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "c++" else real(tool))
    with pytest.raises(ToolMissingError, match="'c\\+\\+'"):
        llama_cpp_build.build()


def test_a_failed_build_is_an_infra_error_with_its_log_and_publishes_nothing(cache: Path) -> None:
    """pip refuses a broken sdist: InfraError quoting the log's tail; no result, no work folder."""
    sdist = cache / "sdist" / f"llama_cpp_python-{settings.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(b"not a tarball")
    with pytest.raises(InfraError, match="pip wheel of llama-cpp-python failed") as info:
        llama_cpp_build.build(jobs=1)
    assert str(llama_cpp_build.log_path()) in str(info.value) and llama_cpp_build.log_path().is_file()
    assert llama_cpp_build.cached_wheel() is None and llama_cpp_build.cached_server() is None
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []
