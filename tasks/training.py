"""Prefect tasks of training: the burst preflight, SFT bursts, RL bursts (TRL GRPO/RLOO with verifier
rewards) and verl PPO jobs on a Ray cluster (submitted, followed, stopped with the run), and the
training flows' input checks, digests, records and window datasets (their store and file I/O)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE
from pydantic import BaseModel, ConfigDict

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import atomic_write_text, sha256_tree
from forgeflow.common.settings import home_dir
from forgeflow.curation.generated import GENERATED_FILE
from forgeflow.ledger.records import ModelArtifactRecord
from forgeflow.ledger.store import Store
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.training import adapters, burst, freeze_tasks, jsonl, preflight, ray_jobs, rl, samples, verl
from forgeflow.training.freeze_tasks import FreezeSplit
from tasks.common import (
    TRANSIENT_RETRIES,
    TRANSIENT_RETRY_DELAYS_S,
    forwarded_logs,
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
    with forwarded_logs("forgeflow.training.burst"):  # e.g. why gradient checkpointing is on or off
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
        prompt_template: the prompt template file (problem statement -> prompt); the agentic mode's
            (``config.episode``) is :data:`forgeflow.training.episodes.EPISODE_PROMPT_TEMPLATE`.
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


@task(retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S, retry_condition_fn=retry_on_transient,
      cache_policy=NO_CACHE)
def submit_ray_job(spec: verl.RayJobSpec, dashboard_url: str) -> str:
    """Submit a Ray job (:func:`forgeflow.training.ray_jobs.submit`); returns its submission id.

    A job whose metadata names its checkpoint folder (:data:`forgeflow.training.verl.CHECKPOINT_DIR_LABEL`,
    relative: under ``spec.runtime_env.working_dir``) has what that folder holds stamped just before it is
    submitted and, once Ray accepted it, recorded at ``$FORGEFLOW_HOME/ppo/<submission id>/checkpoints-before.json``
    (:func:`forgeflow.training.ppo.kept_if_accepted`), so :func:`ingest_ppo_checkpoint` takes only a
    checkpoint the job wrote. A refused submission records nothing.

    Not cached: a submission is an action. Ray refuses a reused ``submission_id``, so a retry after
    a lost answer cannot start the job twice.

    Raises:
        InputError / ToolMissingError / TransientInfraError / InfraError: :func:`forgeflow.training.ray_jobs.submit`'s.
    """
    from forgeflow.common.settings import home_dir
    from forgeflow.training import ppo as ppo_ingest

    logger = get_run_logger()
    labelled = spec.metadata.get(verl.CHECKPOINT_DIR_LABEL)
    before = None
    if labelled is not None:
        folder = ppo_ingest.local_checkpoint_dir(labelled, spec.runtime_env.working_dir)
        before = ppo_ingest.checkpoints_before(folder, spec.submission_id)
    env = spec.runtime_env.model_dump(exclude_none=True)
    runtime_env = {k: v for k, v in env.items() if v not in ([], {})}
    with ppo_ingest.kept_if_accepted(ppo_ingest.record_path(home_dir(), spec.submission_id), before):
        submission_id = ray_jobs.submit(dashboard_url, spec.entrypoint, spec.submission_id, runtime_env,
                                        spec.metadata, spec.entrypoint_num_cpus)
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
def write_sft_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write SFT rows (``{"messages": [...], ...}``, e.g. :func:`oracle_samples`') to ``path`` as JSONL, one
    row per line (atomically), the file the ``sft-burst`` flow reads
    (:func:`forgeflow.training.jsonl.read_sft_jsonl`). Not cached: the file is rewritten each run. Returns ``path``."""
    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows))
    return path


@task(cache_policy=NO_CACHE)
def pin_adapter(record: adapters.AdapterRecord, adapters_dir: Path) -> adapters.AdapterRecord:
    """Copy an adapter into its content-addressed folder ``<adapters_dir>/<sha256>`` (kept if already
    there and intact): :func:`forgeflow.training.adapters.pin_adapter`. The pinned record."""
    return adapters.pin_adapter(record, adapters_dir)


