"""Prefect tasks of training: the burst preflight, SFT and RL bursts, verl PPO jobs on a Ray cluster, and the
training flows' input checks, digests, records and window datasets."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE
from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import JSONObject, atomic_write_text, sha256_tree
from forgeflow.common.settings import home_dir
from forgeflow.curation.bugs import Candidate
from forgeflow.curation.generated import GENERATED_FILE
from forgeflow.curation.task_rows import TaskSource
from forgeflow.ledger.records import ModelArtifactRecord
from forgeflow.ledger.store import Store
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.training import adapters, burst, freeze_tasks, jsonl, preflight, ray_jobs, rl, samples, verl
from forgeflow.training.windows import WindowConfig, WindowsResult
from tasks.common import forwarded_logs, io_task, run_labelled, shared_store


@task(cache_policy=NO_CACHE)
def burst_preflight(base_model_dir: Path, out_dir: Path, lora_r: int, lora_target_modules: tuple[str, ...],
                    template_files: tuple[Path, ...] = ()) -> preflight.PreflightReport:
    """Before any model loads: the chat template and ``template_files`` are non-empty files and ``out_dir``'s file
    system has the adapter's space. Not cached (disk space changes). Raises PreflightError: every problem found, in one
    message (``burst preflight failed: ...``)."""
    return preflight.burst_preflight(base_model_dir, out_dir, lora_r, lora_target_modules, template_files)


# log_prints off: HF datasets fingerprints functions with dill, which disassembles them with
# dis.dis into a captured stdout; Prefect's print capture would log those ~500 lines instead.
@task(cache_policy=(INPUTS - "run_id") + TASK_SOURCE, log_prints=False)
def sft_burst(base_model_dir: Path, base_sha256: str, samples: list[dict], out_dir: Path,
              config: burst.BurstConfig, parent_adapter_dir: Path | None, run_id: str | None) -> adapters.AdapterRecord:
    """One LoRA SFT burst (TRL SFTTrainer + peft). ``base_sha256`` keys the cache; ``run_id`` (the
    Prefect run recorded in the lineage) does not, so a later run reuses the adapter."""
    data = burst.build_sft_dataset(samples)
    with forwarded_logs("forgeflow.training.burst"):  # e.g. why gradient checkpointing is on or off
        return burst.run_sft_burst(base_model_dir, data, out_dir, config, parent_adapter_dir=parent_adapter_dir,
                                   run_id=run_id)


class BurstInputs(BaseModel):
    """A burst flow's inputs (:func:`burst_inputs`), what :func:`rl_burst` trains on: ``rows`` in file (or split)
    order; ``parent_dir`` None: the burst starts from the base model."""

    model_config = ConfigDict(frozen=True)

    hf_dir: Path = Field(description="the base model folder (HF checkpoint with tokenizer and chat template)")
    rows: list[JSONObject] = Field(description="the SFT samples or RL task rows")
    parent_dir: Path | None = Field(description="the adapter folder the burst continues; None: a new adapter")


# log_prints off: HF datasets fingerprints functions with dill (see sft_burst).
@io_task(cache_policy=(INPUTS - "run_id" - "ray") + TASK_SOURCE, log_prints=False)
def rl_burst(inputs: BurstInputs, base_sha256: str, parent_sha256: str | None, out_dir: Path,
             config: rl.RLBurstConfig, run_id: str | None, prompt_template: Path = rl.DEFAULT_PROMPT_TEMPLATE,
             ray: RayPlacement | None = None, backend: str | SandboxTarget = "podman") -> rl.RLBurstRecord:
    """One RL burst (TRL GRPO/RLOO + peft, verifier reward) on ``inputs.rows`` (:class:`forgeflow.training.rl.RLTask`
    rows) continuing ``inputs.parent_dir``. Cached on the folders, the base model's and parent adapter's digests
    (``parent_sha256`` None exactly when there is no parent), the tasks, ``out_dir``, the config, the template and
    the verifier's sandbox ``backend``; not on ``run_id`` nor ``ray`` (where the rewards are scored). Retried on
    transient errors. Raises PreflightError: before any model is loaded, listing every problem of
    :func:`forgeflow.training.preflight.burst_preflight` (chat template, ``prompt_template``, disk space)."""
    if (inputs.parent_dir is None) != (parent_sha256 is None):
        raise InputError(f"parent_dir and parent_sha256 go together (both or neither): got {inputs.parent_dir} and "
                         f"{parent_sha256}")
    base_model_dir = inputs.hf_dir
    preflight.burst_preflight(base_model_dir, out_dir, config.lora_r, config.lora_target_modules, [prompt_template])
    data = rl.build_rl_dataset(inputs.rows, prompt_template)
    # the backend's pods carry this run's id (the sweep); neither is in the lineage
    record = rl.run_rl_burst(base_model_dir, data, out_dir, config, parent_adapter_dir=inputs.parent_dir,
                             run_id=run_id, verifier_backend=run_labelled(backend), ray=ray)
    if not record.weights_changed:
        totals = record.totals()
        get_run_logger().warning(
            "RL burst left adapter %s unchanged: every group's rewards were equal (%d resolved, %d unresolved of "
            "which %d the submission's own failures, %d exceptions over %d completions), so no advantage and no "
            "update; it is its parent (or peft's initialisation), not a new step",
            record.adapter.sha256[:12], totals.resolved, totals.unresolved, totals.submission_failures,
            totals.exceptions, totals.completions)
    return record


@io_task()
def submit_ray_job(spec: verl.RayJobSpec) -> str:
    """Submit a Ray job to ``spec.job.dashboard_url``; returns its submission id (Ray refuses a reused one: a retry
    never starts it twice). The checkpoint folder its metadata names
    (:data:`forgeflow.training.verl.CHECKPOINT_DIR_LABEL`) is stamped before and, once accepted, recorded at
    ``$FORGEFLOW_HOME/ppo/<submission id>/checkpoints-before.json``, so :func:`ingest_ppo_checkpoint` takes only a
    checkpoint the job wrote. Raises InputError / ToolMissingError / TransientInfraError / InfraError:
    :func:`forgeflow.training.ray_jobs.submit`'s."""
    from forgeflow.common.settings import home_dir
    from forgeflow.training import ppo as ppo_ingest

    logger = get_run_logger()
    dashboard_url = spec.job.dashboard_url
    labelled = spec.metadata.get(verl.CHECKPOINT_DIR_LABEL)
    before = None
    if labelled is not None:
        folder = ppo_ingest.local_checkpoint_dir(labelled, spec.job.working_dir)
        before = ppo_ingest.checkpoints_before(folder, spec.submission_id)
    with ppo_ingest.kept_if_accepted(ppo_ingest.record_path(home_dir(), spec.submission_id), before):
        submission_id = ray_jobs.submit(dashboard_url, spec.entrypoint, spec.submission_id, spec.runtime_env(),
                                        spec.metadata, spec.job.entrypoint_num_cpus)
    logger.info("Ray job %s submitted to %s: %s", submission_id, dashboard_url, spec.entrypoint[:200])
    if before is not None:
        older = before.step_folders()
        if older:
            shown = ", ".join(older[:5]) + (", ..." if len(older) > 5 else "")
            logger.warning("checkpoint folder %s already holds %d checkpoints of earlier jobs (%s): only one that "
                           "Ray job %s writes or rewrites will be ingested; give each run its own checkpoint_dir",
                           before.checkpoint_dir, len(older), shown, submission_id)
    return submission_id


