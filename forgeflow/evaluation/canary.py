"""The canary's functional core: concurrency profiles, the tasks of a frozen split, the job report.

:data:`CANARY_PROFILES` (``default`` 4 trials at once, ``verified`` 10) are this project's policy numbers,
not measured capacities."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.task import DIGEST_PATTERN
from forgeflow.curation.freeze import FreezeManifest, stable_key, verify_freeze
from forgeflow.evaluation import chat_images, compare
from forgeflow.evaluation.agent import problem_statement_for
from forgeflow.evaluation.canary_result import MergedView
from forgeflow.ledger import records
from forgeflow.ledger import store as ledger
from forgeflow.registry import images
from forgeflow.registry.skopeo import Skopeo
from forgeflow.sandbox.verifier import TaskTests

CANARY_PROFILES: dict[str, int] = {"default": 4, "verified": 10}
"""Profile name -> the most agent trials a canary may run at once."""

JOB_KIND = "canary"
RECOVERY_JOB_KIND = "recovery"
"""``jobs.kind`` of a job that re-runs another job's exception trials (its ``parent_job_id``)."""


def concurrency_limit(profile: str) -> int:
    """The most trials at once that ``profile`` allows (:data:`CANARY_PROFILES`).

    Raises:
        InputError: ``profile`` is not a known profile (the valid ones are listed).
    """
    if profile not in CANARY_PROFILES:
        raise InputError(f"canary profile {profile!r} is unknown; valid profiles: "
                         + ", ".join(f"{p} (up to {n})" for p, n in CANARY_PROFILES.items()))
    return CANARY_PROFILES[profile]


def check_concurrency(concurrency: int, profile: str = "default") -> int:
    """Return ``concurrency`` if ``profile`` allows it.

    Args:
        concurrency: Agent trials to run at once (>= 1).

    Raises:
        InputError: ``concurrency`` < 1, above the profile's limit (the message names the value,
            the limit and the profile that would allow it), or an unknown profile.
    """
    limit = concurrency_limit(profile)
    if concurrency < 1:
        raise InputError(f"canary concurrency must be >= 1, got {concurrency}")
    if concurrency > limit:
        wider = [p for p, n in CANARY_PROFILES.items() if n >= concurrency]
        hint = (f"; profile {wider[0]!r} allows up to {CANARY_PROFILES[wider[0]]}" if wider
                else f"; no profile allows more than {max(CANARY_PROFILES.values())}")
        raise InputError(f"canary concurrency {concurrency} is above the limit {limit} of profile "
                         f"{profile!r}{hint}")
    return concurrency


class CanaryTask(TaskTests):
    """Everything one agent trial of a canary needs about its task: a validated
    :class:`~forgeflow.sandbox.verifier.TaskTests` with its problem statement, repository, image digest and images."""

    problem_statement: str = Field(min_length=1, description="The issue text given to the agent.")
    repo: str = Field(min_length=1, description="Its repository (project name).")
    image_digest: str = Field(pattern=DIGEST_PATTERN, description="The image's digest (sha256:<hex>); part of "
                              "the trial's cache key.")
    FAIL_TO_PASS: list[str] = Field(min_length=1, validation_alias=AliasChoices("FAIL_TO_PASS", "fail_to_pass"),
                                    description="Tests the fix must make pass (>= 1: a canary task is a validated "
                                                "task).")
    images: list[str] = Field(default_factory=list, exclude_if=lambda v: not v,
                              description="The task row's images: file paths or data: URIs.")

    def image_refs(self, store_dir: Path) -> list[chat_images.ImageRef]:
        """The task's images by digest (:func:`forgeflow.evaluation.chat_images.image_ref`; a data URI's
        bytes written once under ``store_dir``), for :func:`forgeflow.evaluation.chat_images.with_images`.

        Raises:
            InputError: an image is missing or not a PNG, JPEG, GIF or WebP image.
        """
        return [chat_images.image_ref(source, store_dir) for source in self.images]

    @classmethod
    def from_row(cls, row: Any, image_ref: str, image_digest: str, test_command: str, FAIL_TO_PASS: list[str],
                 PASS_TO_PASS: list[str], log_parser: str | None = None, known_tests: list[str] | None = None,
                 pristine_duration_s: float | None = None) -> CanaryTask:
        """The task of a task row (``instance_id``, ``repo``, ``patch``, optionally ``problem_statement`` and
        ``images``), with its known tests and pristine duration (seconds) where validation recorded them.

        Raises:
            pydantic.ValidationError: a field out of its bounds (e.g. no FAIL_TO_PASS test, a bad digest).
        """
        statement = getattr(row, "problem_statement", None) or problem_statement_for(row.patch, FAIL_TO_PASS)
        return cls(instance_id=row.instance_id, repo=row.repo, image_ref=image_ref, image_digest=image_digest,
                   problem_statement=statement, test_command=test_command, FAIL_TO_PASS=FAIL_TO_PASS,
                   PASS_TO_PASS=PASS_TO_PASS, log_parser=log_parser, known_tests=known_tests or None,
                   pristine_duration_s=pristine_duration_s, images=list(getattr(row, "images", None) or []))


