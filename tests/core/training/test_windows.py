"""Replay and anti-loop training windows from mini-swe-agent trajectories.

The trajectories are synthetic but shaped as mini-swe-agent 2.4.6 records them: its own system,
instance and observation templates (through ``forgeflow.training.samples.agent_templates``), ``extra``
with ``actions``/``returncode``, format-error answers to replies with zero or several actions, and
the final ``exit`` message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_json
from forgeflow.training.samples import agent_templates
from forgeflow.training.windows import (
    CONCLUDE_CALL_ID,
    CONCLUDE_COMMAND,
    QUOTA_OBSERVATION,
    WindowConfig,
    build_windows,
    parse_trajectory,
)

INSTANCE = "tabulate__tabulate.3b5e1c0f.lm_rewrite__k2x9"
TASK = "The `tabulate` function drops the last column when `maxcolwidths` is set.\n" + "Details. " * 60


def _plain(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content, "tool_calls": None, "tool_call_id": None}


def _observation(command: str, returncode: int = 0) -> str:
    template = agent_templates()["observation"]
    return jinja2.Template(template).render(output={"returncode": returncode, "output": f"out of {command}",
                                                    "exception_info": ""})


def _assistant(step: int, commands: list[str]) -> str:
    fences = "\n\n".join(f"```mswea_bash_command\n{c}\n```" for c in commands)
    return f"THOUGHT: reasoning for reply {step}.\n\n{fences}"


def text_trajectory(replies: list[str | list[str]]) -> dict[str, Any]:
    """A text-format trajectory; a ``list`` reply has that many fences (0 or >= 2): format error."""
    templates = agent_templates()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": templates["system"]},
        {"role": "user", "content": jinja2.Template(templates["instance"]).render(task=TASK)},
    ]
    for step, reply in enumerate(replies):
        commands = [reply] if isinstance(reply, str) else reply
        extra: dict[str, Any] = {"timestamp": 1_760_000_000.0 + step}
        if len(commands) == 1:
            extra["actions"] = [{"command": commands[0]}]
        messages.append({"role": "assistant", "content": _assistant(step, commands), "extra": extra})
        if len(commands) == 1:
            messages.append({"role": "user", "content": _observation(commands[0]),
                             "extra": {"returncode": 0, "raw_output": f"out of {commands[0]}"}})
        else:
            messages.append({"role": "user", "content": f"Format error: found {len(commands)} actions.",
                             "extra": {"interrupt_type": "FormatError", "n_actions": len(commands)}})
    messages.append({"role": "exit", "content": "", "extra": {"exit_status": "LimitsExceeded"}})
    return {"trajectory_format": "mini-swe-agent-1.1", "instance_id": INSTANCE, "messages": messages,
            "info": {"exit_status": "LimitsExceeded"}}


def _steps(trajectory: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(assistant, observation) message pairs of the aligned replies, normalized as in the dataset."""
    messages = trajectory["messages"]
    pairs = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and "actions" in m.get("extra", {}):
            pairs.append((_plain("assistant", m["content"]), _plain("user", messages[i + 1]["content"])))
    return pairs