@task(cache_policy=NO_CACHE)
def follow_ray_job(dashboard_url: str, submission_id: str, poll_s: float = 5.0,
                   timeout_s: float | None = None) -> ray_jobs.RayJobOutcome:
    """Follow a Ray job to its end, its log lines into this run's log; a cancelled or crashed run stops the job. Raises
    RayJobError: the job ended FAILED or STOPPED, or ran past ``timeout_s``."""
    logger = get_run_logger()
    outcome = ray_jobs.follow(dashboard_url, submission_id, lambda line: logger.info("[%s] %s", submission_id, line),
                              poll_s=poll_s, timeout_s=timeout_s)
    logger.info("Ray job %s %s after %.1f s (%d log lines)", submission_id, outcome.status, outcome.wall_s,
                outcome.log_lines)
    return outcome


@task(cache_policy=NO_CACHE)
def oracle_samples(tasks: list[tuple[Candidate, Path, list[str]]]) -> list[JSONObject]:
    """SFT rows from the Oracle solutions of accepted tasks: (candidate, its checkout, its FAIL_TO_PASS)."""
    return samples.oracle_samples(tasks)


@task(cache_policy=NO_CACHE)
def write_sft_jsonl(rows: list[JSONObject], path: Path) -> Path:
    """Write SFT rows (``{"messages": [...], ...}``) to ``path`` as JSONL, atomically; returns ``path``."""
    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows))
    return path


