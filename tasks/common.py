"""Shared pieces of forgeflow's Prefect tasks: cache policy, retry condition, artifacts.

* :data:`RESUMABLE` caches on the task's inputs and source only (not the run id), so a new flow
  run resumes from results of an earlier one (Prefect's default policy includes RUN_ID).
  Failed states (exceptions) are never cached by Prefect.
* :func:`retry_on_transient` lets Prefect retry only infrastructure failures marked transient in
  ``forgeflow.common.errors`` (registry 5xx/429, model endpoint resets); auth errors, bad input and
  deterministic failures end the task at once.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

from prefect import Task, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE
from prefect.client.schemas.objects import State, TaskRun

from forgeflow.common.errors import InputError, is_transient
from forgeflow.ledger import tables
from forgeflow.ledger.group_commit import GroupCommit
from forgeflow.ledger.records import SupervisionEventRecord, TrialRecord
from forgeflow.ledger.store import Store
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.kubernetes_manifests import FLOW_RUN_LABEL

_BlockT = TypeVar("_BlockT")
_R = TypeVar("_R")

RESUMABLE = INPUTS + TASK_SOURCE
"""Cache on inputs + task source: re-running a flow reuses every completed stage."""

TRANSIENT_RETRIES = 3
TRANSIENT_RETRY_DELAYS_S = [2, 8, 30]


def retry_on_transient(task: Task[..., Any], task_run: TaskRun, state: State) -> bool:
    """Prefect ``retry_condition_fn``: retry only if the failure is a transient InfraError."""
    try:
        state.result(raise_on_failure=True)
    except Exception as exc:  # noqa: BLE001 - we classify, never swallow: Prefect keeps the state
        return is_transient(exc)
    return False


def io_task(**options: Any) -> Callable[[Callable[..., _R]], Task[..., _R]]:
    """``@task`` for a call to the store, a registry or another service: never cached (its answer is what the
    service holds now), retried :data:`TRANSIENT_RETRIES` times after :data:`TRANSIENT_RETRY_DELAYS_S` when it
    failed with a transient :class:`~forgeflow.common.errors.InfraError` (:func:`retry_on_transient`), never on
    bad input. ``options`` are Prefect's ``@task`` keywords and win (e.g. ``cache_policy=RESUMABLE`` for a copy
    that may be answered from its cache, ``task_run_name=...``)."""
    return task(**{"cache_policy": NO_CACHE, "retries": TRANSIENT_RETRIES,
                   "retry_delay_seconds": TRANSIENT_RETRY_DELAYS_S, "retry_condition_fn": retry_on_transient,
                   **options})


def table_artifact(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """Publish ``rows`` as a Prefect table artifact (``key``: lowercase letters, digits, dashes)."""
    create_table_artifact(key=key, table=rows or [{"info": "no rows"}], description=description)


def markdown_artifact(key: str, markdown: str, description: str) -> None:
    """Publish a markdown artifact."""
    create_markdown_artifact(key=key, markdown=markdown, description=description)


def run_logger() -> Any:
    """The Prefect run logger, or the ``forgeflow.tasks`` logger when called outside a run (``.fn`` in
    tests and scripts)."""
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:  # called as .fn outside a run (tests, scripts)
        return logging.getLogger("forgeflow.tasks")


@contextmanager
def forwarded_logs(name: str, level: int = logging.INFO) -> Iterator[None]:
    """While the block runs, records of ``level`` and above on the stdlib logger ``name`` (the core's, which
    knows nothing of Prefect) also go to :func:`run_logger`, so a user reads them in the run's log."""
    target = run_logger()

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            target.log(record.levelno, record.getMessage())

    source, handler = logging.getLogger(name), Forward(level)
    previous = source.level
    source.addHandler(handler)
    if source.getEffectiveLevel() > level:
        source.setLevel(level)
    try:
        yield
    finally:
        source.removeHandler(handler)
        source.setLevel(previous)


def task_run_id() -> str | None:
    """The id of the task run this code runs in (at most 64 characters), or None."""
    from prefect.runtime import task_run

    run = task_run.get_id()
    return str(run)[:64] if run else None


def flow_run_id() -> str | None:
    """The id of the flow run this code runs in (as :func:`tasks.serving.record_swap` stamps promotions),
    or None."""
    from prefect.runtime import flow_run

    run = flow_run.get_id()
    return str(run)[:64] if run else None


def load_block(block_cls: type[_BlockT], name: str, what: str) -> _BlockT:
    """The saved Prefect block ``name`` of ``block_cls`` (``block_cls.load(name)``).

    Raises:
        InputError: no block of that type and name is saved (``"<what> block '<name>' does not
            exist: ..."``, with Prefect's own message).
    """
    try:
        return block_cls.load(name)  # type: ignore[attr-defined]
    except ValueError as exc:  # Prefect: "Unable to find block document named ..."
        raise InputError(f"{what} block {name!r} does not exist: {exc}") from exc


