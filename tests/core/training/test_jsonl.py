"""JSONL training inputs: SFT chat rows and RL task rows, each bad line named by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.training.burst import build_sft_dataset
from forgeflow.training.jsonl import read_rl_jsonl, read_sft_jsonl

CHAT = [{"role": "user", "content": "fix add"}, {"role": "assistant", "content": "--- a/x\n+++ b/x"}]
TASK = {"instance_id": "calc-1", "image_ref": "localhost/calc:1", "problem_statement": "add fails",
        "test_command": "pytest -rA", "fail_to_pass": ["t::a"], "verifier_timeout_s": 60.0}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sft_rows_get_ids_and_source_and_build_a_dataset(tmp_path: Path) -> None:
    path = _write(tmp_path / "chats.jsonl", [json.dumps({"messages": CHAT}), "",
                                             json.dumps({"messages": CHAT, "instance_id": "mine", "source": "team"})])
    samples = read_sft_jsonl(path)
    assert [(s["instance_id"], s["source"]) for s in samples] == [("chats:1", "jsonl"), ("mine", "team")]
    assert len(build_sft_dataset(samples).dataset) == 2


@pytest.mark.parametrize(("line", "message"), [
    ('{"messages": []}', "line 2: messages must be a non-empty list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"line 2: messages\[0\].role must be one of"),
    ('[1, 2]', "line 2 is a JSON list, not an object"),
    ('{"messages": ', "line 2 is not JSON"),
])
def test_a_bad_sft_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path / "chats.jsonl", [json.dumps({"messages": CHAT}), line])
    with pytest.raises(InputError, match=message):
        read_sft_jsonl(path)


def test_rl_rows_validate_as_tasks(tmp_path: Path) -> None:
    path = _write(tmp_path / "tasks.jsonl", [json.dumps(TASK), json.dumps({**TASK, "instance_id": "calc-2"})])
    assert [t["instance_id"] for t in read_rl_jsonl(path)] == ["calc-1", "calc-2"]
    bad = _write(tmp_path / "bad.jsonl", [json.dumps({**TASK, "fail_to_pass": []})])
    with pytest.raises(InputError, match="bad.jsonl line 1 is not an RL task: .*nothing to grade"):
        read_rl_jsonl(bad)
    with pytest.raises(InputError, match="is not a file"):
        read_rl_jsonl(tmp_path / "missing.jsonl")
