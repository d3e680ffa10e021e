"""Running agentic RL episodes: a policy in a fresh sandbox of the task image, graded by the verifier.

:func:`run_episode` runs one episode (:mod:`forgeflow.training.episodes` holds its records, tokens and
policies):

1. a fresh container of the task image on the sandbox backend (a kind, or a ``forgeflow-sandbox`` block's
   :class:`~forgeflow.sandbox.backends.SandboxTarget`), through the canary agent's own environment
   (:class:`forgeflow.evaluation.sandbox_env.SandboxEnvironment`: no network, memory/CPU limits, ``/testbed``,
   mini-swe-agent's command environment);
2. per turn: the policy samples after the stored sequence (the prefix check first,
   :func:`forgeflow.training.episodes.prefix_mismatch`); one ```` ```mswea_bash_command ```` block is the tool
   call (none or several: a format error shown to the policy, its outcome); the call goes through the canary's
   loop detector (:class:`forgeflow.evaluation.supervision.LoopDetector`) before it runs, and a
   :class:`~forgeflow.evaluation.supervision.HangWatchdog` kills the episode's commands when nothing happened for
   ``hang_idle_s``; the command runs in the container (timeout: the smaller of ``command_timeout_s`` and the
   episode's wall clock left); its output is appended as the next user turn (mask 0);
3. the end: submit (:data:`~forgeflow.training.episodes.SUBMIT_COMMAND`), ``max_turns``, ``max_tokens``,
   ``wall_s``, a supervision stop, a refused prefix or an exception;
4. the reward, taken as the canary's agent trial takes it (:mod:`forgeflow.evaluation.agent`): the container's
   tree copied out where the policy has no hand (``agent.take_submission``), then
   :func:`forgeflow.sandbox.dispatch.verify_on` in a fresh container of the pristine image on git's own diff.

Outcomes versus breakage: the policy's format errors, failing or timed-out commands and the bounds are its
outcomes (the verifier grades its change: 1.0 or 0.0); a dead loop or a hang is its failure (reward 0.0,
with ``supervision`` evidence; the verifier is not run: a looping policy is not credited a fix it made
before looping); a container lost mid-episode, a verifier that broke, the step's wall bound are exceptions
(reward None, never 0); a refused prefix is ``PrefixMismatchError`` (reward None, no loss).

Trajectories are saved as canary trajectories: each message appended to ``<episode_id>.messages.jsonl`` as
it happens, ``<episode_id>.traj.json`` (mini-swe-agent's format, ``info.forgeflow`` with the episode's
outcome) written atomically at the end and the stream removed; the token record (ids per turn, the loss
mask) goes to ``<episode_id>.tokens.json``.

:func:`run_episodes` runs a step's episodes in parallel (``concurrency``), under the step's wall bound.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from forgeflow.common import errors
from forgeflow.common.errors import PrefixMismatchError, StepWallError
from forgeflow.common.fsutil import atomic_write_text
from forgeflow.common.names import sanitize_name
from forgeflow.evaluation.agent import AgentPhase, take_submission
from forgeflow.evaluation.mswea import stream_path, write_trajectory
from forgeflow.evaluation.sandbox_env import SandboxEnvironment
from forgeflow.evaluation.supervision import BASH_TOOL, MSWEA_ACTION_REGEX, HangWatchdog, LoopDetector, ToolCall
from forgeflow.ledger.trial_result import Supervision, VerifierEvidence
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.dispatch import verify_on
from forgeflow.sandbox.scoring import SubmissionVerdict
from forgeflow.sandbox.verifier import TaskTests
from forgeflow.training.episodes import (
    EndReason,
    Episode,
    EpisodeSettings,
    EpisodeTokens,
    EpisodeTurn,
    Policy,
    prefix_mismatch,
)
from forgeflow.training.episodes_env import start_episode_env
from forgeflow.training.episodes_ray import RayEpisodeEnv

FORMAT_ERROR = ("Please always provide EXACTLY ONE action in triple backticks, found {n} actions.\n"
                "Answer with one ```mswea_bash_command block holding one command.")
"""The observation after a sample without exactly one action (mini-swe-agent's format error, shortened)."""


def _observation(output: dict[str, Any], max_chars: int) -> str:
    """A command's result as the policy sees it (mini-swe-agent's returncode/output form; head and tail kept)."""
    text = output.get("output", "")
    if output.get("exception_info"):
        text = f"{output['exception_info']}\n{text}"
    if len(text) > max_chars:
        half = max_chars // 2
        text = f"{text[:half]}\n[... {len(text) - max_chars} characters elided ...]\n{text[-half:]}"
    return f"<returncode>{output.get('returncode')}</returncode>\n<output>\n{text}\n</output>"


def episode_messages(problem_statement: str, template: str) -> list[dict[str, Any]]:
    """An episode's first messages: the template's user turn with ``{problem_statement}`` replaced."""
    return [{"role": "user", "content": template.replace("{problem_statement}", problem_statement)}]


class _Trajectory:
    """The episode's messages streamed to ``<id>.messages.jsonl``, then saved as ``<id>.traj.json``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = open(stream_path(path), "a", encoding="utf-8")  # noqa: SIM115 - held for the episode

    def add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if not self._stream.closed:
            self._stream.write(json.dumps(message, ensure_ascii=False) + "\n")
            self._stream.flush()

    def save(self, info: dict[str, Any], instance_id: str) -> None:
        self._stream.close()
        write_trajectory(self.path, {"info": info, "messages": self.messages, "instance_id": instance_id,
                                     "trajectory_format": "mini-swe-agent-1.1"})
        stream_path(self.path).unlink(missing_ok=True)


class _EpisodeRun:
    """One episode's state (internal to :func:`run_episode`)."""

    def __init__(self, task: TaskTests, messages: list[dict[str, Any]], tokens: EpisodeTokens,
                 settings: EpisodeSettings, episode_id: str, out_dir: Path) -> None:
        self.task, self.tokens, self.settings, self.episode_id = task, tokens, settings, episode_id
        self.messages = [dict(m) for m in messages]
        self.prompt_ids = tokens.prompt_ids(self.messages)
        self.completion: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] | None = []
        self.turns: list[EpisodeTurn] = []
        self.end: EndReason | None = None
        self.error: BaseException | None = None
        self.supervision: Supervision | None = None
        self.node_id: str | None = None
        self.notes: list[str] = []
        self.traj = _Trajectory(out_dir / f"{episode_id}.traj.json")
        for m in self.messages:
            self.traj.add(m)

    @property
    def stored(self) -> list[int]:
        return self.prompt_ids + self.completion

    def _stop(self, kind: str, evidence: dict[str, Any]) -> None:
        self.end = "dead_loop" if kind == "dead_loop" else "hang"
        self.supervision = Supervision(kind=self.end, evidence=evidence, trajectory_path=str(self.traj.path))

    def turn(self, index: int, policy: Policy, env: SandboxEnvironment, watchdog: HangWatchdog,
             detector: LoopDetector, deadline: float) -> None:
        """Sample, check, act and append one turn; sets :attr:`end` when the episode ends with it."""
        watchdog.touch_model_call()
        stored = self.stored
        sample = policy.sample(list(stored), [dict(m) for m in self.messages])
        watchdog.touch_model_call()
        where = prefix_mismatch(stored, sample.context_ids)
        if where is not None:
            self.end, self.error = "prefix_mismatch", PrefixMismatchError(
                f"turn {index}: the policy conditioned on {len(sample.context_ids)} tokens that depart from the "
                f"{len(stored)} stored at position {where} (a re-tokenized history): episode refused")
            return
        ids, lps = list(sample.completion_ids), sample.logprobs
        budget = self.settings.max_tokens - len(stored)
        cut = len(ids) > budget
        ids = ids[:budget]
        self.completion += ids
        self.mask += [1] * len(ids)
        if self.logprobs is not None and lps is not None and len(lps) >= len(ids):
            self.logprobs += [float(x) for x in lps[: len(ids)]]
        else:
            self.logprobs = None
        text = self.tokens.decode(ids)
        self.traj.add({"role": "assistant", "content": text})
        watchdog.touch_message()
        if cut:
            self.end = "max_tokens"
            self.turns.append(EpisodeTurn(index=index, context_tokens=len(stored), sampled_ids=ids, logprobs=lps))
            return
        command, returncode, observation = self._act(text, env, watchdog, detector, deadline)
        tool = self.tokens.tool_ids(observation, ids) if self.end is None else []
        if self.end is None and len(self.stored) + len(tool) > self.settings.max_tokens:
            self.end, tool = "max_tokens", []
        self.turns.append(EpisodeTurn(index=index, context_tokens=len(stored), sampled_ids=ids, logprobs=lps,
                                      command=command, returncode=returncode, tool_tokens=len(tool)))
        if tool:
            self.completion += tool
            self.mask += [0] * len(tool)
            if self.logprobs is not None:
                self.logprobs += [0.0] * len(tool)
            self.messages.append({"role": "assistant", "content": text})
            self.messages.append({"role": "user", "content": observation})
            self.traj.add({"role": "user", "content": observation})

    def _act(self, text: str, env: SandboxEnvironment, watchdog: HangWatchdog, detector: LoopDetector,
             deadline: float) -> tuple[str | None, int | None, str]:
        """Run the sample's one command (after the loop detector); ``(command, returncode, observation)``."""
        from minisweagent.exceptions import Submitted

        actions = [a.strip() for a in re.findall(MSWEA_ACTION_REGEX, text, re.DOTALL)]
        if len(actions) != 1:
            return None, None, FORMAT_ERROR.format(n=len(actions))
        command = actions[0]
        detection = detector.add(ToolCall(name=BASH_TOOL, arguments=command, message_index=len(self.traj.messages) - 1))
        if detection.detected:
            self._stop("dead_loop", detection.model_dump(mode="json"))
            return command, None, ""
        timeout = max(1, min(self.settings.command_timeout_s, int(deadline - time.monotonic())))
        try:
            output = env.execute({"command": command}, timeout=timeout)
        except Submitted as exc:
            if "submit" in self.settings.tools:
                self.end = "submitted"
                self.traj.add(exc.messages[0] if exc.messages else {"role": "exit", "content": ""})
                return command, 0, ""
            output = {"output": exc.messages[0].get("content", "") if exc.messages else "", "returncode": 0}
        watchdog.touch_message()
        if watchdog.hung and watchdog.hang is not None:
            self._stop("hang", watchdog.hang.model_dump(mode="json"))
            return command, output.get("returncode"), ""
        return command, output.get("returncode"), _observation(output, self.settings.output_max_chars)