@task(cache_policy=NO_CACHE)
def pin_adapter(record: adapters.AdapterRecord, adapters_dir: Path) -> adapters.AdapterRecord:
    """Copy an adapter into ``<adapters_dir>/<sha256>`` (kept if already there and intact); the pinned record."""
    return adapters.pin_adapter(record, adapters_dir)


_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA256_PREFIX = re.compile(r"^[0-9a-f]{8,63}$")


def _check_hf_dir(hf_dir: Path, field: str) -> Path:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise InputError(f"{field} {hf_dir} is not a folder")
    if not (hf_dir / "config.json").is_file():
        raise InputError(f"{field} {hf_dir} holds no config.json: not an HF model folder")
    return hf_dir.resolve()


def _parent_folder(store: Store, parent_adapter: str | None, field: str) -> Path | None:
    """The folder of ``parent_adapter`` (a folder, or the sha256 of an adapter recorded in the store, whole or a unique
    prefix of at least 8 hex characters as the flows' logs and ``forgeflow lineage`` show them). Raises InputError: the
    folder holds no adapter, the sha256 is no recorded adapter whose recorded folder still holds it, or the prefix
    matches no recorded adapter or several."""
    if parent_adapter is None:
        return None
    value = parent_adapter.strip()
    if _SHA256_PREFIX.match(value.lower()) and not Path(value).exists():
        from forgeflow.packaging.lineage import resolve_sha256

        known = {a.sha256 for a in store.model_artifacts("adapter")}
        try:
            value = resolve_sha256(store, value, known)
        except InputError as exc:
            raise InputError(f"{field}: {str(exc).replace('artifact ', 'adapter ', 1)}") from None
    if _SHA256.match(value.lower()):
        sha = value.lower()
        productions = [p for p in store.producers(sha) if p.kind == "adapter"]
        if not productions:
            raise InputError(f"{field} {sha} is not an adapter recorded in the store ({store.display_url})")
        for production in reversed(productions):  # the newest recorded folder first
            if adapters.adapter_matches(Path(production.path), sha):
                return Path(production.path)
        raise InputError(f"{field} {sha} is recorded at {productions[-1].path}, which no longer holds it")
    folder = Path(value)
    if not (folder / "adapter_config.json").is_file() or not (folder / "lineage.json").is_file():
        raise InputError(f"{field} {folder} is neither a recorded adapter sha256 nor an adapter folder "
                         "(adapter_config.json and lineage.json)")
    return folder.resolve()


