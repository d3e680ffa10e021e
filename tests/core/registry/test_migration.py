"""Pure parts of forgeflow.registry.migration: dataset image lists, migration state rows, reference rewrite,
prewarm plan inputs (SQLite store in a temp folder; no registry)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.ledger.records import ImageRecord, TaskRecord
from forgeflow.ledger.store import Store
from forgeflow.registry import coverage
from forgeflow.registry import migration as migrate

OLD, NEW = "127.0.0.1:5701", "registry.example.com:443/mirror"
DIGEST_A, DIGEST_B = "sha256:" + "a" * 64, "sha256:" + "b" * 64


@pytest.fixture
def store(store_url: str) -> Store:
    ledger = Store(store_url)
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
    plan = coverage.rewrite_refs(store, OLD, NEW)
    assert not plan.applied
    assert [(r.table, r.old, r.new) for r in plan.rows] == [
        ("images", f"{OLD}/env/six:1", f"{NEW}/env/six:1"),
        ("images", f"{OLD}/task-01:t1", f"{NEW}/task-01:t1"),
        ("task_instances", f"{OLD}/task-01:t1", f"{NEW}/task-01:t1"),
    ]  # the source row stays, and 127.0.0.1:57011 is not under 127.0.0.1:5701
    assert _snapshot(store) == before


def test_rewrite_then_rewrite_back_restores_exactly(store: Store) -> None:
    before = _snapshot(store)
    applied = coverage.rewrite_refs(store, OLD, NEW, dry_run=False)
    assert applied.applied and len(applied.rows) == 3
    assert store.get_task("t1").image_ref == f"{NEW}/task-01:t1"
    moved = store.get_image(f"{NEW}/env/six:1")
    assert moved is not None and moved.digest == DIGEST_A and moved.project == "six"
    assert store.get_image(f"{OLD}/env/six:1") is None
    reverted = coverage.rewrite_refs(store, NEW, OLD, dry_run=False)
    assert [(r.old, r.new) for r in reverted.rows] == [(r.new, r.old) for r in applied.rows]
    assert _snapshot(store) == before


def test_rewrite_refused_when_not_reversible(store: Store) -> None:
    store.record_task(TaskRecord(instance_id="t3", repo="six", image_ref=f"{NEW}/task-02:t3", status="candidate"))
    before = _snapshot(store)
    with pytest.raises(InputError, match=r"task-02:t3"):
        coverage.rewrite_refs(store, OLD, NEW, dry_run=False)
    assert _snapshot(store) == before


@pytest.mark.parametrize("old,new", [(OLD, OLD), ("127.0.0.1:5701", "127.0.0.1:5701/x"), ("docker://a", "b")])
def test_rewrite_rejects_bad_prefixes(store: Store, old: str, new: str) -> None:
    with pytest.raises(InputError):
        coverage.rewrite_refs(store, old, new)


def test_image_names_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "ds.jsonl"
    path.write_text('{"image": "env/six:1"}\n\n{"image": "env/toolz:2"}\n{"image": "env/six:1"}\n')
    assert coverage.image_names_from_jsonl(path) == ["env/six:1", "env/toolz:2"]
    path.write_text('{"image": "env/six:1"}\n{"img": "x:1"}\n')
    with pytest.raises(InputError, match=r"ds.jsonl:2"):
        coverage.image_names_from_jsonl(path)


def test_states_live_in_the_images_rows_and_read_back(store: Store) -> None:
    target = "127.0.0.1:5702"
    failed = migrate.MigrationRecord(source_ref="docker://a/x:1", target_ref=f"docker://{target}/x:1", status="failed",
                                     reason="image docker://a/x:1 not found: manifest unknown",
                                     error_type="ImageNotFoundError", source_digest=None)
    skipped = migrate.MigrationRecord(source_ref="docker://a/y:1", target_ref=f"docker://{target}/y:1",
                                      status="skipped", reason="oversize: 9 bytes > max 1 bytes",
                                      source_digest=DIGEST_B, size_bytes=9)
    assert migrate.record_pending(store, [failed, skipped], run_id="r1") == 2
    assert {r.status for r in migrate.load_states(store, [failed.target_ref, skipped.target_ref]).values()} == {"pending"}
    migrate.record_state(store, failed, "r1")
    migrate.record_state(store, skipped, "r1")
    states = migrate.load_states(store)
    assert states[failed.target_ref] == failed
    assert states[skipped.target_ref] == skipped
    row = store.get_image(f"{target}/x:1")
    assert (row.status, row.role, row.source_ref, row.digest) == ("failed", "target", "a/x:1", None)
    assert row.status_reason.startswith("ImageNotFoundError: image docker://a/x:1")
    # rows without a migration status (the fixture's legacy target row, other roles) are not states
    assert f"docker://{target}/env/six:1" not in states and len(states) == 2


def test_completed_rows_are_kept_by_pending_and_found_for_the_same_source_only(store: Store) -> None:
    pair = ("docker://a/env/six:1", "docker://127.0.0.1:5702/env/six:1")
    done = migrate.MigrationRecord(source_ref=pair[0], target_ref=pair[1], status="completed",
                                   source_digest=DIGEST_A, target_digest=DIGEST_A, size_bytes=5)
    migrate.record_state(store, done, "r1")
    assert store.get_image("127.0.0.1:5702/env/six:1").project == "six"  # a migration leaves project alone
    assert migrate.completed_in_store(store, [pair]) == {pair[1]: done}
    assert migrate.completed_in_store(store, [("docker://b/env/six:1", pair[1])]) == {}
    # marking it pending again (a re-attempt) keeps the last verified digest until the attempt ends
    migrate.record_pending(store, [migrate.MigrationRecord(source_ref=pair[0], target_ref=pair[1], status="pending")])
    row = store.get_image("127.0.0.1:5702/env/six:1")
    assert (row.status, row.digest) == ("pending", DIGEST_A)
    assert migrate.completed_in_store(store, [pair]) == {}


def test_coverage_drift_puts_completed_rows_back_to_pending(store: Store) -> None:
    done = migrate.MigrationRecord(source_ref="docker://a/m:1", target_ref="docker://127.0.0.1:5702/m:1",
                                   status="completed", source_digest=DIGEST_A, target_digest=DIGEST_A)
    migrate.record_state(store, done)
    report = coverage.CoverageReport(total=1, available=0, missing=1, errored=0, drifted=1, rows=[
        coverage.AvailabilityRow(ref=done.target_ref, availability="missing", recorded_status="completed",
                                recorded_digest=DIGEST_A, drift="recorded completed, missing from the registry")])
    assert coverage.reconcile_coverage(store, report, "r2") == [done.target_ref]
    row = store.get_image("127.0.0.1:5702/m:1")
    assert (row.status, row.digest, row.run_id) == ("pending", None, "r2")
    assert "missing from the registry" in row.status_reason


def test_migration_pairs_must_be_docker_refs_with_unique_targets() -> None:
    with pytest.raises(InputError, match="repeated"):
        migrate.check_pairs([("docker://a/x:1", "docker://b/x:1"), ("docker://a/y:1", "docker://b/x:1")])
    with pytest.raises(InputError, match="oci:/tmp/x"):
        migrate.check_pairs([("oci:/tmp/x", "docker://b/x:1")])


def test_plan_tasks_from_store_uses_the_target_image_of_each_repo(store: Store) -> None:
    assert coverage.plan_tasks_from_store(store) == [("t1", DIGEST_A), ("t2", DIGEST_A)]
    store.record_task(TaskRecord(instance_id="t9", repo="toolz", status="candidate"))
    with pytest.raises(InputError, match="toolz"):
        coverage.plan_tasks_from_store(store)


def test_plan_tasks_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"task_id": "a", "base_digest": DIGEST_A}) + "\n" + json.dumps({"task_id": "b"}) + "\n")
    with pytest.raises(InputError, match=r"tasks.jsonl:2"):
        coverage.plan_tasks_from_jsonl(path)


def test_rewriting_migration_rows_keeps_their_state_and_reverts(store: Store) -> None:
    """With role ``target`` in scope (the target registry itself moved), rewrite_refs moves the
    migration rows' keys; their status, source and digests travel with them, and the reverse
    rewrite restores them."""
    done = migrate.MigrationRecord(source_ref=f"docker://{OLD}/env/six-src:1", target_ref="docker://127.0.0.1:5702/env/x:1",
                                   status="completed", source_digest=DIGEST_A, target_digest=DIGEST_A, size_bytes=3)
    migrate.record_state(store, done, "r1")
    plan = coverage.rewrite_refs(store, "127.0.0.1:5702", NEW, dry_run=False, image_roles=("target",))
    assert {(r.old, r.new) for r in plan.rows} == {("127.0.0.1:5702/env/x:1", f"{NEW}/env/x:1"),
                                                   ("127.0.0.1:5702/env/six:1", f"{NEW}/env/six:1")}
    moved = migrate.load_states(store)[f"docker://{NEW}/env/x:1"]
    assert moved == done.model_copy(update={"target_ref": f"docker://{NEW}/env/x:1"})
    coverage.rewrite_refs(store, NEW, "127.0.0.1:5702", dry_run=False, image_roles=("target",))
    assert migrate.load_states(store)[done.target_ref] == done


def test_rewrite_moves_one_repository_at_a_tag_boundary_and_back(store: Store) -> None:
    # regression: '127.0.0.1:5701/task-01' -> '.../task-02' found no rows ('host/task-01:t1' refs)
    store.record_image(ImageRecord(ref=f"{OLD}/task-010:t9", digest=DIGEST_B, role="task"))
    before = _snapshot(store)
    plan = coverage.rewrite_refs(store, f"{OLD}/task-01", f"{OLD}/task-02", dry_run=False)
    assert [(r.table, r.old, r.new) for r in plan.rows] == [
        ("images", f"{OLD}/task-01:t1", f"{OLD}/task-02:t1"),
        ("task_instances", f"{OLD}/task-01:t1", f"{OLD}/task-02:t1"),
    ]  # task-010 is another repository
    assert plan.unmatched_example is None
    assert store.get_task("t1").image_ref == f"{OLD}/task-02:t1"
    coverage.rewrite_refs(store, f"{OLD}/task-02", f"{OLD}/task-01", dry_run=False)
    assert _snapshot(store) == before


def test_rewrite_of_a_bare_host_never_matches_its_port(store: Store) -> None:
    plan = coverage.rewrite_refs(store, "127.0.0.1", "10.0.0.1")
    assert plan.rows == []  # '127.0.0.1:5701/...' is another registry, not '127.0.0.1' + ':tag'
    assert plan.unmatched_example is not None and plan.unmatched_example.startswith("127.0.0.1:")


def test_rewrite_that_matches_nothing_shows_a_recorded_reference(store: Store) -> None:
    before = _snapshot(store)
    plan = coverage.rewrite_refs(store, "127.0.0.1:5799/task-01", "127.0.0.1:5799/task-02", dry_run=False)
    assert plan.rows == [] and plan.applied
    assert plan.unmatched_example == f"{OLD}/env/six:1"
    assert _snapshot(store) == before


def _serve(status: int):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


@pytest.mark.parametrize("status", [200, 401])
def test_registry_answering_v2_with_200_or_401_is_reachable(status: int) -> None:
    server = _serve(status)
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        assert migrate.check_reachable(address) == f"http://{address}/v2/"
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_registry_is_an_exception_naming_the_address() -> None:
    from forgeflow.common.errors import RegistryUnavailableError
    from tests.helpers import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(RegistryUnavailableError, match=rf"target registry {address} is not reachable"):
        migrate.check_reachable(address, what="target", timeout_s=2.0)
    server = _serve(404)  # something answers, but not a registry
    try:
        other = f"127.0.0.1:{server.server_address[1]}"
        with pytest.raises(RegistryUnavailableError, match=r"HTTP 404"):
            migrate.check_reachable(other, timeout_s=2.0)
    finally:
        server.shutdown()
        server.server_close()


def test_transfer_limits_are_bounded_where_they_are_built() -> None:
    """``migrate-images``'s ``limits`` group: the flow's defaults; each bound refused naming its field
    (a bool is not a number of images; at most 10 retry delays, none negative)."""
    from pydantic import ValidationError

    limits = migrate.TransferLimits()
    assert (limits.max_size_bytes, limits.concurrency_limit, limits.rate_limit_per_s, limits.retry_delays_s) == \
        (2_000_000_000, 4, None, None)
    assert migrate.TransferLimits(retry_delays_s=[1, 2.5]).retry_delays_s == (1.0, 2.5)
    for fields, field in [({"concurrency_limit": 0}, "concurrency_limit"), ({"concurrency_limit": 65}, "concurrency_limit"),
                          ({"concurrency_limit": True}, "concurrency_limit"), ({"max_size_bytes": -1}, "max_size_bytes"),
                          ({"rate_limit_per_s": 0}, "rate_limit_per_s"), ({"retry_delays_s": [1.0] * 11}, "retry_delays_s"),
                          ({"retry_delays_s": [-1.0]}, "retry_delays_s"), ({"concurency_limit": 2}, "concurency_limit")]:
        with pytest.raises(ValidationError, match=field):
            migrate.TransferLimits(**fields)
