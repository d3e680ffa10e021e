"""The ``rescore`` flow and ``forgeflow rescore`` on a real canary job (session Prefect harness, real podman,
mini-swe-agent against the scripted loopback model of the canary flow tests, the verifier).

A two-task canary (one answer fixes the bug, one submits nothing) is re-scored without re-running the model:
the same verdicts, a new job linked to the original, the original's rows unchanged, compare takes the new job
by its id; the re-score of the re-score reads the submissions from the store (the trajectories deleted).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_agent import task_image  # noqa: E402,F401 - fixture
from test_agent_supervision import scripted_endpoint, text_answer  # noqa: E402
from test_canary_flow import AGENT, FIX, MODEL_SHA, recorded_freeze  # noqa: E402,F401 - fixture

from forgeflow.curation.task_rows import TaskSource  # noqa: E402
from forgeflow.evaluation.canary_params import CanaryEndpoint, CanaryRunSettings  # noqa: E402
from forgeflow.ledger.store import Store  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NOTHING = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def _rows(store: Store, job_id: str) -> list[tuple]:
    with store.engine.connect() as connection:
        return [tuple(r) for r in connection.execute(text("SELECT * FROM trials WHERE job_id = :j ORDER BY trial_id"),
                                                     {"j": job_id})]


def test_rescore_of_a_canary_job_gives_its_verdicts_as_a_new_linked_job(prefect_harness, recorded_freeze,
                                                                       tmp_path: Path) -> None:
    from deployments.cli import app
    from flows.canary import CanaryParams, canary
    from flows.rescore import RescoreParams, rescore
    from forgeflow.evaluation.compare import compare_stored_jobs

    store, manifest, generated = recorded_freeze
    with scripted_endpoint(lambda i: text_answer(FIX if i == 0 else NOTHING)) as (url, _):
        job = canary(CanaryParams(freeze_name="canary-test", endpoint=CanaryEndpoint(base_url=url, model_sha256=MODEL_SHA),
                                  source=TaskSource(generated_path=generated), out_dir=tmp_path / "canary",
                                  run=CanaryRunSettings(agent_config=AGENT, verifier_timeout_s=120.0)))
    verdicts = {t.instance_id: (t.reward, t.exception_type) for t in job.trials}
    assert sorted(verdicts.values()) == [(0.0, None), (1.0, None)]
    before = _rows(store, job.job_id)

    result = rescore(RescoreParams(job_id=job.job_id, out_dir=tmp_path / "canary"))
    assert result.counts == {"trials": 2, "reverify": 2, "carried": 0, "missing": 0, "changed": 0}
    assert {c.instance_id: (c.new_reward, c.new_exception) for c in result.changes} == verdicts
    assert {c.source for c in result.changes} == {"store"}  # the canary stores each trial's graded submission
    stored = {t.instance_id: t.submission for t in store.trials_for(job_id=job.job_id)}
    fixed = next(i for i, (reward, _) in verdicts.items() if reward == 1.0)
    assert "a + b" in stored[fixed] and "a - b" in stored[fixed]  # git's own diff of the agent's tree, as the verifier graded it
    new = store.get_job(result.job_id)
    assert (new.kind, new.parent_job_id, new.freeze_name, new.split, new.model_sha256) == (
        "rescore", job.job_id, "canary-test", "test", MODEL_SHA)
    assert _rows(store, job.job_id) == before, "the original's rows are never rewritten"
    rescored = store.trials_for(job_id=result.job_id)
    assert {t.instance_id: (t.reward, t.exception_type) for t in rescored} == verdicts
    assert all(t.submission is not None and t.verifier["rescore_of"] for t in rescored)
    assert "0 changed, listed first" in result.report_path.read_text()
    compared = compare_stored_jobs(store, job.job_id, result.job_id)  # the gate takes the re-score by its id
    assert (compared.paired.n_pairs, compared.paired.wins, compared.paired.losses) == (2, 0, 0)

    # the re-score of the re-score, through the CLI: the submissions come from the store now
    for path in (tmp_path / "canary" / job.job_id / "trajectories").glob("*.traj.json"):
        path.unlink()
    runner = CliRunner()
    out = runner.invoke(app, ["rescore", result.job_id, "--out-dir", str(tmp_path / "canary"), "--json"])
    assert out.exit_code == 0, out.output
    again = json.loads(out.stdout)
    assert again["parent_job_id"] == result.job_id and again["counts"]["changed"] == 0
    assert {c["source"] for c in again["changes"]} == {"store"}
    typo = runner.invoke(app, ["rescore", job.job_id + "x"])
    assert typo.exit_code == 2 and f"job '{job.job_id}x' is not recorded" in typo.output and job.job_id in typo.output
