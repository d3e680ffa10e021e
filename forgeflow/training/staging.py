"""Staging folders of bursts: written beside the adapter folder, renamed into place when published.

A :class:`StagingDir` (``.<name>.XXXX``) holds an owner lock (``fcntl.flock`` plus host, pid, boot id
and process start time), so the next burst removes a killed burst's leftover
(:func:`remove_dead_staging_dirs`) and never a live burst's folder.
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
    """Start time of process ``pid`` in clock ticks since boot (field 22 of ``/proc/<pid>/stat``,
    proc(5)), None when the process does not exist (or /proc is missing)."""
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
    """Second check after the lock: is the recorded owner possibly still running?

    True for an owner on another host (its process cannot be inspected from here) and for a
    process of this host and boot that runs with the recorded start time (a reused pid has another
    one). False for a record of an earlier boot, a gone process, or no readable record (then the
    free lock is the only evidence, and it suffices: a live owner writes its record before the lock
    file gets its name).
    """
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
    """A temporary sibling ``.<name>.XXXX`` of an adapter folder that a burst writes into before
    the rename, owned by the running burst.

    On enter: ``tempfile.mkdtemp`` (mode set to 0755), then the owner lock :data:`STAGING_LOCK_FILE`
    is created under a temporary name, ``fcntl.flock``-ed (exclusive), filled with the owner record
    (host, pid, boot id, process start time) and renamed into place, so a lock file that exists is
    always held while its owner lives. The kernel drops a ``flock`` when its holder dies (kill -9
    included), which is what lets :func:`remove_dead_staging_dirs` tell a dead burst's leftover from
    a live burst's folder. On exit: the folder (if not published) is removed and the lock released.

    Use: ``with StagingDir(out_dir) as tmp: ...`` (``tmp`` is the folder's path).
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
    """Remove the staging folders ``.<out_dir name>.*`` beside ``out_dir`` whose owner is provably dead.

    A folder is removed only when its :data:`STAGING_LOCK_FILE` exists, an exclusive non-blocking
    ``flock`` on it succeeds (no live process holds it: the kernel released the dead owner's lock),
    and the owner record does not name a process that is running on this host and boot with the
    recorded start time. The lock is held while the folder is removed. A folder without a lock file
    (being created, being published, or written by a forgeflow without owner locks) and a folder whose
    lock is held (a live burst, in this process or another) are never touched.

    Returns:
        The removed folders, sorted.
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
