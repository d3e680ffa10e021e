"""The lifecycle's generated-candidates file: written atomically, read back, bad rows named."""

from __future__ import annotations

import json

import pytest

from forgeflow.common.errors import InputError
from forgeflow.curation.generated import (
    GeneratedTask,
    load_generated,
    merge_generated,
    write_generated,
)

PATCH = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def _row(n: int) -> dict:
    return {"instance_id": f"proj.func_pm_op_swap__abcd{n:04d}", "repo": "proj", "patch": PATCH,
            "modifier": "func_pm_op_swap", "file_path": "m.py", "func_name": "f",
            "image": f"localhost/forgeflow/task:t{n}", "test_command": "python3 -m pytest -rA"}


def test_write_then_load_gives_the_same_rows(tmp_path) -> None:
    rows = [GeneratedTask(**_row(n)) for n in range(3)]
    path = write_generated(tmp_path / "candidates.jsonl", rows)
    assert load_generated(path) == rows
    assert [json.loads(line)["instance_id"] for line in path.read_text().splitlines()] == [r.instance_id for r in rows]


def test_bad_rows_are_all_named_with_their_line_and_field(tmp_path) -> None:
    bad = _row(1) | {"test_command": ""}
    missing = {k: v for k, v in _row(2).items() if k != "image"}
    path = tmp_path / "candidates.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (_row(0), bad, missing, _row(0))) + "\n")
    with pytest.raises(InputError) as err:
        load_generated(path)
    text = str(err.value)
    assert "3 malformed" in text
    assert "row 2: field test_command" in text and "row 3: field image" in text
    assert "row 4: field instance_id" in text and "duplicates row 1" in text


def test_missing_file_says_so(tmp_path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        load_generated(tmp_path / "nope.jsonl")


def test_a_later_run_adds_its_rows_and_keeps_the_earlier_ones(tmp_path) -> None:
    """A second demo with other parameters must not drop the candidates an earlier freeze refers to."""
    path = tmp_path / "candidates.jsonl"
    first = [GeneratedTask(**_row(n)) for n in range(3)]
    merge_generated(path, first)
    rebuilt = GeneratedTask(**_row(1) | {"image": "localhost/forgeflow/task:rebuilt"})
    merge_generated(path, [rebuilt, GeneratedTask(**_row(7))])
    assert load_generated(path) == [first[0], rebuilt, first[2], GeneratedTask(**_row(7))]


def test_merging_into_a_malformed_file_is_refused_and_writes_nothing(tmp_path) -> None:
    path = tmp_path / "candidates.jsonl"
    path.write_text(json.dumps(_row(0) | {"image": ""}) + "\n")
    before = path.read_bytes()
    with pytest.raises(InputError, match="row 1: field image"):
        merge_generated(path, [GeneratedTask(**_row(1))])
    assert path.read_bytes() == before
