"""Group commit (:mod:`forgeflow.ledger.group_commit`): trials recorded by many threads share transactions, each
caller returns only once its own row is committed, so a process killed at any moment has every trial it
acknowledged in the store; a failed write is every one of its callers' error, and the next write starts afresh."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from forgeflow.common.errors import StoreUnavailableError
from forgeflow.ledger.group_commit import GroupCommit
from forgeflow.ledger.store import Store

_CHILD = r"""
import sys, threading
from datetime import UTC, datetime
from forgeflow.ledger.group_commit import GroupCommit
from forgeflow.ledger.records import TrialRecord
from forgeflow.ledger.store import Store

store = Store(sys.argv[1])
store.upgrade()
writer = GroupCommit(store.record_trials)
lock = threading.Lock()

def run(n):
    for k in range(100_000):
        trial_id = f"t{n}.{k}"
        writer.record(TrialRecord(trial_id=trial_id, instance_id=f"i{k % 50}", kind="agent", reward=1.0,
                                  job_id="crash", created_at=datetime(2026, 12, 7, tzinfo=UTC)))
        with lock:  # acknowledged: record() returned
            print(trial_id, flush=True)

for n in range(4):
    threading.Thread(target=run, args=(n,), daemon=True).start()
threading.Event().wait()
"""


def test_a_process_killed_while_four_threads_record_keeps_every_trial_it_acknowledged(tmp_path: Path) -> None:
    """SIGKILL after 400 acknowledgements (no atexit, no flush): each acknowledged trial is in the store, and the
    writes were shared (fewer transactions than trials, read back from the rows' ``updated_at`` stamps: one per
    batch)."""
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url], stdout=subprocess.PIPE, text=True)
    acknowledged = []
    assert child.stdout is not None
    for line in child.stdout:
        acknowledged.append(line.strip())
        if len(acknowledged) >= 400:
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    assert child.returncode == -signal.SIGKILL
    store = Store(url)
    stored = {t.trial_id: t for t in store.trials_for(job_id="crash")}
    missing = [trial_id for trial_id in acknowledged if trial_id not in stored]
    assert missing == [], f"{len(missing)} acknowledged trials lost by the kill: {missing[:5]}"
    with store.engine.connect() as connection:
        transactions = connection.exec_driver_sql("SELECT COUNT(DISTINCT updated_at) FROM trials").scalar()
        assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 1, "NORMAL: no fsync per commit"
    assert transactions < len(stored), "no two trials shared a transaction"
    store.dispose()


def test_a_failed_write_is_the_error_of_each_of_its_callers_and_the_next_write_starts_afresh() -> None:
    """Eight threads record while the store is down: every one of them gets the store's error (none returns as
    if recorded); once it is back, the same writer records again. ``max_batch`` bounds a transaction."""
    down = threading.Event()
    down.set()
    written: list[list[int]] = []
    entered = threading.Barrier(8)

    def write(items: list[int]) -> None:
        if down.is_set():
            raise StoreUnavailableError("store down")
        written.append(list(items))

    writer = GroupCommit(write, max_batch=3)
    outcomes: dict[int, str] = {}

    def record(n: int) -> None:
        entered.wait()
        try:
            writer.record(n)
            outcomes[n] = "recorded"
        except StoreUnavailableError as exc:
            outcomes[n] = str(exc)

    threads = [threading.Thread(target=record, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == dict.fromkeys(range(8), "store down") and written == []
    down.clear()
    threads = [threading.Thread(target=record, args=(n,)) for n in range(8, 16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == {**dict.fromkeys(range(8), "store down"), **dict.fromkeys(range(8, 16), "recorded")}
    assert sorted(n for batch in written for n in batch) == list(range(8, 16))
    assert max(len(batch) for batch in written) <= 3 and writer.items_written == 8
    with pytest.raises(ValueError, match="max_batch 0"):
        GroupCommit(write, max_batch=0)
