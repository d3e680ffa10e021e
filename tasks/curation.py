"""Prefect tasks of curation: candidate generation, which task images exist, NOP/Oracle validation of a
``curate`` batch (one task run per batch: :func:`validate_batch`), freeze."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import update_progress_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.curation import batch_run, bugs, bundle, freeze, generated, recovery, run_reads
from forgeflow.curation.candidates import CandidateTask
from forgeflow.curation.generated import GeneratedTask
from forgeflow.curation.selection import longest_first
from forgeflow.curation.task_rows import TaskRows, TaskSource
from forgeflow.ledger.records import BatchRecord, TaskRecord, TrialRecord
from forgeflow.ledger.store import Store
from forgeflow.registry import images
from forgeflow.sandbox import dispatch, trial
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.kubernetes_manifests import FLOW_RUN_LABEL
from tasks.common import (
    RESUMABLE,
    io_task,
    load_block,
    run_labelled,
    shared_store,
)


@task(cache_policy=RESUMABLE, task_run_name="candidates-{repo}")
def generate_candidates(repo: str, checkout_dir: Path, source_dir: str, max_candidates: int,
                        seed: int) -> list[bugs.Candidate]:
    """SWE-smith procedural candidates for one project, statically checked (patch applies)."""
    return bugs.generate_candidates(repo, checkout_dir, source_dir, max_candidates, seed)


class SandboxChoice(BaseModel):
    """Where a flow's trials run: the fields of a ``forgeflow-sandbox`` block
    (:class:`blocks.core.SandboxBackend`).

    Attributes:
        block: the block's name.
        kind: the sandbox backend (:data:`forgeflow.sandbox.backends.BACKENDS`: ``podman``,
            ``kubernetes``).
        memory_mb: memory limit per trial container, MiB.
        cpus: CPU quota per trial container, cores.
        target: the kind and where its pods run (kubeconfig, context, namespace).
    """

    model_config = ConfigDict(frozen=True)

    block: str
    kind: str
    memory_mb: int
    cpus: float
    target: SandboxTarget = SandboxTarget()

    def backend(self) -> "str | SandboxTarget":
        """What a verifier records and runs on: the kind alone for ``podman`` (nothing else to say),
        the whole :class:`SandboxTarget` for a cluster."""
        return self.kind if self.kind == "podman" else self.target


@task(cache_policy=NO_CACHE)
def sandbox_choice(block_name: str) -> SandboxChoice:
    """Load the ``forgeflow-sandbox`` block ``block_name`` (preflight: its backend kind must exist).

    Raises:
        InputError: no such block, or its kind is not a sandbox backend (the valid kinds listed).
    """
    from blocks.core import SandboxBackend

    block = load_block(SandboxBackend, block_name, "sandbox")
    return SandboxChoice(block=block_name, kind=block.kind, memory_mb=block.memory_mb, cpus=block.cpus,
                         target=block.target())


CURATE_JOB_ID = "curate"
"""The job id of every trial a ``curate`` run stores, and the kind of its batch rows."""


class BatchPlan(BaseModel):
    """One batch of a ``curate`` run, as :func:`validate_batch` validates it.

    Attributes:
        store_url: the store's SQLAlchemy URL.
        run_id: the ``curate`` flow run (its trials' and verdicts' ``run_id`` and its sandboxes' label).
        ids: the batch's instance ids, in selection order.
        rows: instance id -> its candidate row (not sent to the API with the task's parameters).
        image_ids: instance id -> what keys its image (a local image id or registry digest), or None.
        test_commands: instance id -> its test command.
        log_parsers: instance id -> its repository's log parser (absent: the run's).
        concurrency: validations in flight at once.
        max_retries: extra attempts for a validation that ended in an infrastructure error.
        validation: each validation's limits and checks.
        sandbox: the ``forgeflow-sandbox`` block's choice, or None (podman).
        ray: the Ray placement, or None (in this process).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    store_url: str
    run_id: str
    ids: list[str]
    rows: dict[str, Any] = Field(exclude=True)
    image_ids: dict[str, str | None] = Field(exclude=True)
    test_commands: dict[str, str] = Field(exclude=True)
    log_parsers: dict[str, str] = Field(exclude=True)
    concurrency: int
    max_retries: int
    validation: trial.ValidationSettings
    sandbox: SandboxChoice | None = None
    ray: RayPlacement | None = None


class BatchVerdicts(BaseModel):
    """What :func:`validate_batch` recorded.

    Attributes:
        tasks: each candidate's verdict (its task row as stored), in the batch's order.
        trials: how many trials the batch's validations stored.
    """

    model_config = ConfigDict(frozen=True)

    tasks: list[TaskRecord]
    trials: int


class BatchProgress(BaseModel):
    """A progress artifact :func:`validate_batch` moves as candidates finish (at most every
    :data:`PROGRESS_UPDATE_S`): ``(done + finished) / total`` percent."""

    artifact_id: Any
    done: int
    total: int


PROGRESS_UPDATE_S = 2.0
"""Least seconds between two updates of a run's progress artifact from inside a batch (one API call each)."""


def _validator(plan: BatchPlan, batch_id: str, stored: list[str]) -> batch_run.Validate:
    """``validate(instance_id, run_key)`` for ``plan``'s candidates: NOP then Oracle runs in no-network
    containers of the task image (:func:`forgeflow.sandbox.trial.validate_candidate`), on the sandbox block's
    backend (labelled with the curate run, swept with it) or as a Ray task on a sandbox node
    (:func:`forgeflow.sandbox.dispatch.validate_on_ray`, each trial recorded here once it returns, with the
    ``node_id`` it ran on); every trial upserted in the store by its id the moment it ends (a killed
    validation loses no finished trial), its id appended to ``stored``."""
    store = shared_store(plan.store_url)
    sandbox = plan.sandbox
    spec = SandboxSpec(memory_mb=plan.validation.memory_mb) if sandbox is None else SandboxSpec(
        memory_mb=sandbox.memory_mb, cpus=sandbox.cpus)
    backend = run_labelled(sandbox.target if sandbox is not None else "podman")
    if plan.run_id:
        backend = backend.model_copy(update={"labels": {**backend.labels, FLOW_RUN_LABEL: plan.run_id[:64]}})

    def on_trial(record: trial.TrialResult) -> None:
        store.record_trial(TrialRecord.from_trial(record, CURATE_JOB_ID, None, plan.run_id, batch_id=batch_id))
        stored.append(record.trial_id)

    def validate(instance_id: str, run_key: str) -> trial.ValidationOutcome:
        row, command, settings = plan.rows[instance_id], plan.test_commands[instance_id], plan.validation
        if parser := plan.log_parsers.get(instance_id):  # the repository's own log parser replaces the run's
            settings = settings.model_copy(update={"checks": settings.checks.model_copy(
                update={"log_parser": parser})})
        if plan.ray is not None:
            outcome = dispatch.validate_on_ray(plan.ray, row, row.image, command, timeout_s=settings.verifier_timeout_s,
                                               spec=spec, run_key=run_key, checks=settings.checks, backend=backend)
            for record in outcome.trials:
                on_trial(record)
            return outcome
        return trial.validate_candidate(row, row.image, command, timeout_s=settings.verifier_timeout_s, spec=spec,
                                        run_key=run_key, checks=settings.checks, on_trial=on_trial, backend=backend)

    return validate


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="validate-batch-{batch_id}")
def validate_batch(batch_id: str, plan: BatchPlan, progress: BatchProgress | None = None) -> BatchVerdicts:
    """Validate one batch of a ``curate`` run: NOP then Oracle runs of each candidate, ``plan.concurrency`` at a
    time in this task's threads (:func:`forgeflow.curation.batch_run.run_batch`), longest recorded validation
    first; each trial stored as it ends, each verdict (the task's status, test lists, pristine duration) the
    moment it is known, then the batch row. One task run per batch: no per-candidate orchestration, so a run's
    cost per candidate stays flat and its graph small at any size. Not cached and nothing persisted: a killed
    run resumed reads what has a verdict from the store and validates only the rest (a half-done validation
    again, under the same trial ids).

    Args:
        batch_id: the batch's id (trials' ``batch_id``, the batch row, the task run's name).
        plan: what to validate and how (:class:`BatchPlan`).
        progress: the run's progress artifact to move as candidates finish, or None.

    Returns:
        The verdicts and the number of trials stored (:class:`BatchVerdicts`).
    """
    store = shared_store(plan.store_url)
    stored: list[str] = []  # the trial ids stored (list.append is atomic: the pool's threads append)
    ids = longest_first(plan.ids, store.validation_seconds(plan.ids))
    job = batch_run.BatchJob(batch_id=batch_id, run_id=plan.run_id, ids=ids, rows=plan.rows,
                             concurrency=plan.concurrency, max_retries=plan.max_retries,
                             first_attempt=run_reads.voided_nop_attempts(store.engine, plan.ids))
    shown_at = [time.monotonic()]

    def on_finished(finished: int) -> None:
        if progress is not None and time.monotonic() - shown_at[0] >= PROGRESS_UPDATE_S:
            update_progress_artifact(progress.artifact_id, progress=100.0 * (progress.done + finished) / progress.total)
            shown_at[0] = time.monotonic()

    verdicts = {verdict.instance_id: verdict for verdict in batch_run.run_batch(
        job, _validator(plan, batch_id, stored), lambda verdict, _outcome: store.record_task(verdict), on_finished)}
    store.record_batch(BatchRecord(batch_id=batch_id, kind=CURATE_JOB_ID, instance_ids=plan.ids,
                                   concurrency=plan.concurrency, run_id=plan.run_id))
    return BatchVerdicts(tasks=[verdicts[i] for i in plan.ids], trials=len(stored))


