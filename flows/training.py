"""Training flows on a user's own data: ``sft-burst``, ``rl-burst``, ``ppo`` and ``windows``, each a deployment.

Each flow checks its inputs and runs the burst preflight before any model is loaded, runs one burst, pins the
adapter to ``<out_dir>/adapters/<sha256>`` and records it in the store (parent: the parent adapter or the base
model), so ``forgeflow lineage <sha256>`` shows base -> adapter -> adapter. A refused input names its field as
the user wrote it (``params.hf_dir``, ``params.training.lora_r``).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from flows.stagekit import param_error, run_task
from flows.training_params import (
    PPOJob,
    PPOParams,
    RLBurstParams,
    SFTBurstParams,
    WindowsParams,
)
from forgeflow.common import settings as store_settings
from forgeflow.common.errors import InputError
from forgeflow.common.settings import home_dir
from forgeflow.ledger import records
from forgeflow.sandbox import dispatch
from forgeflow.training import verl
from forgeflow.training.adapters import AdapterRecord, Lineage, pin_adapter
from forgeflow.training.episodes import EPISODE_PROMPT_TEMPLATE
from forgeflow.training.episodes_grpo import EpisodeStepStats
from forgeflow.training.episodes_plot import episode_plot_markdown
from forgeflow.training.health import BurstHealthError
from forgeflow.training.ppo import local_checkpoint_dir
from forgeflow.training.ray_jobs import RayJobOutcome
from forgeflow.training.rewards import StepRewardCounts
from forgeflow.training.rl import DEFAULT_PROMPT_TEMPLATE
from forgeflow.training.windows import WindowsResult
from tasks import training as training_tasks
from tasks.common import hook_logger, markdown_artifact, sweep_trial_sandboxes, table_artifact, trial_dispatcher
from tasks.curation import sandbox_block

__all__ = ["PPOJob", "PPOParams", "PPOResult", "RLBurstParams", "SFTBurstParams",
           "WindowsParams", "WindowsResult", "ppo", "rl_burst", "sft_burst", "windows"]

def _kinds(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def reward_rows(counts: list[StepRewardCounts]) -> list[dict[str, object]]:
    """The RL burst's reward counts as table rows: one per optimizer step, then ``total``."""
    labelled = [(str(c.step), c) for c in counts] + ([("total", StepRewardCounts.total(counts))] if counts else [])
    return [{"step": label, "completions": c.completions, "resolved": c.resolved, "unresolved": c.unresolved,
             "submission failures": c.submission_failures, "by kind": _kinds(c.submission_failure_kinds),
             "exceptions": c.exceptions, "by type": _kinds(c.exception_types), "tampering": c.tampering}
            for label, c in labelled]


def episode_rows(stats: list[EpisodeStepStats]) -> list[dict[str, object]]:
    """The agentic burst's episodes as table rows, one per optimizer step: rewards, exceptions by type, refused
    prefixes, supervision stops, end reasons, turns, sampled tokens, the step's wall time and the Ray nodes that
    ran the episodes' containers (``-``: this host)."""
    return [{"step": s.step, "episodes": s.episodes, "resolved": s.resolved, "unresolved": s.unresolved,
             "reward mean": "-" if s.reward_mean is None else f"{s.reward_mean:.3f}", "exceptions": s.exceptions,
             "by type": _kinds(s.exception_types), "prefix refused": s.prefix_refused,
             "supervision stops": _kinds(s.supervision_stops), "end reasons": _kinds(s.end_reasons),
             "turns": s.turns, "turns max": s.turns_max, "policy tokens": s.policy_tokens,
             "wall s": round(s.wall_s, 1), "ray nodes": _kinds({n[:12]: c for n, c in s.nodes.items()})}
            for s in stats]


def _run_id() -> str | None:
    return str(flow_run.get_id() or "") or None


def _base_row(base_sha: str, base_path: Path, source: str, run_id: str | None) -> records.ModelArtifactRecord:
    """The base model's row (kind ``base``, lineage ``{"source": source}``), recorded unless the store knows it."""
    return records.ModelArtifactRecord(sha256=base_sha, kind="base", path=str(base_path), lineage={"source": source},
                                       run_id=run_id)


def _training_setup(lineage: Lineage) -> str:
    """Device, dtype, attention, packing and gradient checkpointing as the lineage records them (``-``: not)."""
    checkpointing = "-" if lineage.gradient_checkpointing is None else "on" if lineage.gradient_checkpointing else "off"
    return (f"{lineage.device or '-'} / {lineage.dtype or '-'}; attention {lineage.attention or '-'}; "
            f"packing {lineage.packing or '-'}; gradient checkpointing {checkpointing}")


