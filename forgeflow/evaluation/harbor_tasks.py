"""The Harbor tasks of a frozen split: what :func:`forgeflow.evaluation.harbor.export_split` needs,
assembled from the store and the task rows (the ``harbor-export`` flow's inputs)."""

from __future__ import annotations

from collections.abc import Sequence

from forgeflow.common.task import Task
from forgeflow.curation.task_rows import TaskRows
from forgeflow.evaluation.canary import accepted_row, refuse_problems
from forgeflow.evaluation.harbor import export_problem
from forgeflow.ledger import store as ledger

__all__ = ["PYTEST_LOG_PARSERS", "harbor_tasks"]

PYTEST_LOG_PARSERS = frozenset({None, "parse_log_pytest"})
"""Log parsers whose output the exported ``tests/grade.py`` (SWE-bench's ``parse_log_pytest``) reads."""


def harbor_tasks(store: ledger.Store, instance_ids: Sequence[str], loaded: TaskRows) -> list[Task]:
    """One :class:`~forgeflow.common.task.Task` per id, in order (image: the row's, else the store's).

    Raises:
        PreflightError: ids without a row, not accepted (status given), without an image or test command, with
            a log parser other than pytest's, or not exportable (:func:`forgeflow.evaluation.harbor.export_problem`):
            every problem listed, before anything is written.
    """
    by_id = {row.instance_id: row for row in loaded.rows}
    problems: list[str] = []
    out: list[Task] = []
    for instance_id in instance_ids:
        found = accepted_row(store, instance_id, by_id, loaded.test_commands, str(loaded.source))
        if isinstance(found, str):
            problems.append(found)
            continue
        row, task, image, command = found
        parser = loaded.log_parsers.get(instance_id)
        if parser not in PYTEST_LOG_PARSERS:
            problems.append(f"{instance_id}: its tests are read with {parser}; the Harbor grader reads pytest -rA "
                            "output only")
            continue
        exported = Task(instance_id=instance_id, image_ref=image, patch=row.patch, FAIL_TO_PASS=task.FAIL_TO_PASS,
                        PASS_TO_PASS=task.PASS_TO_PASS, test_command=command, repo=row.repo,
                        problem_statement=getattr(row, "problem_statement", None) or None)
        if (problem := export_problem(exported)) is not None:
            problems.append(problem)
            continue
        out.append(exported)
    refuse_problems(problems, f"harbor-export: {len(problems)} of {len(instance_ids)} task(s) cannot be exported")
    return out