@task(cache_policy=NO_CACHE)
def trial_dispatcher(block_name: str) -> RayPlacement | None:
    """Load the ``forgeflow-dispatcher`` block ``block_name`` (:class:`blocks.core.TrialDispatcher`):
    None for ``in-process``, the :class:`forgeflow.sandbox.dispatch.RayPlacement` for ``ray``.

    Raises:
        InputError: no such block.
    """
    from blocks.core import TrialDispatcher

    return load_block(TrialDispatcher, block_name, "dispatcher").placement()


@task(cache_policy=RESUMABLE)
def freeze_dataset(name: str, accepted: list[freeze.AcceptedTask], quotas: freeze.SplitQuotas, seed: int,
                   out_dir: Path, extra_inputs: dict,
                   bundle_tasks: list[bundle.BundleTask] | None = None) -> freeze.FreezeManifest:
    """Select the splits, write the freeze manifest (refused if the name exists with other
    content; a no-op if identical) and its export bundle (:func:`forgeflow.curation.bundle.write_bundle`:
    HF ``datasets`` folder + deterministic tarball + sidecar) from ``bundle_tasks``, one per accepted
    task (None: rows of instance id and repository only).

    Returns:
        The manifest with ``bundle_path`` / ``bundle_sha256`` set.

    Raises:
        PreflightError: the quotas are not met.
        FreezeConflictError: the manifest or bundle of ``name`` exists with other content.
    """
    selection = freeze.select_splits(accepted, quotas, seed)
    if not selection.ready:
        raise PreflightError(f"freeze {name!r} is not ready: {freeze.unmet_text(selection.unmet)}")
    manifest = freeze.write_freeze(name, selection, quotas, seed, out_dir, extra_inputs)
    rows = bundle_tasks if bundle_tasks is not None else [
        bundle.BundleTask(instance_id=t.instance_id, repo=t.repo) for t in accepted]
    return bundle.with_bundle(manifest, bundle.write_bundle(manifest, rows, out_dir))


