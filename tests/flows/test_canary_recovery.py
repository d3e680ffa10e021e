"""The ``canary-recover`` flow: a canary whose model server died mid-run is recovered by a linked job.

Real parts: the llama-cpp-python server on the tiny GGUF (started and stopped by PID on a free
port), mini-swe-agent, podman sandboxes and the verifier, the session Prefect harness. The server is
stopped right after the canary recorded its first trial (a wrapper around ``Store.record_trial``
does it, so the point in the run is the same every time), so the second trial ends in a
ModelEndpointError; a new server on the same GGUF is started and the recovery re-runs that trial
only. Checked as a user would: ``forgeflow trials --job X --merged`` reads "original job X + 1
recovery job", every task is scored once in it, and the original's rows are unchanged.
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
from test_canary_flow import recorded_freeze  # noqa: E402,F401 - fixture

from forgeflow.common.errors import InputError, PreflightError  # noqa: E402
from forgeflow.common.fsutil import sha256_file  # noqa: E402
from forgeflow.curation.task_rows import TaskSource  # noqa: E402
from forgeflow.evaluation.canary_params import CanaryEndpoint, CanaryRunSettings  # noqa: E402
from forgeflow.ledger.store import Store  # noqa: E402
from forgeflow.serving.server import ModelServer  # noqa: E402
from tests.helpers import free_port, pid_alive, tiny_ggufs  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AGENT = {"step_limit": 2, "max_tokens": 32, "agent_timeout_s": 120, "memory_mb": 512}


def _raw_rows(store: Store, job_id: str) -> list[tuple]:
    """Every column of the job's trial rows, as the database holds them (timestamps included)."""
    with store.engine.connect() as connection:
        return [tuple(row) for row in connection.execute(
            text("SELECT * FROM trials WHERE job_id = :job ORDER BY trial_id"), {"job": job_id})]


def test_a_canary_whose_server_died_mid_run_is_recovered_by_a_linked_job(prefect_harness, recorded_freeze,
                                                                          tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments.cli import app
    from flows.canary import CanaryParams, CanaryRecoverParams, canary, canary_recover

    store, manifest, generated = recorded_freeze
    q8, _ = tiny_ggufs()
    sha = sha256_file(q8)
    test_ids = manifest.splits["test"]
    assert len(test_ids) == 2
    server = ModelServer(q8, free_port(), "forgeflow", n_ctx=4096, log_path=tmp_path / "server-1.log").start()
    restarted = None
    try:
        record_trials = Store.record_trials
        stopped: list[int] = []

        def record_then_stop_the_server(self: Store, rows, *events) -> None:  # each trial recorded as it ends
            record_trials(self, rows, *events)
            if any(r.kind == "agent" for r in rows) and not stopped:  # the model server dies after the first trial
                stopped.append(server.pid)
                server.stop()

        with monkeypatch.context() as patch:
            patch.setattr(Store, "record_trials", record_then_stop_the_server)
            result = canary(CanaryParams(freeze_name="canary-test", endpoint=CanaryEndpoint(base_url=server.base_url, model_sha256=sha),
                            source=TaskSource(generated_path=generated), out_dir=tmp_path / "canary",
                            run=CanaryRunSettings(agent_config=AGENT, verifier_timeout_s=120.0, concurrency=1)))
        assert stopped and not pid_alive(stopped[0])
        job_id = result.job_id
        report = result.report
        assert (report.requested, report.scored, report.exceptions_by_type) == (2, 1, {"ModelEndpointError": 1})
        first, second = result.trials
        assert first.exception_type is None and second.exception_type == "ModelEndpointError"
        original_rows = _raw_rows(store, job_id)
        (broken,) = [t for t in store.trials_for(job_id=job_id) if t.exception_type is not None]

        # the endpoint is still down: refused before anything is recorded
        with pytest.raises(PreflightError, match="does not answer"):
            canary_recover(CanaryRecoverParams(job_id=job_id, endpoint=CanaryEndpoint(base_url=server.base_url)))
        assert store.jobs(parent_job_id=job_id) == []

        restarted = ModelServer(q8, free_port(), "forgeflow", n_ctx=4096, log_path=tmp_path / "server-2.log").start()
        back = CanaryEndpoint(base_url=restarted.base_url)
        with pytest.raises(InputError, match="a recovery re-runs the same model"):
            canary_recover(CanaryRecoverParams(job_id=job_id, endpoint=CanaryEndpoint(base_url=restarted.base_url, model_sha256="e" * 64)))
        with pytest.raises(InputError, match="params.agent_config .* differs from the one job"):
            canary_recover(CanaryRecoverParams(job_id=job_id, endpoint=back, agent_config={**AGENT, "step_limit": 3}))
        out = canary_recover(CanaryRecoverParams(job_id=job_id, endpoint=back))

        # one recovery job, linked to the original, that re-ran exactly the exception trial
        recovery_id = out.job_id
        job = store.get_job(recovery_id)
        assert (job.kind, job.parent_job_id, job.freeze_name, job.split, job.model_sha256) == (
            "recovery", job_id, "canary-test", "test", sha)
        assert job.params["recovers"] == {broken.instance_id: broken.trial_id}
        recovered = store.trials_for(job_id=recovery_id)
        assert [t.instance_id for t in recovered] == [broken.instance_id]
        assert recovered[0].trial_id != broken.trial_id and recovered[0].reward is not None
        assert [r.original_trial_id for r in out.recovered] == [broken.trial_id]
        # the original's rows are exactly as they were
        assert _raw_rows(store, job_id) == original_rows

        # the merged view, as the user reads it
        shown = CliRunner().invoke(app, ["trials", "--job", job_id, "--merged", "--json"])
        assert shown.exit_code == 0, shown.output
        view = json.loads(shown.output)
        assert view["view"].startswith(f"original job {job_id} + 1 recovery job") and recovery_id in view["view"]
        assert view["recovery_job_ids"] == [recovery_id] and view["from_recovery"] == {broken.instance_id: recovery_id}
        assert sorted(t["instance_id"] for t in view["trials"]) == sorted(test_ids)  # every task once
        assert all(t["exception_type"] is None and t["reward"] is not None for t in view["trials"])
        assert out.merged.report.scored == 2 and out.merged.report.exceptions_by_type == {}
        assert f"original job {job_id} + 1 recovery job" in out.report_path.read_text()

        # nothing is left to recover: no second recovery job
        again = canary_recover(CanaryRecoverParams(job_id=job_id, endpoint=back))
        assert again.job_id is None and [j.job_id for j in store.jobs(parent_job_id=job_id)] == [recovery_id]
        with pytest.raises(InputError, match=f"is itself a recovery job of '{job_id}'"):
            canary_recover(CanaryRecoverParams(job_id=recovery_id, endpoint=back))
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()
