"""Prefect tasks of training: the burst preflight, SFT bursts, RL bursts (TRL GRPO/RLOO with verifier
rewards) and verl PPO jobs on a Ray cluster (submitted, followed, stopped with the run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.training import adapters, burst, preflight, ray_jobs, rl, samples, verl
from tasks.common import (
    TRANSIENT_RETRIES,
    TRANSIENT_RETRY_DELAYS_S,
    retry_on_transient,
    run_labelled,
)


@task(cache_policy=NO_CACHE)
def burst_preflight(base_model_dir: Path, out_dir: Path, lora_r: int, lora_target_modules: tuple[str, ...],
                    template_files: tuple[Path, ...] = ()) -> preflight.PreflightReport:
    """The burst's preflight before any model is loaded (:func:`forgeflow.training.preflight.burst_preflight`):
    the chat template and ``template_files`` exist and are non-empty, and ``out_dir``'s file system
    has the free space the adapter needs. Never cached (disk space and files change between runs).

    Raises:
        PreflightError: every problem found, in one message (``burst preflight failed: ...``).
    """
    return preflight.burst_preflight(base_model_dir, out_dir, lora_r, lora_target_modules, template_files)


# log_prints off: HF datasets fingerprints functions with dill, which disassembles them with
# dis.dis into a captured stdout; Prefect's print capture would log those ~500 lines instead.
@task(cache_policy=(INPUTS - "run_id") + TASK_SOURCE, log_prints=False)
def sft_burst(base_model_dir: Path, base_sha256: str, samples: list[dict], out_dir: Path,
              config: burst.BurstConfig, parent_adapter_dir: Path | None, run_id: str | None) -> adapters.AdapterRecord:
    """One LoRA SFT burst (TRL SFTTrainer + peft). ``base_sha256`` keys the cache; ``run_id`` (the
    Prefect run recorded in the lineage) does not, so a later run reuses the adapter."""
    data = burst.build_sft_dataset(samples)
    return burst.run_sft_burst(base_model_dir, data, out_dir, config, parent_adapter_dir=parent_adapter_dir,
                               run_id=run_id)


# log_prints off: HF datasets fingerprints functions with dill (see tasks/packaging.py).
@task(cache_policy=(INPUTS - "run_id" - "ray") + TASK_SOURCE, log_prints=False, retries=TRANSIENT_RETRIES,
      retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S, retry_condition_fn=retry_on_transient)
def rl_burst(origin: adapters.BurstOrigin, tasks: list[dict], out_dir: Path, config: rl.RLBurstConfig,
             run_id: str | None, prompt_template: Path = rl.DEFAULT_PROMPT_TEMPLATE,
             ray: RayPlacement | None = None) -> rl.RLBurstRecord:
    """One RL burst (TRL GRPOTrainer/RLOOTrainer + peft, verifier reward) continuing an adapter.

    ``origin``'s digests (``base_model_sha256``, ``parent_adapter_sha256``: the folders' contents)
    key the cache with its folders, the tasks, ``out_dir``, the config and the prompt template;
    ``run_id`` (recorded in the lineage) and ``ray`` (the cluster the rewards are scored on: where,
    not what) do not, so a later run reuses a finished burst, as does
    :func:`forgeflow.training.rl.run_rl_burst` itself from the adapter's ``lineage.json``.

    Args:
        origin: the base model and the parent adapter (or none), each with its digest.
        tasks: :class:`forgeflow.training.rl.RLTask` rows.
        out_dir: the adapter folder to create.
        config: the burst's hyperparameters and verifier settings.
        run_id: the Prefect flow run recorded in the lineage (not in the cache key).
        prompt_template: the prompt template file (problem statement -> prompt).
        ray: score the rollouts on this Ray cluster's sandbox nodes, or None: here (not in the
            cache key nor the lineage's inputs).

    Raises:
        PreflightError: before any model is loaded, listing every problem of
            :func:`forgeflow.training.preflight.burst_preflight` (chat template, ``prompt_template``, disk space).
    """
    base_model_dir = origin.base_model_dir
    preflight.burst_preflight(base_model_dir, out_dir, config.lora_r, config.lora_target_modules, [prompt_template])
    data = rl.build_rl_dataset(tasks, prompt_template)
    backend = config.verifier_backend  # its pods carry this run's id (the sweep), not in the lineage
    record = rl.run_rl_burst(base_model_dir, data, out_dir, config, parent_adapter_dir=origin.parent_adapter_dir,
                             run_id=run_id, verifier_backend=run_labelled(backend) if isinstance(backend, SandboxTarget)
                             else None, ray=ray)
    if not record.weights_changed:
        totals = record.totals()
        get_run_logger().warning(
            "RL burst left adapter %s unchanged: every group's rewards were equal (%d resolved, %d unresolved, "
            "%d exceptions over %d completions), so no advantage and no update; it is its parent, not a new step",
            record.adapter.sha256[:12], totals.resolved, totals.unresolved, totals.exceptions, totals.completions)
    return record


@task(retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S, retry_condition_fn=retry_on_transient,
      cache_policy=NO_CACHE)
def submit_ray_job(spec: verl.RayJobSpec, dashboard_url: str) -> str:
    """Submit a Ray job (:func:`forgeflow.training.ray_jobs.submit`); returns its submission id.

    Not cached: a submission is an action. Ray refuses a reused ``submission_id``, so a retry after
    a lost answer cannot start the job twice.
    """
    env = spec.runtime_env.model_dump(exclude_none=True)
    runtime_env = {k: v for k, v in env.items() if v not in ([], {})}
    submission_id = ray_jobs.submit(dashboard_url, spec.entrypoint, spec.submission_id, runtime_env, spec.metadata,
                                    spec.entrypoint_num_cpus)
    get_run_logger().info("Ray job %s submitted to %s: %s", submission_id, dashboard_url, spec.entrypoint[:200])
    return submission_id


@task(cache_policy=NO_CACHE)
def follow_ray_job(dashboard_url: str, submission_id: str, poll_s: float = 5.0,
                   timeout_s: float | None = None) -> ray_jobs.RayJobOutcome:
    """Follow a Ray job to its end, its log lines into this run's log
    (:func:`forgeflow.training.ray_jobs.follow`); a cancelled or crashed run stops the job.

    Raises:
        RayJobError: the job ended FAILED or STOPPED, or ran past ``timeout_s``.
    """
    logger = get_run_logger()
    outcome = ray_jobs.follow(dashboard_url, submission_id, lambda line: logger.info("[%s] %s", submission_id, line),
                              poll_s=poll_s, timeout_s=timeout_s)
    logger.info("Ray job %s %s after %.1f s (%d log lines)", submission_id, outcome.status, outcome.wall_s,
                outcome.log_lines)
    return outcome


@task(cache_policy=NO_CACHE)
def oracle_samples(tasks: list[tuple[Any, Path, list[str]]]) -> list[dict[str, Any]]:
    """SFT rows from the Oracle solutions of accepted tasks (candidate, its project checkout, its
    FAIL_TO_PASS): :func:`forgeflow.training.samples.oracle_samples`."""
    return samples.oracle_samples(tasks)


@task(cache_policy=NO_CACHE)
def pin_adapter(record: adapters.AdapterRecord, adapters_dir: Path) -> adapters.AdapterRecord:
    """Copy an adapter into its content-addressed folder ``<adapters_dir>/<sha256>`` (kept if already
    there and intact): :func:`forgeflow.training.adapters.pin_adapter`. The pinned record."""
    return adapters.pin_adapter(record, adapters_dir)
