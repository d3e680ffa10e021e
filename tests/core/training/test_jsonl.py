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
        "test_command": "pytest -rA", "FAIL_TO_PASS": ["t::a"], "verifier_timeout_s": 60.0}


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
    bad = _write(tmp_path / "bad.jsonl", [json.dumps({**TASK, "FAIL_TO_PASS": [], "PASS_TO_PASS": []})])
    with pytest.raises(InputError, match="bad.jsonl line 1 is not an RL task: FAIL_TO_PASS: Value error, no test"):
        read_rl_jsonl(bad)
    with pytest.raises(InputError, match="is not a file"):
        read_rl_jsonl(tmp_path / "missing.jsonl")


def test_an_rl_task_that_would_reward_doing_nothing_is_refused(tmp_path: Path) -> None:
    """A task with no FAIL_TO_PASS test rewards a completion that changes nothing (every remaining test
    passes): refused, whether the list is empty, missing, or misspelt (an unknown field is refused, naming the
    field it means)."""
    only_p2p = {**TASK, "FAIL_TO_PASS": [], "PASS_TO_PASS": ["t::b"]}
    misspelt = {k: v for k, v in TASK.items() if k != "FAIL_TO_PASS"} | {"Fail_To_Pass": ["t::a"],
                                                                         "PASS_TO_PASS": ["t::b"]}
    for name, row, message in [
            ("empty", only_p2p, r"line 2 is not an RL task: FAIL_TO_PASS: Value error, no test: an RL task needs "
                                r"at least one FAIL_TO_PASS test"),
            ("misspelt", misspelt, r"line 2 is not an RL task: FAIL_TO_PASS: Field required; "
                                   r"Fail_To_Pass: Extra inputs are not permitted \(the field is FAIL_TO_PASS\)"),
            ("unknown", {**TASK, "timeout": 5}, r"line 2 is not an RL task: timeout: Extra inputs are not permitted$"),
            ("patch", {**TASK, "patch": "diff"}, r"line 2 is not an RL task: patch: Value error, an RL task never "
                                                 r"carries the bug patch")]:
        path = _write(tmp_path / f"{name}.jsonl", [json.dumps({**TASK, "instance_id": "ok"}), json.dumps(row)])
        with pytest.raises(InputError, match=rf"{name}.jsonl {message}"):
            read_rl_jsonl(path)


def test_an_rl_task_file_written_before_issue_35_with_lowercase_test_keys_still_loads(tmp_path: Path) -> None:
    """RL task files once spelt the tests ``fail_to_pass`` / ``pass_to_pass``: they load, read as SWE-bench's
    ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` (the one name a row is written and a dataset built with)."""
    from forgeflow.training.rl import build_rl_dataset

    old = {k: v for k, v in TASK.items() if k != "FAIL_TO_PASS"} | {"fail_to_pass": ["t::a"], "pass_to_pass": ["t::b"]}
    rows = read_rl_jsonl(_write(tmp_path / "old.jsonl", [json.dumps(old)]))
    assert (rows[0]["FAIL_TO_PASS"], rows[0]["PASS_TO_PASS"]) == (["t::a"], ["t::b"])
    assert not {"fail_to_pass", "pass_to_pass"} & set(rows[0])
    data = build_rl_dataset(rows)
    assert (data.dataset["FAIL_TO_PASS"], data.dataset["PASS_TO_PASS"]) == ([["t::a"]], [["t::b"]])
    assert data.sha256 == build_rl_dataset(read_rl_jsonl(_write(tmp_path / "new.jsonl", [json.dumps(
        {**TASK, "PASS_TO_PASS": ["t::b"]})]))).sha256  # either spelling: one dataset, one digest
    empty = _write(tmp_path / "empty.jsonl", [json.dumps({**old, "fail_to_pass": []})])
    with pytest.raises(InputError, match="empty.jsonl line 1 is not an RL task: fail_to_pass: Value error, no test"):
        read_rl_jsonl(empty)


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "binary.jsonl"
    path.write_bytes(json.dumps({"messages": CHAT}).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(InputError, match=rf"^samples_jsonl {path} line 2 is not UTF-8 text \(byte 0xff at offset"):
        read_sft_jsonl(path)
    with pytest.raises(InputError, match=rf"^tasks_jsonl {path} line 2 is not UTF-8"):
        read_rl_jsonl(path)


def test_prompt_completion_rows_keep_tool_calls_and_one_format_per_file(tmp_path: Path) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}
    prompt = [{"role": "user", "content": "fix add"},
              {"role": "assistant", "content": "look", "tool_calls": [call], "tool_call_id": None},
              {"role": "tool", "content": "x.py", "tool_calls": None, "tool_call_id": "c1"}]
    completion = [{"role": "assistant", "content": "done", "tool_calls": None, "tool_call_id": None}]
    row = {"prompt": prompt, "completion": completion, "instance_id": "w1", "source": "window:replay:ab:3"}
    path = _write(tmp_path / "windows.jsonl", [json.dumps(row)])
    data = build_sft_dataset(read_sft_jsonl(path))
    assert data.dataset.column_names == ["prompt", "completion", "instance_id", "source"]
    assert data.dataset[0]["prompt"][1]["tool_calls"][0]["function"]["name"] == "bash"
    assert data.dataset[0]["prompt"][2]["tool_call_id"] == "c1"
    mixed = _write(tmp_path / "mixed.jsonl", [json.dumps(row), json.dumps({"messages": CHAT})])
    with pytest.raises(InputError, match=r"mixed.jsonl line 2: a messages row in a file of prompt \+ completion rows"):
        read_sft_jsonl(mixed)
    bad = _write(tmp_path / "bad.jsonl", [json.dumps({**row, "completion": [{"role": "user", "content": "x"}]})])
    with pytest.raises(InputError, match="bad.jsonl line 1: completion must hold assistant messages only"):
        read_sft_jsonl(bad)
    broken_call = {**row, "prompt": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 1}}]}]}
    with pytest.raises(InputError, match=r"line 1: prompt\[0\].tool_calls must be a list"):
        read_sft_jsonl(_write(tmp_path / "call.jsonl", [json.dumps(broken_call)]))
