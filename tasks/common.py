"""Shared pieces of forgeflow's Prefect tasks: cache policy, retry condition, artifacts.

* :data:`RESUMABLE` caches on the task's inputs and source only (not the run id), so a new flow
  run resumes from results of an earlier one (FACTS.md: the default policy includes RUN_ID).
  Failed states (exceptions) are never cached by Prefect.
* :func:`retry_on_transient` lets Prefect retry only infrastructure failures marked transient in
  ``forgeflow.errors`` (registry 5xx/429, model endpoint resets); auth errors, bad input and
  deterministic failures end the task at once.
"""

from __future__ import annotations

from typing import Any

from prefect import Task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.client.schemas.objects import State, TaskRun

from forgeflow.errors import is_transient

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


def table_artifact(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """Publish ``rows`` as a Prefect table artifact (``key``: lowercase letters, digits, dashes)."""
    create_table_artifact(key=key, table=rows or [{"info": "no rows"}], description=description)


def markdown_artifact(key: str, markdown: str, description: str) -> None:
    """Publish a markdown artifact."""
    create_markdown_artifact(key=key, markdown=markdown, description=description)
