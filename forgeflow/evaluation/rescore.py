"""Re-score a canary job without re-running the model: every stored submission re-verified under the
current verifier, as a new job linked to the original (NeMo Gym's ``gym eval reverify``,
https://docs.nvidia.com/nemo/gym/tutorials/evaluation-tutorials/reverify-rollouts, and Inspect's
``inspect score``, https://inspect.aisi.org.uk/scorers.html, are the anchors).

The trials *standing* for the job (its merged view) are re-scored. A submission comes from the trial row
(its ``submission_sha256`` checked again; from ledger migration 0008 on), else from the trial's trajectory
(``info.submission``). A trial whose agent run made no submission is *carried* (its exception stands); one
whose submission cannot be found is *missing* (:class:`SubmissionMissingError`, never a reward of 0).

The new job (kind :data:`RESCORE_JOB_KIND`, ``parent_job_id`` the original) never rewrites the original's
rows; its id digests the standing trials and the verifier's source (:func:`verifier_sha256`), so the same
re-score again upserts the same rows, and a verifier change makes a new job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.common.fsutil import sha256_bytes, sha256_json
from forgeflow.common.names import sanitize_name
from forgeflow.common.settings import home_dir
from forgeflow.curation.task_rows import DatasetSource, TestSpec, load_task_rows
from forgeflow.evaluation import compare
from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.evaluation.canary import JOB_KIND, RECOVERY_JOB_KIND, canary_tasks
from forgeflow.ledger import records
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.limits import DEFAULT_VERIFIER_TIMEOUT_S, VerifierTimeoutS
from forgeflow.sandbox.scoring import verify_submission
from forgeflow.sandbox.verifier import TaskTests

RESCORE_JOB_KIND = "rescore"
"""``jobs.kind`` of a re-score; its ``parent_job_id`` is the job whose submissions it re-verified."""

RESCORABLE_KINDS = (JOB_KIND, RESCORE_JOB_KIND)
"""Job kinds a re-score takes: a canary job (with its recovery jobs merged in) or an earlier re-score."""

VERIFIER_SOURCES = ("sandbox", "data/forgeflow_pytest_report.py")
"""What the verifier is made of, under ``forgeflow/``: every module of :mod:`forgeflow.sandbox` and the pytest
plugin it runs inside the sandbox (:func:`verifier_sha256` digests them)."""


class SubmissionMissingError(errors.InfraError):
    """A stored trial's submission cannot be found (no diff in its row, its trajectory file gone or unreadable,
    or a stored diff whose sha256 is not the recorded one). A re-score records it as the trial's exception with
    the reason: a lost record is not the model's outcome, never a reward of 0."""


