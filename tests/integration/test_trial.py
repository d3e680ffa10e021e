"""Candidate bugs on a real project, validated by NOP/Oracle trials in podman sandboxes.

The project is inflection 0.5.1 (pinned sdist, 455 tests, ~1 s suite): candidates are generated
with swesmith's procedural modifiers on its checkout, a task image is built with the bug applied,
and the NOP/Oracle trials run in fresh no-network containers.
"""

from __future__ import annotations

import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from forgeflow.common import errors
from forgeflow.common.names import sanitize_name
from forgeflow.common.settings import cache_dir
from forgeflow.curation.bugs import (
    check_patch_applies,
    generate_candidate_set,
    generate_candidates,
)
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.trial import (
    TrialResult,
    container_name,
    make_trial_id,
    validate_candidate,
)

PROJECT = "inflection"
SEED = 0


# --- names and records (no podman) -------------------------------------------------------------
def test_sanitize_name_of_66_char_id_is_a_valid_unique_name() -> None:
    a = "Owner__Repo.func_pm_remove_assign__abcd1234.with_a_long_tail_x" + "AAAA"
    b = a[:-1] + "B"
    assert len(a) == len(b) == 66
    na, nb = sanitize_name(a), sanitize_name(b)
    for name in (na, nb):
        assert len(name) <= 63
        assert all(c.isdigit() or c.islower() or c == "-" for c in name), name
        assert name[0].isalnum() and name[-1].isalnum()
    assert na != nb  # same first 54 characters, different names
    assert sanitize_name(a) == na  # deterministic
    assert sanitize_name("ff-nop-ok-123") == "ff-nop-ok-123"  # already valid: unchanged
    assert sanitize_name("A_b") != sanitize_name("a.b")


def test_container_names_differ_per_trial() -> None:
    iid = "inflection.func_pm_op_change__" + "a" * 8 + "_" + "x" * 30
    nop = container_name(iid, "nop", make_trial_id(iid, "nop", "img", "k"))
    oracle = container_name(iid, "oracle", make_trial_id(iid, "oracle", "img", "k"))
    rerun = container_name(iid, "nop", make_trial_id(iid, "nop", "img", "k2"))
    assert len({nop, oracle, rerun}) == 3
    assert max(map(len, (nop, oracle, rerun))) <= 63
    assert make_trial_id(iid, "nop", "img", "k") == make_trial_id(iid, "nop", "img", "k")


def test_trial_record_holds_reward_or_exception_never_both() -> None:
    base = dict(trial_id="t", instance_id="i", kind="nop", started_at=datetime.now(timezone.utc), env_setup_s=0.1)
    assert TrialResult(**base, reward=0.0).reward == 0.0
    with pytest.raises(ValidationError, match="exactly one"):
        TrialResult(**base)
    with pytest.raises(ValidationError, match="exactly one"):
        TrialResult(**base, reward=0.0, exception_type="SandboxOOMError", exception_message="oom")
    with pytest.raises(ValidationError, match="timezone-aware"):
        TrialResult(**{**base, "started_at": datetime.now()}, reward=1.0)


# --- candidates on a real checkout --------------------------------------------------------------
@pytest.fixture(scope="module")
def project_and_checkout():
    from forgeflow.registry.projects import get_project, prepare_checkout

    project = get_project(PROJECT)
    return project, prepare_checkout(project, cache_dir() / "checkouts")


def test_candidates_are_deterministic_source_only_and_apply(project_and_checkout) -> None:
    project, root = project_and_checkout
    first = generate_candidate_set(project.name, root, project.source_path, 6, SEED)
    again = generate_candidates(project.name, root, project.source_path, 6, SEED)
    assert first.candidates == again
    assert len(again) == 6 and first.generated >= 6 and first.dropped_unapplicable == 0
    other_seed = generate_candidates(project.name, root, project.source_path, 6, SEED + 1)
    assert [c.instance_id for c in other_seed] != [c.instance_id for c in again]
    for cand in again:
        assert cand.instance_id.startswith(f"{PROJECT}.func_pm_")
        assert cand.file_path.startswith(f"{project.source_path}/")  # never the test file
        check_patch_applies(root, cand.patch, cand.instance_id)
    # the checkout was not modified by generation
    status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    assert status.stdout == ""


def test_patch_that_does_not_apply_names_the_instance(project_and_checkout) -> None:
    _, root = project_and_checkout
    bad = "--- a/inflection/__init__.py\n+++ b/inflection/__init__.py\n@@ -1,1 +1,1 @@\n-no such line\n+x\n"
    with pytest.raises(errors.PatchApplyError, match="inflection.bogus__abcdefgh"):
        check_patch_applies(root, bad, "inflection.bogus__abcdefgh")


