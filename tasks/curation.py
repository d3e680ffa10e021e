"""Prefect tasks of curation: candidate generation, which task images exist, NOP/Oracle validation of a
``curate`` batch (one task run per batch), freeze."""

from __future__ import annotations

import time
from pathlib import Path
from uuid import UUID

from prefect import task
from prefect.artifacts import update_progress_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from forgeflow.common import settings
from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import JSONObject
from forgeflow.curation import batch_run, bugs, bundle, freeze, generated, recovery, run_reads
from forgeflow.curation.candidates import CandidateTask
from forgeflow.curation.generated import GeneratedTask
from forgeflow.curation.selection import longest_first
from forgeflow.curation.task_rows import TaskRows, TaskSource
from forgeflow.ledger.records import BatchRecord, TaskRecord, TrialRecord
from forgeflow.registry import images
from forgeflow.sandbox import dispatch, trial
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.kubernetes_manifests import FLOW_RUN_LABEL
from forgeflow.sandbox.limits import SandboxLimits
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


@task(cache_policy=NO_CACHE)
def sandbox_block(block_name: str) -> tuple[SandboxLimits, SandboxTarget]:
    """Load the ``forgeflow-sandbox`` block ``block_name`` (preflight: its backend kind must exist): its memory and
    CPUs per trial container (a stage's own limits win: :meth:`forgeflow.sandbox.limits.LimitOverrides.over`) and
    its target (backend kind and where its pods run), each a plain model. Raises InputError: no such block, or its
    kind is not a sandbox backend (the valid kinds listed)."""
    from blocks.core import SandboxBackend

    block = load_block(SandboxBackend, block_name, "sandbox")
    return block.limits(), block.target()


CURATE_JOB_ID = "curate"
"""The job id of every trial a ``curate`` run stores, and the kind of its batch rows."""


class BatchVerdicts(BaseModel):
    """What :func:`validate_batch` recorded: each candidate's task row, in the batch's order, and the trials."""

    model_config = ConfigDict(frozen=True)

    tasks: list[TaskRecord]
    trials: int


class BatchProgress(BaseModel):
    """A progress artifact :func:`validate_batch` moves as candidates finish (at most every
    :data:`PROGRESS_UPDATE_S`): ``(done + finished) / total`` percent."""

    artifact_id: UUID
    done: int
    total: int


PROGRESS_UPDATE_S = 2.0
"""Least seconds between two updates of a run's progress artifact from inside a batch (one API call each)."""


def _validator(plan: batch_run.BatchJob, stored: list[str]) -> batch_run.Validate:
    """``validate(instance_id, run_key)``: NOP then Oracle runs in no-network containers of the task image, on
    the block's backend (labelled with the run) or as a Ray task; each trial upserted the moment it ends, its
    id appended to ``stored``."""
    store = shared_store(plan.store_url)
    spec = plan.spec()
    backend = run_labelled(plan.sandbox)
    if plan.run_id:
        backend = backend.model_copy(update={"labels": {**backend.labels, FLOW_RUN_LABEL: plan.run_id[:64]}})

    def on_trial(record: trial.TrialResult) -> None:
        store.record_trial(TrialRecord.from_trial(record, CURATE_JOB_ID, None, plan.run_id,
                                                batch_id=plan.batch_id))
        stored.append(record.trial_id)

    def validate(instance_id: str, run_key: str) -> trial.ValidationOutcome:
        row, command, settings = plan.rows[instance_id], plan.test_commands[instance_id], plan.validation
        if parser := plan.log_parsers.get(instance_id):  # the repository's own log parser replaces the run's
            settings = settings.model_copy(update={"checks": settings.checks.model_copy(
                update={"log_parser": parser})})
        if plan.ray is not None:
            outcome = dispatch.validate_on_ray(plan.ray, row, row.image_ref, command,
                                               timeout_s=settings.verifier_timeout_s, spec=spec, run_key=run_key,
                                               checks=settings.checks, backend=backend)
            for record in outcome.trials:
                on_trial(record)
            return outcome
        return trial.validate_candidate(row, row.image_ref, command, timeout_s=settings.verifier_timeout_s, spec=spec,
                                        run_key=run_key, checks=settings.checks, on_trial=on_trial, backend=backend)

    return validate


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="validate-batch-{plan.batch_id}")
def validate_batch(plan: batch_run.BatchJob, progress: BatchProgress | None = None) -> BatchVerdicts:
    """Validate one batch of a ``curate`` run in this task's threads (``plan.concurrency`` at a time, longest
    recorded validation first): each trial and verdict stored as it ends, then the batch row. Nothing cached or
    persisted: a resumed run validates only what has no verdict, under the same trial ids."""
    store = shared_store(plan.store_url)
    stored: list[str] = []  # the trial ids stored (list.append is atomic: the pool's threads append)
    job = plan.model_copy(update={"ids": longest_first(plan.ids, store.validation_seconds(plan.ids)),
                                  "first_attempt": run_reads.voided_nop_attempts(store.engine, plan.ids)})
    shown_at = [time.monotonic()]

    def on_finished(finished: int) -> None:
        if progress is not None and time.monotonic() - shown_at[0] >= PROGRESS_UPDATE_S:
            update_progress_artifact(progress.artifact_id, progress=100.0 * (progress.done + finished) / progress.total)
            shown_at[0] = time.monotonic()

    verdicts = {verdict.instance_id: verdict for verdict in batch_run.run_batch(
        job, _validator(plan, stored), lambda verdict, _outcome: store.record_task(verdict), on_finished)}
    store.record_batch(BatchRecord(batch_id=plan.batch_id, kind=CURATE_JOB_ID, instance_ids=plan.ids,
                                   concurrency=plan.concurrency, run_id=plan.run_id))
    return BatchVerdicts(tasks=[verdicts[i] for i in plan.ids], trials=len(stored))


