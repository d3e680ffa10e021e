"""Agentic GRPO/RLOO: TRL 1.16's trainer learns from forgeflow's episodes, token-exact.

Why not TRL's ``environment_factory`` / ``tools``: in TRL 1.16 (``GRPOTrainer._tool_call_loop``) a tool that
raises becomes a ``{"error": ...}`` message the model reads (a sandbox lost mid-episode would be scored as the
model's outcome, never an exception), a rollout ends only when the model stops calling tools (no submit, no
wall clock, no supervision stop), tool calls run one after another, and calls are parsed from the tokenizer's
``response_schema``. Its token handling is what forgeflow keeps: sampled ids concatenated with the tool
output's ids, a 0/1 mask over them. So the trainer's ``rollout_func`` hook is used instead (TRL: "It must
return a dict with prompt_ids, completion_ids and logprobs ... Any other fields are forwarded to the reward
functions"; an ``env_mask`` field is its ``tool_mask``): :class:`EpisodeRollout` runs one episode per prompt
(:func:`forgeflow.training.episodes_run.run_episodes`, sampling with the trainer's own generator through
:class:`~forgeflow.training.episodes.TrainerPolicy`) and returns the episodes' ids, their loss masks as
``env_mask`` and their rewards, which :func:`episode_reward` hands back to the trainer. The trainer's own
loss then runs on (ids, mask, group advantage): ``completion_mask * tool_mask`` keeps tool and prompt tokens
out of it.

An episode without a reward (an exception, a refused prefix) gives None: TRL makes it NaN, leaves it out of
its group's baseline and sets its advantage to 0 (:mod:`forgeflow.training.rl`), and its loss mask is zeroed
here as well, so it trains nothing. Per step, :class:`EpisodeStepStats` counts rewards, exceptions by type,
refused prefixes, supervision stops, end reasons, turns and tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.sandbox.verifier import TaskTests
from forgeflow.training.episodes import Episode, EpisodeSettings, EpisodeTokens, Policy, TrainerPolicy
from forgeflow.training.episodes_run import run_episodes
from forgeflow.training.rewards import StepRewardCounts


class EpisodeJob(NamedTuple):
    """One episode to run: the task, its first messages, the verifier's timeout (seconds)."""

    task: TaskTests
    messages: list[dict[str, Any]]
    verifier_timeout_s: float


class EpisodeStepStats(BaseModel):
    """The episodes of one optimizer step.

    Attributes:
        step: the optimizer step (1-based).
        episodes: episodes run.
        resolved / unresolved: reward 1.0 / 0.0 (supervision stops among ``unresolved``).
        exceptions: no reward (infrastructure, the step's wall bound, refused prefixes).
        exception_types: exception class name -> count (``PrefixMismatchError`` included).
        prefix_refused: episodes the prefix check refused.
        supervision_stops: ``dead_loop`` / ``hang`` -> count.
        end_reasons: end reason -> count.
        turns: turns over all episodes; turns_max: the longest episode's.
        policy_tokens: tokens sampled (loss mask 1) over all episodes.
        wall_s: seconds the step's episodes took together.
        reward_mean: mean reward of the scored episodes (None when none was scored).
        nodes: Ray node id -> episodes whose container ran there (empty: all on this host).
    """

    model_config = ConfigDict(frozen=True)

    step: int = Field(ge=1)
    episodes: int = Field(default=0, ge=0)
    resolved: int = Field(default=0, ge=0)
    unresolved: int = Field(default=0, ge=0)
    exceptions: int = Field(default=0, ge=0)
    exception_types: dict[str, int] = Field(default_factory=dict)
    prefix_refused: int = Field(default=0, ge=0)
    supervision_stops: dict[str, int] = Field(default_factory=dict)
    end_reasons: dict[str, int] = Field(default_factory=dict)
    turns: int = Field(default=0, ge=0)
    turns_max: int = Field(default=0, ge=0)
    policy_tokens: int = Field(default=0, ge=0)
    wall_s: float = Field(default=0.0, ge=0)
    reward_mean: float | None = None
    nodes: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def of(cls, step: int, episodes: Sequence[Episode], wall_s: float) -> "EpisodeStepStats":
        """The counts of ``episodes`` run for ``step`` in ``wall_s`` seconds."""
        scored = [e.reward for e in episodes if e.reward is not None]
        return cls(
            step=step, episodes=len(episodes), resolved=sum(r == 1.0 for r in scored),
            unresolved=sum(r == 0.0 for r in scored), exceptions=sum(e.reward is None for e in episodes),
            exception_types=dict(sorted(Counter(e.exception_type for e in episodes if e.exception_type).items())),
            prefix_refused=sum(e.end_reason == "prefix_mismatch" for e in episodes),
            supervision_stops=dict(sorted(Counter(e.supervision.kind for e in episodes if e.supervision).items())),
            end_reasons=dict(sorted(Counter(e.end_reason for e in episodes).items())),
            turns=sum(len(e.turns) for e in episodes), turns_max=max((len(e.turns) for e in episodes), default=0),
            policy_tokens=sum(e.policy_tokens for e in episodes), wall_s=wall_s,
            reward_mean=sum(scored) / len(scored) if scored else None,
            nodes=dict(sorted(Counter(e.node_id for e in episodes if e.node_id).items())),
        )

    def reward_counts(self) -> StepRewardCounts:
        """The step as the bursts' :class:`~forgeflow.training.rewards.StepRewardCounts` (an episode is a
        completion; the scored-fraction gate and ``lineage.json``'s ``reward_counts`` read these)."""
        return StepRewardCounts(step=self.step, completions=self.episodes, resolved=self.resolved,
                                unresolved=self.unresolved, exceptions=self.exceptions,
                                exception_types=dict(self.exception_types))


