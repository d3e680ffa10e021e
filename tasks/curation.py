"""Prefect tasks of curation: candidate generation, NOP/Oracle validation, freeze."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from forgeflow import bugs, freeze, trial
from forgeflow.errors import PreflightError
from forgeflow.sandbox import SandboxSpec
from tasks.common import RESUMABLE


@task(cache_policy=RESUMABLE, task_run_name="candidates-{repo}")
def generate_candidates(repo: str, checkout_dir: Path, source_dir: str, max_candidates: int, seed: int) -> list[bugs.Candidate]:
    """SWE-smith procedural candidates for one project, statically checked (patch applies)."""
    return bugs.generate_candidates(repo, checkout_dir, source_dir, max_candidates, seed)


@task(cache_policy=RESUMABLE, task_run_name="validate-{candidate.instance_id}")
def validate_candidate(candidate: bugs.Candidate, image_ref: str, image_digest: str, test_command: str,
                       timeout_s: float, memory_mb: int) -> trial.ValidationOutcome:
    """NOP then Oracle run of one candidate in no-network containers of its task image.

    Infrastructure failures come back as trials with an exception type (never a rejection), so
    one broken trial never sinks the batch. ``image_digest`` keys the cache.
    """
    return trial.validate_candidate(candidate, image_ref, test_command, timeout_s=timeout_s,
                                    spec=SandboxSpec(memory_mb=memory_mb))


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
