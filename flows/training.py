"""Training flows on a user's own data: ``sft-burst``, ``rl-burst``, ``ppo`` and ``windows``, each a deployment.

Each flow checks its inputs (the base model folder, the JSONL rows, the parent adapter, the sandbox
block) and runs the burst preflight before any model is loaded, then runs one burst (task), pins the
adapter to its content-addressed folder ``<out_dir>/adapters/<sha256>``, records it in the store
(kind ``adapter``, parent = the parent adapter or the base model, lineage: dataset sha256,
hyper-parameters, run id) so ``forgeflow lineage <sha256>`` shows base -> adapter -> adapter, and
publishes a table of the logged loss per step plus a markdown summary. Bursts continue a lineage by
naming the previous adapter (its folder or its recorded sha256) as ``parent_adapter``. ``ppo`` runs
verl on a Ray cluster through the Ray Jobs API (submitted, followed, stopped with the run) and
ingests its newest LoRA checkpoint the same way. ``windows`` turns a canary job's trajectories
into replay and anti-loop training windows and, given a base model, an SFT burst on them.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import settings as store_settings
from forgeflow.common.errors import InputError
from forgeflow.common.settings import home_dir
from forgeflow.ledger import records
from forgeflow.sandbox import dispatch
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.training import verl
from forgeflow.training.adapters import AdapterRecord, BurstOrigin, Lineage, pin_adapter
from forgeflow.training.burst import BurstConfig
from forgeflow.training.health import BurstHealthError
from forgeflow.training.ppo import DEFAULT_ADAPTER_GLOB
from forgeflow.training.rl import RLBurstConfig
from forgeflow.training.windows import WindowConfig
from tasks import training as training_tasks
from tasks.common import markdown_artifact, sweep_trial_pods, table_artifact
from tasks.curation import sandbox_choice, trial_dispatcher


class SFTBurstParams(BaseModel):
    """Hyper-parameters of an ``sft-burst`` (the common subset of :class:`BurstConfig`).

    Attributes:
        steps: optimizer steps.
        learning_rate: constant learning rate (no warm-up).
        lora_r: LoRA rank; a continued adapter must have the same rank.
        max_length: tokens per sample and per packed row (the burst packs samples, bfd); a longer
            sample is refused, not truncated.
        seed: training and data-order seed.
        device: ``auto`` (CUDA in bfloat16 when the worker has a GPU, else the CPU in float32),
            ``cpu`` or ``cuda``; the lineage records what was used.
    """

    model_config = ConfigDict(frozen=True)

    steps: int = Field(default=2, ge=1, le=100_000)
    learning_rate: float = Field(default=1e-3, gt=0.0, le=1.0)
    lora_r: int = Field(default=8, ge=1, le=256)
    max_length: int = Field(default=512, ge=16, le=131_072)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def burst_config(self) -> BurstConfig:
        """The :class:`BurstConfig` these parameters stand for (other fields at their defaults)."""
        return BurstConfig(max_steps=self.steps, learning_rate=self.learning_rate, lora_r=self.lora_r,
                           lora_alpha=2 * self.lora_r, max_length=self.max_length, seed=self.seed,
                           device=self.device)


class RLBurstParams(BaseModel):
    """Hyper-parameters of an ``rl-burst`` (the common subset of :class:`RLBurstConfig`).

    Attributes:
        algorithm: ``grpo`` or ``rloo`` (TRL trainers).
        steps: optimizer steps.
        learning_rate: constant learning rate.
        lora_r: LoRA rank; a continued adapter must have the same rank.
        num_generations: completions sampled per prompt (the group), >= 2.
        max_completion_length: tokens per completion.
        seed: training and sampling seed.
        verifier_timeout_multiplier: the training verifier's timeout = each task's own
            ``verifier_timeout_s`` x this (kept apart from curation's timeout).
        verifier_concurrency: verifier sandboxes at once.
        device: as :class:`SFTBurstParams`'.
    """

    model_config = ConfigDict(frozen=True)

    algorithm: Literal["grpo", "rloo"] = "grpo"
    steps: int = Field(default=2, ge=1, le=100_000)
    learning_rate: float = Field(default=1e-4, gt=0.0, le=1.0)
    lora_r: int = Field(default=8, ge=1, le=256)
    num_generations: int = Field(default=2, ge=2, le=64)
    max_completion_length: int = Field(default=128, ge=1, le=32_768)
    seed: int = 0
    verifier_timeout_multiplier: float = Field(default=0.06, gt=0.0, le=10.0)
    verifier_concurrency: int = Field(default=1, ge=1, le=32)
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def burst_config(self, backend: "str | SandboxTarget", memory_mb: int, cpus: float) -> RLBurstConfig:
        """The :class:`RLBurstConfig` with the verifier sandbox ``backend`` (a kind or a target) and its limits."""
        return RLBurstConfig(algorithm=self.algorithm, max_steps=self.steps, learning_rate=self.learning_rate,
                             lora_r=self.lora_r, lora_alpha=2 * self.lora_r, num_generations=self.num_generations,
                             max_completion_length=self.max_completion_length, seed=self.seed,
                             verifier_timeout_multiplier=self.verifier_timeout_multiplier,
                             verifier_concurrency=self.verifier_concurrency, verifier_backend=backend,
                             verifier_memory_mb=memory_mb, verifier_cpus=cpus, device=self.device)


class BurstResult(BaseModel):
    """What a burst flow made.

    Attributes:
        adapter_sha256: the pinned adapter's digest (weights + adapter config).
        adapter_path: its content-addressed folder ``<out_dir>/adapters/<sha256>``.
        parent_sha256: what it continues: the parent adapter's digest, or the base model's.
        base_model_sha256: the base model folder's digest.
        dataset_sha256: the training data's digest.
        steps: optimizer steps run.
        final_loss: the last logged training loss.
        losses: ``(step, loss)`` as logged.
    """

    model_config = ConfigDict(frozen=True)

    adapter_sha256: str
    adapter_path: Path
    parent_sha256: str
    base_model_sha256: str
    dataset_sha256: str
    steps: int
    final_loss: float
    losses: list[tuple[int, float]]


def _run_id() -> str | None:
    return str(flow_run.get_id() or "") or None


def _base_row(base_sha: str, base_path: Path, source: str, run_id: str | None) -> records.ModelArtifactRecord:
    """The base model's row (kind ``base``, lineage ``{"source": source}``), recorded unless the store knows it."""
    return records.ModelArtifactRecord(sha256=base_sha, kind="base", path=str(base_path), lineage={"source": source},
                                       run_id=run_id)


def _training_setup(lineage: Lineage) -> str:
    """Device, dtype, attention and packing of a burst as its lineage records them ("-" where it does not)."""
    return (f"{lineage.device or '-'} / {lineage.dtype or '-'}; attention {lineage.attention or '-'}; "
            f"packing {lineage.packing or '-'}")


def _record(adapter: AdapterRecord, base_path: Path, base_sha: str,
            run_id: str | None, artifact_key: str, title: str) -> BurstResult:
    """Record the base (if the store does not know it yet) and the pinned adapter; publish artifacts."""
    parent = adapter.lineage.parent_adapter_sha256 or base_sha
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
    return BurstResult(adapter_sha256=adapter.sha256, adapter_path=adapter.path, parent_sha256=parent,
                       base_model_sha256=base_sha, dataset_sha256=adapter.lineage.dataset_sha256,
                       steps=adapter.steps, final_loss=adapter.final_loss, losses=losses)


@flow(name="sft-burst", log_prints=False)
def sft_burst(hf_dir: Path, samples_jsonl: Path, params: SFTBurstParams = SFTBurstParams(),
              parent_adapter: str | None = None, out_dir: Path | None = None) -> BurstResult:
    """One LoRA SFT burst on the user's chat samples, continuing ``parent_adapter`` if given.

    Args:
        hf_dir: the base model folder (HF checkpoint with tokenizer and chat template).
        samples_jsonl: one ``{"messages": [...]}`` row per line (see
            :func:`forgeflow.training.jsonl.read_sft_jsonl`).
        params: steps, learning rate, LoRA rank, max length (tokens), seed.
        parent_adapter: an adapter to continue (``is_trainable=True``): its folder, or its sha256
            as recorded in the store; same base model and LoRA rank. None starts a new adapter.
        out_dir: default ``$FORGEFLOW_HOME/models``; the burst trains in ``<out_dir>/sft-adapter``
            and pins the result to ``<out_dir>/adapters/<sha256>``.

    Returns:
        The :class:`BurstResult`.

    Raises:
        InputError: ``hf_dir`` is not a model folder, a JSONL line is invalid (named), the parent is
            unknown or does not fit — all before any model loads.
        PreflightError: chat template missing/empty or disk space short (before any model loads).
        BurstDivergedError / BurstHealthError: a health gate failed; no adapter is written.
    """
    inputs = training_tasks.burst_inputs(hf_dir, samples_jsonl, "sft", parent_adapter, store_settings.store_url())
    hf_dir, parent_dir = inputs.hf_dir, inputs.parent_dir
    config = params.burst_config()
    models = Path(out_dir) if out_dir is not None else home_dir() / "models"
    work = models / "sft-adapter"
    training_tasks.burst_preflight(hf_dir, work, config.lora_r, config.lora_target_modules)
    base_sha = training_tasks.tree_digest(hf_dir, "base-model")
    run_id = _run_id()
    adapter = training_tasks.sft_burst(hf_dir, base_sha, inputs.rows, work, config, parent_dir, run_id)
    adapter = pin_adapter(adapter, models / "adapters")
    return _record(adapter, hf_dir, base_sha, run_id, "sft-burst", "sft-burst")


@flow(name="rl-burst", log_prints=False, on_cancellation=[sweep_trial_pods("sandbox_block")],
      on_crashed=[sweep_trial_pods("sandbox_block")])
def rl_burst(hf_dir: Path, tasks_jsonl: Path, params: RLBurstParams = RLBurstParams(),
             parent_adapter: str | None = None, sandbox_block: str | None = None,
             out_dir: Path | None = None, dispatcher: str | None = None) -> BurstResult:
    """One RL burst (TRL GRPO or RLOO + LoRA) on the user's tasks, rewarded by the verifier in a sandbox.

    The reward of a completion is the verifier's verdict on its patch in a fresh sandbox of the task
    image (1 resolved, 0 not); an infrastructure failure gives no reward (None), never 0. The
    verifier's timeout is each task's ``verifier_timeout_s`` x ``params.verifier_timeout_multiplier``.

    Args:
        hf_dir: the base model folder.
        tasks_jsonl: one :class:`~forgeflow.training.rl.RLTask` row per line (prompt = problem
            statement; verifier = image, test command, FAIL_TO_PASS/PASS_TO_PASS, timeout).
        params: algorithm, steps, learning rate, LoRA rank, group size, completion length, seed,
            verifier timeout multiplier and concurrency.
        parent_adapter: an adapter (folder or recorded sha256) to continue, or None.
        sandbox_block: a ``forgeflow-sandbox`` block (backend kind, memory MiB, CPUs) as curate
            takes it; None: podman with 1024 MiB and 1 CPU.
        out_dir: default ``$FORGEFLOW_HOME/models``; trains in ``<out_dir>/rl-adapter``, pins to
            ``<out_dir>/adapters/<sha256>``.
        dispatcher: a ``forgeflow-dispatcher`` block (:class:`blocks.core.TrialDispatcher`) as curate
            takes it: ``ray`` scores each rollout as a Ray task on a sandbox node of that cluster
            (the counts per step name the nodes); None or ``in-process``: here.

    Returns:
        The :class:`BurstResult`.

    Raises:
        InputError: bad ``hf_dir``, an invalid JSONL line (named), an unknown parent, sandbox or
            dispatcher block — before any model loads.
        PreflightError: templates or disk space (before any model loads).
        BurstDivergedError / BurstHealthError: a gate failed (incl. too few completions scored), or
            every group's rewards were equal so the adapter did not change (nothing new to record).
    """
    inputs = training_tasks.burst_inputs(hf_dir, tasks_jsonl, "rl", parent_adapter, store_settings.store_url())
    hf_dir, parent_dir, rl_tasks = inputs.hf_dir, inputs.parent_dir, inputs.rows
    placement = trial_dispatcher(dispatcher) if dispatcher is not None else None
    if sandbox_block is not None:
        choice = sandbox_choice(sandbox_block)
        config = params.burst_config(choice.backend(), choice.memory_mb, choice.cpus)
    else:
        config = params.burst_config("podman", 1024, 1.0)
    models = Path(out_dir) if out_dir is not None else home_dir() / "models"
    work = models / "rl-adapter"
    base_sha = training_tasks.tree_digest(hf_dir, "base-model")
    parent_sha = training_tasks.tree_digest(parent_dir, "adapter") if parent_dir is not None else None
    run_id = _run_id()
    # rl_burst runs the preflight (chat + prompt templates, disk) first, before any model loads
    try:
        origin = BurstOrigin(base_model_dir=hf_dir, base_model_sha256=base_sha, parent_adapter_dir=parent_dir,
                             parent_adapter_sha256=parent_sha)
        record = training_tasks.rl_burst(origin, rl_tasks, work, config, run_id, ray=placement)
    finally:  # a driver outlived by its Ray cluster is ended by Ray: leave it now
        if placement is not None:
            dispatch.disconnect()
    if not record.weights_changed:
        raise BurstHealthError(f"rl-burst left adapter {record.adapter.sha256[:12]} unchanged (every group's "
                               "rewards were equal, so no advantage): nothing new to record; give more tasks or "
                               "generations")
    adapter = pin_adapter(record.adapter, models / "adapters")
    return _record(adapter, hf_dir, base_sha, run_id, "rl-burst", f"rl-burst ({config.algorithm})")


class PPOParams(BaseModel):
    """How the ``ppo`` flow runs verl on a Ray cluster.

    Attributes:
        dashboard_url: the cluster's dashboard (Ray job server), e.g. ``http://head:8265``.
        working_dir: the job's working directory (uploaded by Ray; must hold forgeflow for the reward
            function), or None for a cluster image that has it.
        pip: packages the job installs (e.g. a pinned ``verl``).
        entrypoint: a command replacing verl's ``python3 -m verl.trainer.main_ppo <overrides>`` (a
            wrapper script, or a CPU stand-in that writes a checkpoint); None: verl's own.
        entrypoint_num_cpus: CPUs reserved for the job's driver.
        poll_s: seconds between status polls (the job's new log lines are logged at each).
        timeout_s: stop the job after this many seconds (None: no limit).
        adapter_glob: where the LoRA adapter of a step lies under ``settings.checkpoint_dir``
            (default verl's ``global_step_*/actor/lora_adapter``); the highest step is ingested.
        base_model_sha256: the base model's digest, when ``settings.model_path`` is not a folder
            readable here (an HF id or a cluster path); else computed from the folder.
    """

    model_config = ConfigDict(frozen=True)

    dashboard_url: str = Field(min_length=1)
    working_dir: str | None = None
    pip: tuple[str, ...] = ()
    entrypoint: str | None = None
    entrypoint_num_cpus: float = Field(default=1.0, ge=0)
    poll_s: float = Field(default=5.0, gt=0)
    timeout_s: float | None = Field(default=None, gt=0)
    adapter_glob: str = Field(default=DEFAULT_ADAPTER_GLOB, min_length=1)
    base_model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class PPOResult(BaseModel):
    """What a ``ppo`` run trained and kept.

    Attributes:
        submission_id: the Ray job.
        status: how it ended (``SUCCEEDED``).
        wall_s: seconds the job was followed.
        log_lines: job log lines logged into the run.
        adapter_sha256 / adapter_path: the ingested adapter, pinned.
        base_model_sha256: its base model (its parent in the store).
        dataset_sha256: digest of ``settings.train_files``.
        global_step: the checkpoint's step.
    """

    model_config = ConfigDict(frozen=True)

    submission_id: str
    status: str
    wall_s: float
    log_lines: int
    adapter_sha256: str
    adapter_path: Path
    base_model_sha256: str
    dataset_sha256: str
    global_step: int


def _ppo_submission_id(run_id: str | None) -> str:
    return f"forgeflow-ppo-{run_id or uuid.uuid4().hex}"


def _stop_ppo_job(flow: object, run: object, state: object) -> None:
    """Flow hook (cancelled / crashed): stop the run's Ray job if it still runs."""
    from forgeflow.training import ray_jobs

    parameters = getattr(run, "parameters", {}) or {}
    submission_id = parameters.get("submission_id") or _ppo_submission_id(str(getattr(run, "id", "")))
    try:
        params = PPOParams.model_validate(parameters.get("params") or {})
        ray_jobs.stop(params.dashboard_url, submission_id)
    except Exception as exc:  # noqa: BLE001 - a hook must not mask the run's own end
        get_run_logger().warning("could not stop Ray job %s: %s", submission_id, exc)


@flow(name="ppo", log_prints=False, on_cancellation=[_stop_ppo_job], on_crashed=[_stop_ppo_job])
def ppo(settings: verl.VerlPPOSettings, params: PPOParams, submission_id: str | None = None,
        out_dir: Path | None = None) -> PPOResult:
    """PPO with verl on a Ray cluster through the Ray Jobs API: submit, follow its status and log
    into this run, stop it when the run is cancelled or crashes, and ingest its newest LoRA
    checkpoint as an adapter whose parent is the base model (``forgeflow lineage`` shows it).

    Args:
        settings: verl's PPO settings (:class:`forgeflow.training.verl.VerlPPOSettings`; rendered to
            verl's Hydra overrides). ``lora_rank`` must be > 0 (an adapter is what is ingested) and
            ``checkpoint_dir`` readable here (a shared filesystem) once the job ends.
        params: the cluster and the job (:class:`PPOParams`).
        submission_id: the Ray job's id (default ``forgeflow-ppo-<flow run id>``).
        out_dir: default ``$FORGEFLOW_HOME/models``; the adapter is pinned to ``<out_dir>/adapters/<sha256>``.

    Returns:
        The :class:`PPOResult`.

    Raises:
        InputError: ``lora_rank`` 0, or no base model digest (``model_path`` not a folder here and no
            ``params.base_model_sha256``) — before anything is submitted.
        TransientInfraError: the job server does not answer (after retries).
        RayJobError: the job ended FAILED or STOPPED or ran past ``params.timeout_s``.
        InfraError: the job succeeded but left no adapter under ``checkpoint_dir``.
    """

    if settings.lora_rank < 1:
        raise InputError("settings.lora_rank is 0 (all weights trained): the ppo flow ingests a LoRA adapter; "
                         "give lora_rank > 0")
    model_dir = Path(settings.model_path)
    if params.base_model_sha256 is None and not model_dir.is_dir():
        raise InputError(f"settings.model_path {settings.model_path!r} is not a folder here: give "
                         "params.base_model_sha256 (the base model's sha256_tree) to record the lineage")
    base_sha = params.base_model_sha256 or training_tasks.tree_digest(model_dir, "base-model")
    run_id = _run_id()
    job_id = submission_id or _ppo_submission_id(run_id)
    spec = verl.ray_job_spec(settings, working_dir=params.working_dir, submission_id=job_id, pip=list(params.pip),
                             metadata={"prefect_flow_run_id": run_id or ""})
    spec = spec.model_copy(update={"entrypoint": params.entrypoint or spec.entrypoint,
                                   "entrypoint_num_cpus": params.entrypoint_num_cpus})
    training_tasks.submit_ray_job(spec, params.dashboard_url)
    outcome = training_tasks.follow_ray_job(params.dashboard_url, job_id, params.poll_s, params.timeout_s)
    checkpoints = Path(settings.checkpoint_dir)
    if not checkpoints.is_absolute() and params.working_dir:
        checkpoints = Path(params.working_dir) / checkpoints
    models = Path(out_dir) if out_dir is not None else home_dir() / "models"
    folder, step, adapter = training_tasks.ingest_ppo_checkpoint(
        checkpoints, params.adapter_glob, models / "ppo-adapter", base_sha, tuple(settings.train_files),
        settings.model_dump(mode="json"), run_id or job_id, {"ray_job": job_id})
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
    return PPOResult(submission_id=job_id, status=outcome.status, wall_s=outcome.wall_s, log_lines=outcome.log_lines,
                     adapter_sha256=adapter.sha256, adapter_path=adapter.path, base_model_sha256=base_sha,
                     dataset_sha256=lineage.dataset_sha256, global_step=step)


class WindowsResult(BaseModel):
    """What a ``windows`` run built (and trained, when asked).

    Attributes:
        samples_jsonl: the training windows as JSONL (``sft-burst``'s ``samples_jsonl``).
        samples_sha256: that file's sha256.
        trajectories: trajectories read (their sha256 in each sample's provenance).
        windows_by_kind: windows per kind (``replay``, ``stop_and_conclude``, ``early_switch``,
            ``one_call_quota``).
        stats: every count of :class:`forgeflow.training.windows.WindowStats`.
        burst: the SFT burst on the windows (None unless ``hf_dir`` was given).
    """

    model_config = ConfigDict(frozen=True)

    samples_jsonl: Path
    samples_sha256: str
    trajectories: int
    windows_by_kind: dict[str, int]
    stats: dict
    burst: BurstResult | None = None


@flow(name="windows", log_prints=False)
def windows(job_id: str | None = None, trajectories_dir: Path | None = None,
            config: WindowConfig = WindowConfig(), samples_jsonl: Path | None = None, hf_dir: Path | None = None,
            params: SFTBurstParams = SFTBurstParams(), parent_adapter: str | None = None,
            out_dir: Path | None = None) -> WindowsResult:
    """Agent trajectories -> replay and anti-loop training windows (stop-and-conclude, early switch,
    one-call quota) -> a prompt-completion chat dataset (tool calls kept, rendered by the model's chat
    template) -> optionally an SFT burst on it that continues ``parent_adapter``.

    The trajectories are a canary job's (``job_id``: one ``<trial id>.traj.json`` per agent trial in
    the job's trajectory folder) or a folder's. Each sample keeps its provenance (instance id,
    trajectory sha256, window kind, target step); its ``source`` names them, so the dataset digest
    in the adapter's lineage does too.

    Args:
        job_id: a canary (or recovery) job recorded in the store.
        trajectories_dir: a folder of mini-swe-agent ``*.traj.json`` instead.
        config: window layout and kinds (:class:`forgeflow.training.windows.WindowConfig`).
        samples_jsonl: where the JSONL goes (default ``$FORGEFLOW_HOME/windows/<job id or folder>.jsonl``).
        hf_dir: the base model to train (the ``sft-burst`` flow as a subflow); None: only the dataset.
        params / parent_adapter / out_dir: as the ``sft-burst`` flow's.

    Returns:
        The :class:`WindowsResult`.

    Raises:
        InputError: see :func:`tasks.training.window_dataset`; a malformed trajectory (named); no window at all.
        Whatever ``sft-burst`` raises when training.
    """
    name = job_id or Path(trajectories_dir or "trajectories").name
    path = Path(samples_jsonl) if samples_jsonl is not None else home_dir() / "windows" / f"{name}.jsonl"
    n_files, window_stats, digest = training_tasks.window_dataset(store_settings.store_url(), job_id, trajectories_dir,
                                                                  config, path)
    stats = window_stats.model_dump(mode="json")
    table_artifact("windows", [{"kind": k, "windows": v} for k, v in window_stats.windows_by_kind.items()],
                   f"training windows from {n_files} trajectories ({name})")
    get_run_logger().info("windows: %d trajectories -> %s in %s (sha256 %s)", n_files, window_stats.windows_by_kind,
                          path, digest[:12])
    burst = None
    if hf_dir is not None:
        burst = sft_burst(hf_dir, path, params, parent_adapter, out_dir)
    return WindowsResult(samples_jsonl=path, samples_sha256=digest, trajectories=n_files,
                         windows_by_kind=dict(window_stats.windows_by_kind), stats=stats, burst=burst)