def _prompt_key(prompt: Any) -> str:
    """The text that identifies a dataset prompt: its last message's content (a conversational prompt)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return str(prompt)


class EpisodeRollout:
    """TRL's ``rollout_func``: one episode per prompt, the episodes' tokens and masks back to the trainer.

    Args:
        rows: the RL dataset's rows (``prompt`` and the task columns of
            :func:`forgeflow.training.rl.build_rl_dataset`, ``verifier_timeout_s`` computed per row).
        settings: the ``episode`` block.
        out_dir: trajectories go to ``<out_dir>/step-<NNNN>/``.
        grading: as :func:`forgeflow.training.episodes_run.run_episode` (``backend``, optional ``ray``).
        policy: the policy; None: the trainer's own generator (:class:`TrainerPolicy`).

    Attributes:
        stats: one :class:`EpisodeStepStats` per step, in order.

    Raises:
        InputError: two rows share one prompt text (an episode could not tell which task it is).
    """

    def __init__(self, rows: Sequence[dict[str, Any]], settings: EpisodeSettings, out_dir: Path,
                 grading: dict[str, Any], policy: Policy | None = None) -> None:
        self.settings, self.out_dir, self.grading, self.policy = settings, Path(out_dir), dict(grading), policy
        self._rows: dict[str, dict[str, Any]] = {}
        for row in rows:
            key = _prompt_key(row["prompt"])
            if key in self._rows and self._rows[key]["instance_id"] != row["instance_id"]:
                raise errors.InputError(f"tasks {self._rows[key]['instance_id']!r} and {row['instance_id']!r} "
                                        "share one prompt: an episode could not tell which task it runs")
            self._rows[key] = dict(row)
        self.stats: list[EpisodeStepStats] = []
        self._tokens: EpisodeTokens | None = None

    def _job(self, prompt: Any) -> EpisodeJob:
        row = self._rows.get(_prompt_key(prompt))
        if row is None:
            raise errors.InputError("a prompt the trainer handed over is not in the RL dataset")
        task = TaskTests(instance_id=row["instance_id"], image_ref=row["image_ref"],
                         problem_statement=_prompt_key(prompt), test_command=row["test_command"],
                         FAIL_TO_PASS=list(row["FAIL_TO_PASS"]), PASS_TO_PASS=list(row["PASS_TO_PASS"]),
                         known_tests=row.get("known_tests"), pristine_duration_s=row.get("pristine_duration_s"))
        return EpisodeJob(task, [dict(m) for m in prompt], float(row["verifier_timeout_s"]))

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        """Run the episodes of ``prompts`` (one each, in order) for the trainer's next step.

        Returns:
            ``prompt_ids``, ``completion_ids`` (each ending at its last sampled token; an episode with none
            gets the eos token, masked), ``logprobs`` (None unless every episode has them), ``env_mask``
            (the loss masks; all 0 for an episode without a reward) and ``episode_reward`` (per prompt).
        """
        self._tokens = self._tokens or EpisodeTokens(trainer.processing_class)
        policy = self.policy or TrainerPolicy(trainer)
        step = int(trainer.state.global_step) + 1
        t0 = time.monotonic()
        jobs = [self._job(p) for p in prompts]
        episodes = run_episodes([(j.task, j.messages) for j in jobs], policy, self._tokens, self.settings,
                                self.out_dir / f"step-{step:04d}",
                                {**self.grading, "verifier_timeout_s": {j.task.instance_id: j.verifier_timeout_s
                                                                        for j in jobs}})
        self.stats.append(EpisodeStepStats.of(step, episodes, time.monotonic() - t0))
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "env_mask": [], "episode_reward": []}
        logprobs: list[list[float]] | None = []
        for e in episodes:
            last = max((i for i, m in enumerate(e.loss_mask) if m), default=-1)
            ids, mask = e.completion_ids[: last + 1], e.loss_mask[: last + 1]
            if e.reward is None:
                mask = [0] * len(mask)
            if not ids:
                ids, mask = [self._tokens.eos_id], [0]
            out["prompt_ids"].append(e.prompt_ids)
            out["completion_ids"].append(ids)
            out["env_mask"].append(mask)
            out["episode_reward"].append(e.reward)
            if logprobs is not None and e.logprobs is not None and last >= 0:
                logprobs.append(e.logprobs[: last + 1])
            else:
                logprobs = None
        out["logprobs"] = logprobs
        return out


def episode_reward(prompts: list, completions: list, episode_reward: list[float | None] | None = None,
                   **_: Any) -> list[float | None]:
    """The TRL reward function of agentic bursts: each episode's own reward (from :class:`EpisodeRollout`).

    Raises:
        InputError: the trainer did not forward ``episode_reward`` (the rollout did not run).
    """
    if episode_reward is None or len(episode_reward) != len(completions):
        raise errors.InputError("episode_reward missing or of the wrong length: the episode rollout did not run")
    return list(episode_reward)
