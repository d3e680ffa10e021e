"""Agentic RL episodes on a real local Ray cluster (tests/raycluster.py: a head without sandboxes, one worker
declaring ``{"sandbox": 3}``): each episode's container runs in an actor on the worker, the scripted policy
samples here, the verifier runs as a Ray task there. A solver scores 1.0 through the turns, a looper is stopped
with 0, a command that hangs is killed by the watchdog through the actor (reward 0, ``hang``); the episodes
and the step's stats name the node, and no container is left."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from forgeflow.common.settings import tool_env
from forgeflow.training.episodes import EpisodeTokens, ScriptedPolicy, TurnSample
from forgeflow.training.episodes_grpo import EpisodeStepStats
from forgeflow.training.episodes_run import run_episodes
from tests.integration.test_rl_episodes import LOOPER, SETTINGS, SOLVER, _act, _job, task_image, tiny, tokens  # noqa: F401
from tests.raycluster import RayCluster, node_storage, ray_head, ray_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class _ByTask:
    def __init__(self, policies: dict[str, Any]) -> None:
        self.policies = policies

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        return next(p for key, p in self.policies.items() if f"({key})" in messages[0]["content"]).sample(
            context_ids, messages)


@pytest.fixture(scope="module")
def head() -> Iterator[RayCluster]:
    """One head node (no sandbox resource) for the module's tests; each test joins its own worker."""
    with ray_head(num_cpus=1) as cluster:
        yield cluster


def test_episodes_run_their_containers_on_the_ray_sandbox_node(
        head: RayCluster, task_image: str, tokens: EpisodeTokens, tmp_path: Path) -> None:  # noqa: F811
    from forgeflow.sandbox import dispatch
    from forgeflow.sandbox.dispatch import RayPlacement

    policy = _ByTask({"calc-raysolve": ScriptedPolicy(tokens, SOLVER), "calc-rayloop": ScriptedPolicy(tokens, LOOPER),
                      "calc-rayhang": ScriptedPolicy(tokens, [_act("sleep 300")])})
    settings = SETTINGS.model_copy(update={"concurrency": 3, "hang_idle_s": 5.0})
    with ray_worker(head, {"sandbox": 3}) as worker:
        try:
            solved, looped, hung = run_episodes(
                [_job(task_image, "calc-raysolve"), _job(task_image, "calc-rayloop"), _job(task_image, "calc-rayhang")],
                policy, tokens, settings, tmp_path,
                {"backend": "podman", "verifier_timeout_s": 120, "ray": RayPlacement(address=head.address)})
        finally:
            dispatch.disconnect()
    assert (solved.end_reason, solved.reward, solved.exception_type, len(solved.turns)) == ("submitted", 1.0, None, 3)
    assert solved.verifier.node_id == worker.node_id  # the verifier ran there too
    assert (looped.end_reason, looped.reward) == ("dead_loop", 0.0)
    assert (hung.end_reason, hung.reward, hung.turns[0].returncode) == ("hang", 0.0, 137) and hung.wall_s < 25
    assert {e.node_id for e in (solved, looped, hung)} == {worker.node_id}
    assert EpisodeStepStats.of(1, [solved, looped, hung], 1.0).nodes == {worker.node_id: 3}
    left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", "name=ff-episode"],
                          env=tool_env(), capture_output=True, text=True, check=True).stdout.split()
    assert left == []


class _KillsItsWorker:
    """Runs ``ls`` then ``ls -a`` (again and again: a loop); before the second sample of the first episode to get
    there, SIGKILLs the Ray worker process of that episode's actor (on the node, the container's owner)."""

    def __init__(self, tokens: EpisodeTokens, dashboard_url: str) -> None:
        self.tokens, self.url, self.scripts, self.killed = tokens, dashboard_url, {}, None

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        from ray.util.state import list_actors

        script = self.scripts.setdefault(messages[0]["content"], ScriptedPolicy(self.tokens, [_act("ls"),
                                                                                               _act("ls -a")]))
        if script.calls == 1 and self.killed is None:
            (actor,) = list_actors(address=self.url, filters=[("class_name", "=", "NodeEpisodeEnv"),
                                                              ("state", "=", "ALIVE")])
            self.killed = messages[0]["content"]
            os.kill(actor.pid, signal.SIGKILL)
        return script.sample(context_ids, messages)


def _run_bounded(limit_s: float, *args: Any) -> list[Any] | None:
    """``run_episodes(*args)`` in a daemon thread; its episodes, or None when it has not returned in ``limit_s``."""
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(run_episodes(*args)), daemon=True)
    runner.start()
    runner.join(timeout=limit_s)
    return done[0] if done else None


