"""Oracle SFT samples (forgeflow.training.samples) on a real git checkout."""

from __future__ import annotations

import subprocess

import pytest

from forgeflow.common.errors import PatchApplyError
from forgeflow.training import samples

BUG = """--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a + b
+    return a - b
"""


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "pristine"]):
        subprocess.run(cmd, cwd=repo, check=True)
    return repo


def test_fix_patch_reverts_the_bug_and_leaves_checkout_clean(checkout):
    fix = samples.fix_patch(checkout, BUG, "proj.add__1")
    assert "-    return a - b" in fix and "+    return a + b" in fix
    assert subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True, text=True).stdout == ""


def test_fix_patch_names_instance_when_bug_does_not_apply(checkout):
    with pytest.raises(PatchApplyError, match="proj.other__2"):
        samples.fix_patch(checkout, BUG.replace("a + b", "a * b"), "proj.other__2")


def test_oracle_messages_use_mini_swe_agent_prompts_and_fence(checkout):
    fix = samples.fix_patch(checkout, BUG, "proj.add__1")
    msgs = samples.oracle_messages("test_add fails", fix)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert msgs[0]["content"] == samples.agent_templates()["system"]
    assert samples.SUBMIT_COMMAND in samples.agent_templates()["instance"]  # the config's own submit
    assert "test_add fails" in msgs[1]["content"]
    assert "```mswea_bash_command" in msgs[2]["content"] and fix in msgs[2]["content"]
    assert "<returncode>0</returncode>" in msgs[3]["content"]
    assert msgs[-1]["content"].endswith(f"```mswea_bash_command\n{samples.SUBMIT_COMMAND}\n```")


def test_problem_statement_names_at_most_ten_failing_tests_and_counts_the_rest():
    from forgeflow.evaluation.agent import MAX_TESTS_LISTED, problem_statement_for

    tests = [f"tests/test_calc.py::test_case_{i:02d}" for i in range(25)]
    text = problem_statement_for(BUG, tests)
    assert sum(f"test_case_{i:02d}" in text for i in range(25)) == MAX_TESTS_LISTED
    assert f"and {25 - MAX_TESTS_LISTED} more" in text
    assert "a - b" not in text  # nothing of the bug leaks