def verifier_sha256() -> str:
    """The sha256 (64 hex) of the verifier's source: every ``.py`` under :data:`VERIFIER_SOURCES`, by relative path
    and bytes. The same forgeflow gives the same digest; a change to the verifier gives another (a re-score's
    default id and its job's ``params.verifier_sha256``)."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for rel in VERIFIER_SOURCES for p in ([root / rel] if (root / rel).is_file()
                                                          else (root / rel).rglob("*.py")))
    return sha256_json([[str(p.relative_to(root)), sha256_bytes(p.read_bytes())] for p in files])


SubmissionSource = Literal["store", "trajectory"]


class RescoreItem(BaseModel):
    """One standing trial of the original and what the re-score does with it.

    Attributes:
        original: the trial as stored (never rewritten).
        action: ``reverify`` (its submission is re-verified), ``carried`` (no submission was made: the
            original's exception stands) or ``missing`` (the submission cannot be found: SubmissionMissingError).
        submission: the diff to re-verify (``reverify`` only; ``""`` is an empty submission).
        source: where the diff came from (``store`` or ``trajectory``; None unless ``reverify``).
        reason: why it is carried over or missing (None for ``reverify``).
        tests: the task's tests as the verifier runs them (``reverify`` only).
    """

    model_config = ConfigDict(frozen=True)

    original: records.TrialRecord
    action: Literal["reverify", "carried", "missing"]
    submission: str | None = None
    source: SubmissionSource | None = None
    reason: str | None = None
    tests: TaskTests | None = None


class RescorePlan(BaseModel):
    """What a re-score of ``original`` does (read-only: :func:`plan_rescore`).

    Attributes:
        original: the original job's row.
        merged_label: the view re-scored (``job X`` or ``original job X + N recovery jobs``).
        rescore_job_id: the new job's id.
        verifier_sha256: the verifier's source digest (:func:`verifier_sha256`).
        verifier_timeout_s: the limit of one test run, seconds: the request's, else the original job's recorded one.
        agent_config: the original job's recorded agent config with its limits resolved (:meth:`AgentConfig.resolved`):
            the verifier's ``memory_mb``, ``cpus``, ``tamper_policy``, ``screen_policy`` and ``verifier_backend``.
        items: one per standing trial, in instance-id order.
        rows_params: the original's task-row source (``candidates_path`` / ``generated_path`` / ``dataset``,
            ``test_commands``, ``test_specs``), recorded on the new job so it can be re-scored in turn.
    """

    model_config = ConfigDict(frozen=True)

    original: records.JobRecord
    merged_label: str
    rescore_job_id: str = Field(min_length=1, max_length=512)
    verifier_sha256: str
    verifier_timeout_s: VerifierTimeoutS
    agent_config: AgentConfig
    items: list[RescoreItem]
    rows_params: dict[str, Any] = Field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        """``{"trials", "reverify", "carried", "missing"}``: how many standing trials take each path."""
        out = {"trials": len(self.items), "reverify": 0, "carried": 0, "missing": 0}
        for item in self.items:
            out[item.action] += 1
        return out

    def job_record(self, run_id: str | None = None) -> records.JobRecord:
        """The new job's row: kind :data:`RESCORE_JOB_KIND`, parent the original, the original's freeze, split and
        model; ``params`` the verifier digest, the verifier timeout, the view re-scored and the task-row source."""
        o = self.original
        return records.JobRecord(
            job_id=self.rescore_job_id, kind=RESCORE_JOB_KIND, parent_job_id=o.job_id, freeze_name=o.freeze_name,
            split=o.split, model_sha256=o.model_sha256, run_id=(run_id or "")[:64] or None,
            params={"rescores": o.job_id, "view": self.merged_label, "verifier_sha256": self.verifier_sha256,
                    "verifier_timeout_s": self.verifier_timeout_s,
                    "agent_config": o.params.get("agent_config"), **self.rows_params,
                    "counts": self.counts()})


def default_rescore_job_id(job_id: str, trial_ids: list[str], verifier_digest: str) -> str:
    """``<job_id>-rescore-<12 hex>``: the digest of the standing trial ids and the verifier's source digest."""
    return f"{job_id}-rescore-{sha256_json([sorted(trial_ids), verifier_digest])[:12]}"


def check_rescorable(store: Any, job_id: str) -> records.JobRecord:
    """The row of the job to re-score (reads only; what ``forgeflow rescore`` checks before anything starts).

    Raises:
        InputError: no job ``job_id`` (its canary and rescore jobs are listed), a recovery job (its original
            named), or a job of another kind.
    """
    job = store.get_job(job_id)
    if job is None:
        known = [j.job_id for kind in RESCORABLE_KINDS for j in store.jobs(kind=kind)]
        raise errors.InputError(f"rescore: job {job_id!r} is not recorded in the store ({store.display_url}); its "
                                f"canary and rescore jobs: {', '.join(known[:20]) or 'none'}")
    if job.kind == RECOVERY_JOB_KIND:
        raise errors.InputError(f"rescore: job {job_id!r} is a recovery job of {job.parent_job_id!r}: give the "
                                f"original job ({job.parent_job_id!r}); its merged view includes this one")
    if job.kind not in RESCORABLE_KINDS:
        raise errors.InputError(f"rescore: job {job_id!r} is a {job.kind!r} job; only canary jobs and their re-scores "
                                f"keep the submissions a re-score re-verifies")
    return job


def _agent_config(job: records.JobRecord) -> AgentConfig:
    """The agent config the job recorded (its verifier limits), else the defaults (the lifecycle's early jobs)."""
    recorded = job.params.get("agent_config")
    return AgentConfig.model_validate(recorded) if recorded else AgentConfig()


def _trajectory(store: Any, trial: records.TrialRecord, dirs: dict[str, Path]) -> Path:
    """Where ``trial``'s trajectory is: its job's ``params.trajectories_dir`` (the canary's and a recovery's), else
    ``$FORGEFLOW_HOME/canary/<job>/trajectories``."""
    job_id = trial.job_id or ""
    if job_id not in dirs:
        row = store.get_job(job_id) if job_id else None
        recorded = (row.params if row is not None else {}).get("trajectories_dir")
        dirs[job_id] = Path(recorded or home_dir() / "canary" / job_id / "trajectories")
    return dirs[job_id] / f"{trial.trial_id}.traj.json"