def episode_container_name(instance_id: str, episode_id: str) -> str:
    """The episode's container name: ``ff-episode-<instance id>-<episode id[:10]>``, sanitized."""
    return sanitize_name(f"ff-episode-{instance_id}-{episode_id[:10]}")


def _episode_env(task: TaskTests, settings: EpisodeSettings, grading: dict[str, Any], name: str,
                 deadline: float) -> Any:
    """The episode's container: here, or on a Ray sandbox node when ``grading["ray"]`` names a cluster
    (:class:`forgeflow.training.episodes_ray.RayEpisodeEnv`: commands there, the policy here), placed by
    ``deadline`` (monotonic seconds) or a SandboxError (no node left with the resource, say)."""
    if grading.get("ray") is None:
        return start_episode_env(task, settings, grading["backend"], name)
    return RayEpisodeEnv(grading["ray"], task, settings, grading["backend"], name,
                         start_timeout_s=max(0.0, deadline - time.monotonic()))


def _grade(run: _EpisodeRun, env: Any, task: TaskTests, settings: EpisodeSettings,
           grading: dict[str, Any]) -> SubmissionVerdict:
    """The reward of a finished episode, taken as the agent trial takes it: the tree out of the stopped
    container (``agent.take_submission``), the verifier on it in a fresh pristine container."""
    phase = AgentPhase()
    if isinstance(env, SandboxEnvironment):
        take_submission(env, phase)
    else:  # on a Ray node: the tree is taken there
        env.take_submission(phase)
    run.notes.extend(phase.notes)
    if phase.error is not None:  # the container vanished before its tree was taken: infrastructure
        raise phase.error
    _stop_env(env, run)  # the tree is out: free the container (and a Ray node's slot) before the verifier
    timeout_s = grading["verifier_timeout_s"]
    timeout_s = timeout_s[task.instance_id] if isinstance(timeout_s, dict) else timeout_s
    verdict = verify_on(grading.get("ray"), task, phase.submission, timeout_s=float(timeout_s),
                        spec=SandboxSpec(memory_mb=settings.memory_mb, cpus=settings.cpus),
                        name=sanitize_name(f"ff-episodeverify-{task.instance_id}-{run.episode_id[:10]}"),
                        backend=grading["backend"], tree=phase.tree)
    run.notes.extend(verdict.notes)
    return verdict


