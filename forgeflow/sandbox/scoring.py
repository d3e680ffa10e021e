"""A submission scored: a fresh sandbox of the pristine task image, the submission applied, the task's tests run.

:func:`verify_submission` is the verifier of agent trials and RL rewards (and of a re-score).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.sandbox.backends import SandboxTarget, get_backend
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.grading import grade_resolved
from forgeflow.sandbox.submission import TamperPolicy, screen_submission
from forgeflow.sandbox.verifier import TESTBED, TaskTests, VerifierResult, run_tests

__all__ = ["SubmissionVerdict", "verify_submission"]


class SubmissionVerdict(BaseModel):
    """The verifier's answer on one submission.

    Attributes:
        reward: 1.0 (every FAIL_TO_PASS and PASS_TO_PASS test PASSED) or 0.0.
        result: the test run (None when no test ran: tampering, a patch that does not apply).
        notes: why, for a person (tampering with the paths, a patch that did not apply, a report
            that could not be trusted, an empty submission).
        evidence: what the trial record keeps (``submission``: the screening; ``run``: the run's
            evidence, see :meth:`VerifierResult.evidence`).
    """

    model_config = ConfigDict(frozen=True)

    reward: float = Field(ge=0.0, le=1.0)
    result: VerifierResult | None = None
    notes: list[str] = Field(default_factory=list)
    evidence: dict[str, Any] = Field(default_factory=dict)


SUBMISSION_PATH_IN_SANDBOX = "/tmp/forgeflow-submission.patch"


def verify_submission(
    tests: TaskTests, submission: str, *, timeout_s: float, spec: SandboxSpec, name: str,
    tamper_policy: TamperPolicy = "reject", backend: "str | SandboxTarget" = "podman",
) -> SubmissionVerdict:
    """Grade a submission: a fresh sandbox of the pristine task image, the screened diff applied, the tests run.

    Args:
        tests: the task's image, test command, FAIL_TO_PASS / PASS_TO_PASS ids and log parser
            (:class:`TaskTests`).
        submission: the submission's unified diff (may be empty).
        timeout_s: limit of the test run, seconds.
        spec: sandbox limits.
        name: sandbox name (a leftover of a crashed run of the same trial is removed first).
        tamper_policy: ``reject`` or ``drop`` (:mod:`forgeflow.sandbox.submission`).
        backend: sandbox kind, or a :class:`~forgeflow.sandbox.backends.SandboxTarget` (where a
            kubernetes backend runs its pods; :func:`forgeflow.sandbox.backends.get_backend`).

    Returns:
        The :class:`SubmissionVerdict`: reward 0 for tampering (no test run), a patch that does not
        apply, failing tests, or a report that disagrees with the exit status.

    Raises:
        InputError: an unknown policy, parser or backend; nothing graded.
        SandboxError and subclasses, VerifierTimeoutError, VerifierOutputError: the verifier broke
            (the caller records an exception, never reward 0).
    """
    image_ref, test_command, log_parser = tests.image_ref, tests.test_command, tests.log_parser
    fail_to_pass, pass_to_pass = tests.fail_to_pass, tests.pass_to_pass
    screened = screen_submission(submission, [*fail_to_pass, *pass_to_pass], tamper_policy)
    evidence: dict[str, Any] = {"submission": screened.evidence()}
    if screened.tampering:
        paths = ", ".join(f"{p} ({why})" for p, why in screened.protected_paths.items())
        return SubmissionVerdict(reward=0.0, notes=[f"tampering: the submission changes the task's own files: {paths}"],
                                 evidence=evidence)
    notes = []
    if screened.dropped_paths:
        notes.append(f"dropped the submission's changes to the task's own files: {', '.join(screened.dropped_paths)}")
    sandbox = get_backend(backend)(image_ref, spec, name)
    sandbox.start()
    try:
        diff = screened.diff
        if diff.strip():
            sandbox.write_file(SUBMISSION_PATH_IN_SANDBOX, diff if diff.endswith("\n") else diff + "\n")
            applied = sandbox.exec(["git", "apply", "--verbose", "--whitespace=nowarn", SUBMISSION_PATH_IN_SANDBOX],
                                   timeout_s=60, workdir=TESTBED)
            sandbox.exec(["rm", "-f", SUBMISSION_PATH_IN_SANDBOX], timeout_s=60)
            if applied.exit_code != 0:
                detail = (applied.stderr or applied.stdout).strip()[-1000:]
                return SubmissionVerdict(reward=0.0, notes=[*notes, f"submission patch did not apply (the model's "
                                                                   f"fault): {detail}"], evidence=evidence)
        else:
            notes.append("empty submission (no change to /testbed)")
        result = run_tests(sandbox, test_command, timeout_s, log_parser=log_parser)
    finally:
        sandbox.stop()
    evidence["run"] = result.evidence()
    if result.problem is not None:
        return SubmissionVerdict(reward=0.0, result=result, evidence=evidence,
                                 notes=[*notes, f"not credited: {result.problem}"])
    return SubmissionVerdict(reward=grade_resolved(result.tests, list(fail_to_pass), list(pass_to_pass)),
                             result=result, notes=notes, evidence=evidence)