_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA256_PREFIX = re.compile(r"^[0-9a-f]{8,63}$")


def _check_hf_dir(hf_dir: Path) -> Path:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise InputError(f"hf_dir {hf_dir} is not a folder")
    if not (hf_dir / "config.json").is_file():
        raise InputError(f"hf_dir {hf_dir} holds no config.json: not an HF model folder")
    return hf_dir.resolve()


def _parent_folder(store: Store, parent_adapter: str | None) -> Path | None:
    """The folder of ``parent_adapter`` (a folder, or the sha256 of an adapter recorded in the store, whole or
    a unique prefix of at least 8 hex characters as the flows' logs and ``forgeflow lineage`` show them).

    Raises:
        InputError: the folder holds no adapter, the sha256 is no recorded adapter whose recorded
            folder still holds it, or the prefix matches no recorded adapter or several.
    """
    if parent_adapter is None:
        return None
    value = parent_adapter.strip()
    if _SHA256_PREFIX.match(value.lower()) and not Path(value).exists():
        from forgeflow.packaging.lineage import resolve_sha256

        known = {a.sha256 for a in store.model_artifacts("adapter")}
        try:
            value = resolve_sha256(store, value, known)
        except InputError as exc:
            raise InputError(f"parent_adapter: {str(exc).replace('artifact ', 'adapter ', 1)}") from None
    if _SHA256.match(value.lower()):
        sha = value.lower()
        productions = [p for p in store.producers(sha) if p.kind == "adapter"]
        if not productions:
            raise InputError(f"parent_adapter {sha} is not an adapter recorded in the store ({store.display_url})")
        for production in reversed(productions):  # the newest recorded folder first
            if adapters.adapter_matches(Path(production.path), sha):
                return Path(production.path)
        raise InputError(f"parent_adapter {sha} is recorded at {productions[-1].path}, which no longer holds it")
    folder = Path(value)
    if not (folder / "adapter_config.json").is_file() or not (folder / "lineage.json").is_file():
        raise InputError(f"parent_adapter {folder} is neither a recorded adapter sha256 nor an adapter folder "
                         "(adapter_config.json and lineage.json)")
    return folder.resolve()


class BurstInputs(BaseModel):
    """A burst flow's inputs, read and checked before any model loads (:func:`burst_inputs`).

    Attributes:
        hf_dir: the base model folder, resolved.
        rows: the JSONL's rows (SFT samples or RL tasks), in file order; or a freeze split's RL tasks, in its order.
        parent_dir: the parent adapter's folder (None: the burst starts from the base model).
    """

    model_config = ConfigDict(frozen=True)

    hf_dir: Path
    rows: list[dict[str, Any]]
    parent_dir: Path | None


@task(cache_policy=NO_CACHE)
def burst_inputs(hf_dir: Path, rows_jsonl: Path | None, kind: Literal["sft", "rl"], parent_adapter: str | None,
                 store_url: str, freeze: FreezeSplit | None = None) -> BurstInputs:
    """Check and read a burst flow's inputs: ``hf_dir`` is an HF model folder (``config.json``), the rows are
    valid (the JSONL's: :func:`forgeflow.training.jsonl.read_sft_jsonl` for ``sft``, ``read_rl_jsonl`` for
    ``rl``; or, for ``rl`` with ``freeze`` instead of a JSONL, the RL tasks of a freeze's split with what
    validation recorded for their verifier: :func:`forgeflow.training.freeze_tasks.rl_tasks_from_freeze`),
    and ``parent_adapter`` (an adapter folder, or the sha256 of an adapter the store at ``store_url``
    records, whose recorded folder still holds it) resolves to a folder. Not cached.

    Raises:
        InputError: ``hf_dir`` is not a model folder, a JSONL line is invalid (named), an unknown freeze or
            split (the message begins with ``freeze_name``), the parent is unknown.
        PreflightError: tasks of the freeze that cannot run (each named).
    """
    folder = _check_hf_dir(hf_dir)
    store = Store(store_url)
    try:
        store.upgrade()
        if freeze is not None and kind == "rl":
            try:
                rows = freeze_tasks.rl_tasks_from_freeze(store, freeze.freeze_name, freeze.split, freeze.source,
                                                         home_dir() / "demo" / GENERATED_FILE)
            except InputError as exc:
                raise InputError(f"freeze_name {freeze.freeze_name!r} (split {freeze.split!r}): {exc}") from None
        else:
            rows = (jsonl.read_sft_jsonl if kind == "sft" else jsonl.read_rl_jsonl)(Path(rows_jsonl))
        parent_dir = _parent_folder(store, parent_adapter)
    finally:
        store.dispose()
    return BurstInputs(hf_dir=folder, rows=rows, parent_dir=parent_dir)


