"""`forgeflow compare` / `forgeflow trials` and the compare flow on a store the test fills itself.

The CLI tests need no Prefect server; the flow test uses the session's Prefect test harness.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from forgeflow.common.fsutil import sha256_file
from forgeflow.ledger.records import (
    JobRecord,
    SupervisionEventRecord,
    TaskRecord,
    TrialRecord,
)
from forgeflow.ledger.store import Store

runner = CliRunner()

# instance -> (repo, reward baseline, reward candidate); None = ModelEndpointError
CASES = {"six.t1": ("six", 1.0, 1.0), "six.t2": ("six", 0.0, 1.0), "toolz.t1": ("toolz", 0.0, 1.0),
         "toolz.t2": ("toolz", None, 0.0)}


def _trial(job: str, instance_id: str, reward: float | None, **extra) -> TrialRecord:
    return TrialRecord(trial_id=f"{job}-{instance_id}", instance_id=instance_id, kind="agent", job_id=job,
                       reward=reward, exception_type=extra.pop("exception_type", None if reward is not None else
                                                               "ModelEndpointError"),
                       exception_message=extra.pop("exception_message", None if reward is not None else "refused"),
                       agent_steps=3, input_tokens=900, timings={"agent_s": 4.0, "verifier_s": 1.0}, **extra)


@pytest.fixture
def home(tmp_path, monkeypatch, flow_store_url: str) -> Path:
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    store = Store(flow_store_url)
    store.upgrade()
    for job in ("base", "cand"):
        store.record_job(JobRecord(job_id=job, kind="canary", freeze_name="demo-v1", split="test"))
    store.record_job(JobRecord(job_id="other", kind="canary", freeze_name="demo-v2", split="test"))
    store.record_job(JobRecord(job_id="base-r1", kind="recovery", parent_job_id="base", freeze_name="demo-v1",
                               split="test"))
    for instance_id, (repo, ra, rb) in CASES.items():
        store.record_task(TaskRecord(instance_id=instance_id, repo=repo, status="accepted"))
        store.record_trial(_trial("base", instance_id, ra))
        store.record_trial(_trial("cand", instance_id, rb))
        store.record_trial(_trial("other", instance_id, rb))
    store.record_trial(_trial("base-r1", "toolz.t2", 1.0))
    store.record_trial(_trial("cand", "six.t2", 0.0, exception_type="AgentHangError", exception_message="idle 700 s"))
    store.record_supervision_event(SupervisionEventRecord(event_id="e1", trial_id="cand-six.t2", job_id="cand",
                                                          kind="hang", evidence={"idle_s": 700.0}))
    return tmp_path


def test_compare_json_reports_merge_split_exclusions_and_costs(home: Path) -> None:
    result = runner.invoke(app, ["compare", "base", "cand", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["runs"]["a"]["label"] == "original job base + 1 recovery job (base-r1)"
    assert out["runs"]["b"]["merged"] is False
    assert out["split_checked"].startswith("freeze demo-v1, split test")
    assert (out["n_pairs"], out["wins"], out["ties"], out["losses"]) == (3, 1, 1, 1)
    assert out["excluded_tasks"] == [{"instance_id": "six.t2", "reason": "exception in B: AgentHangError",
                                      "exception_a": None, "exception_b": "AgentHangError"}]
    assert out["delta_interval"]["clustered_by"] == "repository"
    assert out["costs"]["agent_steps"]["ratio"] == pytest.approx(1.0) and out["costs"]["wall_s"]["mean_a"] == 5.0
    assert out["report_b"]["flagged"] == 1
    alone = json.loads(runner.invoke(app, ["compare", "base", "cand", "--json", "--no-recovery"]).output)
    assert alone["n_pairs"] == 2 and "toolz.t2" in alone["excluded_exception"]


def test_compare_json_carries_the_gate_verdict_reason_and_interval_method(home: Path) -> None:
    out = json.loads(runner.invoke(app, ["compare", "base", "cand", "--json"]).output)
    ci = out["delta_interval"]
    assert ci["method"] == "union(newcombe_hybrid_score, cluster_bootstrap)" and "Newcombe 1998" in ci["source"]
    assert ci["n_clusters"] == 2 and ci["low"] < 0.0 < ci["high"]
    gate = out["promotion"]
    assert gate["verdict"] == "hold" and gate["n_repos"] == 2 and gate["interval_method"] == ci["method"]
    # cand's hang took 1 of its 4 trials (25%), above the default limit of 20%: not compared, the gate holds
    assert gate["reason"].startswith("not compared: job cand is unusable: 1 of 4 trials (25.0%): AgentHangError 1 "
                                     "(25.0%) excluded as exceptions, above the limit 20.0%")
    assert "the pairs alone: hold (not enough evidence: 3 pairs < 30, 2 repositories < 3; delta +0.0 pp" in gate["reason"]
    assert gate["repos_needed"] == 3 and gate["pairs_needed"] > 30
    # the gate's settings are options; a drop allowance of 100 points on 1 pair from 1 repository, with a quarter
    # of a job's trials allowed to be exceptions (25% is not above 0.25), promotes
    lenient = runner.invoke(app, ["compare", "base", "cand", "--json", "--min-pairs", "1", "--min-repos", "1",
                                  "--max-drop", "1.0", "--max-exception-rate", "0.25"])
    assert lenient.exit_code == 0, lenient.output
    assert json.loads(lenient.output)["promotion"]["verdict"] == "promote"
    bad = runner.invoke(app, ["compare", "base", "cand", "--alpha", "0.9"])
    assert bad.exit_code == 2 and "alpha" in bad.output
    assert "**Promotion gate: hold** (not compared: job cand is unusable" in runner.invoke(
        app, ["compare", "base", "cand"]).output


def test_compare_refuses_jobs_on_different_freezes(home: Path) -> None:
    result = runner.invoke(app, ["compare", "base", "other"])
    assert result.exit_code == 2
    assert "freeze: base has 'demo-v1', other has 'demo-v2'" in result.output


def test_trials_json_flags_and_merged_view(home: Path) -> None:
    rows = {r["instance_id"]: r for r in json.loads(runner.invoke(app, ["trials", "--job", "cand", "--json"]).output)}
    assert rows["six.t2"]["exception_type"] == "AgentHangError" and rows["six.t2"]["reward"] == 0.0
    assert rows["six.t2"]["flagged"] is True and rows["six.t2"]["supervision"] == "hang"
    assert rows["six.t1"]["flagged"] is False and rows["six.t1"]["agent_steps"] == 3
    merged = json.loads(runner.invoke(app, ["trials", "--job", "base", "--merged", "--json"]).output)
    assert merged["view"] == "original job base + 1 recovery job (base-r1)"
    assert merged["recovery_job_ids"] == ["base-r1"] and merged["from_recovery"] == {"toolz.t2": "base-r1"}
    by_id = {r["instance_id"]: r for r in merged["trials"]}
    assert by_id["toolz.t2"]["job_id"] == "base-r1" and by_id["toolz.t2"]["reward"] == 1.0
    plain = {r["instance_id"]: r for r in json.loads(runner.invoke(app, ["trials", "--job", "base", "--json"]).output)}
    assert plain["toolz.t2"]["exception_type"] == "ModelEndpointError", "the original is never rewritten"


def test_trials_lists_a_validation_job_and_only_the_merged_view_refuses_it(home: Path, flow_store_url: str) -> None:
    """``forgeflow trials`` names a curate job among the jobs; ``--job`` on it lists its NOP and Oracle trials
    (a paired view of them is what ``--merged`` and ``compare`` refuse, not a listing); an unknown job is
    refused naming the jobs there are."""
    store = Store(flow_store_url)
    for kind, reward in (("nop", 0.0), ("oracle", 1.0)):
        store.record_trial(TrialRecord(trial_id=f"curate-b1-six.t1-{kind}", instance_id="six.t1", kind=kind,
                                       job_id="curate-b1", reward=reward))
    store.dispose()
    assert "curate-b1 2 trials" in " ".join(runner.invoke(app, ["trials"]).output.split())  # rich expands tabs
    listed = runner.invoke(app, ["trials", "--job", "curate-b1", "--json"])
    assert listed.exit_code == 0, listed.output
    assert sorted((r["kind"], r["reward"]) for r in json.loads(listed.output)) == [("nop", 0.0), ("oracle", 1.0)]
    table = runner.invoke(app, ["trials", "--job", "curate-b1"])
    assert table.exit_code == 0 and "oracle" in table.output and "nop" in table.output, table.output
    merged = runner.invoke(app, ["trials", "--job", "curate-b1", "--merged"])
    assert merged.exit_code == 2 and "holds nop/oracle trials" in merged.output
    unknown = runner.invoke(app, ["trials", "--job", "nope"])
    assert unknown.exit_code == 2 and "job 'nope' has no trials" in unknown.output and "curate-b1" in unknown.output


@pytest.mark.slow
def test_compare_flow_writes_report_and_plot_and_references_the_plot(home: Path, prefect_harness) -> None:
    from flows.stages import CompareParams, compare

    report = home / "reports" / "base-vs-cand.md"
    result = compare(CompareParams(job_a="base", job_b="cand", report_path=report))
    assert (result.paired.wins, result.paired.losses) == (1, 1)
    png = report.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the report and plot with their digests, and the gate's decision on the pairs
    assert result.files.report_path == report and result.files.report_sha256 == sha256_file(report)
    assert result.files.plot_path == png and result.files.plot_sha256 == sha256_file(png)
    assert result.decision.verdict == "hold" and result.job_a.recovery_job_ids == ["base-r1"]
    # the comparison is cached on what it read from the store; the files are written anew
    report.unlink()
    again = compare(CompareParams(job_a="base", job_b="cand", report_path=report), return_state=True)
    assert again.result().paired == result.paired and report.exists()
    text = report.read_text()
    assert f"]({png.name})" in text and "original job base + 1 recovery job (base-r1)" in text


def test_lifecycle_compare_task_lists_exclusions_and_counts_flagged_trials(flow_store_url: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The compare stage's cached comparison (``tasks.evaluation.compare_stored_jobs``, what the
    ``compare`` flow runs) on two canary jobs recorded as the canary records them (``TrialRecord.from_trial``)."""
    from datetime import UTC, datetime

    from forgeflow.evaluation.compare.gate import GatePolicy
    from forgeflow.ledger.records import TrialRecord
    from forgeflow.sandbox.trial import TrialResult as CoreTrial
    from tasks.evaluation import compare_stored_jobs

    def core(iid: str, reward: float | None, exc: str | None = None, agent_s: float = 4.0) -> CoreTrial:
        return CoreTrial(trial_id=f"t-{iid}-{agent_s}", instance_id=iid, kind="agent", reward=reward,
                         exception_type=exc, exception_message=exc and "stopped", started_at=datetime.now(UTC),
                         env_setup_s=0.1, agent_s=agent_s, verifier_s=1.0, agent_steps=2, input_tokens=100)

    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    store = Store(flow_store_url)
    store.upgrade()
    for iid in ("six.t1", "six.t2", "toolz.t1"):
        store.record_task(TaskRecord(instance_id=iid, repo=iid.split(".")[0], status="accepted"))
    jobs = {"lc-base": [core("six.t1", 1.0), core("six.t2", 0.0), core("toolz.t1", 0.0, agent_s=100.0)],
            "lc-cand": [core("six.t1", 1.0, agent_s=2.0), core("six.t2", 1.0, agent_s=2.0),
                        core("toolz.t1", 1.0, "AgentHangError", agent_s=700.0)]}
    for job_id, trials in jobs.items():
        store.record_job(JobRecord(job_id=job_id, kind="canary", freeze_name="demo-v1", split="test"))
        for t in trials:
            store.record_trial(TrialRecord.from_trial(t, job_id, None, None))
    result = compare_stored_jobs.fn("lc-base", "lc-cand", False, 0, GatePolicy())
    assert [(e.instance_id, e.reason) for e in result.excluded] == [("toolz.t1", "exception in B: AgentHangError")]
    assert result.report_b.flagged == 1 and result.report_b.scored == 2
    assert result.costs.wall_s.n == 2 and result.costs.wall_s.ratio == pytest.approx(3.0 / 5.0)  # pairs only
    assert "toolz.t1 (exception in B: AgentHangError)" in result.markdown
    # 1 of lc-cand's 3 trials excluded (33%): unusable at the default 20%, said with its count and rate
    assert result.exclusions_b.unusable and not result.exclusions_a.unusable
    assert result.decision.verdict == "hold" and result.decision.reason.startswith(
        "not compared: job lc-cand is unusable: 1 of 3 trials (33.3%): AgentHangError 1 (33.3%)")
    assert "the pairs alone: hold (not enough evidence: 2 pairs < 30" in result.decision.reason
    assert "| AgentHangError | 1 | 33.3% |" in result.markdown