def frozen_split(store: ledger.Store, freeze_name: str, split: str) -> tuple[FreezeManifest, list[str]]:
    """The verified manifest of ``freeze_name`` (as the store records it) and the ids of ``split``.

    Raises:
        InputError: no such freeze, a manifest that fails verification, an unknown split (listed), or an
            empty split.
    """
    record = store.get_freeze(freeze_name)
    if record is None:
        raise InputError(f"freeze {freeze_name!r} is not recorded in the store ({store.url}): run the freeze "
                         "flow (or the lifecycle) first")
    manifest = verify_freeze(record.manifest_path, record.file_sha256)
    if split not in manifest.splits:
        raise InputError(f"freeze {freeze_name!r} has no split {split!r}; its splits: {sorted(manifest.splits)}")
    ids = manifest.splits[split]
    if not ids:
        raise InputError(f"split {split!r} of freeze {freeze_name!r} is empty")
    return manifest, list(ids)


def sample_split(instance_ids: Sequence[str], sample: int | None, seed: int = 0) -> list[str]:
    """A seeded subset of a split's ids (the hand-run pipeline drew 30 validation tasks with a fixed seed).

    Args:
        sample: how many to keep; None (or at least the split's size) keeps them all.

    Raises:
        InputError: ``sample`` < 1, or a repeated id.
    """
    ids = list(instance_ids)
    if len(set(ids)) != len(ids):
        raise InputError("sample_split: the split repeats an instance id")
    if sample is None or sample >= len(ids):
        return ids
    if sample < 1:
        raise InputError(f"sample must be >= 1 (or None for the whole split), got {sample}")
    kept = set(sorted(ids, key=lambda instance_id: stable_key(seed, instance_id))[:sample])
    return [instance_id for instance_id in ids if instance_id in kept]


def canary_tasks(store: ledger.Store, instance_ids: Sequence[str], rows: Iterable[Any],
                 check_images: bool = True, test_commands: Mapping[str, str] | None = None,
                 log_parsers: Mapping[str, str | None] | None = None, stage: str = "canary") -> list[CanaryTask]:
    """The :class:`CanaryTask` of each instance, from the store's validated task rows and the task rows.

    Raises:
        PreflightError: ids without a row, not accepted (status given), without a test command, or whose
            image is missing: every problem listed, before any trial runs.
        RegistryUnavailableError: a task image's registry does not answer.
    """
    by_id = {row.instance_id: row for row in rows}
    problems: list[str] = []
    out: list[CanaryTask] = []
    found_rows = {i: accepted_row(store, i, by_id, test_commands or {}, "candidates file") for i in instance_ids}
    present = set(images.available([f.image for f in found_rows.values() if not isinstance(f, str)])) \
        if check_images else set()
    for instance_id in instance_ids:
        found = found_rows[instance_id]
        if isinstance(found, str):
            problems.append(found)
            continue
        row, task, image, command = found
        if check_images and image not in present:
            where = "in its registry (skopeo list-tags)" if images.registry_repo(image) else "(podman image exists)"
            problems.append(f"{instance_id}: task image {image} does not exist {where}")
            continue
        digest = getattr(row, "registry_digest", None) or (
            f"sha256:{row.image_id}" if getattr(row, "image_id", None) else None)
        if digest is None and check_images:
            digest = (Skopeo().inspect_digest(f"docker://{image}") if images.registry_repo(image)
                      else f"sha256:{images.image_id(image)}")
        if digest is None:
            problems.append(f"{instance_id}: no image digest (registry_digest or image_id) in its row")
            continue
        out.append(CanaryTask.from_row(row, image, digest, command, task.FAIL_TO_PASS, task.PASS_TO_PASS,
                                       (log_parsers or {}).get(instance_id), task.known_tests,
                                       task.pristine_duration_s))
    refuse_problems(problems, f"{stage}: {len(problems)} of {len(instance_ids)} task(s) cannot run")
    return out