def run_labelled(target: SandboxTarget | str) -> SandboxTarget:
    """``target`` (a :class:`SandboxTarget` or a backend kind) with the current flow run's id as the
    :data:`FLOW_RUN_LABEL` of its pods (kubernetes) or containers (podman: a label and an OCI annotation),
    so :func:`sweep_trial_sandboxes` can end a cancelled or crashed run's sandboxes. Outside a flow run
    the target is returned unlabelled. Called inside task bodies: the label is no part of any cache key."""
    target = SandboxTarget.of(target)
    run = flow_run_id()
    if run is None:
        return target
    return target.model_copy(update={"labels": {**target.labels, FLOW_RUN_LABEL: run}})


def hook_logger(flow: Any, flow_run: Any) -> Any:
    """The logger of a flow hook: Prefect's ``flow_run_logger`` for ``flow_run`` (its lines go to the run's
    log), since the runner calls ``on_cancellation`` / ``on_crashed`` hooks outside the run's context,
    where ``get_run_logger`` has no run; this module's logger when ``flow_run`` is no Prefect flow run."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.logging.loggers import flow_run_logger

    if isinstance(flow_run, FlowRun):
        return flow_run_logger(flow_run, flow)
    return logging.getLogger(__name__)


def sweep_trial_sandboxes(parameter: str) -> Callable[[Any, Any, Any], None]:
    """A flow hook (``on_cancellation`` / ``on_crashed``) ending the trial sandboxes of the run: on the
    ``forgeflow-sandbox`` block the flow parameter ``parameter`` names (or a field of one by a dotted path:
    ``params.sandbox``), its ``kubernetes`` pods labelled with the run are deleted; with no block, or a
    ``podman`` one, this host's containers labelled with the run are ended at every layer (podman's
    records, the runtime's containers, conmon: :func:`forgeflow.sandbox.podman_layers.sweep_labelled`). A
    cancelled or crashed run leaves no sandbox behind (those of trials still unwinding are removed by
    their own sandbox; ``activeDeadlineSeconds`` bounds pods). Containers a Ray dispatcher started on
    other nodes are those nodes' to end (the trial's own cleanup). Prefect's runner calls hooks by keyword
    (``flow=``, ``flow_run=``, ``state=``), its flow engine by position: the parameter names are Prefect's."""

    def hook(flow: Any, flow_run: Any, state: Any) -> None:
        from blocks.core import SandboxBackend
        from forgeflow.sandbox.kubernetes import delete_trial_pods, new_core_api
        from forgeflow.sandbox.podman_layers import sweep_labelled

        run, logger = flow_run, hook_logger(flow, flow_run)

        name: Any = getattr(run, "parameters", None) or {}
        for part in parameter.split("."):  # a run's parameters as JSON, or the parameter model itself
            name = name.get(part) if isinstance(name, dict) else getattr(name, part, None)
        try:
            target = load_block(SandboxBackend, name, "sandbox").target() if name else SandboxTarget()
            if target.kind == "kubernetes":
                deleted = delete_trial_pods(new_core_api(target.kubeconfig, target.context), target.namespace,
                                            {FLOW_RUN_LABEL: str(run.id)})
            else:
                found = sweep_labelled(FLOW_RUN_LABEL, str(run.id))
                deleted = sorted({*found.podman, *(n for *_, n in found.runtime), *(n for _, n in found.conmon)})
            logger.info("ended %d trial sandbox(es) of run %s: %s", len(deleted), run.id, ", ".join(deleted))
        except Exception as exc:  # noqa: BLE001 - a hook must not mask the run's own end
            logger.warning("could not sweep the trial sandboxes of run %s: %s", run.id, exc)

    return hook


LedgerKind = Literal["images", "image_roles", "tasks", "trials", "jobs", "model_artifacts", "serving_generations",
                     "freezes"]
"""What :func:`record_rows` writes: rows of ``images`` (whole), ``image_roles`` (the role and project of an
image another flow recorded), ``tasks``, ``trials``, ``jobs`` (canary and recovery jobs), ``model_artifacts``,
``serving_generations`` or ``freezes``."""


@task(cache_policy=NO_CACHE, retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S,
      retry_condition_fn=retry_on_transient, task_run_name="upgrade-store")
def upgrade_store(store_url: str) -> str:
    """Bring the store at ``store_url`` to this forgeflow's schema (Alembic, idempotent) before a flow's first
    read; retried on transient errors. Returns the URL with any password masked, for logs.

    Raises:
        StoreUnavailableError / StoreInvalidError: the database cannot be reached, is not a forgeflow store,
            or a newer forgeflow made it.
    """
    store = Store(store_url)
    try:
        store.upgrade()
        return store.display_url
    finally:
        store.dispose()


@task(cache_policy=NO_CACHE, retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S,
      retry_condition_fn=retry_on_transient, task_run_name="record-{kind}")
