"""The ledger: migrations match the models, upserts never duplicate, URL from the environment.

Every test that takes ``store`` (or ``store_url``) runs twice: on SQLite and on a fresh database of
the session's PostgreSQL cluster (tests/pgfixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from pydantic import ValidationError
from sqlalchemy.dialects import postgresql

from forgeflow.common.errors import InputError
from forgeflow.ledger.dialects import upsert_statement
from forgeflow.ledger.records import (
    ImageRecord,
    ModelArtifactRecord,
    ServingGenerationRecord,
    TaskRecord,
    TrialRecord,
)
from forgeflow.ledger.store import Store
from forgeflow.ledger.tables import Base, Image, ServingGeneration
from tests.helpers import store_revision, task_status_counts

DIGEST = "sha256:" + "a" * 64
HEAD = "0010"
"""The newest migration (forgeflow/ledger/migrations/versions)."""

SHA = "b" * 64


def test_migration_creates_exactly_what_the_models_declare(store: Store) -> None:
    with store.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diff = compare_metadata(context, Base.metadata)
    assert diff == []
    assert store_revision(store) == HEAD


def test_upgrade_twice_is_a_no_op(store: Store) -> None:
    store.record_image(ImageRecord(ref="r/x:1", role="task"))
    store.upgrade()
    assert store.counts()["images"] == 1


def test_upsert_twice_leaves_one_row_with_the_new_values(store: Store) -> None:
    store.upsert(Image, {"ref": "127.0.0.1:5701/a:1"}, {"role": "source", "digest": None})
    first = store.get_image("127.0.0.1:5701/a:1")
    store.upsert(Image, {"ref": "127.0.0.1:5701/a:1"}, {"role": "target", "digest": DIGEST})
    rows = store.images()
    assert len(rows) == 1
    assert rows[0].role == "target" and rows[0].digest == DIGEST
    assert first is not None and first.digest is None


def test_upsert_rejects_a_key_that_is_not_the_natural_key(store: Store) -> None:
    with pytest.raises(InputError, match="must be exactly"):
        store.upsert(Image, {"digest": DIGEST}, {"role": "task"})
    with pytest.raises(InputError, match="unknown columns"):
        store.upsert(Image, {"ref": "x"}, {"colour": "red"})


def test_resumed_task_validation_updates_status_without_duplicating(store: Store) -> None:
    store.record_task(TaskRecord(instance_id="o__r.1", repo="o/r", status="candidate"))
    store.record_task(
        TaskRecord(
            instance_id="o__r.1",
            repo="o/r",
            status="accepted",
            FAIL_TO_PASS=["t::a"],
            run_id="run-2",
        )
    )
    store.record_task(
        TaskRecord(instance_id="o__r.2", repo="o/r", status="rejected", reason="nop passed")
    )
    store.record_task(TaskRecord(instance_id="o__s.1", repo="o/s", status="candidate"))
    accepted = store.accepted_tasks()
    assert [t.instance_id for t in accepted] == ["o__r.1"]
    assert accepted[0].FAIL_TO_PASS == ["t::a"] and accepted[0].run_id == "run-2"
    assert store.processed_instance_ids() == {"o__r.1", "o__r.2"}
    assert store.accepted_per_repo() == {"o/r": 1}
    assert task_status_counts(store) == {"accepted": 1, "rejected": 1, "candidate": 1}
    assert store.counts()["task_instances"] == 3


def test_trials_filter_by_kind_and_job_and_keep_exceptions_apart(store: Store) -> None:
    store.record_trial(TrialRecord(trial_id="t1", instance_id="i1", kind="nop", reward=0.0))
    store.record_trial(
        TrialRecord(
            trial_id="t2",
            instance_id="i1",
            kind="agent",
            job_id="canary-1",
            reward=1.0,
            timings={"agent_s": 3.5},
            model_sha256=SHA,
        )
    )
    store.record_trial(
        TrialRecord(
            trial_id="t3",
            instance_id="i2",
            kind="agent",
            job_id="canary-1",
            exception_type="SandboxOOMError",
            exception_message="exit 137",
        )
    )
    store.record_trial(
        TrialRecord(
            trial_id="t3",
            instance_id="i2",
            kind="agent",
            job_id="canary-1",
            exception_type="SandboxOOMError",
            exception_message="exit 137",
        )
    )
    agent = store.trials_for(kind="agent", job_id="canary-1")
    assert [t.trial_id for t in agent] == ["t2", "t3"]
    assert agent[0].timings == {"agent_s": 3.5} and agent[0].created_at is not None
    assert agent[1].reward is None and agent[1].exception_type == "SandboxOOMError"
    assert [t.trial_id for t in store.trials_for(kind="nop")] == ["t1"]


def test_a_trial_needs_exactly_one_of_reward_and_exception(store: Store) -> None:
    with pytest.raises(InputError, match="exactly one of reward"):
        store.record_trial(TrialRecord(trial_id="t", instance_id="i", kind="agent"))
    with pytest.raises(InputError, match="exactly one of reward"):
        store.record_trial(
            TrialRecord(trial_id="t", instance_id="i", kind="agent", reward=0.0, exception_type="X")
        )


def test_created_at_survives_an_upsert_and_updated_at_moves(store: Store) -> None:
    store.record_serving_generation(
        ServingGenerationRecord(generation=1, port=8101, gguf_sha256=SHA, status="active")
    )
    with store.session() as session:
        before = session.get(ServingGeneration, 1)
        created, updated = before.created_at, before.updated_at
    store.record_serving_generation(
        ServingGenerationRecord(generation=1, port=8101, gguf_sha256=SHA, status="retired")
    )
    with store.session() as session:
        after = session.get(ServingGeneration, 1)
        assert after.created_at == created and after.updated_at >= updated
    assert [g.status for g in store.serving_generations()] == ["retired"]


def test_highest_serving_generation_is_the_largest_number_of_any_status(store: Store) -> None:
    assert store.highest_serving_generation() == 0
    for generation, status in ((3, "retired"), (1, "active"), (2, "rolled_back")):
        store.record_serving_generation(
            ServingGenerationRecord(generation=generation, port=8101, gguf_sha256=SHA, status=status)
        )
    assert store.highest_serving_generation() == 3


def test_a_rolled_back_swap_takes_the_next_number_and_never_overwrites_a_generation(store: Store) -> None:
    assert store.record_rolled_back_swap(8101, SHA, run_id="run-a").generation == 1  # an empty store
    store.record_serving_generation(ServingGenerationRecord(generation=5, port=8102, gguf_sha256="c" * 64,
                                                            status="active"))
    row = store.record_rolled_back_swap(8101, SHA, run_id="run-b")
    assert (row.generation, row.status, row.port, row.gguf_sha256, row.run_id) == (6, "rolled_back", 8101, SHA, "run-b")
    assert [(g.generation, g.status) for g in store.serving_generations()] == [
        (1, "rolled_back"), (5, "active"), (6, "rolled_back")]
    assert store.highest_serving_generation() == 6  # the next swap is numbered above it
    assert store.latest_serving_generation().generation == 5  # what serves is still the active one
    with pytest.raises(InputError, match="rolled-back swap"):
        store.record_rolled_back_swap(0, SHA)
    assert len(store.serving_generations()) == 3


def test_model_artifact_lineage_round_trips(store: Store) -> None:
    store.record_model_artifact(
        ModelArtifactRecord(
            sha256=SHA,
            kind="adapter",
            path="/m/a",
            parent_sha256="c" * 64,
            lineage={"bursts": ["b1", "b2"]},
        )
    )
    (artifact,) = store.model_artifacts(kind="adapter")
    assert artifact.lineage == {"bursts": ["b1", "b2"]} and artifact.parent_sha256 == "c" * 64


def test_upgrade_works_from_another_working_directory(tmp_path: Path, monkeypatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ledger = Store(f"sqlite:///{tmp_path / 'nested' / 'deeper' / 'store.db'}")
    ledger.upgrade()
    ledger.record_image(ImageRecord(ref="r/x:1", role="env"))
    assert ledger.counts()["images"] == 1
    ledger.dispose()
    assert (tmp_path / "nested" / "deeper" / "store.db").is_file()


def test_url_comes_from_forgeflow_store_url(tmp_path: Path, monkeypatch) -> None:
    db = tmp_path / "from_env.db"
    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{db}")
    ledger = Store()
    ledger.upgrade()
    assert ledger.url == f"sqlite:///{db}"
    assert db.is_file() and store_revision(ledger) == HEAD
    ledger.dispose()


def test_unsupported_dialect_is_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="mysql"):
        Store("mysql://u@h/db")


def test_the_postgresql_upsert_updates_on_conflict_with_the_natural_key() -> None:
    statement = upsert_statement("postgresql", Image, {"ref": "x"}, {"role": "task"})
    sql = str(statement.compile(dialect=postgresql.dialect()))
    assert "ON CONFLICT (ref) DO UPDATE SET role = excluded.role" in sql.replace("\n", " ")
    assert "updated_at = " in sql


def test_record_trials_writes_a_batch_in_one_transaction_or_nothing(store: Store) -> None:
    good = [TrialRecord(trial_id=f"t{i}", instance_id=f"i{i}", kind="nop", reward=0.0, job_id="j") for i in range(40)]
    store.record_trials(good)
    store.record_trials(good)  # a resumed run: upserts, no duplicates
    assert len(store.trials_for(job_id="j")) == 40
    bad = [TrialRecord(trial_id="x1", instance_id="i", kind="nop", reward=1.0, job_id="k"),
           TrialRecord(trial_id="x2", instance_id="i", kind="nop", job_id="k")]  # neither reward nor exception
    with pytest.raises(InputError, match="'x2'"):
        store.record_trials(bad)
    assert store.trials_for(job_id="k") == []  # the good row of the bad batch was not written either


def test_image_migration_state_round_trips_and_rejects_an_unknown_status(store: Store) -> None:
    from forgeflow.ledger.records import ImageRecord

    digest = "sha256:" + "a" * 64
    store.record_image(ImageRecord(ref="127.0.0.1:5702/env/a:1", role="target", status="skipped",
                                   status_reason="oversize: 3 GiB > 1 GiB",
                                   source_ref="127.0.0.1:5701/env/a:1", source_digest=digest))
    row = store.get_image("127.0.0.1:5702/env/a:1")
    assert row is not None and (row.status, row.source_digest) == ("skipped", digest)
    assert row.status_reason.startswith("oversize")
    with pytest.raises(ValidationError, match="status"):
        ImageRecord(ref="x", role="target", status="done")


def test_recovery_job_links_to_its_original_and_trial_costs_are_kept(store: Store) -> None:
    from forgeflow.ledger.records import JobRecord, TrialRecord

    store.record_job(JobRecord(job_id="canary-1", kind="canary", freeze_name="f1", split="test"))
    store.record_job(JobRecord(job_id="canary-1-r1", kind="recovery", parent_job_id="canary-1"))
    store.record_job(JobRecord(job_id="canary-1-r2", kind="recovery", parent_job_id="canary-1"))
    assert [j.job_id for j in store.jobs(parent_job_id="canary-1")] == ["canary-1-r1", "canary-1-r2"]
    assert store.get_job("canary-1").split == "test"
    with pytest.raises(InputError, match="own parent"):
        store.record_job(JobRecord(job_id="x", kind="recovery", parent_job_id="x"))
    store.record_trial(TrialRecord(trial_id="t1", instance_id="i1", kind="agent", job_id="canary-1",
                                   reward=1.0, agent_steps=7, input_tokens=1234, output_tokens=56))
    (trial,) = store.trials_for(job_id="canary-1")
    assert (trial.agent_steps, trial.input_tokens, trial.output_tokens) == (7, 1234, 56)


def test_judgments_and_supervision_events_are_stored_with_their_evidence(store: Store) -> None:
    from forgeflow.evaluation.judge import judge_answer
    from forgeflow.ledger.records import SupervisionEventRecord

    verdict = judge_answer("q1", "The Eiffel Tower", "eiffel tower", job_id="qa-1")
    store.record_judgments([verdict])
    (row,) = store.judgments("qa-1")
    assert row.correct and row.normalized_answer == verdict.normalized_answer
    store.record_supervision_event(SupervisionEventRecord(
        event_id="e1", trial_id="t1", kind="dead_loop",
        evidence={"period": 2, "repeats": 3}, trajectory_path="/tmp/t1.traj.json"))
    (event,) = store.supervision_events("t1")
    assert event.evidence == {"period": 2, "repeats": 3}
    with pytest.raises(ValidationError, match="kind"):
        SupervisionEventRecord(event_id="e2", trial_id="t1", kind="stuck")


def test_downgrade_to_0002_and_upgrade_again_keeps_old_rows(store: Store) -> None:
    from alembic import command

    from forgeflow.ledger.records import TrialRecord

    store.record_trial(TrialRecord(trial_id="t1", instance_id="i1", kind="nop", reward=0.0))
    with store.engine.begin() as connection:
        command.downgrade(store.alembic_config(connection), "0002")
    assert store_revision(store) == "0002"
    store.upgrade()
    assert store_revision(store) == HEAD
    assert [t.trial_id for t in store.trials_for()] == ["t1"]


def test_an_artifact_made_from_two_parents_keeps_both_producers(store: Store) -> None:
    """Regression (new-user trial): the same GGUF bytes made from two adapters; the second record
    replaced the first's parent instead of both being kept."""
    gguf, first, second = "c" * 64, "a" * 64, "b" * 64
    for parent, run in ((first, "run-1"), (second, "run-2"), (second, "run-2")):  # run-2 resumed: no duplicate
        store.record_model_artifact(ModelArtifactRecord(sha256=gguf, kind="gguf", path="/m/q8.gguf",
                                                        quantization="Q8_0", parent_sha256=parent, run_id=run))
    rows = store.model_artifacts(kind="gguf")
    assert [(r.sha256, r.parent_sha256, r.run_id) for r in rows] == [(gguf, first, "run-1"), (gguf, second, "run-2")]
    assert [r.parent_sha256 for r in store.producers(gguf)] == [first, second]
    assert store.producers("d" * 64) == []


