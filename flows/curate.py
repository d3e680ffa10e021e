"""The ``curate`` flow (validate batches until the dataset is freeze-ready) and the ``recover`` flow.

``curate``: takes one parameter model, ``params`` (:class:`CurateParams`, a
:class:`flows.stagekit.StageParams`), whose fields group the task rows (``tasks``,
:class:`forgeflow.curation.task_rows.TaskSource`), the freeze ``quotas`` and how it validates
(``settings``, :class:`forgeflow.curation.curate_settings.CurateSettings`), beside the freeze name and the
sandbox and dispatcher blocks by name. It reads candidates in its own JSONL format
(``tasks.candidates_path``, :func:`forgeflow.curation.candidates.load_candidates`), a HF split
(``tasks.dataset``) or, by default, the file the lifecycle's generate/prewarm stages wrote
(``tasks.generated_path``, default ``$FORGEFLOW_HOME/demo/candidates.jsonl``,
:mod:`forgeflow.curation.generated`). Before every batch the
freeze check (:func:`forgeflow.curation.freeze.freeze_ready`, the very selection the freeze uses) runs on the store's
accepted tasks (read for this run's candidates only: :mod:`forgeflow.curation.run_reads`). Ready: emit the
Prefect event ``forgeflow.dataset.freeze-ready`` (its payload names the run's candidate set recorded in the
store, :func:`freeze_ready_payload`: a fixed size at any number of candidates) and stop. Not ready: pick
one batch with :func:`forgeflow.curation.selection.select_batch` and validate it in its own subflow run,
``curate-batch`` named by the batch id (:func:`_curate_batch`: one run graph and one progress bar per batch,
so no run's graph grows past what the UI draws at 30,000 candidates): NOP/Oracle at most
``settings.concurrency`` at a time (an attempt that ends in an infrastructure error is tried again, up to
``settings.max_retries`` times), each trial stored as it ends, then the batch's trials, task statuses and
batch row in one transaction. No candidate left: stop, naming each unmet quota and by how much. Batch ids
and trial ids are deterministic and validations are cached on their inputs, so a killed run resumed
re-selects the same batch, gets the finished validations from Prefect's cache and upserts the same trial
ids: it loses no finished trial and duplicates none (tests/flows/test_curate_kill.py). Once a batch is
recorded its validations' cached results are deleted unless ``settings.keep_validation_results``.

``recover`` (``params``: :class:`RecoverParams`): :mod:`forgeflow.curation.recovery` behind a flow (dry run
by default), with an audit artifact.
"""

from __future__ import annotations

import queue
import time
from collections import Counter, deque
from datetime import datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.events import emit_event
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from flows.stagekit import StageParams, note_task_state
from forgeflow.common import settings as store_settings
from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import sha256_bytes, sha256_json
from forgeflow.common.settings import apply_container_env, home_dir
from forgeflow.curation.candidates import to_candidate_refs
from forgeflow.curation.curate_result import CurateResult, RecoverResult
from forgeflow.curation.curate_settings import CurateSettings
from forgeflow.curation.freeze import (
    SplitQuotas,
    feasibility_text,
    freeze_ready,
    quota_feasibility,
    unmet_text,
    validate_freeze_name,
)
from forgeflow.curation.generated import GENERATED_FILE
from forgeflow.curation.recovery import (
    RecoveryRequest,
    render_plan,
)
from forgeflow.curation.selection import longest_first, select_batch
from forgeflow.curation.task_rows import TaskSource
from forgeflow.evaluation.canary import trial_row
from forgeflow.ledger.records import BatchRecord, TaskRecord, TrialRecord
from forgeflow.ledger.store import masked_url
from forgeflow.sandbox import dispatch
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.trial import ValidationOutcome, ValidationSettings
from tasks import curation as curate_tasks
from tasks.common import markdown_artifact, sweep_trial_sandboxes, table_artifact
from tasks.curation import TrialSink, validate_candidate

FREEZE_READY_EVENT = "forgeflow.dataset.freeze-ready"
DEFAULT_QUOTAS = SplitQuotas(train=350, validation=75, test=75, max_per_repo=20, min_repos=70)
JOB_ID = "curate"


