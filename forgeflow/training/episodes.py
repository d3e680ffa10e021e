"""Agentic RL episodes, token-exact: the records, the tokens of a multi-turn episode and the policies.

An episode is a policy working in a fresh sandbox of the task image for several turns
(:func:`forgeflow.training.episodes_run.run_episode` runs it). This module holds what does not touch a
sandbox:

* :class:`EpisodeSettings`: the ``episode`` block of an agentic RL burst (turns, tokens, wall clock, tools,
  concurrency, the step's wall bound);
* :class:`EpisodeTokens`: the token arithmetic of a multi-turn chat **without re-tokenizing the history**
  (the bug of SkyRL #123, verl #3720, rLLM #272: a history re-rendered through the chat template is not
  the token sequence the policy sampled, so the trainer would credit tokens nobody sampled). The episode's
  sequence is built by concatenation only: the prompt's ids, then per turn the ids the policy sampled
  (loss mask 1) and the ids of the tool's output rendered as the next user turn (mask 0), the way TRL
  1.16's own tool loop builds it (``GRPOTrainer._tool_call_loop`` / ``_get_tool_suffix_ids``: the suffix
  of a dummy conversation's rendering);
* :func:`prefix_mismatch`: the prefix check. The context a policy reports having conditioned on at turn k
  must be exactly the stored sequence through turn k-1 (prompt, sampled ids, tool ids); an episode whose
  policy saw anything else (a backend that re-tokenized the history) is refused: no reward, no loss,
  counted per step;
* the policies (:class:`Policy`): :class:`TrainerPolicy` samples with the GRPO trainer's own generator
  (``GRPOTrainer._generate_single_turn``, the call TRL's tool loop makes), :class:`ScriptedPolicy` answers
  from a script (a solver, a looper: the mechanics without a model, as Harbor's oracle and nop agents).

The action format is mini-swe-agent's text format (one ```` ```mswea_bash_command ```` block per answer,
:data:`forgeflow.evaluation.supervision.MSWEA_ACTION_REGEX`) and the submit tool is mini-swe-agent's
marker command (:data:`SUBMIT_COMMAND`), so an episode's trajectory is a canary trajectory to every
reader of those (the windows flow, the loop detector).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from forgeflow.common import errors
from forgeflow.evaluation.sandbox_env import SUBMIT_MARKER
from forgeflow.evaluation.supervision import DEFAULT_HANG_IDLE_S, DEFAULT_LOOP_THRESHOLD
from forgeflow.ledger.trial_result import Supervision, VerifierEvidence
from forgeflow.sandbox.limits import Cpus, MemoryMb
from forgeflow.training.rewards import RL_VERIFIER_LIMITS

EPISODE_PROMPT_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "rl_episode_prompt.md"
"""The first user message of an episode; ``{problem_statement}`` is replaced by the task's text."""

SUBMIT_COMMAND = f"echo {SUBMIT_MARKER}"
"""The submit tool: mini-swe-agent's marker command (its output's first line ends the run)."""

Tool = Literal["bash", "submit"]
EndReason = Literal["submitted", "max_turns", "max_tokens", "wall", "dead_loop", "hang", "prefix_mismatch",
                    "exception"]
"""Why an episode ended: the policy submitted; a bound (turns, tokens, its wall clock); a supervision stop
(dead loop, hang); the prefix check refused it; an infrastructure exception."""