@io_task()
def accepted_for_freeze(instance_ids: list[str] | None) -> list[bundle.BundleTask]:
    """The accepted tasks the store records (``settings.store_url()``, upgraded first), among
    ``instance_ids`` when given, as rows of a freeze's export bundle: instance id, repository,
    FAIL_TO_PASS / PASS_TO_PASS, image reference and the digest the store records for it (None when
    it records none), patch and its sha256. Never cached: the store is read as it is now.

    Returns:
        One row per accepted task, in the store's order (instance id).
    """
    from forgeflow.common import settings

    store = shared_store(settings.store_url())  # scoped reads: the ids asked for, the images they name
    rows = (store.accepted_tasks() if instance_ids is None
            else list(store.tasks_by_id(instance_ids, status="accepted").values()))
    digests = store.image_digests([t.image_ref for t in rows if t.image_ref])
    return [bundle.BundleTask(instance_id=t.instance_id, repo=t.repo, fail_to_pass=t.fail_to_pass,
                              pass_to_pass=t.pass_to_pass, image_ref=t.image_ref,
                              image_digest=digests.get(t.image_ref) if t.image_ref else None,
                              patch_sha256=t.patch_sha256, patch=t.patch) for t in rows]


@task(cache_policy=NO_CACHE)
def write_generated(path: Path, rows: list[generated.GeneratedTask]) -> Path:
    """Add ``rows`` to the generated-candidates file ``path`` (what ``curate`` and the canary read),
    atomically, keeping earlier runs' rows (:func:`forgeflow.curation.generated.merge_generated`); the path."""
    return generated.merge_generated(path, rows)


