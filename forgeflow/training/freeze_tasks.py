"""RL tasks of one split of a recorded freeze, assembled by the canary's
:func:`~forgeflow.evaluation.canary.canary_tasks` (so they carry what validation recorded for the verifier).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forgeflow.common.errors import InputError
from forgeflow.curation.task_rows import TaskSource
from forgeflow.evaluation.canary import CanaryTask, canary_tasks, frozen_split
from forgeflow.training.rewards import TASK_TIMEOUT_S
from forgeflow.training.rl import RLTask


def rl_tasks_from_canary(tasks: Sequence[CanaryTask], task_timeout_s: float = TASK_TIMEOUT_S) -> list[dict[str, Any]]:
    """The :class:`~forgeflow.training.rl.RLTask` row (a dict) of each canary task, in order.

    Raises:
        InputError: a task read with a SWE-bench log parser (the RL verifier reads only forgeflow's report).
    """
    parsed = [t.instance_id for t in tasks if t.log_parser]
    if parsed:
        raise InputError(f"{len(parsed)} task(s) are read with a SWE-bench log parser, which the RL verifier does "
                         f"not take (it reads forgeflow's pytest report): {', '.join(parsed[:10])}")
    return [RLTask(instance_id=t.instance_id, image_ref=t.image_ref, problem_statement=t.problem_statement,
                   test_command=t.test_command, FAIL_TO_PASS=t.FAIL_TO_PASS, PASS_TO_PASS=t.PASS_TO_PASS,
                   task_timeout_s=task_timeout_s, pristine_duration_s=t.pristine_duration_s,
                   known_tests=t.known_tests).model_dump(mode="json") for t in tasks]


def rl_tasks_from_freeze(store: Any, freeze_name: str, split: str, source: TaskSource, default_generated: Path,
                         check_images: bool = True) -> list[dict[str, Any]]:
    """The RL task rows of split ``split`` of freeze ``freeze_name``, in the split's order.

    Raises:
        InputError: an unknown freeze or split, a bad manifest, unreadable rows, a task with a log parser.
        PreflightError: tasks without a row, not accepted in the store, or whose image is missing (all listed).
    """
    _, ids = frozen_split(store, freeze_name, split)
    loaded = source.load(default_generated, "rl-burst")
    tasks = canary_tasks(store, ids, loaded.rows, check_images=check_images, test_commands=loaded.test_commands,
                         log_parsers=loaded.log_parsers, stage="rl-burst")
    return rl_tasks_from_canary(tasks)
