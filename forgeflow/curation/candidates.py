"""Candidate task rows: load, validate and freeze them before any compute is spent on them.

Loading collects every error (up to :data:`MAX_REPORTED_ERRORS`) so a user fixes a generator's output
in one pass. Test lists may be JSON-encoded strings, as SWE-bench's published datasets store them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from forgeflow.common.errors import InputError
from forgeflow.curation.freeze import TaskRef

INSTANCE_ID_MAX_CHARS = 128
"""Longest accepted instance id (ids become container tags, file names and store keys)."""

INSTANCE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""Safe instance-id alphabet (``fullmatch``): letters, digits, ``.``, ``_``, ``-``; no leading
punctuation. Covers SWE-bench (``astropy__astropy-12907``) and swesmith
(``owner__repo.abc123.func_pm_op_change__x1y2``) ids."""

MAX_REPORTED_ERRORS = 20
"""How many row errors one :class:`InputError` lists before summarising the rest."""

_TEST_LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")


class CandidateTask(BaseModel):
    """One validated candidate task (immutable); SWE-bench's field names.

    Test names must be non-blank and unique within each list, and no test may be in both lists; a
    violation raises ``ValidationError`` naming the test, its position and the instance id.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", str_strip_whitespace=False)

    instance_id: str = Field(min_length=1, max_length=INSTANCE_ID_MAX_CHARS,
        description="unique id of [A-Za-z0-9._-], starting with a letter or digit")
    repo: str = Field(min_length=1, max_length=256, description="the source repository (owner/name or a project name)")
    patch: str = Field(min_length=1, description="the unified diff that introduces the bug")
    image_ref: str | None = Field(default=None, min_length=1, validation_alias=AliasChoices("image_ref", "image"),
        description="the environment/task image reference, if the generator knows it")
    FAIL_TO_PASS: list[str] = Field(min_length=1, description="tests that must fail with the bug and pass without it")
    PASS_TO_PASS: list[str] = Field(default_factory=list, description="tests that must pass both ways")
    problem_statement: str | None = Field(None, description="the issue text shown to the agent, if any")

    @field_validator("instance_id")
    @classmethod
    def _safe_instance_id(cls, value: str) -> str:
        if not INSTANCE_ID_PATTERN.fullmatch(value):
            raise ValueError(
                "must use only letters, digits, '.', '_' and '-' and start with a letter or digit"
            )
        return value

    @field_validator(*_TEST_LIST_FIELDS, mode="before")
    @classmethod
    def _decode_json_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                decoded = json.loads(value)
            except json.JSONDecodeError:
                decoded = None
            if not isinstance(decoded, list):
                raise ValueError(f"expected a list of test names, got a string ({_preview(value)})")
            return decoded
        if value is not None and not isinstance(value, list | tuple):
            raise ValueError(f"expected a list of test names, got {type(value).__name__}")
        return value

    @field_validator(*_TEST_LIST_FIELDS)
    @classmethod
    def _distinct_test_names(cls, value: list[str], info: ValidationInfo) -> list[str]:
        problems: list[str] = []
        first: dict[str, int] = {}
        for index, test in enumerate(value):
            if not test.strip():
                problems.append(f"empty test name {test!r} at [{index}]")
            elif test in first:
                problems.append(f"test name {test!r} at [{index}] repeats [{first[test]}]")
            else:
                first[test] = index
        if problems:
            raise ValueError("; ".join(problems) + _of_instance(info.data.get("instance_id")))
        return value

    @model_validator(mode="after")
    def _fail_xor_pass(self) -> CandidateTask:
        in_fail = {test: index for index, test in enumerate(self.FAIL_TO_PASS)}
        both = [
            f"test name {test!r} at PASS_TO_PASS[{index}] is also FAIL_TO_PASS[{in_fail[test]}]"
            for index, test in enumerate(self.PASS_TO_PASS)
            if test in in_fail
        ]
        if both:
            raise ValueError("; ".join(both) + _of_instance(self.instance_id)
                             + ": a test cannot both fail and pass with the bug")
        return self


def _of_instance(instance_id: object) -> str:
    return f" (instance_id {instance_id!r})" if isinstance(instance_id, str) else ""


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_errors(row_no: int, exc: ValidationError) -> list[str]:
    messages: list[str] = []
    for error in exc.errors(include_url=False):
        loc = error["loc"]
        field = str(loc[0]) if loc else "FAIL_TO_PASS/PASS_TO_PASS"  # from the model validator
        for part in loc[1:]:
            field += f"[{part}]" if isinstance(part, int) else f".{part}"
        if error["type"] == "missing":
            detail = "missing"
        elif len(loc) == 2 and isinstance(loc[1], int) and loc[0] in _TEST_LIST_FIELDS:
            detail = (
                f"test names must be strings, got {type(error['input']).__name__} "
                f"{_preview(error['input'])}"
            )
        else:
            detail = str(error["msg"]).removeprefix("Value error, ")
            if error["type"] == "string_too_long" and field == "instance_id":
                detail = (
                    f"longer than {INSTANCE_ID_MAX_CHARS} characters "
                    f"({len(error['input'])} characters)"
                )
        messages.append(f"row {row_no}: field {field}: {detail}")
    return messages


def _rows_from_jsonl(path: Path, errors: list[str]) -> Iterable[tuple[int, Any]]:
    try:
        handle = path.open(encoding="utf-8")
    except FileNotFoundError as exc:
        raise InputError(f"candidate file {path} does not exist") from exc
    except IsADirectoryError as exc:
        raise InputError(f"candidate file {path} is a folder, not a JSON-lines file") from exc
    with handle:
        line_no = 0
        try:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as exc:
                    errors.append(f"row {line_no}: not valid JSON: {exc.msg} (column {exc.colno})")
        except UnicodeDecodeError as exc:
            raise InputError(f"candidate file {path} is not UTF-8 text (after row {line_no}): {exc.reason}") from exc


def load_candidates(
    source: str | Path | Iterable[Mapping[str, Any]], *, name: str | None = None
) -> list[CandidateTask]:
    """Load and validate candidate rows, collecting every error before failing.

    Args:
        source: a JSONL file (row numbers are line numbers) or an iterable of mappings such as a HF
            ``datasets`` split; unknown keys are ignored.
        name: how the source is named in the error message (default: the path, or ``"candidates"``).

    Raises:
        InputError: a missing file, or malformed rows: up to :data:`MAX_REPORTED_ERRORS` problems as
            ``row N: field F: what is wrong`` (then how many more), including instance ids that differ
            from an earlier row's only by case (they must stay distinct on case-insensitive
            filesystems and in image tags).
    """
    errors: list[str] = []
    rows: Iterable[tuple[int, Any]]
    if isinstance(source, str | Path):
        label = name or str(source)
        rows = _rows_from_jsonl(Path(source), errors)
    else:
        label = name or "candidates"
        rows = enumerate(source, start=1)

    loaded: list[CandidateTask] = []
    first_row: dict[str, int] = {}
    first_folded: dict[str, tuple[int, str]] = {}  # lower-cased id -> (row, id as written)
    for row_no, row in rows:
        if not isinstance(row, Mapping):
            errors.append(f"row {row_no}: expected a JSON object, got {type(row).__name__}")
            continue
        try:
            candidate = CandidateTask.model_validate(dict(row))
        except ValidationError as exc:
            errors.extend(_field_errors(row_no, exc))
            raw_id = row.get("instance_id")
            if isinstance(raw_id, str):
                first_row.setdefault(raw_id, row_no)
                first_folded.setdefault(raw_id.lower(), (row_no, raw_id))
            continue
        earlier = first_row.get(candidate.instance_id)
        if earlier is not None:
            errors.append(
                f"row {row_no}: field instance_id: {candidate.instance_id!r} duplicates row "
                f"{earlier}"
            )
            continue
        folded = first_folded.get(candidate.instance_id.lower())
        if folded is not None:
            errors.append(
                f"row {row_no}: field instance_id: {candidate.instance_id!r} differs only by case "
                f"from {folded[1]!r} (row {folded[0]}); such ids collide on case-insensitive "
                "filesystems and in image tags"
            )
            continue
        first_row[candidate.instance_id] = row_no
        first_folded[candidate.instance_id.lower()] = (row_no, candidate.instance_id)
        loaded.append(candidate)

    if errors:
        shown = errors[:MAX_REPORTED_ERRORS]
        more = len(errors) - len(shown)
        tail = f"\n  ... and {more} more" if more else ""
        raise InputError(
            f"{label}: {len(errors)} malformed candidate row error(s):\n  "
            + "\n  ".join(shown)
            + tail
        )
    return loaded


def to_candidate_refs(
    candidates: Iterable[CandidateTask],
    available_images: Collection[str],
    image_of: Callable[[CandidateTask], str | None] | None = None,
) -> list[TaskRef]:
    """The selection view of candidates, for :func:`forgeflow.curation.selection.select_batch`, in input order.

    Args:
        available_images: image references present in the registry (a ``set`` for O(1) lookups).
        image_of: a candidate's image reference when the row carries none; default ``candidate.image_ref``.
    """
    resolve = image_of or (lambda candidate: candidate.image_ref)
    refs: list[TaskRef] = []
    for candidate in candidates:
        image = resolve(candidate)
        refs.append(
            TaskRef(
                instance_id=candidate.instance_id,
                repo=candidate.repo,
                image_available=image is not None and image in available_images,
            )
        )
    return refs