def run_episode(task: TaskTests, messages: list[dict[str, Any]], policy: Policy, tokens: EpisodeTokens,
                settings: EpisodeSettings, out_dir: Path, grading: dict[str, Any]) -> Episode:
    """Run one episode of ``policy`` on ``task`` in a fresh sandbox, graded by the verifier.

    Args:
        task: the task (:class:`forgeflow.evaluation.agent.TaskTests`: image, tests, problem statement).
        messages: the first messages (:func:`episode_messages`; in a burst, the dataset's prompt).
        policy: samples each turn (:class:`~forgeflow.training.episodes.Policy`).
        tokens: the tokenizer's :class:`~forgeflow.training.episodes.EpisodeTokens`.
        settings: the bounds and tools (:class:`~forgeflow.training.episodes.EpisodeSettings`).
        out_dir: where the trajectory (``<episode_id>.traj.json``) and tokens (``.tokens.json``) go.
        grading: ``backend`` (kind or SandboxTarget, the episode's and the verifier's containers),
            ``verifier_timeout_s`` (seconds, or instance id -> seconds), optional ``ray`` (a
            :class:`~forgeflow.sandbox.dispatch.RayPlacement`: the episode's container runs on a sandbox node
            of that cluster, :mod:`forgeflow.training.episodes_ray`, and the verifier too),
            ``episode_id`` (default a uuid4 hex), ``deadline_monotonic`` (the step's wall bound) and
            ``create_gate`` (a semaphore held while the container is created, up to its first command).

    Returns:
        The :class:`~forgeflow.training.episodes.Episode` (never raises for a sandbox or verifier failure:
        those are its exception, reward None).

    Raises:
        InputError: the chat template cannot append turns by concatenation.
    """
    t0 = time.monotonic()
    episode_id = grading.get("episode_id") or uuid.uuid4().hex
    step_deadline = grading.get("deadline_monotonic")
    deadline = t0 + settings.wall_s if step_deadline is None else min(t0 + settings.wall_s, step_deadline)
    run = _EpisodeRun(task, messages, tokens, settings, episode_id, Path(out_dir))
    env: Any = None  # a SandboxEnvironment, or a RayEpisodeEnv on a Ray node
    watchdog = HangWatchdog(settings.hang_idle_s, on_hang=lambda _check: env.interrupt() if env else None)
    reward, verdict = None, None
    try:
        if step_deadline is not None and time.monotonic() >= step_deadline:
            raise StepWallError("the step's wall bound passed before the episode started")
        with grading.get("create_gate") or nullcontext():  # settings.create_concurrency creations at once
            env = _episode_env(task, settings, grading, episode_container_name(task.instance_id, episode_id),
                               deadline)
        run.node_id = getattr(env, "node_id", None)
        watchdog.start()
        detector = LoopDetector(settings.loop_threshold)
        for index in range(settings.max_turns):
            if time.monotonic() >= deadline:
                run.end = "wall"
                break
            run.turn(index, policy, env, watchdog, detector, deadline)
            if run.end is not None:
                break
        run.end = run.end or "max_turns"
        watchdog.stop()
        if run.end == "wall" and step_deadline is not None and deadline == step_deadline < t0 + settings.wall_s:
            raise StepWallError(f"the step's wall bound stopped the episode after {time.monotonic() - t0:.1f} s")
        if run.end in ("dead_loop", "hang"):
            reward = 0.0
        elif run.end != "prefix_mismatch":
            verdict = _grade(run, env, task, settings, grading)
            reward = verdict.reward
    except errors.InfraError as exc:  # the sandbox lost, the verifier broken, the step's bound: no reward
        run.error, run.end, reward = exc, "exception", None
    finally:
        watchdog.stop()
        if env is not None:
            _stop_env(env, run)
    return _finish(run, reward, verdict, time.monotonic() - t0)