class AcceptedRow(NamedTuple):
    """A task row with its accepted store record, task image and test command (:func:`accepted_row`)."""

    row: Any
    task: records.TaskRecord
    image: str
    test_command: str


def accepted_row(store: ledger.Store, instance_id: str, by_id: Mapping[str, Any], test_commands: Mapping[str, str],
                 source: str) -> AcceptedRow | str:
    """``instance_id``'s row of the task rows ``by_id`` with its accepted, validated store record, its task
    image (the row's ``image``, else the store's ``image_ref``) and its test command (``test_commands``
    first, else the row's), or the problem in words (``"<id>: ..."``): no row in ``source``, not an
    accepted task with FAIL_TO_PASS (its status said), no image, no test command."""
    row, task = by_id.get(instance_id), store.get_task(instance_id)
    if row is None:
        return f"{instance_id}: no row in the task rows ({source})"
    if task is None or task.status != "accepted" or not task.FAIL_TO_PASS:
        status = "not in the store" if task is None else f"status {task.status!r}"
        return f"{instance_id}: not an accepted task with FAIL_TO_PASS ({status})"
    image = row.image_ref or task.image_ref
    command = test_commands.get(instance_id) or getattr(row, "test_command", None)
    if not image or not command:
        return f"{instance_id}: no {'task image' if not image else 'test command'} in its row"
    return AcceptedRow(row, task, image, command)


def refuse_problems(problems: Sequence[str], headline: str, shown: int = 20) -> None:
    """Raise one PreflightError listing every problem (the first ``shown``, then a count) under ``headline``."""
    if problems:
        more = f"\n  ... and {len(problems) - shown} more" if len(problems) > shown else ""
        raise PreflightError(f"{headline}:\n  " + "\n  ".join(problems[:shown]) + more)


def render_job_report(job: records.JobRecord, report: compare.JobReport, trials: Sequence[Any],
                      extra: Mapping[str, Any] | None = None) -> str:
    """The markdown job report: identity, the accounting (requested, scored, exceptions by type, pass rates
    over scored trials and all attempts, Wilson 95% interval) and one row per trial."""
    w = report.wilson
    lines = [f"# Canary job `{job.job_id}`", "",
             f"- freeze: `{job.freeze_name}`, split `{job.split}`",
             f"- model sha256: `{job.model_sha256}`"]
    lines += [f"- {k}: {v}" for k, v in (extra or {}).items()]
    exceptions = ", ".join(f"{k} {n}" for k, n in sorted(report.exceptions_by_type.items())) or "none"
    lines += ["", "| requested | scored | exceptions | reward 1 | reward 0 | pass rate (scored) "
              "| pass rate (attempts) | Wilson 95% |",
              "|---|---|---|---|---|---|---|---|",
              f"| {report.requested} | {report.scored} | {report.exceptions} | {report.reward_1} | {report.reward_0} "
              f"| {report.pass_rate_scored:.1%} | {report.pass_rate_attempts:.1%} | [{w.low:.1%}, {w.high:.1%}] |",
              "", f"Exceptions by type: {exceptions}.", "",
              *compare.exclusion_lines(compare.job_exclusions(report, job.job_id)), "",
              "| instance_id | reward | exception | agent s | verifier s |", "|---|---|---|---|---|"]
    for tr in trials:
        lines.append(f"| {tr.instance_id} | {'' if tr.reward is None else tr.reward} | {tr.exception_type or ''} "
                     f"| {'' if tr.agent_s is None else f'{tr.agent_s:.1f}'} "
                     f"| {'' if tr.verifier_s is None else f'{tr.verifier_s:.1f}'} |")
    return "\n".join(lines) + "\n"


