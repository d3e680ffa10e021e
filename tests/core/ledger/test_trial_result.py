"""The typed trial record: its parts dump to the JSON keys the ledger always stored, and its row mapper."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from forgeflow.ledger.records import TrialRecord
from forgeflow.ledger.trial_result import TrialResult, VerifierEvidence
from forgeflow.sandbox.verifier import VerifierResult

STARTED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def test_trial_parts_keep_the_stored_json_keys_and_refuse_unknown_ones() -> None:
    run = VerifierResult(tests={"t::a": "PASSED"}, log_tail="", exit_code=1, duration_s=0.5, report_exit_code=None,
                         stdout_sha256="a" * 64, stderr_sha256="b" * 64, tripwires={"must_pass": "PASSED"},
                         tampering=["a second outcome for t::a"]).evidence()
    # an agent trial's evidence as the scorer and the agent write it (screen, own failure, notes, Ray node)
    agent_evidence = {
        "submission": {"policy": "reject", "screen_policy": "flag", "source": "tree", "changed_paths": 2,
                       "patch_sha256": "c" * 64, "protected_paths": {"tests/conftest.py": "conftest"},
                       "dropped_paths": ["tests/conftest.py"], "tampering": True,
                       "screen_findings": [{"path": "a.py", "kind": "exit", "line": "os._exit(0)"}]},
        "submission_failure": {"kind": "timeout", "error": "VerifierTimeoutError: 5 s", "timeout_s": 5.0,
                               "memory_mb": 512, "pristine": {"source": "re-run", "duration_s": 1.2, "exit_code": 0}},
        "run": run, "notes": [], "node_id": "n1",
    }
    agent = TrialResult(trial_id="t1", instance_id="calc.1", kind="agent", reward=0.0, started_at=STARTED,
                        env_setup_s=0.3, agent_s=10.0, verifier_s=2.0, agent_steps=4, input_tokens=100,
                        output_tokens=7, verifier=agent_evidence, submission="",
                        supervision={"kind": "dead_loop", "evidence": {"period": 1, "signatures": ["s"]},
                                     "trajectory_path": "/t/x.json"})
    assert agent.verifier.submission.tampering and agent.verifier.run.report_exit_code is None
    assert agent.supervision.kind == "dead_loop" and agent.supervision.evidence["period"] == 1
    row = TrialRecord.from_trial(agent, "job-1", "d" * 64, "run-1", batch_id="b1")
    assert row.verifier == agent_evidence and "undecodable_output" not in row.verifier["run"]
    assert row.timings == {"env_setup_s": 0.3, "verifier_s": 2.0, "agent_s": 10.0}
    assert (row.job_id, row.batch_id, row.run_id, row.created_at, row.input_tokens) == \
        ("job-1", "b1", "run-1", STARTED, 100)
    # a trial crosses processes as JSON (Prefect results, Ray): the same trial comes back
    assert TrialResult.model_validate_json(agent.model_dump_json()) == agent

    scored_nop = {"outcome": {"error_type": "VerifierTimeoutError", "error_message": "hung"}}
    oracle = {"run": run, "repeat": {"repeat_s": 0.4, "runs": 6, "tests": 2}}
    for evidence in (scored_nop, oracle):
        nop = TrialResult(trial_id="t2", instance_id="calc.1", kind="nop", reward=0.0, started_at=STARTED,
                          env_setup_s=0.1, verifier=evidence)
        stored = TrialRecord.from_trial(nop, "curate", None, None)
        assert stored.verifier == evidence and stored.timings == {"env_setup_s": 0.1} and stored.agent_steps is None
    node_only = VerifierEvidence().model_copy(update={"node_id": "n2"})  # an infra error's trial tagged by Ray
    assert node_only.model_dump(mode="json") == {"node_id": "n2"}
    with pytest.raises(ValidationError, match="unexpected"):
        TrialResult(trial_id="t3", instance_id="calc.1", kind="nop", reward=1.0, started_at=STARTED,
                    env_setup_s=0.1, verifier={"run": {**run, "unexpected": 1}})