class CurateParams(StageParams):
    """The ``curate`` flow's parameters (the curate deployment's defaults are the model's).

    Attributes:
        tasks: where the candidates come from (:class:`forgeflow.curation.task_rows.TaskSource`).
        quotas: what the freeze needs (tasks per split, per repository, repositories).
        settings: how the run validates (:class:`forgeflow.curation.curate_settings.CurateSettings`).
        freeze_name: the name the freeze-on-ready automation freezes under; None: derived from the inputs.
        sandbox: a ``forgeflow-sandbox`` block every NOP/Oracle trial runs on; None: podman.
        dispatcher: a ``forgeflow-dispatcher`` block (``ray``: each validation a Ray task); None: here.
        instance_ids: only these candidates of ``tasks``; None: all of them.
        emit_freeze_ready: emit the freeze-ready event when ready (false: the caller freezes itself).
    """

    tasks: TaskSource = Field(TaskSource(), description="the candidates: candidates_path, dataset or "
                              "generated_path (default $FORGEFLOW_HOME/demo/candidates.jsonl), test_commands and "
                              "test_specs per repository")
    quotas: SplitQuotas = Field(DEFAULT_QUOTAS, description="what the freeze needs: minimum tasks per split, at "
                                "most max_per_repo tasks per repository, at least min_repos repositories")
    settings: CurateSettings = Field(CurateSettings(), description="how the run validates: batch_size (candidates), "
                                     "concurrency (validations at once), max_retries, verifier_timeout_s (seconds), "
                                     "memory_mb (MiB), seed, checks")
    freeze_name: str | None = Field(None, description="the name the freeze-on-ready automation freezes under; "
                                    "None: curate- + 12 hex digits of the sha256 of (candidate ids, quotas, seed)")
    sandbox: str | None = Field(None, min_length=1, description="a forgeflow-sandbox block: every NOP/Oracle trial "
                                "runs on its backend with its memory (MiB) and CPU limits; None: podman, "
                                "settings.memory_mb")
    dispatcher: str | None = Field(None, min_length=1, description="a forgeflow-dispatcher block: ray runs each "
                                   "validation as a Ray task on a sandbox node; None or in-process: here")
    instance_ids: tuple[str, ...] | None = Field(None, min_length=1, description="validate only these candidates "
                                                 "of tasks (each must be there); None: every candidate")
    emit_freeze_ready: bool = Field(True, description="emit the forgeflow.dataset.freeze-ready event when ready "
                                    "(the freeze-on-ready automation freezes on it); false: the caller freezes "
                                    "itself (the lifecycle)")


def freeze_ready_payload(store_url: str, freeze_name: str, quotas: SplitQuotas, seed: int,
                         registered: curate_tasks.Registration, run_id: str, counts: dict[str, int], accepted: int,
                         batches: int) -> dict[str, Any]:
    """The freeze-ready event's payload: a reference to the run's candidates, never the ids themselves, so its
    size does not grow with the run (a Prefect event is refused above ``PREFECT_EVENTS_MAXIMUM_SIZE_BYTES``).

    Returns:
        ``store_url`` (password masked), ``freeze_name``, ``quotas``, ``seed``, ``run_id`` (the curate run),
        ``candidate_set`` (the batch row holding the run's candidate ids, what the freeze-on-ready automation
        hands the freeze flow), ``candidates_sha256`` (their digest) and ``candidates`` (how many), ``counts``
        (accepted tasks per split), ``accepted`` and ``batches`` (how many this run validated).
    """
    return {"store_url": store_url, "freeze_name": freeze_name, "quotas": quotas.model_dump(), "seed": seed,
            "run_id": run_id, "candidate_set": registered.candidate_set,
            "candidates_sha256": registered.candidates_sha256, "candidates": registered.candidates,
            "counts": counts, "accepted": accepted, "batches": batches}