def test_a_ray_worker_killed_mid_episode_is_an_exception_and_the_burst_goes_on_or_ends_clearly(
        head: RayCluster, task_image: str, tokens: EpisodeTokens, tmp_path: Path) -> None:  # noqa: F811
    """One sandbox slot, two episodes: the worker process of the first one's actor is killed under it: a
    SandboxError (reward None, never 0); the second then gets the slot and ends on its own outcome (a loop: 0).
    With no sandbox node left, an episode is not left waiting for one past the step's wall bound: a SandboxError
    too."""
    from forgeflow.sandbox import dispatch
    from forgeflow.sandbox.dispatch import RayPlacement
    from forgeflow.sandbox.podman_layers import sweep_containers

    jobs = [_job(task_image, "calc-raynode-a"), _job(task_image, "calc-raynode-b")]
    try:
        with ray_worker(head, {"sandbox": 1}) as worker:
            grading = {"backend": "podman", "verifier_timeout_s": 120, "ray": RayPlacement(address=head.address)}
            policy = _KillsItsWorker(tokens, head.dashboard_url)
            episodes = _run_bounded(240, jobs, policy, tokens, SETTINGS, tmp_path, grading)
            assert episodes is not None, "the step did not end after a worker was killed"
            left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter",
                                   "name=ff-episode-calc-raynode"], env=tool_env(), capture_output=True, text=True,
                                  check=True).stdout.split()
        # every sandbox node gone (a resource no node declares now): Ray would hold the container's actor pending
        began = time.monotonic()
        stranded = _run_bounded(60, jobs[:1], ScriptedPolicy(tokens, LOOPER), tokens,
                                SETTINGS.model_copy(update={"step_wall_s": 8.0}), tmp_path,
                                {**grading, "ray": RayPlacement(address=head.address, resource="sandbox-lost")})
        took = time.monotonic() - began
    finally:
        dispatch.disconnect()
        sweep_containers(lambda n: n.startswith("ff-episode-calc-raynode"))  # a killed actor's, on this host
    looped, lost = sorted(episodes, key=lambda e: e.end_reason)  # dead_loop, exception
    assert policy.killed is not None and f"({lost.instance_id})" in policy.killed
    assert (lost.end_reason, lost.reward, lost.exception_type, lost.node_id) == (
        "exception", None, "SandboxError", worker.node_id)
    assert "vanished" in lost.exception_message and len(lost.turns) == 1
    assert left == [], "the killed actor's container outlived its episode on a live node"
    assert (looped.end_reason, looped.reward, looped.exception_type) == ("dead_loop", 0.0, None)
    stats = EpisodeStepStats.of(1, episodes, 1.0)
    assert (stats.exceptions, stats.resolved, stats.unresolved, stats.exception_types) == (
        1, 0, 1, {"SandboxError": 1})
    assert stranded is not None, "an episode waited for a Ray node past the step's wall bound"
    ((waited,),) = [stranded]
    assert (waited.end_reason, waited.reward, waited.exception_type, waited.turns) == (
        "exception", None, "SandboxError", [])
    assert "no Ray node" in waited.exception_message and took < 30


def test_a_cancelled_runs_container_on_another_ray_node_is_swept_there_by_each_ray_flow(
        head: RayCluster, task_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A node with a podman storage of its own (another machine's containers, to this host's podman): a sandbox
    container labelled with a run, its driver gone (the actor killed, as a cancelled run's), is left there; the
    cancellation hooks of each flow that dispatches to Ray (rl-burst, curate, canary), as Prefect's runner calls
    them, end it on that node."""
    import tasks.common
    from flows.canary import canary
    from flows.curate import curate
    from flows.training import rl_burst
    from forgeflow.sandbox import dispatch
    from forgeflow.sandbox.backends import SandboxTarget
    from forgeflow.sandbox.dispatch import RayPlacement
    from forgeflow.sandbox.kubernetes_manifests import FLOW_RUN_LABEL
    from forgeflow.training.episodes_ray import RayEpisodeEnv

    placement = RayPlacement(address=head.address)
    monkeypatch.setattr(tasks.common, "trial_dispatcher", lambda name: placement if name == "ray-nodes" else None)
    task, _ = _job(task_image, "calc-raycancel")
    with node_storage(tmp_path) as storage, ray_worker(head, {"sandbox": 1}, env=storage) as worker:
        for stage_flow in (rl_burst, curate, canary):
            run = SimpleNamespace(id=uuid.uuid4(), parameters={"params": {"dispatcher": "ray-nodes", "sandbox": None}})
            name = f"ff-episode-calc-raycancel-{run.id.hex[:10]}"

            def on_node(run_id: uuid.UUID = run.id) -> list[str]:
                return subprocess.run(["podman", "ps", "-a", "--filter", f"label={FLOW_RUN_LABEL}={run_id}",
                                       "--format", "{{.Names}}"], env={**tool_env(), **storage}, capture_output=True,
                                      text=True, check=True).stdout.split()

            try:
                env = RayEpisodeEnv(placement, task, SETTINGS, SandboxTarget(labels={FLOW_RUN_LABEL: str(run.id)}),
                                    name)
                env._kill()  # the driver gone: its actor dies, the container stays on the node
                assert env.node_id == worker.node_id and on_node() == [name]
                for hook in stage_flow.on_cancellation_hooks:
                    hook(flow=stage_flow, flow_run=run, state=None)
                assert on_node() == [], f"{stage_flow.name}'s hooks left its container on the Ray node"
            finally:
                dispatch.disconnect()
                subprocess.run(["podman", "rm", "-f", "-t", "0", name], env={**tool_env(), **storage},
                               capture_output=True)
