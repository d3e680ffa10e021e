"""Install llama-cpp-python from forgeflow's shared llama.cpp build (run by scripts/setup.sh).

llama.cpp is compiled once per machine for both of its users (:mod:`forgeflow.common.llama_cpp_build`):
the pinned llama-cpp-python sdist built with ``CMAKE_ARGS`` = ``forgeflow.common.settings.LLAMA_CPP_CMAKE_ARGS``
plus llama.cpp's server; the wheel is kept in ``$FORGEFLOW_CACHE/wheels/llama-cpp-python-<version>-<tag>/``
and ``llama-server`` (with its shared libraries) in ``$FORGEFLOW_CACHE/llama-server-<version>-<tag>/``
(the tag names the options). pip's own wheel cache cannot be used for this: it keys a built wheel by
the sdist alone, so a wheel compiled earlier with other options (a native build that crashes on this
CPU) would be installed again. The installed distribution is replaced when it did not come from that
wheel (pip records the wheel's URL in ``direct_url.json``). Standard library only: it runs before
forgeflow's dependencies exist.

Usage: ``python3 scripts/llama_cpp_python.py [--build-only]`` (prints what it did and how long each part
took; ``--build-only`` compiles into the cache and installs nothing, so setup.sh can run it beside other
steps).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forgeflow.common import llama_cpp_build, settings  # noqa: E402  (standard library only, see above)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q"], check=True)


def installed_from() -> str | None:
    """The URL the installed llama-cpp-python came from (None: not installed, or from an index)."""
    try:
        text = importlib.metadata.distribution("llama_cpp_python").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    return json.loads(text).get("url") if text else None


def main(argv: list[str]) -> int:
    start = time.monotonic()
    if not (llama_cpp_build.cached_wheel() and llama_cpp_build.cached_server()):
        print(f"llama_cpp_python: compiling llama.cpp {settings.LLAMA_CPP_PYTHON_VERSION} once for llama-cpp-python "
              f"and llama-server (log {llama_cpp_build.log_path()})", flush=True)
    built = llama_cpp_build.build()
    if built.compile_s:
        print(f"llama_cpp_python: compiled in {built.compile_s:.0f} s ({built.compile_cpu_s:.0f} CPU-s): "
              f"{built.wheel.name}, {built.server}", flush=True)
    if "--build-only" in argv:
        return 0
    if installed_from() != built.wheel.as_uri():
        _pip("install", "--no-deps", "--force-reinstall", "--root-user-action=ignore", str(built.wheel))
        print(f"llama_cpp_python: installed {built.wheel.name} ({time.monotonic() - start:.0f} s)")
    else:
        print(f"llama_cpp_python: {built.wheel.name} already installed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