def _param_error(exc: InputError, field: str) -> InputError:
    """``exc`` with its message naming ``params.<field>``, as the user wrote it."""
    return type(exc)(f"params.{field}: {exc}")


def _only(rows: list[Any], instance_ids: tuple[str, ...] | None, source: str) -> list[Any]:
    """The rows whose instance id is in ``instance_ids`` (all rows for None), in the source's order.

    Raises:
        InputError: an id of ``params.instance_ids`` that ``source`` does not have (up to 10 named).
    """
    if instance_ids is None:
        return rows
    wanted = set(instance_ids)
    missing = sorted(wanted - {row.instance_id for row in rows})
    if missing:
        raise InputError(f"params.instance_ids: {len(missing)} id(s) not among the candidates of {source}: "
                         f"{', '.join(missing[:10])}")
    return [row for row in rows if row.instance_id in wanted]


def _blocks(freeze_name: str | None, sandbox: str | None,
            dispatcher: str | None) -> tuple[curate_tasks.SandboxChoice | None, RayPlacement | None]:
    """The checks ``curate`` makes before anything runs: the freeze name, and the sandbox and dispatcher
    blocks loaded (None where not given).

    Raises:
        InputError: an invalid ``params.freeze_name``, a missing ``params.sandbox`` block or one whose kind is
            not a sandbox backend, a missing ``params.dispatcher`` block (the field named).
    """
    try:
        if freeze_name is not None:
            validate_freeze_name(freeze_name)
    except InputError as exc:
        raise _param_error(exc, "freeze_name") from None
    try:
        placement = curate_tasks.sandbox_choice(sandbox) if sandbox is not None else None
    except InputError as exc:
        raise _param_error(exc, "sandbox") from None
    try:
        return placement, curate_tasks.trial_dispatcher(dispatcher) if dispatcher is not None else None
    except InputError as exc:
        raise _param_error(exc, "dispatcher") from None


@flow(name="curate", log_prints=True, on_cancellation=[sweep_trial_sandboxes("params.sandbox")],
      on_crashed=[sweep_trial_sandboxes("params.sandbox")])
