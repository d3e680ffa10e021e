"""Agentic RL episodes on the calc task's real image under podman (tests/adversarial/calc_task.py), with
scripted policies and the tiny model's tokenizer: the mechanics, not learning.

A solver (its sampled ids a non-canonical tokenization) is rewarded 1.0 by the verifier through the
multi-turn path while a looper beside it is stopped by the loop detector and rewarded 0 with its evidence;
a container removed mid-episode is an exception (reward None, never 0); a command that hangs is killed by the
watchdog and the episode rewarded 0 with reason ``hang``; a policy that conditions on a
re-tokenized history is refused by the prefix check; a GRPO step trains on a solver's and a looper's
episodes with the trainer's own loss, and the lineage keeps the step's episode counts.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from forgeflow.common.settings import cache_dir, tool_env
from forgeflow.packaging.base_model import build_tiny_model
from forgeflow.sandbox.verifier import TaskTests
from forgeflow.training.episodes import (
    EPISODE_PROMPT_TEMPLATE,
    SUBMIT_COMMAND,
    EpisodeSettings,
    EpisodeTokens,
    ScriptedPolicy,
    TurnSample,
)
from forgeflow.training.episodes_grpo import EpisodeStepStats
from forgeflow.training.episodes_run import episode_messages, run_episodes
from forgeflow.training.windows import parse_trajectory
from tests.adversarial.calc_task import (
    BUGGY_CALC,
    CONFTEST,
    ENV_TEST,
    F2P,
    P2P,
    TASK_IMAGE,
    TEST_COMMAND,
    TESTS,
    build_task_image,
)

pytestmark = pytest.mark.integration

SETTINGS = EpisodeSettings(max_turns=6, concurrency=2, memory_mb=256, command_timeout_s=30, wall_s=120)
GRADING = {"backend": "podman", "verifier_timeout_s": 120}


def _act(command: str) -> str:
    return f"Next step.\n```mswea_bash_command\n{command}\n```"


SOLVER = [_act("cat calc.py"), _act("sed -i 's/a - b/a + b/' calc.py"), _act(SUBMIT_COMMAND)]
LOOPER = [_act("ls")]


@pytest.fixture(scope="module")
def task_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_task_image(tmp_path_factory.mktemp("calc"), TASK_IMAGE, {
        "calc.py": BUGGY_CALC, "tests/test_calc.py": TESTS, "tests/test_env.py": ENV_TEST, "conftest.py": CONFTEST})


@pytest.fixture(scope="module")
def tiny() -> Path:
    return build_tiny_model(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf", seed=0).path


@pytest.fixture(scope="module")
def tokens(tiny: Path) -> EpisodeTokens:
    from transformers import AutoTokenizer

    return EpisodeTokens(AutoTokenizer.from_pretrained(str(tiny)))


def _job(image: str, instance_id: str) -> tuple[TaskTests, list[dict[str, Any]]]:
    task = TaskTests(instance_id=instance_id, image_ref=image, problem_statement=f"test_add fails ({instance_id})",
                     test_command=TEST_COMMAND, FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P)
    return task, episode_messages(task.problem_statement, EPISODE_PROMPT_TEMPLATE.read_text(encoding="utf-8"))


class _ByTask:
    """One policy per task, chosen by the instance id in the episode's first message."""

    def __init__(self, policies: dict[str, Any]) -> None:
        self.policies = policies

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        return next(p for key, p in self.policies.items() if f"({key})" in messages[0]["content"]).sample(
            context_ids, messages)


class _RemovesItsContainer:
    """Runs ``ls``; before its second sample, removes its episode's container (as an operator or the runtime)."""

    def __init__(self, tokens: EpisodeTokens) -> None:
        self.inner = ScriptedPolicy(tokens, [_act("ls"), _act("ls -a")])

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        if self.inner.calls == 1:
            names = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter",
                                    "name=ff-episode-calc-kill"], env=tool_env(), capture_output=True, text=True,
                                   check=True).stdout.split()
            for _ in range(20):  # podman rm can fail on a busy shm mount while the last exec ends: again
                if subprocess.run(["podman", "rm", "-f", "-t", "0", *names], env=tool_env(),
                                  capture_output=True).returncode == 0:
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"podman rm -f {names} kept failing")
        return self.inner.sample(context_ids, messages)