def test_an_artifact_recorded_with_another_kind_is_refused(store: Store) -> None:
    store.record_model_artifact(ModelArtifactRecord(sha256=SHA, kind="gguf", path="/m/q8.gguf", quantization="Q8_0"))
    with pytest.raises(InputError, match="kind 'adapter'.*'gguf'"):
        store.record_model_artifact(ModelArtifactRecord(sha256=SHA, kind="adapter", path="/m/a"))
    with pytest.raises(InputError, match="quantization 'Q4_K_M'.*'Q8_0'"):
        store.record_model_artifact(ModelArtifactRecord(sha256=SHA, kind="gguf", path="/m/q4.gguf",
                                                        quantization="Q4_K_M"))
    assert [r.path for r in store.model_artifacts()] == ["/m/q8.gguf"]


def test_migration_0004_moves_each_parent_link_into_a_production_and_back(store: Store) -> None:
    from alembic import command
    from sqlalchemy import text

    with store.engine.begin() as connection:
        command.downgrade(store.alembic_config(connection), "0003")
        connection.execute(text(  # a row as a 0003 store wrote it: one parent per artifact
            "INSERT INTO model_artifacts (sha256, kind, path, quantization, parent_sha256, lineage, run_id, "
            f"created_at, updated_at) VALUES ('{SHA}', 'adapter', '/m/a', NULL, '{'c' * 64}', "
            "'{\"dataset_sha256\": \"d\"}', 'run-0', '2026-11-01 00:00:00', '2026-11-01 00:00:00')"))
    store.upgrade()
    assert store_revision(store) == HEAD
    (row,) = store.producers(SHA)
    assert (row.kind, row.path, row.parent_sha256, row.run_id) == ("adapter", "/m/a", "c" * 64, "run-0")
    assert row.lineage == {"dataset_sha256": "d"}
    store.record_model_artifact(ModelArtifactRecord(sha256=SHA, kind="adapter", path="/m/b", parent_sha256="e" * 64,
                                                    run_id="run-1"))
    with store.engine.begin() as connection:
        command.downgrade(store.alembic_config(connection), "0003")
        parent = connection.execute(text("SELECT parent_sha256, path FROM model_artifacts")).one()
    assert tuple(parent) == ("e" * 64, "/m/b")  # back to one parent: the latest production's
    store.upgrade()
    assert [r.parent_sha256 for r in store.producers(SHA)] == ["e" * 64]


