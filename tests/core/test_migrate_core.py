"""Pure parts of forgeflow.migrate: dataset image lists, state documents, reference rewrite,
prewarm plan inputs (SQLite store in a temp folder; no registry)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow import migrate
from forgeflow.errors import InputError
from forgeflow.store import ImageRecord, Store, TaskRecord

OLD, NEW = "127.0.0.1:5701", "registry.example.com:443/mirror"
DIGEST_A, DIGEST_B = "sha256:" + "a" * 64, "sha256:" + "b" * 64


@pytest.fixture
def store(tmp_path: Path) -> Store:
    ledger = Store(f"sqlite:///{tmp_path / 'store.db'}")
    ledger.upgrade()
    ledger.record_image(ImageRecord(ref=f"{OLD}/task-01:t1", digest=DIGEST_A, role="task", project="six"))
    ledger.record_image(ImageRecord(ref=f"{OLD}/env/six:1", digest=DIGEST_A, role="env", project="six"))
    ledger.record_image(ImageRecord(ref=f"{OLD}/env/six-src:1", digest=DIGEST_A, role="source"))
    ledger.record_image(ImageRecord(ref="127.0.0.1:57011/task-01:x", digest=DIGEST_B, role="task"))
    ledger.record_image(ImageRecord(ref="127.0.0.1:5702/env/six:1", digest=DIGEST_A, role="target", project="six"))
    ledger.record_task(TaskRecord(instance_id="t1", repo="six", image_ref=f"{OLD}/task-01:t1", status="candidate"))
    ledger.record_task(TaskRecord(instance_id="t2", repo="six", image_ref=None, status="candidate"))
    yield ledger
    ledger.dispose()


def _snapshot(store: Store) -> tuple[list, list]:
    images = sorted((i.ref, i.digest, i.role, i.project) for i in store.images())
    tasks = sorted((t.instance_id, t.image_ref) for t in store.tasks())
    return images, tasks


def test_dry_run_lists_the_diff_and_changes_nothing(store: Store) -> None:
    before = _snapshot(store)
    plan = migrate.rewrite_refs(store, OLD, NEW)
    assert not plan.applied
    assert [(r.table, r.old, r.new) for r in plan.rows] == [
        ("images", f"{OLD}/env/six:1", f"{NEW}/env/six:1"),
        ("images", f"{OLD}/task-01:t1", f"{NEW}/task-01:t1"),
        ("task_instances", f"{OLD}/task-01:t1", f"{NEW}/task-01:t1"),
    ]  # the source row stays, and 127.0.0.1:57011 is not under 127.0.0.1:5701
    assert _snapshot(store) == before


def test_rewrite_then_rewrite_back_restores_exactly(store: Store) -> None:
    before = _snapshot(store)
    applied = migrate.rewrite_refs(store, OLD, NEW, dry_run=False)
    assert applied.applied and len(applied.rows) == 3
    assert store.get_task("t1").image_ref == f"{NEW}/task-01:t1"
    moved = store.get_image(f"{NEW}/env/six:1")
    assert moved is not None and moved.digest == DIGEST_A and moved.project == "six"
    assert store.get_image(f"{OLD}/env/six:1") is None
    reverted = migrate.rewrite_refs(store, NEW, OLD, dry_run=False)
    assert [(r.old, r.new) for r in reverted.rows] == [(r.new, r.old) for r in applied.rows]
    assert _snapshot(store) == before


def test_rewrite_refused_when_not_reversible(store: Store) -> None:
    store.record_task(TaskRecord(instance_id="t3", repo="six", image_ref=f"{NEW}/task-02:t3", status="candidate"))
    before = _snapshot(store)
    with pytest.raises(InputError, match=r"task-02:t3"):
        migrate.rewrite_refs(store, OLD, NEW, dry_run=False)
    assert _snapshot(store) == before


@pytest.mark.parametrize("old,new", [(OLD, OLD), ("127.0.0.1:5701", "127.0.0.1:5701/x"), ("docker://a", "b")])
def test_rewrite_rejects_bad_prefixes(store: Store, old: str, new: str) -> None:
    with pytest.raises(InputError):
        migrate.rewrite_refs(store, old, new)


def test_image_names_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "ds.jsonl"
    path.write_text('{"image": "env/six:1"}\n\n{"image": "env/toolz:2"}\n{"image": "env/six:1"}\n')
    assert migrate.image_names_from_jsonl(path) == ["env/six:1", "env/toolz:2"]
    path.write_text('{"image": "env/six:1"}\n{"img": "x:1"}\n')
    with pytest.raises(InputError, match=r"ds.jsonl:2"):
        migrate.image_names_from_jsonl(path)


def test_states_round_trip_and_merge(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    first = migrate.MigrationRecord(source_ref="docker://a/x:1", target_ref="docker://b/x:1", status="failed",
                                    reason="not found", error_type="ImageNotFoundError")
    other = migrate.MigrationRecord(source_ref="docker://a/y:1", target_ref="docker://b/y:1", status="pending")
    migrate.save_states(path, [first, other])
    done = first.model_copy(update={"status": "completed", "target_digest": DIGEST_A, "error_type": None})
    migrate.save_states(path, [done])
    states = migrate.load_states(path)
    assert states == {"docker://b/x:1": done, "docker://b/y:1": other}
    assert json.loads(path.read_text())["schema_version"] == 1


def test_pending_rows_never_erase_a_completed_digest(store: Store) -> None:
    completed = migrate.MigrationRecord(source_ref="docker://a/env/six:1", target_ref="docker://127.0.0.1:5702/env/six:1",
                                        status="pending")
    fresh = migrate.MigrationRecord(source_ref="docker://a/env/new:1", target_ref="docker://127.0.0.1:5702/env/new:1",
                                    status="pending")
    assert migrate.record_pending(store, [completed, fresh]) == 1
    assert store.get_image("127.0.0.1:5702/env/six:1").digest == DIGEST_A
    assert store.get_image("127.0.0.1:5702/env/new:1").digest is None


def test_plan_tasks_from_store_uses_the_target_image_of_each_repo(store: Store) -> None:
    assert migrate.plan_tasks_from_store(store) == [("t1", DIGEST_A), ("t2", DIGEST_A)]
    store.record_task(TaskRecord(instance_id="t9", repo="toolz", status="candidate"))
    with pytest.raises(InputError, match="toolz"):
        migrate.plan_tasks_from_store(store)


def test_plan_tasks_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"task_id": "a", "base_digest": DIGEST_A}) + "\n" + json.dumps({"task_id": "b"}) + "\n")
    with pytest.raises(InputError, match=r"tasks.jsonl:2"):
        migrate.plan_tasks_from_jsonl(path)
