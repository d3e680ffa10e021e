"""Reading answer files for the judge: rows in order, bad rows named by file, line (or row) and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.judge import load_answer_rows


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
