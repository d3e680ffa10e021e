"""``forgeflow rescore`` answers without a Prefect server: a typo'd job id (exit 2, naming the canary jobs the store
has, before anything starts), a recovery job, and ``--dry-run`` (what would be re-verified, carried over or missing).
The run itself is in ``test_rescore_flow.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from forgeflow.ledger.records import JobRecord, TrialRecord
from forgeflow.ledger.store import Store

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flow_store_url: str) -> Path:
    """A canary job ``canary-1``: one trial whose agent never made a submission, one whose trajectory is gone."""
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    store = Store(flow_store_url)
    store.upgrade()
    folder = tmp_path / "trajectories"
    folder.mkdir()
    store.record_job(JobRecord(job_id="canary-1", kind="canary", freeze_name="f", split="test",
                               params={"trajectories_dir": str(folder)}))
    store.record_job(JobRecord(job_id="canary-1-r1", kind="recovery", parent_job_id="canary-1"))
    store.record_trial(TrialRecord(trial_id="t-a", instance_id="calc.a", kind="agent", job_id="canary-1", reward=None,
                                   exception_type="ModelEndpointError", exception_message="refused"))
    (folder / "t-a.traj.json").write_text(json.dumps({"info": {"submission": "", "forgeflow": {
        "error": "ModelEndpointError: refused"}}}))
    store.record_trial(TrialRecord(trial_id="t-b", instance_id="calc.b", kind="agent", job_id="canary-1", reward=1.0))
    store.dispose()
    return tmp_path


def test_rescore_of_a_typo_or_a_recovery_job_exits_2_naming_the_jobs(home: Path) -> None:
    typo = runner.invoke(app, ["rescore", "canary-2"])
    assert typo.exit_code == 2
    assert "job 'canary-2' is not recorded in the store" in typo.output and "canary and rescore jobs: canary-1" in typo.output
    recovery = runner.invoke(app, ["rescore", "canary-1-r1", "--dry-run"])
    assert recovery.exit_code == 2 and "give the original job ('canary-1')" in recovery.output
    for dry in ([], ["--dry-run"]):  # the flow's parameter model checks the options, a dry run's too
        empty = runner.invoke(app, ["rescore", "canary-1", "--rescore-job-id", "", *dry])
        assert empty.exit_code == 2 and "--rescore-job-id: String should have at least 1 character" in empty.output


def test_rescore_dry_run_lists_what_is_carried_over_and_missing_and_changes_nothing(home: Path) -> None:
    before = Store().counts()
    out = runner.invoke(app, ["rescore", "canary-1", "--dry-run", "--json"])
    assert out.exit_code == 0, out.output
    plan = json.loads(out.stdout)
    assert plan["counts"] == {"trials": 2, "reverify": 0, "carried": 1, "missing": 1}
    assert plan["job_id"].startswith("canary-1-rescore-")
    items = {i["instance_id"]: i for i in plan["items"]}
    assert items["calc.a"]["action"] == "carried" and "ModelEndpointError" in items["calc.a"]["reason"]
    assert items["calc.b"]["action"] == "missing" and "no trajectory at" in items["calc.b"]["reason"]
    text = runner.invoke(app, ["rescore", "canary-1", "--dry-run"])
    assert text.exit_code == 0 and "0 to re-verify, 1 carried over, 1 missing" in text.output
    assert Store().counts() == before
