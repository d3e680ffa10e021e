"""Dead-loop and hang detection on recorded-looking mini-swe-agent trajectories; the answer judge."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from forgeflow.common.errors import InputError
from forgeflow.evaluation.judge import judge_answer
from forgeflow.evaluation.supervision import (
    ToolCall,
    call_signature,
    detect_hang,
    detect_loop,
    last_activity_unix_s,
    tool_calls_from_trajectory,
)

T0 = 1_760_000_000.0


def text_trajectory(commands: list[str]) -> dict[str, Any]:
    """A trajectory in mini-swe-agent's text format (as forgeflow's canary records it)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant..."},
        {"role": "user", "content": "<pr_description>Fix the failing tests</pr_description>"},
    ]
    for step, command in enumerate(commands):
        messages.append(
            {
                "role": "assistant",
                "content": f"THOUGHT: step {step}.\n\n```mswea_bash_command\n{command}\n```",
                "extra": {"actions": [{"command": command}], "timestamp": T0 + 10 * step},
            }
        )
        messages.append(
            {
                "role": "user",
                "content": "<returncode>0</returncode>\n<output>\n</output>",
                "extra": {"returncode": 0, "timestamp": T0 + 10 * step + 1},
            }
        )
    return {"trajectory_format": "mini-swe-agent-1.1", "instance_id": "tabulate__x", "messages": messages}