def curate(params: CurateParams = CurateParams()) -> CurateResult:
    """Validate candidate batches until the accepted tasks meet ``params.quotas`` (or none is left).

    Args:
        params: :class:`CurateParams`:

            * ``tasks``: Where the candidates come from (:class:`forgeflow.curation.task_rows.TaskSource`):
              ``candidates_path``, a JSONL of candidate rows
              (:func:`forgeflow.curation.candidates.load_candidates`; ``image`` is the task image, local
              name or ``host:port/repo:tag``; an optional ``test_command`` key per row overrides
              ``test_commands``); or ``dataset``, the same rows as a HF ``datasets`` split (SWE-bench /
              SWE-smith / SWE-Gym rows: a ``save_to_disk`` folder, or a dataset id pinned to a
              ``revision``; :class:`forgeflow.curation.task_rows.DatasetSource`); or ``generated_path``,
              the lifecycle's candidates with their task images
              (:func:`forgeflow.curation.generated.merge_generated`), read when neither other source is
              given, default ``$FORGEFLOW_HOME/demo/candidates.jsonl`` (what ``forgeflow demo``
              writes). ``test_commands``: repo -> test command, for repos that are not pinned projects
              (for generated rows: overrides the row's command). ``test_specs``: repo -> test command
              and log parser (a SWE-bench parser by name, e.g. ``parse_log_django`` for Django's runner
              or unittest's verbose output), for repositories that are not pytest or not pinned
              projects; a row's own ``test_command`` / ``log_parser`` wins, and the parser replaces
              ``settings.checks.log_parser`` for that repository.
            * ``quotas``: What the freeze needs (default: train 350, validation 75, test 75, <= 20 per repo,
              >= 70 repos).
            * ``settings``: How the run validates (:class:`forgeflow.curation.curate_settings.CurateSettings`):
              ``batch_size`` (candidates per batch, select_batch), ``concurrency`` (NOP/Oracle
              validations in flight at once), ``max_retries`` (extra attempts for a validation that
              ended in an infrastructure error), ``verifier_timeout_s`` (absolute limit per test run,
              seconds), ``memory_mb`` (sandbox memory limit, MiB), ``seed`` (orders candidates and
              splits: same seed, same batches) and ``checks`` (Oracle runs per task that would be
              accepted, default 2: a task whose runs disagree is flaky; the flaky policy, ``reject`` or
              ``drop_flaky_pass_to_pass``; the log parser for runners without forgeflow's pytest report;
              :class:`forgeflow.sandbox.trial.ValidationChecks`).
            * ``freeze_name``: The name the freeze-on-ready automation freezes under (carried in the
              freeze-ready event with ``quotas``, ``settings.seed`` (as ``seed``) and the run's candidate
              set, ``candidate_set``); None: ``curate-`` + 12 hex digits of the sha256 of (candidate ids, quotas, seed).
            * ``sandbox``: The name of a ``forgeflow-sandbox`` block (:class:`blocks.core.SandboxBackend`):
              every NOP/Oracle trial runs on its backend (``podman``, ``kubernetes``) with its memory
              and CPU limits (its ``memory_mb`` replaces ``settings.memory_mb``). None: podman,
              ``settings.memory_mb``.
            * ``dispatcher``: The name of a ``forgeflow-dispatcher`` block (:class:`blocks.core.TrialDispatcher`):
              ``ray`` runs each validation as a Ray task on a cluster node that declares the sandbox
              resource (:mod:`forgeflow.sandbox.dispatch`; each trial records the ``node_id`` it ran on
              in its ``verifier`` record; a node lost mid-validation makes Ray run it again elsewhere).
              None or ``in-process``: here.
            * ``instance_ids``: Validate only these candidates of ``tasks`` (an id that is not there is refused
              before anything runs); None: every candidate. The lifecycle's validate stage passes its run's.
            * ``emit_freeze_ready``: When ready, emit the freeze-ready event (default); false: the caller
              freezes itself (the lifecycle's freeze stage), so no automation freezes a second time.

    Only this run's candidates count: readiness is checked on the accepted tasks among them, and
    before any image is checked or trial run the quotas are checked against the candidates
    themselves (:func:`forgeflow.curation.freeze.quota_feasibility`: e.g. 2 repositories cannot fill
    3 repository-disjoint splits).

    Returns:
        A :class:`forgeflow.curation.curate_result.CurateResult`: ``status`` (``freeze-ready`` or
        ``exhausted``), ``batches`` (ids run), ``trials_recorded``, ``counts`` (accepted tasks per
        split), ``unmet`` (quota texts), ``event_id`` (the freeze-ready event), ``freeze_name``.

    Raises:
        InputError: malformed rows, a repo without a test command, no candidates file, more than one
            source given, an invalid ``params.freeze_name``, a missing ``params.sandbox`` block or one
            whose kind is not a sandbox backend. (Out-of-bounds ``params.settings``, e.g. ``concurrency`` < 1,
            are refused when the model is built: pydantic's ValidationError, or Prefect's parameter
            validation before the flow runs, naming ``params.settings.concurrency``.)
        PreflightError: the candidates cannot meet ``quotas`` even if every one were accepted
            (nothing was validated).
    """
    tasks, quotas, settings, freeze_name = params.tasks, params.quotas, params.settings, params.freeze_name
    placement, ray_placement = _blocks(freeze_name, params.sandbox, params.dispatcher)
    logger = get_run_logger()
    apply_container_env()
    run_id = str(flow_run.get_id() or "")
    store_url = store_settings.store_url()
    loaded = curate_tasks.load_rows(tasks, home_dir() / "demo" / GENERATED_FILE, "curate")
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
    available = set(curate_tasks.available_images([row.image for row in rows if row.image]))
    refs = to_candidate_refs(rows, available)
    registered = curate_tasks.register_candidates(store_url, rows, run_id)
    logger.info("curate: %d candidates (%d new; candidate set %s), %d with an available image", len(rows),
                registered.new, registered.candidate_set, sum(r.image_available for r in refs))
    progress = create_progress_artifact(progress=0.0, description=f"curate: {len(rows)} candidates, batches of "
                                                                  f"{settings.batch_size}")
    try:
        batches: list[str] = []
        validated: list[str] = []
        recorded = 0
        while True:
            state = curate_tasks.curation_state(store_url, sorted(by_id))
            update_progress_artifact(progress, progress=100.0 * len(state.processed) / len(by_id))
            accepted = state.accepted
            selection = freeze_ready(accepted, quotas, seed)
            if selection.ready:
                resource_id = (f"forgeflow.store.{sha256_bytes(store_url.encode())[:12]}"
                               f".quotas.{sha256_json(quotas.model_dump())[:12]}")
                payload = freeze_ready_payload(masked_url(store_url), name, quotas, seed, registered, run_id,
                                               selection.counts, len(accepted), len(batches))
                event = emit_event(FREEZE_READY_EVENT,
                                   resource={"prefect.resource.id": resource_id,
                                             "prefect.resource.name": "curated dataset"},
                                   payload=payload) if params.emit_freeze_ready else None
                logger.info("FREEZE READY: %s over %d repos after %d batch(es); %s",
                            ", ".join(f"{s} {n}/{quotas.target(s)}" for s, n in selection.counts.items()),
                            sum(len(r) for r in selection.repos_per_split.values()), len(batches),
                            f"event {FREEZE_READY_EVENT} on {resource_id}" if params.emit_freeze_ready
                            else "no event (the caller freezes)")
                return CurateResult(status="freeze-ready", batches=batches, trials_recorded=recorded,
                                    counts=selection.counts, unmet=[], event_id=str(event.id) if event else None,
                                    freeze_name=name, validated=validated)
            ids = select_batch(refs, state.processed, state.accepted_per_repo, settings.batch_size, seed)
            if not ids:
                text = unmet_text(selection.unmet)
                logger.warning("STOPPED, NOT READY: no candidate left to validate; unmet quotas: %s", text)
                return CurateResult(status="exhausted", batches=batches, trials_recorded=recorded,
                                    counts=selection.counts, unmet=[text], event_id=None, freeze_name=name,
                                    validated=validated)
            batch_id = f"curate-{sha256_json({'seed': seed, 'ids': sorted(ids)})[:16]}"
            plan = BatchPlan(store_url=store_url, run_id=run_id, ids=ids, rows={i: by_id[i] for i in ids},
                             image_ids={i: loaded.image_ids[i] for i in ids},
                             test_commands={i: loaded.test_commands[i] for i in ids},
                             log_parsers={i: loaded.log_parsers[i] for i in ids if loaded.log_parsers.get(i)},
                             concurrency=settings.concurrency, max_retries=settings.max_retries,
                             validation=settings.validation(), sandbox=placement, ray=ray_placement,
                             keep_validation_results=settings.keep_validation_results)
            recorded += _curate_batch(batch_id, plan)
            batches.append(batch_id)
            validated.extend(ids)
            logger.info("batch %s: %d candidates; unmet before it: %s", batch_id, len(ids), unmet_text(selection.unmet))
    finally:  # a driver outlived by its Ray cluster is ended by Ray: leave it now
        if ray_placement is not None:
            dispatch.disconnect()


