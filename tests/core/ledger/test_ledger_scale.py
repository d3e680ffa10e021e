"""The ledger at the team's scale (issue 34): migrations safe from many threads and processes, batched trial
writes, and user-facing reads bounded by what they show.

* A module-scoped SQLite store of 100,000 trials (49 jobs, 3,000 tasks) filled with the product's batched writes
  (:func:`benchmarks.scale_ledger.fill`, a few seconds): every ``forgeflow`` read a user makes on it runs
  in-process while every SQL statement and every trial model it builds are counted; each statement on
  ``trials`` is planned with SQLite's ``EXPLAIN QUERY PLAN`` (https://www.sqlite.org/eqp.html) and must use an
  index (a range SEARCH, or a SCAN of a covering index for the whole-ledger counts), and no read builds more
  trial models than the jobs it shows hold.
* The store's aggregate reads give the same answers on SQLite and PostgreSQL (``store`` fixture:
  tests/pgfixtures.py), equal to counting the trials one by one.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import Engine, event
from typer.testing import CliRunner

from benchmarks.scale_ledger import fill, job_id
from forgeflow.ledger.records import TrialRecord
from forgeflow.ledger.store import Store, head_revision
from forgeflow.ledger.tables import Trial
from tests.helpers import store_revision

TRIALS = 100_000


def test_upgrade_from_eight_threads_and_three_processes_at_once_all_succeed(tmp_path: Path) -> None:
    """Alembic's command API is not thread-safe and SQLite runs DDL outside a transaction: before the lock,
    8 threads x 20 upgrades of one fresh store failed every call (``table alembic_version already exists``,
    the store left with an empty ``alembic_version``), and one of 4 processes failed."""
    url = f"sqlite:///{tmp_path / 'threads.db'}"
    errors: list[BaseException] = []

    def upgrade_twenty_times() -> None:
        for _ in range(20):
            store = Store(url)
            try:
                store.upgrade()
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)
            finally:
                store.dispose()

    threads = [threading.Thread(target=upgrade_twenty_times) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert store_revision(Store(url)) == head_revision()

    other = f"sqlite:///{tmp_path / 'processes.db'}"
    code = f"from forgeflow.ledger.store import Store; Store({other!r}).upgrade()"
    children = [subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) for _ in range(3)]
    failures = [child.communicate()[1] for child in children if child.wait() != 0]
    assert failures == []
    assert store_revision(Store(other)) == head_revision()


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A SQLite store of :data:`TRIALS` trials (and its URL) filled once for the module."""
    path = tmp_path_factory.mktemp("ledger-scale") / "store.db"
    store = Store(f"sqlite:///{path}")
    store.upgrade()
    out = fill(store, TRIALS)
    store.void_trials([f"{job_id(5)}.repo05__bench-00005.5"], "bench: a void trial is never counted")
    store.dispose()
    return {**out, "path": path, "url": f"sqlite:///{path}"}


READS = {
    "job list": ["trials"],
    "job list json": ["trials", "--json"],
    "unknown job": ["trials", "--job", "canary-07-00000000007x"],
    "job page": ["trials", "--job", job_id(5)],
    "job page json": ["trials", "--job", job_id(5), "--json", "--limit", "20", "--offset", "40"],
    "merged page": ["trials", "--job", job_id(5), "--merged", "--json"],
    "compare": ["compare", job_id(5), job_id(6), "--json"],
    "compare typo": ["compare", job_id(5), "canary-6"],
    "status": ["status", "--json"],
    "lineage": ["lineage", f"{13:064x}", "--json", "--no-verify"],
}
"""Each user-facing read and its ``forgeflow`` command line."""


def _plan(path: Path, statement: str, parameters: object) -> list[str]:
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [row[3] for row in connection.execute("EXPLAIN QUERY PLAN " + statement, parameters or ())]
    finally:
        connection.close()


