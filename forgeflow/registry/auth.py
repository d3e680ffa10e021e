"""Registry credentials for skopeo: a temporary containers auth file, never a command line."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pydantic import SecretStr

from forgeflow.common.errors import InputError

AUTHFILE_MODE = 0o600
"""Permissions of the auth file: read/write for its owner only."""

REDACTED = "***"
"""What a secret is replaced with in scrubbed text."""

_ADDRESS = re.compile(r"[A-Za-z0-9.-]+(?::\d{1,5})?(?:/[A-Za-z0-9._/-]+)?")


def _plain(secret: str | SecretStr) -> str:
    return secret.get_secret_value() if isinstance(secret, SecretStr) else secret


def auth_json(entries: Mapping[str, tuple[str, str | SecretStr]]) -> dict[str, dict[str, dict[str, str]]]:
    """The containers-auth.json document for ``entries``: ``{"auths": {address: {"auth": base64("user:password")}}}``.

    Raises:
        InputError: a bad address, an empty username or one containing ``:``, or an empty password (the
            address named, never the password).
    """
    auths: dict[str, dict[str, str]] = {}
    for address, (username, password) in entries.items():
        if not _ADDRESS.fullmatch(address or ""):
            raise InputError(f"registry address {address!r} is not host[:port][/path]")
        if not username or ":" in username:
            raise InputError(f"username for {address} must be non-empty and contain no ':'")
        if not _plain(password):
            raise InputError(f"password for {address} is empty")
        token = base64.b64encode(f"{username}:{_plain(password)}".encode()).decode("ascii")
        auths[address] = {"auth": token}
    return {"auths": auths}


@contextmanager
def authfile(entries: Mapping[str, tuple[str, str | SecretStr]]) -> Iterator[Path]:
    """Write a temporary containers-auth.json (mode 600, in a 700 folder) and yield its path; both are removed
    when the ``with`` block ends, also on an exception.

    Raises:
        InputError: bad entries (see :func:`auth_json`), raised before anything is written.
    """
    document = json.dumps(auth_json(entries)).encode()
    folder = Path(tempfile.mkdtemp(prefix="forgeflow-auth-"))  # mkdtemp: mode 700
    try:
        path = folder / "auth.json"
        # Create with 600 from the start (no window in which the file is world-readable).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, AUTHFILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(document)
            handle.flush()
            os.fsync(handle.fileno())
        if stat.S_IMODE(path.stat().st_mode) != AUTHFILE_MODE:  # pragma: no cover - umask only narrows
            os.chmod(path, AUTHFILE_MODE)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def secrets_of(path: Path) -> list[str]:
    """Every secret string an auth file holds: each ``auth`` token, its decoded ``user:password``
    and the password alone (longest first, for :func:`scrub`).

    Returns:
        The secrets; empty if the file is missing or unreadable (nothing to scrub then).
    """
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    found: set[str] = set()
    for entry in (document.get("auths") or {}).values():
        token = entry.get("auth") if isinstance(entry, dict) else None
        if not token:
            continue
        found.add(token)
        try:
            decoded = base64.b64decode(token).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            continue
        found.add(decoded)
        password = decoded.split(":", 1)[1] if ":" in decoded else ""
        if password:
            found.add(password)
    return sorted(found, key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """Replace every occurrence of each secret (empty ones ignored) in ``text`` with ``***``."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
