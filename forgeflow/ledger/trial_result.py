"""The typed record of one trial (:class:`TrialResult`) and its parts: the verifier's evidence and the
supervisor's stop, each a model (Harbor's nested ``TrialResult``, https://github.com/laude-institute/harbor).

It lives beside the ledger's row (:meth:`forgeflow.ledger.records.TrialRecord.from_trial` maps one to the
other) and below the trial runners that make it (:mod:`forgeflow.sandbox.trial` for NOP and Oracle runs,
:mod:`forgeflow.evaluation.agent` for agent runs). The parts dump to exactly the JSON keys their writers
give (a field at its default is left out), so stored ``trials.verifier`` rows keep their shape.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from forgeflow.common import errors
from forgeflow.ledger.tables import TrialKind

__all__ = ["ErrorOutcome", "PristineRun", "RepeatEvidence", "RunEvidence", "SubmissionFailure",
           "SubmissionScreen", "Supervision", "TrialResult", "VerifierEvidence"]


class _Part(BaseModel):
    """A part of a trial record: frozen, no unknown key; dumped without the fields at their default (the
    keys its writer left out), so the JSON has the keys the dicts it replaced had."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_serializer(mode="wrap")
    def _without_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = type(self).model_fields
        return {k: v for k, v in handler(self).items()
                if fields[k].is_required() or getattr(self, k) != fields[k].get_default(call_default_factory=True)}


class RunEvidence(_Part):
    """What a trial keeps of one verifier run besides its statuses
    (:meth:`forgeflow.sandbox.verifier.VerifierResult.evidence`; same field meanings).

    Attributes:
        report_format: ``pytest-report`` or ``log``.
        exit_code: the test command's exit status.
        report_exit_code: pytest's own exit status from its session-end record (None without one).
        stdout_sha256 / stderr_sha256: sha256 hex of the raw output bytes.
        log_parser: the SWE-bench log parser's name (``log`` format only).
        undecodable_output: True when the output held bytes that are not UTF-8.
        problem: why the outcomes cannot be trusted.
        tampering: each contradiction that is evidence of tampering.
        tripwires: the tripwires' statuses (``must_pass``, ``must_fail``).
        summary_counts: the counts of pytest's final summary line.
    """

    report_format: str
    exit_code: int
    report_exit_code: int | None
    stdout_sha256: str | None
    stderr_sha256: str | None
    log_parser: str | None = None
    undecodable_output: bool = False
    problem: str | None = None
    tampering: list[str] | None = None
    tripwires: dict[str, str] | None = None
    summary_counts: dict[str, int] | None = None


class RepeatEvidence(_Part):
    """The flaky-gold repeats of an Oracle run (:mod:`forgeflow.sandbox.flaky_gold`).

    Attributes:
        repeat_s: pytest's seconds in the repetitions after the first.
        runs: repetitions run (the first included).
        tests: tests in the last repetition.
    """

    repeat_s: float = Field(ge=0.0)
    runs: int = Field(ge=0)
    tests: int = Field(ge=0)


class ErrorOutcome(_Part):
    """The error a scored run ended in (a NOP run that hung or exhausted memory: the task's own outcome).

    Attributes:
        error_type: the exception's class name.
        error_message: its message.
    """

    error_type: str
    error_message: str


class SubmissionScreen(_Part):
    """How the verifier took in a submission (:func:`forgeflow.sandbox.scoring.verify_submission`).

    Attributes:
        policy / screen_policy: the tamper and static-screen policies applied.
        source: ``diff`` (a unified diff) or ``tree`` (the agent's work tree).
        applied: False when git could not take the submission in.
        changed_paths: paths the submission changed.
        patch_sha256: sha256 hex of the submission as git wrote it.
        protected_paths: ``{path: why}`` of the task's own files the submission touched.
        tampering: True when a policy or the run found tampering.
        dropped_paths: protected paths put back as the image had them.
        screen_findings: the static screen's findings (at most 20, as dicts).
        runner_read: changed files the test runner read.
    """

    policy: str
    screen_policy: str
    source: Literal["diff", "tree"]
    applied: bool | None = None
    changed_paths: int | None = Field(default=None, ge=0)
    patch_sha256: str | None = None
    protected_paths: dict[str, str] | None = None
    tampering: bool = False
    dropped_paths: list[str] | None = None
    screen_findings: list[dict[str, JsonValue]] | None = None
    runner_read: list[str] | None = None