def test_every_user_facing_read_uses_an_index_and_loads_only_what_it_shows(filled: dict, monkeypatch) -> None:
    """Before issue 34 the job list and an unknown job id loaded every trial as a model (104 s and 56 s, 5.3 GB
    at a million trials), ``trials --job`` every trial of the job and every supervision event."""
    from deployments.cli import app
    from forgeflow.ledger import trials_ledger

    monkeypatch.setenv("FORGEFLOW_STORE_URL", filled["url"])
    statements: list[tuple[str, object]] = []
    loaded = Counter()

    def on_execute(conn, cursor, statement, parameters, context, executemany) -> None:
        statements.append((statement, parameters))

    def on_load(target, context) -> None:
        loaded["trials"] += 1

    class CountedTrialRecord(TrialRecord):  # every trial record a read builds
        def model_post_init(self, context: object) -> None:
            loaded["trials"] += 1

    monkeypatch.setattr(trials_ledger, "TrialRecord", CountedTrialRecord)
    event.listen(Engine, "before_cursor_execute", on_execute)
    event.listen(Trial, "load", on_load)  # and every ORM trial, were a read to load them so
    outputs: dict[str, str] = {}
    per_job = TRIALS // 49 + 1
    try:
        for name, args in READS.items():
            statements.clear()
            loaded.clear()
            result = CliRunner().invoke(app, args)
            outputs[name] = result.output
            assert result.exit_code == (2 if "typo" in name or "unknown" in name else 0), (name, result.output)
            bound = {"compare": 2 * per_job, "merged page": per_job}.get(name, 50)
            assert loaded["trials"] <= bound, f"{name}: {loaded['trials']} trial models built (bound {bound})"
            on_trials = [(s, p) for s, p in statements if re.search(r"\btrials\b", s)]
            for statement, parameters in on_trials:
                for line in _plan(filled["path"], statement, parameters):
                    if re.match(r"(SCAN|SEARCH) (trials|t)\b", line):
                        assert line.startswith("SEARCH") or "COVERING INDEX" in line, (name, line, statement)
    finally:
        event.remove(Engine, "before_cursor_execute", on_execute)
        event.remove(Trial, "load", on_load)
    lines = outputs["job list"].splitlines()
    assert len(lines) == 49 and lines[0].split()[0] == "canary-02-000000000002"
    assert re.search(rf"{job_id(5)}\s+2040 trials \(reward 1: \d+, reward 0: \d+, exceptions: 204\)",
                     outputs["job list"]), "one void trial of 2,041 is not counted"
    assert "closest: canary-07-000000000007" in outputs["unknown job"]
    assert "(49 jobs with trials: `forgeflow trials` lists them)" in outputs["unknown job"]
    assert "1-50 of 2040" in outputs["job page"] and "1990 more trial(s) after these (of 2040): --offset 50" in \
        " ".join(outputs["job page"].split())
    assert "per repository: repo00 69, repo01 68" in " ".join(outputs["job page"].split())
    assert "job 'canary-6' has no trials" in outputs["compare typo"]


def test_scoped_reads_at_100k_use_an_index_and_build_one_record_per_row_shown(filled: dict, monkeypatch) -> None:
    """The reads compare and curate make beside the CLI's (issue 34): a job's latest trial per instance (picked
    in SQL: 3,000 records at a million trials, not the job's 20,000), its trial kinds, task rows and image
    digests of the ids asked for (before: ``task_verdicts`` and ``accepted_for_freeze`` read every task row and
    every image of the store). Each statement is planned: no SCAN of ``trials``, ``task_instances`` or ``images``."""
    from forgeflow.ledger import trials_ledger

    store = Store(filled["url"])
    statements: list[tuple[str, object]] = []
    built = Counter()

    class CountedTrialRecord(TrialRecord):
        def model_post_init(self, context: object) -> None:
            built["trials"] += 1

    def on_execute(conn, cursor, statement, parameters, context, executemany) -> None:
        statements.append((statement, parameters))

    monkeypatch.setattr(trials_ledger, "TrialRecord", CountedTrialRecord)
    event.listen(store.engine, "before_cursor_execute", on_execute)
    try:
        latest = store.latest_job_trials(job_id(5))
        assert built["trials"] == len(latest) == 2040, "one record per instance, nothing else built"
        kinds = (store.job_trial_kinds(job_id(5)), store.job_trial_kinds(job_id(0)), store.job_trial_kinds("nope"))
        wanted = [f"repo{n % 30:02d}__bench-{n:05d}" for n in (7, 3, 2999)] + ["unknown__1"]
        rows = store.tasks_by_id(wanted)
        accepted = store.tasks_by_id(wanted, status="rejected")
        digests = store.image_digests(["nowhere/image:1"])
    finally:
        event.remove(store.engine, "before_cursor_execute", on_execute)
    for statement, parameters in statements:
        for line in _plan(filled["path"], statement, parameters):
            assert not re.match(r"SCAN (trials|task_instances|images)\b", line), (line, statement)
    assert kinds == (["agent"], ["nop", "oracle"], [])
    assert list(rows) == sorted(wanted[:3]) and accepted == {} and digests == {}
    everything = store.trials_for(job_id=job_id(5))
    last = {}
    for trial in everything:  # what merged_job kept from trials_for: the last of each instance wins
        last[trial.instance_id] = trial
    assert latest == [last[i] for i in sorted(last)]
    store.dispose()


