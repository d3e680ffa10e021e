"""Candidate rows: malformed rows are rejected at load, each error naming its row and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.curation.candidates import (
    MAX_REPORTED_ERRORS,
    CandidateTask,
    load_candidates,
    to_candidate_refs,
)
from forgeflow.curation.selection import select_batch


def row(instance_id: str = "owner__repo-1", **overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "instance_id": instance_id,
        "repo": "owner/repo",
        "patch": "diff --git a/x.py b/x.py\n",
        "FAIL_TO_PASS": ["tests/test_x.py::test_a"],
        "PASS_TO_PASS": ["tests/test_x.py::test_b"],
    }
    base.update(overrides)
    return drop_none(base)


def drop_none(mapping: dict[str, object]) -> dict[str, object]:
    return {key: value for key, value in mapping.items() if value is not None}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def load_error(source: object) -> str:
    with pytest.raises(InputError) as info:
        load_candidates(source)  # type: ignore[arg-type]
    return str(info.value)


def test_valid_jsonl_loads_frozen_records_with_extra_keys_ignored(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            json.dumps(row("a-1", image="127.0.0.1:5702/task-00:a-1", base_commit="abc")),
            "",
            json.dumps(row("a-2", problem_statement="It breaks.")),
        ],
    )
    loaded = load_candidates(path)
    assert [c.instance_id for c in loaded] == ["a-1", "a-2"]
    assert loaded[0].image_ref == "127.0.0.1:5702/task-00:a-1"
    assert loaded[1].problem_statement == "It breaks."
    with pytest.raises(Exception):
        loaded[0].repo = "other"  # type: ignore[misc]


def test_swebench_json_encoded_test_lists_are_decoded() -> None:
    loaded = load_candidates([row(FAIL_TO_PASS='["t::a", "t::b"]', PASS_TO_PASS="[]")])
    assert loaded[0].FAIL_TO_PASS == ["t::a", "t::b"]
    assert loaded[0].PASS_TO_PASS == []


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"FAIL_TO_PASS": None}, "row 2: field FAIL_TO_PASS: missing"),
        ({"FAIL_TO_PASS": "tests/test_x.py::test_a"}, "row 2: field FAIL_TO_PASS: expected a list"),
        ({"PASS_TO_PASS": {"t": 1}}, "row 2: field PASS_TO_PASS: expected a list"),
        ({"FAIL_TO_PASS": ["ok", 7]}, "row 2: field FAIL_TO_PASS[1]: test names must be strings"),
        ({"FAIL_TO_PASS": []}, "row 2: field FAIL_TO_PASS:"),
        ({"instance_id": "x" * 129}, "row 2: field instance_id: longer than 128 characters"),
        ({"instance_id": "../etc/passwd"}, "row 2: field instance_id: must use only letters"),
        ({"instance_id": "a b"}, "row 2: field instance_id: must use only letters"),
        ({"repo": None}, "row 2: field repo: missing"),
        ({"patch": ""}, "row 2: field patch:"),
    ],
)
def test_malformed_row_is_rejected_naming_row_and_field(
    bad: dict[str, object], expected: str
) -> None:
    message = load_error([row("good-1"), drop_none({**row("bad-2"), **bad})])
    assert expected in message
    assert "1 malformed" in message


def test_instance_id_of_exactly_128_characters_is_accepted() -> None:
    assert load_candidates([row("x" * 128)])[0].instance_id == "x" * 128


def test_duplicate_instance_id_names_both_rows(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "dup.jsonl",
        [json.dumps(row("a-1")), json.dumps(row("b-1")), json.dumps(row("a-1"))],
    )
    message = load_error(path)
    assert "row 3: field instance_id: 'a-1' duplicates row 1" in message
    assert str(path) in message


def test_bad_json_line_is_reported_with_its_line_number(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [json.dumps(row("a-1")), "{not json", "[1, 2]", json.dumps(row("b-1"))],
    )
    message = load_error(path)
    assert "row 2: not valid JSON" in message
    assert "row 3: expected a JSON object, got list" in message


def test_all_errors_are_collected_and_capped_at_twenty() -> None:
    rows = [row(f"ok-{i}") for i in range(3)] + [
        row(f"bad-{i}", FAIL_TO_PASS=None) for i in range(25)
    ]
    message = load_error(rows)
    assert "25 malformed" in message
    assert "row 4: field FAIL_TO_PASS: missing" in message
    assert message.count("field FAIL_TO_PASS: missing") == MAX_REPORTED_ERRORS
    assert "... and 5 more" in message


def test_missing_file_is_an_input_error(tmp_path: Path) -> None:
    assert "does not exist" in load_error(tmp_path / "absent.jsonl")


def test_candidate_refs_feed_select_batch_only_with_available_images() -> None:
    candidates = [
        CandidateTask.model_validate(row(f"r{r}-{i}", repo=f"o/r{r}", image=f"img:r{r}-{i}"))
        for r in range(3)
        for i in range(2)
    ]
    candidates.append(CandidateTask.model_validate(row("noimg-1", repo="o/r9")))
    available = {"img:r0-0", "img:r0-1", "img:r1-0"}
    refs = to_candidate_refs(candidates, available)
    assert {r.instance_id for r in refs if r.image_available} == {"r0-0", "r0-1", "r1-0"}
    batch = select_batch(refs, processed=set(), accepted_per_repo={}, batch_size=10)
    assert sorted(batch) == ["r0-0", "r0-1", "r1-0"]
    named = to_candidate_refs(
        candidates, {"tag-noimg-1"}, image_of=lambda c: f"tag-{c.instance_id}"
    )
    assert [r.instance_id for r in named if r.image_available] == ["noimg-1"]


def test_a_folder_or_a_non_utf8_file_is_named_as_bad_input(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is a folder"):
        load_candidates(tmp_path)
    binary = tmp_path / "candidates.jsonl"
    binary.write_bytes(b'{"instance_id": "a"}\n\xff\xfe\x00garbage\n')
    with pytest.raises(InputError, match=r"candidates.jsonl is not UTF-8 text"):
        load_candidates(binary)


def test_blank_and_repeated_test_names_are_named_with_row_and_instance(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "names.jsonl",
        [
            json.dumps(row("ok-1")),
            json.dumps(row("empty-1", FAIL_TO_PASS=["t::a", ""])),
            json.dumps(row("blank-1", PASS_TO_PASS=["  "])),
            json.dumps(row("dup-1", FAIL_TO_PASS=["t::a", "t::b", "t::a"])),
            json.dumps(row("dup-2", PASS_TO_PASS=json.dumps(["t::p", "t::p"]))),  # SWE-bench's string form
        ],
    )
    message = load_error(path)
    assert str(path) in message and "4 malformed" in message
    assert "row 2: field FAIL_TO_PASS: empty test name '' at [1] (instance_id 'empty-1')" in message
    assert "row 3: field PASS_TO_PASS: empty test name '  ' at [0] (instance_id 'blank-1')" in message
    assert "row 4: field FAIL_TO_PASS: test name 't::a' at [2] repeats [0] (instance_id 'dup-1')" in message
    assert "row 5: field PASS_TO_PASS: test name 't::p' at [1] repeats [0] (instance_id 'dup-2')" in message
    assert "row 1" not in message  # the good row is not blamed


def test_a_test_in_both_lists_is_named_with_row_and_instance(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "both.jsonl",
        [json.dumps(row("both-1", FAIL_TO_PASS=["t::a", "t::b"], PASS_TO_PASS=["t::c", "t::b"]))],
    )
    message = load_error(path)
    assert str(path) in message
    assert "row 1: field FAIL_TO_PASS/PASS_TO_PASS: test name 't::b' at PASS_TO_PASS[1] is also " \
           "FAIL_TO_PASS[1] (instance_id 'both-1')" in message


def test_instance_ids_that_differ_only_by_case_collide(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "case.jsonl",
        [json.dumps(row("Owner__Repo-1")), json.dumps(row("b-1")), json.dumps(row("owner__repo-1")),
         json.dumps(row("c-1", FAIL_TO_PASS=[""]))],
    )
    message = load_error(path)
    assert str(path) in message and "2 malformed" in message  # every bad row still reported
    assert "row 3: field instance_id: 'owner__repo-1' differs only by case from 'Owner__Repo-1' (row 1)" in message
    assert "row 4: field FAIL_TO_PASS: empty test name '' at [0] (instance_id 'c-1')" in message
    assert [c.instance_id for c in load_candidates([row("Owner__Repo-1"), row("b-1")])] == ["Owner__Repo-1", "b-1"]