def _episode_containers() -> list[str]:
    return subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", "name=ff-episode"],
                          env=tool_env(), capture_output=True, text=True, check=True).stdout.split()


class _CreationSpy:
    """The real :func:`start_episode_env`, with the times each container's creation began and ended."""

    def __init__(self) -> None:
        from forgeflow.training import episodes_run

        self.real, self.spans = episodes_run.start_episode_env, []

    def __call__(self, *args: Any) -> Any:
        began = time.monotonic()
        try:
            return self.real(*args)
        finally:
            self.spans.append((began, time.monotonic()))


def test_a_solver_scores_1_through_the_turns_and_a_looper_is_stopped_with_0(
        task_image: str, tokens: EpisodeTokens, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = _ByTask({"calc-solve": ScriptedPolicy(tokens, SOLVER, split_tokens=True),
                      "calc-loop": ScriptedPolicy(tokens, LOOPER)})
    spy = _CreationSpy()
    monkeypatch.setattr("forgeflow.training.episodes_run.start_episode_env", spy)
    solved, looped = run_episodes([_job(task_image, "calc-solve"), _job(task_image, "calc-loop")], policy, tokens,
                                  SETTINGS.model_copy(update={"create_concurrency": 1}), tmp_path, GRADING)
    # two episodes at once, their sandboxes created one at a time (the creation throttle)
    (a0, a1), (b0, b1) = sorted(spy.spans)
    assert b0 >= a1, spy.spans
    assert (solved.end_reason, solved.reward, solved.exception_type, len(solved.turns)) == ("submitted", 1.0, None, 3)
    assert "+    return a + b" in solved.submission and solved.verifier.run.report_format == "pytest-report"
    # token-exact: the trained tokens are the sampled ones, turn by turn; the tool turns are masked
    trained = [t for t, m in zip(solved.completion_ids, solved.loss_mask) if m]
    assert trained == [t for turn in solved.turns for t in turn.sampled_ids]
    assert solved.turns[0].sampled_ids != tokens.tokenizer.encode(tokens.decode(solved.turns[0].sampled_ids)) + [
        tokens.eos_id]  # a non-canonical tokenization, kept as sampled
    tool_text = tokens.tokenizer.decode([t for t, m in zip(solved.completion_ids, solved.loss_mask) if not m])
    assert "def add(a, b):" in tool_text and "<returncode>0</returncode>" in tool_text
    assert json.loads(Path(solved.trajectory_path).with_name(f"{solved.episode_id}.tokens.json").read_text())[
        "loss_mask"] == solved.loss_mask
    assert (looped.end_reason, looped.reward, looped.exception_type) == ("dead_loop", 0.0, None)
    assert looped.supervision.kind == "dead_loop" and looped.supervision.evidence["period"] == 1
    assert len(looped.turns) == 3 and looped.verifier is None
    # saved as canary trajectories: the stream removed, the windows flow reads them
    traj = json.loads(Path(looped.trajectory_path).read_text())
    assert traj["info"]["exit_status"] == "dead_loop" and traj["info"]["forgeflow"]["reward"] == 0.0
    assert not list(tmp_path.glob("*.messages.jsonl"))
    assert len(parse_trajectory(solved.trajectory_path).steps) == 3
    stats = EpisodeStepStats.of(1, [solved, looped], 1.0)
    assert (stats.resolved, stats.unresolved, stats.supervision_stops, stats.turns) == (1, 1, {"dead_loop": 1}, 6)
    assert _episode_containers() == []


def test_a_lost_sandbox_is_an_exception_a_retokenized_history_is_refused_and_a_hang_is_stopped(
        task_image: str, tokens: EpisodeTokens, tmp_path: Path) -> None:
    policy = _ByTask({"calc-kill": _RemovesItsContainer(tokens),
                      "calc-chat": ScriptedPolicy(tokens, [_act("ls"), _act("ls -a")], split_tokens=True,
                                                  retokenize_history=True),
                      "calc-hang": ScriptedPolicy(tokens, [_act("sleep 300")])})
    # the hang's short watchdog in a run of its own: a sample counts as idle time, and the kill policy's
    # `podman rm` inside its sample took over 4 s on a loaded machine (a "hang" where a lost sandbox was meant)
    hang_settings = SETTINGS.model_copy(update={"concurrency": 1, "hang_idle_s": 4.0})
    lost, refused = run_episodes([_job(task_image, "calc-kill"), _job(task_image, "calc-chat")], policy, tokens,
                                 SETTINGS, tmp_path, GRADING)
    (hung,) = run_episodes([_job(task_image, "calc-hang")], policy, tokens, hang_settings, tmp_path, GRADING)
    # the canary's watchdog, reused: a command that hangs is killed after hang_idle_s (not its 30 s timeout)
    assert (hung.end_reason, hung.reward, hung.exception_type, hung.verifier) == ("hang", 0.0, None, None)
    assert hung.supervision.kind == "hang" and hung.supervision.evidence["idle_s"] >= 4.0
    assert len(hung.turns) == 1 and hung.turns[0].returncode == 137 and hung.wall_s < 25
    assert json.loads(Path(hung.trajectory_path).read_text())["info"]["exit_status"] == "hang"
    assert (lost.end_reason, lost.reward, lost.exception_type) == ("exception", None, "SandboxError")
    assert "vanished" in lost.exception_message
    assert (refused.end_reason, refused.reward, refused.exception_type) == ("prefix_mismatch", None,
                                                                           "PrefixMismatchError")
    assert len(refused.turns) == 1 and "turn 1" in refused.exception_message  # turn 0's context was the prompt
    stats = EpisodeStepStats.of(1, [lost, refused], 1.0)
    assert (stats.exceptions, stats.prefix_refused, stats.reward_mean) == (2, 1, None)
    assert stats.exception_types == {"PrefixMismatchError": 1, "SandboxError": 1}
    # the step's wall bound: an episode it leaves no time for is an exception, never 0, and starts no container
    (late,) = run_episodes([_job(task_image, "calc-late")], ScriptedPolicy(tokens, LOOPER), tokens,
                           SETTINGS.model_copy(update={"step_wall_s": 1e-6}), tmp_path, GRADING)
    assert (late.end_reason, late.reward, late.exception_type, late.turns) == ("exception", None, "StepWallError", [])
    assert _episode_containers() == []


class _PerThread:
    """Each episode (one thread of the step's pool) gets the next script: a GRPO group of a solver and a looper."""

    def __init__(self, tokens: EpisodeTokens, scripts: list[list[str]]) -> None:
        self.tokens, self.scripts, self.mine, self.lock = tokens, list(scripts), {}, threading.Lock()

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        with self.lock:
            policy = self.mine.get(threading.get_ident())
            if policy is None:
                policy = self.mine[threading.get_ident()] = ScriptedPolicy(self.tokens, self.scripts.pop(0))
        return policy.sample(context_ids, messages)


@pytest.mark.slow
def test_a_grpo_step_trains_on_episodes_and_the_lineage_keeps_their_counts(
        task_image: str, tiny: Path, tokens: EpisodeTokens, tmp_path: Path) -> None:
    from forgeflow.training.rl import RLBurstConfig, RLTask, build_rl_dataset, run_rl_burst

    task = RLTask(instance_id="calc-add", image_ref=task_image, problem_statement="test_add fails",
                  test_command=TEST_COMMAND, FAIL_TO_PASS=tuple(F2P), PASS_TO_PASS=tuple(P2P), task_timeout_s=240)
    data = build_rl_dataset([task], EPISODE_PROMPT_TEMPLATE)
    config = RLBurstConfig(max_steps=1, num_generations=2, max_completion_length=32, verifier_timeout_multiplier=0.5,
                           episode=SETTINGS)
    record = run_rl_burst(tiny, data, tmp_path / "rl-adapter", config, run_id="agentic-test",
                          policy=_PerThread(tokens, [SOLVER, LOOPER]))
    assert record.weights_changed  # rewards 1 and 0 in one group: an advantage, a gradient through the masks
    (step,) = record.episode_stats
    assert (step.episodes, step.resolved, step.unresolved, step.supervision_stops) == (2, 1, 1, {"dead_loop": 1})
    assert step.end_reasons == {"dead_loop": 1, "submitted": 1} and step.turns == 6
    written = json.loads((tmp_path / "rl-adapter" / "lineage.json").read_text())
    assert written["episode_stats"][0]["resolved"] == 1 and written["reward_counts"][0]["completions"] == 2
    assert written["lineage"]["hyperparameters"]["episode"]["max_turns"] == SETTINGS.max_turns
    assert len(list((tmp_path / "rl-episodes" / "agentic-test" / "step-0001").glob("*.traj.json"))) == 2
