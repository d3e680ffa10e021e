"""Atomic file writes and digests: temp file + fsync + ``os.replace`` + directory fsync, never a torn file."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import JsonValue

from forgeflow.common.errors import DiskFullError, InputError

JSONObject = dict[str, JsonValue]
"""A free-form JSON object (a JSONL row, a recorded lineage): string keys, JSON values (pydantic validates them)."""

_CHUNK_BYTES = 1 << 20
FILE_MODE = 0o644
"""Mode of files written by :func:`atomic_write_bytes` (readable by other users, like a plain write)."""

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""``errno`` values of a write that ran out of space (ENOSPC) or of the user's quota (EDQUOT)."""

NEARLY_FULL_BYTES = 1 << 20
"""Free space (bytes) under which :func:`looks_full` calls a filesystem full: a failed write fills
the disk up to the last block before ``ENOSPC``, so a tool that hides the errno (llama.cpp's
quantizer, a converter subprocess) leaves well under 1 MiB free."""


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes this process may still write where ``path`` lives (``f_bfree`` for root, else ``f_bavail``)."""
    target = Path(path).resolve()
    while not target.exists():
        target = target.parent
    stats = os.statvfs(target)
    blocks = stats.f_bfree if os.geteuid() == 0 else stats.f_bavail
    return blocks * stats.f_frsize


def looks_full(path: str | os.PathLike[str]) -> bool:
    """True if the filesystem holding ``path`` has under :data:`NEARLY_FULL_BYTES` free."""
    return free_bytes(path) < NEARLY_FULL_BYTES


def disk_full_error(path: str | os.PathLike[str], what: str, cause: str = "") -> DiskFullError:
    """A DiskFullError for ``path`` naming its filesystem and free bytes; ``what`` is read before the path."""
    target = Path(path)
    message = (
        f"no space left on the filesystem at {_mount_point(target.parent)} while {what} {target}: "
        f"{target} was not written and the partial file is removed "
        f"({free_bytes(target.parent)} bytes free when checked)"
    )
    return DiskFullError(errno.ENOSPC, message + (f" ({cause})" if cause else ""))


def raise_if_disk_full(exc: BaseException, path: str | os.PathLike[str], what: str) -> None:
    """Raise :func:`disk_full_error` (chained) if ``exc`` is an ENOSPC/EDQUOT OSError; else return."""
    if isinstance(exc, OSError) and not isinstance(exc, DiskFullError) and exc.errno in DISK_FULL_ERRNOS:
        raise disk_full_error(path, what, str(exc)) from exc


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and return the path.

    Raises:
        DiskFullError: out of space or quota (``path`` keeps its previous content).
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
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        raise_if_disk_full(exc, target, "writing")
        raise
    fsync_dir(target.parent)
    return target


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """``fsync`` a directory, so an entry in it survives a crash (POSIX: a file's fsync does not)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2
"""``SYNC_FILE_RANGE_WRITE`` of Linux ``<fcntl.h>``: start writeback, do not wait."""
_sync_file_range: Any = None


def start_writeback(fd: int, offset: int, n: int) -> bool:
    """Start writeback of ``n`` bytes of ``fd`` from ``offset`` (Linux ``sync_file_range``), not waiting.

    An advice only; False where unavailable or refused.
    """
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            func = ctypes.CDLL(None, use_errno=True).sync_file_range
            func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            func.restype = ctypes.c_int
            _sync_file_range = func
        except (AttributeError, OSError):  # not Linux/glibc: the final fsync does it all
            _sync_file_range = False
    if not _sync_file_range or n <= 0:
        return False
    return _sync_file_range(fd, offset, n, _SYNC_FILE_RANGE_WRITE) == 0


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
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (FileNotFoundError when missing)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_tree(root: str | os.PathLike[str]) -> str:
    """Hex sha256 over a directory: every file's relative path and content digest, sorted."""
    base = Path(root)
    entries = sorted(
        (p.relative_to(base).as_posix(), sha256_file(p)) for p in base.rglob("*") if p.is_file()
    )
    return sha256_json(entries)


SEMANTIC_KEY = "semantic_sha256"
"""Key under which a self-digesting JSON document embeds the digest of the rest of itself."""


def with_semantic_digest(document: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``document`` with ``semantic_sha256`` = sha256 of its canonical JSON without that key."""
    body = {k: v for k, v in document.items() if k != SEMANTIC_KEY}
    return {**body, SEMANTIC_KEY: sha256_json(body)}


def read_digested_json(path: str | os.PathLike[str], what: str, schema_version: int) -> dict[str, Any]:
    """Read a self-digesting JSON document (freeze manifest, derived set) and check it.

    Raises:
        InputError: missing or not JSON, another ``schema_version``, or an embedded ``semantic_sha256`` that does
            not match the content (both digests named).
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InputError(f"{what} {path} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("schema_version") != schema_version:
        found = document.get("schema_version") if isinstance(document, dict) else None
        raise InputError(f"{what} {path} has schema_version {found!r}; expected {schema_version}")
    embedded = document.get(SEMANTIC_KEY)
    recomputed = with_semantic_digest(document)[SEMANTIC_KEY]
    if embedded != recomputed:
        raise InputError(
            f"{what} {path} was altered: embedded semantic_sha256 {embedded}, content digest {recomputed}"
        )
    return document


def read_json_object(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The JSON object in the file ``path`` (InputError naming ``what`` when missing, invalid or no object)."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InputError(f"{what} {path} does not exist") from exc
    except OSError as exc:
        raise InputError(f"{what} {path} could not be read: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise InputError(f"{what} {path} is not a JSON object")
    return document


def read_jsonl_objects(path: str | os.PathLike[str], what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, object)`` per non-blank line (InputError: missing file, a line not an object)."""
    source = Path(path)
    if not source.is_file():
        raise InputError(f"{what} {source} does not exist" if not source.exists() else f"{what} {source} is not a file")
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {source} is not UTF-8 text: {exc.reason} at byte {exc.start}") from exc
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{source}:{number} is not JSON: {err}") from err
        if not isinstance(row, dict):
            raise InputError(f"{source}:{number} is not a JSON object")
        yield number, row


@contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive advisory ``flock`` on ``path`` while the block runs (released if the holder dies)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextmanager
def atomic_folder(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary sibling folder that replaces ``target`` on return (removed if the block raises)."""
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_output_file(target: str | os.PathLike[str], mode: int = FILE_MODE) -> Iterator[Path]:
    """Yield a temporary sibling path that replaces ``target`` with ``mode`` on return (removed on raise)."""
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, mode)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        tmp.unlink(missing_ok=True)