def _head(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    return [_plain("system", trajectory["messages"][0]["content"])]


def test_replay_windows_have_the_exact_layout() -> None:
    commands = [f"sed -n {10 * i},{10 * i + 9}p tabulate/core.py" for i in range(12)]
    commands[1] = "cat <<'EOF' > repro.py\nfrom tabulate import tabulate\nprint(tabulate([[1, 2]]))\nEOF"
    trajectory = text_trajectory(commands)
    config = WindowConfig(replay_steps=3, stride_steps=4, min_steps=8, task_excerpt_chars=300)
    result = build_windows([trajectory], config)
    rows = result.dataset.to_list()
    assert [r["provenance"]["target_step"] for r in rows] == [4, 8]
    instance = trajectory["messages"][1]["content"]
    excerpt = instance[:300] + f"\n[... {len(instance) - 300} more characters of the task omitted]"
    steps = _steps(trajectory)
    recap_4 = (
        "Progress so far: 1 earlier step(s), oldest first; the last 3 step(s) follow in full.\n"
        "1. `sed -n 0,9p tabulate/core.py` -> returncode 0"
    )
    expected_prompt = _head(trajectory) + [_plain("user", excerpt + "\n\n" + recap_4)]
    for assistant, observation in steps[1:4]:
        expected_prompt += [assistant, observation]
    assert rows[0]["prompt"] == expected_prompt
    assert rows[0]["completion"] == [steps[4][0]]
    recap_8 = rows[1]["prompt"][1]["content"].split("\n\n", 1)[1]
    assert recap_8.splitlines()[1:] == [
        "1. `sed -n 0,9p tabulate/core.py` -> returncode 0",
        "2. `cat <<'EOF' > repro.py` (+3 more lines) -> returncode 0",
        "3. `sed -n 20,29p tabulate/core.py` -> returncode 0",
        "4. `sed -n 30,39p tabulate/core.py` -> returncode 0",
        "5. `sed -n 40,49p tabulate/core.py` -> returncode 0",
    ]
    assert rows[1]["prompt"][-2:] == list(steps[7]) and rows[1]["completion"] == [steps[8][0]]
    assert rows[1]["provenance"] == {"instance_id": INSTANCE, "trajectory_sha256": sha256_json(trajectory),
                                     "window_index": 1, "kind": "replay", "target_step": 8}
    assert result.stats.windows_by_kind == {"replay": 2, "stop_and_conclude": 0, "early_switch": 0,
                                            "one_call_quota": 0}
    # a short trajectory gets no replay window
    short = build_windows([text_trajectory(commands[:7])], config)
    assert len(short.dataset) == 0 and short.stats.short_trajectories == 1


def test_period_1_loop_gives_the_three_anti_loop_windows() -> None:
    pytest_cmd = "python -m pytest -x test/test_output.py"
    commands = ["ls", "cat tabulate/core.py", pytest_cmd, pytest_cmd, pytest_cmd, pytest_cmd,
                "grep -n maxcolwidths tabulate/core.py", "echo done"]
    trajectory = text_trajectory(commands)
    result = build_windows([trajectory], WindowConfig(replay_steps=4, min_steps=6, task_excerpt_chars=100_000))
    steps = _steps(trajectory)
    rows = {r["provenance"]["kind"]: r for r in result.dataset.to_list()}
    assert set(rows) == {"stop_and_conclude", "early_switch", "one_call_quota"}  # replay stops at the loop
    task = _plain("user", trajectory["messages"][1]["content"])

    conclude = rows["stop_and_conclude"]
    assert conclude["prompt"] == _head(trajectory) + [task] + [m for pair in steps[:4] for m in pair]
    assert conclude["completion"] == [_plain("assistant", (
        "THOUGHT: My last 2 actions repeated the same command and gave no new information; running it "
        "again will not help. I stop here and submit the current state of my work.\n\n"
        f"```mswea_bash_command\n{CONCLUDE_COMMAND}\n```"
    ))]
    assert conclude["provenance"]["target_step"] == 4 and conclude["provenance"]["window_index"] == 0

    switch = rows["early_switch"]
    assert switch["prompt"] == _head(trajectory) + [task] + [m for pair in steps[:3] for m in pair]
    assert switch["completion"] == [steps[6][0]] and switch["provenance"]["target_step"] == 6

    quota = rows["one_call_quota"]
    refused = _plain("user", QUOTA_OBSERVATION.format(step=3))
    assert quota["prompt"] == (_head(trajectory) + [task] + [m for pair in steps[:3] for m in pair]
                               + [steps[3][0], refused])
    assert quota["completion"] == [steps[6][0]]
    assert result.stats.loops_detected == 1 and result.stats.skipped_no_switch == 0


def test_period_2_loop_without_a_way_out() -> None:
    view, run = "sed -n 1,40p tabulate/core.py", "python -m pytest -x"
    commands = ["ls", view, run, view, run, view, run, view]
    trajectory = text_trajectory(commands)
    config = WindowConfig(replay_steps=2, min_steps=4, stride_steps=1)
    result = build_windows([trajectory], config)
    rows = result.dataset.to_list()
    kinds = [r["provenance"]["kind"] for r in rows]
    # replay targets stop at the first repetition (step 3); early_switch has no way out to copy
    assert kinds == ["stop_and_conclude", "one_call_quota"]
    assert result.stats.skipped_no_switch == 1 and result.stats.windows_by_kind["replay"] == 0
    conclude_text = rows[0]["completion"][0]["content"]
    assert conclude_text.startswith("THOUGHT: My last 5 actions repeated the same two commands in turn")
    assert rows[0]["provenance"]["target_step"] == 6
    # the blocked call is step 6: context = steps 0-5, of which the last 2 are replayed
    assert rows[0]["prompt"][1]["content"].endswith(
        "\n\nProgress so far: 4 earlier step(s), oldest first; the last 2 step(s) follow in full.\n"
        f"1. `ls` -> returncode 0\n2. `{view}` -> returncode 0\n3. `{run}` -> returncode 0\n"
        f"4. `{view}` -> returncode 0"
    )
    steps = _steps(trajectory)
    assert rows[0]["prompt"][-4:] == [*steps[4], *steps[5]]
    # quota: the first repeated call (the view at step 3) is refused, pointing at step 2 (1-based)
    assert rows[1]["prompt"][-2:] == [steps[3][0], _plain("user", QUOTA_OBSERVATION.format(step=2))]
    assert rows[1]["completion"] == rows[0]["completion"]


def test_replies_with_zero_or_several_actions_are_dropped_and_counted() -> None:
    cat = "cat tabulate/core.py"
    replies: list[str | list[str]] = ["ls", cat, [], cat, [cat, "ls"], cat, "echo end"]
    trajectory = text_trajectory(replies)
    parsed = parse_trajectory(trajectory)
    assert [s.message_index for s in parsed.steps] == [2, 4, 8, 12, 14]
    assert (parsed.dropped_no_action, parsed.dropped_several_actions) == (1, 1)
    result = build_windows([trajectory], WindowConfig(replay_steps=4, min_steps=6))
    assert (result.stats.dropped_no_action, result.stats.dropped_several_actions) == (1, 1)
    assert result.stats.aligned_steps == 5
    # the three aligned `cat` replies are a loop even with dropped replies between them
    kinds = [r["provenance"]["kind"] for r in result.dataset.to_list()]
    assert kinds == ["stop_and_conclude", "early_switch", "one_call_quota"]
    text = json.dumps(result.dataset.to_list())
    for dropped in ("reasoning for reply 2.", "reasoning for reply 4.", "Format error"):
        assert dropped not in text
    assert "reasoning for reply 3." in text and "reasoning for reply 6." in text


def toolcall_trajectory(calls: list[list[str]]) -> dict[str, Any]:
    """Tool-call format: each reply holds the given ``bash`` calls, each answered by a tool message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": TASK}]
    for step, commands in enumerate(calls):
        tool_calls = [{"id": f"call_{step}_{k}", "type": "function",
                       "function": {"name": "bash", "arguments": json.dumps({"command": c})}}
                      for k, c in enumerate(commands)]
        messages.append({"role": "assistant", "content": f"Thinking {step}.", "tool_calls": tool_calls})
        for k, command in enumerate(commands):
            messages.append({"role": "tool", "tool_call_id": f"call_{step}_{k}", "content": f"out of {command}",
                             "extra": {"returncode": 1}})
    return {"instance_id": INSTANCE, "messages": messages}


def test_toolcall_format_windows_keep_tool_calls() -> None:
    trajectory = toolcall_trajectory([["ls"], ["ls", "pwd"], ["pytest"], ["pytest"], ["pytest"]])
    result = build_windows([trajectory], WindowConfig(replay_steps=4, min_steps=6))
    assert result.stats.dropped_several_actions == 1 and result.stats.skipped_no_switch == 1
    rows = {r["provenance"]["kind"]: r for r in result.dataset.to_list()}
    completion = rows["stop_and_conclude"]["completion"][0]
    assert completion["role"] == "assistant" and completion["content"].startswith("THOUGHT: My last 2 actions")
    assert completion["tool_calls"] == [{"id": CONCLUDE_CALL_ID, "type": "function", "function": {
        "name": "bash", "arguments": json.dumps({"command": CONCLUDE_COMMAND})}}]
    prompt = rows["stop_and_conclude"]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user", *["assistant", "tool"] * 3]
    assert prompt[3] == {"role": "tool", "content": "out of ls", "tool_calls": None, "tool_call_id": "call_0_0"}
    assert "Thinking 1." not in json.dumps(prompt)
    refused = rows["one_call_quota"]["prompt"][-1]
    assert refused == {"role": "tool", "content": QUOTA_OBSERVATION.format(step=2), "tool_calls": None,
                       "tool_call_id": "call_3_0"}


def test_parameters_and_inputs_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_steps"):
        WindowConfig(replay_steps=4, min_steps=5)
    with pytest.raises(ValueError, match="repeats"):
        WindowConfig(loop_variants=("early_switch", "early_switch"))
    with pytest.raises(ValueError):
        WindowConfig(loop_variants=("retry_forever",))
    with pytest.raises(ValueError):
        WindowConfig(replay_steps=0)
    with pytest.raises(InputError, match="instance_id"):
        build_windows([{"messages": []}])
    with pytest.raises(InputError, match="messages"):
        build_windows([{"instance_id": "x"}])
    with pytest.raises(InputError, match="missing.traj.json does not exist"):
        build_windows([tmp_path / "missing.traj.json"])
    trajectory = text_trajectory(["ls", "ls", "ls"])
    path = tmp_path / "t.traj.json"
    path.write_text(json.dumps(trajectory, indent=4))
    from_file = build_windows([path], WindowConfig(replay_steps=1, min_steps=3))
    from_dict = build_windows([trajectory], WindowConfig(replay_steps=1, min_steps=3))
    assert from_file.dataset.to_list() == from_dict.dataset.to_list()
    assert from_file.dataset.to_list()[0]["provenance"]["trajectory_sha256"] == sha256_json(trajectory)
    empty = build_windows([], WindowConfig())
    assert len(empty.dataset) == 0 and set(empty.dataset.column_names) == {"prompt", "completion", "provenance"}