class BatchPlan(BaseModel):
    """One batch of a ``curate`` run, as its ``curate-batch`` subflow (:func:`_curate_batch`) validates it.

    Attributes:
        store_url: the store's SQLAlchemy URL.
        run_id: the ``curate`` flow run (its trials' ``run_id`` and its sandboxes' label).
        ids: the batch's instance ids, in selection order.
        rows: instance id -> its candidate row (not sent to the API with the subflow's parameters).
        image_ids: instance id -> what keys its image (a local image id or registry digest), or None.
        test_commands: instance id -> its test command.
        log_parsers: instance id -> its repository's log parser (absent: the run's).
        concurrency: validations in flight at once.
        max_retries: extra attempts for a validation that ended in an infrastructure error.
        validation: each validation's limits and checks.
        sandbox: the ``forgeflow-sandbox`` block's choice, or None (podman).
        ray: the Ray placement, or None (in this process).
        keep_validation_results: keep each validation's persisted result once the batch is recorded.
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
    validation: ValidationSettings
    sandbox: curate_tasks.SandboxChoice | None = None
    ray: RayPlacement | None = None
    keep_validation_results: bool = False


def _pristine_duration_s(outcome: ValidationOutcome) -> float | None:
    """The longest test run of a validation's Oracle trials (the first and its repeats), seconds: what the
    verifier reads as the task's pristine duration (:attr:`forgeflow.sandbox.verifier.TaskTests.pristine_duration_s`);
    None when no Oracle run completed. A repeat that also re-ran the FAIL_TO_PASS tests counts whole: an
    upper bound, the safe side for attributing a later timeout to a submission."""
    runs = [t.verifier_s for t in ([outcome.oracle] if outcome.oracle else []) + outcome.oracle_repeats
            if t.verifier_s is not None]
    return max(runs) if runs else None


PROGRESS_UPDATE_S = 2.0
"""Least seconds between two updates of a batch's progress artifact (one API call each)."""


