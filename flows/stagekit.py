"""Bookkeeping shared by the flows: per-stage wall time, cached/completed status, summary.json.

A stage is *cached* when every task it ran came back from Prefect's cache (state name
``Cached``); it is *completed* otherwise. The summary is written atomically after every stage, so
an interrupted run still leaves what it did. :meth:`StageLog.finish` also publishes the stages as
one Prefect table artifact (key :data:`STAGE_TABLE_KEY`), the table a person opens in the UI.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from prefect.futures import PrefectFuture
from prefect.states import State

import forgeflow
from forgeflow.common.fsutil import atomic_write_text

T = TypeVar("T")

STAGE_TABLE_KEY = "lifecycle-stages"
"""Key of the stage table artifact (Prefect keys: lowercase letters, digits and dashes)."""


class StageLog:
    """Collects per-stage status, counts, digests and wall seconds; writes ``summary.json``."""

    def __init__(self, summary_path: Path, run_id: str | None) -> None:
        self.summary_path = summary_path
        self.run_id = run_id
        self.stages: dict[str, dict[str, Any]] = {}
        self._current: dict[str, Any] | None = None
        self._t0 = time.monotonic()

    @contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        """Time one stage; the yielded dict takes ``counts``/``digests``/``paths`` entries."""
        record: dict[str, Any] = {"status": "running", "counts": {}, "digests": {}, "paths": {},
                                  "tasks_run": 0, "tasks_cached": 0}
        self.stages[name] = record
        self._current = record
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
            self._current = None
            self.write()

    def _note(self, state: State) -> None:
        if self._current is not None:
            self._current["tasks_run"] += 1
            if state.name == "Cached":
                self._current["tasks_cached"] += 1

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

    def table_rows(self) -> list[dict[str, Any]]:
        """One row per stage in run order: stage, status, wall_s, tasks_run, tasks_cached, counts
        (``k=v`` joined by ``, ``) and error (empty unless the stage failed)."""
        return [{"stage": name, "status": st["status"], "wall_s": st.get("wall_s"),
                 "tasks_run": st["tasks_run"], "tasks_cached": st["tasks_cached"],
                 "counts": ", ".join(f"{k}={v}" for k, v in st.get("counts", {}).items()),
                 "error": st.get("error", "")} for name, st in self.stages.items()]

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        """Write ``summary.json`` (see :meth:`write`), then publish :meth:`table_rows` as the
        table artifact :data:`STAGE_TABLE_KEY` of the current flow run."""
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
