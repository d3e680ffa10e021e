"""The ``curate`` flow (validate batches until the dataset is freeze-ready) and the ``recover`` flow.

``curate``: before every batch the freeze check (the very selection the freeze uses) runs on this run's
accepted candidates. Ready: emit ``forgeflow.dataset.freeze-ready`` and stop. Not ready: validate one
selected batch in ONE task run (NOP/Oracle, ``settings.concurrency`` at a time; an infrastructure error is
retried up to ``settings.max_retries`` times; each trial and verdict stored as it ends). No per-candidate task
run: ~2 graph nodes per batch (30,000 candidates in batches of 50: ~1,200 nodes, under the UI's 10,000;
``python -m benchmarks.scale_curate``). Nothing is cached per validation: a killed run resumed validates only
the rest, under the same deterministic trial ids (tests/flows/test_curate_kill.py).

``recover``: :mod:`forgeflow.curation.recovery` behind a flow (dry run by default), with an audit artifact.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.events import emit_event
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote
from pydantic import Field

from flows.stagekit import StageParams, param_error
from forgeflow.common import settings as store_settings
from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import sha256_bytes, sha256_json
from forgeflow.common.settings import apply_container_env, home_dir
from forgeflow.curation.batch_run import BatchJob
from forgeflow.curation.candidates import to_candidate_refs
from forgeflow.curation.curate_result import CurateResult
from forgeflow.curation.curate_settings import CurateSettings
from forgeflow.curation.freeze import (
    SPLITS,
    FreezeName,
    SplitQuotas,
    TaskRef,
    feasibility_text,
    freeze_ready,
    quota_feasibility,
    unmet_text,
)
from forgeflow.curation.generated import GENERATED_FILE
from forgeflow.curation.recovery import (
    RecoveryRequest,
    RecoveryResult,
    render_plan,
)
from forgeflow.curation.selection import BatchSelector
from forgeflow.curation.task_rows import TaskSource
from forgeflow.ledger.records import TaskRecord
from forgeflow.ledger.store import masked_url
from forgeflow.sandbox import dispatch
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.limits import SandboxLimits
from tasks import curation as curate_tasks
from tasks.common import markdown_artifact, sweep_trial_sandboxes, table_artifact, trial_dispatcher

FREEZE_READY_EVENT = "forgeflow.dataset.freeze-ready"
DEFAULT_QUOTAS = SplitQuotas(train=350, validation=75, test=75, max_per_repo=20, min_repos=70)
JOB_ID = "curate"


class CurateParams(StageParams):
    """The ``curate`` flow's parameters (the curate deployment's defaults are the model's)."""

    source: TaskSource = Field(TaskSource(), description="the candidates: candidates_path, dataset or "
                               "generated_path (default $FORGEFLOW_HOME/demo/candidates.jsonl), test_commands and "
                               "test_specs per repository")
    quotas: SplitQuotas = Field(DEFAULT_QUOTAS, description="what the freeze needs: minimum tasks per split, at "
                                "most max_per_repo tasks per repository, at least min_repos repositories")
    settings: CurateSettings = Field(CurateSettings(), description="how the run validates: batch_size (candidates), "
                                     "concurrency (validations at once), max_retries, verifier_timeout_s (seconds), "
                                     "memory_mb (MiB) and cpus (none: the sandbox block's), seed, checks")
    freeze_name: FreezeName | None = Field(None, description="the name the freeze-on-ready automation freezes under; "
                                    "None: curate- + 12 hex digits of the sha256 of (candidate ids, quotas, seed)")
    sandbox: str | None = Field(None, min_length=1, description="a forgeflow-sandbox block: every NOP/Oracle trial "
                                "runs on its backend, with its memory and CPUs where settings leaves them none; "
                                "None: podman")
    dispatcher: str | None = Field(None, min_length=1, description="a forgeflow-dispatcher block: ray runs each "
                                   "validation as a Ray task on a sandbox node; None or in-process: here")
    instance_ids: tuple[str, ...] | None = Field(None, min_length=1, description="validate only these candidates "
                                                 "of source (each must be there); None: every candidate")
    emit_freeze_ready: bool = Field(True, description="emit the forgeflow.dataset.freeze-ready event when ready "
                                    "(the freeze-on-ready automation freezes on it); false: the caller freezes "
                                    "itself (the lifecycle)")