@task(cache_policy=NO_CACHE, task_run_name="digest-{what}")
def tree_digest(folder: Path, what: str = "folder") -> str:
    """:func:`forgeflow.common.fsutil.sha256_tree` of ``folder`` (every file's path and content; 64 hex), or of an
    adapter folder (``what="adapter"``: :func:`forgeflow.training.adapters.adapter_sha256`, weights + config).
    Not cached: the folder may change between runs."""
    if what == "adapter":
        return adapters.adapter_sha256(Path(folder))
    return sha256_tree(Path(folder))


@task(cache_policy=NO_CACHE, retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S,
      retry_condition_fn=retry_on_transient)
def record_adapter(store_url: str, base: ModelArtifactRecord, adapter: ModelArtifactRecord) -> None:
    """Record a burst's base model (unless the store already knows its sha256: a known base keeps its
    recorded path and provenance) and the adapter (upsert by sha256 and producer), in the store at
    ``store_url`` (upgraded first)."""
    store = Store(store_url)
    try:
        store.upgrade()
        if not store.producers(base.sha256):
            store.record_model_artifact(base)
        store.record_model_artifact(adapter)
    finally:
        store.dispose()


@task(cache_policy=NO_CACHE)
def ingest_ppo_checkpoint(checkpoints: Path, adapter_glob: str, out_dir: Path, base_sha256: str,
                          train_files: tuple[str, ...], hyperparameters: dict[str, Any], run_id: str,
                          extra: dict[str, Any], submission_id: str) -> tuple[Path, int, adapters.AdapterRecord]:
    """The newest LoRA checkpoint a PPO job wrote (:func:`forgeflow.training.ppo.newest_adapter` under
    ``checkpoints``, told from older ones there by the record :func:`submit_ray_job` kept of the folder),
    copied into ``out_dir`` as an adapter with its lineage (the training files' digest,
    :func:`forgeflow.training.ppo.ppo_lineage`; ``extra`` written beside it).

    Args:
        submission_id: the Ray job (its record of the folder is read by this id).

    Returns:
        ``(checkpoint folder, global step, adapter record)``.

    Raises:
        InfraError: no checkpoint matches ``adapter_glob``, every match predates the job (left there by an
            earlier run, unchanged), the newest it wrote holds no adapter, or there is no record of the
            folder before the job (:func:`submit_ray_job` did not submit it with this ``$FORGEFLOW_HOME``).
        InputError: the record is of another folder or job, or was altered.
    """
    from forgeflow.common.settings import home_dir
    from forgeflow.training import ppo as ppo_ingest

    before = ppo_ingest.read_checkpoints_before(ppo_ingest.record_path(home_dir(), submission_id), submission_id)
    folder, step = ppo_ingest.newest_adapter(Path(checkpoints), adapter_glob, before)
    lineage = ppo_ingest.ppo_lineage(base_sha256, train_files, hyperparameters, run_id)
    return folder, step, ppo_ingest.ingest_adapter(folder, step, Path(out_dir), lineage, extra)


