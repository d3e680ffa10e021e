"""Recovery by exact ids: undo the trials an infrastructure fault broke, and nothing else.

Trials an infrastructure fault broke carry an ``exception_type`` and no reward, their tasks status
``error``. Only such trials are voided (kept for audit, excluded from reads and counts), and a task
goes back to ``candidate`` only if it is ``error`` and its latest NOP/Oracle trial is being voided;
accepted and rejected tasks are never touched. With ``include_rejections`` (exact ids only), a
``rejected`` task whose every live NOP/Oracle trial is selected (a dead build tunnel can reject with
a reward) has them voided and is validated afresh. :func:`apply_recovery` backs up every affected
row and applies the plan in one transaction, verifying the counts.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import (
    atomic_write_bytes,
    atomic_write_text,
    sha256_file,
    sha256_json,
)
from forgeflow.ledger.records import TaskRecord, TrialRecord
from forgeflow.ledger.store import Store
from forgeflow.ledger.tables import Batch, TaskInstance, Trial

BACKUP_SCHEMA_VERSION = 1
"""Layout version of the backup JSON written by :func:`apply_recovery`."""

VALIDATION_KINDS = ("nop", "oracle")
"""Trial kinds whose outcome sets a task's status (agent trials never requeue a task)."""


class RecoveryRequest(BaseModel):
    """What to recover: batch or trial ids, or an exception type inside a ``[since, until)`` window (never
    across all history); and how (``dry_run``, ``backup_dir``): the ``recover`` flow's parameters.

    Raises:
        ValueError (pydantic ValidationError): no selector; ids mixed with an exception type; an
            exception type without both window ends; a naive or empty window;
            ``include_rejections`` with an exception type.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_ids: list[str] = Field(default_factory=list,
        description="every trial recorded with one of these batch ids is selected")
    trial_ids: list[str] = Field(default_factory=list, description="these trials are selected")
    exception_type: str | None = Field(default=None, min_length=1, max_length=128,
        description="select trials that ended in this exception class (e.g. RegistryUnavailableError)")
    since: datetime | None = Field(None,
        description="window start, inclusive (timezone-aware; required with exception_type)")
    until: datetime | None = Field(None,
        description="window end, exclusive (timezone-aware; required with exception_type)")
    reason: str = Field(min_length=1, max_length=2000,
        description="why (stored on every voided trial and requeued task)")
    include_rejections: bool = Field(False,
        description="also requeue rejected tasks whose every live validation trial is selected (ids only)")
    dry_run: bool = Field(True, description="only list what would be voided and requeued; False: back up, void, "
                                            "requeue and audit")
    backup_dir: Path | None = Field(None, description="folder for the backup of the affected rows (JSON + "
                                                      ".sha256); None: $FORGEFLOW_HOME/recovery")

    @field_validator("since", "until")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("must be timezone-aware (e.g. 2026-12-01T10:00:00+00:00)")
        return value.astimezone(UTC) if value is not None else None

    @model_validator(mode="after")
    def _one_mode(self) -> RecoveryRequest:
        by_ids = bool(self.batch_ids or self.trial_ids)
        if self.exception_type is None:
            if not by_ids:
                raise ValueError("give batch_ids and/or trial_ids, or exception_type with since/until")
            if self.since is not None or self.until is not None:
                raise ValueError("since/until apply only with exception_type")
            return self
        if self.include_rejections:
            raise ValueError("include_rejections needs exact batch_ids and/or trial_ids, not an exception_type "
                             "window: a rejection is voided only where its ids are named")
        if by_ids:
            raise ValueError("select by ids or by exception_type within a window, not both")
        if self.since is None or self.until is None:
            raise ValueError(
                f"exception_type {self.exception_type!r} needs a time window (since and until): "
                "recovery never voids an error type across all history"
            )
        if self.since >= self.until:
            raise ValueError(f"empty window: since {self.since} is not before until {self.until}")
        return self

    def selection(self) -> dict[str, Any]:
        """The request as JSON without how it runs (``dry_run``, ``backup_dir``): what the plan's digest covers
        and the backup records, so a dry run and its apply plan alike."""
        return self.model_dump(mode="json", exclude={"dry_run", "backup_dir"})


class KeptTrial(BaseModel):
    """A selected trial that recovery leaves as it is, and why."""

    model_config = ConfigDict(frozen=True)

    trial_id: str
    instance_id: str
    why: str


class Summary(BaseModel):
    """The counts recovery checks: live (non-void) trials, void trials, tasks per status."""

    model_config = ConfigDict(frozen=True)

    trials: int = Field(ge=0)
    void_trials: int = Field(ge=0)
    tasks_by_status: dict[str, int]


class RecoveryPlan(BaseModel):
    """What :func:`apply_recovery` would do (the dry run's answer)."""

    model_config = ConfigDict(frozen=True)

    request: RecoveryRequest
    void: list[TrialRecord] = Field(description="trials to mark void, by created_at then id")
    requeue: list[TaskRecord] = Field(description="task rows to put back to candidate, by instance id")
    kept: list[KeptTrial] = Field(description="selected trials left alone (a reward; already void)")
    before: Summary = Field(description="the summary now")
    expected_after: Summary = Field(description="the summary after applying")
    plan_sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
        description="digest of the request, trial ids and instance ids (names the backup)")

    @property
    def empty(self) -> bool:
        """True when there is nothing to void and nothing to requeue."""
        return not self.void and not self.requeue