TOY_MODULE = (
    "def f(a, b):\n    x = a + b\n    y = x * 2\n    if x > 3:\n        return y - 1\n    return y + a"
)


def _git_repo(root: Path) -> Path:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "init"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, env={**env, "PATH": "/usr/bin:/bin"})
    return root


def test_patches_that_do_not_apply_are_dropped_and_counted(tmp_path: Path) -> None:
    """swesmith's difflib patches lose a missing final newline, so git refuses them: dropped."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text(TOY_MODULE + "\n")
    (tmp_path / "pkg" / "no_eol.py").write_text(TOY_MODULE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "helpers.py").write_text(TOY_MODULE + "\n")  # a test path: never mutated
    result = generate_candidate_set("toy", _git_repo(tmp_path), "pkg", 50, SEED)
    assert result.dropped_unapplicable > 0
    assert result.examined == result.generated  # fewer than 50 passed, so all were examined
    assert result.candidates and len(result.candidates) == result.generated - result.dropped_unapplicable
    assert {c.file_path for c in result.candidates} == {"pkg/ok.py"}
    assert all(c.func_name == "f" for c in result.candidates)
    everything = generate_candidate_set("toy", tmp_path, ".", 50, SEED)
    assert {c.file_path for c in everything.candidates} == {"pkg/ok.py"}


def test_bad_generation_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(errors.InputError, match="not a git checkout"):
        generate_candidates("toy", tmp_path, "pkg", 5, SEED)
    with pytest.raises(errors.InputError, match="max_candidates"):
        generate_candidates("toy", tmp_path, "pkg", 0, SEED)


# --- NOP / Oracle in podman ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def accepted_task(project_and_checkout):
    """The first of the seed's candidates whose task validates (up to 3 tried)."""
    from forgeflow.registry.images import build_task_image
    from tests.helpers import ensure_env_image

    project, root = project_and_checkout
    env = ensure_env_image(project)
    tried = []
    for cand in generate_candidates(project.name, root, project.source_path, 3, SEED):
        image = build_task_image(env.name, cand.instance_id, cand.patch)
        outcome = validate_candidate(cand, image.name, project.test_command, timeout_s=120)
        tried.append((cand.instance_id, outcome.report.reason if outcome.report else outcome.nop.exception_type))
        if outcome.report is not None and outcome.report.accepted:
            return project, cand, image, outcome
    pytest.fail(f"no candidate of seed {SEED} validated: {tried}")


@pytest.mark.integration
def test_valid_bug_gives_nop_0_oracle_1(accepted_task) -> None:
    project, cand, image, outcome = accepted_task
    report = outcome.report
    assert report.accepted and report.FAIL_TO_PASS
    assert len(report.FAIL_TO_PASS) + len(report.PASS_TO_PASS) <= project.expected_passed
    assert len(report.PASS_TO_PASS) > 100
    assert outcome.nop.reward == 0.0 and outcome.nop.exception_type is None
    assert outcome.oracle is not None and outcome.oracle.reward == 1.0
    assert all(outcome.nop.tests[t] in ("FAILED", "ERROR") for t in report.FAIL_TO_PASS)
    assert all(outcome.oracle.tests[t] == "PASSED" for t in report.FAIL_TO_PASS)
    assert outcome.nop.trial_id != outcome.oracle.trial_id
    assert outcome.nop.verifier_s is not None and outcome.nop.env_setup_s > 0
    assert "passed" in outcome.oracle.log_tail


@pytest.mark.integration
def test_memory_hog_is_an_oom_exception_not_a_reward(accepted_task) -> None:
    _, cand, image, _ = accepted_task
    hog = "python3 -c \"x = b'a' * (512 << 20)\""
    outcome = validate_candidate(
        cand, image.name, hog, timeout_s=60, spec=SandboxSpec(memory_mb=64), run_key="oom"
    )
    assert outcome.nop.exception_type == "SandboxOOMError", outcome.nop
    assert outcome.nop.reward is None and outcome.nop.exception_message
    # the Oracle runs too (a NOP that alone fails the limit would be the task's own rejection) and fails the
    # same way: no verdict, both exceptions
    assert outcome.oracle.exception_type == "SandboxOOMError" and outcome.report is None
    # conmon marks the kill with an empty "oom" file in its working directory: never the caller's
    assert not (Path.cwd() / "oom").exists()


