"""The task side of an agent trial (forgeflow.evaluation.agent.AgentTask): made from a canary task."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forgeflow.evaluation.agent import AgentTask
from forgeflow.evaluation.canary import CanaryTask


def test_an_agent_task_is_read_from_a_canary_tasks_fields():
    canary_task = CanaryTask(instance_id="calc-add-1", repo="calc", image_ref="localhost/calc:1",
                             image_digest="sha256:" + "1" * 64, problem_statement="fix add",
                             test_command="pytest -rA", fail_to_pass=["t::a"], pass_to_pass=["t::b"],
                             log_parser="parse_log_django")
    task = AgentTask.model_validate(canary_task, from_attributes=True)
    assert task.model_dump() == {"instance_id": "calc-add-1", "image_ref": "localhost/calc:1",
                                 "problem_statement": "fix add", "test_command": "pytest -rA",
                                 "fail_to_pass": ["t::a"], "pass_to_pass": ["t::b"], "log_parser": "parse_log_django"}


def test_an_agent_task_is_frozen_and_takes_no_unknown_field():
    task = AgentTask(instance_id="i", image_ref="img", problem_statement="ps", test_command="pytest",
                     fail_to_pass=["t::a"])
    assert task.pass_to_pass == [] and task.log_parser is None
    with pytest.raises(ValidationError):
        task.instance_id = "j"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        AgentTask(instance_id="i", image_ref="img", problem_statement="ps", test_command="pytest",
                  fail_to_pass=["t::a"], repo="calc")