class RecoveryResult(BaseModel):
    """One recovery, listed or done: the ``recover`` flow's result and :func:`apply_recovery`'s.

    A dry run (:meth:`listing`) carries ``void``, ``requeue`` and ``kept``; an applied recovery carries
    the other fields (``backup_*`` None when the plan was empty); the other group stays None.

    Raises:
        ValueError (pydantic ValidationError): the fields of a dry run and of an applied recovery mixed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dry_run: bool = Field(description="True: nothing changed; the lists say what would.")
    void: list[str] | None = Field(default=None, description="Dry run: trial ids that would be voided.")
    requeue: list[str] | None = Field(default=None, description="Dry run: instance ids that would be requeued.")
    kept: list[str] | None = Field(default=None, description="Dry run: selected trial ids left as they are.")
    recovery_id: str | None = Field(default=None, description="Applied: recover-<UTC time>-<plan_sha256[:8]>.")
    voided: int | None = Field(default=None, ge=0, description="Applied: trials newly marked void (count).")
    requeued: int | None = Field(default=None, ge=0, description="Applied: tasks put back to candidate (count).")
    backup_path: Path | None = Field(default=None, description="Applied: the backup JSON (None: nothing to back up).")
    backup_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                                      description="Applied: the backup's sha256 (also in <backup>.sha256, sha256sum "
                                                  "format).")
    after: Summary | None = Field(default=None, description="Applied: the store's counts after the recovery (equal "
                                                            "to the plan's expected_after).")
    voided_at: datetime | None = Field(default=None, description="Applied: the void timestamp written (UTC).")

    @model_validator(mode="after")
    def _one_kind(self) -> RecoveryResult:
        """A dry run carries only the lists; an applied recovery only what it did."""
        listed = (self.void, self.requeue, self.kept)
        applied = (self.recovery_id, self.voided, self.requeued, self.after, self.voided_at)
        if self.dry_run and (any(v is None for v in listed) or any(v is not None for v in applied)):
            raise ValueError("a dry run lists void, requeue and kept, and has no recovery_id, counts, after or "
                             "voided_at")
        if not self.dry_run and (any(v is not None for v in listed) or any(v is None for v in applied)):
            raise ValueError("an applied recovery has recovery_id, voided, requeued, after and voided_at, and no "
                             "dry-run lists")
        if self.dry_run and (self.backup_path is not None or self.backup_sha256 is not None):
            raise ValueError("a dry run writes no backup")
        return self

    @classmethod
    def listing(cls, plan: RecoveryPlan) -> RecoveryResult:
        """The dry run of ``plan``: the trial ids to void, instance ids to requeue and trial ids kept."""
        return cls(dry_run=True, void=[t.trial_id for t in plan.void], requeue=[t.instance_id for t in plan.requeue],
                   kept=[k.trial_id for k in plan.kept])


def summary(session: Session) -> Summary:
    """The recovery summary read through ``session`` (sees its uncommitted writes)."""
    live = session.scalar(select(func.count()).select_from(Trial).where(Trial.voided_at.is_(None)))
    void = session.scalar(select(func.count()).select_from(Trial).where(Trial.voided_at.is_not(None)))
    statuses = session.execute(select(TaskInstance.status, func.count()).group_by(TaskInstance.status))
    return Summary(trials=live or 0, void_trials=void or 0,
                   tasks_by_status={status: n for status, n in statuses if n})


def _select(session: Session, request: RecoveryRequest) -> list[Trial]:
    if request.exception_type is not None:
        statement = select(Trial).where(
            Trial.exception_type == request.exception_type,
            Trial.created_at >= request.since,
            Trial.created_at < request.until,
        )
        return list(session.scalars(statement))
    rows: dict[str, Trial] = {}
    if request.batch_ids:
        known = set(session.scalars(select(Batch.batch_id).where(Batch.batch_id.in_(request.batch_ids))))
        for trial in session.scalars(select(Trial).where(Trial.batch_id.in_(request.batch_ids))):
            rows[trial.trial_id] = trial
            known.add(trial.batch_id or "")
        unknown = [batch_id for batch_id in request.batch_ids if batch_id not in known]
        if unknown:
            raise InputError(f"recover: unknown batch ids {unknown} (no batch row, no trial)")
    if request.trial_ids:
        found = {t.trial_id: t for t in session.scalars(select(Trial).where(Trial.trial_id.in_(request.trial_ids)))}
        unknown = [trial_id for trial_id in request.trial_ids if trial_id not in found]
        if unknown:
            raise InputError(f"recover: unknown trial ids {unknown}")
        rows.update(found)
    return list(rows.values())


def _latest_validation_trial(session: Session, instance_id: str) -> str | None:
    statement = (
        select(Trial.trial_id)
        .where(Trial.instance_id == instance_id, Trial.kind.in_(VALIDATION_KINDS), Trial.voided_at.is_(None))
        .order_by(Trial.created_at.desc(), Trial.trial_id.desc())
        .limit(1)
    )
    return session.scalar(statement)


def _live_validation_trial_ids(session: Session, instance_id: str) -> list[str]:
    statement = select(Trial.trial_id).where(Trial.instance_id == instance_id, Trial.kind.in_(VALIDATION_KINDS),
                                             Trial.voided_at.is_(None)).order_by(Trial.trial_id)
    return list(session.scalars(statement))


def _task_status(session: Session, instance_id: str, cache: dict[str, str | None]) -> str | None:
    if instance_id not in cache:
        task = session.get(TaskInstance, instance_id)
        cache[instance_id] = task.status if task is not None else None
    return cache[instance_id]


def plan_recovery(store: Store, request: RecoveryRequest) -> RecoveryPlan:
    """Plan a recovery without writing anything (the dry run); the rules are the module docstring's.

    Raises:
        InputError: a batch id or trial id given is unknown.
    """
    with Session(store.engine) as session:
        selected = sorted(_select(session, request), key=lambda t: (t.created_at, t.trial_id))
        selected_ids = {t.trial_id for t in selected}
        statuses_now: dict[str, str | None] = {}
        void: list[TrialRecord] = []
        kept: list[KeptTrial] = []
        for trial in selected:
            rejection = (trial.kind in VALIDATION_KINDS
                         and _task_status(session, trial.instance_id, statuses_now) == "rejected")
            if trial.voided_at is not None:
                kept.append(KeptTrial(trial_id=trial.trial_id, instance_id=trial.instance_id,
                                      why=f"already void since {trial.voided_at.isoformat()}"))
            elif trial.reward is None and trial.exception_type is not None:
                void.append(TrialRecord.model_validate(trial))
            elif rejection and request.include_rejections:
                live = _live_validation_trial_ids(session, trial.instance_id)
                unselected = [t for t in live if t not in selected_ids]
                if unselected:
                    kept.append(KeptTrial(trial_id=trial.trial_id, instance_id=trial.instance_id,
                                          why=f"task {trial.instance_id} stays rejected: its live NOP/Oracle trial(s) "
                                              f"{unselected} are not selected (select them too to requeue it)"))
                else:
                    void.append(TrialRecord.model_validate(trial))
            else:
                hint = ("; its task is rejected: include_rejections voids it if an infrastructure fault caused "
                        "the rejection" if rejection else "")
                kept.append(KeptTrial(trial_id=trial.trial_id, instance_id=trial.instance_id,
                                      why=f"has a reward ({trial.reward}): a real outcome{hint}"))
        void_ids = {t.trial_id for t in void}
        requeue: list[TaskRecord] = []
        for instance_id in sorted({t.instance_id for t in void if t.kind in VALIDATION_KINDS}):
            task = session.get(TaskInstance, instance_id)
            if task is None:
                continue
            if task.status == "error" and _latest_validation_trial(session, instance_id) in void_ids:
                requeue.append(TaskRecord.model_validate(task))
            elif (task.status == "rejected" and request.include_rejections
                  and set(_live_validation_trial_ids(session, instance_id)) <= void_ids):
                requeue.append(TaskRecord.model_validate(task))
        before = summary(session)
    statuses = Counter(before.tasks_by_status)
    for task in requeue:
        statuses[task.status] -= 1
        statuses["candidate"] += 1
    expected = Summary(trials=before.trials - len(void), void_trials=before.void_trials + len(void),
                       tasks_by_status={status: n for status, n in statuses.items() if n})
    digest = sha256_json({"request": request.selection(),
                          "void": sorted(void_ids), "requeue": [t.instance_id for t in requeue]})
    return RecoveryPlan(request=request, void=void, requeue=requeue, kept=kept, before=before,
                        expected_after=expected, plan_sha256=digest)


def render_plan(plan: RecoveryPlan) -> str:
    """The dry run as plain text: each trial to void, each task to requeue, each trial kept."""
    lines = [f"recovery plan {plan.plan_sha256[:12]}: void {len(plan.void)} trial(s), "
             f"requeue {len(plan.requeue)} task(s), keep {len(plan.kept)}"]
    lines += [f"  void    {t.trial_id}  {t.instance_id}  {t.kind}  "
              f"{t.exception_type or f'reward {t.reward} (rejection)'}  batch={t.batch_id}" for t in plan.void]
    lines += [f"  requeue {t.instance_id}  (status {t.status}: {t.reason})" for t in plan.requeue]
    lines += [f"  keep    {k.trial_id}  {k.instance_id}  {k.why}" for k in plan.kept]
    return "\n".join(lines)


class CountMismatchError(InputError):
    """The summary after a recovery differs from the plan's expectation (nothing was committed)."""


