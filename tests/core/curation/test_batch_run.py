"""A curate batch's validations as they finish (forgeflow.curation.batch_run.run_batch), without Prefect or
containers: the validation is a function of (instance id, run key) here, so what is checked is the batch's own
logic: at most ``concurrency`` in flight, every candidate one verdict handed over the moment it is known, an
attempt without a verdict (an infrastructure error) tried again under a new run key, a raising validation
an ``error`` verdict that does not sink the batch, a transient failure retried. (The real validation inside
it runs in podman in tests/flows/test_curate*.py.)"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from forgeflow.common.errors import InputError, TransientInfraError
from forgeflow.curation import batch_run
from forgeflow.curation.batch_run import BatchJob, run_batch
from forgeflow.sandbox.grading import ValidationReport
from forgeflow.sandbox.trial import TrialResult, ValidationOutcome


def _trial(instance_id: str, kind: str, run_key: str, exception: str | None = None, verifier_s: float = 1.0
           ) -> TrialResult:
    return TrialResult(trial_id=f"{instance_id}-{kind}-{run_key}", instance_id=instance_id, kind=kind,
                       reward=None if exception else 1.0, exception_type=exception,
                       exception_message="sandbox lost" if exception else None, started_at=datetime.now(UTC),
                       env_setup_s=0.1, verifier_s=None if exception else verifier_s)


def _accepted(instance_id: str, run_key: str) -> ValidationOutcome:
    return ValidationOutcome(nop=_trial(instance_id, "nop", run_key),
                             oracle=_trial(instance_id, "oracle", run_key, verifier_s=2.5),
                             oracle_repeats=[_trial(instance_id, "oracle", run_key + "r", verifier_s=3.0)],
                             report=ValidationReport(FAIL_TO_PASS=["t::f"], PASS_TO_PASS=["t::p"], accepted=True,
                                                     reason="1 FAIL_TO_PASS", known_tests=["t::f", "t::p"]))


def _job(ids: list[str], concurrency: int = 2, max_retries: int = 0, **kwargs: object) -> BatchJob:
    rows = {i: SimpleNamespace(instance_id=i, repo=i.split(".")[0], patch="diff", image_ref="img:1") for i in ids}
    return BatchJob(batch_id="curate-b1", run_id="run-1", store_url="sqlite://", ids=ids, rows=rows,
                    concurrency=concurrency, max_retries=max_retries, **kwargs)


def test_at_most_concurrency_in_flight_and_each_verdict_handed_over_once_as_it_ends() -> None:
    ids = [f"r{i % 3}.c{i}" for i in range(12)]
    lock, in_flight, peak, keys = threading.Lock(), [0], [0], []

    def validate(instance_id: str, run_key: str) -> ValidationOutcome:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            keys.append((instance_id, run_key))
        time.sleep(0.01 if instance_id != ids[0] else 0.2)  # the first one ends last
        with lock:
            in_flight[0] -= 1
        return _accepted(instance_id, run_key)

    handed: list[str] = []
    finished: list[int] = []
    verdicts = run_batch(_job(ids, concurrency=3, first_attempt={ids[1]: 2}), validate,
                         lambda verdict, outcome: handed.append(verdict.instance_id), finished.append)
    assert peak[0] == 3
    assert [v.instance_id for v in verdicts] == ids  # the batch's order, whatever order they ended in
    assert sorted(handed) == sorted(ids) and handed[-1] == ids[0]  # each once, as it ended
    assert finished == list(range(1, 13))
    assert dict(keys)[ids[1]] == "curate-a2" and dict(keys)[ids[2]] == "curate-a0"  # attempts continue
    first = verdicts[0]
    assert (first.status, first.FAIL_TO_PASS, first.known_tests, first.run_id) == ("accepted", ["t::f"],
                                                                                   ["t::f", "t::p"], "run-1")
    assert first.pristine_duration_s == 3.0  # the longest Oracle run, repeats included


def test_an_infrastructure_error_is_tried_again_then_recorded_as_error_and_a_raise_does_not_sink_the_batch() -> None:
    ids = ["a.lost", "b.bad", "c.ok"]
    calls: list[tuple[str, str]] = []

    def validate(instance_id: str, run_key: str) -> ValidationOutcome:
        calls.append((instance_id, run_key))
        if instance_id == "a.lost":
            return ValidationOutcome(nop=_trial(instance_id, "nop", run_key, exception="SandboxError"))
        if instance_id == "b.bad":
            raise InputError("b.bad: the patch does not apply")
        return _accepted(instance_id, run_key)

    outcomes: dict[str, object] = {}
    verdicts = run_batch(_job(ids, max_retries=2), validate,
                         lambda verdict, outcome: outcomes.setdefault(verdict.instance_id, outcome))
    assert [k for i, k in calls if i == "a.lost"] == ["curate-a0", "curate-a1", "curate-a2"]
    assert [k for i, k in calls if i == "b.bad"] == ["curate-a0"]  # bad input is never tried again
    by_id = {v.instance_id: v for v in verdicts}
    assert by_id["a.lost"].status == "error" and by_id["a.lost"].reason == "SandboxError: sandbox lost"
    assert by_id["b.bad"].status == "error" and "InputError" in by_id["b.bad"].reason
    assert outcomes["b.bad"] is None and by_id["c.ok"].status == "accepted"


def test_a_transient_failure_is_retried_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_run, "TRANSIENT_RETRY_DELAYS_S", (0.0, 0.0))
    tries: list[str] = []

    def validate(instance_id: str, run_key: str) -> ValidationOutcome:
        tries.append(run_key)
        if len(tries) < 3:
            raise TransientInfraError("registry 502")
        return _accepted(instance_id, run_key)

    (verdict,) = run_batch(_job(["r.one"], max_retries=0), validate, lambda *_: None)
    assert verdict.status == "accepted" and tries == ["curate-a0"] * 3  # the same attempt, not a new one