def freeze_ready_payload(store_url: str, freeze_name: str, quotas: SplitQuotas, seed: int,
                         registered: curate_tasks.Registration, run_id: str, counts: dict[str, int], accepted: int,
                         batches: int) -> dict[str, Any]:
    """The freeze-ready event's payload: a reference to the run's candidates, never the ids themselves.

    Its size does not grow with the run (Prefect refuses an event above ``PREFECT_EVENTS_MAXIMUM_SIZE_BYTES``);
    ``candidate_set`` is what the freeze-on-ready automation hands the freeze flow.
    """
    return {"store_url": store_url, "freeze_name": freeze_name, "quotas": quotas.model_dump(), "seed": seed,
            "run_id": run_id, "candidate_set": registered.candidate_set,
            "candidates_sha256": registered.candidates_sha256, "candidates": registered.candidates,
            "counts": counts, "accepted": accepted, "batches": batches}


def _only(rows: list[Any], instance_ids: tuple[str, ...] | None, source: str) -> list[Any]:
    """The rows whose instance id is in ``instance_ids`` (all for None), in order; InputError names unknown ids."""
    if instance_ids is None:
        return rows
    wanted = set(instance_ids)
    missing = sorted(wanted - {row.instance_id for row in rows})
    if missing:
        raise InputError(f"params.instance_ids: {len(missing)} id(s) not among the candidates of {source}: "
                         f"{', '.join(missing[:10])}")
    return [row for row in rows if row.instance_id in wanted]


def _blocks(sandbox: str | None,
            dispatcher: str | None) -> tuple[SandboxLimits | None, SandboxTarget, RayPlacement | None]:
    """The blocks loaded before anything runs: the sandbox block's limits (None: no block) and target (none:
    podman), the dispatcher's placement (or None).

    Raises:
        InputError: a missing or non-sandbox ``sandbox`` block, a missing ``dispatcher`` (the field named).
    """
    try:
        limits, target = curate_tasks.sandbox_block(sandbox) if sandbox is not None else (None, SandboxTarget())
    except InputError as exc:
        raise param_error(exc, "sandbox") from None
    try:
        return limits, target, trial_dispatcher(dispatcher) if dispatcher is not None else None
    except InputError as exc:
        raise param_error(exc, "dispatcher") from None


@flow(name="curate", log_prints=True,
      on_cancellation=[sweep_trial_sandboxes("params.sandbox", "params.dispatcher")],
      on_crashed=[sweep_trial_sandboxes("params.sandbox", "params.dispatcher")])
