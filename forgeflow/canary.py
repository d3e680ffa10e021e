"""The canary's functional core: concurrency profiles, the tasks of a frozen split, the job report.

A canary runs the agent (mini-swe-agent against a served model) on every task of one split of a
frozen dataset and records one *job* (``jobs`` row, kind ``canary``) with its trials. The
lifecycle runs it twice (baseline and candidate); the standalone ``canary`` flow
(``flows/canary.py``) runs it on any recorded freeze against any endpoint. This module holds what
both need that is not Prefect: the concurrency guard, the assembly of :class:`CanaryTask` rows
from the store + the generated-candidates file, and the markdown job report.

Concurrency guard (issue 5): a canary refuses more than :data:`CANARY_PROFILES` allows for its
profile: ``default`` 4 trials at once, ``verified`` 10. The limits bound how many sandboxes and
concurrent model requests one canary puts on a shared endpoint; they are this project's policy
numbers (issue 5), not measured capacities.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow import compare, images
from forgeflow import store as ledger
from forgeflow.agent import problem_statement_for
from forgeflow.errors import InputError, PreflightError
from forgeflow.freeze import FreezeManifest, verify_freeze

CANARY_PROFILES: dict[str, int] = {"default": 4, "verified": 10}
"""Profile name -> the most agent trials a canary may run at once."""

JOB_KIND = "canary"


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
        profile: A key of :data:`CANARY_PROFILES`.

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


class CanaryTask(BaseModel):
    """Everything one agent trial of a canary needs about its task.

    Attributes:
        instance_id: The task.
        repo: Its repository (project name).
        image_ref: The task image the sandbox starts (local name or ``host:port/repo:tag``).
        image_digest: The image's digest (``sha256:<hex>``); part of the trial's cache key.
        problem_statement: The text the agent gets (:func:`forgeflow.agent.problem_statement_for`).
        test_command: The verifier's test command (``pytest -rA`` output).
        fail_to_pass: Tests the fix must make pass (>= 1).
        pass_to_pass: Tests that must keep passing.
    """

    model_config = ConfigDict(frozen=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    image_ref: str = Field(min_length=1)
    image_digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    problem_statement: str = Field(min_length=1)
    test_command: str = Field(min_length=1)
    fail_to_pass: list[str] = Field(min_length=1)
    pass_to_pass: list[str] = Field(default_factory=list)


def frozen_split(store: ledger.Store, freeze_name: str, split: str) -> tuple[FreezeManifest, list[str]]:
    """The verified manifest of ``freeze_name`` (as the store records it) and the ids of ``split``.

    Raises:
        InputError: the store records no such freeze, the manifest fails verification (digest
            differs from the store's), ``split`` is not one of its splits (they are listed), or
            the split is empty.
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


def canary_tasks(store: ledger.Store, instance_ids: Sequence[str], generated: Iterable[Any],
                 check_images: bool = True) -> list[CanaryTask]:
    """The :class:`CanaryTask` of each instance, from the store's validated task rows and the
    generated-candidates rows (:class:`forgeflow.generated.GeneratedTask`: patch, task image, test
    command).

    The sandbox image is the row's local task image (``image``: present once the lifecycle's
    registries stopped); its digest is the registry digest the lifecycle pushed it under when known
    (the same content, so the lifecycle's cached scored trials are reused), else ``sha256:<image id>``.

    Args:
        store: The ledger holding the tasks' validation (FAIL_TO_PASS / PASS_TO_PASS).
        instance_ids: The split's ids, in order.
        generated: The candidate rows.
        check_images: Check with podman that every task image exists (one ``image exists`` each).

    Returns:
        One task per id, in order.

    Raises:
        PreflightError: ids without a generated row, not accepted in the store (status given), or
            whose image is missing: every problem listed, before any trial runs.
    """
    rows = {row.instance_id: row for row in generated}
    problems: list[str] = []
    out: list[CanaryTask] = []
    for instance_id in instance_ids:
        row, task = rows.get(instance_id), store.get_task(instance_id)
        if row is None:
            problems.append(f"{instance_id}: no row in the generated-candidates file")
            continue
        if task is None or task.status != "accepted" or not task.fail_to_pass:
            status = "not in the store" if task is None else f"status {task.status!r}"
            problems.append(f"{instance_id}: not an accepted task with FAIL_TO_PASS ({status})")
            continue
        digest = row.registry_digest or (f"sha256:{row.image_id}" if row.image_id else None)
        if digest is None:
            problems.append(f"{instance_id}: no image digest (registry_digest or image_id) in its row")
            continue
        if check_images and not images.image_exists(row.image):
            problems.append(f"{instance_id}: task image {row.image} does not exist (podman image exists)")
            continue
        out.append(CanaryTask(instance_id=instance_id, repo=row.repo, image_ref=row.image, image_digest=digest,
                              problem_statement=problem_statement_for(row.patch, task.fail_to_pass),
                              test_command=row.test_command, fail_to_pass=task.fail_to_pass,
                              pass_to_pass=task.pass_to_pass))
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PreflightError(f"canary: {len(problems)} of {len(instance_ids)} task(s) cannot run:\n  "
                             + "\n  ".join(shown) + more)
    return out


def trial_row(tr: Any, job_id: str | None, model_sha256: str | None, run_id: str | None,
              batch_id: str | None = None) -> ledger.TrialRecord:
    """The store row of a trial (:class:`forgeflow.trial.TrialRecord`: agent, nop or oracle), timings
    flattened to seconds per phase (``env_setup_s``, ``verifier_s``, ``agent_s``); costs where the
    trial has them. Used by the canary, the lifecycle and curate."""
    timings = {k: v for k, v in {"env_setup_s": tr.env_setup_s, "verifier_s": tr.verifier_s,
                                 "agent_s": tr.agent_s}.items() if v is not None}
    return ledger.TrialRecord(trial_id=tr.trial_id, instance_id=tr.instance_id, kind=tr.kind, job_id=job_id,
                              batch_id=batch_id,
                              reward=tr.reward, exception_type=tr.exception_type,
                              exception_message=tr.exception_message, timings=timings,
                              model_sha256=model_sha256, created_at=tr.started_at, run_id=run_id,
                              agent_steps=tr.agent_steps, input_tokens=tr.input_tokens,
                              output_tokens=tr.output_tokens)


def render_job_report(job: ledger.JobRecord, report: compare.JobReport, trials: Sequence[Any],
                      extra: Mapping[str, Any] | None = None) -> str:
    """The markdown job report: the job's identity, the accounting issue 5 asks a report to always
    show (requested, scored, exceptions by type, reward 1 / reward 0, pass rate over scored trials
    and over all attempts, Wilson 95% interval) and one row per trial.

    Args:
        job: The recorded job.
        report: :meth:`forgeflow.compare.JobReport.from_trials` of ``trials``.
        trials: Objects with ``instance_id``, ``reward``, ``exception_type``, ``agent_s``,
            ``verifier_s``.
        extra: More ``key: value`` lines for the header (endpoint, profile...).
    """
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
              "| instance_id | reward | exception | agent s | verifier s |", "|---|---|---|---|---|"]
    for tr in trials:
        lines.append(f"| {tr.instance_id} | {'' if tr.reward is None else tr.reward} | {tr.exception_type or ''} "
                     f"| {'' if tr.agent_s is None else f'{tr.agent_s:.1f}'} "
                     f"| {'' if tr.verifier_s is None else f'{tr.verifier_s:.1f}'} |")
    return "\n".join(lines) + "\n"