@pytest.mark.integration
def test_a_container_left_under_the_trials_name_is_replaced(accepted_task) -> None:
    """A crashed run of the same trial (or a Ray node SIGKILLed mid-trial on the same host) leaves a
    container under the trial's name; the next run removes it and records the trial, never a
    SandboxError (podman words this 'name ... is in use: container already exists')."""
    project, cand, image, _ = accepted_task
    trial_id = make_trial_id(cand.instance_id, "nop", image.name, "leftover")
    name = container_name(cand.instance_id, "nop", trial_id)
    subprocess.run(["podman", "create", "--name", name, image.name, "sleep", "infinity"], check=True,
                   capture_output=True)
    outcome = validate_candidate(cand, image.name, project.test_command, timeout_s=120, run_key="leftover")
    assert outcome.nop.trial_id == trial_id
    assert outcome.nop.exception_type is None, outcome.nop.exception_message
    assert outcome.report is not None and outcome.report.accepted
    listed = subprocess.run(["podman", "ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.ID}}"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert listed == []


@pytest.mark.integration
def test_an_oracle_reverts_a_patch_larger_than_one_command_argument(accepted_task) -> None:
    """Linux caps one argv string at 128 KiB (MAX_ARG_STRLEN): a bug patch of ~250 KiB (the bug plus a
    new data file) is reverted all the same, and the task validates."""
    from forgeflow.registry.images import build_task_image
    from tests.helpers import ensure_env_image

    project, cand, _, _ = accepted_task
    lines = [f"row {i:05d} " + "x" * 70 + "\n" for i in range(3200)]
    addition = (f"diff --git a/BIG.txt b/BIG.txt\nnew file mode 100644\n--- /dev/null\n+++ b/BIG.txt\n"
                f"@@ -0,0 +1,{len(lines)} @@\n" + "".join("+" + line for line in lines))
    patch = cand.patch + addition
    assert len(patch.encode()) > 200 * 1024
    big = cand.model_copy(update={"instance_id": f"{cand.instance_id}-big", "patch": patch})
    image = build_task_image(ensure_env_image(project).name, big.instance_id, patch)
    outcome = validate_candidate(big, image.name, project.test_command, timeout_s=120, run_key="big-patch")
    assert outcome.oracle is not None and outcome.oracle.exception_type is None, outcome.oracle
    assert outcome.report is not None and outcome.report.accepted, outcome.report


@pytest.mark.integration
def test_verifier_timeout_is_an_exception_not_a_reward(accepted_task) -> None:
    _, cand, image, _ = accepted_task
    outcome = validate_candidate(cand, image.name, "sleep 5", timeout_s=1, run_key="timeout")
    assert outcome.nop.exception_type == "VerifierTimeoutError"
    assert outcome.nop.reward is None
    assert outcome.oracle.exception_type == "VerifierTimeoutError" and outcome.report is None


@pytest.mark.integration
def test_image_that_lacks_the_bug_fails_the_oracle_as_an_exception(accepted_task, project_and_checkout) -> None:
    """A patch the task image does not hold cannot be reverted: recorded, never a reward."""
    project, cand, image, _ = accepted_task
    _, root = project_and_checkout
    other = next(
        c for c in generate_candidates(project.name, root, project.source_path, 9, SEED)
        if c.instance_id != cand.instance_id
    )
    # the NOP fails (the image holds cand's bug), so the Oracle runs and tries to revert `other`
    outcome = validate_candidate(other, image.name, project.test_command, timeout_s=120, run_key="mismatch")
    assert outcome.nop.reward is not None
    assert outcome.oracle is not None
    assert outcome.oracle.exception_type == "PatchApplyError" and outcome.oracle.reward is None
    assert other.instance_id in outcome.oracle.exception_message
    assert outcome.report is None


def test_agent_trial_costs_feed_cost_ratios():
    from datetime import datetime, timezone

    from forgeflow.evaluation.compare import cost_ratios
    from forgeflow.sandbox.trial import TrialResult

    def agent(iid: str, steps: int, tokens: int, agent_s: float) -> TrialResult:
        return TrialResult(trial_id=f"t-{iid}-{steps}", instance_id=iid, kind="agent", reward=0.0,
                           started_at=datetime.now(timezone.utc), env_setup_s=0.1, verifier_s=1.0,
                           agent_s=agent_s, agent_steps=steps, input_tokens=tokens)

    a = [agent("x", 4, 1000, 9.0), agent("y", 2, 600, 5.0)]
    b = [agent("x", 2, 500, 4.0), agent("y", 1, 300, 2.0)]
    costs = cost_ratios({t.instance_id: t.costs() for t in a}, {t.instance_id: t.costs() for t in b})
    assert costs.agent_steps.ratio == pytest.approx(0.5) and costs.input_tokens.ratio == pytest.approx(0.5)
    assert costs.wall_s.mean_a == pytest.approx(8.0)  # agent + verifier seconds
