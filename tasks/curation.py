"""Prefect tasks of curation: candidate generation, NOP/Oracle validation (the one task the
lifecycle's validate stage and the ``curate`` flow share), freeze."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from forgeflow import bugs, freeze, trial
from forgeflow.errors import PreflightError
from forgeflow.sandbox import SandboxSpec
from tasks.common import RESUMABLE, TRANSIENT_RETRY_DELAYS_S, retry_on_transient


@task(cache_policy=RESUMABLE, task_run_name="candidates-{repo}")
def generate_candidates(repo: str, checkout_dir: Path, source_dir: str, max_candidates: int, seed: int) -> list[bugs.Candidate]:
    """SWE-smith procedural candidates for one project, statically checked (patch applies)."""
    return bugs.generate_candidates(repo, checkout_dir, source_dir, max_candidates, seed)


@task(cache_policy=RESUMABLE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, task_run_name="validate-{candidate.instance_id}-{run_key}")
def validate_candidate(candidate: trial.BugTask, image_ref: str, image_digest: str | None, test_command: str,
                       timeout_s: float, memory_mb: int, run_key: str = "validate") -> trial.ValidationOutcome:
    """NOP then Oracle run of one candidate in no-network containers of its task image
    (:func:`forgeflow.trial.validate_candidate`); the one validation task of the lifecycle's
    validate stage and of the ``curate`` flow.

    Args:
        candidate: A :class:`forgeflow.bugs.Candidate`, :class:`forgeflow.candidates.CandidateTask`
            or :class:`forgeflow.generated.GeneratedTask` (its ``instance_id`` and bug ``patch``).
        image_ref: The task image (local name or ``host:port/repo:tag``).
        image_digest: The image's digest or id when known (keys the cache: a rebuilt image under
            the same name is validated afresh); None when ``image_ref`` is the identity.
        test_command: Shell command printing ``pytest -rA`` output, run in ``/testbed``.
        timeout_s: Absolute limit per test run, seconds.
        memory_mb: Sandbox memory limit, MiB.
        run_key: Goes into the trial ids and the cache key. The lifecycle keeps the default; the
            ``curate`` flow passes ``curate-a<N>`` (N = the instance's earlier NOP trials, void ones
            included), so a task requeued by ``recover`` is validated afresh with new trial ids
            (the voided rows stay for audit), while a killed-and-resumed batch reuses the same key:
            Prefect's cache answers and the store upserts the same trial ids (nothing duplicated).

    Returns:
        The outcome. Infrastructure failures come back as trials with an exception type (never
        a rejection), so one broken trial never sinks the batch.

    Raises:
        InputError: bad input (fails only this task run, never retried). A transient
            :class:`~forgeflow.errors.InfraError` escaping the trial runner is retried by Prefect
            (twice by default; callers override with ``with_options(retries=...)``).
    """
    return trial.validate_candidate(candidate, image_ref, test_command, timeout_s=timeout_s,
                                    spec=SandboxSpec(memory_mb=memory_mb), run_key=run_key)


@task(cache_policy=RESUMABLE)
def freeze_dataset(name: str, accepted: list[freeze.AcceptedTask], quotas: freeze.SplitQuotas, seed: int,
                   out_dir: Path, extra_inputs: dict) -> freeze.FreezeManifest:
    """Select the splits and write the freeze manifest (refused if the name exists with other
    content; a no-op if identical)."""
    selection = freeze.select_splits(accepted, quotas, seed)
    if not selection.ready:
        unmet = "; ".join(f"{u.name}: need {u.required}, found {u.found}" for u in selection.unmet)
        raise PreflightError(f"freeze {name!r} is not ready: {unmet}")
    return freeze.write_freeze(name, selection, quotas, seed, out_dir, extra_inputs)
