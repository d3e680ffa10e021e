"""Long agent runs (issue 34): flat supervision cost, trajectories streamed to disk, context accounting.

No container: mini-swe-agent's own ``DeterministicModel`` replays the 200-step script of
``benchmarks/scale_agent.py`` through forgeflow's supervised agent on an in-memory environment; the context
budget is checked against the scripted llama-server-shaped endpoint of the same module (loopback HTTP).
"""

from __future__ import annotations

import json
import platform
import re
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.scale_agent import LongEndpoint, answer_text, long_script
from forgeflow.evaluation import supervision
from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.evaluation.context_budget import ContextBudget
from forgeflow.evaluation.mswea import (
    endpoint_model_class,
    mswea_config,
    prepare_mswea_env,
    stream_path,
    supervised_agent_class,
)
from forgeflow.evaluation.sandbox_env import SandboxEnvironment
from forgeflow.evaluation.supervision import LoopDetector, ToolCall, detect_loop

STEPS = 200


class MemoryEnv:
    """mini-swe-agent's environment protocol in memory: each command prints a few KB; at each command it
    notes how many signatures the supervisor has computed and how many lines the stream holds."""

    def __init__(self, stream: Path) -> None:
        self.stream = stream
        self.signatures_at: list[int] = []
        self.stream_lines_at: list[int] = []

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        self.signatures_at.append(COUNT["signatures"])
        self.stream_lines_at.append(len(self.stream.read_text().splitlines()) if self.stream.exists() else 0)
        command = action["command"]
        output = {"output": f"{command}\n" + "x = 1  # some source line\n" * 100, "returncode": 0, "exception_info": ""}
        if "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in command:
            output["output"] = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a/calc.py b/calc.py\n"
        SandboxEnvironment._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**platform.uname()._asdict(), "cwd": "/testbed", **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {}


COUNT = {"signatures": 0}


def test_200_step_run_checks_each_call_once_and_streams_each_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare_mswea_env()
    from minisweagent.models.test_models import DeterministicModel, make_output

    real_signature = supervision.call_signature

    def counted_signature(name: str, arguments: Any) -> str:
        COUNT["signatures"] += 1
        return real_signature(name, arguments)

    COUNT["signatures"] = 0
    monkeypatch.setattr(supervision, "call_signature", counted_signature)
    commands = long_script(STEPS)
    outputs = [make_output(answer_text(i, c), [{"command": c}]) for i, c in enumerate(commands)]
    traj = tmp_path / "trial.traj.json"
    env = MemoryEnv(stream_path(traj))
    agent_cfg = mswea_config("img", "http://127.0.0.1:1/v1", "scripted", AgentConfig(step_limit=STEPS + 5))["agent"]
    agent = supervised_agent_class()(DeterministicModel(outputs=outputs), env, output_path=traj, **agent_cfg)

    result = agent.run("fix add")

    assert result["exit_status"] == "Submitted" and agent.n_calls == STEPS
    # supervision: one signature per call, so the work of step 200 is that of step 10 (it was every call so far)
    per_step = [b - a for a, b in zip(env.signatures_at, env.signatures_at[1:], strict=False)]
    assert per_step[9] == per_step[-1] == 1, (per_step[9], per_step[-1])
    assert agent.loop_detector.n_calls == agent.loop_detector.signatures_computed == STEPS
    assert agent.loop_detector.detection is None, "200 distinct commands are no loop"
    # the stream: when step k's command runs, steps 1..k-1 are on disk (system + task, then 2 messages a step)
    assert env.stream_lines_at[0] == 0 and env.stream_lines_at[1:] == [2 + 2 * k for k in range(1, STEPS)]
    streamed = [json.loads(line) for line in stream_path(traj).read_text().splitlines()]
    assert streamed == agent.messages and agent.stream_stats["writes"] == STEPS
    # the final save writes mini-swe-agent's format whole, once, and the stream goes
    data = agent.save(traj, {"info": {"forgeflow": {"n_steps": agent.n_calls}}})
    on_disk = json.loads(traj.read_text())
    assert on_disk == json.loads(json.dumps(data)) and on_disk["trajectory_format"] == "mini-swe-agent-1.1"
    assert len(on_disk["messages"]) == 2 + 2 * STEPS and on_disk["messages"][-1]["role"] == "exit" and on_disk["info"]["exit_status"] == "Submitted"
    assert on_disk["info"]["forgeflow"]["n_steps"] == STEPS and not stream_path(traj).exists()
    # bytes written during the run: each message once (rewriting the whole file each step was ~100x this)
    assert agent.stream_stats["bytes"] < 1.2 * traj.stat().st_size


