"""Prefect tasks of curation: candidate generation, which task images exist, NOP/Oracle validation
(the one task the lifecycle's validate stage and the ``curate`` flow share), freeze."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE
from pydantic import BaseModel, ConfigDict

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.curation import bugs, bundle, freeze, generated, run_reads
from forgeflow.evaluation.canary import trial_row
from forgeflow.ledger.records import TaskRecord
from forgeflow.ledger.store import Store
from forgeflow.registry import images
from forgeflow.sandbox import dispatch, trial
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.kubernetes_manifests import FLOW_RUN_LABEL
from tasks.common import (
    RESUMABLE,
    TRANSIENT_RETRY_DELAYS_S,
    load_block,
    retry_on_transient,
    run_labelled,
    shared_store,
)


@task(cache_policy=RESUMABLE, task_run_name="candidates-{repo}")
def generate_candidates(repo: str, checkout_dir: Path, source_dir: str, max_candidates: int,
                        seed: int) -> list[bugs.Candidate]:
    """SWE-smith procedural candidates for one project, statically checked (patch applies)."""
    return bugs.generate_candidates(repo, checkout_dir, source_dir, max_candidates, seed)


class TrialSink(BaseModel):
    """Where :func:`validate_candidate` stores each trial the moment it ends (a store row per trial,
    upserted by trial id: a killed validation loses no finished trial).

    Attributes:
        store_url: the store's SQLAlchemy URL.
        job_id: the trials' job id (e.g. ``curate``), or None.
        batch_id: the trials' batch id, or None.
        run_id: the Prefect flow run that ran them.
    """

    model_config = ConfigDict(frozen=True)

    store_url: str
    job_id: str | None = None
    batch_id: str | None = None
    run_id: str | None = None


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


_VALIDATION_CACHE = (INPUTS - "sink" - "ray") + TASK_SOURCE
"""RESUMABLE without the sink and the Ray placement: where trials are recorded, or on which node
they run, does not change the validation."""


@task(cache_policy=_VALIDATION_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, task_run_name="validate-{candidate.instance_id}-{run_key}")
def validate_candidate(candidate: trial.BugTask, image_ref: str, image_digest: str | None, test_command: str,
                       settings: trial.ValidationSettings, run_key: str = "validate",
                       sink: TrialSink | None = None, sandbox: SandboxChoice | None = None,
                       ray: RayPlacement | None = None) -> trial.ValidationOutcome:
    """NOP then Oracle runs of one candidate in no-network containers of its task image
    (:func:`forgeflow.sandbox.trial.validate_candidate`); the one validation task of the lifecycle's
    validate stage and of the ``curate`` flow.

    Args:
        candidate: A :class:`forgeflow.curation.bugs.Candidate`, :class:`forgeflow.curation.candidates.CandidateTask`
            or :class:`forgeflow.curation.generated.GeneratedTask` (its ``instance_id`` and bug ``patch``).
        image_ref: The task image (local name or ``host:port/repo:tag``).
        image_digest: The image's digest or id when known (keys the cache: a rebuilt image under
            the same name is validated afresh); None when ``image_ref`` is the identity.
        test_command: The task's test command, run in ``/testbed``.
        settings: The verifier's limit per test run (seconds), the sandbox memory (MiB) and the Oracle
            repeats, flaky policy and log parser (:class:`forgeflow.sandbox.trial.ValidationSettings`;
            part of the cache key).
        run_key: Goes into the trial ids and the cache key. The lifecycle keeps the default; the
            ``curate`` flow passes ``curate-a<N>`` (N = the instance's earlier NOP trials, void ones
            included), so a task requeued by ``recover`` is validated afresh with new trial ids
            (the voided rows stay for audit), while a killed-and-resumed batch reuses the same key:
            Prefect's cache answers and the store upserts the same trial ids (nothing duplicated).
        sink: Where each trial is stored as it ends (not part of the cache key); None: the caller
            records the outcome.
        sandbox: The sandbox backend and its limits (a ``forgeflow-sandbox`` block's,
            :func:`sandbox_choice`); its ``memory_mb`` replaces ``settings.memory_mb``. None: podman, 1 CPU.
        ray: run the validation as a Ray task on a sandbox node of this cluster
            (:func:`forgeflow.sandbox.dispatch.validate_on_ray`); its trials are recorded here once it
            returns, each with the ``node_id`` it ran on. None: in this process.

    Returns:
        The outcome. Infrastructure failures come back as trials with an exception type (never
        a rejection), so one broken trial never sinks the batch.

    Raises:
        InputError: bad input (fails only this task run, never retried). A transient
            :class:`~forgeflow.common.errors.InfraError` escaping the trial runner is retried by Prefect
            (twice by default; callers override with ``with_options(retries=...)``).
    """
    on_trial = None
    if sink is not None:
        store = shared_store(sink.store_url)

        def on_trial(record: trial.TrialResult) -> None:
            store.record_trial(trial_row(record, sink.job_id, None, sink.run_id, batch_id=sink.batch_id))

    spec = SandboxSpec(memory_mb=settings.memory_mb) if sandbox is None else SandboxSpec(
        memory_mb=sandbox.memory_mb, cpus=sandbox.cpus)
    backend = run_labelled(sandbox.target if sandbox is not None else "podman")
    if sink is not None and sink.run_id:  # a curate batch's subflow: labelled with the curate run, swept with it
        backend = backend.model_copy(update={"labels": {**backend.labels, FLOW_RUN_LABEL: sink.run_id[:64]}})
    timeout_s, checks = settings.verifier_timeout_s, settings.checks
    if ray is not None:
        outcome = dispatch.validate_on_ray(ray, candidate, image_ref, test_command, timeout_s=timeout_s, spec=spec,
                                           run_key=run_key, checks=checks, backend=backend)
        for record in outcome.trials if on_trial is not None else ():
            on_trial(record)
        return outcome
    return trial.validate_candidate(candidate, image_ref, test_command, timeout_s=timeout_s, spec=spec,
                                    run_key=run_key, checks=checks, on_trial=on_trial, backend=backend)


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


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient)
def accepted_for_freeze(instance_ids: list[str] | None) -> list[bundle.BundleTask]:
    """The accepted tasks the store records (``settings.store_url()``, upgraded first), among
    ``instance_ids`` when given, as rows of a freeze's export bundle: instance id, repository,
    FAIL_TO_PASS / PASS_TO_PASS, image reference and the digest the store records for it (None when
    it records none), patch and its sha256. Never cached: the store is read as it is now.

    Returns:
        One row per accepted task, in the store's order (instance id).
    """
    store = Store()
    try:
        store.upgrade()
        wanted = set(instance_ids) if instance_ids is not None else None
        rows = [t for t in store.accepted_tasks() if wanted is None or t.instance_id in wanted]
        digests = {image.ref: image.digest for image in store.images()}
    finally:
        store.dispose()
    return [bundle.BundleTask(instance_id=t.instance_id, repo=t.repo, fail_to_pass=t.fail_to_pass,
                              pass_to_pass=t.pass_to_pass, image_ref=t.image_ref,
                              image_digest=digests.get(t.image_ref) if t.image_ref else None,
                              patch_sha256=t.patch_sha256, patch=t.patch) for t in rows]


@task(cache_policy=NO_CACHE)
def write_generated(path: Path, rows: list[generated.GeneratedTask]) -> Path:
    """Add ``rows`` to the generated-candidates file ``path`` (what ``curate`` and the canary read),
    atomically, keeping earlier runs' rows (:func:`forgeflow.curation.generated.merge_generated`); the path."""
    return generated.merge_generated(path, rows)


