"""Comparing jobs recorded in a real SQLite store: frozen-split check, repository clustering, cost
ratios from the stored trial columns, excluded tasks with reasons, merged recovery views, the plot."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.compare import (
    JobReport,
    compare_stored_jobs,
    merged_job,
    render_plot,
    wilson_interval,
)
from forgeflow.evaluation.compare.gate import GatePolicy
from forgeflow.evaluation.paired_stats import cluster_bootstrap_delta
from forgeflow.ledger.records import JobRecord, TaskRecord, TrialRecord
from forgeflow.ledger.store import Store

# instance -> (repo, reward in A, reward in B); None = an exception
CASES = {
    "boltons.t1": ("boltons", 1.0, 1.0),
    "boltons.t2": ("boltons", 0.0, 1.0),
    "boltons.t3": ("boltons", 0.0, 1.0),
    "six.t1": ("six", 1.0, 0.0),
    "six.t2": ("six", 0.0, 0.0),
    "toolz.t1": ("toolz", 0.0, 1.0),
    "toolz.t2": ("toolz", None, 1.0),  # exception in A
}


def trial(job: str, instance_id: str, reward: float | None, exc: str = "SandboxOOMError", *, steps: int = 4,
          tokens: int = 1000, agent_s: float = 10.0, suffix: str = "") -> TrialRecord:
    return TrialRecord(
        trial_id=f"{job}-{instance_id}{suffix}", instance_id=instance_id, kind="agent", job_id=job, reward=reward,
        exception_type=None if reward is not None else exc,
        exception_message=None if reward is not None else "killed", agent_steps=steps, input_tokens=tokens,
        output_tokens=50, timings={"agent_s": agent_s, "verifier_s": 2.0},
    )


@pytest.fixture
def store(store_url: str) -> Store:
    s = Store(store_url)
    s.upgrade()
    for instance_id, (repo, _, _) in CASES.items():
        s.record_task(TaskRecord(instance_id=instance_id, repo=repo, status="accepted"))
    s.record_job(JobRecord(job_id="base", kind="canary", freeze_name="demo-v1", split="test"))
    s.record_job(JobRecord(job_id="cand", kind="canary", freeze_name="demo-v1", split="test"))
    for instance_id, (_, ra, rb) in CASES.items():
        s.record_trial(trial("base", instance_id, ra, steps=4, tokens=1000, agent_s=10.0))
        s.record_trial(trial("cand", instance_id, rb, steps=2, tokens=1500, agent_s=5.0))
    return s


def test_pairs_are_clustered_by_repository_from_the_task_table(store: Store) -> None:
    result = compare_stored_jobs(store, "base", "cand", seed=7)
    p = result.paired
    assert (p.n_pairs, p.wins, p.ties, p.losses) == (6, 3, 2, 1)
    assert p.excluded_exception == ["toolz.t2"]
    assert p.per_repo["boltons"].wins == 2 and p.per_repo["six"].losses == 1
    ci = p.delta_interval
    assert ci.clustered_by == "repository" and ci.n_clusters == 3
    # the interval is the repository bootstrap, not the per-instance one
    pairs = {"boltons.t1": (True, True), "boltons.t2": (False, True), "boltons.t3": (False, True),
             "six.t1": (True, False), "six.t2": (False, False), "toolz.t1": (False, True)}
    repos = {i: CASES[i][0] for i in pairs}
    assert ci.bootstrap == cluster_bootstrap_delta(pairs, repos, seed=7)
    assert ci.bootstrap != cluster_bootstrap_delta(pairs, None, seed=7)
    # the reported interval is the union with Newcombe's on the same 6 pairs
    assert ci.low == min(ci.newcombe.low, ci.bootstrap.low) and ci.high == max(ci.newcombe.high, ci.bootstrap.high)


def test_the_gate_holds_on_six_pairs_and_names_the_token_ratio(store: Store) -> None:
    result = compare_stored_jobs(store, "base", "cand")
    decision = result.decision
    assert decision.verdict == "hold" and decision.n_repos == 3 and decision.n_pairs == 6
    assert decision.reason.startswith("not enough evidence: 6 pairs < 30; delta +33.3 pp")
    assert "cost over the limit: input_tokens 1.5x > 1.25x" in decision.reason
    out = result.to_json()
    assert out["promotion"]["verdict"] == "hold" and out["promotion"]["reason"] == decision.reason
    assert out["delta_interval"]["method"] == "union(newcombe_hybrid_score, cluster_bootstrap)"
    assert "**Promotion gate: hold** (not enough evidence" in result.markdown
    # the gate's settings come in through compare_stored_jobs
    lenient = compare_stored_jobs(store, "base", "cand", gate=GatePolicy(min_pairs=1, min_repos=1, max_drop=1.0,
                                                                         max_input_tokens_ratio=None))
    assert lenient.decision.verdict == "promote"


def test_cost_ratios_come_from_the_stored_columns_over_the_pairs(store: Store) -> None:
    costs = compare_stored_jobs(store, "base", "cand").costs
    assert costs.agent_steps.n == 6 and costs.agent_steps.ratio == pytest.approx(0.5)
    assert costs.input_tokens.mean_a == pytest.approx(1000) and costs.input_tokens.ratio == pytest.approx(1.5)
    assert costs.wall_s.mean_a == pytest.approx(12.0) and costs.wall_s.mean_b == pytest.approx(7.0)


def test_excluded_tasks_are_listed_with_their_reason_in_json_and_markdown(store: Store) -> None:
    store.record_trial(trial("cand", "six.t2", None, exc="ModelEndpointError"))  # B breaks on six.t2 too
    result = compare_stored_jobs(store, "base", "cand")
    reasons = {e.instance_id: e.reason for e in result.excluded}
    assert reasons == {"toolz.t2": "exception in A: SandboxOOMError", "six.t2": "exception in B: ModelEndpointError"}
    out = result.to_json()
    assert out["n_pairs"] == 5 and {e["instance_id"] for e in out["excluded_tasks"]} == {"toolz.t2", "six.t2"}
    assert out["report_b"]["exceptions_by_type"] == {"ModelEndpointError": 1}
    assert "toolz.t2 (exception in A: SandboxOOMError)" in result.markdown


def test_jobs_on_different_frozen_splits_are_refused_naming_the_difference(store: Store) -> None:
    store.record_job(JobRecord(job_id="val", kind="canary", freeze_name="demo-v1", split="validation"))
    store.record_job(JobRecord(job_id="v2", kind="canary", freeze_name="demo-v2", split="test"))
    for instance_id, (_, ra, _) in CASES.items():
        store.record_trial(trial("val", instance_id, ra))
        store.record_trial(trial("v2", instance_id, ra))
    with pytest.raises(InputError, match="split: base has 'test', val has 'validation'"):
        compare_stored_jobs(store, "base", "val")
    with pytest.raises(InputError, match="freeze: base has 'demo-v1', v2 has 'demo-v2'"):
        compare_stored_jobs(store, "base", "v2")
    store.record_trial(trial("loose", "six.t1", 1.0))  # trials without a jobs row
    with pytest.raises(InputError, match="'loose' has no row in the jobs table"):
        compare_stored_jobs(store, "base", "loose")
    with pytest.raises(InputError, match="'nope' has no trials"):
        compare_stored_jobs(store, "base", "nope")


def test_recovery_jobs_merge_into_a_view_that_says_so(store: Store) -> None:
    store.record_job(JobRecord(job_id="base-r1", kind="recovery", parent_job_id="base", freeze_name="demo-v1",
                               split="test"))
    store.record_trial(trial("base-r1", "toolz.t2", 1.0))
    view = merged_job(store, "base")
    assert view.label == "original job base + 1 recovery job (base-r1)" and view.is_merged
    assert view.from_recovery == {"toolz.t2": "base-r1"}
    assert {t.instance_id: t.job_id for t in view.trials}["toolz.t2"] == "base-r1"
    result = compare_stored_jobs(store, "base", "cand")
    assert result.paired.n_pairs == 7 and result.excluded == []
    assert "A = original job base + 1 recovery job (base-r1)" in result.markdown
    assert result.to_json()["runs"]["a"]["recovery_job_ids"] == ["base-r1"]
    alone = compare_stored_jobs(store, "base", "cand", merge_recovery=False)
    assert alone.paired.n_pairs == 6 and "not merged: base-r1" in alone.job_a.label
    # a recovery never overrides a trial that had a reward
    store.record_trial(trial("base-r1", "six.t1", 0.0))
    assert {t.instance_id: t.reward for t in merged_job(store, "base").trials}["six.t1"] == 1.0


def test_a_flagged_trial_is_an_exception_with_its_reward_kept(store: Store) -> None:
    store.record_trial(TrialRecord(trial_id="cand-loop", instance_id="six.t1", kind="agent", job_id="cand",
                                   reward=1.0, exception_type="AgentLoopError", exception_message="dead loop"))
    store.record_trial(TrialRecord(trial_id="cand-six.t1", instance_id="six.t1", kind="agent", job_id="x",
                                   reward=0.0))  # moved out of the job
    result = compare_stored_jobs(store, "base", "cand")
    report = result.report_b
    assert report.exceptions_by_type == {"AgentLoopError": 1} and report.flagged == 1 and report.flagged_reward_1 == 1
    assert report.scored == 6 and report.reward_1 == 5  # not counted as a pass
    assert "six.t1" in result.paired.excluded_exception
    assert "flagged: reward kept beside the exception" in result.markdown
    assert JobReport.from_trials([]).flagged == 0


def test_plot_is_a_png_with_both_panels(store: Store, tmp_path: Path) -> None:
    result = compare_stored_jobs(store, "base", "cand", plot_file="cmp.png")
    path = render_plot(result.report_a, result.report_b, result.paired, tmp_path / "cmp.png", "base", "cand")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (900, 360)
    assert "![pass rates with Wilson intervals; wins and losses per repository](cmp.png)" in result.markdown
    assert result.report_a.wilson == wilson_interval(2, 6)


def test_a_validation_job_or_the_same_job_twice_is_refused(store: Store) -> None:
    """A validation job has a NOP and an Oracle trial per instance: keeping 'the latest' of them
    would report the Oracle's 1s as a pass rate; the same job twice is no comparison."""
    from forgeflow.evaluation.compare import merged_job

    store.record_trials([
        TrialRecord(trial_id="v-nop", instance_id="six.t1", kind="nop", job_id="validate-0", reward=0.0),
        TrialRecord(trial_id="v-oracle", instance_id="six.t1", kind="oracle", job_id="validate-0", reward=1.0),
    ])
    with pytest.raises(InputError, match="'validate-0' holds nop/oracle trials"):
        compare_stored_jobs(store, "validate-0", "cand")
    with pytest.raises(InputError, match="holds nop/oracle trials"):
        merged_job(store, "validate-0")
    with pytest.raises(InputError, match="both runs are job 'base'"):
        compare_stored_jobs(store, "base", "base")


def test_comparison_settings_read_as_a_flow_parameter_group() -> None:
    """The ``promote`` flow's ``comparison`` group: a JSON dict (UI, API) validates into the gate's
    own model; an unknown or misspelt setting is refused, naming it; the defaults are the flow's."""
    from pydantic import ValidationError

    from forgeflow.evaluation.compare import ComparisonSettings

    assert ComparisonSettings() == ComparisonSettings(gate=None, report_path=None, merge_recovery=True, seed=0)
    settings = ComparisonSettings.model_validate({"gate": {"min_pairs": 6, "max_wall_s_ratio": None},
                                                  "report_path": "/tmp/r.md", "seed": 3})
    assert settings.gate == GatePolicy(min_pairs=6, max_wall_s_ratio=None) and settings.report_path == Path("/tmp/r.md")
    with pytest.raises(ValidationError, match="merge_recovry"):
        ComparisonSettings.model_validate({"merge_recovry": False})
    with pytest.raises(ValidationError, match="gate.min_pairs"):
        ComparisonSettings.model_validate({"gate": {"min_pairs": 0}})
