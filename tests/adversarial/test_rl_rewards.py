"""RL rewards against malformed completions, in the calc task's real image under podman.

A policy's completion is whatever text it samples. One that holds prose inside its diff fence
before ``diff --git``, a diff between two ``/dev/null``s, no diff at all or no text must be that
completion's reward 0 (with a note saying why) and must never cost the other completions of the
batch their rewards: the correct fix in the same batch still scores 1.0.
"""

from __future__ import annotations

import pytest

from forgeflow.training.rewards import StepRewardCounts, VerifierReward
from tests.adversarial.calc_task import BUGGY_CALC, F2P, FIX, P2P, TEST_COMMAND, make_patch

pytestmark = pytest.mark.integration

WRONG = make_patch("calc.py", BUGGY_CALC, BUGGY_CALC.replace("a * b", "b * a"))  # applies, fixes nothing


def _fenced(body: str) -> str:
    return f"The bug is in add.\n```diff\n{body}```\nDone."


def test_a_batch_with_malformed_completions_keeps_the_others_rewards(task_image: str) -> None:
    completions = {
        "fix": [{"role": "assistant", "content": _fenced(FIX)}],
        "prose inside the fence before the diff": _fenced("Here is my patch:\n" + WRONG),
        "a diff between two /dev/nulls": _fenced("--- /dev/null\n+++ /dev/null\n@@ -0,0 +1 @@\n+x\n"),
        "no diff": "I could not find the bug.",
        "not text": {"content": _fenced(FIX)},
        "wrong fix": _fenced(WRONG),
        "fix again": _fenced(FIX),
    }
    n = len(completions)
    reward = VerifierReward(verifier_timeout_multiplier=0.5, memory_mb=256, concurrency=2)
    got = reward(prompts=["p"] * n, completions=list(completions.values()), instance_id=[f"calc-{i}" for i in range(n)],
                 image_ref=[task_image] * n, test_command=[TEST_COMMAND] * n, FAIL_TO_PASS=[F2P] * n,
                 PASS_TO_PASS=[P2P] * n, task_timeout_s=[240.0] * n, pristine_duration_s=[1.0] * n)
    by_kind = dict(zip(completions, got))
    notes = {kind: o.note for kind, (_, _, o) in zip(completions, reward.outcomes)}
    assert by_kind == {"fix": 1.0, "prose inside the fence before the diff": 0.0,
                       "a diff between two /dev/nulls": 0.0, "no diff": 0.0, "not text": 0.0,
                       "wrong fix": 0.0, "fix again": 1.0}, notes
    assert "no diff" in notes["no diff"] and "not text" in notes["not text"]
    assert reward.counts[1] == StepRewardCounts(step=1, completions=n, resolved=2, unresolved=n - 2)
    assert {o.verifier_timeout_s for _, _, o in reward.outcomes} == {120.0}  # 240 s x 0.5 (5 x 1 s is less)
