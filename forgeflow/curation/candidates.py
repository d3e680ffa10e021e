"""Candidate task rows: load, validate and freeze them before any compute is spent on them.

A candidate row is what a task generator (swesmith, a SWE-bench style dataset) emits: an
``instance_id``, the ``repo`` it comes from, the bug ``patch``, optionally the environment
``image`` and a ``problem_statement``, and the test lists ``FAIL_TO_PASS`` / ``PASS_TO_PASS``
(SWE-bench's field names, kept as the row keys).

Rows come from a JSONL file (one JSON object per line) or any iterable of mappings, such as a
split of a HF ``datasets.Dataset``. Loading **collects every error** rather than stopping at the
first one, so a user fixes a generator's output in one pass: :func:`load_candidates` raises one
:class:`~forgeflow.common.errors.InputError` listing up to :data:`MAX_REPORTED_ERRORS` problems (then
how many more), each naming the row (1-based; for a file, its line number) and the field.

Test lists may also be given as a JSON-encoded string holding a list of strings, because
SWE-bench's published datasets store ``FAIL_TO_PASS``/``PASS_TO_PASS`` that way; any other string
is rejected as "not a list".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from forgeflow.common.errors import InputError
from forgeflow.curation.selection import CandidateRef

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
    """One validated candidate task (immutable).

    Attributes:
        instance_id: Unique id, at most 128 characters of ``[A-Za-z0-9._-]``, starting with a
            letter or digit.
        repo: The source repository (``owner/name`` or a project name), 1..256 characters.
        patch: The unified diff that introduces the bug (non-empty).
        image: The environment/task image reference, if the generator knows it.
        FAIL_TO_PASS: Tests that must fail with the bug and pass without it (at least one).
        PASS_TO_PASS: Tests that must pass both ways (may be empty).
        problem_statement: The issue text shown to the agent, if any.

    Test names must be non-blank and unique within each list, and no test may be in both lists
    (a test cannot both fail and pass with the bug); a violation raises ``ValidationError`` whose
    message names the test, its position and the instance id.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", str_strip_whitespace=False)

    instance_id: str = Field(min_length=1, max_length=INSTANCE_ID_MAX_CHARS)
    repo: str = Field(min_length=1, max_length=256)
    patch: str = Field(min_length=1)
    image: str | None = Field(default=None, min_length=1)
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    problem_statement: str | None = None

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
        source: A JSONL file path (blank lines are skipped; row numbers are line numbers) or an
            iterable of mappings, e.g. a HF ``datasets`` split (row numbers are 1-based
            positions). Unknown keys (``base_commit``, ``hints_text``, ...) are ignored.
        name: How the source is named in the error message (default: the path, or
            ``"candidates"``).

    Returns:
        The validated rows, in input order.

    Raises:
        InputError: one or more rows are malformed. The message names the source and lists up
            to :data:`MAX_REPORTED_ERRORS` problems as ``row N: field F: what is wrong``
            (missing ``FAIL_TO_PASS``, a test list that is not a list, a non-string test name,
            an instance id over 128 characters or outside the safe alphabet, an instance id
            that duplicates an earlier row, which that message names, a line that is not
            JSON, a blank or repeated test name within a list, a test in both lists, an
            instance id that differs from an earlier row's only by case — ids must stay distinct
            on case-insensitive filesystems and in image tags), then how many more were found.
            Messages about test names also name the row's instance id. Also raised for a
            missing file.
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
) -> list[CandidateRef]:
    """The selection view of candidates, for :func:`forgeflow.curation.selection.select_batch`.

    Args:
        candidates: Validated candidates (ids are unique if they came from
            :func:`load_candidates`).
        available_images: Image references present in the registry (pass a ``set`` for
            O(1) lookups).
        image_of: Maps a candidate to its image reference when the row does not carry one
            (e.g. a naming scheme such as the prewarm layout's tag); default: ``candidate.image``.

    Returns:
        One :class:`CandidateRef` per candidate, in input order; ``image_available`` is True
        only when the candidate's image reference is in ``available_images``.
    """
    resolve = image_of or (lambda candidate: candidate.image)
    refs: list[CandidateRef] = []
    for candidate in candidates:
        image = resolve(candidate)
        refs.append(
            CandidateRef(
                instance_id=candidate.instance_id,
                repo=candidate.repo,
                image_available=image is not None and image in available_images,
            )
        )
    return refs