def _record(adapter: AdapterRecord, base_path: Path, base_sha: str,
            run_id: str | None, artifact_key: str, title: str) -> AdapterRecord:
    """Record the base (if the store does not know it yet) and the pinned adapter; publish artifacts."""
    parent = adapter.parent_sha256
    training_tasks.record_adapter(store_settings.store_url(), _base_row(base_sha, base_path, "local", run_id),
                                  records.ModelArtifactRecord(
                                      sha256=adapter.sha256, kind="adapter", path=str(adapter.path),
                                      parent_sha256=parent, lineage=adapter.lineage.model_dump(mode="json"),
                                      run_id=run_id))
    losses = [(int(s), float(v)) for s, v in (adapter.health.losses if adapter.health else [])]
    table_artifact(f"{artifact_key}-loss", [{"step": s, "loss": round(v, 6)} for s, v in losses],
                   f"{title}: training loss per logged step")
    markdown_artifact(f"{artifact_key}-summary", "\n".join([
        f"# {title}", "",
        "| field | value |", "|---|---|",
        f"| adapter | `{adapter.sha256}` |", f"| path | `{adapter.path}` |",
        f"| parent | `{parent}` ({'adapter' if adapter.lineage.parent_adapter_sha256 else 'base model'}) |",
        f"| dataset sha256 | `{adapter.lineage.dataset_sha256}` |",
        f"| trained on | {_training_setup(adapter.lineage)} |",
        f"| steps | {adapter.steps} |", f"| final loss | {adapter.final_loss:.4f} |",
        "", f"`forgeflow lineage {adapter.sha256[:12]}` shows the chain."]), f"{title}: the adapter and its lineage")
    get_run_logger().info("%s: adapter %s (parent %s), %d steps, final loss %.4f", title, adapter.sha256[:12],
                          parent[:12], adapter.steps, adapter.final_loss)
    return adapter


@flow(name="sft-burst", log_prints=False)
def sft_burst(params: SFTBurstParams) -> AdapterRecord:
    """One LoRA SFT burst on the user's chat samples, continuing ``params.parent_adapter`` if given.

    On an image-text-to-text base (``tiny-vl``, Qwen3.5 / Qwen3-VL) a user turn may hold image parts; the vision
    tower is frozen and recorded so in the lineage. The burst is cached on the base model's digest and folder,
    the rows, the output folder, the hyper-parameters and the parent (not the run id).

    Args:
        params: the checkpoint (or parent adapter) to train, the SFT samples file, the training settings.

    Raises:
        InputError: a bad ``params.hf_dir``, an invalid line of ``params.samples_jsonl`` (named), an unknown or
            unfitting ``params.parent_adapter``, all before any model loads.
        PreflightError: chat template missing/empty or disk space short (before any model loads).
        BurstDivergedError / BurstHealthError: a health gate failed; no adapter is written.
    """
    inputs = training_tasks.burst_inputs(params.hf_dir, params.samples_jsonl, "sft", params.parent_adapter,
                                         store_settings.store_url())
    hf_dir, parent_dir, config = inputs.hf_dir, inputs.parent_dir, params.training
    models = Path(params.out_dir) if params.out_dir is not None else home_dir() / "models"
    work = models / "sft-adapter"
    training_tasks.burst_preflight(hf_dir, work, config.lora_r, config.lora_target_modules)
    base_sha = training_tasks.tree_digest(hf_dir, "base-model")
    if parent_dir is not None:
        training_tasks.check_parent(parent_dir, hf_dir, base_sha, config.lora_r)
    run_id = _run_id()
    # run_task: inside a lifecycle stage the burst is counted (cached on a re-run of the same inputs); the
    # checks, digests, pin and record above and below are not cached, so they stay out of the stage's counts
    adapter = run_task(training_tasks.sft_burst, hf_dir, base_sha, inputs.rows, work, config, parent_dir, run_id)
    # <out_dir>/sft-adapter is the working folder, reused by the next burst: the store and whoever packages
    # the adapter use its content-addressed copy <out_dir>/adapters/<sha256>
    adapter = training_tasks.pin_adapter(adapter, models / "adapters")
    return _record(adapter, hf_dir, base_sha, run_id, "sft-burst", "sft-burst")


@flow(name="rl-burst", log_prints=False,
      on_cancellation=[sweep_trial_sandboxes("params.sandbox", "params.dispatcher")],
      on_crashed=[sweep_trial_sandboxes("params.sandbox", "params.dispatcher")])
