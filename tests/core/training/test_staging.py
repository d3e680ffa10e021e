"""Staging folders of bursts (``forgeflow.training.burst.StagingDir``) and the removal of dead bursts'
leftovers (``remove_dead_staging_dirs``), with real processes, real ``flock`` locks and real
``/proc`` records; no training (tests/resilience/test_burst_kill.py kills a training burst)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from forgeflow.training.staging import (
    STAGING_LOCK_FILE,
    StagingDir,
    remove_dead_staging_dirs,
)

# a process that makes a staging folder and dies without leaving the ``with`` block (as kill -9 would)
DIE_INSIDE = ("import os, sys; from pathlib import Path; from forgeflow.training.staging import StagingDir; "
              "s = StagingDir(Path(sys.argv[1])); p = s.__enter__(); (p / 'weights.bin').write_bytes(b'x' * 10); "
              "print(p, flush=True); os._exit(9)")


def _dead_leftover(out_dir: Path) -> Path:
    done = subprocess.run([sys.executable, "-c", DIE_INSIDE, str(out_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 9, done.stderr
    return Path(done.stdout.strip())


def test_live_staging_folder_is_kept_and_a_dead_owners_is_removed(tmp_path: Path) -> None:
    out_dir = tmp_path / "adapter"
    leftover = _dead_leftover(out_dir)
    assert leftover.parent == tmp_path and leftover.name.startswith(".adapter.") and (leftover / "weights.bin").exists()
    with StagingDir(out_dir) as live:
        record = json.loads((live / STAGING_LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["boot_id"] and record["start_ticks"] > 0
        # this process holds the live lock; the dead child's lock was released by the kernel
        assert remove_dead_staging_dirs(out_dir) == [leftover]
        assert live.is_dir() and not leftover.exists()
        assert remove_dead_staging_dirs(out_dir) == []
    assert not live.exists()  # an unpublished staging folder goes with its burst


def test_folders_whose_owner_cannot_be_proven_dead_are_never_removed(tmp_path: Path) -> None:
    out_dir = tmp_path / "adapter"
    unlocked = tmp_path / ".adapter.nolock"  # no owner lock (e.g. left by an older forgeflow): kept
    unlocked.mkdir()
    alive = _dead_leftover(out_dir)  # lock free, but the record says this running process owns it
    mine = json.loads((alive / STAGING_LOCK_FILE).read_text())
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    ticks = int(stat[stat.rindex(")") + 2:].split()[19])
    (alive / STAGING_LOCK_FILE).write_text(json.dumps({**mine, "pid": os.getpid(), "start_ticks": ticks}))
    other_host = _dead_leftover(out_dir)  # another machine's burst: its process cannot be checked here
    (other_host / STAGING_LOCK_FILE).write_text(json.dumps({**mine, "host": "some-other-host"}))
    earlier_boot = _dead_leftover(out_dir)  # same host, earlier boot: its owner is gone
    (earlier_boot / STAGING_LOCK_FILE).write_text(json.dumps({**mine, "boot_id": "0" * 32}))
    reused_pid = _dead_leftover(out_dir)  # a running pid with another start time: a reused pid
    (reused_pid / STAGING_LOCK_FILE).write_text(json.dumps({**mine, "pid": os.getpid(), "start_ticks": ticks + 1}))

    assert remove_dead_staging_dirs(out_dir) == sorted([earlier_boot, reused_pid])
    assert unlocked.is_dir() and alive.is_dir() and other_host.is_dir()
    assert remove_dead_staging_dirs(tmp_path / "missing" / "adapter") == []
