"""The task rows a stage runs on: the user's candidates JSONL or the lifecycle's generated file.

Two formats, one loader (the ``curate`` and ``canary`` flows read both the same way):

* the user's own rows (:func:`forgeflow.curation.candidates.load_candidates`: ``instance_id``,
  ``repo``, ``patch``, ``image``, ``FAIL_TO_PASS`` / ``PASS_TO_PASS``, ``problem_statement``),
  with an optional ``test_command`` key per row;
* the lifecycle's generated candidates (:mod:`forgeflow.curation.generated`), which carry their
  task image, image id and test command.

A row's test command is its own ``test_command``, else the ``test_commands`` mapping's entry for
its repository, else the pinned project's (``forgeflow/data/projects.json``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from forgeflow.common.errors import InputError
from forgeflow.curation.candidates import CandidateTask, load_candidates
from forgeflow.curation.generated import GeneratedTask, load_generated
from forgeflow.registry import projects


class TaskRows(BaseModel):
    """Loaded task rows with what each needs to run.

    Attributes:
        rows: the rows, in file order.
        test_commands: instance id -> the test command its trials run in ``/testbed``.
        image_ids: instance id -> the local image id (64 hex) when the file records it, else None.
        source: the file read.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    rows: list[CandidateTask | GeneratedTask]
    test_commands: dict[str, str]
    image_ids: dict[str, str | None]
    source: Path


def _candidate_commands(path: Path, rows: list[CandidateTask], given: Mapping[str, str] | None) -> dict[str, str]:
    per_row: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            raw = json.loads(line)
            if isinstance(raw.get("test_command"), str) and raw["test_command"].strip():
                per_row[raw["instance_id"]] = raw["test_command"]
    out: dict[str, str] = {}
    lacking: set[str] = set()
    for row in rows:
        command = per_row.get(row.instance_id) or (given or {}).get(row.repo)
        if command is None:
            try:
                command = projects.get_project(row.repo).test_command
            except InputError:
                lacking.add(row.repo)
                continue
        out[row.instance_id] = command
    if lacking:
        raise InputError(f"{path}: no test_command for repos {sorted(lacking)[:20]}: give it per row "
                         "(key test_command) or in the test_commands parameter (repo -> command)")
    return out


def load_task_rows(candidates_path: Path | None, generated_path: Path | None, default_generated: Path,
                   test_commands: Mapping[str, str] | None = None, stage: str = "curate") -> TaskRows:
    """Read the rows of ``candidates_path`` (the user's JSONL) or of ``generated_path`` (default
    ``default_generated``, what ``forgeflow demo`` writes).

    Args:
        candidates_path: the user's candidates JSONL, or None.
        generated_path: a generated-candidates file, or None for ``default_generated``; only when
            ``candidates_path`` is None.
        default_generated: the generated file read when neither path is given.
        test_commands: repo -> test command, for repositories that are not pinned projects (for
            generated rows: overrides the row's command).
        stage: the stage named in error messages.

    Raises:
        InputError: both paths given, no file at the path, a malformed row (named by line), a
            repository without a test command.
    """
    if candidates_path is not None and generated_path is not None:
        raise InputError(f"{stage}: give candidates_path ({candidates_path}) or generated_path ({generated_path}), "
                         "not both")
    if candidates_path is not None:
        rows = list(load_candidates(candidates_path))
        return TaskRows(rows=rows, test_commands=_candidate_commands(Path(candidates_path), rows, test_commands),
                        image_ids={r.instance_id: None for r in rows}, source=Path(candidates_path))
    path = Path(generated_path or default_generated)
    if not path.is_file():
        raise InputError(f"{stage}: no candidates file at {path}: run the lifecycle (`forgeflow demo`) to write it, "
                         "or give candidates_path (the candidates JSONL) or generated_path")
    generated = load_generated(path)
    return TaskRows(rows=list(generated),
                    test_commands={r.instance_id: (test_commands or {}).get(r.repo, r.test_command) for r in generated},
                    image_ids={r.instance_id: r.image_id for r in generated}, source=path)