class EpisodeSettings(BaseModel):
    """The ``episode`` block of an agentic RL burst (its presence switches the agentic mode on); each field's
    description is the one line the run form shows beside it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_turns: int = Field(default=8, ge=1, le=1000, description="policy turns per episode (one sample, then its "
                           "tool call)")
    max_tokens: int = Field(default=4096, ge=64, description="tokens of the episode's whole sequence (prompt, "
                            "sampled and tool tokens); passing it ends the episode (max_tokens)")
    wall_s: float = Field(default=900.0, gt=0, description="wall-clock seconds per episode; past it the episode "
                          "ends (wall) and is graded on its change")
    tools: tuple[Tool, ...] = Field(default=("bash", "submit"), description="the tool set: bash (a command in the "
                                    "task's container, required) and submit (ends the episode); without submit "
                                    "only a bound ends it")
    command_timeout_s: int = Field(default=60, ge=1, description="seconds one command may run (never beyond the "
                                   "episode's wall clock)")
    output_max_chars: int = Field(default=4000, ge=200, description="characters of a command's output shown to the "
                                  "policy (head and tail kept)")
    loop_threshold: int = Field(default=DEFAULT_LOOP_THRESHOLD, ge=2, description="repeats of a call (or an A-B "
                                "cycle) at which the loop detector stops the episode (reward 0)")
    hang_idle_s: float = Field(default=DEFAULT_HANG_IDLE_S, gt=0, description="seconds without a sample or a "
                               "finished command after which the episode is hung (reward 0)")
    concurrency: int = Field(default=2, ge=1, le=64, description="episodes running at once (sandboxes, commands, "
                             "verifiers; sampling is serialized)")
    create_concurrency: int | None = Field(default=None, ge=1, le=64, description="sandboxes being created at once "
                                           "(start to first command), apart from concurrency; null: no separate "
                                           "throttle")
    step_wall_s: float = Field(default=3600.0, gt=0, description="seconds all of one step's episodes may take; "
                               "an episode running or not started past it is an exception (no reward)")
    memory_mb: MemoryMb = RL_VERIFIER_LIMITS.memory_mb
    cpus: Cpus = RL_VERIFIER_LIMITS.cpus

    @field_validator("tools")
    @classmethod
    def _bash_needed(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if "bash" not in value:
            raise ValueError("tools must include 'bash' (the policy's only way to change the repository)")
        return tuple(dict.fromkeys(value))


class EpisodeTurn(BaseModel):
    """One turn of an episode, as sampled.

    Attributes:
        index: 0-based turn number.
        context_tokens: length of the sequence the policy conditioned on (== the stored sequence).
        sampled_ids: the token ids the policy sampled, exactly (loss mask 1).
        logprobs: their log-probabilities from the sampler, when it reports them.
        command: the bash command parsed from the sample (None: a format error, or none run).
        returncode: the command's exit status (-1: timeout, OOM, process limit; None: not run).
        tool_tokens: tokens appended after the sample (the end-of-turn token where the sample lacks
            it, then the tool output as the next user turn; mask 0).
    """

    model_config = ConfigDict(frozen=True)

    index: int = Field(ge=0)
    context_tokens: int = Field(ge=0)
    sampled_ids: list[int]
    logprobs: list[float] | None = None
    command: str | None = None
    returncode: int | None = None
    tool_tokens: int = Field(default=0, ge=0)


class Episode(BaseModel):
    """One episode's outcome and its tokens.

    Attributes:
        episode_id: unique id (file names of its trajectory and tokens).
        instance_id: the task's id.
        end_reason: why it ended (:data:`EndReason`).
        reward: the verifier's 1.0 / 0.0 on the episode's final change; 0.0 for a supervision stop (dead
            loop, hang: the model's own failure, with ``supervision``); None for an exception or a refused
            prefix (never 0).
        exception_type / exception_message: the infrastructure failure (a sandbox lost mid-episode, the
            verifier broken, the step's wall bound), or ``PrefixMismatchError`` for a refused episode.
        supervision: a supervision stop's kind (dead loop, hang), evidence and trajectory.
        prompt_ids: the prompt's token ids (the first context).
        completion_ids: every token after the prompt, in order (sampled and tool tokens).
        loss_mask: per ``completion_ids`` token: 1 sampled by the policy, 0 prompt/tool tokens.
        logprobs: per ``completion_ids`` token the sampler's log-probability (0.0 for tool tokens), or
            None when the sampler reported none.
        turns: the turns (:class:`EpisodeTurn`).
        wall_s: seconds from start to the end of grading.
        verifier: the verifier's evidence (as a trial's: screening, run, notes, its Ray node) or None.
        submission: the episode's change as git wrote it in the verifier's sandbox (a unified diff), or None.
        trajectory_path: the episode's ``<episode_id>.traj.json`` (mini-swe-agent's format).
        notes: for a person.
        node_id: the Ray node the episode's container ran on (a ``ray`` dispatcher), or None: this host.
    """

    model_config = ConfigDict(frozen=True)

    episode_id: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    end_reason: EndReason
    reward: float | None = Field(default=None, ge=0.0, le=1.0)
    exception_type: str | None = None
    exception_message: str | None = None
    supervision: Supervision | None = None
    prompt_ids: list[int]
    completion_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] | None = None
    turns: list[EpisodeTurn] = Field(default_factory=list)
    wall_s: float = Field(default=0.0, ge=0)
    verifier: VerifierEvidence | None = None
    submission: str | None = None
    trajectory_path: str | None = None
    notes: list[str] = Field(default_factory=list)
    node_id: str | None = None

    @property
    def policy_tokens(self) -> int:
        """Tokens the policy sampled (loss mask 1)."""
        return sum(self.loss_mask)


# --- tokens ------------------------------------------------------------------------------------
def prefix_mismatch(stored_ids: Sequence[int], context_ids: Sequence[int]) -> int | None:
    """The prefix check: where ``context_ids`` (what a policy conditioned on at turn k) departs from
    ``stored_ids`` (the episode's stored sequence through turn k-1), or None when they are equal.

    Args:
        stored_ids: the stored sequence (prompt, sampled and tool ids so far).
        context_ids: the sequence the policy reports having conditioned on.

    Returns:
        The first differing position (``min`` of the lengths when one is a strict prefix of the other), or
        None when the two are identical.
    """
    for i, (a, b) in enumerate(zip(stored_ids, context_ids)):
        if a != b:
            return i
    return None if len(stored_ids) == len(context_ids) else min(len(stored_ids), len(context_ids))


class EpisodeTokens:
    """The token arithmetic of an episode with one tokenizer (a chat template's rendering, never the history's).

    Args:
        tokenizer: a transformers tokenizer with a chat template and an eos token ending each turn
            (Qwen2.5's ``<|im_end|>``).

    Raises:
        InputError: the tokenizer has no chat template or no eos token.
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None) or tokenizer.eos_token_id is None:
            raise errors.InputError("an episode needs a tokenizer with a chat template and an eos token")
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
        prefix = self._render(dummy, generation_prompt=False)
        last_eos = max(i for i, t in enumerate(prefix) if t == self.eos_id)
        self._dummy, self._dummy_prefix = dummy, prefix[: last_eos + 1]

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                 return_dict=False)
        return [int(t) for t in ids]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first context: ``messages`` rendered by the chat template with the generation prompt."""
        return self._render(messages, generation_prompt=True)

    def tool_ids(self, observation: str, sampled_ids: Sequence[int]) -> list[int]:
        """The ids appended after a turn's sample: the eos token when the sample does not end with it, then
        ``observation`` as the next user turn and the assistant's generation prompt (the suffix of a dummy
        conversation's rendering past its last eos, as TRL's ``_get_tool_suffix_ids``).

        Raises:
            InputError: the chat template does not render the dummy conversation as a prefix of itself.
        """
        full = self._render([*self._dummy, {"role": "user", "content": observation}], generation_prompt=True)
        if full[: len(self._dummy_prefix)] != self._dummy_prefix:
            raise errors.InputError("the chat template is not prefix-preserving: a turn cannot be appended by "
                                    "concatenation (TRL swaps in a training template for such models)")
        closing = [] if sampled_ids and sampled_ids[-1] == self.eos_id else [self.eos_id]
        return closing + full[len(self._dummy_prefix):]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of sampled ids, special tokens dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# --- policies ----------------------------------------------------------------------------------
class TurnSample(BaseModel):
    """What a policy returns for one turn.

    Attributes:
        context_ids: the sequence it conditioned on (the prefix check compares it with the stored one).
        completion_ids: the ids it sampled.
        logprobs: their log-probabilities, when the sampler reports them.
    """

    model_config = ConfigDict(frozen=True)

    context_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None = None


class Policy(Protocol):
    """Samples one turn: given the stored sequence (and the messages, for a text-only backend)."""

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        """One turn's sample after ``context_ids`` (the episode's stored sequence)."""
        ...


class TrainerPolicy:
    """The GRPO trainer's own generator as an episode's policy: ``GRPOTrainer._generate_single_turn`` on the
    stored ids (token ids in, token ids out: nothing re-tokenized), one turn of at most the trainer's
    ``max_completion_length`` tokens; logprobs where the backend gives them (vLLM; None for transformers).
    Calls are serialized by a lock: episodes run their commands in parallel, the model samples one at a time.

    Args:
        trainer: a ``trl.GRPOTrainer`` (or ``RLOOTrainer``) mid-training.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._lock = threading.Lock()

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        """Sample one turn after ``context_ids`` with the trainer's model and generation config."""
        with self._lock:
            completion, logprobs = self.trainer._generate_single_turn([list(context_ids)], None, {}, 1)
        ids = [int(t) for t in completion[0]]
        lps = [float(x) for x in logprobs[0]] if logprobs is not None else None
        return TurnSample(context_ids=list(context_ids), completion_ids=ids, logprobs=lps)


