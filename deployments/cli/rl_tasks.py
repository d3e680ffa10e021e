"""``forgeflow rl-tasks FREEZE``: the RL task rows of a freeze's split written as a JSONL (``rl-burst``'s
``params.tasks_jsonl``), each with what validation recorded for its verifier. Reads the store only, no Prefect."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from deployments.cli.app import app, console, fail, prepare_env, read_store


@app.command("rl-tasks", short_help="Write a freeze split's RL task rows (JSONL) with their recorded known tests.")
def rl_tasks(
    freeze: str = typer.Argument(..., help="a freeze recorded in the store (`forgeflow status` names the latest)"),
    out: Path = typer.Option(..., help="the JSONL to write (atomically; an existing file is replaced)"),
    split: str = typer.Option("train", help="the freeze's split"),
    candidates_path: Optional[Path] = typer.Option(None, help="the task rows: the candidates JSONL curate validated "
                                                   "(default: the demo's generated-candidates file)"),
    generated_path: Optional[Path] = typer.Option(None, help="the task rows: a generated-candidates file"),
    check_images: bool = typer.Option(True, help="check that every task image exists (podman or its registry)"),
    verl: bool = typer.Option(False, "--verl", help="write verl's RL parquet (the ppo flow's settings.train_files / "
                              "val_files; each row's verifier spec for its reward function) instead of the JSONL"),
) -> None:
    """Write the RLTask rows of split SPLIT of freeze FREEZE to OUT, one per line: image, problem statement (never
    the patch), test command, FAIL_TO_PASS / PASS_TO_PASS, and the known tests and pristine duration (seconds)
    its validation recorded, where recorded. The same rows `rl-burst` builds from params.freeze_name; with --verl,
    as verl's parquet for the `ppo` flow. An unknown freeze or split, unreadable rows or a task that cannot run exit
    2 naming the problem."""
    prepare_env(create=False)
    from forgeflow.common.errors import InputError, PreflightError  # noqa: PLC0415
    from forgeflow.common.fsutil import atomic_write_text  # noqa: PLC0415
    from forgeflow.common.settings import home_dir  # noqa: PLC0415
    from forgeflow.curation.generated import GENERATED_FILE  # noqa: PLC0415
    from forgeflow.curation.task_rows import TaskSource  # noqa: PLC0415
    from forgeflow.training.freeze_tasks import rl_tasks_from_freeze  # noqa: PLC0415

    store = read_store()
    try:
        rows = rl_tasks_from_freeze(store, freeze, split, TaskSource(candidates_path=candidates_path,
                                                                     generated_path=generated_path),
                                    home_dir() / "demo" / GENERATED_FILE, check_images=check_images)
    except (InputError, PreflightError) as exc:
        fail(exc)
    finally:
        store.dispose()
    if verl:
        from forgeflow.training.rl import build_rl_dataset  # noqa: PLC0415
        from forgeflow.training.verl import write_verl_dataset  # noqa: PLC0415

        write_verl_dataset(build_rl_dataset(rows), out)
    else:
        atomic_write_text(out, "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    recorded = sum(bool(row.get("known_tests")) for row in rows)
    console.print(f"{out}: {len(rows)} RL task(s) of {freeze}/{split}, {recorded} with known tests recorded",
                  highlight=False, soft_wrap=True)
