"""Bookkeeping shared by the flows: per-stage wall time, cached/completed status, summary.json; and
:class:`StageParams`, the base of every stage flow's parameter model.

A stage is *cached* when every task it ran came back from Prefect's cache; a stage flow run inside a
lifecycle stage counts its task runs in that stage too. The summary is written atomically after every stage.
"""

from __future__ import annotations

import json
import queue
import time
from collections import deque
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from prefect import flow
from prefect.futures import PrefectFuture
from prefect.states import State
from pydantic import BaseModel, ConfigDict

import forgeflow
from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import atomic_write_text

T = TypeVar("T")
Item = TypeVar("Item")

STAGE_TABLE_KEY = "lifecycle-stages"
"""Key of the stage table artifact (Prefect keys: lowercase letters, digits and dashes)."""

STAGE_FLOW_NAME = "lifecycle-stage"
"""The flow name of a lifecycle stage's subflow runs (:func:`run_stage_flow`); the run is named after the stage."""

_ACTIVE_STAGE: ContextVar[StageLog | None] = ContextVar("forgeflow_active_stage_log", default=None)
"""The :class:`StageLog` whose stage is running in this context (set by :meth:`StageLog.stage`)."""


class StageParams(BaseModel):
    """Base of a stage flow's parameter model: frozen, and an unknown field is refused (``extra="forbid"``).

    A run's parameters are merged over its deployment's shallowly: a run that gives ``params`` replaces the
    deployment's whole object, so the working defaults live in the model's fields.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")


def param_error(exc: InputError, field: str) -> InputError:
    """``exc`` (a check that needs I/O, e.g. a block loaded) with its message prefixed ``params.<field>: ``, the
    field as the user wrote it; a check of a value alone belongs in the parameter model instead."""
    return type(exc)(f"params.{field}: {exc}")


def run_task(task: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a Prefect task from a stage flow, noting its state in the enclosing lifecycle stage, if any."""
    log = _ACTIVE_STAGE.get()
    return task(*args, **kwargs) if log is None else log.call(task, *args, **kwargs)


def run_stage_flow(name: str, body: Callable[..., T], *args: Any) -> T:
    """Run ``body(*args)`` as a subflow run named ``name`` of the calling flow run; return its result.

    The subflow takes no parameters and does not persist its result (the tasks inside cache their own).
    """

    def stage_body() -> T:
        return body(*args)

    stage_flow = flow(name=STAGE_FLOW_NAME, flow_run_name=name, log_prints=True, validate_parameters=False,
                      persist_result=False)(stage_body)
    return stage_flow()


class StageLog:
    """Collects per-stage status, counts, digests and wall seconds; writes ``summary.json``."""

    def __init__(self, summary_path: Path, run_id: str | None) -> None:
        self.summary_path = summary_path
        self.run_id = run_id
        self.stages: dict[str, dict[str, Any]] = {}
        self._current: dict[str, Any] | None = None
        self._enclosing: StageLog | None = None  # another log's active stage, while one of ours is open
        self._t0 = time.monotonic()

    @contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        """Time one stage; the yielded dict takes ``counts``/``digests``/``paths`` entries.

        Opened while another log's stage is active, its task runs count in that stage too, until this one ends.
        """
        record: dict[str, Any] = {"status": "running", "counts": {}, "digests": {}, "paths": {},
                                  "tasks_run": 0, "tasks_cached": 0}
        self.stages[name] = record
        outer, enclosing = self._current, self._enclosing
        active_log = _ACTIVE_STAGE.get()
        if active_log is not None and active_log is not self:
            self._enclosing = active_log
        self._current = record
        active = _ACTIVE_STAGE.set(self)
        t0 = time.monotonic()
        try:
            yield record
        except BaseException as exc:
            record["status"] = "failed"
            record["error"] = f"{type(exc).__name__}: {exc}"
            raise
        else:
            ran, cached = record["tasks_run"], record["tasks_cached"]
            record["status"] = "cached" if ran > 0 and cached == ran else "completed"
        finally:
            record["wall_s"] = round(time.monotonic() - t0, 3)
            self._current, self._enclosing = outer, enclosing
            _ACTIVE_STAGE.reset(active)
            self.write()

    def _note(self, state: State) -> None:
        """Count one ended task run in the open stage and in the enclosing log's active stage, if any."""
        if self._current is not None:
            self._current["tasks_run"] += 1
            if state.name == "Cached":
                self._current["tasks_cached"] += 1
            if self._enclosing is not None:
                self._enclosing._note(state)

    def call(self, task: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a Prefect task, note whether it was cached, return its result (raises on failure)."""
        state = task(*args, return_state=True, **kwargs)  # type: ignore[call-arg]
        self._note(state)
        return state.result()

    def gather(self, futures: list[PrefectFuture[T]]) -> list[State]:
        """Wait for submitted task runs and note them; returns their final states in order."""
        states = []
        for future in futures:
            future.wait()
            state = future.state
            self._note(state)
            states.append(state)
        return states

    def window(self, items: Iterable[Item], submit: Callable[[Item], PrefectFuture[T]],
               concurrency: int) -> Iterator[tuple[Item, State]]:
        """Yield ``(item, final state)`` of ``submit(item)`` in completion order, at most ``concurrency`` in flight.

        Raises:
            ValueError: ``concurrency`` < 1.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        done: queue.Queue = queue.Queue()
        pending = deque(items)
        in_flight = 0
        while pending or in_flight:
            while pending and in_flight < concurrency:
                item = pending.popleft()
                submit(item).add_done_callback(lambda future, item=item: done.put((item, future)))
                in_flight += 1
            item, future = done.get()
            in_flight -= 1
            # the callback can run before the Prefect state is final: gather waits for it
            yield item, self.gather([future])[0]

    def table_rows(self) -> list[dict[str, Any]]:
        """One row per stage in run order (``counts`` as ``k=v`` joined by ``, ``)."""
        return [{"stage": name, "status": st["status"], "wall_s": st.get("wall_s"),
                 "tasks_run": st["tasks_run"], "tasks_cached": st["tasks_cached"],
                 "counts": ", ".join(f"{k}={v}" for k, v in st.get("counts", {}).items()),
                 "error": st.get("error", "")} for name, st in self.stages.items()]

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        """Write ``summary.json``, then publish the stage table artifact :data:`STAGE_TABLE_KEY`."""
        from tasks.common import table_artifact

        self.write(extra)
        table_artifact(STAGE_TABLE_KEY, self.table_rows(),
                       f"Stages of this run: status (cached = every task came from Prefect's cache), "
                       f"wall seconds, counts; summary at {self.summary_path}")

    def write(self, extra: dict[str, Any] | None = None) -> None:
        """Write ``summary.json`` atomically (stages so far + total wall seconds)."""
        body: dict[str, Any] = {
            "schema_version": 1,
            "forgeflow_version": forgeflow.__version__,
            "prefect_flow_run_id": self.run_id,
            "stages": self.stages,
            "total_wall_s": round(time.monotonic() - self._t0, 3),
        }
        if extra:
            body.update(extra)
        # stages keep their run order (no key sorting)
        atomic_write_text(self.summary_path, json.dumps(body, indent=2, default=str) + "\n")
