"""Staging folders of bursts, owner-locked (``fcntl.flock`` plus host, pid, boot id and start time), so
the next burst removes a killed burst's leftover and never a live burst's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

STAGING_LOCK_FILE = ".forgeflow-staging.lock"
"""The owner lock inside a staging folder: ``flock``-ed by the burst that made the folder for as
long as the burst runs, and holding its owner record (:func:`_owner_record`) as JSON."""


def _boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``), None where the file is missing."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start_ticks(pid: int) -> int | None:
    """Start ticks since boot of ``pid`` (field 22 of ``/proc/<pid>/stat``, proc(5)); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # fields after "(comm)" start at field 3


def _owner_record() -> dict[str, Any]:
    """Who owns a staging folder: host, pid, boot id and the process' start time (ticks)."""
    import socket

    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "boot_id": _boot_id(),
            "start_ticks": _process_start_ticks(pid), "created_at": datetime.now(timezone.utc).isoformat()}


def _owner_alive(record: Mapping[str, Any]) -> bool:
    """Might the recorded owner still run? (another host's, or a live pid with the recorded start time)"""
    import socket

    host = record.get("host")
    if not host:
        return False
    if host != socket.gethostname():
        return True
    boot = _boot_id()
    if boot is None or record.get("boot_id") != boot:
        return False
    pid, ticks = record.get("pid"), record.get("start_ticks")
    now = _process_start_ticks(pid) if isinstance(pid, int) else None
    return now is not None and (ticks is None or now == ticks)


class StagingDir:
    """A temporary sibling ``.<name>.XXXX`` of an adapter folder, owned by the running burst: its lock file is
    ``flock``-ed before it gets its name, and the kernel drops the lock when the owner dies (kill -9 too).
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.path: Path | None = None
        self._fd: int | None = None

    def __enter__(self) -> Path:
        import fcntl

        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(dir=self.out_dir.parent, prefix=f".{self.out_dir.name}."))
        os.chmod(path, 0o755)
        pending = path / (STAGING_LOCK_FILE + ".tmp")
        fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # O_CLOEXEC: not inherited
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps(_owner_record()).encode())
            os.fsync(fd)
            os.rename(pending, path / STAGING_LOCK_FILE)
        except BaseException:
            os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        self.path, self._fd = path, fd
        return path

    def __exit__(self, *exc: Any) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)  # a published folder was renamed away already
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def remove_dead_staging_dirs(out_dir: Path) -> list[Path]:
    """Remove the staging folders ``.<out_dir name>.*`` whose owner is provably dead (lock file present, free
    ``flock``, no live owner); returns them sorted.
    """
    import fcntl

    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return []
    removed = []
    for folder in sorted(out_dir.parent.glob(f".{out_dir.name}.*")):
        lock = folder / STAGING_LOCK_FILE
        if not folder.is_dir() or folder.is_symlink():
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # no owner lock: not provably dead
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # held: a live burst's folder
            try:
                record = json.loads(lock.read_text(encoding="utf-8") or "{}")
            except (OSError, ValueError):
                record = {}
            if _owner_alive(record):
                continue  # lock free but the owner runs (e.g. flock unsupported there): keep it
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed
