"""Source distributions from the package index: ``pip download`` of one pinned sdist (no wheels)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from forgeflow.common.errors import InputError, TransientInfraError

PIP_DOWNLOAD_TIMEOUT_S = 600
"""Limit of one ``pip download``, seconds."""


def pip_download_sdist(requirement: str, filename: str, into: Path, timeout_s: float = PIP_DOWNLOAD_TIMEOUT_S) -> Path:
    """Download the sdist of ``requirement`` (``name==version``) into the existing folder ``into``.

    Only ``name`` is refused as a wheel (``--no-binary <name>``): with ``:all:`` pip compiled the build tools too.

    Returns:
        ``into / filename``.

    Raises:
        TransientInfraError: pip failed or timed out (index unreachable, 5xx).
        InputError: pip succeeded but left another file name (both named).
    """
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name,
           "--disable-pip-version-check", "--no-input", "-d", str(into), requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TransientInfraError(f"pip download {requirement} timed out after {timeout_s:g} s") from exc
    if proc.returncode != 0:
        raise TransientInfraError(f"pip download {requirement} failed (exit {proc.returncode}): "
                                  f"{proc.stderr.strip()[-2000:]}")
    got = into / filename
    if not got.is_file():
        raise InputError(f"pip download {requirement} saved {sorted(p.name for p in into.iterdir())}, "
                         f"expected {filename}")
    return got
