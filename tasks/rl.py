"""Prefect tasks of RL training: one GRPO/RLOO burst (:mod:`forgeflow.rl`), and the verl PPO job
submission for clusters (:mod:`forgeflow.verl`).

Retries only on transient infrastructure errors (:func:`tasks.common.retry_on_transient`): a
failed health gate, a failed preflight or bad input end the task at once (a retry would fail the
same way). Inside a burst, verifier infrastructure failures are not task failures: they are the
completions' "no reward" (counted in the record), never 0.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from forgeflow import burst, rl, verl
from tasks.common import TRANSIENT_RETRIES, TRANSIENT_RETRY_DELAYS_S, retry_on_transient


# log_prints off: HF datasets fingerprints functions with dill (see tasks/model.py).
@task(cache_policy=(INPUTS - "run_id") + TASK_SOURCE, log_prints=False, retries=TRANSIENT_RETRIES,
      retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S, retry_condition_fn=retry_on_transient)
def rl_burst(base_model_dir: Path, base_sha256: str, tasks: list[dict], out_dir: Path, config: rl.RLBurstConfig,
             parent_adapter_dir: Path | None, parent_sha256: str | None, run_id: str | None,
             prompt_template: Path = rl.DEFAULT_PROMPT_TEMPLATE) -> rl.RLBurstRecord:
    """One RL burst (TRL GRPOTrainer/RLOOTrainer + peft, verifier reward) continuing an adapter.

    ``base_sha256`` and ``parent_sha256`` key the cache (the folders' contents, not their paths);
    ``run_id`` (recorded in the lineage) does not, so a later run reuses a finished burst, as does
    :func:`forgeflow.rl.run_rl_burst` itself from the adapter's ``lineage.json``.

    Raises:
        PreflightError: before any model is loaded, listing every problem of
            :func:`forgeflow.burst.burst_preflight` (chat template, ``prompt_template``, disk space).
    """
    burst.burst_preflight(base_model_dir, out_dir, config.lora_r, config.lora_target_modules, [prompt_template])
    data = rl.build_rl_dataset(tasks, prompt_template)
    record = rl.run_rl_burst(base_model_dir, data, out_dir, config, parent_adapter_dir=parent_adapter_dir, run_id=run_id)
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