def apply_recovery(store: Store, plan: RecoveryPlan, backup_dir: Path, run_id: str | None = None,
                   now: datetime | None = None) -> RecoveryResult:
    """Back up, void and requeue exactly what ``plan`` lists, verifying counts.

    The backup ``backup_dir/<recovery_id>.json`` (sha256 in ``<backup>.sha256``) holds every affected row
    as it was. One transaction then voids and requeues, comparing the rebuilt summary with
    ``plan.expected_after``, so a concurrent writer or a stale plan rolls it back. An empty plan writes
    nothing.

    Raises:
        CountMismatchError: the store changed since the plan (nothing committed; the backup stays).
        InputError: a planned row vanished.
    """
    when = (now or datetime.now(UTC)).astimezone(UTC)
    recovery_id = f"recover-{when.strftime('%Y%m%dT%H%M%SZ')}-{plan.plan_sha256[:8]}"
    if plan.empty:
        return RecoveryResult(dry_run=False, recovery_id=recovery_id, voided=0, requeued=0, after=plan.before,
                              voided_at=when)
    backup_dir = Path(backup_dir)
    backup_dir.mkdir(parents=True, exist_ok=True)
    backup = backup_dir / f"{recovery_id}.json"
    document: dict[str, Any] = {
        "schema_version": BACKUP_SCHEMA_VERSION,
        "recovery_id": recovery_id,
        "store_url": store.engine.url.render_as_string(hide_password=True),
        "plan_sha256": plan.plan_sha256,
        "request": plan.request.selection(),
        "summary_before": plan.before.model_dump(mode="json"),
        "summary_expected_after": plan.expected_after.model_dump(mode="json"),
        "trials": [t.model_dump(mode="json") for t in plan.void],
        "tasks": [t.model_dump(mode="json") for t in plan.requeue],
        "kept": [k.model_dump(mode="json") for k in plan.kept],
    }
    atomic_write_bytes(backup, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())
    digest = sha256_file(backup)
    atomic_write_text(backup.with_name(backup.name + ".sha256"), f"{digest}  {backup.name}\n")

    def check(session: Session) -> None:
        after = summary(session)
        if after != plan.expected_after:
            raise CountMismatchError(
                f"recovery {recovery_id}: counts after {after.model_dump()} differ from the expected "
                f"{plan.expected_after.model_dump()} (the store changed since the plan); rolled back"
            )
        changed = {t.instance_id: status for t in plan.requeue
                   if (status := session.get(TaskInstance, t.instance_id).status) != "candidate"}
        if changed:
            raise CountMismatchError(
                f"recovery {recovery_id}: task(s) {changed} changed status since the plan (not requeued); rolled back")

    voided = store.void_trials([t.trial_id for t in plan.void], plan.request.reason,
                               requeue=[t.instance_id for t in plan.requeue], voided_at=when,
                               run_id=run_id, check=check,
                               requeue_only_from={t.instance_id: t.status for t in plan.requeue})
    return RecoveryResult(dry_run=False, recovery_id=recovery_id, voided=voided, requeued=len(plan.requeue),
                          backup_path=backup, backup_sha256=digest, after=plan.expected_after, voided_at=when)