def rl_burst(params: RLBurstParams) -> AdapterRecord:
    """One RL burst (TRL GRPO or RLOO + LoRA) on the user's tasks, rewarded by the verifier in a sandbox.

    The reward is the verifier's verdict on the completion's patch in a fresh sandbox (1 resolved, 0 not, also
    for no diff, a patch that does not apply, or a run the submission hung); an infrastructure failure gives no
    reward (None), never 0. The verifier's timeout is each task's ``task_timeout_s`` x
    ``verifier_timeout_multiplier``, never below 5 x its ``pristine_duration_s``. A cancelled or crashed run's
    Kubernetes pods are swept. On an image-text-to-text base (``tiny-vl``) the vision tower is frozen, the
    prompts stay text, and the lineage records the tower as an SFT burst does.

    * ``training.episode``: the agentic mode (:class:`forgeflow.training.episodes.EpisodeSettings`; ``grpo``
      only): each rollout a multi-turn episode of the policy (bash in a fresh container of the task
      image on ``sandbox``'s backend, labelled with the run so a cancelled run's are swept; submit)
      bounded by ``max_turns``, ``max_tokens``, ``wall_s``, the loop and hang detectors, ``concurrency``
      episodes at once under ``step_wall_s``; rewarded by the verifier on the episode's final change,
      token-exact (:mod:`forgeflow.training.episodes_grpo`). Prompts from
      ``forgeflow/data/rl_episode_prompt.md``; trajectories (canary format) under
      ``<out_dir>/rl-episodes/<run id>/step-<N>/``; the table artifact ``rl-burst-episodes``, the markdown
      artifact ``rl-burst-episodes-plot`` (reward and turns per step, the PNG also at
      ``<out_dir>/rl-episodes/<run id>/episodes.png``) and
      ``lineage.json``'s ``episode_stats`` count each step's rewards, exceptions, refused prefixes,
      supervision stops, end reasons and turns. None: single-turn rollouts.

    Args:
        params: the checkpoint (or parent adapter), the RL task rows or a freeze split, the sandbox, the RL settings.

    Raises:
        InputError: a bad ``params.hf_dir``, an invalid task line (named), an unknown freeze, split, parent
            adapter, sandbox or dispatcher block, all before any model loads.
        PreflightError: templates or disk space, tasks of the freeze that cannot run (before any model loads).
        BurstDivergedError / BurstHealthError: a gate failed (incl. too few completions scored), or every
            group's rewards were equal so the adapter did not change.
    """
    inputs = training_tasks.burst_inputs(params.hf_dir, params.tasks_jsonl, "rl", params.parent_adapter,
                                         store_settings.store_url(), params.freeze_name, params.split,
                                         params.source)
    hf_dir, parent_dir = inputs.hf_dir, inputs.parent_dir
    try:
        placement = trial_dispatcher(params.dispatcher) if params.dispatcher is not None else None
    except InputError as exc:
        raise param_error(exc, "dispatcher") from None
    if params.sandbox is not None:
        try:
            limits, target = sandbox_block(params.sandbox)
        except InputError as exc:
            raise param_error(exc, "sandbox") from None
        backend, config = target.as_backend(), params.training.resolved(limits)
    else:
        backend, config = "podman", params.training.resolved()
    template = EPISODE_PROMPT_TEMPLATE if config.episode is not None else DEFAULT_PROMPT_TEMPLATE
    models = Path(params.out_dir) if params.out_dir is not None else home_dir() / "models"
    work = models / "rl-adapter"
    base_sha = training_tasks.tree_digest(hf_dir, "base-model")
    parent_sha = training_tasks.tree_digest(parent_dir, "adapter") if parent_dir is not None else None
    if parent_dir is not None:
        training_tasks.check_parent(parent_dir, hf_dir, base_sha, config.lora_r)
    run_id = _run_id()
    # rl_burst runs the preflight (chat + prompt templates, disk) first, before any model loads
    try:
        record = training_tasks.rl_burst(inputs, base_sha, parent_sha, work, config, run_id, template, ray=placement,
                                         backend=backend)
    finally:  # a driver outlived by its Ray cluster is ended by Ray: leave it now
        if placement is not None:
            dispatch.disconnect()
    table_artifact("rl-burst-rewards", reward_rows(record.reward_counts),
                   f"rl-burst ({config.algorithm}): the verifier's rewards per optimizer step")
    if record.episode_stats:
        table_artifact("rl-burst-episodes", episode_rows(record.episode_stats),
                       "rl-burst (agentic): episodes per optimizer step (rewards, exceptions, refused prefixes, "
                       "supervision stops, turns)")
        markdown_artifact("rl-burst-episodes-plot", episode_plot_markdown(
            record.episode_stats, models / "rl-episodes" / run_id / "episodes.png"),
            "rl-burst (agentic): reward and turns per optimizer step")
    if not record.weights_changed:
        what = (f"left adapter {record.adapter.sha256[:12]} unchanged" if parent_dir is not None
                else "left its new adapter at peft's initial weights")
        raise BurstHealthError(f"rl-burst {what} (every group's rewards were equal, so no advantage): nothing "
                               "learned, nothing new to record; give more tasks or generations")
    adapter = pin_adapter(record.adapter, models / "adapters")
    return _record(adapter, hf_dir, base_sha, run_id, "rl-burst", f"rl-burst ({config.algorithm})")


