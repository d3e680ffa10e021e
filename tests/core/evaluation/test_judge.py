"""The answer judge (forgeflow.evaluation.judge): reading answer files (rows in order, bad rows named by
file, line (or row) and field), and judging a list recorded in the store's judgments table in one
transaction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.judge import judge_answers, judgment_id, load_answer_rows
from forgeflow.ledger.store import Store


def _write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_rows_are_read_in_order_with_numbers_as_text(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl",
                  json.dumps({"question_id": "q1", "answer": 3.5, "reference": "3.5", "extra": [1]}), "",
                  json.dumps({"question_id": 2, "answer": "", "reference": "paris"}))
    assert load_answer_rows(path) == [("q1", "3.5", "3.5"), ("2", "", "paris")]  # an empty answer is wrong, not bad


def test_csv_rows_are_read_with_datasets(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.csv", "question_id,answer,reference", "q1,blue,Blue", "q2,4,4")
    assert load_answer_rows(path) == [("q1", "blue", "Blue"), ("q2", "4", "4")]


@pytest.mark.parametrize(("lines", "message"), [
    (["{not json"], r"line 1: not valid JSON"),
    (['["q1", "a", "b"]'], r"line 1: is not a JSON object with question_id, answer, reference"),
    (['{"question_id": "q1", "answer": "a"}'], r"line 1: field 'reference' is missing"),
    (['{"question_id": "q1", "answer": true, "reference": "yes"}'], r"line 1: field 'answer' is a bool, not a string"),
    (['{"question_id": " ", "answer": "a", "reference": "b"}'], r"line 1: field 'question_id' is empty"),
    (['{"question_id": "q1", "answer": "a", "reference": ""}'], r"line 1: field 'reference' is empty"),
    ([""], r"holds no rows"),
])
def test_bad_rows_name_the_line_and_field(tmp_path: Path, lines: list[str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        load_answer_rows(_write(tmp_path / "bad.jsonl", *lines))


def test_missing_file_and_unknown_suffix_are_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"answers file .*gone\.jsonl does not exist"):
        load_answer_rows(tmp_path / "gone.jsonl")
    with pytest.raises(InputError, match=r"unknown suffix '\.txt'; known: \.jsonl, \.json, \.parquet, \.csv"):
        load_answer_rows(_write(tmp_path / "a.txt", "x"))


ITEMS = [
    ("gaia-1", "The Eiffel Tower.", "eiffel tower"),
    ("gaia-2", "$1,000.50", "1000.5"),
    ("gaia-3", "red; Green ,blue", "red, green, blue"),
    ("gaia-4", "42", "41"),
]


def test_judgments_are_judged_and_appended_to_the_table(store: Store) -> None:
    records = judge_answers(ITEMS, store, job_id="qa-1", run_id="run-1")
    assert [r.correct for r in records] == [True, True, True, False]
    assert [r.rule for r in records] == ["string", "number", "list", "number"]
    rows = {r.question_id: r for r in store.judgments(job_id="qa-1")}
    assert set(rows) == {"gaia-1", "gaia-2", "gaia-3", "gaia-4"}
    assert rows["gaia-2"].normalized_answer == "1000.5" and rows["gaia-2"].answer == "$1,000.50"
    assert rows["gaia-4"].correct is False and rows["gaia-1"].run_id == "run-1"
    assert rows["gaia-1"].judgment_id == judgment_id("qa-1", "gaia-1")


def test_re_judging_a_job_updates_its_rows_and_other_jobs_are_apart(store: Store) -> None:
    judge_answers(ITEMS, store, job_id="qa-1")
    judge_answers([("gaia-4", "41", "41")], store, job_id="qa-1")
    judge_answers([("gaia-4", "40", "41")], store, job_id="qa-2")
    assert len(store.judgments(job_id="qa-1")) == 4
    assert {r.question_id: r.correct for r in store.judgments(job_id="qa-1")}["gaia-4"] is True
    assert [r.correct for r in store.judgments(job_id="qa-2")] == [False]


def test_one_bad_item_records_nothing(store: Store) -> None:
    with pytest.raises(InputError, match="question 'gaia-9'.*reference"):
        judge_answers([*ITEMS, ("gaia-9", "x", "  ")], store, job_id="qa-1")
    with pytest.raises(InputError, match="'gaia-1' appears more than once"):
        judge_answers([*ITEMS, ("gaia-1", "x", "y")], store, job_id="qa-1")
    with pytest.raises(InputError, match="empty question_id"):
        judge_answers([("", "x", "y")], store)
    with pytest.raises(InputError, match="at least one"):
        judge_answers([], store)
    assert store.judgments() == []