def _from_trajectory(path: Path) -> tuple[str | None, str | None, str | None]:
    """``(submission, agent error, problem)`` of a trajectory file: the diff in ``info.submission``, the
    agent's error in ``info.forgeflow.error`` (``"ModelEndpointError: ..."``), or why neither can be read."""
    if not path.is_file():
        return None, None, f"no trajectory at {path}"
    try:
        info = json.loads(path.read_text(encoding="utf-8")).get("info")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        return None, None, f"trajectory {path} cannot be read: {type(exc).__name__}: {exc}"
    if not isinstance(info, dict) or not isinstance(info.get("submission"), str):
        return None, None, f"trajectory {path} holds no info.submission"
    error = (info.get("forgeflow") or {}).get("error") if isinstance(info.get("forgeflow"), dict) else None
    return info["submission"], error if isinstance(error, str) else None, None


def plan_item(store: Any, trial: records.TrialRecord, dirs: dict[str, Path]) -> RescoreItem:
    """What the re-score does with one standing trial: ``reverify`` (submission from the store or its
    trajectory), ``carried`` when its agent run made none, or ``missing``; ``dirs`` caches trajectory folders."""
    if trial.submission is not None:
        digest = sha256_bytes(trial.submission.encode())
        if trial.submission_sha256 not in (None, digest):
            return RescoreItem(original=trial, action="missing", reason=f"the stored submission's sha256 {digest} "
                               f"is not the recorded {trial.submission_sha256}: not re-verified")
        return RescoreItem(original=trial, action="reverify", submission=trial.submission, source="store")
    submission, agent_error, problem = _from_trajectory(_trajectory(store, trial, dirs))
    scored = trial.reward is not None
    if submission is None:
        if trial.exception_type is not None and not scored:  # excluded before, and nothing to re-verify now
            return RescoreItem(original=trial, action="carried", reason=f"{problem}; the original's "
                               f"{trial.exception_type} stands")
        return RescoreItem(original=trial, action="missing", reason=f"no submission in the store, {problem}")
    agent_type = agent_error.split(":", 1)[0].strip() if agent_error else None
    if not scored and agent_type is not None and agent_type not in errors.SCORED_DESPITE_EXCEPTION:
        return RescoreItem(original=trial, action="carried", reason=f"the agent run ended in {agent_type} before it "
                           f"made a submission; the original's {trial.exception_type} stands")
    if not scored and not submission:
        # the agent's tree reaches the trajectory only as the verifier's git wrote it: a verifier that broke
        # left info.submission empty, which is not the submission (re-verifying "" would score it 0)
        return RescoreItem(original=trial, action="missing", reason=f"the trajectory's submission is empty and the "
                           f"original was never scored ({trial.exception_type}): the submission the verifier "
                           "would have seen is not recorded")
    return RescoreItem(original=trial, action="reverify", submission=submission, source="trajectory")


def _rows_params(job: records.JobRecord, generated_path: Path | None) -> dict[str, Any]:
    """The task-row source a re-score reads (and records on its job): the original's unless a file is given."""
    p = job.params
    if generated_path is not None:
        return {"generated_path": str(generated_path)}
    keys = ("candidates_path", "generated_path", "dataset", "test_commands", "test_specs")
    return {k: p[k] for k in keys if p.get(k)}


def _tests(store: Any, items: list[RescoreItem], rows: dict[str, Any], default_generated: Path) -> list[RescoreItem]:
    """``items`` with each re-verified one's :class:`TaskTests` (the canary's own task assembly: accepted
    task, image, test command, log parser).

    Raises:
        PreflightError: a task to re-verify has no row, is no longer accepted, or its image is gone (listed).
        InputError: the task rows cannot be read.
    """
    wanted = [i.original.instance_id for i in items if i.action == "reverify"]
    if not wanted:
        return items
    dataset = DatasetSource(**rows["dataset"]) if rows.get("dataset") else None
    loaded = load_task_rows(Path(rows["candidates_path"]) if rows.get("candidates_path") else None,
                            None if rows.get("candidates_path") or dataset else
                            Path(rows.get("generated_path") or default_generated),
                            default_generated, rows.get("test_commands"), stage="rescore", dataset=dataset,
                            test_specs={r: TestSpec(**v) for r, v in (rows.get("test_specs") or {}).items()})
    tasks = {t.instance_id: t for t in canary_tasks(store, wanted, loaded.rows, test_commands=loaded.test_commands,
                                                   log_parsers=loaded.log_parsers)}
    return [i.model_copy(update={"tests": tasks[i.original.instance_id]}) if i.action == "reverify" else i
            for i in items]


