"""The task side of an agent trial (forgeflow.evaluation.agent.AgentTask): a canary task is one, and
what its verifier runs comes from it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forgeflow.evaluation.agent import AgentTask
from forgeflow.evaluation.canary import CanaryTask
from forgeflow.sandbox.verifier import TaskTests


def _canary_task(**changes: object) -> CanaryTask:
    fields = {"instance_id": "calc-add-1", "repo": "calc", "image_ref": "localhost/calc:1",
              "image_digest": "sha256:" + "1" * 64, "problem_statement": "fix add", "test_command": "pytest -rA",
              "fail_to_pass": ["t::a"], "pass_to_pass": ["t::b"], "log_parser": "parse_log_django"}
    return CanaryTask(**{**fields, **changes})


def test_a_canary_task_is_an_agent_task_and_its_tests_are_what_the_verifier_grades():
    canary_task = _canary_task()
    assert isinstance(canary_task, AgentTask)
    assert canary_task.tests() == TaskTests(image_ref="localhost/calc:1", test_command="pytest -rA",
                                            fail_to_pass=["t::a"], pass_to_pass=["t::b"],
                                            log_parser="parse_log_django")


def test_a_canary_task_needs_a_fail_to_pass_test_and_a_digest():
    with pytest.raises(ValidationError, match="fail_to_pass"):
        _canary_task(fail_to_pass=[])
    with pytest.raises(ValidationError, match="image_digest"):
        _canary_task(image_digest="latest")


def test_an_agent_task_is_frozen_and_refuses_unknown_or_empty_fields():
    task = AgentTask(instance_id="i", image_ref="img", problem_statement="ps", test_command="pytest",
                     fail_to_pass=["t::a"])
    assert task.pass_to_pass == [] and task.log_parser is None
    with pytest.raises(ValidationError):
        task.instance_id = "j"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        AgentTask(instance_id="i", image_ref="img", problem_statement="ps", test_command="pytest",
                  fail_to_pass=["t::a"], repo="calc")
    for field in ("instance_id", "image_ref", "problem_statement", "test_command"):
        with pytest.raises(ValidationError, match=field):
            AgentTask(**{"instance_id": "i", "image_ref": "img", "problem_statement": "ps", "test_command": "pytest",
                         field: ""})


def test_known_tests_reach_the_verifier_and_a_task_without_them_keeps_its_cache_key():
    plain = _canary_task()
    # the trial's Prefect cache key hashes the task's JSON dump (prefect.utilities.hashing.hash_objects ->
    # model_dump(mode="json")): without the new fields it is the dump, hence the key, of before they existed
    assert set(plain.model_dump(mode="json")) == {"instance_id", "repo", "image_ref", "image_digest",
                                                  "problem_statement", "test_command", "fail_to_pass",
                                                  "pass_to_pass", "log_parser"}
    assert _canary_task(known_tests=[]).model_dump(mode="json") == plain.model_dump(mode="json")
    recorded = _canary_task(known_tests=["t::a", "t::b", "t::c"], pristine_duration_s=2.5)
    dumped = recorded.model_dump(mode="json")  # a stricter verifier is a new trial: a new key
    assert dumped["known_tests"] == ["t::a", "t::b", "t::c"] and dumped["pristine_duration_s"] == 2.5
    assert recorded.tests().known_tests == ["t::a", "t::b", "t::c"] and recorded.tests().pristine_duration_s == 2.5
    assert _canary_task(known_tests=[]).tests().known_tests is None  # empty: not recorded, never "no test known"
    assert CanaryTask.model_validate(dumped) == recorded
