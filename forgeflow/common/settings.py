"""Where forgeflow keeps its state, and the environment its external tools need.

* ``FORGEFLOW_HOME`` (default ``./.forgeflow``): the store, demo outputs, registry storage.
* ``FORGEFLOW_CACHE`` (default ``~/.cache/forgeflow``): machine-wide caches that outlive a clone.
* ``FORGEFLOW_STORE_URL`` (default ``sqlite:///$FORGEFLOW_HOME/store.db``): any SQLAlchemy URL.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout root (``forgeflow`` is installed editable; ``infra/`` lives beside it)."""

INFRA_DIR = REPO_ROOT / "infra"
CONTAINERS_CONF = INFRA_DIR / "containers.conf"
REGISTRIES_CONF = INFRA_DIR / "registries.conf"
DATA_DIR = Path(__file__).resolve().parents[1] / "data"

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The pinned llama-cpp-python release: its sdist ships the Qwen2 vocabulary and the converter."""

LLAMA_CPP_CMAKE_ARGS: tuple[str, ...] = ("-DGGML_NATIVE=OFF",)
"""CMake options of every llama.cpp build forgeflow makes (the one shared by llama-cpp-python and the
CPU ``llama-server``, :mod:`forgeflow.common.llama_cpp_build`, and the CUDA ``llama-server``'s): a
portable build (on x86-64 ggml's default instruction set, AVX2 + FMA + F16C + BMI2), never
``-march=native``. A native build on a Xeon guest whose CPU reports AMX but whose hypervisor does
not enable the tile state compiles ggml's AMX kernels, and the first matrix multiplication dies
with a general protection fault at ``ldtilecfg`` (``dmesg``: ``traps: ... general protection
fault ... in libggml-cpu.so``), taking the model server down with it."""


def llama_cpp_build_tag(extra_cmake_args: tuple[str, ...] = ()) -> str:
    """12 hex of the sha256 of the pinned version and CMake args (pip's wheel cache keys by sdist alone)."""
    text = " ".join((LLAMA_CPP_PYTHON_VERSION, *LLAMA_CPP_CMAKE_ARGS, *extra_cmake_args))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def home_path() -> Path:
    """``$FORGEFLOW_HOME`` resolved, without creating it (a mistyped home leaves no empty folder)."""
    return Path(os.environ.get("FORGEFLOW_HOME", ".forgeflow")).resolve()


def home_dir() -> Path:
    """Return ``$FORGEFLOW_HOME`` (created if missing)."""
    path = home_path()
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """Return ``$FORGEFLOW_CACHE`` (created if missing)."""
    path = Path(os.environ.get("FORGEFLOW_CACHE", Path.home() / ".cache" / "forgeflow")).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def store_url() -> str:
    """``$FORGEFLOW_STORE_URL``, else ``sqlite:///$FORGEFLOW_HOME/store.db``; creates nothing."""
    return os.environ.get("FORGEFLOW_STORE_URL", f"sqlite:///{home_path() / 'store.db'}")


def container_env() -> dict[str, str]:
    """Podman/skopeo environment: runc and lowered ulimits, loopback registries insecure (user's values win)."""
    return {
        "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF)),
        "CONTAINERS_REGISTRIES_CONF": os.environ.get(
            "CONTAINERS_REGISTRIES_CONF", str(REGISTRIES_CONF)
        ),
    }


def apply_container_env() -> None:
    """Export :func:`container_env` into ``os.environ`` (for tools that spawn podman themselves)."""
    os.environ.update(container_env())


def tool_env() -> dict[str, str]:
    """A full environment for subprocesses: ``os.environ`` plus :func:`container_env`."""
    env = dict(os.environ)
    env.update(container_env())
    return env
