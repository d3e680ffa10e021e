"""The typed record of one trial (:class:`TrialResult`) and its parts, each a model.

After Harbor's nested ``TrialResult`` (https://github.com/laude-institute/harbor). The parts dump to exactly
the JSON keys their writers give (a field at its default is left out), so stored ``trials.verifier`` rows keep
their shape.
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
    """A part of a trial record: frozen, no unknown key; dumped without the fields at their default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_serializer(mode="wrap")
    def _without_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = type(self).model_fields
        return {k: v for k, v in handler(self).items()
                if fields[k].is_required() or getattr(self, k) != fields[k].get_default(call_default_factory=True)}


class RunEvidence(_Part):
    """What a trial keeps of one verifier run besides its statuses (same fields as ``VerifierResult.evidence``).

    Attributes:
        report_exit_code: pytest's own exit status from its session-end record (None without one).
        stdout_sha256 / stderr_sha256: sha256 hex of the raw output bytes.
        problem: why the outcomes cannot be trusted; ``tampering``: each contradiction that is evidence of it.
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
    """The flaky-gold repeats of an Oracle run; ``repeat_s``: pytest's seconds after the first, ``runs`` incl. it."""

    repeat_s: float = Field(ge=0.0)
    runs: int = Field(ge=0)
    tests: int = Field(ge=0)


class ErrorOutcome(_Part):
    """The error a scored run ended in (a NOP run that hung or exhausted memory: the task's own outcome)."""

    error_type: str
    error_message: str


class SubmissionScreen(_Part):
    """How the verifier took in a submission (:func:`forgeflow.sandbox.scoring.verify_submission`).

    Attributes:
        source: ``diff`` (a unified diff) or ``tree`` (the agent's work tree).
        protected_paths: ``{path: why}`` of the task's own files the submission touched; ``dropped_paths`` the
            ones put back as the image had them.
        screen_findings: the static screen's findings (at most 20, as dicts); ``runner_read``: changed files the
            test runner read.
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
    """Why a failed run is the submission's doing: the pristine tests fit the same limits (``duration_s``)."""

    source: str
    duration_s: float = Field(ge=0.0)
    exit_code: int | None = None


class SubmissionFailure(_Part):
    """A test run the submission broke by itself (:data:`forgeflow.sandbox.scoring.SUBMISSION_FAILURES`).

    Attributes:
        kind: ``timeout``, ``oom``, ``pids_limit`` or ``runner_broken``; ``error`` at most 1,200 characters.
        timeout_s: the run's limit, seconds (not set when git's taking-in failed); ``memory_mb`` in MiB.
    """

    kind: str
    error: str
    timeout_s: float | None = None
    memory_mb: int
    pristine: PristineRun


class VerifierEvidence(_Part):
    """What a trial's verdict rests on (``run`` None: no test ran; ``node_id``: the Ray node)."""

    submission: SubmissionScreen | None = None
    submission_failure: SubmissionFailure | None = None
    run: RunEvidence | None = None
    repeat: RepeatEvidence | None = None
    outcome: ErrorOutcome | None = None
    notes: list[str] | None = None
    node_id: str | None = None


class Supervision(_Part):
    """The agent supervisor's stop of a run: ``kind`` ``dead_loop`` or ``hang``, with the error's evidence."""

    kind: Literal["dead_loop", "hang"]
    evidence: dict[str, JsonValue] = Field(default_factory=dict)
    trajectory_path: str | None = None


class TrialResult(BaseModel):
    """One trial's outcome: a reward, or the infrastructure error that prevented one.

    Reward convention: :mod:`forgeflow.sandbox.trial`.

    Attributes:
        reward: 0.0..1.0; None iff ``exception_type`` is set (an agent trial stopped by a timeout or the
            supervisor keeps both: :data:`forgeflow.common.errors.SCORED_DESPITE_EXCEPTION`).
        started_at: timezone-aware, stored in UTC.
        env_setup_s / verifier_s / agent_s: seconds (container start; the test run, None if it never completed;
            the agent, None for nop/oracle).
        log_tail: the last :data:`forgeflow.sandbox.verifier.LOG_TAIL_CHARS` characters of the verifier's output.

    Raises:
        pydantic.ValidationError: a naive ``started_at``, both or neither of reward and exception (but as
            above), a message without its type.
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
        """``{input_tokens, agent_steps, wall_s}`` where recorded; wall = agent + verifier seconds."""
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