def _drop_results(states: list[Any]) -> int:
    """Delete the persisted results of ``states`` (validation task runs whose batch is recorded) where they are
    files of this machine (Prefect's default local result storage keys results by absolute path); results in
    other storages are kept. Returns how many files were deleted."""
    dropped = 0
    for state in states:
        key = getattr(getattr(getattr(state, "data", None), "metadata", None), "storage_key", None)
        if isinstance(key, str) and Path(key).is_absolute() and Path(key).is_file():
            Path(key).unlink(missing_ok=True)
            dropped += 1
    return dropped


@flow(name="curate-batch", flow_run_name="{batch_id}", validate_parameters=False, persist_result=False,
      log_prints=True)
def _curate_batch(batch_id: str, plan: BatchPlan) -> int:
    """Validate one batch of a ``curate`` run (its own run in the UI: its validations, its progress, its table):
    a sliding window of ``plan.concurrency`` validations, each handled as it ends (its trials were stored by the
    validation as they ended), then the trials, the task statuses and the batch row in one transaction.
    Unless ``plan.keep_validation_results``, the validations' persisted results (what a resumed run would
    reuse) are deleted once the batch is recorded: a recorded candidate is never validated again.

    Returns:
        The number of trials recorded.
    """
    logger = get_run_logger()
    ids, concurrency, max_retries, run_id = plan.ids, plan.concurrency, plan.max_retries, plan.run_id
    validate = validate_candidate.with_options(retries=max_retries)
    sink = TrialSink(store_url=plan.store_url, job_id=JOB_ID, batch_id=batch_id, run_id=run_id)
    # attempt numbers continue after voided attempts: a task requeued by `recover` gets new trial ids;
    # live trials of a killed run keep theirs (same key: cache hit, same ids upserted)
    earlier = curate_tasks.voided_attempts(plan.store_url, ids)
    # the longest validations (as last recorded) start first: a long one started last would idle the other slots
    ids = longest_first(ids, curate_tasks.recorded_validation_seconds(plan.store_url, ids))
    progress = create_progress_artifact(progress=0.0, description=f"batch {batch_id}: {len(ids)} candidates")
    done: queue.Queue = queue.Queue()
    pending = deque((iid, 0) for iid in ids)
    in_flight, finished, shown_at = 0, 0, time.monotonic()
    trials: list[TrialRecord] = []
    final: dict[str, tuple[str, str, Any]] = {}
    pristine: dict[str, float | None] = {}  # the longest Oracle run of each task with a verdict, seconds
    states: list[Any] = []
    while pending or in_flight:
        while pending and in_flight < concurrency:
            iid, attempt = pending.popleft()
            row = plan.rows[iid]
            validation = plan.validation
            if parser := plan.log_parsers.get(iid):  # the repository's own log parser replaces the run's
                validation = validation.model_copy(
                    update={"checks": validation.checks.model_copy(update={"log_parser": parser})})
            future = validate.submit(row, row.image, plan.image_ids[iid], plan.test_commands[iid], validation,
                                     f"curate-a{earlier[iid] + attempt}", sink, plan.sandbox, plan.ray)
            future.add_done_callback(lambda f, iid=iid, attempt=attempt: done.put((iid, attempt, f)))
            in_flight += 1
        iid, attempt, future = done.get()
        in_flight -= 1
        try:  # the callback can run before the Prefect state is final: result() waits for it
            outcome = future.result()
        except Exception as exc:  # noqa: BLE001 - this task's failure must not sink the batch
            logger.error("validation of %s raised (no trial recorded): %r", iid, exc)
            final[iid] = ("error", f"validation raised {type(exc).__name__}: {exc}"[:2000], None)
        else:
            states.append(future.state)
            note_task_state(future.state)  # inside a lifecycle stage: ran or answered from cache
            # stored by the validation as each ended (a cached one's in the run that ran it); again below
            trials.extend(trial_row(tr, JOB_ID, None, run_id, batch_id=batch_id) for tr in outcome.trials)
            if outcome.report is None:
                failed = outcome.failed_trial or outcome.nop
                if attempt < max_retries:
                    logger.warning("%s: %s on attempt %d; trying again", iid, failed.exception_type, attempt + 1)
                    pending.append((iid, attempt + 1))
                    continue
                final[iid] = ("error", f"{failed.exception_type}: {failed.exception_message}"[:2000], None)
            else:
                verdict = "accepted" if outcome.report.accepted else "rejected"
                final[iid] = (verdict, outcome.report.reason, outcome.report)
                pristine[iid] = _pristine_duration_s(outcome)
        finished += 1
        if finished == len(ids) or time.monotonic() - shown_at >= PROGRESS_UPDATE_S:
            update_progress_artifact(progress, progress=100.0 * finished / len(ids))
            shown_at = time.monotonic()
    tasks = []
    for iid in ids:
        status, reason, report = final[iid]
        row = plan.rows[iid]
        tasks.append(TaskRecord(instance_id=iid, repo=row.repo, patch=row.patch, image_ref=row.image,
                                status=status, reason=reason,
                                fail_to_pass=report.FAIL_TO_PASS if report else [],
                                pass_to_pass=report.PASS_TO_PASS if report else [],
                                known_tests=report.known_tests if report else [],
                                pristine_duration_s=pristine.get(iid), run_id=run_id))
    curate_tasks.record_batch(plan.store_url, BatchRecord(batch_id=batch_id, kind="curate", instance_ids=ids,
                                                          concurrency=concurrency, run_id=run_id), trials, tasks)
    if not plan.keep_validation_results:
        _drop_results(states)
    table_artifact(f"curate-{batch_id[-16:].lower()}", [
        {"instance_id": t.instance_id, "status": t.status, "reason": t.reason, "FAIL_TO_PASS": len(t.fail_to_pass)}
        for t in tasks], f"curate batch {batch_id}")
    return len(trials)