@task(cache_policy=NO_CACHE)
def recorded_validation_seconds(store_url: str, instance_ids: list[str]) -> dict[str, float]:
    """How long each candidate's last recorded validation took (seconds; candidates never validated are
    absent), read from the store at ``store_url``: what orders a validation window longest first."""
    store = Store(store_url)
    try:
        return store.validation_seconds(instance_ids)
    finally:
        store.dispose()


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, task_run_name="task-verdicts")
def task_verdicts(store_url: str, instance_ids: list[str]) -> dict[str, TaskRecord]:
    """Each of ``instance_ids``' task row in the store at ``store_url`` (``status`` candidate / accepted /
    rejected / error, ``reason``, ``fail_to_pass`` / ``pass_to_pass``), read now (never cached), in the order given.

    Raises:
        InputError: an id the store has no task row for (up to 10 named).
    """
    store = shared_store(store_url)
    wanted = set(instance_ids)
    rows = {t.instance_id: t for t in store.tasks() if t.instance_id in wanted}
    missing = sorted(wanted - set(rows))
    if missing:
        raise InputError(f"the store holds no task row for {len(missing)} id(s): {', '.join(missing[:10])}")
    return {iid: rows[iid] for iid in instance_ids}


@task(cache_policy=NO_CACHE)
def keep_freeze_inputs(name: str, out_dir: Path, inputs: dict) -> Path:
    """Write the inputs that made freeze ``name`` beside its manifest (kept if already there);
    :func:`forgeflow.curation.freeze.record_freeze_inputs`. Returns the path."""
    return freeze.record_freeze_inputs(name, out_dir, inputs)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient)
