"""The RL reward without containers: the training verifier's timeout rule, and a batch in which one
completion's trouble (no text, no diff, a diff the screen or git refuses, the submission's own hang,
an infrastructure error, an unexpected error) stays that completion's outcome. The verifier itself is
replaced by a stand-in that answers per completion as the real one does (its verdicts and errors);
tests/adversarial/test_rl_rewards.py runs the same batch through real podman."""

from __future__ import annotations

import pytest

from forgeflow.common import errors
from forgeflow.sandbox.scoring import SubmissionVerdict
from forgeflow.training import rewards
from forgeflow.training.rewards import (
    PRISTINE_SAFETY_FACTOR,
    TASK_TIMEOUT_S,
    StepRewardCounts,
    VerifierReward,
    score_completion,
    training_timeout_s,
)
from forgeflow.training.rl import RLTask

TASK = {"instance_id": "calc-1", "image_ref": "localhost/x:1", "problem_statement": "add is wrong",
        "test_command": "pytest -rA", "FAIL_TO_PASS": ["t.py::test_add"]}


def test_training_timeout_is_the_task_timeout_times_the_multiplier_never_below_the_pristine_run() -> None:
    # the seeds' rule: SWE-smith's 3000 s x 0.06 = 180 s, for a task row that gives no timeout
    assert TASK_TIMEOUT_S == 3000 and RLTask(**TASK).task_timeout_s == 3000
    assert training_timeout_s(RLTask(**TASK).task_timeout_s, 0.06) == pytest.approx(180.0)
    # a row's own timeout (also under its former name) x the multiplier
    assert RLTask(**TASK, verifier_timeout_s=120).task_timeout_s == 120 == RLTask(**TASK, task_timeout_s=120).task_timeout_s
    assert training_timeout_s(120, 0.5) == 60.0
    # curation's 180 s cap x 0.06 = 10.8 s: a suite whose pristine run took 4 s gets 5 x 4 = 20 s, never less
    assert PRISTINE_SAFETY_FACTOR == 5.0
    assert training_timeout_s(180, 0.06, pristine_duration_s=4.0) == 20.0
    assert training_timeout_s(180, 0.06, pristine_duration_s=1.0) == pytest.approx(10.8)  # 5 s fits: the rule's
    assert training_timeout_s(3000, 0.06, pristine_duration_s=50.0) == 250.0
    for bad in [(0, 0.06, None), (180, 0, None), (180, 0.06, -1.0)]:
        with pytest.raises(errors.InputError):
            training_timeout_s(*bad)
    with pytest.raises(ValueError, match="verifier_timeout_s"):  # both names at once: which one is meant?
        RLTask.model_validate({**TASK, "task_timeout_s": 100, "verifier_timeout_s": 120})


def test_score_completion_runs_the_verifier_with_that_timeout_and_passes_the_pristine_run_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def verify_on(ray, tests, patch, **kwargs):  # noqa: ANN001, ANN202
        seen.update(tests=tests, patch=patch, **kwargs)
        return SubmissionVerdict(reward=1.0)

    monkeypatch.setattr(rewards, "verify_on", verify_on)
    task = RLTask(**TASK, task_timeout_s=180, pristine_duration_s=4.0)
    outcome = score_completion("```diff\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y\n```", task)
    assert outcome.reward == 1.0 and outcome.verifier_timeout_s == seen["timeout_s"] == 20.0
    assert seen["tests"].pristine_duration_s == 4.0  # the verifier attributes a timeout with it


