"""Agentic RL episodes on a real local Ray cluster (tests/raycluster.py: a head without sandboxes, one worker
declaring ``{"sandbox": 3}``): each episode's container runs in an actor on the worker, the scripted policy
samples here, the verifier runs as a Ray task there. A solver scores 1.0 through the turns, a looper is stopped
with 0, a command that hangs is killed by the watchdog through the actor (reward 0, ``hang``); the episodes
and the step's stats name the node, and no container is left."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from forgeflow.common.settings import tool_env
from forgeflow.training.episodes import EpisodeTokens, ScriptedPolicy, TurnSample
from forgeflow.training.episodes_grpo import EpisodeStepStats
from forgeflow.training.episodes_run import run_episodes
from tests.integration.test_rl_episodes import LOOPER, SETTINGS, SOLVER, _act, _job, task_image, tiny, tokens  # noqa: F401
from tests.raycluster import ray_head, ray_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class _ByTask:
    def __init__(self, policies: dict[str, Any]) -> None:
        self.policies = policies

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        return next(p for key, p in self.policies.items() if f"({key})" in messages[0]["content"]).sample(
            context_ids, messages)


def test_episodes_run_their_containers_on_the_ray_sandbox_node(
        task_image: str, tokens: EpisodeTokens, tmp_path: Path) -> None:  # noqa: F811
    from forgeflow.sandbox import dispatch
    from forgeflow.sandbox.dispatch import RayPlacement

    policy = _ByTask({"calc-raysolve": ScriptedPolicy(tokens, SOLVER), "calc-rayloop": ScriptedPolicy(tokens, LOOPER),
                      "calc-rayhang": ScriptedPolicy(tokens, [_act("sleep 300")])})
    settings = SETTINGS.model_copy(update={"concurrency": 3, "hang_idle_s": 5.0})
    with ray_head(num_cpus=1) as head, ray_worker(head, {"sandbox": 3}) as worker:
        try:
            solved, looped, hung = run_episodes(
                [_job(task_image, "calc-raysolve"), _job(task_image, "calc-rayloop"), _job(task_image, "calc-rayhang")],
                policy, tokens, settings, tmp_path,
                {"backend": "podman", "verifier_timeout_s": 120, "ray": RayPlacement(address=head.address)})
        finally:
            dispatch.disconnect()
    assert (solved.end_reason, solved.reward, solved.exception_type, len(solved.turns)) == ("submitted", 1.0, None, 3)
    assert solved.verifier["evidence"]["node_id"] == worker.node_id  # the verifier ran there too
    assert (looped.end_reason, looped.reward) == ("dead_loop", 0.0)
    assert (hung.end_reason, hung.reward, hung.turns[0].returncode) == ("hang", 0.0, 137) and hung.wall_s < 25
    assert {e.node_id for e in (solved, looped, hung)} == {worker.node_id}
    assert EpisodeStepStats.of(1, [solved, looped, hung], 1.0).nodes == {worker.node_id: 3}
    left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", "name=ff-episode"],
                          env=tool_env(), capture_output=True, text=True, check=True).stdout.split()
    assert left == []