def toolcall_trajectory(arguments: list[str]) -> dict[str, Any]:
    """A trajectory in mini-swe-agent's tool-call format (OpenAI ``tool_calls``, JSON arguments)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for step, args in enumerate(arguments):
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"c{step}", "type": "function", "function": {"name": "bash", "arguments": args}}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"c{step}", "content": "ok"})
    return {"messages": messages}


def test_period_1_loop_is_blocked_at_the_third_repeat() -> None:
    trajectory = text_trajectory(["ls", "cat setup.py", "python -m pytest -x", "python -m pytest -x", "python -m pytest -x", "ls"])
    calls = tool_calls_from_trajectory(trajectory)
    assert [c.arguments["command"] for c in calls][:3] == ["ls", "cat setup.py", "python -m pytest -x"]
    result = detect_loop(calls)
    assert result.detected and result.period == 1 and result.repeats == 3
    assert result.indices == [2, 3, 4] and result.blocked_at == 4
    assert result.message_indices == [6, 8, 10]  # assistant messages in the trajectory
    assert result.signatures == [call_signature("bash", {"command": "python -m pytest -x"})]
    # two repeats are not yet a loop
    assert not detect_loop(calls[:4]).detected


def test_period_2_loop_alternating_calls() -> None:
    commands = ["ls", "sed -n 1,20p a.py", "python -m pytest", "sed -n 1,20p a.py", "python -m pytest", "sed -n 1,20p a.py", "python -m pytest"]
    result = detect_loop(tool_calls_from_trajectory(text_trajectory(commands)))
    assert result.detected and result.period == 2
    assert result.indices == [1, 2, 3, 4, 5, 6] and result.blocked_at == 6
    assert len(result.signatures) == 2 and "sed -n 1,20p a.py" in result.signatures[0]
    assert not detect_loop(tool_calls_from_trajectory(text_trajectory(commands[:6]))).detected


def test_near_duplicate_json_arguments_are_the_same_call() -> None:
    variants = [
        '{"command": "cat a.py", "timeout": 30}',
        '{ "timeout" : 30,\n  "command" : "cat a.py" }',
        '{"command":"cat \\u0061.py","timeout":30}',
    ]
    calls = tool_calls_from_trajectory(toolcall_trajectory(["ls", *variants]))
    assert len({c.signature for c in calls[1:]}) == 1
    result = detect_loop(calls)
    assert result.detected and result.period == 1 and result.indices == [1, 2, 3]
    assert result.signatures == ['{"arguments":{"command":"cat a.py","timeout":30},"tool":"bash"}']


def test_no_loop_when_calls_vary_and_threshold_is_a_parameter() -> None:
    calls = tool_calls_from_trajectory(text_trajectory(["ls", "cat a.py", "ls", "cat b.py", "ls", "cat a.py", "ls"]))
    assert not detect_loop(calls).detected
    repeated = [ToolCall(name="bash", arguments={"command": "ls"})] * 4
    assert not detect_loop(repeated, threshold=5).detected
    assert detect_loop(repeated, threshold=4).blocked_at == 3
    assert detect_loop(repeated, threshold=2).blocked_at == 1
    with pytest.raises(InputError, match="threshold"):
        detect_loop(repeated, threshold=1)


def test_different_tools_with_equal_arguments_are_different_calls() -> None:
    calls = [ToolCall(name=name, arguments='{"path": "a.py"}') for name in ("view", "edit", "view")]
    assert not detect_loop(calls).detected


def test_reads_the_trajectory_file_and_its_last_activity(tmp_path: Path) -> None:
    path = tmp_path / "x.traj.json"
    path.write_text(json.dumps(text_trajectory(["ls", "pwd"])))
    assert [c.arguments for c in tool_calls_from_trajectory(path)] == [{"command": "ls"}, {"command": "pwd"}]
    assert last_activity_unix_s(json.loads(path.read_text())) == T0 + 11
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="bad.json"):
        tool_calls_from_trajectory(tmp_path / "bad.json")


def test_fences_are_read_when_actions_were_not_recorded() -> None:
    trajectory = {"messages": [{"role": "assistant", "content": "THOUGHT\n```mswea_bash_command\n  git diff \n```"}]}
    assert tool_calls_from_trajectory(trajectory)[0].arguments == {"command": "git diff"}


def test_hang_after_eleven_idle_minutes() -> None:
    last = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
    assert not detect_hang(last_message_at=last, now=last + timedelta(minutes=11)).hung
    check = detect_hang(last_message_at=last, now=last + timedelta(minutes=11, seconds=1))
    assert check.hung and check.idle_s == pytest.approx(661.0)
    # a model call after the last message counts as activity
    recent = detect_hang(last_message_at=T0, last_model_call_at=T0 + 600, now=T0 + 700)
    assert not recent.hung and recent.idle_s == pytest.approx(100.0)
    assert detect_hang(started_at=T0, now=T0 + 120, idle_limit_s=60).hung
    with pytest.raises(InputError, match="at least one"):
        detect_hang(now=T0)
    with pytest.raises(InputError, match="timezone-aware"):
        detect_hang(last_message_at=datetime(2025, 1, 1), now=T0)


@pytest.mark.parametrize(
    ("answer", "reference", "correct", "rule"),
    [
        ("The Eiffel Tower.", "eiffel tower", True, "string"),
        ("  an   apple ", "Apple", True, "string"),
        ("Paris, France", "Paris", False, "string"),
        ("1,000", "1000", True, "number"),
        ("$1 000.00", "1,000", True, "number"),
        ("45%", "45", True, "number"),
        ("0.30000000000000004", "0.3", True, "number"),
        ("0.31", "0.3", False, "number"),
        ("about 12", "12", False, "number"),
        ("apple; Banana ,cherry", "apple, banana, cherry", True, "list"),
        ("apple, cherry, banana", "apple, banana, cherry", False, "list"),
        ("1, 2", "1, 2, 3", False, "list"),
        ("3.0, the dog", "3, dog", True, "list"),
    ],
)
def test_answer_judge(answer: str, reference: str, correct: bool, rule: str) -> None:
    judgment = judge_answer("q1", answer, reference)
    assert (judgment.correct, judgment.rule) == (correct, rule)


def test_judgment_shows_the_normalized_forms() -> None:
    judgment = judge_answer("q1", "The  Quick, brown fox!", "quick brown fox")
    assert judgment.normalized_answer == "quick brown fox" == judgment.normalized_reference
    numbers = judge_answer("q2", "1,234.50", "1234.5")
    assert (numbers.normalized_answer, numbers.normalized_reference) == ("1234.5", "1234.5")
    assert judge_answer("q3", "3.0, The Dog", "3, dog").normalized_answer == "3,dog"
    with pytest.raises(InputError, match="reference"):
        judge_answer("q4", "x", "  ")
