"""The ledger's records: one frozen pydantic model per table row, checked on construction."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from forgeflow.common.errors import (
    SCORED_DESPITE_EXCEPTION,
    InputError,
)
from forgeflow.common.fsutil import sha256_bytes, sha256_json
from forgeflow.ledger.tables import (
    _ID,
    ArtifactKind,
    ImageRole,
    ImageStatus,
    ServingStatus,
    SupervisionKind,
    TaskStatus,
    TrialKind,
)
from forgeflow.ledger.trial_result import TrialResult

_Sha256 = Field(pattern=r"^[0-9a-f]{64}$")
"""A lower-case hex sha256 (64 characters)."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, from_attributes=True, extra="forbid")

    COLUMNS: ClassVar[dict[str, str]] = {}
    """Fields whose table column is spelt otherwise (field -> column; the SQL schema keeps its names)."""

    run_id: str | None = Field(default=None, max_length=64)


class ImageRecord(_Record):
    """A row of ``images``; the ``status``/``source_*`` fields are set for a migration target only."""

    ref: str = Field(min_length=1, max_length=_ID)
    digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    role: ImageRole
    size_bytes: int | None = Field(default=None, ge=0)
    project: str | None = None
    status: ImageStatus | None = None
    status_reason: str | None = None
    source_ref: str | None = Field(default=None, max_length=_ID)
    source_digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")


def _with_digest(data: dict[str, Any], field: str, what: str) -> dict[str, Any]:
    """``data`` with ``<field>_sha256`` filled from ``data[field]`` (UTF-8 bytes), or checked against it.

    Raises:
        ValueError: the given digest is not the sha256 of the field.
    """
    digest = sha256_bytes(data[field].encode())
    given = data.get(f"{field}_sha256")
    if given is None:
        return {**data, f"{field}_sha256": digest}
    if given != digest:
        raise ValueError(f"{what}: {field}_sha256 {given} is not the sha256 of its {field} ({digest})")
    return data