@task(cache_policy=RESUMABLE)
def freeze_dataset(name: str, accepted: list[freeze.TaskRef], quotas: freeze.SplitQuotas, seed: int,
                   out_dir: Path, extra_inputs: JSONObject,
                   bundle_tasks: list[bundle.BundleTask] | None = None) -> freeze.FreezeManifest:
    """Select the splits, write the freeze manifest (identical again: a no-op) and its export bundle (HF ``datasets``
    folder + deterministic tarball + sidecar) of ``bundle_tasks`` (None: ids and repositories); the manifest with
    ``bundle_path`` / ``bundle_sha256`` set. Raises PreflightError: the quotas are not met; FreezeConflictError: the
    manifest or bundle of ``name`` exists with other content."""
    selection = freeze.select_splits(accepted, quotas, seed)
    if not selection.ready:
        raise PreflightError(f"freeze {name!r} is not ready: {freeze.unmet_text(selection.unmet)}")
    manifest = freeze.write_freeze(name, selection, quotas, seed, out_dir, extra_inputs)
    rows = bundle_tasks if bundle_tasks is not None else [
        bundle.BundleTask(instance_id=t.instance_id, repo=t.repo) for t in accepted]
    return bundle.with_bundle(manifest, bundle.write_bundle(manifest, rows, out_dir))


@io_task()
def accepted_for_freeze(instance_ids: list[str] | None) -> list[bundle.BundleTask]:
    """The accepted tasks the store records (among ``instance_ids`` when given) as export bundle rows, with the
    image digest the store records (or None); in instance id order."""
    store = shared_store(settings.store_url())  # scoped reads: the ids asked for, the images they name
    rows = (store.accepted_tasks() if instance_ids is None
            else list(store.tasks_by_id(instance_ids, status="accepted").values()))
    digests = store.image_digests([t.image_ref for t in rows if t.image_ref])
    return [bundle.BundleTask(instance_id=t.instance_id, repo=t.repo, FAIL_TO_PASS=t.FAIL_TO_PASS,
                              PASS_TO_PASS=t.PASS_TO_PASS, image_ref=t.image_ref,
                              image_digest=digests.get(t.image_ref) if t.image_ref else None,
                              patch_sha256=t.patch_sha256, patch=t.patch) for t in rows]


@task(cache_policy=NO_CACHE)
def write_generated(path: Path, rows: list[generated.GeneratedTask]) -> Path:
    """Add ``rows`` to the generated-candidates file ``path`` atomically, keeping earlier runs' rows; the path."""
    return generated.merge_generated(path, rows)


@io_task(task_run_name="task-verdicts")
def task_verdicts(store_url: str, instance_ids: list[str]) -> dict[str, TaskRecord]:
    """The task row of each of ``instance_ids`` as the store holds it now, in the order given. Raises InputError: an id
    the store has no task row for (up to 10 named)."""
    rows = shared_store(store_url).tasks_by_id(instance_ids)  # primary-key reads of these ids alone
    missing = sorted(set(instance_ids) - set(rows))
    if missing:
        raise InputError(f"the store holds no task row for {len(missing)} id(s): {', '.join(missing[:10])}")
    return {iid: rows[iid] for iid in instance_ids}