class PPOResult(BaseModel):
    """What a ``ppo`` run trained and kept: the Ray job as it ended, the adapter ingested from verl's checkpoint
    (its lineage: base model, ``settings.train_files``' digest, hyperparameters) and that checkpoint's step."""

    model_config = ConfigDict(frozen=True)

    job: RayJobOutcome = Field(description="the Ray job: its submission id, how it ended (SUCCEEDED), seconds "
                                           "followed, log lines")
    adapter: AdapterRecord = Field(description="the adapter, pinned under <out_dir>/adapters/<sha256>")
    global_step: int = Field(ge=0, description="the step of the checkpoint the adapter came from")


def _ppo_submission_id(run_id: str | None) -> str:
    return f"forgeflow-ppo-{run_id or uuid.uuid4().hex}"


def _stop_ppo_job(flow: object, flow_run: object, state: object) -> None:
    """Flow hook (cancelled / crashed): stop the run's Ray job (parameter names are Prefect's: it calls by keyword)."""
    from forgeflow.training import ray_jobs

    run, logger = flow_run, hook_logger(flow, flow_run)
    parameters = getattr(run, "parameters", {}) or {}
    given = parameters.get("params") or {}  # the run's parameters as JSON, or the model itself
    given = given.model_dump(mode="json") if isinstance(given, BaseModel) else given
    submission_id = given.get("submission_id") or _ppo_submission_id(str(getattr(run, "id", "")))
    try:
        job = PPOJob.model_validate(given.get("job") or {})
        ended = ray_jobs.stop(job.dashboard_url, submission_id)
        logger.info("Ray job %s at %s: %s", submission_id, job.dashboard_url, ended)
    except Exception as exc:  # noqa: BLE001 - a hook must not mask the run's own end
        logger.warning("could not stop Ray job %s: %s", submission_id, exc)