def _expected(store: Store) -> dict:
    """The aggregates counted one trial at a time from :meth:`~forgeflow.ledger.store.Store.trials_for`."""
    per_job: dict = {}
    for trial in store.trials_for():
        counts = per_job.setdefault(trial.job_id, Counter())
        counts["trials"] += 1
        if trial.exception_type is not None:
            counts["exceptions"] += 1
        else:
            counts["reward_1" if trial.reward >= 1 else "reward_0"] += 1
    return per_job


def test_aggregate_reads_equal_counting_one_by_one_on_sqlite_and_postgresql(store: Store) -> None:
    fill(store, 700, tasks=60, jobs=7, chunk=150)
    store.record_trials([TrialRecord(trial_id="loose", instance_id="nowhere__1", kind="nop", reward=0.0)])
    store.void_trials([f"{job_id(3)}.repo03__bench-00003.3"], "a void trial is never counted")
    expected = _expected(store)
    summaries = store.job_summaries()
    assert [s.job_id for s in summaries] == [*sorted(j for j in expected if j), None]
    for summary in summaries:
        assert summary.model_dump(exclude={"job_id"}) == {"trials": 0, "reward_1": 0, "reward_0": 0, "exceptions": 0,
                                                          **expected[summary.job_id]}
    assert store.job_ids() == sorted(j for j in expected if j)
    assert store.has_trials(job_id(3)) and not store.has_trials("canary-3")
    assert store.job_verdict_counts(job_id(3)).trials == 99
    assert store.job_repository_counts(job_id(3)) == dict(sorted(Counter(
        t.instance_id.split("__")[0] for t in store.trials_for(job_id=job_id(3))).items()))
    everything = store.trials_for(job_id=job_id(4))
    pages = [store.job_trial_page(job_id(4), limit=30, offset=offset) for offset in range(0, 100, 30)]
    assert [t.trial_id for page in pages for t in page] == [t.trial_id for t in everything]
    assert [len(page) for page in pages] == [30, 30, 30, 10] and store.job_verdict_counts(job_id(4)).trials == 100
    # the latest trial of each instance, a tie on created_at broken by trial id, a void trial never standing
    tied = everything[-1]  # the job's newest trial: the latest of its instance
    store.record_trials([tied.model_copy(update={"trial_id": tied.trial_id + "~b", "reward": 1.0,
                                                 "exception_type": None, "submission": None}),
                         tied.model_copy(update={"trial_id": tied.trial_id + "~c", "submission": None})])
    store.void_trials([tied.trial_id + "~c"], "never stands")
    last: dict = {}
    for trial in store.trials_for(job_id=job_id(4)):
        last[trial.instance_id] = trial
    latest = store.latest_job_trials(job_id(4))
    assert [t.trial_id for t in latest] == [last[i].trial_id for i in sorted(last)]
    assert last[tied.instance_id].trial_id == tied.trial_id + "~b" and latest == [last[i] for i in sorted(last)]
    assert store.job_trial_kinds(job_id(0)) == ["nop", "oracle"] and store.job_trial_kinds("nope") == []
    ids = [f"repo{n % 30:02d}__bench-{n:05d}" for n in (59, 1, 0)]
    assert list(store.tasks_by_id([*ids, "nowhere__1", ids[0]])) == sorted(ids)
    assert store.tasks_by_id(ids, status="rejected") == {}


def test_a_batch_with_one_trial_twice_keeps_the_last_and_a_recorded_submission(store: Store) -> None:
    """The batched upsert groups rows by their columns: the same trial id twice in one batch ends as the last
    row says (as two upserts one after the other), and a row without a submission keeps the one recorded."""
    first = TrialRecord(trial_id="t1", instance_id="i1", kind="agent", reward=0.0, submission="diff a")
    store.record_trials([first, TrialRecord(trial_id="t1", instance_id="i1", kind="agent", reward=1.0, submission="diff b"),
                         TrialRecord(trial_id="t2", instance_id="i2", kind="agent", reward=1.0, submission="diff c")])
    store.record_trials([TrialRecord(trial_id="t2", instance_id="i2", kind="agent", exception_type="AgentTimeoutError",
                                     exception_message="late", reward=1.0)])
    rows = {t.trial_id: t for t in store.trials_for()}
    assert (rows["t1"].reward, rows["t1"].submission) == (1.0, "diff b")
    assert (rows["t2"].exception_type, rows["t2"].submission) == ("AgentTimeoutError", "diff c")
