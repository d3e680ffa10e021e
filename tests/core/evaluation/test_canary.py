"""The canary's core (forgeflow.evaluation.canary): concurrency profiles, task assembly preflight, job report."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.evaluation.canary import (
    CANARY_PROFILES,
    canary_tasks,
    check_concurrency,
    render_job_report,
    sample_split,
)
from forgeflow.evaluation.compare import JobReport
from forgeflow.ledger.records import JobRecord, TaskRecord
from forgeflow.ledger.store import Store

PATCH = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n"
         "-    return a + b\n+    return a - b\n")


def test_default_profile_allows_4_and_verified_allows_10():
    assert CANARY_PROFILES == {"default": 4, "verified": 10}
    assert check_concurrency(4) == 4 and check_concurrency(10, "verified") == 10
    with pytest.raises(InputError, match=r"^canary concurrency 5 is above the limit 4 of profile 'default'; "
                                         r"profile 'verified' allows up to 10$"):
        check_concurrency(5)
    with pytest.raises(InputError, match=r"concurrency 11 is above the limit 10 of profile 'verified'; "
                                         r"no profile allows more than 10"):
        check_concurrency(11, "verified")
    with pytest.raises(InputError, match=r"profile 'fast' is unknown; valid profiles: default \(up to 4\), "
                                         r"verified \(up to 10\)"):
        check_concurrency(2, "fast")
    with pytest.raises(InputError, match="must be >= 1, got 0"):
        check_concurrency(0)


def _row(instance_id: str, **extra):
    return SimpleNamespace(instance_id=instance_id, repo="calc", patch=PATCH, image_ref=f"localhost/t/{instance_id}",
                           image_id="a" * 64, registry_digest=None, test_command="pytest -rA", **extra)


def test_tasks_that_cannot_run_are_all_listed_before_any_trial(store_url: str):
    store = Store(store_url)
    store.upgrade()
    store.record_task(TaskRecord(instance_id="calc.ok__00000001", repo="calc", status="accepted",
                                 FAIL_TO_PASS=["tests/test_calc.py::test_add"], PASS_TO_PASS=["t::p"]))
    store.record_task(TaskRecord(instance_id="calc.rej__00000002", repo="calc", status="rejected"))
    rows = [_row("calc.ok__00000001"), _row("calc.rej__00000002")]
    (task,) = canary_tasks(store, ["calc.ok__00000001"], rows, check_images=False)
    assert task.image_ref == "localhost/t/calc.ok__00000001" and task.image_digest == "sha256:" + "a" * 64
    assert task.FAIL_TO_PASS == ["tests/test_calc.py::test_add"] and task.PASS_TO_PASS == ["t::p"]
    assert "test_add" in task.problem_statement and "a - b" not in task.problem_statement  # the patch never leaks
    with pytest.raises(PreflightError) as info:
        canary_tasks(store, ["calc.ok__00000001", "calc.rej__00000002", "calc.gone__00000003"], rows,
                     check_images=False)
    text = str(info.value)
    assert text.startswith("canary: 2 of 3 task(s) cannot run")
    assert "calc.rej__00000002: not an accepted task with FAIL_TO_PASS (status 'rejected')" in text
    assert "calc.gone__00000003: no row in the task rows (candidates file)" in text


def test_job_report_shows_the_accounting_and_every_trial():
    trials = [SimpleNamespace(instance_id="a", reward=1.0, exception_type=None, agent_s=3.25, verifier_s=1.0),
              SimpleNamespace(instance_id="b", reward=0.0, exception_type=None, agent_s=2.0, verifier_s=1.0),
              SimpleNamespace(instance_id="c", reward=None, exception_type="ModelEndpointError", agent_s=None,
                              verifier_s=None)]
    job = JobRecord(job_id="canary-x", kind="canary", freeze_name="f1", split="test", model_sha256="e" * 64)
    report = JobReport.from_trials(trials)
    md = render_job_report(job, report, trials, {"profile": "default (concurrency 2)"})
    # requested 3, scored 2, 1 exception, reward 1 / 0, 50% of scored, 33.3% of attempts, Wilson(1, 2)
    assert "| 3 | 2 | 1 | 1 | 1 | 50.0% | 33.3% | [9.5%, 90.5%] |" in md
    assert "Exceptions by type: ModelEndpointError 1." in md
    assert "| c |  | ModelEndpointError |  |  |" in md and "| a | 1.0 |  | 3.2 | 1.0 |" in md
    assert "freeze: `f1`, split `test`" in md and "- profile: default (concurrency 2)" in md


def test_a_seeded_sample_is_the_same_every_time_and_nested_in_larger_ones():
    ids = [f"repo{i % 5}.task{i:03d}" for i in range(60)]
    thirty = sample_split(ids, 30, seed=42)
    assert len(thirty) == 30 and thirty == sample_split(list(ids), 30, seed=42)
    assert thirty == [i for i in ids if i in set(thirty)]  # the split's order is kept
    assert set(sample_split(ids, 10, seed=42)) < set(thirty)  # a smaller draw of the same seed is inside
    assert sample_split(ids, 30, seed=43) != thirty
    assert sample_split(ids, None) == ids and sample_split(ids, 60) == ids and sample_split(ids, 99) == ids
    with pytest.raises(InputError, match="sample must be >= 1"):
        sample_split(ids, 0)
    with pytest.raises(InputError, match="repeats an instance id"):
        sample_split(["a", "a"], 1)


def test_canary_tasks_carry_the_known_tests_and_pristine_duration_the_store_recorded(store_url: str):
    store = Store(store_url)
    store.upgrade()
    known = ["t::other", "tests/test_calc.py::test_add", "t::p"]
    store.record_task(TaskRecord(instance_id="calc.k__1", repo="calc", status="accepted",
                                 FAIL_TO_PASS=["tests/test_calc.py::test_add"], PASS_TO_PASS=["t::p"],
                                 known_tests=known, pristine_duration_s=1.25))
    store.record_task(TaskRecord(instance_id="calc.old__2", repo="calc", status="accepted",  # validated before 0009
                                 FAIL_TO_PASS=["tests/test_calc.py::test_add"]))
    recorded, old = canary_tasks(store, ["calc.k__1", "calc.old__2"], [_row("calc.k__1"), _row("calc.old__2")],
                                 check_images=False)
    # the task is what the canary's (and a re-score's) verifier checks the run against (run_tests' expect)
    assert recorded.known_tests == known and recorded.pristine_duration_s == 1.25
    assert old.known_tests is None and old.pristine_duration_s is None