def plan_rescore(store: Any, job_id: str, default_generated: Path, *, rescore_job_id: str | None = None,
                 verifier_timeout_s: float | None = None, generated_path: Path | None = None) -> RescorePlan:
    """Everything a re-score of canary job ``job_id`` does, read before any sandbox starts (reads only).

    Args:
        default_generated: the task-rows file when neither ``generated_path`` nor the job names one (the demo's).
        rescore_job_id: the new job's id; None: ``<job_id>-rescore-<digest>`` (:func:`default_rescore_job_id`).
        verifier_timeout_s: limit of one test run, seconds; None: the job's recorded one (180 s when none).
        generated_path: the task-rows file; None: the job's recorded source.

    Raises:
        InputError: the job is unknown, a recovery job, of another kind or without agent trials; the re-score
            id is the job's own or another job's; the task rows cannot be read.
        PreflightError: a task to re-verify cannot run (listed: no row, not accepted, image gone).
    """
    job = check_rescorable(store, job_id)
    view = compare.merged_job(store, job.job_id)
    dirs: dict[str, Path] = {}
    items = [plan_item(store, t, dirs) for t in view.trials]
    digest = verifier_sha256()
    new_id = rescore_job_id or default_rescore_job_id(job.job_id, [t.trial_id for t in view.trials], digest)
    existing = store.get_job(new_id)
    if new_id == job.job_id or (existing is not None and (existing.kind, existing.parent_job_id)
                                != (RESCORE_JOB_KIND, job.job_id)):
        raise errors.InputError(f"rescore: job id {new_id!r} is taken (the original, or a job that is not a re-score "
                                f"of {job.job_id!r}); give another rescore job id")
    recorded = float(job.params.get("verifier_timeout_s") or DEFAULT_VERIFIER_TIMEOUT_S)
    rows = _rows_params(job, generated_path)
    return RescorePlan(original=job, merged_label=view.label, rescore_job_id=new_id, verifier_sha256=digest,
                       verifier_timeout_s=verifier_timeout_s or recorded, agent_config=_agent_config(job).resolved(),
                       items=_tests(store, items, rows, default_generated), rows_params=rows)


class VerdictChange(BaseModel):
    """One row of a re-score's verdict table: a task's original outcome and its outcome now, and why.

    Attributes:
        instance_id: the task.
        original_trial_id: the original's standing trial (never rewritten).
        trial_id: the re-score's trial of the task.
        action: ``reverify``, ``carried`` or ``missing`` (:class:`RescoreItem`).
        source: where the submission came from (``store`` / ``trajectory``; None when not re-verified).
        old_reward / old_exception: the original's reward (None after an exception) and exception type.
        new_reward / new_exception: the re-score's.
        changed: the (reward, exception type) pair differs.
        why: the verifier's notes, the tests that did not pass, the verifier's error, or why it was not re-verified.
    """

    model_config = ConfigDict(frozen=True)

    instance_id: str
    original_trial_id: str
    trial_id: str
    action: Literal["reverify", "carried", "missing"]
    source: SubmissionSource | None = None
    old_reward: float | None = None
    old_exception: str | None = None
    new_reward: float | None = None
    new_exception: str | None = None
    changed: bool
    why: str

    @classmethod
    def of(cls, item: RescoreItem, row: records.TrialRecord) -> VerdictChange:
        """The verdict-table row of ``item`` re-scored as ``row`` (:func:`rescore_trial`'s trial: its
        ``verifier["why"]`` is the reason)."""
        old = item.original
        return cls(instance_id=old.instance_id, original_trial_id=old.trial_id, trial_id=row.trial_id,
                   action=item.action, source=item.source, old_reward=old.reward, old_exception=old.exception_type,
                   new_reward=row.reward, new_exception=row.exception_type,
                   changed=(old.reward, old.exception_type) != (row.reward, row.exception_type),
                   why=row.verifier["why"])