def render_audit(plan: RecoveryPlan, result: RecoveryResult) -> str:
    """The markdown audit of ``plan`` as applied (``result``, not a dry run): request, backup, counts
    before/after, every row touched.

    Raises:
        InputError: ``result`` is a dry run.
    """
    if result.dry_run:
        raise InputError("render_audit: a dry run has no audit (apply the plan first)")
    req = plan.request
    selector = (f"exception_type `{req.exception_type}` in [{req.since.isoformat()}, {req.until.isoformat()})"
                if req.exception_type else f"batch ids {req.batch_ids or '-'}; trial ids {req.trial_ids or '-'}")
    if req.include_rejections:
        selector += " (include_rejections: rejected tasks' rewarded NOP/Oracle trials too)"
    lines = [
        f"# Recovery `{result.recovery_id}`",
        "",
        f"- selection: {selector}",
        f"- reason: {req.reason}",
        f"- voided at: {result.voided_at.isoformat()}",
        f"- backup: `{result.backup_path}` sha256 `{result.backup_sha256}`",
        f"- plan sha256: `{plan.plan_sha256}`",
        "",
        "| count | before | after |",
        "|---|---|---|",
        f"| live trials | {plan.before.trials} | {result.after.trials} |",
        f"| void trials | {plan.before.void_trials} | {result.after.void_trials} |",
    ]
    for status in sorted(set(plan.before.tasks_by_status) | set(result.after.tasks_by_status)):
        lines.append(f"| tasks {status} | {plan.before.tasks_by_status.get(status, 0)} | "
                     f"{result.after.tasks_by_status.get(status, 0)} |")
    lines += ["", f"## Voided trials ({result.voided})", "", "| trial | instance | kind | exception | batch |",
              "|---|---|---|---|---|"]
    lines += [f"| {t.trial_id} | {t.instance_id} | {t.kind} | {t.exception_type or f'none (reward {t.reward})'} "
              f"| {t.batch_id} |" for t in plan.void]
    lines += ["", f"## Requeued tasks ({result.requeued})", "", "| instance | was | reason |", "|---|---|---|"]
    lines += [f"| {t.instance_id} | {t.status} | {t.reason} |" for t in plan.requeue]
    lines += ["", f"## Kept ({len(plan.kept)})", "", "| trial | instance | why |", "|---|---|---|"]
    lines += [f"| {k.trial_id} | {k.instance_id} | {k.why} |" for k in plan.kept]
    return "\n".join(lines) + "\n"