@flow(name="ppo", log_prints=False, on_cancellation=[_stop_ppo_job], on_crashed=[_stop_ppo_job])
def ppo(params: PPOParams) -> PPOResult:
    """PPO with verl on a Ray cluster through the Ray Jobs API; ingest its newest LoRA checkpoint as an adapter.

    The job's log is followed into this run and the job stopped when the run is cancelled or crashes. Only a
    checkpoint the job itself wrote under ``checkpoint_dir`` (readable here: a shared filesystem) is ingested.

    Args:
        params: the verl PPO settings, the Ray job to submit them as, and where the checkpoint is ingested.

    Raises:
        InputError: ``lora_rank`` 0, ``save_freq_steps`` < 1, or no base model digest, before anything is submitted.
        TransientInfraError: the job server does not answer (after retries).
        RayJobError: the job ended FAILED or STOPPED or ran past ``params.job.timeout_s``.
        InfraError: the job succeeded but wrote no new adapter under ``checkpoint_dir``.
    """
    settings, job = params.settings, params.job
    if settings.lora_rank < 1:
        raise InputError("params.settings.lora_rank is 0 (all weights trained): the ppo flow ingests a LoRA "
                         "adapter; give lora_rank > 0")
    if settings.save_freq_steps < 1:
        raise InputError(f"params.settings.save_freq_steps is {settings.save_freq_steps}: verl would save no "
                         "checkpoint and the ppo flow would have no adapter to ingest after the whole run; give "
                         "save_freq_steps > 0 (verl then also saves after the last step)")
    model_dir = Path(settings.model_path)
    if job.base_model_sha256 is None and not model_dir.is_dir():
        raise InputError(f"params.settings.model_path {settings.model_path!r} is not a folder here: give "
                         "params.job.base_model_sha256 (the base model's sha256_tree) to record the lineage")
    base_sha = job.base_model_sha256 or training_tasks.tree_digest(model_dir, "base-model")
    run_id = _run_id()
    job_id = params.submission_id or _ppo_submission_id(run_id)
    if "checkpoint_dir" not in settings.model_fields_set:  # the default folder: one per job, never shared
        settings = settings.model_copy(update={"checkpoint_dir": f"{settings.checkpoint_dir}/{job_id}"})
    spec = verl.ray_job_spec(settings, job, submission_id=job_id, metadata={"prefect_flow_run_id": run_id or ""})
    training_tasks.submit_ray_job(spec)
    outcome = training_tasks.follow_ray_job(job.dashboard_url, job_id, job.poll_s, job.timeout_s)
    checkpoints = local_checkpoint_dir(settings.checkpoint_dir, job.working_dir)
    models = Path(params.out_dir) if params.out_dir is not None else home_dir() / "models"
    folder, step, adapter = training_tasks.ingest_ppo_checkpoint(
        checkpoints, job.adapter_glob, models / "ppo-adapter", base_sha, tuple(settings.train_files),
        settings.model_dump(mode="json"), run_id or job_id, {"ray_job": job_id}, submission_id=job_id)
    lineage = adapter.lineage
    adapter = pin_adapter(adapter, models / "adapters")
    training_tasks.record_adapter(store_settings.store_url(), _base_row(base_sha, model_dir, "ppo model_path", run_id),
                                  records.ModelArtifactRecord(
                                      sha256=adapter.sha256, kind="adapter", path=str(adapter.path),
                                      parent_sha256=base_sha, run_id=run_id,
                                      lineage={**lineage.model_dump(mode="json"), "ray_job": job_id,
                                               "global_step": step}))
    markdown_artifact("ppo-summary", "\n".join([
        "# ppo", "", "| field | value |", "|---|---|", f"| Ray job | `{job_id}` ({outcome.status}, "
        f"{outcome.wall_s:.1f} s) |", f"| adapter | `{adapter.sha256}` |", f"| path | `{adapter.path}` |",
        f"| base model | `{base_sha}` |", f"| global step | {step} |",
        f"| dataset sha256 | `{lineage.dataset_sha256}` |",
        "", f"`forgeflow lineage {adapter.sha256[:12]}` shows the chain."]), "ppo: the Ray job and the adapter")
    get_run_logger().info("ppo: Ray job %s %s; adapter %s (step %d) from %s", job_id, outcome.status,
                          adapter.sha256[:12], step, folder)
    return PPOResult(job=outcome, adapter=adapter, global_step=step)


@flow(name="windows", log_prints=False)
def windows(params: WindowsParams) -> WindowsResult:
    """Agent trajectories -> replay and anti-loop training windows -> a chat dataset -> optionally an SFT burst.

    Each sample keeps its provenance (instance id, trajectory sha256, window kind, target step), so the dataset
    digest in the adapter's lineage names them. The default output file is named by its content. A window keeps
    the images of the turns it includes (image parts by sha256, the files written beside the JSONL), so an SFT
    burst on an image-text-to-text base trains on them.

    Args:
        params: the canary job's trajectories to cut into SFT windows, the window sizes, the SFT burst settings.

    Raises:
        InputError: an unknown job, missing or malformed trajectories (named), an image a trajectory names that
            is missing or changed (trajectory and sha256 named), no window at all, a ``params.samples_jsonl``
            holding other samples; and whatever ``sft-burst`` raises when training.
    """
    name = params.job_id or Path(params.trajectories_dir or "trajectories").name
    written = training_tasks.window_dataset(store_settings.store_url(), params.job_id, params.trajectories_dir,
                                            params.windows, params.samples_jsonl, name)
    path, n_files = written.samples_jsonl, written.trajectories
    table_artifact("windows", [{"kind": k, "windows": v} for k, v in written.windows_by_kind.items()],
                   f"training windows from {n_files} trajectories ({name})")
    get_run_logger().info("windows: %d trajectories -> %s in %s (file sha256 %s, dataset sha256 %s)", n_files,
                          written.windows_by_kind, path, written.samples_sha256[:12], written.dataset_sha256[:12])
    if params.hf_dir is None:
        return written
    burst = sft_burst(SFTBurstParams(hf_dir=params.hf_dir, samples_jsonl=path, training=params.training,
                                     parent_adapter=params.parent_adapter, out_dir=params.out_dir))
    return written.model_copy(update={"burst": burst})
