"""Trials: one sandboxed run of a task's tests, recorded with its reward or its infrastructure error.

A *NOP* trial runs the tests on the task image as built (bug present, nothing fixed); an *Oracle*
trial reverts the bug patch (``git apply -R``) first; an *agent* trial (run elsewhere) lets an
agent edit ``/testbed`` before the verifier runs. Every trial runs in a fresh container.

Reward convention (Harbor's): ``reward`` is the SWE-bench resolution of the run —
1.0 iff every FAIL_TO_PASS and PASS_TO_PASS test passes (:func:`forgeflow.grading.grade_resolved`).
A valid task therefore gives **nop 0.0 and oracle 1.0**. When a candidate has no FAIL_TO_PASS yet
(rejected before or by the Oracle), a run's reward is 1.0 iff it collected at least one passing
test and no test failed or errored — so a NOP reward of 1.0 flags a bug no test detects.

An infrastructure failure (OOM, timeout, image pull, unparseable verifier output, or a bug patch
that does not revert in the Oracle) is recorded as the trial's ``exception_type`` (the class name)
and ``exception_message``, with ``reward = None`` — never as 0.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forgeflow import errors
from forgeflow.fsutil import sha256_json
from forgeflow.grading import ValidationReport, failed, grade_resolved, grade_validation, parse_test_log, passed
from forgeflow.sandbox import Sandbox, SandboxSpec, get_backend
from forgeflow.settings import tool_env

__all__ = [
    "TrialKind",
    "TrialRecord",
    "VerifierResult",
    "ValidationOutcome",
    "TESTBED",
    "sanitize_name",
    "make_trial_id",
    "container_name",
    "verify",
    "run_verifier",
    "validate_candidate",
]

TESTBED = "/testbed"
"""Where the project lives inside every task image; the verifier runs there."""

LOG_TAIL_CHARS = 4000
"""How much of a verifier log a trial record keeps (the end, where pytest's summary is)."""

MAX_NAME_CHARS = 63
"""Container/pod name limit: a DNS-1123 label (Kubernetes) is at most 63 characters."""

PATCH_PATH_IN_SANDBOX = "/tmp/forgeflow-bug.patch"
_REVERT_TIMEOUT_S = 60.0

TrialKind = Literal["nop", "oracle", "agent"]

# exceptions recorded on a trial rather than raised: the infrastructure broke, or the Oracle
# could not revert the patch (the image does not hold the bug it claims)
_RECORDED_ERRORS: tuple[type[BaseException], ...] = (errors.InfraError, errors.PatchApplyError)

_NAME_BAD_CHARS = re.compile(r"[^a-z0-9-]+")
_NAME_DASHES = re.compile(r"-{2,}")


class TrialRecord(BaseModel):
    """One trial's outcome: a reward, or the infrastructure error that prevented one.

    Attributes:
        trial_id: deterministic id (:func:`make_trial_id`).
        instance_id: the task.
        kind: ``nop``, ``oracle`` or ``agent``.
        reward: 0.0..1.0 (see the module's reward convention); None iff ``exception_type`` is set.
        exception_type: class name of the error (``SandboxOOMError``, ``VerifierTimeoutError``, ...).
        exception_message: its message; set iff ``exception_type`` is.
        started_at: when the trial started (timezone-aware, stored in UTC).
        env_setup_s: seconds to start the container and prepare it (Oracle: revert the patch).
        verifier_s: seconds the test run took; None if it never completed.
        agent_s: seconds the agent ran; None for nop/oracle.
        tests: status map of the verifier run (empty when it did not complete).
        log_tail: the last :data:`LOG_TAIL_CHARS` characters of the verifier's output.
        agent_steps / input_tokens / output_tokens: the agent's model calls and token usage
            (agent trials only; None for nop/oracle).
        supervision: set when the agent supervisor stopped the run (``AgentLoopError`` /
            ``AgentHangError``): ``{"kind": "dead_loop" | "hang", "evidence": {...},
            "trajectory_path": str}``; None otherwise.
    """

    model_config = ConfigDict(frozen=True)

    trial_id: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    kind: TrialKind
    reward: float | None = Field(default=None, ge=0.0, le=1.0)
    exception_type: str | None = None
    exception_message: str | None = None
    started_at: datetime
    env_setup_s: float = Field(ge=0.0)
    verifier_s: float | None = Field(default=None, ge=0.0)
    agent_s: float | None = Field(default=None, ge=0.0)
    tests: dict[str, str] = Field(default_factory=dict)
    log_tail: str = ""
    agent_steps: int | None = Field(default=None, ge=0)
    input_tokens: int | None = Field(default=None, ge=0)
    output_tokens: int | None = Field(default=None, ge=0)
    supervision: dict[str, Any] | None = None

    def costs(self) -> dict[str, float]:
        """``{"input_tokens", "agent_steps", "wall_s"}`` where recorded (for
        :func:`forgeflow.compare.cost_ratios`); wall time is agent + verifier seconds."""
        out: dict[str, float] = {}
        if self.input_tokens is not None:
            out["input_tokens"] = float(self.input_tokens)
        if self.agent_steps is not None:
            out["agent_steps"] = float(self.agent_steps)
        if self.agent_s is not None:
            out["wall_s"] = self.agent_s + (self.verifier_s or 0.0)
        return out

    @field_validator("started_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("started_at must be timezone-aware (UTC)")
        return value.astimezone(timezone.utc)

    @model_validator(mode="after")
    def _one_outcome(self) -> "TrialRecord":
        scored_despite = self.kind == "agent" and self.exception_type in errors.SCORED_DESPITE_EXCEPTION
        if self.reward is None and self.exception_type is None or (
            self.reward is not None and self.exception_type is not None and not scored_despite
        ):
            raise ValueError(
                f"trial {self.trial_id}: exactly one of reward ({self.reward!r}) and "
                f"exception_type ({self.exception_type!r}) must be set"
            )
        if (self.exception_type is None) != (self.exception_message is None):
            raise ValueError(f"trial {self.trial_id}: exception_message is set iff exception_type is")
        return self


class VerifierResult(BaseModel):
    """One verifier run: the parsed tests and the raw evidence.

    Attributes:
        tests: status map (``{test_id: status}``).
        log_tail: the end of stdout+stderr (at most :data:`LOG_TAIL_CHARS` characters).
        exit_code: the test command's exit status (pytest: 0 all passed, 1 some failed, ...).
        duration_s: wall-clock seconds of the run.
    """

    model_config = ConfigDict(frozen=True)

    tests: dict[str, str]
    log_tail: str
    exit_code: int
    duration_s: float = Field(ge=0.0)


class ValidationOutcome(BaseModel):
    """The NOP and Oracle trials of one candidate and the verdict.

    Attributes:
        nop: the NOP trial (always run).
        oracle: the Oracle trial; None when the NOP had an infra error or no test failed with the bug.
        report: the verdict; None when a trial had an infra error (no verdict: retry, do not reject).
    """

    model_config = ConfigDict(frozen=True)

    nop: TrialRecord
    oracle: TrialRecord | None = None
    report: ValidationReport | None = None


def sanitize_name(raw: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """Turn ``raw`` into a container/pod name: ``[a-z0-9-]``, alphanumeric at both ends, <= max_chars.

    A name that is already valid is returned unchanged. Otherwise it is lowercased, runs of other
    characters become one ``-``, and an 8-hex digest of ``raw`` is appended (cut to fit), so two
    different inputs that sanitize alike (``A_b`` / ``a.b``) or share a long prefix stay distinct.

    Raises:
        InputError: ``raw`` is empty or ``max_chars`` < 16.
    """
    if not raw:
        raise errors.InputError("sanitize_name: the name must not be empty")
    if max_chars < 16:
        raise errors.InputError(f"sanitize_name: max_chars must be >= 16, got {max_chars}")
    clean = _NAME_DASHES.sub("-", _NAME_BAD_CHARS.sub("-", raw.lower())).strip("-")
    if clean == raw and len(clean) <= max_chars:
        return clean
    digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
    head = clean[: max_chars - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}" if head else f"ff-{digest}"


def make_trial_id(instance_id: str, kind: TrialKind, image_ref: str, run_key: str) -> str:
    """Deterministic trial id: the first 32 hex of the sha256 of the canonical JSON of
    ``{instance_id, kind, image, run_key}`` (the same inputs resume the same trial)."""
    return sha256_json(
        {"instance_id": instance_id, "kind": kind, "image": image_ref, "run_key": run_key}
    )[:32]


def container_name(instance_id: str, kind: TrialKind, trial_id: str) -> str:
    """The sandbox name of a trial: ``ff-<kind>-<instance id>-<trial id[:10]>``, sanitized."""
    return sanitize_name(f"ff-{kind}-{instance_id}-{trial_id[:10]}")


def verify(sandbox: Sandbox, test_command: str, timeout_s: float) -> VerifierResult:
    """Run ``test_command`` in :data:`TESTBED` of a started sandbox and parse its ``pytest -rA`` log.

    Args:
        sandbox: a started sandbox.
        test_command: a shell command printing ``pytest -rA`` output
            (e.g. ``python3 -m pytest -rA -p no:cacheprovider tests``).
        timeout_s: wall-clock limit in seconds (> 0).

    Raises:
        InputError: ``timeout_s`` <= 0 or an empty command.
        VerifierTimeoutError: the run exceeded ``timeout_s``.
        SandboxOOMError: the run was killed for memory.
        VerifierOutputError: the output is not pytest -rA output (message carries exit code and tail).
    """
    if timeout_s <= 0:
        raise errors.InputError(f"timeout_s must be > 0, got {timeout_s}")
    if not test_command.strip():
        raise errors.InputError("test_command must not be empty")
    res = sandbox.exec(test_command, timeout_s=timeout_s, workdir=TESTBED)
    log = res.stdout + ("\n" if res.stdout and not res.stdout.endswith("\n") else "") + res.stderr
    try:
        tests = parse_test_log(log)
    except errors.VerifierOutputError as exc:
        raise errors.VerifierOutputError(f"test command exited {res.exit_code}: {exc}") from exc
    return VerifierResult(
        tests=tests, log_tail=log[-LOG_TAIL_CHARS:], exit_code=res.exit_code, duration_s=res.duration_s
    )


def run_verifier(sandbox: Sandbox, test_command: str, timeout_s: float) -> dict[str, str]:
    """Run the tests in :data:`TESTBED` and return the status map (see :func:`verify`)."""
    return verify(sandbox, test_command, timeout_s).tests


@dataclass(frozen=True)
class _Run:
    trial_id: str
    started_at: datetime
    env_setup_s: float
    result: VerifierResult | None
    error: BaseException | None


def _remove_container(name: str) -> None:
    """Remove the container a crashed run of the same trial left, and check it is gone.

    After a SIGKILL of the flow's process group the left container's conmon can race the removal
    and leave an entry in state "Removing" that no longer holds the name (podman 4.3; seen in
    tests/flows/test_curate_kill.py): entries still listed under the name are removed again by
    id, up to three rounds.
    """
    for round_no in range(3):
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, text=True, env=tool_env(),
                       timeout=120)
        listed = subprocess.run(["podman", "ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.ID}}"],
                                capture_output=True, text=True, env=tool_env(), timeout=60)
        if listed.returncode == 0 and not listed.stdout.split():
            return
        if listed.stdout.split():
            subprocess.run(["podman", "rm", "-f", "-t", "0", *listed.stdout.split()], capture_output=True,
                           text=True, env=tool_env(), timeout=120)
        time.sleep(0.5 * (round_no + 1))


def _run_trial(
    instance_id: str, kind: TrialKind, image_ref: str, test_command: str, timeout_s: float,
    spec: SandboxSpec, backend: str, run_key: str, prepare: Callable[[Sandbox], None] | None = None,
) -> _Run:
    """Start a fresh sandbox, ``prepare`` it, run the verifier; catch what a trial records."""
    sandbox_cls = get_backend(backend)
    trial_id = make_trial_id(instance_id, kind, image_ref, run_key)
    name = container_name(instance_id, kind, trial_id)
    started_at = datetime.now(timezone.utc)
    t0 = time.monotonic()
    env_setup_s = 0.0
    sandbox = sandbox_cls(image_ref, spec, name)
    try:
        try:
            try:
                sandbox.start()
            except errors.SandboxError as exc:
                if backend != "podman" or "already in use" not in str(exc):
                    raise
                _remove_container(name)  # left by a crashed run of the same trial
                sandbox.start()
            if prepare is not None:
                prepare(sandbox)
            env_setup_s = time.monotonic() - t0
            result = verify(sandbox, test_command, timeout_s)
        finally:
            try:
                sandbox.stop()
            except (OSError, subprocess.SubprocessError):
                pass  # the next run of this trial removes a leftover container by name
    except _RECORDED_ERRORS as exc:
        if not env_setup_s:
            env_setup_s = time.monotonic() - t0
        return _Run(trial_id, started_at, env_setup_s, None, exc)
    return _Run(trial_id, started_at, env_setup_s, result, None)


def _record(instance_id: str, kind: TrialKind, run: _Run, reward: float | None) -> TrialRecord:
    if run.error is not None:
        return TrialRecord(
            trial_id=run.trial_id, instance_id=instance_id, kind=kind, reward=None,
            exception_type=type(run.error).__name__, exception_message=str(run.error) or repr(run.error),
            started_at=run.started_at, env_setup_s=run.env_setup_s,
        )
    assert run.result is not None
    return TrialRecord(
        trial_id=run.trial_id, instance_id=instance_id, kind=kind, reward=reward,
        started_at=run.started_at, env_setup_s=run.env_setup_s, verifier_s=run.result.duration_s,
        tests=run.result.tests, log_tail=run.result.log_tail,
    )


def _reward(tests: dict[str, str], report: ValidationReport | None) -> float:
    """The module's reward convention (SWE-bench resolution when FAIL_TO_PASS is known)."""
    if report is not None and report.FAIL_TO_PASS:
        return grade_resolved(tests, report.FAIL_TO_PASS, report.PASS_TO_PASS)
    statuses = tests.values()
    return 1.0 if any(passed(s) for s in statuses) and not any(failed(s) for s in statuses) else 0.0


def _revert_patch(candidate: "BugTask") -> Callable[[Sandbox], None]:
    def prepare(sandbox: Sandbox) -> None:
        sandbox.write_file(PATCH_PATH_IN_SANDBOX, candidate.patch)
        res = sandbox.exec(
            ["git", "apply", "-R", PATCH_PATH_IN_SANDBOX], timeout_s=_REVERT_TIMEOUT_S, workdir=TESTBED
        )
        if res.exit_code == 127:
            raise errors.SandboxError(f"git is not installed in the task image of {candidate.instance_id}")
        if res.exit_code != 0:
            raise errors.PatchApplyError(
                f"oracle of {candidate.instance_id}: reverting the bug patch failed: {res.stderr.strip()[:500]}"
            )
        sandbox.exec(["rm", "-f", PATCH_PATH_IN_SANDBOX], timeout_s=_REVERT_TIMEOUT_S)

    return prepare


class BugTask(Protocol):
    """What validation reads of a candidate: its id and the bug patch the task image has applied
    (a :class:`forgeflow.bugs.Candidate`, a :class:`forgeflow.candidates.CandidateTask`, ...)."""

    @property
    def instance_id(self) -> str: ...

    @property
    def patch(self) -> str: ...


def validate_candidate(
    candidate: BugTask,
    image_ref: str,
    test_command: str,
    *,
    timeout_s: float = 180,
    spec: SandboxSpec | None = None,
    backend: str = "podman",
    run_key: str = "validate",
) -> ValidationOutcome:
    """Validate a candidate bug with a NOP and (if needed) an Oracle trial, each in a fresh sandbox.

    1. NOP: run the tests on ``image_ref`` (the task image: bug applied at ``/testbed``).
       An infra error ends validation (``oracle=None, report=None``); if no test failed or errored,
       the Oracle is skipped and the candidate rejected.
    2. Oracle: write the bug patch into a fresh sandbox, ``git apply -R`` it, run the tests.
    3. :func:`~forgeflow.grading.grade_validation` gives the report; rewards follow the module's
       convention (a valid task: nop 0.0, oracle 1.0).

    Args:
        candidate: the candidate bug (its ``patch`` is what the task image has applied).
        image_ref: the task image (local name or registry reference; digest preferred).
        test_command: shell command printing ``pytest -rA`` output, run in ``/testbed``.
        timeout_s: per verifier run, in seconds.
        spec: sandbox limits (default :class:`SandboxSpec`: 2048 MiB, 1 CPU, no network).
        backend: sandbox kind (``podman``); an unknown kind raises InputError listing valid ones.
        run_key: distinguishes repeated validations of the same candidate and image in trial ids.

    Returns:
        A :class:`ValidationOutcome`.

    Raises:
        InputError: unknown backend, ``timeout_s`` <= 0 or an empty test command (nothing ran).
    """
    get_backend(backend)
    if timeout_s <= 0:
        raise errors.InputError(f"timeout_s must be > 0, got {timeout_s}")
    if not test_command.strip():
        raise errors.InputError("test_command must not be empty")
    spec = spec or SandboxSpec()
    iid = candidate.instance_id
    nop_run = _run_trial(iid, "nop", image_ref, test_command, timeout_s, spec, backend, run_key)
    if nop_run.result is None:
        return ValidationOutcome(nop=_record(iid, "nop", nop_run, None))
    nop_tests = nop_run.result.tests
    if not any(failed(s) for s in nop_tests.values()):
        report = grade_validation(nop_tests, None)
        return ValidationOutcome(nop=_record(iid, "nop", nop_run, _reward(nop_tests, report)), report=report)
    oracle_run = _run_trial(
        iid, "oracle", image_ref, test_command, timeout_s, spec, backend, run_key, _revert_patch(candidate)
    )
    if oracle_run.result is None:
        return ValidationOutcome(
            nop=_record(iid, "nop", nop_run, _reward(nop_tests, None)),
            oracle=_record(iid, "oracle", oracle_run, None),
        )
    report = grade_validation(nop_tests, oracle_run.result.tests)
    return ValidationOutcome(
        nop=_record(iid, "nop", nop_run, _reward(nop_tests, report)),
        oracle=_record(iid, "oracle", oracle_run, _reward(oracle_run.result.tests, report)),
        report=report,
    )
