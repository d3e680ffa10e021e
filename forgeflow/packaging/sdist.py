"""The pinned llama-cpp-python sdist: the source of the Qwen2 vocabulary and llama.cpp's converter.

Only ``models/ggml-vocab-qwen2.gguf`` (with its ``.inp``/``.out`` test vectors) and
``convert_hf_to_gguf.py`` with ``conversion/`` and ``gguf-py/`` are extracted, atomically, into
``cache_dir()/llama-cpp-python-<version>/``.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from forgeflow.common import llama_cpp_build, settings
from forgeflow.common.errors import InfraError, InputError
from forgeflow.common.fsutil import atomic_write_json, sha256_file

_VENDOR = "vendor/llama.cpp"
_MEMBER_FILES = (
    f"{_VENDOR}/models/ggml-vocab-qwen2.gguf",
    f"{_VENDOR}/models/ggml-vocab-qwen2.gguf.inp",
    f"{_VENDOR}/models/ggml-vocab-qwen2.gguf.out",
    f"{_VENDOR}/convert_hf_to_gguf.py",
)
_MEMBER_DIRS = (f"{_VENDOR}/conversion/", f"{_VENDOR}/gguf-py/")
_COMPLETE_MARKER = "forgeflow-sdist.json"


class SdistError(InfraError):
    """The pinned llama-cpp-python sdist could not be fetched or lacks a member forgeflow needs."""


def sdist_root() -> Path:
    """Return where the extracted sdist members live (exists only after :func:`ensure_llama_sdist`)."""
    return settings.cache_dir() / f"llama-cpp-python-{settings.LLAMA_CPP_PYTHON_VERSION}"


def download_sdist(version: str) -> Path:
    """Fetch the sdist tarball into ``cache_dir()/sdist`` with ``pip download`` (once).

    Raises:
        TransientInfraError: pip failed (index unreachable, timeout).
        SdistError: pip succeeded but no tarball for ``version`` appeared.
    """
    try:
        return llama_cpp_build.download_sdist(version)
    except InputError as exc:
        raise SdistError(str(exc)) from exc


def _wanted(member_path: str) -> bool:
    return member_path in _MEMBER_FILES or member_path.startswith(_MEMBER_DIRS)


def ensure_llama_sdist() -> Path:
    """Return the folder holding the needed members of the pinned sdist (its layout below the top directory).

    Raises:
        TransientInfraError: pip could not fetch the sdist.
        SdistError: the tarball lacks one of the members forgeflow needs.
    """
    root = sdist_root()
    if (root / _COMPLETE_MARKER).is_file():
        return root
    version = settings.LLAMA_CPP_PYTHON_VERSION
    tarball = download_sdist(version)
    prefix = f"llama_cpp_python-{version}/"
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
    try:
        with tarfile.open(tarball, "r:gz") as archive:
            members = []
            for member in archive.getmembers():
                if not member.name.startswith(prefix):
                    continue
                rel = member.name[len(prefix):]
                if _wanted(rel) and (member.isfile() or member.isdir()):
                    member.name = rel
                    members.append(member)
            archive.extractall(tmp, members=members, filter="data")
        missing = [m for m in _MEMBER_FILES if not (tmp / m).is_file()]
        missing += [d for d in _MEMBER_DIRS if not (tmp / d).is_dir()]
        if missing:
            raise SdistError(f"{tarball} lacks the members {missing}")
        atomic_write_json(
            tmp / _COMPLETE_MARKER,
            {"version": version, "sdist": tarball.name, "sdist_sha256": sha256_file(tarball)},
        )
        try:
            os.rename(tmp, root)
        except OSError:
            # Another process finished first (the target exists and is not empty): use its copy.
            if not (root / _COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def vocab_gguf_path() -> Path:
    """Path of llama.cpp's ``ggml-vocab-qwen2.gguf`` (vocabulary-only GGUF; ``.inp``/``.out``
    test vectors lie beside it). Calls :func:`ensure_llama_sdist`."""
    return ensure_llama_sdist() / _VENDOR / "models" / "ggml-vocab-qwen2.gguf"


def convert_script_path() -> Path:
    """Path of llama.cpp's ``convert_hf_to_gguf.py`` (its ``conversion/`` and ``gguf-py/`` lie
    beside it). Calls :func:`ensure_llama_sdist`."""
    return ensure_llama_sdist() / _VENDOR / "convert_hf_to_gguf.py"