class RecoverParams(StageParams):
    """The ``recover`` flow's parameters (the recover deployment's defaults are the model's: a dry run).

    Attributes:
        reason: why the trials are voided (recorded in the audit).
        batch_ids: void the broken trials of these batches.
        trial_ids: void these trials.
        exception_type: void the trials that ended in this exception type between ``since`` and ``until``.
        since: the window's start (timezone-aware), with ``exception_type``.
        until: the window's end (timezone-aware), with ``exception_type``.
        dry_run: only list what would be voided and requeued.
        backup_dir: where the affected rows are backed up; None: ``$FORGEFLOW_HOME/recovery``.
        include_rejections: void and requeue the rejections the fault caused (only with ids).
    """

    reason: str = Field(min_length=1, description="why the trials are voided (recorded in the audit)")
    batch_ids: list[str] | None = Field(None, description="void the trials of these batches an infrastructure "
                                        "fault broke")
    trial_ids: list[str] | None = Field(None, description="void these trials")
    exception_type: str | None = Field(None, description="void the trials that ended in this exception type "
                                       "(e.g. SandboxError) between since and until; both required")
    since: datetime | None = Field(None, description="start of the exception_type window (timezone-aware)")
    until: datetime | None = Field(None, description="end of the exception_type window (timezone-aware)")
    dry_run: bool = Field(True, description="only list what would be voided and requeued; False: back up, void, "
                                            "requeue and audit")
    backup_dir: Path | None = Field(None, description="folder for the backup of the affected rows (JSON + "
                                                      ".sha256); None: $FORGEFLOW_HOME/recovery")
    include_rejections: bool = Field(False, description="also void and requeue the rejections the fault caused "
                                                        "(only with batch_ids / trial_ids)")