def test_loop_detector_work_is_flat_and_finds_what_detect_loop_finds() -> None:
    def call(i: int) -> ToolCall:
        return ToolCall(name="bash", arguments={"command": f"sed -n '{i},{i + 9}p' a.py"}, message_index=2 + 2 * i)

    detector = LoopDetector(3)
    work = []
    for i in range(STEPS):
        before = detector.comparisons
        assert not detector.add(call(i)).detected
        work.append(detector.comparisons - before)
    assert work[-1] == work[9] <= 9, "comparisons at step 200 equal those at step 10"
    # a loop at the end of a long run: the same evidence as detect_loop over the whole list
    calls = [call(i) for i in range(STEPS)] + [call(1000), call(1001)] * 3
    verdict = detect_loop(calls, 3)
    assert verdict.detected and verdict.period == 2 and verdict.indices == list(range(STEPS, STEPS + 6))
    assert verdict.blocked_at == STEPS + 5 and verdict.message_indices == [2 + 2 * i for i in (1000, 1001) * 3]


def test_context_budget_refuses_the_seeds_66k_request_on_a_65536_slot() -> None:
    counted: list[str] = []

    def counter(text: str) -> int:
        counted.append(text)
        return len(text) // 4

    budget = ContextBudget(65_536, 1024, counter)
    sent = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}, {"role": "user", "content": "o"}]
    budget.observe(len(sent), prompt_tokens=60_000, completion_tokens=500)
    reply = {"role": "assistant", "content": "THOUGHT ..."}
    small = budget.check([*sent, reply, {"role": "user", "content": "x" * 2_000}])
    assert small.fits and not small.counted and counted == [], "far from the slot: nothing counted"
    big = budget.check([*sent, reply, {"role": "user", "content": "x" * 24_000}])  # 6,000 more tokens
    assert not big.fits and big.counted and big.floor_tokens == 66_500 and big.slot_tokens == 65_536
    # without a tokenizer the floor is the previous usage: sent, and the server's own 400 decides
    assert ContextBudget(65_536, 1024).check([*sent, reply, {"role": "user", "content": "x" * 24_000}]).fits
    assert ContextBudget(None, 1024, counter).check([{"role": "user", "content": "x" * 10**6}]).fits


def test_request_over_the_slot_is_refused_before_it_is_sent() -> None:
    prepare_mswea_env()
    from minisweagent.exceptions import InterruptAgentFlow

    endpoint = LongEndpoint(["ls", "cat calc.py"], slot_tokens=3_000)
    with endpoint.serve():
        cfg = mswea_config("img", endpoint.url, "scripted", AgentConfig(max_tokens=256))
        model = endpoint_model_class()(deadline_monotonic=time.monotonic() + 60, **cfg["model"])
        try:
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."},
                                              {"role": "user", "content": "fix add"}]
            first = model.query(messages)
            assert re.search(r"mswea_bash_command\nls\n", first["content"]) and model.budget.slot_tokens == 3_000
            messages += [first, {"role": "user", "content": "<output>\n" + "def f(x):\n    return x\n" * 600}]
            with pytest.raises(InterruptAgentFlow) as info:
                model.query(messages)
        finally:
            model.close()
    exit_message = info.value.messages[0]
    assert exit_message["extra"]["exit_status"] == "ContextWindowExceeded"
    assert "not sent" in exit_message["extra"]["exception_str"]
    assert len(endpoint.prompt_tokens) == 1 and endpoint.overflows == 0, "the overflowing request never left"
    assert endpoint.tokenize_calls == 1, "counted with the endpoint's tokenizer (the new message only)"