def test_a_reading_store_on_a_missing_sqlite_file_names_it_and_creates_nothing(tmp_path: Path) -> None:
    from forgeflow.common.errors import StoreNotFoundError

    missing = tmp_path / "typo" / "forgeflow.db"
    with pytest.raises(StoreNotFoundError, match=f"no forgeflow store at {missing}; run a flow first"):
        Store(f"sqlite:///{missing}", create=False)
    assert not missing.parent.exists()


def test_a_mistyped_forgeflow_home_is_named_and_left_uncreated(tmp_path: Path, monkeypatch) -> None:
    from forgeflow.common import settings
    from forgeflow.common.errors import StoreNotFoundError

    home = tmp_path / "forgeflw"  # the user's typo
    monkeypatch.setenv("FORGEFLOW_HOME", str(home))
    monkeypatch.delenv("FORGEFLOW_STORE_URL", raising=False)
    assert settings.store_url() == f"sqlite:///{home / 'store.db'}"  # resolving the URL makes no folder
    with pytest.raises(StoreNotFoundError, match=r"store\.db; run a flow first or set FORGEFLOW_HOME"):
        Store(create=False)
    assert not home.exists()
    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'other.db'}")
    with pytest.raises(StoreNotFoundError, match="fix FORGEFLOW_STORE_URL"):
        Store(create=False)

    writer = Store()  # a command that writes still creates the store
    writer.upgrade()
    writer.dispose()
    reader = Store(create=False)  # ... which reading commands then open
    assert reader.counts()["trials"] == 0
    reader.dispose()