@io_task(task_run_name="task-verdicts")
def task_verdicts(store_url: str, instance_ids: list[str]) -> dict[str, TaskRecord]:
    """Each of ``instance_ids``' task row in the store at ``store_url`` (``status`` candidate / accepted /
    rejected / error, ``reason``, ``fail_to_pass`` / ``pass_to_pass``), read now (never cached), in the order given.

    Raises:
        InputError: an id the store has no task row for (up to 10 named).
    """
    rows = shared_store(store_url).tasks_by_id(instance_ids)  # primary-key reads of these ids alone
    missing = sorted(set(instance_ids) - set(rows))
    if missing:
        raise InputError(f"the store holds no task row for {len(missing)} id(s): {', '.join(missing[:10])}")
    return {iid: rows[iid] for iid in instance_ids}


@task(cache_policy=NO_CACHE)
def keep_freeze_inputs(name: str, out_dir: Path, inputs: dict) -> Path:
    """Write the inputs that made freeze ``name`` beside its manifest (kept if already there);
    :func:`forgeflow.curation.freeze.record_freeze_inputs`. Returns the path."""
    return freeze.record_freeze_inputs(name, out_dir, inputs)


@io_task()
def available_images(refs: list[str]) -> list[str]:
    """Which image references exist (:func:`forgeflow.registry.images.available`: one ``skopeo list-tags``
    per registry repository, ``podman image exists`` for local names and digest refs); sorted.

    Raises:
        RegistryUnavailableError: a registry does not answer (transient: retried).
    """
    return images.available(refs)


CurationState = run_reads.CurationState
"""What the store says about a curate run's candidates (:class:`forgeflow.curation.run_reads.CurationState`)."""


@io_task(task_run_name="curation-state", persist_result=False)
def curation_state(store_url: str, instance_ids: list[str]) -> CurationState:
    """The store's accepted tasks among ``instance_ids`` (a run's candidates), which of them are processed and
    the accepted ones per repository, read now (never cached: the run itself changes them batch by batch) and
    only for those ids (:func:`forgeflow.curation.run_reads.curation_state`: primary-key lookups in chunks, so
    the cost is the run's, not the whole store's)."""
    return run_reads.curation_state(shared_store(store_url).engine, instance_ids)


class Registration(BaseModel):
    """What :func:`register_candidates` recorded.

    Attributes:
        new: how many of the run's candidates the store did not know (recorded with status ``candidate``).
        candidates: how many candidates the run has (distinct ids).
        candidate_set: the batch id of the run's candidate set
            (:func:`forgeflow.curation.run_reads.candidate_set_record`): what the freeze-ready event names.
        candidates_sha256: the hex sha256 of the sorted candidate ids (the set's digest).
    """

    model_config = ConfigDict(frozen=True)

    new: int
    candidates: int
    candidate_set: str
    candidates_sha256: str