def curate(params: CurateParams = CurateParams()) -> CurateResult:
    """Validate candidate batches until the accepted tasks meet ``params.quotas`` (or none is left).

    Only this run's candidates count; the quotas are first checked against the candidates themselves (e.g. 2
    repositories cannot fill 3 repository-disjoint splits).

    Args:
        params: The run's inputs; each field is described in the run form.

    Raises:
        InputError: malformed rows, a repo without a test command, no candidates file, more than one source,
            an invalid freeze name, a missing sandbox block or one that is not a sandbox backend.
        PreflightError: the candidates cannot meet the quotas even if every one were accepted (nothing validated).
    """
    source, quotas, settings, freeze_name = params.source, params.quotas, params.settings, params.freeze_name
    limits, target, ray_placement = _blocks(params.sandbox, params.dispatcher)
    logger = get_run_logger()
    apply_container_env()
    run_id = str(flow_run.get_id() or "")
    store_url = store_settings.store_url()
    loaded = curate_tasks.load_rows(source, home_dir() / "demo" / GENERATED_FILE, "curate")
    rows = _only(loaded.rows, params.instance_ids, loaded.source)
    by_id = {row.instance_id: row for row in rows}
    per_repo = Counter(row.repo for row in rows)
    unmet = quota_feasibility(per_repo, quotas)
    if unmet:
        raise PreflightError(f"curate: {len(rows)} candidates from {len(per_repo)} repositories cannot meet the quotas "
                             f"even if every one is accepted (nothing validated): {feasibility_text(unmet)}")
    seed = settings.seed
    digest = sha256_json({"ids": sorted(by_id), "quotas": quotas.model_dump(), "seed": seed})
    name = freeze_name or f"curate-{digest[:12]}"
    available = set(curate_tasks.available_images([row.image_ref for row in rows if row.image_ref]))
    refs = to_candidate_refs(rows, available)
    registered = curate_tasks.register_candidates(store_url, rows, run_id)
    logger.info("curate: %d candidates (%d new; candidate set %s), %d with an available image", len(rows),
                registered.new, registered.candidate_set, sum(r.image_available for r in refs))
    progress = create_progress_artifact(progress=0.0, description=f"curate: {len(rows)} candidates, batches of "
                                                                  f"{settings.batch_size}")
    run: _RunState | None = None
    try:
        batches: list[str] = []
        validated: list[str] = []
        recorded = 0
        run = _RunState(curate_tasks.curation_state(store_url, sorted(by_id)), refs, quotas, seed)
        while True:
            run.show_progress(progress, len(by_id))
            selection = run.selection()
            if selection is not None and selection.ready:
                event_id = _announce_ready(params, store_url, name, registered, run_id, selection, run, len(batches))
                return CurateResult(status="freeze-ready", batches=batches, trials_recorded=recorded,
                                    counts=selection.counts, unmet=[], event_id=event_id, freeze_name=name,
                                    validated=validated)
            ids = run.selector.select(run.per_repo, settings.batch_size)
            if not ids:
                selection = selection or run.selection(always=True)
                text = unmet_text(selection.unmet)
                logger.warning("STOPPED, NOT READY: no candidate left to validate; unmet quotas: %s", text)
                return CurateResult(status="exhausted", batches=batches, trials_recorded=recorded,
                                    counts=selection.counts, unmet=[text], event_id=None, freeze_name=name,
                                    validated=validated)
            batch_id = f"curate-{sha256_json({'seed': seed, 'ids': sorted(ids)})[:16]}"
            plan = BatchJob(
                batch_id=batch_id, store_url=store_url, run_id=run_id, ids=ids, rows={i: by_id[i] for i in ids},
                test_commands={i: loaded.test_commands[i] for i in ids},
                log_parsers={i: loaded.log_parsers[i] for i in ids if loaded.log_parsers.get(i)},
                concurrency=settings.concurrency, max_retries=settings.max_retries,
                validation=settings.validation(limits), sandbox=target, ray=ray_placement)
            # quote: Prefect would otherwise walk the plan's rows (every candidate's patch) looking for futures
            out = curate_tasks.validate_batch(quote(plan), curate_tasks.BatchProgress(
                artifact_id=progress, done=len(run.processed), total=len(by_id)))
            run.add(ids, out.tasks)
            recorded += out.trials
            batches.append(batch_id)
            validated.extend(ids)
            table_artifact(f"curate-{batch_id[-16:].lower()}", [
                {"instance_id": t.instance_id, "status": t.status, "reason": t.reason,
                 "FAIL_TO_PASS": len(t.FAIL_TO_PASS)} for t in out.tasks], f"curate batch {batch_id}")
            logger.info("batch %s: %d candidates, %d accepted; %d of the run's %d accepted so far (the quotas need "
                        ">= %d)", batch_id, len(ids), sum(t.status == "accepted" for t in out.tasks),
                        len(run.accepted), len(by_id), run.needed)
    finally:  # a driver outlived by its Ray cluster is ended by Ray: leave it now
        if run is not None:  # the last count, whatever the throttle held back
            run.show_progress(progress, len(by_id), force=True)
        if ray_placement is not None:
            dispatch.disconnect()