def test_store_url_password_never_shown() -> None:
    """status, event payloads and messages show the store URL: never its password."""
    store = Store("postgresql+psycopg://forge:s3cr3t-pw@127.0.0.1:1/forgeflow")  # no connection made
    try:
        assert "s3cr3t-pw" not in store.display_url
        assert store.display_url == "postgresql+psycopg://forge:***@127.0.0.1:1/forgeflow"
    finally:
        store.dispose()
    with pytest.raises(InputError, match="mysql") as bad_dialect:
        Store("mysql://forge:s3cr3t-pw@127.0.0.1/forgeflow")
    assert "s3cr3t-pw" not in str(bad_dialect.value)


def test_an_artifact_cannot_be_its_own_parent() -> None:
    """An RL burst with zero advantages leaves the adapter's bytes as they were: recording it as made
    from itself would put a cycle in the lineage; the record is refused, naming the digest."""
    sha = "a" * 64
    with pytest.raises(ValidationError, match=f"adapter {sha} is recorded as made from itself"):
        ModelArtifactRecord(sha256=sha, kind="adapter", path="/x", parent_sha256=sha, run_id="rl")
    assert ModelArtifactRecord(sha256=sha, kind="adapter", path="/x", parent_sha256="b" * 64).parent_sha256 == "b" * 64