def test_the_tasks_known_tests_reach_the_verifier_from_a_spec_a_dataset_row_and_a_reward_column(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from forgeflow.training.rl import build_rl_dataset

    seen = []

    def verify_on(ray, tests, patch, **kwargs):  # noqa: ANN001, ANN202
        seen.append(tests)
        return SubmissionVerdict(reward=1.0)

    monkeypatch.setattr(rewards, "verify_on", verify_on)
    known = ["t.py::test_add", "t.py::test_mul"]
    diff = "```diff\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y\n```"
    score_completion(diff, RLTask(**TASK, known_tests=known))
    score_completion(diff, RLTask(**TASK))  # not recorded: the verifier skips the check (None, never "none known")
    score_completion(diff, RLTask(**TASK, known_tests=[]))
    assert [t.known_tests for t in seen] == [known, None, None]  # what the verifier checks every reported id against

    rows = [{**TASK, "known_tests": known}, {**TASK, "instance_id": "calc-2"}]
    data = build_rl_dataset(rows)  # TRL hands the dataset's columns to the reward function
    assert data.dataset["known_tests"] == [known, None]
    assert "known_tests" not in build_rl_dataset(rows[1:]).dataset.column_names  # older datasets keep their digest
    assert {"FAIL_TO_PASS", "PASS_TO_PASS"} <= set(data.dataset.column_names)  # one name (issue 35)
    assert not {"fail_to_pass", "pass_to_pass"} & set(data.dataset.column_names)
    old = {k: v for k, v in TASK.items() if k != "FAIL_TO_PASS"} | {"fail_to_pass": TASK["FAIL_TO_PASS"],
                                                                     "pass_to_pass": ["t.py::test_mul"]}
    assert build_rl_dataset([old]).dataset["PASS_TO_PASS"] == [["t.py::test_mul"]]  # an old row still loads
    seen.clear()
    columns = {c: data.dataset[c] for c in data.dataset.column_names if c != "prompt"}
    assert VerifierReward()(prompts=["p"] * 2, completions=[diff] * 2, **columns) == [1.0, 1.0]
    assert sorted(t.known_tests or [] for t in seen) == [[], known]


GOOD = "```diff\ndiff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a - b\n+a + b\n```"


def test_one_completion_never_loses_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each completion's trouble is its own: the others keep their rewards, in order, and the step's
    counts tell the submission's own failures apart from infrastructure exceptions."""

    def verify_on(ray, tests, patch, **kwargs):  # noqa: ANN001, ANN202
        if "PROSE" in patch:  # what the text screen did to prose before ``diff --git``
            raise errors.InputError("submission diff has a part that names no file")
        if "HANG" in patch:  # the submission's own hang, attributed on evidence by the verifier
            return SubmissionVerdict(reward=0.0, notes=["the submission timed out"],
                                     evidence={"submission_failure": {"kind": "timeout", "limit_s": 10.8}})
        if "LOST" in patch:
            raise errors.VerifierTimeoutError("the node went away")
        if "BUG" in patch:
            raise KeyError("a bug of the scorer, for one completion")
        return SubmissionVerdict(reward=1.0)

    monkeypatch.setattr(rewards, "verify_on", verify_on)
    completions = [
        GOOD,
        "```diff\nPROSE: here is my fix\n" + GOOD[8:],  # text inside the fence before ``diff --git``
        "```diff\n--- /dev/null\n+++ /dev/null\n@@ -0,0 +1 @@\n+PROSE\n```",  # between two /dev/nulls
        "I cannot fix this.",  # no diff
        {"content": GOOD},  # not text
        [{"role": "assistant", "content": GOOD}],
        GOOD.replace("a + b", "HANG"),
        GOOD.replace("a + b", "LOST"),
        GOOD.replace("a + b", "BUG"),
    ]
    n = len(completions)
    reward = VerifierReward(concurrency=3)
    got = reward(prompts=["p"] * n, completions=completions, instance_id=[f"calc-{i}" for i in range(n)],
                 image_ref=["localhost/x:1"] * n, test_command=["pytest -rA"] * n, FAIL_TO_PASS=[["t::a"]] * n,
                 PASS_TO_PASS=[[]] * n, task_timeout_s=[180.0] * n, pristine_duration_s=[None] * n)
    assert got == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, None, None]
    notes = [o.note for _, _, o in reward.outcomes]
    assert "did not apply" in notes[1] and "did not apply" in notes[2]
    assert "no diff" in notes[3] and "not text" in notes[4]
    assert reward.counts[1] == StepRewardCounts(
        step=1, completions=9, resolved=2, unresolved=5, submission_failures=1, exceptions=2,
        submission_failure_kinds={"timeout": 1}, exception_types={"KeyError": 1, "VerifierTimeoutError": 1})
    # a bad task row is its completion's exception too
    got = reward(prompts=["p"] * 2, completions=[GOOD, GOOD], instance_id=["a", "b"], image_ref=["i", "i"],
                 test_command=["t", "t"], FAIL_TO_PASS=[["t::a"], []], PASS_TO_PASS=[[], []],
                 task_timeout_s=[180.0, 180.0])
    assert got == [1.0, None] and reward.outcomes[-1][2].exception_type == "ValidationError"
    # the scorer's own settings are its error, never every completion's 0
    with pytest.raises(errors.InputError, match="tamper policy"):
        VerifierReward(tamper_policy="lenient")(prompts=["p"], completions=[GOOD], instance_id=["a"],
                                                image_ref=["i"], test_command=["t"], FAIL_TO_PASS=[["t::a"]],
                                                PASS_TO_PASS=[[]], task_timeout_s=[180.0])
