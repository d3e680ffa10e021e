"""RL tasks from a freeze: the :class:`forgeflow.training.rl.RLTask` rows of one split of a recorded freeze.

The ``rl-burst`` flow takes its tasks from a JSONL file or from a freeze, as the canary does: the
freeze's split (verified against the store's digest, :func:`forgeflow.evaluation.canary.frozen_split`),
the task rows (:class:`forgeflow.curation.task_rows.TaskSource`: patches, task images, test commands)
and each task's accepted validation in the store, assembled by the canary's own
:func:`forgeflow.evaluation.canary.canary_tasks`. So an RL task carries what validation recorded for
its verifier: FAIL_TO_PASS / PASS_TO_PASS, the known test ids (a run that reports another is
tampering) and the pristine (Oracle) duration (the floor of the training timeout, and what attributes a
timeout to the submission). The model sees the task's problem statement, never its patch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.curation.task_rows import TaskSource
from forgeflow.evaluation.canary import CanaryTask, canary_tasks, frozen_split
from forgeflow.training.rewards import TASK_TIMEOUT_S
from forgeflow.training.rl import RLTask


class FreezeSplit(BaseModel):
    """Where an RL burst's tasks come from when not from a JSONL: one split of a recorded freeze and its task rows.

    Attributes:
        freeze_name: a freeze recorded in the store.
        split: the freeze's split (default ``train``).
        source: the task rows (:class:`forgeflow.curation.task_rows.TaskSource`, as the canary flow takes them).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    freeze_name: str = Field(min_length=1)
    split: str = Field("train", min_length=1)
    source: TaskSource = TaskSource()


def rl_tasks_from_canary(tasks: Sequence[CanaryTask], task_timeout_s: float = TASK_TIMEOUT_S) -> list[dict[str, Any]]:
    """The :class:`~forgeflow.training.rl.RLTask` row (as a dict, what ``rl-burst`` trains on) of each canary task.

    Args:
        tasks: canary tasks (:func:`forgeflow.evaluation.canary.canary_tasks`), in order.
        task_timeout_s: each task's original per-task timeout, seconds (default SWE-smith's 3000 s; training
            runs the tests for it x the burst's multiplier).

    Returns:
        One row per task, in order: id, image, problem statement, test command, FAIL_TO_PASS / PASS_TO_PASS,
        ``task_timeout_s``, and ``pristine_duration_s`` / ``known_tests`` where recorded.

    Raises:
        InputError: a task read with a SWE-bench log parser (the RL verifier reads forgeflow's pytest report
            only; every such task named).
    """
    parsed = [t.instance_id for t in tasks if t.log_parser]
    if parsed:
        raise InputError(f"{len(parsed)} task(s) are read with a SWE-bench log parser, which the RL verifier does "
                         f"not take (it reads forgeflow's pytest report): {', '.join(parsed[:10])}")
    return [RLTask(instance_id=t.instance_id, image_ref=t.image_ref, problem_statement=t.problem_statement,
                   test_command=t.test_command, fail_to_pass=tuple(t.fail_to_pass), pass_to_pass=tuple(t.pass_to_pass),
                   task_timeout_s=task_timeout_s, pristine_duration_s=t.pristine_duration_s,
                   known_tests=t.known_tests).model_dump(mode="json") for t in tasks]


def rl_tasks_from_freeze(store: Any, freeze_name: str, split: str, source: TaskSource, default_generated: Path,
                         check_images: bool = True) -> list[dict[str, Any]]:
    """The RL task rows of split ``split`` of freeze ``freeze_name``: :func:`rl_tasks_from_canary` of its canary tasks.

    Args:
        store: the ledger (:class:`forgeflow.ledger.store.Store`) recording the freeze and the tasks' validation.
        freeze_name: a freeze recorded in the store.
        split: one of its splits (``train``, ``validation``, ``test``).
        source: the task rows (patches, task images, test commands), as the canary flow takes them.
        default_generated: the generated-candidates file read when ``source`` names none.
        check_images: check that every task image exists (podman or its registry).

    Returns:
        One row per task of the split, in the split's order.

    Raises:
        InputError: an unknown freeze or split, a manifest that fails verification, rows that cannot be read,
            a task read with a log parser (:func:`rl_tasks_from_canary`).
        PreflightError: tasks without a row, not accepted in the store, or whose image is missing (all listed).
    """
    _, ids = frozen_split(store, freeze_name, split)
    loaded = source.load(default_generated, "rl-burst")
    tasks = canary_tasks(store, ids, loaded.rows, check_images=check_images, test_commands=loaded.test_commands,
                         log_parsers=loaded.log_parsers, stage="rl-burst")
    return rl_tasks_from_canary(tasks)
