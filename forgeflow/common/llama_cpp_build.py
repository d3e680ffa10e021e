"""One compile of the pinned llama.cpp for both of its users: llama-cpp-python and ``llama-server``.

:func:`build` compiles the CMake tree of the llama-cpp-python sdist once with the server on and keeps the wheel
(:func:`wheel_dir`) and ``llama-server`` with its shared libraries, RPATH ``$ORIGIN`` (:func:`server_dir`).
Each result appears complete or not at all; ``<tag>`` (:func:`build_tag`) names every build option.

Why the hook: with llama.cpp's tools on, llama.cpp adds ``tools/mtmd`` itself, and llama-cpp-python's
``add_subdirectory(tools/mtmd)`` (``LLAVA_BUILD``) would add it twice, which CMake refuses. So ``LLAVA_BUILD``
is off and :data:`CMAKE_HOOK` (``CMAKE_PROJECT_llama_cpp_INCLUDE``) installs the tools' ``mtmd`` into the wheel.

Standard library only: ``scripts/setup.sh`` runs it before forgeflow's dependencies exist.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from forgeflow.common import settings
from forgeflow.common.errors import InfraError, ToolMissingError
from forgeflow.common.sdists import pip_download_sdist

SERVER_CMAKE_ARGS: tuple[str, ...] = (
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DCMAKE_BUILD_RPATH=$ORIGIN",
)
"""What the shared build adds to :data:`forgeflow.common.settings.LLAMA_CPP_CMAKE_ARGS`: llama.cpp's
server (offline: no web UI download, no OpenSSL), no tests/examples; ``$ORIGIN`` in every build RPATH, so
each file copied beside ``llama-server`` has an RPATH entry that :func:`build` can set to exactly ``$ORIGIN``."""

BUILD_TARGETS: tuple[str, ...] = ("llama", "ggml", "mtmd", "llama-server")
"""The CMake targets compiled (scikit-build-core's ``build.targets``): the wheel's libraries and the
server; llama.cpp's other tools (bench, perplexity, ...) are left out."""

WHEEL_EXCLUDE: tuple[str, ...] = ("bin/llama-server",)
"""llama.cpp's install rule would put ``llama-server`` into site-packages' ``bin/``: kept out of the wheel."""

CMAKE_HOOK = "cmake_language(DEFER CALL llama_cpp_python_install_target mtmd)\n"
"""Included at the end of llama-cpp-python's ``project(llama_cpp)``: once its CMakeLists has been read,
install llama.cpp's ``mtmd`` into ``llama_cpp/lib`` (see the module docstring)."""

BUILD_TIMEOUT_S = 3600
"""Limit of the whole build (configure + compile + wheel), seconds."""
_LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class BuildResult:
    """What :func:`build` left in the cache (compile times 0.0 when both were cached)."""

    wheel: Path
    server: Path
    compile_s: float  # wall seconds of the pip wheel step (configure + compile + install)
    compile_cpu_s: float = 0.0  # CPU seconds (user + system) of that step and its children


def _options() -> tuple[str, ...]:
    """Every option that changes the build, as text (CMake arguments, targets, exclusions, the hook)."""
    hook = hashlib.sha256(CMAKE_HOOK.encode()).hexdigest()[:12]
    return (*SERVER_CMAKE_ARGS, "targets=" + ";".join(BUILD_TARGETS), "exclude=" + ";".join(WHEEL_EXCLUDE),
            f"hook={hook}")


def build_tag() -> str:
    """12 hex naming the shared build's options (version, CMake args, targets, exclusions, hook)."""
    return settings.llama_cpp_build_tag(_options())


def wheel_dir() -> Path:
    """``cache_dir()/wheels/llama-cpp-python-<version>-<tag>``: where the wheel is kept."""
    return settings.cache_dir() / "wheels" / f"llama-cpp-python-{settings.LLAMA_CPP_PYTHON_VERSION}-{build_tag()}"


def server_dir() -> Path:
    """``cache_dir()/llama-server-<version>-<tag>``: ``bin/llama-server`` and its shared libraries."""
    return settings.cache_dir() / f"llama-server-{settings.LLAMA_CPP_PYTHON_VERSION}-{build_tag()}"


def log_path() -> Path:
    """The build log of the last :func:`build` (kept beside the results)."""
    return settings.cache_dir() / f"llama.cpp-{settings.LLAMA_CPP_PYTHON_VERSION}-{build_tag()}.build.log"


def cached_wheel() -> Path | None:
    """The kept wheel, or None."""
    found = sorted(wheel_dir().glob("llama_cpp_python-*.whl"))
    return found[0] if found else None


def cached_server() -> Path | None:
    """The kept ``llama-server``, or None."""
    binary = server_dir() / "bin" / "llama-server"
    return binary if binary.is_file() else None


def download_sdist(version: str) -> Path:
    """Fetch the llama-cpp-python sdist into ``cache_dir()/sdist`` with ``pip download`` (once).

    Raises:
        TransientInfraError: pip failed. InputError: no tarball for ``version`` appeared.
    """
    dest = settings.cache_dir() / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    if (dest / name).is_file():
        return dest / name
    with tempfile.TemporaryDirectory(dir=dest, prefix=".pip-download-") as tmp:
        got = pip_download_sdist(f"llama-cpp-python=={version}", name, Path(tmp))
        os.replace(got, dest / name)
    return dest / name


def build(jobs: int | None = None) -> BuildResult:
    """The wheel and ``llama-server`` of the shared build, compiling llama.cpp once when either is missing.

    Args:
        jobs: parallel compile jobs (default: ``$CMAKE_BUILD_PARALLEL_LEVEL``, else the CPU count).

    Raises:
        ToolMissingError: ``cmake`` or a C++ compiler is not on PATH.
        TransientInfraError: the sdist could not be downloaded.
        InfraError: the build failed, or ``llama-server`` does not start from its folder (log tail attached).
    """
    wheel, server = cached_wheel(), cached_server()
    if wheel and server:
        return BuildResult(wheel, server, 0.0, 0.0)
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ToolMissingError(f"building llama.cpp needs {tool!r} on PATH (Debian: cmake build-essential)")
    tarball = download_sdist(settings.LLAMA_CPP_PYTHON_VERSION)
    cache = settings.cache_dir()
    work = Path(tempfile.mkdtemp(dir=cache, prefix=f".llama.cpp-{build_tag()}."))
    try:
        started, cpu_before = time.monotonic(), _children_cpu_s()
        _compile(tarball, work, jobs)
        compile_s, compile_cpu_s = time.monotonic() - started, _children_cpu_s() - cpu_before
        _collect_server(work / "build" / "bin", work / "server" / "bin")
        _publish(work / "server", server_dir())
        _publish(work / "wheel", wheel_dir())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wheel, server = cached_wheel(), cached_server()
    assert wheel is not None and server is not None  # both published above
    return BuildResult(wheel, server, compile_s, compile_cpu_s)


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children and their descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _compile(tarball: Path, work: Path, jobs: int | None) -> None:
    """``pip wheel`` of the sdist with the server on, in ``work/build`` (kept for :func:`_collect_server`)."""
    hook = work / "forgeflow-hook.cmake"
    hook.write_text(CMAKE_HOOK)
    cmake_args = [*settings.LLAMA_CPP_CMAKE_ARGS, *SERVER_CMAKE_ARGS, f"-DCMAKE_PROJECT_llama_cpp_INCLUDE={hook}"]
    level = str(jobs or os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or os.cpu_count() or 1)
    env = {**os.environ, "CMAKE_ARGS": shlex.join(cmake_args), "CMAKE_BUILD_PARALLEL_LEVEL": level}
    argv = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
            "-w", str(work / "wheel"), f"--config-settings=build-dir={work / 'build'}",
            f"--config-settings=build.targets={';'.join(BUILD_TARGETS)}",
            f"--config-settings=wheel.exclude={';'.join(WHEEL_EXCLUDE)}", str(tarball)]
    log = log_path()
    with open(log, "wb") as out:
        out.write(f"CMAKE_ARGS={env['CMAKE_ARGS']}\n{shlex.join(argv)}\n".encode())
        out.flush()
        try:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=BUILD_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise InfraError(f"building llama.cpp took over {BUILD_TIMEOUT_S} s; log {log}") from exc
    if proc.returncode != 0:
        raise InfraError(f"pip wheel of llama-cpp-python failed with {proc.returncode}; log {log}:\n"
                         f"{log.read_text(errors='replace')[-_LOG_TAIL_CHARS:]}")