class _RunState:
    """A ``curate`` run's candidates: what the store held at the start (read once), plus each batch's verdicts.

    ``needed`` is the quotas' task total: the O(accepted) freeze check runs only from there on.
    """

    def __init__(self, state: curate_tasks.CurationState, refs: list[Any], quotas: SplitQuotas, seed: int) -> None:
        """Start from the store's ``state`` of the run's candidates ``refs``."""
        self.processed = set(state.processed)
        self.accepted = {task.instance_id: task for task in state.accepted}
        self.per_repo = dict(state.accepted_per_repo)
        self.selector = BatchSelector(refs, seed)
        self.selector.mark_processed(self.processed)
        self.quotas, self.seed = quotas, seed
        self.needed = sum(quotas.target(split) for split in SPLITS)
        self._shown_at = float("-inf")

    def show_progress(self, artifact_id: Any, total: int, force: bool = False) -> None:
        """Move the progress artifact: at most every :data:`tasks.curation.PROGRESS_UPDATE_S`, or now with ``force``."""
        now = time.monotonic()
        if force or now - self._shown_at >= curate_tasks.PROGRESS_UPDATE_S:
            update_progress_artifact(artifact_id, progress=100.0 * len(self.processed) / total)
            self._shown_at = now

    def selection(self, always: bool = False) -> Any:
        """The freeze check on the accepted tasks; None while fewer than :attr:`needed`, unless ``always``."""
        if not always and len(self.accepted) < self.needed:
            return None
        return freeze_ready(sorted(self.accepted.values(), key=lambda t: t.instance_id), self.quotas, self.seed)

    def add(self, ids: list[str], verdicts: list[TaskRecord]) -> None:
        """Count a batch: its ``ids`` processed, its accepted ``verdicts`` accepted."""
        self.selector.mark_processed(ids)
        for verdict in verdicts:
            self.processed.add(verdict.instance_id)
            if verdict.status == "accepted" and verdict.instance_id not in self.accepted:
                self.accepted[verdict.instance_id] = TaskRef(instance_id=verdict.instance_id, repo=verdict.repo)
                self.per_repo[verdict.repo] = self.per_repo.get(verdict.repo, 0) + 1


def _announce_ready(params: CurateParams, store_url: str, name: str, registered: curate_tasks.Registration,
                    run_id: str, selection: Any, run: _RunState, batches: int) -> str | None:
    """Log the freeze-ready selection and emit the event unless ``emit_freeze_ready`` is false; its id or None."""
    quotas, seed = params.quotas, params.settings.seed
    resource_id = (f"forgeflow.store.{sha256_bytes(store_url.encode())[:12]}"
                   f".quotas.{sha256_json(quotas.model_dump())[:12]}")
    payload = freeze_ready_payload(masked_url(store_url), name, quotas, seed, registered, run_id, selection.counts,
                                   len(run.accepted), batches)
    event = emit_event(FREEZE_READY_EVENT, resource={"prefect.resource.id": resource_id,
                                                     "prefect.resource.name": "curated dataset"},
                       payload=payload) if params.emit_freeze_ready else None
    get_run_logger().info("FREEZE READY: %s over %d repos after %d batch(es); %s",
                          ", ".join(f"{s} {n}/{quotas.target(s)}" for s, n in selection.counts.items()),
                          sum(len(r) for r in selection.repos_per_split.values()), batches,
                          f"event {FREEZE_READY_EVENT} on {resource_id}" if params.emit_freeze_ready
                          else "no event (the caller freezes)")
    return str(event.id) if event else None


@flow(name="recover", log_prints=True)
def recover(params: RecoveryRequest) -> RecoveryResult:
    """Void exactly the trials an infrastructure fault broke and requeue their tasks.

    Select by ``batch_ids`` and/or ``trial_ids``, or by ``exception_type`` with BOTH ``since`` and ``until``.
    Applied: the affected rows are backed up (JSON + ``.sha256``), voided/requeued in one transaction with the
    counts verified, and an audit artifact written. ``include_rejections`` also requeues the rejected tasks whose
    every live NOP/Oracle trial is selected; accepted tasks stay.

    Args:
        params: the trials to void and requeue (batch ids, trial ids, or an exception type in a window); dry run first.

    Raises:
        InputError: a bad selection, unknown ids.
        CountMismatchError: the store changed under the recovery (rolled back).
    """
    logger = get_run_logger()
    dry_run, backup_dir = params.dry_run, params.backup_dir
    store_url = store_settings.store_url()
    plan = curate_tasks.plan_trial_recovery(store_url, params)
    text = render_plan(plan)
    logger.info("%s", text)
    if dry_run:
        markdown_artifact("recover-dry-run", f"```\n{text}\n```\n", "recover: what would be voided/requeued")
        return RecoveryResult.listing(plan)
    result, audit = curate_tasks.apply_trial_recovery(store_url, plan, backup_dir or home_dir() / "recovery",
                                                      str(flow_run.get_id() or ""))
    markdown_artifact("recover-audit", audit, f"recovery {result.recovery_id}")
    logger.info("recovered: %d trial(s) voided, %d task(s) requeued; backup %s (sha256 %s)",
                result.voided, result.requeued, result.backup_path, result.backup_sha256)
    return result