class CanaryRecoveryPlan(BaseModel):
    """What a canary recovery re-runs (the dry answer of :func:`plan_canary_recovery`)."""

    model_config = ConfigDict(frozen=True)

    original: records.JobRecord = Field(
        description="The original canary job's row (its freeze, split, model and parameters).")
    recovery_job_id: str = Field(min_length=1, max_length=512,
                                 description="The id the recovery job gets (recovery_job_id unless given).")
    exception_trials: list[records.TrialRecord] = Field(
        description="The trials standing in the merged view that ended in an exception (one per instance, by "
                    "instance id) and match the requested exception types: exactly what is re-run.")
    merged: MergedView = Field(description="The merged view now: its label (job X or original job X + N recovery "
                               "jobs), the recovery jobs the original already has (oldest first), its report.")

    @property
    def instance_ids(self) -> list[str]:
        """The instances to re-run, in instance-id order."""
        return [t.instance_id for t in self.exception_trials]

    @property
    def empty(self) -> bool:
        """True when no trial of the merged view ended in a (selected) exception."""
        return not self.exception_trials


def recovery_job_id(job_id: str, trial_ids: Sequence[str]) -> str:
    """``<job_id>-recovery-<12 hex>``: the digest of the exception trial ids it re-runs, so the same
    recovery started again (e.g. before any of its trials was recorded) gets the same id and upserts
    the same rows, and a later recovery of what is left gets another."""
    from forgeflow.common.fsutil import sha256_json

    return f"{job_id}-recovery-{sha256_json(sorted(trial_ids))[:12]}"


def plan_canary_recovery(store: ledger.Store, job_id: str, exception_types: Sequence[str] | None = None,
                         job_id_override: str | None = None) -> CanaryRecoveryPlan:
    """Which tasks of canary job ``job_id`` a recovery re-runs: those whose standing trial ended in one of
    ``exception_types`` (None: any exception). Reads only.

    Raises:
        InputError: no job ``job_id`` (the canary jobs listed), a recovery job or not a canary job, no model
            or no agent trials recorded, or an override naming the original or another parent's job.
    """
    original = store.get_job(job_id)
    if original is None:
        known = [j.job_id for j in store.jobs(kind=JOB_KIND)]
        raise InputError(f"canary recovery: job {job_id!r} is not recorded in the store ({store.display_url}); "
                         f"its canary jobs: {', '.join(known[:20]) or 'none'}")
    if original.kind == RECOVERY_JOB_KIND:
        raise InputError(f"canary recovery: job {job_id!r} is itself a recovery job of {original.parent_job_id!r}: "
                         f"give the original job ({original.parent_job_id!r}); its merged view includes this one")
    if original.kind != JOB_KIND:
        raise InputError(f"canary recovery: job {job_id!r} is a {original.kind!r} job; only canary jobs are re-run")
    if original.model_sha256 is None:
        raise InputError(f"canary recovery: job {job_id!r} records no model_sha256: the model to re-run is unknown")
    view = compare.merged_job(store, job_id)
    wanted = set(exception_types) if exception_types else None
    failed = [t for t in view.trials if t.exception_type is not None
              and (wanted is None or t.exception_type in wanted)]
    new_id = job_id_override or recovery_job_id(job_id, [t.trial_id for t in failed])
    if new_id == job_id:
        raise InputError(f"canary recovery: the recovery job id {new_id!r} is the original's")
    existing = store.get_job(new_id)
    if existing is not None and existing.parent_job_id != job_id:
        raise InputError(f"canary recovery: job id {new_id!r} is taken by a {existing.kind!r} job "
                         f"(parent {existing.parent_job_id!r}); give another recovery job id")
    return CanaryRecoveryPlan(original=original, recovery_job_id=new_id, exception_trials=failed,
                              merged=MergedView.of(view))