@task(cache_policy=NO_CACHE)
def burst_inputs(hf_dir: Path, rows_jsonl: Path | None, kind: Literal["sft", "rl"], parent_adapter: str | None,
                 store_url: str, freeze_name: str | None = None, split: str = "train",
                 source: TaskSource | None = None, where: str = "params") -> BurstInputs:
    """Check and read a burst flow's inputs: ``hf_dir`` holds a ``config.json``; the rows (the JSONL's, or for ``rl``
    with ``freeze_name`` the RL tasks of the freeze's ``split``, their rows from ``source``) are valid;
    ``parent_adapter`` (a folder or a recorded sha256) resolves to a folder that holds it. Raises InputError naming
    the field of ``where`` (``params.hf_dir``, ``params.samples_jsonl`` or ``params.tasks_jsonl`` with the line,
    ``params.freeze_name``, ``params.parent_adapter``); PreflightError: tasks of the freeze that cannot run (each
    named)."""
    folder = _check_hf_dir(hf_dir, f"{where}.hf_dir")
    store = shared_store(store_url)
    if freeze_name is not None and kind == "rl":
        try:
            rows = freeze_tasks.rl_tasks_from_freeze(store, freeze_name, split, source or TaskSource(),
                                                     home_dir() / "demo" / GENERATED_FILE)
        except InputError as exc:
            raise InputError(f"{where}.freeze_name {freeze_name!r} (split {split!r}): {exc}") from None
    else:
        rows = (jsonl.read_sft_jsonl(Path(rows_jsonl), f"{where}.samples_jsonl") if kind == "sft"
                else jsonl.read_rl_jsonl(Path(rows_jsonl), f"{where}.tasks_jsonl"))
    parent_dir = _parent_folder(store, parent_adapter, f"{where}.parent_adapter")
    return BurstInputs(hf_dir=folder, rows=rows, parent_dir=parent_dir)


@task(cache_policy=NO_CACHE)
def check_parent(parent_dir: Path, hf_dir: Path, base_sha256: str, lora_r: int, where: str = "params") -> None:
    """Before any model loads: the parent adapter was trained on this base model and has rank ``lora_r``. Raises
    InputError naming ``<where>.parent_adapter`` or ``<where>.training.lora_r``."""
    try:
        record = adapters.read_adapter_record(Path(parent_dir))
    except InputError as exc:
        raise InputError(f"{where}.parent_adapter: {exc}") from None
    if record.lineage.base_model_sha256 != base_sha256:
        raise InputError(f"{where}.parent_adapter: the adapter at {parent_dir} was trained on base model "
                         f"{record.lineage.base_model_sha256}, not {base_sha256} ({hf_dir})")
    rank = json.loads((Path(parent_dir) / "adapter_config.json").read_text())["r"]
    if rank != lora_r:
        raise InputError(f"{where}.training.lora_r {lora_r} differs from the parent adapter's r {rank}")


@task(cache_policy=NO_CACHE, task_run_name="digest-{what}")
def tree_digest(folder: Path, what: str = "folder") -> str:
    """``sha256_tree`` of ``folder`` (64 hex), or ``adapter_sha256`` (weights + config) for ``what="adapter"``."""
    if what == "adapter":
        return adapters.adapter_sha256(Path(folder))
    return sha256_tree(Path(folder))


@io_task()
def record_adapter(store_url: str, base: ModelArtifactRecord, adapter: ModelArtifactRecord) -> None:
    """Record a burst's base model (unless already known: it keeps its recorded path) and the adapter."""
    store = shared_store(store_url)
    if not store.producers(base.sha256):
        store.record_model_artifact(base)
    store.record_model_artifact(adapter)


@task(cache_policy=NO_CACHE)
def ingest_ppo_checkpoint(checkpoints: Path, adapter_glob: str, out_dir: Path, base_sha256: str,
                          train_files: tuple[str, ...], hyperparameters: JSONObject, run_id: str,
                          extra: JSONObject, submission_id: str) -> tuple[Path, int, adapters.AdapterRecord]:
    """The newest LoRA checkpoint the PPO job ``submission_id`` wrote under ``checkpoints`` (told from older ones by
    :func:`submit_ray_job`'s record), copied into ``out_dir`` as an adapter with its lineage (``extra`` beside). Returns
    ``(checkpoint folder, global step, adapter record)``. Raises InfraError: no checkpoint matches ``adapter_glob``,
    every match predates the job (left there by an earlier run, unchanged), the newest it wrote holds no adapter, or
    there is no record of the folder before the job (:func:`submit_ray_job` did not submit it with this
    ``$FORGEFLOW_HOME``); InputError: the record is of another folder or job, or was altered."""
    from forgeflow.common.settings import home_dir
    from forgeflow.training import ppo as ppo_ingest

    before = ppo_ingest.read_checkpoints_before(ppo_ingest.record_path(home_dir(), submission_id), submission_id)
    folder, step = ppo_ingest.newest_adapter(Path(checkpoints), adapter_glob, before)
    lineage = ppo_ingest.ppo_lineage(base_sha256, train_files, hyperparameters, run_id)
    return folder, step, ppo_ingest.ingest_adapter(folder, step, Path(out_dir), lineage, extra)