class ScriptedPolicy:
    """A policy that answers from a script: turn k's answer is ``answers[k]`` (the last one again after the
    script ends), ended by the eos token, as a solver or a looper for the mechanics without a model.

    Args:
        tokens: the episode's :class:`EpisodeTokens`.
        answers: the answers' texts, in order (at least one).
        split_tokens: sample each character as its own token (a valid but non-canonical tokenization, as a
            sampler may produce; re-tokenizing its text gives other ids).
        retokenize_history: condition on the messages re-rendered by the chat template instead of the stored
            ids (what a chat-completions endpoint does: the bug the prefix check refuses).

    Raises:
        InputError: ``answers`` is empty.
    """

    def __init__(self, tokens: EpisodeTokens, answers: Sequence[str], *, split_tokens: bool = False,
                 retokenize_history: bool = False) -> None:
        if not answers:
            raise errors.InputError("a scripted policy needs at least one answer")
        self.tokens, self.answers = tokens, list(answers)
        self.split_tokens, self.retokenize_history = split_tokens, retokenize_history
        self.calls = 0

    def _ids(self, text: str) -> list[int]:
        tok = self.tokens.tokenizer
        if self.split_tokens:
            return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
        return list(tok.encode(text, add_special_tokens=False))

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> TurnSample:
        """The next scripted answer's ids (then eos); the context is the stored ids, or the re-rendered
        messages with ``retokenize_history``."""
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        context = self.tokens.prompt_ids(messages) if self.retokenize_history else list(context_ids)
        return TurnSample(context_ids=context, completion_ids=[*self._ids(answer), self.tokens.eos_id])