def test_a_reading_store_refuses_a_file_that_is_not_a_forgeflow_store_and_writes_nothing(tmp_path: Path) -> None:
    from forgeflow.common.errors import StoreInvalidError

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"garbage\n")
    with pytest.raises(StoreInvalidError, match=f"{garbage} is not a forgeflow store \\(file is not a database\\)"):
        Store(f"sqlite:///{garbage}", create=False)
    assert garbage.read_bytes() == b"garbage\n"
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(StoreInvalidError, match="it has no forgeflow schema"):
        Store(f"sqlite:///{empty}", create=False)
    assert empty.stat().st_size == 0 and not (tmp_path / "empty.db-wal").exists()


def test_a_reading_store_refuses_an_older_revision_without_migrating_it(tmp_path: Path) -> None:
    from forgeflow.common.errors import StoreInvalidError

    url = f"sqlite:///{tmp_path / 'old.db'}"
    writer = Store(url)
    writer.upgrade("0003")
    with pytest.raises(StoreInvalidError, match="revision 0003, older than .*run any flow or `forgeflow up`"):
        Store(url, create=False)
    assert store_revision(writer) == "0003"
    writer.upgrade()
    reader = Store(url, create=False)
    assert reader.counts()["trials"] == 0
    reader.dispose()
    writer.dispose()


def test_a_reading_store_on_a_database_server_that_is_down_names_the_masked_url() -> None:
    from forgeflow.common.errors import StoreUnavailableError
    from tests.helpers import free_port

    url = f"postgresql+psycopg://forge:s3cr3t-pw@127.0.0.1:{free_port()}/forgeflow"
    with pytest.raises(StoreUnavailableError, match=r"forge:\*\*\*@127\.0\.0\.1.*cannot be reached") as down:
        Store(url, create=False)
    assert "s3cr3t-pw" not in str(down.value)