@flow(name="recover", log_prints=True)
def recover(params: RecoverParams) -> RecoverResult:
    """Void exactly the trials an infrastructure fault broke and requeue their tasks.

    ``params`` is a :class:`RecoverParams`. Select by ``batch_ids`` and/or ``trial_ids``, or by
    ``exception_type`` with BOTH ``since`` and ``until`` (timezone-aware; refused without a window).
    ``dry_run`` (default) only lists what
    would be voided/requeued; otherwise the affected rows are backed up (``backup_dir``, default
    ``$FORGEFLOW_HOME/recovery``; JSON + ``.sha256``), voided/requeued in one transaction with the
    counts verified, and an audit markdown artifact (and file beside the backup) is written.

    ``include_rejections`` (only with ``batch_ids``/``trial_ids``): tasks an infrastructure fault
    made ``rejected`` (e.g. a dead build tunnel) are voided and requeued too, with the same backup,
    audit and count check: the selected rewarded NOP/Oracle trials of a rejected task whose every
    live NOP/Oracle trial is selected (:mod:`forgeflow.curation.recovery`). Accepted tasks and rejections
    outside the ids stay.

    Returns:
        A :class:`forgeflow.curation.curate_result.RecoverResult`: a dry run's ``void`` (trial ids),
        ``requeue`` (instance ids) and ``kept`` (trial ids); an applied recovery's ``recovery_id``,
        ``voided`` and ``requeued`` (counts), ``backup_path``, ``backup_sha256`` and ``after`` (the
        store's counts after it).

    Raises:
        InputError: bad selection (``include_rejections`` with an exception type included),
            unknown ids; CountMismatchError: the store changed under the recovery (rolled back).
    """
    from pydantic import ValidationError

    logger = get_run_logger()
    dry_run, backup_dir = params.dry_run, params.backup_dir
    try:
        request = RecoveryRequest(batch_ids=params.batch_ids or [], trial_ids=params.trial_ids or [],
                                  exception_type=params.exception_type, since=params.since, until=params.until,
                                  reason=params.reason, include_rejections=params.include_rejections)
    except ValidationError as exc:
        problems = "; ".join(f"{'params.' + '.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}"
                             f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
        raise InputError(f"recover: {problems}") from None
    store_url = store_settings.store_url()
    plan = curate_tasks.plan_trial_recovery(store_url, request)
    text = render_plan(plan)
    logger.info("%s", text)
    if dry_run:
        markdown_artifact("recover-dry-run", f"```\n{text}\n```\n", "recover: what would be voided/requeued")
        return RecoverResult(dry_run=True, void=[t.trial_id for t in plan.void],
                             requeue=[t.instance_id for t in plan.requeue], kept=[k.trial_id for k in plan.kept])
    result, audit = curate_tasks.apply_trial_recovery(store_url, plan, backup_dir or home_dir() / "recovery",
                                                      str(flow_run.get_id() or ""))
    markdown_artifact("recover-audit", audit, f"recovery {result.recovery_id}")
    logger.info("recovered: %d trial(s) voided, %d task(s) requeued; backup %s (sha256 %s)",
                result.voided, result.requeued, result.backup_path, result.backup_sha256)
    return RecoverResult(dry_run=False, recovery_id=result.recovery_id, voided=result.voided,
                         requeued=result.requeued, backup_path=result.backup_path,
                         backup_sha256=result.backup_sha256, after=result.after)
