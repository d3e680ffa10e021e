"""The candidates the lifecycle generated, with their task images: the file ``curate`` reads.

:func:`merge_generated` adds the generate and prewarm stages' rows to ``<output_dir>/candidates.jsonl``
(:data:`GENERATED_FILE`; earlier runs' rows kept); :func:`build_generated` makes the same rows without
the lifecycle, for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import AliasChoices, Field, ValidationError

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import atomic_write_text, read_jsonl_objects
from forgeflow.common.task import Task
from forgeflow.curation import bugs
from forgeflow.registry import images, projects

GENERATED_FILE = "candidates.jsonl"
"""Name of the file in the lifecycle's output folder."""

MAX_REPORTED_ERRORS = 20
"""How many row errors one :class:`InputError` lists."""


class GeneratedTask(bugs.Candidate, Task):
    """A generated candidate as a :class:`~forgeflow.common.task.Task` (no tests until validation) whose local
    task image has its bug applied at ``/testbed``; written without the fields still at their defaults."""

    image_ref: str = Field(min_length=1, validation_alias=AliasChoices("image_ref", "image"),
        description="the local task image (localhost/forgeflow/task:...), present after the registries stop")
    image_id: str | None = Field(default=None, min_length=1,
        description="its local image id (sha256 hex), when known; keys validation caches")
    registry_ref: str | None = Field(default=None, min_length=1,
        description="where the lifecycle pushed it (host:port/task-NN:tag), if it did")
    registry_digest: str | None = Field(default=None, min_length=1,
        description="the registry's manifest digest of that push, if any")
    test_command: str = Field(min_length=1,
        description="the project's test command (pytest -rA output, run in /testbed)")


def write_generated(path: str | Path, rows: Iterable[GeneratedTask]) -> Path:
    """Write ``rows`` as JSON lines, atomically (temp + fsync + rename); returns the path."""
    text = "".join(row.model_dump_json(exclude_defaults=True) + "\n" for row in rows)
    return atomic_write_text(path, text)


def merge_generated(path: str | Path, rows: Iterable[GeneratedTask]) -> Path:
    """Add ``rows`` to the file at ``path`` (created if missing), atomically; returns the path.

    A row with an ``instance_id`` already there replaces it in place; every other row is kept, so a later
    run never drops the candidates an earlier freeze refers to.

    Raises:
        InputError: the existing file is malformed (nothing is written).
    """
    new = {row.instance_id: row for row in rows}
    kept = load_generated(path) if Path(path).exists() else []
    merged = [new.pop(row.instance_id, row) for row in kept] + list(new.values())
    return write_generated(path, merged)


def load_generated(path: str | Path) -> list[GeneratedTask]:
    """Read and validate a file written by :func:`write_generated`, collecting every error.

    Raises:
        InputError: the file is missing, a line is not a JSON object, or rows are malformed (up to
            :data:`MAX_REPORTED_ERRORS` problems as ``row N: field F: what``).
    """
    errors: list[str] = []
    rows: list[GeneratedTask] = []
    first: dict[str, int] = {}
    for line_no, raw in read_jsonl_objects(path, "generated-candidates file"):
        try:
            row = GeneratedTask.model_validate(raw)
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                field = ".".join(str(part) for part in err["loc"]) or "?"
                errors.append(f"row {line_no}: field {field}: {err['msg']}")
            continue
        if row.instance_id in first:
            errors.append(f"row {line_no}: field instance_id: {row.instance_id!r} duplicates row "
                          f"{first[row.instance_id]}")
            continue
        first[row.instance_id] = line_no
        rows.append(row)
    if errors:
        more = len(errors) - MAX_REPORTED_ERRORS
        raise InputError(f"{path}: {len(errors)} malformed generated-candidate row error(s):\n  "
                         + "\n  ".join(errors[:MAX_REPORTED_ERRORS]) + (f"\n  ... and {more} more" if more > 0 else ""))
    return rows


def build_generated(project_names: Sequence[str], work_dir: str | Path, per_project: int,
                    seed: int = 0) -> list[GeneratedTask]:
    """Generate candidates and build their local task images the way the lifecycle does.

    Images are content-keyed, so existing ones are reused (seconds when the demo ran before).

    Returns:
        The rows, project by project in rank order (no ``registry_ref``).

    Raises:
        InputError: an unknown project or ``per_project`` < 1.
        ImageBuildError / InfraError: from podman.
    """
    if per_project < 1:
        raise InputError(f"per_project must be >= 1, got {per_project}")
    base = images.ensure_base_image()
    rows: list[GeneratedTask] = []
    for name in project_names:
        project = projects.get_project(name)
        checkout = projects.prepare_checkout(project, Path(work_dir) / "checkouts" / name)
        env = images.build_env_image(project, checkout, base.name)
        for candidate in bugs.generate_candidates(name, checkout, project.source_path, per_project, seed):
            task = images.build_task_image(env.name, candidate.instance_id, candidate.patch)
            rows.append(GeneratedTask(**candidate.model_dump(), image_ref=task.name, image_id=task.image_id,
                                      test_command=project.test_command))
    return rows
