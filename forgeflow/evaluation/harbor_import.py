"""Harbor results into the store: a Harbor job folder read as forgeflow trials.

``verifier_result.rewards["reward"]`` becomes the reward; ``exception_info`` becomes the exception, mapped by
:data:`HARBOR_EXCEPTION_TYPES` (Harbor's type and message kept in ``exception_message``), its reward dropped
except an agent's ``AgentTimeoutError`` (Harbor's convention, :data:`forgeflow.common.errors.SCORED_DESPITE_EXCEPTION`).
An exception never becomes a reward of 0."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasPath, BaseModel, ConfigDict, Field, ValidationError, model_validator

from forgeflow.common import errors
from forgeflow.common.fsutil import read_json_object, sha256_json
from forgeflow.evaluation.harbor import HARBOR_AGENT_OUTCOMES, map_harbor_exception
from forgeflow.ledger.records import TrialRecord
from forgeflow.ledger.store import Store


# --- import ------------------------------------------------------------------------------------
class _Timing(BaseModel):
    model_config = ConfigDict(extra="ignore")
    started_at: datetime | None = None
    finished_at: datetime | None = None

    def seconds(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return max(0.0, (self.finished_at - self.started_at).total_seconds())


class _TrialResult(BaseModel):
    """What forgeflow reads of Harbor 0.25's ``harbor.models.trial.result.TrialResult``, each field at its place
    in Harbor's nesting (``agent_info.name``, ``verifier_result.rewards``, ...); a missing or bad field's error
    names that path."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1)
    task_name: str = Field(min_length=1)
    trial_name: str = Field(min_length=1)
    job_id: str | None = Field(None, validation_alias=AliasPath("config", "job_id"),
                               description="the Harbor job the trial belongs to, if recorded")
    agent_name: str = Field(min_length=1, validation_alias=AliasPath("agent_info", "name"))
    n_input_tokens: int | None = Field(None, ge=0, validation_alias=AliasPath("agent_result", "n_input_tokens"))
    n_output_tokens: int | None = Field(None, ge=0, validation_alias=AliasPath("agent_result", "n_output_tokens"))
    rewards: dict[str, float] | None = Field(None, validation_alias=AliasPath("verifier_result", "rewards"))
    exception_type: str | None = Field(None, min_length=1, validation_alias=AliasPath("exception_info",
                                                                                      "exception_type"),
                                       description="Harbor's exception class name; None: no exception")
    exception_message: str = Field("", validation_alias=AliasPath("exception_info", "exception_message"))
    started_at: datetime | None = None
    finished_at: datetime | None = None
    environment_setup: _Timing | None = None
    agent_setup: _Timing | None = None
    agent_execution: _Timing | None = None
    verifier: _Timing | None = None
    step_results: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _exception_has_type(cls, data: Any) -> Any:
        info = data.get("exception_info") if isinstance(data, dict) else None
        if isinstance(info, dict) and info.get("exception_type") is None:
            raise ValueError("exception_info has no exception_type")
        return data


def _kind(agent_name: str) -> Literal["nop", "oracle", "agent"]:
    return agent_name if agent_name in ("nop", "oracle") else "agent"  # type: ignore[return-value]


