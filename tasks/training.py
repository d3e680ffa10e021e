"""Prefect tasks of training: the burst preflight, SFT bursts, RL bursts (TRL GRPO/RLOO with verifier
rewards) and submitting verl PPO jobs to a Ray cluster."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from forgeflow.training import adapters, burst, preflight, rl, verl
from tasks.common import (
    TRANSIENT_RETRIES,
    TRANSIENT_RETRY_DELAYS_S,
    retry_on_transient,
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
@task(cache_policy=(INPUTS - "run_id") + TASK_SOURCE, log_prints=False, retries=TRANSIENT_RETRIES,
      retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S, retry_condition_fn=retry_on_transient)
def rl_burst(base_model_dir: Path, base_sha256: str, tasks: list[dict], out_dir: Path, config: rl.RLBurstConfig,
             parent_adapter_dir: Path | None, parent_sha256: str | None, run_id: str | None,
             prompt_template: Path = rl.DEFAULT_PROMPT_TEMPLATE) -> rl.RLBurstRecord:
    """One RL burst (TRL GRPOTrainer/RLOOTrainer + peft, verifier reward) continuing an adapter.

    ``base_sha256`` and ``parent_sha256`` key the cache (the folders' contents, not their paths);
    ``run_id`` (recorded in the lineage) does not, so a later run reuses a finished burst, as does
    :func:`forgeflow.training.rl.run_rl_burst` itself from the adapter's ``lineage.json``.

    Raises:
        PreflightError: before any model is loaded, listing every problem of
            :func:`forgeflow.training.preflight.burst_preflight` (chat template, ``prompt_template``, disk space).
    """
    preflight.burst_preflight(base_model_dir, out_dir, config.lora_r, config.lora_target_modules, [prompt_template])
    data = rl.build_rl_dataset(tasks, prompt_template)
    record = rl.run_rl_burst(base_model_dir, data, out_dir, config, parent_adapter_dir=parent_adapter_dir,
                             run_id=run_id)
    if not record.weights_changed:
        totals = record.totals()
        get_run_logger().warning(
            "RL burst left adapter %s unchanged: every group's rewards were equal (%d resolved, %d unresolved, "
            "%d exceptions over %d completions), so no advantage and no update; it is its parent, not a new step",
            record.adapter.sha256[:12], totals.resolved, totals.unresolved, totals.exceptions, totals.completions)
    return record


@task(retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S, retry_condition_fn=retry_on_transient)
def submit_verl_ppo(settings: verl.VerlPPOSettings, dashboard_url: str, working_dir: str, submission_id: str,
                    pip: list[str] | None = None, metadata: dict[str, str] | None = None) -> str:
    """Render the verl PPO config and submit it as a Ray job; returns the submission id.

    Not cached: a submission is an action. Ray rejects a reused ``submission_id``, so a retry after
    a lost answer cannot start the job twice.
    """
    spec = verl.ray_job_spec(settings, working_dir=working_dir, submission_id=submission_id, pip=pip,
                             metadata=metadata)
    return verl.submit_ray_job(spec, dashboard_url)
