"""The answer judge applied to a list and recorded in the store's judgments table in one transaction."""

from __future__ import annotations

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.judge import judge_answers, judgment_id
from forgeflow.ledger.store import Store

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
