"""Attack class: the agent controls the container its submission is taken from.

On the agent path the old submission was the agent's own ``git diff`` inside its container: a
replaced ``git`` binary, an external diff driver in ``.git/config`` or an alias can make that diff say
anything. Now the container is stopped and its tree copied out from the host
(:func:`forgeflow.sandbox.tree.export_tree`); the verifier's git in a fresh pristine container decides
what changed. Each variant below runs real commands in a real agent container (podman), then the
tree goes through :func:`forgeflow.sandbox.scoring.verify_submission`.
"""

from __future__ import annotations

import pytest

from forgeflow.evaluation.sandbox_env import SandboxEnvironment, SandboxEnvironmentConfig
from forgeflow.sandbox.tree import export_tree
from tests.adversarial.calc_task import verify

pytestmark = pytest.mark.integration

FIX = "sed -i 's/return a - b/return a + b/' calc.py"
FORCE_PASS = ("import pytest\\n\\n\\n@pytest.hookimpl(hookwrapper=True)\\ndef pytest_runtest_makereport(item, call):\\n"
              "    outcome = yield\\n    outcome.get_result().outcome = 'passed'\\n")
HIDE = [  # the agent's own tools lie about what changed
    "git config diff.external /bin/true",
    "printf '#!/bin/sh\\nexit 0\\n' > /tmp/git && chmod +x /tmp/git && cp /tmp/git /usr/bin/git",
    "git config alias.diff '!true'",
]


def _tree_of(image: str, name: str, commands: list[str]) -> bytes:
    env = SandboxEnvironment.start("podman", SandboxEnvironmentConfig(image=image, name=name, memory_mb=256))
    try:
        for command in commands:
            out = env.execute({"command": command})
            assert out["returncode"] == 0, (command, out)
        return export_tree(name)
    finally:
        env.stop()


def test_a_fix_with_scratch_files_scores_1_and_the_scratch_is_removed(task_image: str) -> None:
    tree = _tree_of(task_image, "ff-test-adv-agent-fix", [
        FIX, "printf 'def test_repro():\\n    pass\\n' > test_repro.py", "mkdir -p tests && touch tests/notes.txt",
        "git add -A && git -c user.name=a -c user.email=a@a commit -qm wip", *HIDE])
    verdict = verify(task_image, "", "agent-fix", tree=tree)
    assert verdict.reward == 1.0, verdict.notes
    record = verdict.evidence["submission"]
    assert record["source"] == "tree" and record["dropped_paths"] == ["test_repro.py", "tests/notes.txt"]
    assert "+    return a + b" in verdict.submission_patch and "calc.py" in verdict.submission_patch


@pytest.mark.parametrize(("label", "commands"), [
    ("new-conftest-hidden", [f"printf \"{FORCE_PASS}\" > tests/conftest.py", *HIDE]),
    ("edited-conftest", [f"printf \"{FORCE_PASS}\" >> conftest.py", *HIDE]),
    ("pyc-planted", ["python3 -c \"import py_compile; py_compile.compile('calc.py', cfile='__pycache__/x.pyc')\"",
                     *HIDE]),
])
def test_what_the_agents_tools_hide_is_seen_and_scores_0(task_image: str, label: str, commands: list[str]) -> None:
    tree = _tree_of(task_image, f"ff-test-adv-agent-{label}", commands)
    verdict = verify(task_image, "", f"agent-{label}", tree=tree)
    assert verdict.reward == 0.0, verdict.notes
    record = verdict.evidence["submission"]
    assert record["protected_paths"], record
    if label == "edited-conftest":  # the task's own file changed: tampering, not even run
        assert record["tampering"] and verdict.result is None
    else:  # new files of the agent's are removed; the tests run on the task's own and fail
        assert verdict.result is not None and verdict.result.tests["tests/test_calc.py::test_add"] == "FAILED"
