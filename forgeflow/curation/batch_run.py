"""One curate batch's validations, run as they finish: a pool of threads, no per-candidate orchestration.

Each verdict goes to ``on_verdict`` the moment it is known (the caller records it, so a resumed run
validates only what has no verdict). Per-candidate overhead is the same at 1,000 candidates as at
30,000 (``python -m benchmarks.scale_curate``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import is_transient
from forgeflow.ledger.records import TaskRecord
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.trial import ValidationOutcome, ValidationSettings

TRANSIENT_RETRY_DELAYS_S = (2.0, 8.0)
"""Seconds slept before each new try of a validation that raised a transient
:class:`~forgeflow.common.errors.InfraError` (a registry or API hiccup); a third one raises."""

RUN_KEY_PREFIX = "curate-a"
"""A validation's run key is this prefix + its attempt number: it goes into the trial ids, so a task requeued
by ``recover`` (its earlier NOP attempts voided) gets new trial ids, while a killed run's half-done validation
runs again under the same ids (upserted, never duplicated)."""

Validate = Callable[[str, str], ValidationOutcome]
"""``validate(instance_id, run_key) -> outcome``: one NOP/Oracle validation (trials stored by the callee as
they end); raises only for what is not an outcome (bad input, a transient infrastructure failure)."""


class BatchJob(BaseModel):
    """One batch of a ``curate`` run: what :func:`run_batch` validates, and what each validation needs (the
    Prefect task ``tasks.curation.validate_batch`` validates it)."""

    model_config = ConfigDict(frozen=True)

    batch_id: str = Field(description="the batch's id (its trials' batch_id and its batch row)")
    run_id: str = Field(description="the curate flow run (its trials' and verdicts' run_id and its sandboxes' label)")
    ids: list[str] = Field(description="instance ids: started, and their verdicts returned, in this order")
    rows: dict[str, Any] = Field(repr=False, exclude=True, description="instance id -> its candidate row "
                                 "(CandidateTask or GeneratedTask; not sent to the API with a task's parameters)")
    concurrency: int = Field(ge=1, description="validations in flight at once")
    max_retries: int = Field(ge=0, description="extra attempts for a validation that ended in an infrastructure error")
    first_attempt: dict[str, int] = Field(default_factory=dict,
        description="instance id -> its first attempt number (absent: 0)")
    store_url: str = Field(description="the store's SQLAlchemy URL")
    test_commands: dict[str, str] = Field(default_factory=dict, exclude=True,
                                          description="instance id -> its test command")
    log_parsers: dict[str, str] = Field(default_factory=dict, exclude=True,
                                        description="instance id -> its repository's log parser (absent: the run's)")
    validation: ValidationSettings = Field(default_factory=ValidationSettings,
                                           description="each validation's limits and checks")
    sandbox: SandboxTarget = Field(default_factory=SandboxTarget, description="the forgeflow-sandbox block's "
                                   "backend kind and cluster (default: podman)")
    ray: RayPlacement | None = Field(None, description="the Ray placement, or None (in this process)")

    def spec(self) -> SandboxSpec:
        """Each trial container's :class:`SandboxSpec`: ``validation``'s limits, which
        :meth:`~forgeflow.curation.curate_settings.CurateSettings.validation` resolved against the block."""
        return SandboxSpec.of(self.validation)


def pristine_duration_s(outcome: ValidationOutcome) -> float | None:
    """The longest Oracle test run of a validation (the first and its repeats), seconds; None when none
    completed. An upper bound: the safe side for attributing a later timeout to a submission.
    """
    runs = [t.verifier_s for t in ([outcome.oracle] if outcome.oracle else []) + outcome.oracle_repeats
            if t.verifier_s is not None]
    return max(runs) if runs else None


def task_verdict(row: Any, run_id: str, outcome: ValidationOutcome | None, error: str | None = None) -> TaskRecord:
    """The task row a validation decides: ``accepted`` / ``rejected`` with the report's test lists, or
    ``error`` (``error`` given, or an outcome without a report) with the reason.
    """
    common = {"instance_id": row.instance_id, "repo": row.repo, "patch": row.patch, "image_ref": row.image_ref,
              "run_id": run_id}
    report = outcome.report if outcome is not None else None
    if report is None:
        if error is None and outcome is not None:
            failed = outcome.failed_trial or outcome.nop
            error = f"{failed.exception_type}: {failed.exception_message}"
        return TaskRecord(**common, status="error", reason=(error or "no outcome")[:2000])
    return TaskRecord(**common, status="accepted" if report.accepted else "rejected", reason=report.reason,
                      FAIL_TO_PASS=report.FAIL_TO_PASS, PASS_TO_PASS=report.PASS_TO_PASS,
                      known_tests=report.known_tests, pristine_duration_s=pristine_duration_s(outcome))


def _try(validate: Validate, instance_id: str, run_key: str) -> ValidationOutcome:
    """``validate`` once more after each transient failure (:data:`TRANSIENT_RETRY_DELAYS_S`)."""
    for delay in (*TRANSIENT_RETRY_DELAYS_S, None):
        try:
            return validate(instance_id, run_key)
        except Exception as exc:
            if delay is None or not is_transient(exc):
                raise
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def run_batch(job: BatchJob, validate: Validate, on_verdict: Callable[[TaskRecord, ValidationOutcome | None], None],
              on_finished: Callable[[int], None] | None = None) -> list[TaskRecord]:
    """Validate ``job.ids``, ``job.concurrency`` at a time, handling each as it ends; verdicts in ``job.ids``' order.

    An outcome without a report (an infrastructure error) is retried as a new attempt while attempts
    remain; then, or when ``validate`` raised, the verdict is ``error``: one validation never sinks the batch.

    Args:
        on_verdict: called in this thread with each verdict and its outcome (None when it raised).
        on_finished: called in this thread with the number of candidates finished so far.
    """
    verdicts: dict[str, TaskRecord] = {}
    with ThreadPoolExecutor(max_workers=job.concurrency, thread_name_prefix=f"validate-{job.batch_id[-8:]}") as pool:
        running: dict[Future, tuple[str, int]] = {}

        def start(instance_id: str, attempt: int) -> None:
            run_key = f"{RUN_KEY_PREFIX}{job.first_attempt.get(instance_id, 0) + attempt}"
            running[pool.submit(_try, validate, instance_id, run_key)] = (instance_id, attempt)

        for instance_id in job.ids:
            start(instance_id, 0)
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                instance_id, attempt = running.pop(future)
                row = job.rows[instance_id]
                try:
                    outcome = future.result()
                except Exception as exc:  # noqa: BLE001 - this validation's failure must not sink the batch
                    outcome, verdict = None, task_verdict(row, job.run_id, None,
                                                          f"validation raised {type(exc).__name__}: {exc}")
                else:
                    if outcome.report is None and attempt < job.max_retries:
                        start(instance_id, attempt + 1)
                        continue
                    verdict = task_verdict(row, job.run_id, outcome)
                verdicts[instance_id] = verdict
                on_verdict(verdict, outcome)
                if on_finished is not None:
                    on_finished(len(verdicts))
    return [verdicts[instance_id] for instance_id in job.ids]