def _stop_env(env: Any, run: _EpisodeRun) -> None:
    """Remove the episode's container (idempotent); a failure is a note, never the episode's outcome."""
    try:
        env.stop()
    except errors.InfraError as exc:
        run.notes.append(f"could not remove the episode's container: {type(exc).__name__}: {exc}")


def _finish(run: _EpisodeRun, reward: float | None, verdict: SubmissionVerdict | None, wall_s: float) -> Episode:
    """The episode's record; its trajectory and tokens written."""
    error = run.error
    verifier = None if verdict is None else VerifierEvidence.model_validate({**verdict.evidence,
                                                                             "notes": verdict.notes})
    episode = Episode(
        episode_id=run.episode_id, instance_id=run.task.instance_id, end_reason=run.end or "exception",
        reward=reward, exception_type=type(error).__name__ if error is not None else None,
        exception_message=str(error) if error is not None else None, supervision=run.supervision,
        prompt_ids=run.prompt_ids, completion_ids=run.completion, loss_mask=run.mask, logprobs=run.logprobs,
        turns=run.turns, wall_s=wall_s, verifier=verifier, trajectory_path=str(run.traj.path), notes=run.notes,
        node_id=run.node_id, submission=verdict.submission_patch if verdict is not None else None,
    )
    summary = episode.model_dump(mode="json", exclude={"prompt_ids", "completion_ids", "loss_mask", "logprobs",
                                                       "turns", "verifier", "submission"})
    submission = episode.submission or ""
    run.traj.save({"exit_status": episode.end_reason, "submission": submission,
                   "forgeflow": {**summary, "n_steps": len(run.turns), "n_output_tokens": episode.policy_tokens}},
                  run.task.instance_id)
    atomic_write_text(run.traj.path.with_name(f"{run.episode_id}.tokens.json"), json.dumps(episode.model_dump(
        mode="json", include={"episode_id", "prompt_ids", "completion_ids", "loss_mask", "logprobs", "turns"})))
    return episode


