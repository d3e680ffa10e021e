"""Atomic file writes and digests.

Every file forgeflow records is written with :func:`atomic_write_bytes` (temp file in the same
directory + fsync + ``os.replace`` + directory fsync), so a crash leaves either the old or the new
file, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

_CHUNK_BYTES = 1 << 20
FILE_MODE = 0o644
"""Mode of files written by :func:`atomic_write_bytes` (readable by other users, like a plain write)."""


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and return the path.

    Raises:
        OSError: the directory is not writable.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp creates 0600; results are meant to be shared
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, UTF-8 (the form digests are taken over)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented, key-sorted JSON atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data`` (64 characters)."""
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of the canonical JSON form of ``obj`` (a semantic digest)."""
    return sha256_bytes(canonical_json(obj))


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_tree(root: str | os.PathLike[str]) -> str:
    """Hex sha256 over a directory: every file's relative path and content digest, sorted.

    Used for model/adapter folders whose identity is their files, not one file.
    """
    base = Path(root)
    entries = sorted(
        (p.relative_to(base).as_posix(), sha256_file(p)) for p in base.rglob("*") if p.is_file()
    )
    return sha256_json(entries)