def available_images(refs: list[str]) -> list[str]:
    """Which image references exist (:func:`forgeflow.registry.images.available`: one ``skopeo list-tags``
    per registry repository, ``podman image exists`` for local names and digest refs); sorted.

    Raises:
        RegistryUnavailableError: a registry does not answer (transient: retried).
    """
    return images.available(refs)


CurationState = run_reads.CurationState
"""What the store says about a curate run's candidates (:class:`forgeflow.curation.run_reads.CurationState`)."""


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, task_run_name="curation-state", persist_result=False)
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


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, persist_result=False)
def register_candidates(store_url: str, rows: list[Any], run_id: str) -> Registration:
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


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, persist_result=False)
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


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, persist_result=False)
def voided_attempts(store_url: str, instance_ids: list[str]) -> dict[str, int]:
    """Instance id -> how many of its NOP trials ``recover`` voided: where its attempt numbers continue, so a
    requeued task gets new trial ids while a killed run's live trials keep theirs (one grouped count per chunk
    of ids, :func:`forgeflow.curation.run_reads.voided_nop_attempts`)."""
    return run_reads.voided_nop_attempts(shared_store(store_url).engine, instance_ids)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S[:2],
      retry_condition_fn=retry_on_transient, task_run_name="record-batch-{batch.batch_id}")
def record_batch(store_url: str, batch: Any, trials: list[Any], tasks: list[Any]) -> int:
    """Upsert a batch's trials, its tasks' statuses and the batch row in one transaction
    (:meth:`forgeflow.ledger.store.Store.record_batch_results`; a retry writes the same rows). Returns the
    number of trials."""
    shared_store(store_url).record_batch_results(batch, trials, tasks)
    return len(trials)


@task(cache_policy=NO_CACHE, task_run_name="load-task-rows-{stage}")
def load_rows(source: Any, default_generated: Path, stage: str) -> Any:
    """The task rows of ``source`` (:class:`forgeflow.curation.task_rows.TaskSource`:
    :meth:`~forgeflow.curation.task_rows.TaskSource.load`; ``stage`` names the caller in errors). Not cached:
    the file or dataset may change between runs.

    Raises:
        InputError: as :func:`forgeflow.curation.task_rows.load_task_rows`.
    """
    return source.load(default_generated, stage)


@task(cache_policy=NO_CACHE, task_run_name="plan-recovery")
def plan_trial_recovery(store_url: str, request: Any) -> Any:
    """:func:`forgeflow.curation.recovery.plan_recovery` of ``request`` on the store (upgraded first; reads only,
    never cached). Raises as that function (unknown ids, a bad selection)."""
    from forgeflow.curation.recovery import plan_recovery

    store = Store(store_url)
    try:
        store.upgrade()
        return plan_recovery(store, request)
    finally:
        store.dispose()


@task(cache_policy=NO_CACHE, task_run_name="apply-recovery")
def apply_trial_recovery(store_url: str, plan: Any, backup_dir: Path, run_id: str) -> tuple[Any, str]:
    """:func:`forgeflow.curation.recovery.apply_recovery` of ``plan`` (backup, void, requeue, counts verified in
    one transaction; not retried: a second attempt would plan against a changed store), then the markdown audit
    (:func:`~forgeflow.curation.recovery.render_audit`) written atomically beside the backup (``.md``).

    Returns:
        ``(RecoveryResult, audit markdown)``.

    Raises:
        CountMismatchError: the store changed under the recovery (rolled back, nothing written).
    """
    from forgeflow.common.fsutil import atomic_write_text
    from forgeflow.curation.recovery import apply_recovery, render_audit

    store = Store(store_url)
    try:
        result = apply_recovery(store, plan, backup_dir, run_id=run_id)
    finally:
        store.dispose()
    audit = render_audit(result)
    if result.backup_path is not None:
        atomic_write_text(result.backup_path.with_suffix(".md"), audit)
    return result, audit
