"""Install llama-cpp-python built with forgeflow's llama.cpp options (run by scripts/setup.sh).

The wheel is compiled once per machine with ``CMAKE_ARGS`` set to
``forgeflow.common.settings.LLAMA_CPP_CMAKE_ARGS`` and kept in
``$FORGEFLOW_CACHE/wheels/llama-cpp-python-<version>-<tag>/`` (the tag names the options). pip's own
wheel cache cannot be used for this: it keys a built wheel by the sdist alone, so a wheel compiled
earlier with other options (a native build that crashes on this CPU) would be installed again. The
installed distribution is replaced when it did not come from that wheel (pip records the wheel's
URL in ``direct_url.json``). Standard library only: it runs before forgeflow's dependencies exist.

Usage: ``python3 scripts/llama_cpp_python.py`` (prints what it did and how long it took).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = runpy.run_path(str(ROOT / "forgeflow" / "common" / "settings.py"))
VERSION: str = SETTINGS["LLAMA_CPP_PYTHON_VERSION"]
CMAKE_ARGS: tuple[str, ...] = SETTINGS["LLAMA_CPP_CMAKE_ARGS"]


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q"], check=True, env=env)


def wheel() -> Path:
    """The cached wheel, compiled first when missing (built in a temporary sibling, then renamed)."""
    folder = SETTINGS["cache_dir"]() / "wheels" / f"llama-cpp-python-{VERSION}-{SETTINGS['llama_cpp_build_tag']()}"
    found = sorted(folder.glob("llama_cpp_python-*.whl"))
    if found:
        return found[0]
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        env = {**os.environ, "CMAKE_ARGS": " ".join(CMAKE_ARGS),
               "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))}
        print(f"llama_cpp_python: compiling llama-cpp-python {VERSION} with CMAKE_ARGS={env['CMAKE_ARGS']!r} "
              "(once per machine)", flush=True)
        _pip("wheel", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python", "-w", str(work),
             f"llama-cpp-python=={VERSION}", env=env)
        os.rename(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return sorted(folder.glob("llama_cpp_python-*.whl"))[0]


def installed_from() -> str | None:
    """The URL the installed llama-cpp-python came from (None: not installed, or from an index)."""
    try:
        text = importlib.metadata.distribution("llama_cpp_python").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    return json.loads(text).get("url") if text else None


def main() -> int:
    start = time.monotonic()
    built = wheel()
    if installed_from() != built.as_uri():
        _pip("install", "--no-deps", "--force-reinstall", "--root-user-action=ignore", str(built))
        print(f"llama_cpp_python: installed {built.name} ({time.monotonic() - start:.0f} s)")
    else:
        print(f"llama_cpp_python: {built.name} already installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