@task(cache_policy=NO_CACHE)
def keep_freeze_inputs(name: str, out_dir: Path, inputs: JSONObject) -> Path:
    """Write the inputs that made freeze ``name`` beside its manifest (kept if already there); the path."""
    return freeze.record_freeze_inputs(name, out_dir, inputs)


@io_task()
def available_images(refs: list[str]) -> list[str]:
    """Which image references exist (one ``skopeo list-tags`` per registry repository, podman for local names); sorted.
    Raises RegistryUnavailableError: a registry does not answer (transient: retried)."""
    return images.available(refs)


CurationState = run_reads.CurationState
"""What the store says about a curate run's candidates."""


@io_task(task_run_name="curation-state", persist_result=False)
def curation_state(store_url: str, instance_ids: list[str]) -> CurationState:
    """The accepted, processed and per-repository accepted tasks among a run's ``instance_ids``, read now by
    primary key (the cost is the run's, not the store's)."""
    return run_reads.curation_state(shared_store(store_url).engine, instance_ids)


class Registration(BaseModel):
    """What :func:`register_candidates` recorded: ``new`` candidates the store did not know, the run's distinct
    ``candidates``, its ``candidate_set`` batch id (what a freeze-ready event names) and that set's sha256."""

    model_config = ConfigDict(frozen=True)

    new: int
    candidates: int
    candidate_set: str
    candidates_sha256: str


@io_task(persist_result=False)
def register_candidates(store_url: str, rows: list[CandidateTask | GeneratedTask], run_id: str) -> Registration:
    """Record the rows the store does not know (status ``candidate``) in one ``load`` batch named by the ids'
    digest (a re-run upserts it), and the run's candidate set; only the rows' own ids are looked up."""
    from forgeflow.common.fsutil import sha256_json
    from forgeflow.ledger.records import BatchRecord

    store = shared_store(store_url)
    ids = sorted(r.instance_id for r in rows)
    known = run_reads.known_instance_ids(store.engine, ids)
    new_rows = [TaskRecord(instance_id=r.instance_id, repo=r.repo, patch=r.patch, image_ref=r.image_ref,
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
    """The sorted instance ids of the candidate set a freeze-ready event names (what the freeze freezes among). Raises
    InputError: no such candidate set, or its ids do not match its digest."""
    return run_reads.candidate_set_ids(shared_store(settings.store_url()).engine, candidate_set)


@task(cache_policy=NO_CACHE, task_run_name="load-task-rows-{stage}")
def load_rows(source: TaskSource, default_generated: Path, stage: str) -> TaskRows:
    """The task rows of ``source`` (``stage`` names the caller in errors); not cached (files change). Raises InputError:
    as :func:`forgeflow.curation.task_rows.load_task_rows`."""
    return source.load(default_generated, stage)


@task(cache_policy=NO_CACHE, task_run_name="plan-recovery")
def plan_trial_recovery(store_url: str, request: recovery.RecoveryRequest) -> recovery.RecoveryPlan:
    """:func:`forgeflow.curation.recovery.plan_recovery` of ``request`` (reads only). Raises as that function
    (unknown ids, a bad selection)."""
    return recovery.plan_recovery(shared_store(store_url), request)


@task(cache_policy=NO_CACHE, task_run_name="apply-recovery")
def apply_trial_recovery(store_url: str, plan: recovery.RecoveryPlan, backup_dir: Path,
                         run_id: str) -> tuple[recovery.RecoveryResult, str]:
    """Apply ``plan`` (backup, void, requeue, counts verified in one transaction; not retried: a second attempt would
    plan against a changed store) and write its markdown audit beside the backup; (result, audit). Raises
    CountMismatchError: the store changed under the recovery (rolled back, nothing written)."""
    from forgeflow.common.fsutil import atomic_write_text

    result = recovery.apply_recovery(shared_store(store_url), plan, backup_dir, run_id=run_id)
    audit = recovery.render_audit(plan, result)
    if result.backup_path is not None:
        atomic_write_text(result.backup_path.with_suffix(".md"), audit)
    return result, audit