def _trial_record(result: _TrialResult, path: Path, job_id: str, run_id: str | None) -> TrialRecord:
    if result.step_results:
        raise errors.InputError(
            f"trial result {path}: multi-step trials are not supported (forgeflow tasks have one step)")
    kind = _kind(result.agent_name)
    rewards = result.rewards
    reward: float | None = None
    if rewards:
        if "reward" not in rewards:
            raise errors.InputError(
                f"trial result {path}: verifier_result.rewards has no 'reward' key (keys: {sorted(rewards)}); "
                "forgeflow's verifier writes a single reward"
            )
        reward = float(rewards["reward"])
        if not 0.0 <= reward <= 1.0:
            raise errors.InputError(f"trial result {path}: reward {reward} is outside 0..1")
    exception_type = exception_message = None
    harbor_type = result.exception_type
    if harbor_type is not None:
        if harbor_type in HARBOR_AGENT_OUTCOMES and reward is not None:
            pass  # the model's outcome: the reward stands
        else:
            exception_type = map_harbor_exception(harbor_type)
            exception_message = f"Harbor {harbor_type}: {result.exception_message}".strip()
            keep = kind == "agent" and exception_type in errors.SCORED_DESPITE_EXCEPTION
            reward = reward if keep else None
    elif reward is None:
        exception_type = errors.VerifierOutputError.__name__
        exception_message = "Harbor recorded neither a reward nor an exception for this trial"
    timings = {
        name: seconds
        for name, timing in (("env_setup_s", result.environment_setup), ("agent_setup_s", result.agent_setup),
                             ("agent_s", result.agent_execution), ("verifier_s", result.verifier))
        if timing is not None and (seconds := timing.seconds()) is not None
    }
    if result.started_at and result.finished_at:
        timings["total_s"] = max(0.0, (result.finished_at - result.started_at).total_seconds())
    started = result.started_at
    if started is not None and started.tzinfo is None:
        started = started.replace(tzinfo=timezone.utc)  # Harbor writes UTC
    return TrialRecord(
        trial_id=sha256_json({"source": "harbor", "trial": result.id})[:32],
        instance_id=result.task_name, kind=kind, job_id=job_id, run_id=run_id,
        reward=reward, exception_type=exception_type, exception_message=exception_message,
        timings=timings, created_at=started,
        input_tokens=result.n_input_tokens if kind == "agent" else None,
        output_tokens=result.n_output_tokens if kind == "agent" else None,
    )


HARBOR_JOB_KIND = "harbor"
"""``jobs.kind`` of a job imported from Harbor."""


class HarborImportSummary(BaseModel):
    """What a Harbor job folder held (:func:`read_harbor_job`), as the ``harbor-import`` flow records it."""

    model_config = ConfigDict(frozen=True)

    job_id: str = Field(description="the job the trials were recorded under (forgeflow trials --job <job_id>).")
    job_dir: Path = Field(description="the Harbor job folder read.")
    freeze_name: str | None = Field(None,
                                    description="the freeze whose split the trials ran (recorded in the jobs row), "
                                                "or None (no jobs row: a paired compare then checks that the "
                                                "instance sets match).")
    split: str | None = Field(None, description="that split, or None.")
    trials: int = Field(ge=0, description="finished trials recorded.")
    scored: int = Field(ge=0, description="trials with a reward (an exception with a kept reward counts).")
    reward_1: int = Field(ge=0, description="trials with reward 1.")
    exceptions: dict[str, int] = Field(default_factory=dict, description="forgeflow exception class name -> trials.")
    kinds: dict[str, int] = Field(default_factory=dict, description="trial kind (agent, nop, oracle) -> trials.")
    unfinished: list[str] = Field(default_factory=list,
                                  description="trial folders without a finished result (not recorded).")

    @classmethod
    def of(cls, job_id: str, job_dir: Path, trials: Sequence[TrialRecord], unfinished: Sequence[str],
           freeze_name: str | None = None, split: str | None = None) -> HarborImportSummary:
        """The summary of a job's finished ``trials`` (store records) and ``unfinished`` trial folders."""
        exceptions: dict[str, int] = {}
        kinds: dict[str, int] = {}
        for trial in trials:
            kinds[trial.kind] = kinds.get(trial.kind, 0) + 1
            if trial.exception_type is not None:
                exceptions[trial.exception_type] = exceptions.get(trial.exception_type, 0) + 1
        return cls(job_id=job_id, job_dir=job_dir, freeze_name=freeze_name, split=split, trials=len(trials),
                   scored=sum(t.reward is not None for t in trials), reward_1=sum(t.reward == 1.0 for t in trials),
                   exceptions=exceptions, kinds=kinds, unfinished=list(unfinished))