def run_episodes(jobs: Sequence[tuple[TaskTests, list[dict[str, Any]]]], policy: Policy, tokens: EpisodeTokens,
                 settings: EpisodeSettings, out_dir: Path, grading: dict[str, Any]) -> list[Episode]:
    """Run a step's episodes, ``settings.concurrency`` at a time, under ``settings.step_wall_s``.

    Args:
        jobs: ``(task, first messages)`` per episode, in order.
        policy: shared by the episodes (a :class:`~forgeflow.training.episodes.TrainerPolicy` serializes
            its sampling; the commands and verifiers run in parallel).
        tokens / settings / out_dir: as :func:`run_episode`.
        grading: as :func:`run_episode` (``episode_id``, ``deadline_monotonic`` and ``create_gate``, of
            ``settings.create_concurrency`` slots, are set here).

    Returns:
        One :class:`~forgeflow.training.episodes.Episode` per job, in order.
    """
    deadline = time.monotonic() + settings.step_wall_s
    base = {k: v for k, v in grading.items() if k != "episode_id"}
    if settings.create_concurrency is not None:
        base["create_gate"] = threading.BoundedSemaphore(settings.create_concurrency)

    def one(job: tuple[TaskTests, list[dict[str, Any]]]) -> Episode:
        return run_episode(job[0], job[1], policy, tokens, settings, out_dir,
                           {**base, "episode_id": uuid.uuid4().hex, "deadline_monotonic": deadline})

    with ThreadPoolExecutor(max_workers=settings.concurrency, thread_name_prefix="forgeflow-episode") as pool:
        return list(pool.map(one, jobs))