def _trajectory_files(store: Store, job_id: str | None, trajectories_dir: Path | None, where: str) -> list[Path]:
    """The ``*.traj.json`` files of canary job ``job_id`` (one per agent trial, in the job's recorded
    ``trajectories_dir``, default ``$FORGEFLOW_HOME/canary/<job>/trajectories``) or of a folder. Raises InputError: both
    or neither given, an unknown job, a job without trajectories, a recorded trajectory that is gone (named), or a
    folder without ``*.traj.json``; each names ``<where>.job_id`` or ``<where>.trajectories_dir``."""
    from forgeflow.common.settings import home_dir

    if (job_id is None) == (trajectories_dir is None):
        raise InputError("give job_id (a canary job in the store) or trajectories_dir (a folder of *.traj.json), "
                         "not both or neither")
    if trajectories_dir is not None:
        if not Path(trajectories_dir).is_dir():
            raise InputError(f"{where}.trajectories_dir {trajectories_dir} does not exist or is not a folder")
        files = sorted(Path(trajectories_dir).glob("*.traj.json"))
        if not files:
            raise InputError(f"{where}.trajectories_dir {trajectories_dir} holds no *.traj.json")
        return files
    job = store.get_job(job_id)
    if job is None:
        raise InputError(f"{where}.job_id {job_id!r} is not recorded in the store ({store.display_url})")
    folder = Path(job.params.get("trajectories_dir") or home_dir() / "canary" / job_id / "trajectories")
    files = [folder / f"{t.trial_id}.traj.json" for t in store.trials_for(job_id=job_id) if t.kind == "agent"]
    if not files:
        raise InputError(f"{where}.job_id {job_id!r} recorded no agent trial: no trajectory to cut into windows")
    gone = [str(f) for f in files if not f.is_file()]
    if gone:
        raise InputError(f"{where}.job_id {job_id!r}: {len(gone)} of its {len(files)} trajectories are not in "
                         f"{folder}: {', '.join(gone[:5])}")
    return files


@task(cache_policy=NO_CACHE)
def window_dataset(store_url: str, job_id: str | None, trajectories_dir: Path | None, config: WindowConfig,
                   path: Path | None, name: str, where: str = "params") -> WindowsResult:
    """Cut the trajectories of canary job ``job_id`` (or of ``trajectories_dir``) into training windows and write them
    as JSONL at ``path``, else at ``$FORGEFLOW_HOME/windows/<name>-<sha256[:12]>.jsonl`` (never overwritten); the
    ``windows`` flow's result without its burst. Raises InputError: see :func:`_trajectory_files`; a malformed
    trajectory (named); no window at all; ``path`` holding other samples
    (:func:`forgeflow.training.windows.write_window_jsonl`); the fields named as ``<where>.<field>``."""
    from forgeflow.training.windows import build_windows, write_window_jsonl

    files = _trajectory_files(shared_store(store_url), job_id, trajectories_dir, where)
    built = build_windows(files, config)
    written, digest = write_window_jsonl(built, path, folder=home_dir() / "windows", name=name,
                                         field=f"{where}.samples_jsonl")
    rows = burst.sft_rows(jsonl.read_sft_jsonl(written))
    return WindowsResult(samples_jsonl=written, samples_sha256=digest, dataset_sha256=burst.dataset_sha256(rows),
                         trajectories=len(files), windows_by_kind=dict(built.stats.windows_by_kind), stats=built.stats)
