"""Attack class: the submission's own failures scored as nobody's (resource exhaustion, a broken runner).

A model that hangs, allocates without end, starts threads past the pids limit or kills the test process
at import when it cannot solve a task must not drop out of the canary's pass rate, the paired comparison
or the RL gradient as an infrastructure exception: each variant, through real podman, is reward 0 with
its evidence (``submission_failure``) because the task's pristine tests fit the same limits (a recorded
pristine duration, or a pristine re-run). The reverse holds too: when the pristine tests fail the same
limits, it stays an exception, never 0. And an agent's container that vanishes is an exception.
"""

from __future__ import annotations

import pytest

from forgeflow.common import errors
from forgeflow.evaluation.sandbox_env import SandboxEnvironment, SandboxEnvironmentConfig
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.podman import remove_podman_container
from forgeflow.sandbox.scoring import verify_submission
from forgeflow.sandbox.tree import export_tree
from forgeflow.sandbox.verifier import TaskTests
from tests.adversarial.calc_task import F2P, P2P, TEST_COMMAND, calc_with

pytestmark = pytest.mark.integration

SPEC = SandboxSpec(memory_mb=256, pids_limit=64)
VARIANTS = {
    "hang": ("while True:\n    pass\n", "timeout"),
    "sleep": ("import time\ntime.sleep(3600)\n", "timeout"),
    "memory": ("_hog = [bytearray(1 << 20) for _ in range(4096)]\n", "oom"),
    "threads": ("import threading, time\nfor _ in range(500):\n    threading.Thread(target=time.sleep, args=(30,), "
                "daemon=True).start()\n", "pids_limit"),
    "exit-127": ("import os\nos._exit(127)\n", "runner_broken"),
    "exit-126": ("import os\nos._exit(126)\n", "runner_broken"),
}


def _tests(image: str, **kwargs: object) -> TaskTests:
    return TaskTests(instance_id="calc-task", image_ref=image, test_command=TEST_COMMAND, FAIL_TO_PASS=F2P,
                     PASS_TO_PASS=P2P, **kwargs)


def test_each_resource_exhaustion_is_the_submissions_reward_0_with_evidence(task_image: str) -> None:
    recorded = _tests(task_image, pristine_duration_s=1.0)
    for label, (prefix, kind) in VARIANTS.items():
        verdict = verify_submission(recorded, calc_with(prefix), timeout_s=10, spec=SPEC, name=f"ff-test-adv-own-{label}",
                                    screen_policy="off")
        assert verdict.reward == 0.0 and verdict.submission_failure == kind, (label, verdict.notes)
        failure = verdict.evidence["submission_failure"]
        assert failure["kind"] == kind and failure["timeout_s"] == 10 and failure["pristine"]["duration_s"] > 0
        assert f"the submission's own {kind}" in verdict.notes[-1]
        if kind == "timeout":  # the recorded pristine run (1 s of a 10 s limit) is the evidence: no re-run
            assert failure["pristine"]["source"] == "recorded"
        else:
            assert failure["pristine"]["source"].startswith("re-run")


def test_without_a_record_a_pristine_re_run_decides_and_a_pristine_failure_stays_an_exception(task_image: str) -> None:
    hang = calc_with(VARIANTS["sleep"][0])
    verdict = verify_submission(_tests(task_image), hang, timeout_s=10, spec=SPEC, name="ff-test-adv-own-rerun",
                                screen_policy="off")
    assert verdict.submission_failure == "timeout" and verdict.evidence["submission_failure"]["pristine"][
        "source"].startswith("re-run")
    # a test command whose pristine run cannot finish in the limit either: the verifier broke, not the model
    slow = TaskTests(instance_id="calc-task", image_ref=task_image, test_command=f"sleep 30; {TEST_COMMAND}",
                     FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P)
    with pytest.raises(errors.VerifierTimeoutError, match="pristine tests under the same limits failed too"):
        verify_submission(slow, hang, timeout_s=5, spec=SPEC, name="ff-test-adv-own-slow", screen_policy="off")


def test_an_agent_container_that_vanishes_is_an_exception_never_0(task_image: str) -> None:
    config = SandboxEnvironmentConfig(image=task_image, name="ff-test-adv-vanish", memory_mb=256)
    env = SandboxEnvironment.start("podman", config)
    try:
        assert env.execute({"command": "echo ok"})["returncode"] == 0
        # removed from outside as a crash or an operator would; podman 4.3 can leave a "Removing" entry
        # ("userdata/shm: device or resource busy", seen in CI), which the product's own removal retries
        remove_podman_container(config.name)
        with pytest.raises(errors.SandboxError, match="vanished mid-run"):
            env.execute({"command": "git diff"})
        with pytest.raises(errors.SandboxError, match="vanished"):
            export_tree(config.name)
    finally:
        env.stop()