def _trajectory_files(store: Store, job_id: str | None, trajectories_dir: Path | None) -> list[Path]:
    """The ``*.traj.json`` files of canary job ``job_id`` (one per agent trial, in the job's recorded
    ``trajectories_dir``, default ``$FORGEFLOW_HOME/canary/<job>/trajectories``) or of a folder.

    Raises:
        InputError: both or neither given, an unknown job, a job without trajectories, a recorded
            trajectory that is gone (named), or a folder without ``*.traj.json``.
    """
    from forgeflow.common.settings import home_dir

    if (job_id is None) == (trajectories_dir is None):
        raise InputError("give job_id (a canary job in the store) or trajectories_dir (a folder of *.traj.json), "
                         "not both or neither")
    if trajectories_dir is not None:
        if not Path(trajectories_dir).is_dir():
            raise InputError(f"trajectories_dir {trajectories_dir} does not exist or is not a folder")
        files = sorted(Path(trajectories_dir).glob("*.traj.json"))
        if not files:
            raise InputError(f"trajectories_dir {trajectories_dir} holds no *.traj.json")
        return files
    job = store.get_job(job_id)
    if job is None:
        raise InputError(f"job_id {job_id!r} is not recorded in the store ({store.display_url})")
    folder = Path(job.params.get("trajectories_dir") or home_dir() / "canary" / job_id / "trajectories")
    files = [folder / f"{t.trial_id}.traj.json" for t in store.trials_for(job_id=job_id) if t.kind == "agent"]
    if not files:
        raise InputError(f"job_id {job_id!r} recorded no agent trial: no trajectory to cut into windows")
    gone = [str(f) for f in files if not f.is_file()]
    if gone:
        raise InputError(f"job_id {job_id!r}: {len(gone)} of its {len(files)} trajectories are not in {folder}: "
                         f"{', '.join(gone[:5])}")
    return files


class WindowDataset(BaseModel):
    """What :func:`window_dataset` wrote.

    Attributes:
        path: the JSONL file.
        file_sha256: its bytes' sha256.
        dataset_sha256: the digest an ``sft-burst`` on it records as the adapter's ``dataset_sha256``
            (:func:`forgeflow.training.burst.sft_rows` of the file's samples).
        trajectories: trajectories read.
        stats: the :class:`forgeflow.training.windows.WindowStats`.
    """

    model_config = ConfigDict(frozen=True)

    path: Path
    file_sha256: str
    dataset_sha256: str
    trajectories: int
    stats: Any


@task(cache_policy=NO_CACHE)
def window_dataset(store_url: str, job_id: str | None, trajectories_dir: Path | None, config: Any,
                   path: Path | None, name: str) -> WindowDataset:
    """Cut the trajectories of canary job ``job_id`` (as the store at ``store_url`` records it) or of the folder
    ``trajectories_dir`` into training windows (:func:`forgeflow.training.windows.build_windows` with
    ``config``) and write them as JSONL (atomically) at ``path``, or, when None, at
    ``$FORGEFLOW_HOME/windows/<name>-<sha256[:12]>.jsonl`` (named by its content: never overwritten).

    Raises:
        InputError: see :func:`_trajectory_files`; a malformed trajectory (named); no window at all; ``path``
            holding other samples (:func:`forgeflow.training.windows.write_window_jsonl`).
    """
    from forgeflow.common.settings import home_dir
    from forgeflow.training.windows import build_windows, write_window_jsonl

    store = Store(store_url)
    try:
        store.upgrade()
        files = _trajectory_files(store, job_id, trajectories_dir)
    finally:
        store.dispose()
    built = build_windows(files, config)
    written, digest = write_window_jsonl(built, path, folder=home_dir() / "windows", name=name)
    rows = burst.sft_rows(jsonl.read_sft_jsonl(written))
    return WindowDataset(path=written, file_sha256=digest, dataset_sha256=burst.dataset_sha256(rows),
                         trajectories=len(files),
                         stats=built.stats)
