"""The one task model (forgeflow.common.task.Task): one spelling written, the older keys still read (issue 35)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forgeflow.common.task import Task

FIELDS = {"instance_id": "calc.add-1", "image_ref": "localhost/calc:1", "test_command": "pytest -rA",
          "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": ["t::b"], "patch": "--- a/x\n+++ b/x\n"}


def test_older_keys_load_and_a_dump_writes_swe_benchs_names() -> None:
    old = {"instance_id": "calc.add-1", "image": "localhost/calc:1", "test_command": "pytest -rA",
           "fail_to_pass": ["t::a"], "pass_to_pass": ["t::b"], "bug_patch": "--- a/x\n+++ b/x\n"}
    task = Task.model_validate(old)
    assert task == Task(**FIELDS) and task.graded_tests() == ["t::a", "t::b"]
    dumped = task.model_dump()
    assert {"FAIL_TO_PASS", "PASS_TO_PASS", "image_ref", "patch"} <= set(dumped)
    assert not {"fail_to_pass", "pass_to_pass", "image", "bug_patch"} & set(dumped)
    assert Task.model_validate(dumped) == task


def test_a_task_is_frozen_and_refuses_unknown_fields_blank_ids_and_bad_digests() -> None:
    task = Task(**FIELDS)
    with pytest.raises(ValidationError):
        task.instance_id = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="timeout_s"):
        Task(**FIELDS, timeout_s=5)
    for field, value in (("instance_id", ""), ("image_ref", ""), ("test_command", ""), ("problem_statement", ""),
                         ("image_digest", "sha256:abc")):
        with pytest.raises(ValidationError, match=field):
            Task(**{**FIELDS, field: value})
    assert Task(**FIELDS, image_digest="sha256:" + "0" * 64).image_digest.endswith("0" * 64)