def test_freezes_are_listed_newest_first(store: Store) -> None:
    """`forgeflow status` shows the newest freeze from the store."""
    import time

    from forgeflow.ledger.records import FreezeRecord

    assert store.freezes() == []
    for name in ("z-older", "a-newer"):
        store.record_freeze(FreezeRecord(name=name, semantic_sha256="1" * 64, file_sha256="2" * 64,
                                         manifest_path=f"/f/{name}.json", counts={"test": 2}))
        time.sleep(0.05)
    assert [f.name for f in store.freezes()] == ["a-newer", "z-older"]
    assert store.freezes()[0].counts == {"test": 2}


def test_a_writer_refuses_a_file_that_is_not_an_sqlite_database(tmp_path: Path) -> None:
    """A flow (or `forgeflow up`) opening a corrupt store file: one error naming it, the file untouched;
    an empty file still becomes a new store."""
    from forgeflow.common.errors import StoreInvalidError

    garbage = tmp_path / "store.db"
    garbage.write_text("garbage\n")
    with pytest.raises(StoreInvalidError, match=f"{garbage} is not a forgeflow store"):
        Store(f"sqlite:///{garbage}")
    assert garbage.read_text() == "garbage\n"
    empty = tmp_path / "empty.db"
    empty.touch()
    store = Store(f"sqlite:///{empty}")
    try:
        store.upgrade()
        assert store_revision(store) is not None
    finally:
        store.dispose()


def test_migration_0005_keeps_the_verifiers_evidence_and_old_trials(store: Store) -> None:
    from alembic import command

    from forgeflow.ledger.records import TrialRecord

    evidence = {"submission": {"policy": "reject", "tampering": True, "protected_paths": {"conftest.py": "conftest"}}}
    store.record_trial(TrialRecord(trial_id="t-new", instance_id="i1", kind="agent", reward=0.0, verifier=evidence))
    assert store.trials_for(trial_ids=["t-new"])[0].verifier == evidence
    with store.engine.begin() as connection:
        command.downgrade(store.alembic_config(connection), "0004")
    store.upgrade()
    (row,) = store.trials_for(trial_ids=["t-new"])
    assert row.reward == 0.0 and row.verifier is None  # the evidence went with the column; the row stayed


def test_migration_0006_keeps_old_freezes_without_a_bundle(store: Store) -> None:
    from alembic import command
    from sqlalchemy import text

    from forgeflow.ledger.records import FreezeRecord

    with store.engine.begin() as connection:
        command.downgrade(store.alembic_config(connection), "0005")
    with store.engine.begin() as connection:  # a freeze as a 0005 store wrote it (no bundle columns)
        connection.execute(text(
            "INSERT INTO freezes (name, semantic_sha256, file_sha256, manifest_path, counts, created_at, updated_at) "
            f"VALUES ('old', '{'1' * 64}', '{'2' * 64}', '/f/old.json', '{{}}', '2026-11-01 00:00:00', "
            "'2026-11-01 00:00:00')"))
    store.upgrade()
    old = store.get_freeze("old")
    assert old is not None and old.bundle_sha256 is None and old.bundle_path is None
    store.record_freeze(FreezeRecord(name="new", semantic_sha256="1" * 64, file_sha256="2" * 64,
                                     manifest_path="/f/new.json", bundle_sha256="3" * 64,
                                     bundle_path="/f/new.bundle.tar"))
    new = store.get_freeze("new")
    assert new is not None and new.bundle_sha256 == "3" * 64 and new.bundle_path == "/f/new.bundle.tar"