def read_harbor_job(
    job_dir: Path,
    *,
    job_id: str | None = None,
    instance_ids: Iterable[str] | None = None,
    run_id: str | None = None,
    freeze_name: str | None = None,
    split: str | None = None,
) -> tuple[list[TrialRecord], HarborImportSummary]:
    """Read a Harbor job folder into forgeflow trial records (one per finished trial, ordered by trial name) and
    their summary, which names the unfinished trial folders (nothing is written; ``job_id`` defaults to
    ``harbor-<Harbor's job UUID>``; with ``instance_ids`` every task must be one of them; ``freeze_name`` and
    ``split`` only label the summary).

    Raises:
        InputError: not a Harbor job folder (no ``result.json`` with an ``id``), or a trial's ``result.json``
            that is not JSON, lacks a field (file and field named), belongs to another job, is multi-step,
            has no reward in 0..1, or names a task outside ``instance_ids``.
    """
    job_dir = Path(job_dir)
    if not job_dir.is_dir():
        raise errors.InputError(f"Harbor job folder {job_dir} does not exist")
    job_result_path = job_dir / "result.json"
    if not job_result_path.is_file():
        hint = " (it looks like a jobs folder: pass one of its job folders)" if any(
            (child / "result.json").is_file() for child in job_dir.iterdir() if child.is_dir()
        ) else ""
        raise errors.InputError(f"{job_dir} is not a Harbor job folder: it has no result.json{hint}")
    job_document = read_json_object(job_result_path, "Harbor job result")
    harbor_job_id = job_document.get("id")
    if not isinstance(harbor_job_id, str) or "n_total_trials" not in job_document:
        raise errors.InputError(
            f"Harbor job result {job_result_path} lacks 'id' or 'n_total_trials': not a Harbor job result.json"
        )
    job_id = job_id or f"harbor-{harbor_job_id}"
    allowed = set(instance_ids) if instance_ids is not None else None
    records = []
    unfinished = []
    for trial_dir in sorted(child for child in job_dir.iterdir() if child.is_dir()):
        path = trial_dir / "result.json"
        if not path.is_file():
            if (trial_dir / "config.json").is_file():
                unfinished.append(trial_dir.name)
            continue
        try:
            result = _TrialResult.model_validate(read_json_object(path, "Harbor trial result"))
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            field = ".".join(str(part) for part in first["loc"]) or "?"
            raise errors.InputError(
                f"Harbor trial result {path}: field {field}: {first['msg']} ({exc.error_count()} problems)"
            ) from exc
        if result.job_id is not None and result.job_id != harbor_job_id:
            raise errors.InputError(
                f"Harbor trial result {path} belongs to job {result.job_id}, not to {harbor_job_id}"
            )
        if allowed is not None and result.task_name not in allowed:
            raise errors.InputError(
                f"Harbor trial result {path}: task {result.task_name!r} is not one of the {len(allowed)} given "
                "instance ids"
            )
        if result.finished_at is None and result.exception_type is None:
            unfinished.append(trial_dir.name)
            continue
        records.append(_trial_record(result, path, job_id, run_id))
    return records, HarborImportSummary.of(job_id, job_dir, records, unfinished, freeze_name, split)


def import_harbor_job(
    job_dir: Path,
    store: Store,
    *,
    job_id: str | None = None,
    instance_ids: Iterable[str] | None = None,
    run_id: str | None = None,
    freeze_name: str | None = None,
    split: str | None = None,
) -> HarborImportSummary:
    """Read a Harbor job folder (:func:`read_harbor_job`) and upsert its trials into ``store`` in one
    transaction; re-importing the same job changes nothing (trial ids derive from Harbor's trial UUIDs).

    Returns:
        The summary of what was recorded (``freeze_name`` and ``split`` label it; no jobs row is written here).

    Raises:
        InputError: as :func:`read_harbor_job` (nothing is written).
    """
    trials, summary = read_harbor_job(job_dir, job_id=job_id, instance_ids=instance_ids, run_id=run_id,
                                      freeze_name=freeze_name, split=split)
    store.record_trials(trials)
    return summary
