"""A 200-step agent trial (issue 34's long horizon): it completes, its trajectory is on disk step by step,
and the supervision counts are right.

Real mini-swe-agent, a real podman container of the calc task image (``tests/adversarial/calc_task.py``),
the real verifier. The model is the scripted llama-server-shaped endpoint of ``benchmarks/scale_agent.py``
replaying 200 distinct, cheap commands (``sed -n``, ``grep -rn``, ``wc``, ``python3 -c``, ``ls``, the fix,
the tests, the submission), whose observations are real command output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scale_agent import LongEndpoint, agent_config, calc_agent_task, ensure_calc_image, long_script
from forgeflow.evaluation.agent import run_agent_trial
from forgeflow.evaluation.supervision import tool_calls_from_trajectory

pytestmark = pytest.mark.integration
STEPS = 200


def test_200_step_trial_completes_with_every_step_on_disk_and_supervision_counted(tmp_path: Path) -> None:
    commands = long_script(STEPS)
    endpoint = LongEndpoint(commands, slot_tokens=1 << 20, watch=tmp_path)
    with endpoint.serve():
        record = run_agent_trial(calc_agent_task(ensure_calc_image()), endpoint.url, "scripted",
                                 agent_config(STEPS, command_timeout_s=20), tmp_path)

    assert record.exception_type is None and record.reward == 1.0, record.exception_message
    assert record.agent_steps == STEPS == len(endpoint.prompt_tokens) and endpoint.overflows == 0
    # streamed as it happened: at request k+1 the stream held the system and task messages and k steps
    assert endpoint.stream_lines == [0] + [2 + 2 * k for k in range(1, STEPS)]
    traj = json.loads((tmp_path / f"{record.trial_id}.traj.json").read_text())
    assert not list(tmp_path.glob("*.messages.jsonl")), "the stream is gone once the trajectory is whole"
    messages = traj["messages"]
    assert len(messages) == 2 + 2 * STEPS and traj["info"]["exit_status"] == "Submitted"
    assert [c.arguments["command"] for c in tool_calls_from_trajectory(traj)] == commands
    assert sum(1 for m in messages if m["role"] == "user" and "<returncode>0</returncode>" in m["content"]) >= STEPS - 5
    forgeflow = traj["info"]["forgeflow"]
    assert forgeflow["supervision"] is None and record.supervision is None, "200 distinct calls: no loop, no hang"
    work = forgeflow["supervision_work"]
    assert work["calls_checked"] == work["signatures_computed"] == STEPS, "each call hashed once, not every step"
    assert work["comparisons"] <= 10 * STEPS
    assert forgeflow["stream"]["messages"] == len(messages) and forgeflow["stream"]["writes"] == STEPS
    assert record.input_tokens == sum(endpoint.prompt_tokens) and endpoint.prompt_tokens[-1] > 50_000
    assert "return a + b" in (record.submission or "")
