"""`forgeflow recover` and `forgeflow derived build|verify` on a store the test fills itself.

The dry runs and the derived-set commands read the store only (no Prefect server); `recover
--apply` runs the real ``recover`` flow on the session's Prefect test harness.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from forgeflow.ledger.records import BatchRecord, TaskRecord, TrialRecord
from forgeflow.ledger.store import Store
from tests.helpers import task_status_counts

runner = CliRunner()
T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


@pytest.fixture
def home(tmp_path: Path, monkeypatch, flow_store_url: str) -> Path:
    """A store with one batch: ``repo.a`` broke on a registry fault (error), ``repo.b`` was a real
    rejection, ``repo.c`` accepted; a second batch had one fault an hour later (``repo.d``)."""
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    store = Store(flow_store_url)
    store.upgrade()

    def trial(iid: str, reward: float | None, when: datetime, batch: str) -> TrialRecord:
        return TrialRecord(trial_id=f"t-{iid}", instance_id=f"repo.{iid}", kind="nop", batch_id=batch, job_id="curate",
                           reward=reward, created_at=when,
                           exception_type=None if reward is not None else "RegistryUnavailableError",
                           exception_message=None if reward is not None else "registry answered 503")

    def task(iid: str, status: str, repo: str) -> TaskRecord:
        return TaskRecord(instance_id=f"repo.{iid}", repo=repo, status=status, reason=f"{status} in test")

    store.record_batch_results(BatchRecord(batch_id="b1", kind="curate", instance_ids=["repo.a", "repo.b", "repo.c"],
                                           concurrency=2),
                               [trial("a", None, T0, "b1"), trial("b", 1.0, T0, "b1"), trial("c", 0.0, T0, "b1")],
                               [task("a", "error", "r1"), task("b", "rejected", "r1"), task("c", "accepted", "r2")])
    store.record_batch_results(BatchRecord(batch_id="b2", kind="curate", instance_ids=["repo.d"], concurrency=1),
                               [trial("d", None, T0 + timedelta(hours=1), "b2")], [task("d", "error", "r2")])
    return tmp_path


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # Prefect's log lines go to stderr


def test_recover_dry_run_by_batch_lists_only_the_broken_trial_and_changes_nothing(home: Path) -> None:
    before = task_status_counts(Store())
    out = _json(runner.invoke(app, ["recover", "--batch", "b1", "--json"]))
    assert out["dry_run"] is True
    assert [t["trial_id"] for t in out["void"]] == ["t-a"]
    assert [t["instance_id"] for t in out["requeue"]] == ["repo.a"]
    assert sorted(k["trial_id"] for k in out["kept"]) == ["t-b", "t-c"]  # real outcomes stay
    after = task_status_counts(Store())
    assert after == before and len(Store().trials_for()) == 4

    text = runner.invoke(app, ["recover", "--trial", "t-a", "--trial", "t-b"])
    assert text.exit_code == 0, text.output
    assert "void    t-a" in text.output and "dry run: nothing changed" in text.output


def test_recover_by_exception_type_uses_the_window_and_refuses_without_one(home: Path) -> None:
    window = ["--exception-type", "RegistryUnavailableError", "--since", (T0 + timedelta(minutes=30)).isoformat(),
              "--until", (T0 + timedelta(hours=2)).isoformat(), "--json"]
    out = _json(runner.invoke(app, ["recover", *window]))
    assert [t["trial_id"] for t in out["void"]] == ["t-d"]  # t-a is outside the window

    no_window = runner.invoke(app, ["recover", "--exception-type", "RegistryUnavailableError"])
    assert no_window.exit_code == 2
    assert "time window" in no_window.output

    naive = runner.invoke(app, ["recover", "--exception-type", "X", "--since", "2026-11-30T10:00:00",
                                "--until", "2026-11-30T11:00:00"])
    assert naive.exit_code == 2 and "timezone-aware" in naive.output


def test_recover_unknown_batch_and_apply_without_reason_fail_clearly(home: Path) -> None:
    unknown = runner.invoke(app, ["recover", "--batch", "nosuch"])
    assert unknown.exit_code == 2 and "nosuch" in unknown.output
    no_reason = runner.invoke(app, ["recover", "--batch", "b1", "--apply"])
    assert no_reason.exit_code == 2 and "--reason" in no_reason.output
    assert {t.instance_id: t.status for t in Store().tasks()}["repo.a"] == "error"  # nothing applied


def test_recover_apply_runs_the_flow_backs_up_voids_and_requeues(home: Path, prefect_harness) -> None:
    out = _json(runner.invoke(app, ["recover", "--batch", "b1", "--apply", "--reason", "registry outage 10:00",
                                    "--json"]))
    assert out["dry_run"] is False and out["voided"] == 1 and out["requeued"] == 1
    backup = Path(out["backup_path"])
    assert backup.parent == home / "recovery"
    assert hashlib.sha256(backup.read_bytes()).hexdigest() == out["backup_sha256"]
    assert [t["trial_id"] for t in json.loads(backup.read_text())["trials"]] == ["t-a"]

    store = Store()
    statuses = {t.instance_id: t.status for t in store.tasks()}
    assert statuses == {"repo.a": "candidate", "repo.b": "rejected", "repo.c": "accepted", "repo.d": "error"}
    assert {t.trial_id for t in store.trials_for()} == {"t-b", "t-c", "t-d"}  # void: out of the counts
    assert len(store.trials_for(include_void=True)) == 4  # ... but kept for audit

    again = _json(runner.invoke(app, ["recover", "--batch", "b1", "--json"]))
    assert again["void"] == [] and again["requeue"] == []


def test_recover_include_rejections_voids_and_requeues_the_named_rejection_only(home: Path, prefect_harness) -> None:
    """A rejection an infrastructure fault caused (repo.b in b1) is voided and requeued by its batch id
    with --include-rejections; the accepted task stays, and so does everything outside the ids."""
    dry = _json(runner.invoke(app, ["recover", "--batch", "b1", "--include-rejections", "--json"]))
    assert [(t["trial_id"], t["reward"]) for t in dry["void"]] == [("t-a", None), ("t-b", 1.0)]
    assert [t["instance_id"] for t in dry["requeue"]] == ["repo.a", "repo.b"]
    assert [k["trial_id"] for k in dry["kept"]] == ["t-c"]
    assert Store().get_task("repo.b").status == "rejected"  # a dry run changes nothing

    out = _json(runner.invoke(app, ["recover", "--batch", "b1", "--include-rejections", "--apply", "--reason",
                                    "build tunnel down 10:00", "--json"]))
    assert out["voided"] == 2 and out["requeued"] == 2
    backup = json.loads(Path(out["backup_path"]).read_text())
    assert backup["request"]["include_rejections"] is True
    assert {t["trial_id"] for t in backup["trials"]} == {"t-a", "t-b"}
    assert hashlib.sha256(Path(out["backup_path"]).read_bytes()).hexdigest() == out["backup_sha256"]
    assert "include_rejections" in Path(out["backup_path"]).with_suffix(".md").read_text()  # the audit
    statuses = {t.instance_id: t.status for t in Store().tasks()}
    assert statuses == {"repo.a": "candidate", "repo.b": "candidate", "repo.c": "accepted", "repo.d": "error"}
    assert out["after"]["tasks_by_status"] == {"candidate": 2, "accepted": 1, "error": 1}


def test_derived_build_then_verify_and_a_changed_input_is_named(home: Path, tmp_path: Path) -> None:
    solved = tmp_path / "solved.txt"
    solved.write_text("repo.c\nrepo.b\nrepo.x\n")
    build = ["derived", "build", "hard", "--define", "verified_any = accepted | rejected",
             "--define", "hard = verified_any - solved", "--id-list", f"solved={solved}@run-42", "--json"]
    out = _json(runner.invoke(app, build))
    assert out["count"] == 0 and out["inputs"]["solved"]["count"] == 3
    out = _json(runner.invoke(app, ["derived", "build", "verified_any", "--define",
                                    "verified_any = accepted ∪ rejected", "--json"]))
    assert out["count"] == 2 and Path(out["path"]) == home / "derived" / "verified_any.json"

    ok = _json(runner.invoke(app, ["derived", "verify", "verified_any", "--json"]))
    assert ok["ok"] is True and ok["ids_sha256"] == out["ids_sha256"]

    Store().record_task(TaskRecord(instance_id="repo.e", repo="r3", status="accepted"))
    changed = runner.invoke(app, ["derived", "verify", "verified_any"])
    assert changed.exit_code == 2
    assert "'accepted'" in changed.output and "inputs changed" in changed.output


def test_derived_build_over_a_freeze_counts_per_split_and_unknown_names_fail(home: Path) -> None:
    from forgeflow.curation import freeze
    from forgeflow.ledger.records import FreezeRecord

    accepted = [freeze.TaskRef(instance_id=f"r{r}.t{i}", repo=f"r{r}") for r in range(3) for i in range(2)]
    quotas = freeze.SplitQuotas(train=1, validation=1, test=1, max_per_repo=2, min_repos=3)
    manifest = freeze.write_freeze("v1", freeze.select_splits(accepted, quotas, 0), quotas, 0,
                                   home / "demo" / "freezes")
    Store().record_freeze(FreezeRecord(name="v1", semantic_sha256=manifest.semantic_sha256,
                                       file_sha256=manifest.file_sha256, manifest_path=str(manifest.path)))
    definitions = home / "defs.txt"
    definitions.write_text("# test split minus nothing\nfrozen_test = frozen.test - rejected\n")
    out = _json(runner.invoke(app, ["derived", "build", "frozen_test", "--definitions", str(definitions),
                                    "--freeze", "v1", "--json"]))
    assert out["count"] == len(manifest.splits["test"])
    assert out["split_counts"]["v1"]["test"] == out["count"] and out["split_counts"]["v1"]["train"] == 0
    assert _json(runner.invoke(app, ["derived", "verify", "frozen_test", "--json"]))["ok"] is True

    unknown = runner.invoke(app, ["derived", "build", "bad", "--define", "bad = accepted & nosuch"])
    assert unknown.exit_code == 2 and "nosuch" in unknown.output and "images_available" in unknown.output
    undefined = runner.invoke(app, ["derived", "build", "other", "--define", "bad = accepted"])
    assert undefined.exit_code == 2 and "'other' is not defined" in undefined.output


@pytest.mark.parametrize(("args", "expected"), [
    ([], "give --batch and/or --trial, or --exception-type with --since/--until"),
    (["--batch", "b1", "--exception-type", "X"], "select by ids or by --exception-type within a window, not both"),
    (["--batch", "b1", "--since", "2026-11-30T10:00:00+00:00"], "--since/--until apply only with --exception-type"),
    (["--exception-type", "X", "--since", "2026-11-30T10:00:00+00:00"],
     "--exception-type 'X' needs a time window (--since and --until)"),
    (["--exception-type", "X", "--since", "2026-11-30T11:00:00+00:00", "--until", "2026-11-30T10:00:00+00:00"],
     "empty window: --since 2026-11-30 11:00:00+00:00 is not before --until"),
    (["--exception-type", "X", "--since", "2026-11-30T10:00:00", "--until", "2026-11-30T11:00:00+00:00"],
     "--since: must be timezone-aware"),
    (["--exception-type", "X", "--since", "2026-11-30T10:00:00+00:00", "--until", "2026-11-30T11:00:00+00:00",
      "--include-rejections"], "--include-rejections needs exact --batch and/or --trial, not an --exception-type window"),
    (["--batch", "nosuch"], "unknown --batch ids ['nosuch']"),
    (["--trial", "nosuch"], "unknown --trial ids ['nosuch']"),
])
def test_recover_errors_name_the_flags_the_user_typed(home: Path, args: list[str], expected: str) -> None:
    result = runner.invoke(app, ["recover", *args])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert expected in text
    assert not any(field in text for field in ("batch_ids", "trial_ids", "exception_type", "Value error"))


def test_derived_rebuild_with_other_content_needs_replace_and_keeps_the_old_file(home: Path) -> None:
    build = ["derived", "build", "acc", "--define", "acc = accepted", "--json"]
    first = _json(runner.invoke(app, build))
    assert first["written"] is True and first["count"] == 1
    path = Path(first["path"])
    before = path.read_bytes()
    again = _json(runner.invoke(app, build))
    assert again["written"] is False and again["replaced"] is None and path.read_bytes() == before

    Store().record_task(TaskRecord(instance_id="repo.e", repo="r3", status="accepted"))
    refused = runner.invoke(app, build)
    assert refused.exit_code == 2
    text = " ".join(refused.output.split())
    assert f"already exists at {path} with 1 ids, ids sha256 {first['ids_sha256']}" in text
    assert "the rebuild has 2 ids" in text and "--replace" in text
    assert path.read_bytes() == before

    replaced = _json(runner.invoke(app, [*build, "--replace"]))
    assert replaced["written"] is True and replaced["count"] == 2
    assert replaced["replaced"]["count"] == 1 and replaced["replaced"]["ids_sha256"] == first["ids_sha256"]
    assert Path(replaced["replaced"]["path"]).read_bytes() == before  # the previous content is kept
    assert _json(runner.invoke(app, ["derived", "verify", "acc", "--json"]))["count"] == 2


def test_recover_an_exception_type_the_store_never_recorded_is_an_error_listing_the_known_ones(home: Path) -> None:
    """A typo in --exception-type must not read as "nothing to recover" (an empty plan, exit 0)."""
    window = ["--since", T0.isoformat(), "--until", (T0 + timedelta(hours=2)).isoformat()]
    typo = runner.invoke(app, ["recover", "--exception-type", "NoSuchError", *window])
    assert typo.exit_code == 2, typo.output
    text = " ".join(typo.output.split())
    assert "--exception-type 'NoSuchError' is not recorded" in text
    assert "the store has: RegistryUnavailableError" in text
    # a forgeflow exception class the store has not seen yet is a real (empty) selection
    known = runner.invoke(app, ["recover", "--exception-type", "SandboxOOMError", *window, "--json"])
    assert _json(known)["void"] == []