def _collect_server(built: Path, out: Path) -> None:
    """Copy ``llama-server`` and its libraries (RPATH ``$ORIGIN``) and check it starts from there."""
    out.mkdir(parents=True)
    names = ["llama-server", *sorted(p.name for p in built.iterdir() if ".so" in p.name)]
    for name in names:
        shutil.copy2(built / name, out / name, follow_symlinks=False)
    files = [str(out / n) for n in names if not (out / n).is_symlink()]
    script = "foreach(f ${FILES})\n  file(RPATH_SET FILE \"${f}\" NEW_RPATH \"$ORIGIN\")\nendforeach()\n"
    (out.parent / "rpath.cmake").write_text(script)
    _check(["cmake", f"-DFILES={';'.join(files)}", "-P", str(out.parent / "rpath.cmake")], "setting RPATH")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    _check([str(out / "llama-server"), "--version"], "llama-server --version", env=env)
    (out.parent / "rpath.cmake").unlink()


def _check(argv: list[str], what: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    if proc.returncode != 0:
        raise InfraError(f"{what} failed with {proc.returncode}: {(proc.stdout + proc.stderr)[-_LOG_TAIL_CHARS:]}")


def _publish(src: Path, final: Path) -> None:
    """Rename ``src`` to ``final`` (atomic); a complete ``final`` left by a concurrent build is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(src, final)
    except OSError:
        if not (final.is_dir() and any(final.iterdir())):
            raise