def record_rows(store_url: str, kind: LedgerKind, rows: Sequence[Any]) -> int:
    """Write a flow's domain facts to the store at ``store_url`` (upgraded first: idempotent, about 10 ms on
    SQLite) as one task run: each row is upserted by
    its natural key (:class:`forgeflow.ledger.store.Store`'s ``record_*``), so a retry after a transient
    failure writes nothing twice; ``trials`` are written in one transaction. ``image_roles`` rows are
    :class:`forgeflow.ledger.records.ImageRecord` of which only ``role`` and ``project`` are written (the
    row's digests and migration state belong to the flow that recorded it).

    Returns:
        The number of rows written.

    Raises:
        InputError: an unknown ``kind``, or a row the store refuses (named by the store).
    """
    store = shared_store(store_url)
    if kind == "trials":
        store.record_trials(list(rows))
    elif kind == "image_roles":
        store.upsert_many(tables.Image, [({"ref": row.ref}, {"role": row.role, "project": row.project})
                                         for row in rows])
    else:
        writers = {"images": store.record_image, "tasks": store.record_task, "jobs": store.record_job,
                   "model_artifacts": store.record_model_artifact,
                   "serving_generations": store.record_serving_generation, "freezes": store.record_freeze}
        if kind not in writers:
            known = sorted([*writers, "trials", "image_roles"])
            raise InputError(f"record_rows: kind {kind!r} is not one of {known}")
        for row in rows:
            writers[kind](row)
    return len(rows)


_SHARED_STORES: dict[tuple[int, str, tuple[int, int] | None], Store] = {}
_SHARED_LOCK = threading.Lock()


@functools.lru_cache(maxsize=64)
def _sqlite_file(store_url: str) -> Path | None:
    """The SQLite file ``store_url`` names (None: another database, or an in-memory one); parsed once per URL."""
    from sqlalchemy.engine import make_url

    url = make_url(store_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser()


def shared_store(store_url: str) -> Store:
    """This process's :class:`~forgeflow.ledger.store.Store` for ``store_url``, migrated (once per process:
    :meth:`~forgeflow.ledger.store.Store.upgrade`), its engine and pooled connections kept between calls, so a
    task recording a row pays for neither Alembic nor a new connection (a new engine per row cost ~15 ms on
    SQLite: statement compilation, and a WAL checkpoint when its last connection closed). Thread-safe. Keyed by
    process id (an engine is never shared across a fork) and, for an SQLite file, by the file's device and
    inode: a store deleted or replaced under a running process gets a new engine, never writes to the old file.

    Raises:
        StoreUnavailableError / StoreInvalidError / InputError: as :class:`~forgeflow.ledger.store.Store`.
    """
    database = _sqlite_file(store_url)
    key = (os.getpid(), store_url, _file_id(database))
    with _SHARED_LOCK:
        store = _SHARED_STORES.get(key)
        if store is None:
            for stale in [k for k in _SHARED_STORES if k[:2] == key[:2]]:  # the file was replaced
                _SHARED_STORES.pop(stale).dispose()
            store = Store(store_url)
            if database is not None and key[2] is None:  # a new file: the migration makes it, key it by its inode
                store.upgrade()
                key = (*key[:2], _file_id(database))
            _SHARED_STORES[key] = store
    store.upgrade()
    return store


def _file_id(database: Path | None) -> tuple[int, int] | None:
    """``(device, inode)`` of the SQLite file ``database`` (None: no file, or not SQLite)."""
    if database is None:
        return None
    try:
        found = database.stat()
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


_TRIAL_WRITERS: dict[tuple[int, str], GroupCommit] = {}
_TRIAL_WRITERS_LOCK = threading.Lock()

STORE_RECHECK_S = 1.0
"""How often a trial writer asks :func:`shared_store` again (the file replaced? the store off its head revision?)
rather than per transaction: that check (a ``stat`` and a read of ``alembic_version``) cost a third of a shared
transaction of the canary's record path."""


def shared_trial_writer(store_url: str) -> GroupCommit:
    """This process's group commit of trials for the store at ``store_url`` (one per process and URL;
    :class:`~forgeflow.ledger.group_commit.GroupCommit`): ``record((trial, event))`` (a
    :class:`~forgeflow.ledger.records.TrialRecord` already checked with
    :func:`~forgeflow.ledger.records.check_outcome`, and its
    :class:`~forgeflow.ledger.records.SupervisionEventRecord` or None) returns once they are committed, in ONE
    :meth:`~forgeflow.ledger.store.Store.record_trials` transaction on :func:`shared_store` (asked again at most
    every :data:`STORE_RECHECK_S`) with whatever other threads queued meanwhile. Thread-safe; keyed by process id
    (a lock is never shared across a fork)."""
    key = (os.getpid(), store_url)
    with _TRIAL_WRITERS_LOCK:
        writer = _TRIAL_WRITERS.get(key)
        if writer is None:
            held: dict[str, Any] = {"store": None, "checked_at_s": 0.0}  # one write at a time: no race on it

            def write(items: Sequence[tuple[TrialRecord, SupervisionEventRecord | None]]) -> None:
                now_s = time.monotonic()
                if held["store"] is None or now_s - held["checked_at_s"] >= STORE_RECHECK_S:
                    held["store"], held["checked_at_s"] = shared_store(store_url), now_s
                held["store"].record_trials([row for row, _ in items],
                                            [event for _, event in items if event is not None])

            writer = _TRIAL_WRITERS[key] = GroupCommit(write)
        return writer