@io_task(persist_result=False)
def register_candidates(store_url: str, rows: list[CandidateTask | GeneratedTask], run_id: str) -> Registration:
    """Record the candidates of ``rows`` the store does not know yet (status ``candidate``) in one ``load``
    batch, its id the digest of every row's instance id (a re-run upserts the same batch), and the run's
    candidate set (every row's id, :func:`forgeflow.curation.run_reads.candidate_set_record`). The store is
    upgraded first; only the rows' own ids are looked up. Returns a :class:`Registration`."""
    from forgeflow.common.fsutil import sha256_json
    from forgeflow.ledger.records import BatchRecord

    store = shared_store(store_url)
    store.upgrade()
    ids = sorted(r.instance_id for r in rows)
    known = run_reads.known_instance_ids(store.engine, ids)
    new_rows = [TaskRecord(instance_id=r.instance_id, repo=r.repo, patch=r.patch, image_ref=r.image,
                           status="candidate", run_id=run_id) for r in rows if r.instance_id not in known]
    candidate_set = run_reads.candidate_set_record(ids, run_id or None)
    if new_rows:
        store.record_batch_results(BatchRecord(batch_id=f"load-{sha256_json(ids)[:16]}", kind="load",
                                               instance_ids=[t.instance_id for t in new_rows], concurrency=1,
                                               run_id=run_id), [], new_rows)
    store.record_batch(candidate_set)
    return Registration(new=len(new_rows), candidates=len(set(ids)), candidate_set=candidate_set.batch_id,
                        candidates_sha256=run_reads.candidate_set_digest(ids))


@io_task(persist_result=False)
def candidate_set_ids(candidate_set: str) -> list[str]:
    """The instance ids of the candidate set ``candidate_set`` (a freeze-ready event's ``candidate_set``) in the
    store (``settings.store_url()``, upgraded first), sorted; what the freeze freezes among.

    Raises:
        InputError: no such candidate set, or its ids do not match its digest.
    """
    store = Store()
    try:
        store.upgrade()
        return run_reads.candidate_set_ids(store.engine, candidate_set)
    finally:
        store.dispose()


@task(cache_policy=NO_CACHE, task_run_name="load-task-rows-{stage}")
def load_rows(source: TaskSource, default_generated: Path, stage: str) -> TaskRows:
    """The task rows of ``source`` (:class:`forgeflow.curation.task_rows.TaskSource`:
    :meth:`~forgeflow.curation.task_rows.TaskSource.load`; ``stage`` names the caller in errors). Not cached:
    the file or dataset may change between runs.

    Raises:
        InputError: as :func:`forgeflow.curation.task_rows.load_task_rows`.
    """
    return source.load(default_generated, stage)


@task(cache_policy=NO_CACHE, task_run_name="plan-recovery")
def plan_trial_recovery(store_url: str, request: recovery.RecoveryRequest) -> recovery.RecoveryPlan:
    """:func:`forgeflow.curation.recovery.plan_recovery` of ``request`` on the store (upgraded first; reads only,
    never cached). Raises as that function (unknown ids, a bad selection)."""
    store = Store(store_url)
    try:
        store.upgrade()
        return recovery.plan_recovery(store, request)
    finally:
        store.dispose()


@task(cache_policy=NO_CACHE, task_run_name="apply-recovery")
def apply_trial_recovery(store_url: str, plan: recovery.RecoveryPlan, backup_dir: Path,
                         run_id: str) -> tuple[recovery.RecoveryResult, str]:
    """:func:`forgeflow.curation.recovery.apply_recovery` of ``plan`` (backup, void, requeue, counts verified in
    one transaction; not retried: a second attempt would plan against a changed store), then the markdown audit
    (:func:`~forgeflow.curation.recovery.render_audit`) written atomically beside the backup (``.md``).

    Returns:
        ``(RecoveryResult, audit markdown)``.

    Raises:
        CountMismatchError: the store changed under the recovery (rolled back, nothing written).
    """
    from forgeflow.common.fsutil import atomic_write_text
    store = Store(store_url)
    try:
        result = recovery.apply_recovery(store, plan, backup_dir, run_id=run_id)
    finally:
        store.dispose()
    audit = recovery.render_audit(result)
    if result.backup_path is not None:
        atomic_write_text(result.backup_path.with_suffix(".md"), audit)
    return result, audit