class TaskRecord(_Record):
    """A row of ``task_instances``; ``reason`` says why a task was rejected or errored.

    Raises:
        pydantic.ValidationError: a field out of shape, or a ``patch_sha256`` that is not the patch's.
    """

    instance_id: str = Field(min_length=1, max_length=_ID)
    repo: str = Field(min_length=1, max_length=256)
    patch_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    patch: str | None = None
    image_ref: str | None = None
    status: TaskStatus
    reason: str | None = None
    FAIL_TO_PASS: list[str] = Field(default_factory=list, validation_alias=AliasChoices("FAIL_TO_PASS", "fail_to_pass"))
    PASS_TO_PASS: list[str] = Field(default_factory=list, validation_alias=AliasChoices("PASS_TO_PASS", "pass_to_pass"))
    COLUMNS: ClassVar[dict[str, str]] = {"FAIL_TO_PASS": "fail_to_pass", "PASS_TO_PASS": "pass_to_pass"}
    known_tests: list[str] = Field(default_factory=list, description="test ids the pristine runs collected; "
                                   "[]: not recorded (a submission reporting another test is tampering)")
    pristine_duration_s: float | None = Field(default=None, ge=0, description="the longest Oracle run, seconds")

    @field_validator("known_tests", mode="before")
    @classmethod
    def _not_recorded(cls, value: Any) -> Any:
        return [] if value is None else value  # NULL: a row from before migration 0009

    @model_validator(mode="before")
    @classmethod
    def _patch_digest(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("patch") is None:
            return data
        return _with_digest(data, "patch", f"task {data.get('instance_id')!r}")


class BatchRecord(_Record):
    """A row of ``batches``."""

    batch_id: str = Field(min_length=1, max_length=_ID)
    kind: str = Field(min_length=1, max_length=32)
    instance_ids: list[str]
    concurrency: int = Field(ge=1)


class TrialRecord(_Record):
    """A row of ``trials``: ``reward`` is None when the trial ended in an exception.

    A *void* trial is kept for audit but left out of reads and counts unless asked.

    Raises:
        pydantic.ValidationError: a field out of shape, or a ``submission_sha256`` that is not the submission's.
    """

    trial_id: str = Field(min_length=1, max_length=_ID)
    instance_id: str = Field(min_length=1, max_length=_ID)
    batch_id: str | None = None
    kind: TrialKind
    job_id: str | None = None
    reward: float | None = None
    exception_type: str | None = Field(default=None, max_length=128)
    exception_message: str | None = None
    timings: dict[str, float] = Field(default_factory=dict, description="seconds per phase (agent_s, verifier_s)")
    model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    created_at: datetime | None = None
    voided_at: datetime | None = None
    void_reason: str | None = None
    agent_steps: int | None = Field(default=None, ge=0)
    input_tokens: int | None = Field(default=None, ge=0)
    output_tokens: int | None = Field(default=None, ge=0)
    verifier: dict[str, Any] | None = None
    submission: str | None = Field(None, description="the agent's diff as the verifier got it; None: not recorded")
    submission_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @classmethod
    def from_trial(cls, trial: TrialResult, job_id: str | None, model_sha256: str | None, run_id: str | None,
                   batch_id: str | None = None) -> TrialRecord:
        """The row of ``trial`` in job ``job_id`` / batch ``batch_id`` (timings flattened to seconds per phase).

        Raises:
            pydantic.ValidationError: an id, digest or message out of the row's bounds.
        """
        timings = {k: v for k, v in {"env_setup_s": trial.env_setup_s, "verifier_s": trial.verifier_s,
                                     "agent_s": trial.agent_s}.items() if v is not None}
        return cls(trial_id=trial.trial_id, instance_id=trial.instance_id, kind=trial.kind, job_id=job_id,
                   batch_id=batch_id, reward=trial.reward, exception_type=trial.exception_type,
                   exception_message=trial.exception_message, timings=timings, model_sha256=model_sha256,
                   created_at=trial.started_at, run_id=run_id, agent_steps=trial.agent_steps,
                   input_tokens=trial.input_tokens, output_tokens=trial.output_tokens,
                   verifier=trial.verifier.model_dump(mode="json") if trial.verifier is not None else None,
                   submission=trial.submission)

    @model_validator(mode="before")
    @classmethod
    def _submission_digest(cls, data: Any) -> Any:
        if not isinstance(data, dict):  # a row read from the store: its digest is checked where it is used
            return data
        if data.get("submission") is None:
            if data.get("submission_sha256") is not None:
                raise ValueError(f"trial {data.get('trial_id')!r}: submission_sha256 without its submission")
            return data
        return _with_digest(data, "submission", f"trial {data.get('trial_id')!r}")


TRIAL_VOID_FIELDS = frozenset({"voided_at", "void_reason"})
"""Columns only :meth:`Store.void_trials` writes: re-recording a trial never un-voids it."""


class FreezeRecord(_Record):
    """A row of ``freezes``; ``counts``: split -> tasks; ``bundle_*`` None for a freeze made before bundles."""

    name: str = Field(min_length=1, max_length=128)
    semantic_sha256: str = _Sha256
    file_sha256: str = _Sha256
    manifest_path: str
    counts: dict[str, int] = Field(default_factory=dict)
    bundle_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    bundle_path: str | None = None


class ModelArtifactRecord(_Record):
    """One production of a model artifact from ``parent_sha256`` by run ``run_id``."""

    sha256: str = _Sha256
    kind: ArtifactKind
    path: str
    quantization: str | None = None
    parent_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    lineage: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None

    @model_validator(mode="after")
    def _not_its_own_parent(self) -> ModelArtifactRecord:
        if self.parent_sha256 is not None and self.parent_sha256 == self.sha256:
            raise ValueError(
                f"{self.kind} {self.sha256} is recorded as made from itself (parent_sha256 == sha256): "
                "a step that left the bytes unchanged (e.g. an RL burst with zero advantages) made nothing new"
            )
        return self


def production_id(sha256: str, parent_sha256: str | None, run_id: str | None) -> str:
    """The natural key of one production: sha256 of JSON ``[sha256, parent_sha256, run_id]`` (as migration 0004)."""
    return sha256_json([sha256, parent_sha256, run_id])


class ServingGenerationRecord(_Record):
    """A row of ``serving_generations``."""

    generation: int = Field(ge=0)
    port: int = Field(ge=1, le=65535)
    gguf_sha256: str = _Sha256
    status: ServingStatus


class JobRecord(_Record):
    """A row of ``jobs``; a recovery job's ``parent_job_id`` is the job whose exception trials it re-runs."""

    job_id: str = Field(min_length=1, max_length=_ID)
    kind: str = Field(min_length=1, max_length=32)
    parent_job_id: str | None = Field(default=None, max_length=_ID)
    freeze_name: str | None = Field(default=None, max_length=128)
    split: str | None = Field(default=None, max_length=64)
    model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    params: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None


class JudgmentRecord(_Record):
    """A row of ``judgments``: one answer's verdict with its ids (:func:`forgeflow.evaluation.judge.judge_answer`)."""

    judgment_id: str = Field(min_length=1, max_length=_ID)
    job_id: str | None = Field(default=None, max_length=_ID)
    question_id: str = Field(min_length=1, max_length=_ID)
    answer: str
    reference: str
    correct: bool
    rule: Literal["number", "list", "string"]
    normalized_answer: str
    normalized_reference: str


class SupervisionEventRecord(_Record):
    """A row of ``supervision_events``."""

    event_id: str = Field(min_length=1, max_length=_ID)
    trial_id: str = Field(min_length=1, max_length=_ID)
    job_id: str | None = Field(default=None, max_length=_ID)
    kind: SupervisionKind
    evidence: dict[str, Any] = Field(default_factory=dict)
    trajectory_path: str | None = None


def check_outcome(record: TrialRecord) -> None:
    """A trial has a reward or an exception, not both (but an agent timeout: Harbor's convention), not neither.

    Raises:
        InputError: naming the trial and both fields.
    """
    both_ok = record.kind == "agent" and record.exception_type in SCORED_DESPITE_EXCEPTION
    if (record.reward is None and record.exception_type is None) or (
        record.reward is not None and record.exception_type is not None and not both_ok
    ):
        raise InputError(
            f"trial {record.trial_id!r} must have exactly one of reward "
            f"({record.reward!r}) and exception_type ({record.exception_type!r})"
        )


# --- records (what the helpers take and return) ------------------------------------------------