def test_validation_seconds_sums_the_newest_nop_and_oracle_trial_of_each_task(store: Store) -> None:
    from datetime import datetime, timedelta, timezone

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def trial(trial_id: str, instance_id: str, kind: str, minutes: int, **timings: float) -> TrialRecord:
        return TrialRecord(trial_id=trial_id, instance_id=instance_id, kind=kind, reward=1.0, timings=timings,
                           created_at=t0 + timedelta(minutes=minutes))

    store.record_trials([
        trial("a-nop-old", "a", "nop", 0, env_setup_s=1.0, verifier_s=50.0),
        trial("a-nop-new", "a", "nop", 5, env_setup_s=0.5, verifier_s=30.0),
        trial("a-oracle", "a", "oracle", 6, env_setup_s=0.5, verifier_s=31.0),
        trial("b-nop", "b", "nop", 1, verifier_s=2.0),
        trial("c-agent", "c", "agent", 1, agent_s=90.0, verifier_s=9.0),  # not a validation trial
    ])
    assert store.validation_seconds(["a", "b", "c", "d"]) == {"a": 62.0, "b": 2.0}


def test_a_task_keeps_its_patch_text_checked_against_its_digest(store: Store) -> None:
    from forgeflow.common.fsutil import sha256_bytes

    patch = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    store.record_task(TaskRecord(instance_id="p__1", repo="p", patch=patch, status="candidate"))
    (row,) = store.tasks()
    assert row.patch == patch and row.patch_sha256 == sha256_bytes(patch.encode())
    # a later record without the text (a status change) keeps it
    store.record_task(TaskRecord(instance_id="p__1", repo="p", patch_sha256=row.patch_sha256, status="accepted"))
    (row,) = store.tasks()
    assert row.status == "accepted" and row.patch == patch
    with pytest.raises(ValidationError, match="is not the sha256 of its patch"):
        TaskRecord(instance_id="p__2", repo="p", patch=patch, patch_sha256="0" * 64, status="candidate")


def test_migration_0007_keeps_old_tasks_without_a_patch(store: Store) -> None:
    from alembic import command
    from sqlalchemy import text

    with store.engine.begin() as connection:
        command.downgrade(store.alembic_config(connection), "0006")
    with store.engine.begin() as connection:  # a task as a 0006 store wrote it (no patch column)
        connection.execute(text(
            "INSERT INTO task_instances (instance_id, repo, patch_sha256, status, fail_to_pass, pass_to_pass, "
            f"created_at, updated_at) VALUES ('old__1', 'old', '{'1' * 64}', 'accepted', '[]', '[]', "
            "'2026-11-01 00:00:00', '2026-11-01 00:00:00')"))
    store.upgrade()
    (old,) = store.tasks()
    assert old.patch is None and old.patch_sha256 == "1" * 64


def test_a_task_keeps_its_known_tests_and_pristine_duration_and_0009_reads_old_tasks_as_not_recorded(
        store: Store) -> None:
    from alembic import command
    from sqlalchemy import text

    known = ["tests/test_a.py::test_one", "tests/test_a.py::test_two[1-x]"]
    store.record_task(TaskRecord(instance_id="n__1", repo="n", status="accepted", FAIL_TO_PASS=known[:1],
                                 known_tests=known, pristine_duration_s=2.75))
    (row,) = store.tasks()
    assert row.known_tests == known and row.pristine_duration_s == 2.75
    with pytest.raises(ValidationError, match="pristine_duration_s"):
        TaskRecord(instance_id="n__2", repo="n", status="accepted", pristine_duration_s=-1.0)

    with store.engine.begin() as connection:
        command.downgrade(store.alembic_config(connection), "0008")
    assert store_revision(store) == "0008"
    with store.engine.begin() as connection:  # a task as a 0008 store wrote it (neither column)
        connection.execute(text(
            "INSERT INTO task_instances (instance_id, repo, status, fail_to_pass, pass_to_pass, created_at, "
            "updated_at) VALUES ('old__1', 'old', 'accepted', '[\"t::a\"]', '[]', '2026-11-01 00:00:00', "
            "'2026-11-01 00:00:00')"))
    store.upgrade()
    new, old = store.tasks()  # by instance id
    assert old.instance_id == "old__1" and old.known_tests == [] and old.pristine_duration_s is None
    assert old.FAIL_TO_PASS == ["t::a"] and old.status == "accepted"
    assert new.known_tests == [] and new.pristine_duration_s is None  # the columns went with the downgrade
    store.record_task(new.model_copy(update={"known_tests": known, "pristine_duration_s": 3.5}))
    assert store.get_task("n__1").known_tests == known and store.get_task("n__1").pristine_duration_s == 3.5
