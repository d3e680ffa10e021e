"""The task's known tests reach the verifier on the canary and RL paths, in the calc task's real image.

Validation records every test id the task's pristine runs collected (``TaskRecord.known_tests``); the canary
(the ``CanaryTask`` itself, what ``run_agent_trial`` verifies with) and the RL reward (``score_completion`` of an
``RLTask``) hand them to the verifier, which names a run that collects a test the task does not know as
tampering (reward 0), whatever the tests say. The verifier's own rule is tests/core/sandbox/test_verifier.py's;
here only the wiring: the correct fix scores 1 against the task's real known tests and 0 against a record
that lacks one of the tests it runs.
"""

from __future__ import annotations

import pytest

from forgeflow.evaluation.canary import CanaryTask
from forgeflow.sandbox.scoring import verify_submission
from forgeflow.training.rewards import score_completion
from forgeflow.training.rl import RLTask
from tests.adversarial.calc_task import F2P, FIX, P2P, SPEC, TEST_COMMAND

pytestmark = pytest.mark.integration

KNOWN = sorted([*F2P, *P2P])  # every test of the calc task's suite


def test_a_run_that_collects_a_test_the_task_does_not_know_is_tampering_on_the_canary_and_rl_paths(
        task_image: str) -> None:
    task = {"instance_id": "calc-known", "image_ref": task_image, "problem_statement": "add is wrong",
            "test_command": TEST_COMMAND, "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P}
    canary = {**task, "repo": "calc", "image_digest": "sha256:" + "c" * 64}
    short = [t for t in KNOWN if t != P2P[0]]  # a record that does not know test_mul
    for label, known, reward in (("known", KNOWN, 1.0), ("short", short, 0.0)):
        tests = CanaryTask(**canary, known_tests=known, pristine_duration_s=1.0)
        verdict = verify_submission(tests, FIX, timeout_s=120, spec=SPEC, name=f"ff-test-adv-known-{label}")
        assert verdict.reward == reward, (label, verdict.notes)
    assert any("the task does not know" in note for note in verdict.notes), verdict.notes
    outcome = score_completion(f"```diff\n{FIX}```", RLTask(**task, task_timeout_s=240, known_tests=short),
                               verifier_timeout_multiplier=0.5, memory_mb=256, name="ff-test-adv-known-rl")
    assert outcome.reward == 0.0 and "the task does not know" in outcome.note, outcome