class PristineRun(_Part):
    """Why a failed run is the submission's doing: the pristine tests fit the same limits.

    Attributes:
        source: where the pristine duration comes from (recorded, a re-run, a cached re-run, the probe).
        duration_s: the pristine run's seconds.
        exit_code: its exit status (a fresh re-run only).
    """

    source: str
    duration_s: float = Field(ge=0.0)
    exit_code: int | None = None


class SubmissionFailure(_Part):
    """A test run the submission broke by itself (:data:`forgeflow.sandbox.scoring.SUBMISSION_FAILURES`).

    Attributes:
        kind: ``timeout``, ``oom``, ``pids_limit`` or ``runner_broken``.
        error: the error, shortened to at most 1,200 characters.
        timeout_s: the run's limit, seconds (not set when git's taking-in failed).
        memory_mb: the sandbox memory limit, MiB.
        pristine: the evidence that the pristine tests fit the same limits.
    """

    kind: str
    error: str
    timeout_s: float | None = None
    memory_mb: int
    pristine: PristineRun


class VerifierEvidence(_Part):
    """What a trial's verdict rests on.

    Attributes:
        submission: an agent trial's screening of its submission.
        submission_failure: the submission's own failure of the test run, when it had one.
        run: the verifier run's evidence (None: no test ran).
        repeat: an Oracle run's flaky-gold repeats.
        outcome: the error a scored NOP run ended in.
        notes: the verifier's notes for a person (agent trials).
        node_id: the Ray node the verifier ran on.
    """

    submission: SubmissionScreen | None = None
    submission_failure: SubmissionFailure | None = None
    run: RunEvidence | None = None
    repeat: RepeatEvidence | None = None
    outcome: ErrorOutcome | None = None
    notes: list[str] | None = None
    node_id: str | None = None


class Supervision(_Part):
    """The agent supervisor's stop of a run (``AgentLoopError`` / ``AgentHangError``).

    Attributes:
        kind: ``dead_loop`` or ``hang``.
        evidence: the error's evidence (:class:`forgeflow.evaluation.supervision.LoopDetection` or
            :class:`~forgeflow.evaluation.supervision.HangCheck` as JSON, a hang with ``during``).
        trajectory_path: the run's trajectory file.
    """

    kind: Literal["dead_loop", "hang"]
    evidence: dict[str, JsonValue] = Field(default_factory=dict)
    trajectory_path: str | None = None


class TrialResult(BaseModel):
    """One trial's outcome: a reward, or the infrastructure error that prevented one.

    Reward convention: :mod:`forgeflow.sandbox.trial`.

    Attributes:
        trial_id: deterministic id (:func:`forgeflow.sandbox.trial.make_trial_id`).
        instance_id: the task.
        kind: ``nop``, ``oracle`` or ``agent``.
        reward: 0.0..1.0; None iff ``exception_type`` is set (an agent trial stopped by a timeout or
            the supervisor keeps both: :data:`forgeflow.common.errors.SCORED_DESPITE_EXCEPTION`).
        exception_type: class name of the error (``SandboxOOMError``, ``VerifierTimeoutError``, ...).
        exception_message: its message; set iff ``exception_type`` is.
        started_at: when the trial started (timezone-aware, stored in UTC).
        env_setup_s: seconds to start the container (the Oracle's revert runs in its test exec).
        verifier_s: seconds the test run took; None if it never completed.
        agent_s: seconds the agent ran; None for nop/oracle.
        tests: status map of the verifier run (empty when it did not complete).
        log_tail: the last characters of the verifier's output
            (:data:`forgeflow.sandbox.verifier.LOG_TAIL_CHARS`).
        agent_steps / input_tokens / output_tokens: the agent's model calls and token usage
            (agent trials only; None for nop/oracle).
        supervision: set when the agent supervisor stopped the run; None otherwise.
        verifier: what the verifier's verdict rests on; None when no verifier ran.
        submission: an agent trial's submission as graded (``forgeflow rescore`` re-verifies it); else None.

    Raises:
        pydantic.ValidationError: a naive ``started_at``, both or neither of reward and exception (but
            as above), a message without its type.
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
    supervision: Supervision | None = None
    verifier: VerifierEvidence | None = None
    submission: str | None = None

    def costs(self) -> dict[str, float]:
        """``{"input_tokens", "agent_steps", "wall_s"}`` where recorded (for
        :func:`forgeflow.evaluation.compare.cost_ratios`); wall time is agent + verifier seconds."""
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
    def _one_outcome(self) -> "TrialResult":
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
