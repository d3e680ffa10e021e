"""The task side of an agent trial (forgeflow.sandbox.verifier.TaskTests, a forgeflow.common.task.Task with its
pristine-run evidence): a canary task is one, and it is what its verifier runs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forgeflow.common.task import Task
from forgeflow.evaluation.canary import CanaryTask
from forgeflow.sandbox.verifier import TaskTests


def _canary_task(**changes: object) -> CanaryTask:
    fields = {"instance_id": "calc-add-1", "repo": "calc", "image_ref": "localhost/calc:1",
              "image_digest": "sha256:" + "1" * 64, "problem_statement": "fix add", "test_command": "pytest -rA",
              "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": ["t::b"], "log_parser": "parse_log_django"}
    return CanaryTask(**{**fields, **changes})


def test_a_canary_task_is_a_task_and_what_the_verifier_grades():
    canary_task = _canary_task()
    assert isinstance(canary_task, TaskTests)
    assert isinstance(canary_task, Task) and canary_task.graded_tests() == ["t::a", "t::b"]
    # the old spelling still loads (a user's rows, a stored dump); the dump writes SWE-bench's
    fields = {k: v for k, v in canary_task.model_dump().items() if k not in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    old = CanaryTask.model_validate({**fields, "fail_to_pass": ["t::a"], "pass_to_pass": ["t::b"]})
    assert old == canary_task and "fail_to_pass" not in old.model_dump()


def test_a_canary_task_needs_a_fail_to_pass_test_and_a_digest():
    with pytest.raises(ValidationError, match="FAIL_TO_PASS"):
        _canary_task(FAIL_TO_PASS=[])
    with pytest.raises(ValidationError, match="image_digest"):
        _canary_task(image_digest="latest")


def test_a_task_is_frozen_and_refuses_unknown_or_empty_fields():
    task = TaskTests(instance_id="i", image_ref="img", problem_statement="ps", test_command="pytest",
                     FAIL_TO_PASS=["t::a"])
    assert task.PASS_TO_PASS == [] and task.log_parser is None and task.repo is None
    with pytest.raises(ValidationError):
        task.instance_id = "j"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        TaskTests(instance_id="i", image_ref="img", problem_statement="ps", test_command="pytest",
                  FAIL_TO_PASS=["t::a"], images=["a.png"])
    for field in ("instance_id", "image_ref", "problem_statement", "test_command"):
        with pytest.raises(ValidationError, match=field):
            TaskTests(**{"instance_id": "i", "image_ref": "img", "problem_statement": "ps", "test_command": "pytest",
                         field: ""})


def test_known_tests_reach_the_verifier_and_a_task_without_them_keeps_its_cache_key():
    plain = _canary_task()
    # the trial's Prefect cache key hashes the task's JSON dump (prefect.utilities.hashing.hash_objects ->
    # model_dump(mode="json")): without the new fields it is the dump, hence the key, of before they existed
    assert set(plain.model_dump(mode="json")) == {"instance_id", "repo", "image_ref", "image_digest", "patch",
                                                  "problem_statement", "test_command", "FAIL_TO_PASS",
                                                  "PASS_TO_PASS", "log_parser"}
    assert _canary_task(known_tests=[]).model_dump(mode="json") == plain.model_dump(mode="json")
    recorded = _canary_task(known_tests=["t::a", "t::b", "t::c"], pristine_duration_s=2.5)
    dumped = recorded.model_dump(mode="json")  # a stricter verifier is a new trial: a new key
    assert dumped["known_tests"] == ["t::a", "t::b", "t::c"] and dumped["pristine_duration_s"] == 2.5
    assert recorded.known_tests == ["t::a", "t::b", "t::c"] and recorded.pristine_duration_s == 2.5
    assert _canary_task(known_tests=[]).known_tests is None  # empty: not recorded, never "no test known"
    assert CanaryTask.model_validate(dumped) == recorded