def rescored_trial_id(rescore_job_id: str, original_trial_id: str) -> str:
    """The re-score's trial id of a task: 32 hex of the sha256 of the re-score's id and the original trial's id
    (the same re-score started again upserts the same rows)."""
    return sha256_json({"rescore": rescore_job_id, "trial": original_trial_id})[:32]


def _test_why(verdict: Any, tests: TaskTests) -> str:
    """Why a verdict without notes is what it is: every test passed, or which did not (the first three)."""
    statuses = verdict.result.tests if verdict.result is not None else {}
    groups = (("FAIL_TO_PASS", tests.FAIL_TO_PASS), ("PASS_TO_PASS", tests.PASS_TO_PASS))
    failing = [f"{kind} {t}" for kind, ids in groups for t in ids if statuses.get(t) != "PASSED"]
    if not failing:
        return "every FAIL_TO_PASS and PASS_TO_PASS test passed"
    more = f" and {len(failing) - 3} more" if len(failing) > 3 else ""
    return "not passing: " + ", ".join(failing[:3]) + more


def rescore_trial(item: RescoreItem, agent_config: AgentConfig, verifier_timeout_s: float, rescore_job_id: str,
                  run_id: str | None = None) -> records.TrialRecord:
    """Re-score one standing trial as the new job's trial row: re-verify its submission in a fresh sandbox (the
    limits and policies of ``agent_config``, the original job's resolved one; ``verifier_timeout_s`` seconds per
    test run), carry its exception over, or record the missing submission; ``verifier["why"]`` says why
    (:meth:`VerdictChange.of`). The agent's costs stay the original's; an agent timeout's exception stands
    beside the new reward; a broken verifier is the new trial's exception, never a reward of 0.

    Raises:
        InputError: an unknown parser, backend or tamper policy (nothing graded).
    """
    old = item.original
    trial_id = rescored_trial_id(rescore_job_id, old.trial_id)
    kept = errors.SCORED_DESPITE_EXCEPTION
    agent_exc = old.exception_type if old.exception_type in kept else None
    timings = {k: v for k, v in (old.timings or {}).items() if k != "verifier_s"}
    evidence: dict[str, Any] = {"rescore_of": old.trial_id, "action": item.action}
    reward: float | None = None
    exc_type, exc_message, submission = None, None, None
    if item.action == "reverify" and item.tests is not None:
        submission = item.submission
        evidence["submission_source"] = item.source
        try:
            verdict = verify_submission(item.tests, item.submission or "", timeout_s=verifier_timeout_s,
                                        spec=SandboxSpec.of(agent_config.over()),
                                        name=sanitize_name(f"ff-rescore-{old.instance_id}-{trial_id[:10]}"),
                                        tamper_policy=agent_config.tamper_policy,
                                        backend=agent_config.verifier_backend, screen_policy=agent_config.screen_policy)
        except errors.InfraError as exc:  # the verifier broke: no reward, never 0
            exc_type, exc_message = agent_exc or type(exc).__name__, f"verifier failed: {type(exc).__name__}: {exc}"
            why = exc_message
        else:
            reward = verdict.reward
            evidence |= {**verdict.evidence, "notes": verdict.notes}
            if verdict.result is not None:
                timings["verifier_s"] = verdict.result.duration_s
            exc_type = agent_exc
            exc_message = old.exception_message if agent_exc else None
            why = "; ".join(verdict.notes) or _test_why(verdict, item.tests)
    elif item.action == "carried":
        exc_type, exc_message = old.exception_type, f"carried over from trial {old.trial_id}: {item.reason}"
        why = f"not re-verified: {item.reason}"
    else:
        exc_type = SubmissionMissingError.__name__
        exc_message = why = f"submission missing: {item.reason or 'no submission to re-verify'}"
    evidence["why"] = why
    return records.TrialRecord(trial_id=trial_id, instance_id=old.instance_id, kind="agent", job_id=rescore_job_id,
                               reward=reward, exception_type=exc_type, exception_message=exc_message,
                               timings=timings, model_sha256=old.model_sha256, run_id=(run_id or "")[:64] or None,
                               agent_steps=old.agent_steps, input_tokens=old.input_tokens,
                               output_tokens=old.output_tokens, verifier=evidence, submission=submission)
