"""Shared pieces of forgeflow's Prefect tasks: cache policy, the I/O task decorator, the store, artifacts.

The store: every task reaches it through :func:`shared_store` (one engine per process and URL) with the URL its
caller gave, or ``settings.store_url()`` where it takes none. A task never disposes a store; only
:func:`shared_store` does, for an SQLite file replaced under the process.
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
from typing import Literal, TypeAlias, TypeVar

from prefect import Flow, Task, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE, CachePolicy
from prefect.client.schemas.objects import FlowRun, State, TaskRun
from pydantic import ValidationError

from forgeflow.common.errors import InputError, is_transient, validation_problems
from forgeflow.common.fsutil import JSONObject
from forgeflow.ledger import tables
from forgeflow.ledger.group_commit import GroupCommit
from forgeflow.ledger.records import (
    FreezeRecord,
    ImageRecord,
    JobRecord,
    ModelArtifactRecord,
    ServingGenerationRecord,
    SupervisionEventRecord,
    TaskRecord,
    TrialRecord,
)
from forgeflow.ledger.store import Store
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.kubernetes_manifests import FLOW_RUN_LABEL

_BlockT = TypeVar("_BlockT")
_R = TypeVar("_R")

RESUMABLE = INPUTS + TASK_SOURCE
"""Cache on inputs + task source, not the run id (Prefect's default has it): a new run resumes from an earlier
one's results. Exceptions are never cached."""

TRANSIENT_RETRIES = 3
TRANSIENT_RETRY_DELAYS_S = [2, 8, 30]


def retry_on_transient(task: Task[..., object], task_run: TaskRun, state: State) -> bool:
    """Prefect ``retry_condition_fn``: retry only a transient InfraError (registry 5xx/429, endpoint resets);
    auth errors, bad input and deterministic failures end the task at once."""
    try:
        state.result(raise_on_failure=True)
    except Exception as exc:  # noqa: BLE001 - we classify, never swallow: Prefect keeps the state
        return is_transient(exc)
    return False


def io_task(cache_policy: CachePolicy = NO_CACHE, task_run_name: str | None = None,
            persist_result: bool | None = None,
            log_prints: bool | None = None) -> Callable[[Callable[..., _R]], Task[..., _R]]:
    """``@task`` for a call to the store, a registry or another service: not cached by default (its answer is
    what the service holds now), retried :data:`TRANSIENT_RETRIES` times after :data:`TRANSIENT_RETRY_DELAYS_S`
    s on a transient error only (:func:`retry_on_transient`). The keywords are Prefect's ``@task`` ones."""
    return task(cache_policy=cache_policy, retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S,
                retry_condition_fn=retry_on_transient, task_run_name=task_run_name, persist_result=persist_result,
                log_prints=log_prints)


def table_artifact(key: str, rows: list[JSONObject], description: str) -> None:
    """Publish ``rows`` as a Prefect table artifact (``key``: lowercase letters, digits, dashes)."""
    create_table_artifact(key=key, table=rows or [{"info": "no rows"}], description=description)


def markdown_artifact(key: str, markdown: str, description: str) -> None:
    """Publish a markdown artifact."""
    create_markdown_artifact(key=key, markdown=markdown, description=description)


RunLogger: TypeAlias = "logging.Logger | logging.LoggerAdapter[logging.Logger]"
"""What :func:`run_logger` and :func:`hook_logger` return (Prefect's run loggers are adapters)."""


def run_logger() -> RunLogger:
    """The Prefect run logger, or the ``forgeflow.tasks`` logger outside a run (``.fn`` in tests, scripts)."""
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:  # called as .fn outside a run (tests, scripts)
        return logging.getLogger("forgeflow.tasks")


@contextmanager
def forwarded_logs(name: str, level: int = logging.INFO) -> Iterator[None]:
    """While the block runs, records of ``level`` and up on the stdlib logger ``name`` also go to the run's log."""
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
    """The id of the flow run this code runs in (at most 64 characters), or None."""
    from prefect.runtime import flow_run

    run = flow_run.get_id()
    return str(run)[:64] if run else None


def load_block(block_cls: type[_BlockT], name: str, what: str) -> _BlockT:
    """The saved Prefect block ``name`` of ``block_cls``. Raises InputError: no such block (``"<what> block '<name>'
    does not exist: ..."``), or its saved values break the block's model (a block saved from the UI's form, which
    checks types but not the model's rules: ``"<what> block '<name>' is not valid: <field>: <reason>"``)."""
    try:
        return block_cls.load(name)  # type: ignore[attr-defined]
    except RuntimeError as exc:  # Prefect: "Unable to load ... due to failed validation", from the ValidationError
        if not isinstance(exc.__cause__, ValidationError):
            raise
        raise InputError(f"{what} block {name!r} is not valid: {validation_problems(exc.__cause__)}") from exc
    except ValueError as exc:  # Prefect: "Unable to find block document named ..."
        raise InputError(f"{what} block {name!r} does not exist: {exc}") from exc


def run_labelled(target: SandboxTarget | str) -> SandboxTarget:
    """``target`` with the flow run's id as the :data:`FLOW_RUN_LABEL` of its pods or containers, for
    :func:`sweep_trial_sandboxes` (unlabelled outside a run). Call it in task bodies: no part of a cache key."""
    target = SandboxTarget.of(target)
    run = flow_run_id()
    if run is None:
        return target
    return target.model_copy(update={"labels": {**target.labels, FLOW_RUN_LABEL: run}})


def hook_logger(flow: Flow[..., object], flow_run: object) -> RunLogger:
    """The logger of a flow hook (called outside the run's context): the run's ``flow_run_logger``, or this
    module's logger when ``flow_run`` is no Prefect flow run."""
    from prefect.logging.loggers import flow_run_logger

    if isinstance(flow_run, FlowRun):
        return flow_run_logger(flow_run, flow)
    return logging.getLogger(__name__)


def trial_dispatcher(block_name: str) -> RayPlacement | None:
    """The ``forgeflow-dispatcher`` block's placement: None for ``in-process``, a RayPlacement for ``ray``. Raises
    InputError: no such block."""
    from blocks.core import TrialDispatcher

    return load_block(TrialDispatcher, block_name, "dispatcher").placement()


def _parameter(run: FlowRun, path: str) -> object:
    """The run's parameter at the dotted ``path`` (``params.sandbox``), from its JSON or its parameter model."""
    value: object = getattr(run, "parameters", None) or {}
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value


def sweep_trial_sandboxes(parameter: str, dispatcher: str | None = None
                          ) -> Callable[[Flow[..., object], FlowRun, State], None]:
    """A flow hook (``on_cancellation`` / ``on_crashed``) ending the run's labelled trial sandboxes wherever they
    run: the ``kubernetes`` pods of the ``forgeflow-sandbox`` block the flow parameter ``parameter`` names (a
    dotted path: ``params.sandbox``), else this host's podman containers at every layer
    (:func:`forgeflow.sandbox.podman_layers.sweep_labelled`); and, when the parameter ``dispatcher`` names a
    ``ray`` block, the containers on every sandbox node of that cluster
    (:func:`forgeflow.sandbox.dispatch.sweep_ray_nodes`). A failure is logged, never raised. The hook's
    parameter names are Prefect's (its runner calls hooks by keyword)."""

    def hook(flow: Flow[..., object], flow_run: FlowRun, state: State) -> None:
        from blocks.core import SandboxBackend
        from forgeflow.sandbox.kubernetes import delete_trial_pods, new_core_api
        from forgeflow.sandbox.podman_layers import sweep_labelled

        run, logger = flow_run, hook_logger(flow, flow_run)
        name = _parameter(run, parameter)
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
        ray_block = _parameter(run, dispatcher) if dispatcher else None
        if ray_block:
            _sweep_ray(str(ray_block), run, logger)

    return hook


def _sweep_ray(block_name: str, run: FlowRun, logger: RunLogger) -> None:
    """End the run's labelled containers on every sandbox node of the ``ray`` dispatcher ``block_name`` (an
    ``in-process`` block: nothing); logged, never raised."""
    from forgeflow.sandbox import dispatch

    try:
        placement = trial_dispatcher(block_name)
        if placement is not None:
            swept = dispatch.sweep_ray_nodes(placement, FLOW_RUN_LABEL, str(run.id))
            logger.info("ended the containers of run %s on %d Ray node(s): %s; sweeps failed: %s", run.id,
                        len(swept.ended), swept.ended, swept.failed or "none")
    except Exception as exc:  # noqa: BLE001 - a hook must not mask the run's own end
        logger.warning("could not sweep the Ray nodes of run %s: %s", run.id, exc)
    finally:
        dispatch.disconnect()


LedgerKind = Literal["images", "image_roles", "tasks", "trials", "jobs", "model_artifacts", "serving_generations",
                     "freezes"]
"""The table :func:`record_rows` writes (``image_roles``: the role and project of an image already recorded)."""


@io_task(task_run_name="upgrade-store")
def upgrade_store(store_url: str) -> str:
    """Bring the store at ``store_url`` to this forgeflow's schema (Alembic, idempotent) before a flow's first read.
    Returns the URL with any password masked, for logs. Raises StoreUnavailableError / StoreInvalidError: the database
    cannot be reached, is not a forgeflow store, or a newer forgeflow made it."""
    return shared_store(store_url).display_url


LedgerRow: TypeAlias = (ImageRecord | TaskRecord | TrialRecord | JobRecord | ModelArtifactRecord
                        | ServingGenerationRecord | FreezeRecord)
"""A row :func:`record_rows` writes (the record model of its ``kind``)."""


@io_task(task_run_name="record-{kind}")
def record_rows(store_url: str, kind: LedgerKind, rows: Sequence[LedgerRow]) -> int:
    """Upsert a flow's rows in the store at ``store_url`` by their natural keys (a retry writes nothing twice);
    ``trials`` in one transaction; of ``image_roles`` rows only ``role`` and ``project``. Returns the count. Raises
    InputError: an unknown ``kind``, or a row the store refuses (named by the store)."""
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
    """This process's store for ``store_url``, migrated to the head (once per process), its engine kept between calls (a
    new engine per row cost ~15 ms on SQLite). The one way a task opens the store; tasks never dispose it. Thread-safe;
    keyed by process id and an SQLite file's device and inode: a file replaced under the process gets a new engine (the
    old one disposed). Raises StoreUnavailableError / StoreInvalidError / InputError: as
    :class:`~forgeflow.ledger.store.Store`."""
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
"""Seconds between a trial writer's checks of :func:`shared_store` (per transaction, the check cost a third of one)."""


def shared_trial_writer(store_url: str) -> GroupCommit:
    """This process's group commit of trials for ``store_url``: ``record((trial, event or None))`` returns once
    committed, in one ``record_trials`` transaction with whatever other threads queued meanwhile. Thread-safe."""
    key = (os.getpid(), store_url)
    with _TRIAL_WRITERS_LOCK:
        writer = _TRIAL_WRITERS.get(key)
        if writer is None:
            store: Store | None = None  # one write at a time: no race on it
            checked_at_s = 0.0

            def write(items: Sequence[tuple[TrialRecord, SupervisionEventRecord | None]]) -> None:
                nonlocal store, checked_at_s
                now_s = time.monotonic()
                if store is None or now_s - checked_at_s >= STORE_RECHECK_S:
                    store, checked_at_s = shared_store(store_url), now_s
                store.record_trials([row for row, _ in items], [event for _, event in items if event is not None])

            writer = _TRIAL_WRITERS[key] = GroupCommit(write)
        return writer
