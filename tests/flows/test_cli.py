"""The forgeflow CLI on a store the test fills itself (no Prefect server needed)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flows.cli import app
from forgeflow.store import Store, TrialRecord

runner = CliRunner()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("FORGEFLOW_STORE_URL", raising=False)
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    outcomes = {"a": [1.0, 0.0, 0.0, None], "b": [1.0, 1.0, 0.0, 1.0]}
    for job, rewards in outcomes.items():
        for i, reward in enumerate(rewards):
            store.record_trial(TrialRecord(
                trial_id=f"{job}-{i}", instance_id=f"repo.task__{i}", kind="agent", job_id=job, reward=reward,
                exception_type=None if reward is not None else "ModelEndpointError",
                exception_message=None if reward is not None else "connection refused"))
    return tmp_path


def test_trials_json_shows_reward_or_exception_per_trial(home):
    result = runner.invoke(app, ["trials", "--job", "a", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["instance_id"]: r for r in json.loads(result.output)}
    assert rows["repo.task__3"]["reward"] is None and rows["repo.task__3"]["exception_type"] == "ModelEndpointError"
    assert rows["repo.task__0"]["reward"] == 1.0


def test_compare_json_excludes_exception_pairs(home):
    result = runner.invoke(app, ["compare", "a", "b", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert (out["n_pairs"], out["wins"], out["ties"], out["losses"]) == (3, 1, 2, 0)
    assert out["excluded_exception"] == ["repo.task__3"]


def test_unknown_job_names_the_job_and_lists_known_ones(home):
    result = runner.invoke(app, ["trials", "--job", "nope"])
    assert result.exit_code == 2
    assert "nope" in result.output and "a, b" in result.output


def test_demo_with_unknown_project_fails_before_any_work(home):
    result = runner.invoke(app, ["demo", "--projects", "six,nosuch"])
    assert result.exit_code == 2
    assert "nosuch" in result.output and "boltons" in result.output
    assert not (home / "demo" / "summary.json").exists()
