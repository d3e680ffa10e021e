"""The answer judge: GAIA-style question/answer rows judged by normalised matching.

:func:`judge_answer` is GAIA's quasi-exact match (Mialon et al. 2023, "GAIA: a benchmark for General AI
Assistants", the scorer of its leaderboard) with SQuAD's article removal (Rajpurkar et al. 2016)."""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_json
from forgeflow.ledger.records import JudgmentRecord

# --- answer judge -----------------------------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b")


_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")


_PUNCT = str.maketrans("", "", string.punctuation)


def _number(text: str) -> float | None:
    """GAIA's ``normalize_number_str`` (drops ``$``, ``%``, ``,`` and whitespace), None if not a number."""
    cleaned = re.sub(r"[\s$%,]", "", text)
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _is_number(text: str) -> bool:
    stripped = text.strip()
    return _THOUSANDS.match(stripped) is not None or ("," not in stripped and _number(stripped) is not None)


def normalize_text(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    lowered = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", lowered).split())


def _format_number(value: float) -> str:
    return f"{value:.15g}"


def _match_element(answer: str, reference: str, rel_tol: float, abs_tol: float) -> tuple[bool, str, str]:
    if _is_number(reference):
        ref = _number(reference)
        got = _number(answer)
        assert ref is not None
        ok = got is not None and math.isclose(got, ref, rel_tol=rel_tol, abs_tol=abs_tol)
        return ok, (_format_number(got) if got is not None else normalize_text(answer)), _format_number(ref)
    norm_answer, norm_reference = normalize_text(answer), normalize_text(reference)
    return norm_answer == norm_reference, norm_answer, norm_reference


def judge_answer(question_id: str, answer: str, reference: str, *, job_id: str | None = None,
                 run_id: str | None = None, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> JudgmentRecord:
    """Judge a free-form answer to question ``question_id`` against a reference, GAIA style: the ``judgments``
    row (``judgment_id`` from ``job_id`` and ``question_id``, :func:`judgment_id`) whose ``rule`` (number, list
    or string) is chosen by the reference's form, ``correct`` says whether the answer matches under it, and
    ``normalized_answer`` / ``normalized_reference`` are both after normalization (numbers in %.15g form,
    lists joined with ,).

    Raises:
        InputError: ``reference`` is empty or a tolerance is negative.
        ValueError (pydantic's ValidationError): an empty ``question_id``.
    """
    if not reference.strip():
        raise InputError("reference must be a non-empty answer")
    if rel_tol < 0 or abs_tol < 0:
        raise InputError(f"tolerances must be >= 0, got rel_tol={rel_tol}, abs_tol={abs_tol}")

    def verdict(correct: bool, rule: str, normalized_answer: str, normalized_reference: str) -> JudgmentRecord:
        return JudgmentRecord(judgment_id=judgment_id(job_id, question_id), job_id=job_id, question_id=question_id,
                              answer=answer, reference=reference, correct=correct, rule=rule,
                              normalized_answer=normalized_answer, normalized_reference=normalized_reference,
                              run_id=run_id)

    if _is_number(reference):
        ok, norm_a, norm_r = _match_element(answer, reference, rel_tol, abs_tol)
        return verdict(ok, "number", norm_a, norm_r)
    if "," in reference or ";" in reference:
        ref_items = [item.strip() for item in re.split(r"[,;]", reference)]
        ans_items = [item.strip() for item in re.split(r"[,;]", answer)]
        if len(ans_items) != len(ref_items):
            return verdict(False, "list", ",".join(normalize_text(a) for a in ans_items),
                           ",".join(normalize_text(r) for r in ref_items))
        results = [_match_element(a, r, rel_tol, abs_tol) for a, r in zip(ans_items, ref_items, strict=True)]
        return verdict(all(ok for ok, _, _ in results), "list", ",".join(a for _, a, _ in results),
                       ",".join(r for _, _, r in results))
    norm_a, norm_r = normalize_text(answer), normalize_text(reference)
    return verdict(norm_a == norm_r, "string", norm_a, norm_r)


def judgment_id(job_id: str | None, question_id: str) -> str:
    """Natural key of a judgment: the first 32 hex of sha256 of ``{job_id, question_id}`` (a re-run
    of the same job re-judges in place, never duplicates)."""
    return sha256_json({"job_id": job_id, "question_id": question_id})[:32]


def judge_answers(
    items: Sequence[tuple[str, str, str]],
    store: Any,
    *,
    job_id: str | None = None,
    run_id: str | None = None,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
) -> list[JudgmentRecord]:
    """Judge ``(question_id, answer, reference)`` triples (:func:`judge_answer`) and record them in ONE transaction,
    in the order given; the rows recorded.

    Raises:
        InputError: no items, an empty or repeated question id, an empty reference or a bad tolerance
            (nothing is recorded).
    """
    if not items:
        raise InputError("judge_answers needs at least one (question_id, answer, reference) item")
    seen: set[str] = set()
    records: list[JudgmentRecord] = []
    for position, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 3:
            raise InputError(f"items[{position}] must be (question_id, answer, reference), got {item!r}")
        question_id, answer, reference = (str(v) if v is not None else "" for v in item)
        if not question_id.strip():
            raise InputError(f"items[{position}] has an empty question_id")
        if question_id in seen:
            raise InputError(f"question_id {question_id!r} appears more than once")
        seen.add(question_id)
        try:
            records.append(judge_answer(question_id, answer, reference, job_id=job_id, run_id=run_id,
                                        rel_tol=rel_tol, abs_tol=abs_tol))
        except InputError as exc:
            raise InputError(f"question {question_id!r}: {exc}") from exc
    store.record_judgments(records)
    return records


# --- answer files ------------------------------------------------------------------------------
ANSWER_FIELDS = ("question_id", "answer", "reference")
"""The fields every row of an answer file has (strings; a JSON number is read as its text)."""

DATASETS_BUILDERS = {".parquet": "parquet", ".csv": "csv"}
"""File suffix -> the HF ``datasets`` builder that reads it (``.jsonl`` / ``.json`` lines are read here)."""


def _field_text(value: Any, where: str, field: str) -> str:
    if isinstance(value, bool) or value is None or not isinstance(value, str | int | float):
        shown = "missing" if value is None else f"a {type(value).__name__}, not a string"
        raise InputError(f"{where}: field {field!r} is {shown}")
    text = value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
    if field != "answer" and not text.strip():
        raise InputError(f"{where}: field {field!r} is empty")
    return text


def _row_items(rows: Sequence[tuple[str, Any]]) -> list[tuple[str, str, str]]:
    items: list[tuple[str, str, str]] = []
    seen: dict[str, str] = {}
    for where, row in rows:
        if not isinstance(row, dict):
            raise InputError(f"{where}: is not a JSON object with {', '.join(ANSWER_FIELDS)}")
        question_id, answer, reference = (_field_text(row.get(f), where, f) for f in ANSWER_FIELDS)
        if question_id in seen:
            raise InputError(f"{where}: field 'question_id' {question_id!r} repeats {seen[question_id]}")
        seen[question_id] = where
        items.append((question_id, answer, reference))
    return items


def load_answer_rows(path: str | Path) -> list[tuple[str, str, str]]:
    """Read ``(question_id, answer, reference)`` rows (at least one) from a JSONL, parquet or CSV answer file.

    Raises:
        InputError: no file, an unknown suffix, a line not a JSON object, a missing or empty
            ``question_id`` / ``reference``, a repeated ``question_id``, or no rows (file, line and field named).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"answers file {path} does not exist")
    suffix = path.suffix.lower()
    rows: list[tuple[str, Any]] = []
    if suffix in (".jsonl", ".json"):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path} line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path} line {number}: not valid JSON ({exc.msg})") from exc
    elif suffix in DATASETS_BUILDERS:
        import datasets

        try:
            loaded = datasets.load_dataset(DATASETS_BUILDERS[suffix], data_files=str(path), split="train")
        except (ValueError, datasets.exceptions.DatasetGenerationError) as exc:
            raise InputError(f"answers file {path} cannot be read: {type(exc).__name__}: {exc}") from exc
        rows = [(f"{path} row {number}", dict(row)) for number, row in enumerate(loaded, start=1)]
    else:
        known = ", ".join([".jsonl", ".json", *DATASETS_BUILDERS])
        raise InputError(f"answers file {path}: unknown suffix {path.suffix!r}; known: {known}")
    if not rows:
        raise InputError(f"answers file {path} holds no rows")
    return _row_items(rows)


class JudgeSummary(BaseModel):
    """What the ``judge`` flow recorded."""

    model_config = ConfigDict(frozen=True)

    job_id: str = Field(description="the job the judgments were recorded under (judgments.job_id).")
    path: Path = Field(description="the answers file judged.")
    judged: int = Field(ge=0, description="rows judged (= correct + incorrect).")
    correct: int = Field(ge=0, description="rows whose answer matches the reference.")
    incorrect: int = Field(ge=0, description="the others.")
    rules: dict[str, int] = Field(default_factory=dict, description="rule (number, list, string) -> rows judged by it.")

    @classmethod
    def of(cls, job_id: str, path: Path, records: Sequence[JudgmentRecord]) -> JudgeSummary:
        """The summary of the recorded judgments."""
        rules: dict[str, int] = {}
        for record in records:
            rules[record.rule] = rules.get(record.rule, 0) + 1
        correct = sum(bool(r.correct) for r in records)
        return cls(job_id=job_id, path=path, judged=len(records), correct=correct,
                   incorrect=len(records) - correct, rules=rules)
