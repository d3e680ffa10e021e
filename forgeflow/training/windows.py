"""Training windows from agent trajectories: replay windows and anti-loop windows.

A long agent run does not fit one training sample, and its dead loops are what training should
remove. This module cuts mini-swe-agent trajectories (as forgeflow's canary records them,
``forgeflow.evaluation.agent``: the text format, one ```` ```mswea_bash_command ```` fence per assistant
message, or the tool-call format, OpenAI ``tool_calls`` answered by ``tool`` messages) into
prompt/completion samples in TRL's conversational prompt-completion format (``prompt``: chat
messages, ``completion``: one assistant message; TRL computes the loss on the completion only),
as an HF :class:`datasets.Dataset` with a ``provenance`` column.

**Steps.** A step is an assistant message with exactly one action (one fence, or one tool call)
and its observation (the ``user``/``tool`` messages up to the next assistant message). An
assistant message with zero or several actions cannot have its reasoning aligned to one action
(in the text format mini-swe-agent executed none of them and answered with a format error; in
the tool-call format it ran several calls after one reasoning text), so the message and its
answers are dropped from every window and counted (``dropped_no_action`` /
``dropped_several_actions``), never guessed.

**Messages** in the dataset all have the keys ``role``, ``content`` (text; ``""`` for none),
``tool_calls`` (None, or ``[{id, type, function: {name, arguments}}]`` with ``arguments`` a JSON
string) and ``tool_call_id`` (None, or the call a ``tool`` message answers), as chat templates
with tool support expect.

**Window layout** (every kind): ``[system]`` (the trajectory's system message, verbatim, unless
``include_system=False``), one ``user`` message = the task excerpt (the instance message, cut at
``task_excerpt_chars``) + a progress recap of the steps older than the last ``replay_steps``
(one line per step: its number, the first line of its command, its return code), then the last
``replay_steps`` steps replayed verbatim (assistant message, observation messages); the
completion is the continuation target.

**Kinds.**

* ``replay`` — for trajectories of at least ``min_steps`` steps: targets at the 0-based steps
  ``replay_steps + 1``, then every ``stride_steps`` (so every window recaps at least one step); the target
  is that step's assistant message verbatim. Targets from the first repetition of a detected loop
  onward are left out (they would teach the loop).
* anti-loop windows, from the earliest loop :func:`forgeflow.evaluation.supervision.detect_loop` finds on the
  steps' calls (period 1: the same call repeated; period 2: two calls alternating;
  ``loop_threshold`` repetitions):

  - ``stop_and_conclude``: the context runs up to the call that completed the loop; the target,
    instead of that call, says the last calls repeated without new information and submits
    (``conclude_command``).
  - ``early_switch``: the context runs to the end of the loop's first block (before any
    repetition); the target is the first later step of the trajectory whose call is not in the
    loop (the run's own way out, verbatim). No such step: no window (``skipped_no_switch``).
  - ``one_call_quota``: as ``early_switch``, plus the first repeated call, whose observation is
    replaced by the quota refusal (:data:`QUOTA_OBSERVATION`: each distinct call runs once); the
    target is the run's way out, or the conclude message when it has none.

The loop definition is the supervisor's (``supervision.detect_loop`` over the same call
signatures), so the windows teach the behaviour the supervisor enforces at run time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import atomic_write_text, read_json_object, sha256_bytes, sha256_file, sha256_json
from forgeflow.evaluation.supervision import (
    DEFAULT_LOOP_THRESHOLD,
    LoopDetection,
    ToolCall,
    detect_loop,
    tool_calls_from_trajectory,
)
from forgeflow.training.samples import SUBMIT_COMMAND

LoopVariant = Literal["stop_and_conclude", "early_switch", "one_call_quota"]
WindowKind = Literal["replay", "stop_and_conclude", "early_switch", "one_call_quota"]
LOOP_VARIANTS: tuple[LoopVariant, ...] = ("stop_and_conclude", "early_switch", "one_call_quota")

CONCLUDE_COMMAND = f"git diff -- . ':!patch.txt' > patch.txt && {SUBMIT_COMMAND}"
"""Default action of a conclude target: write the patch file, then mini-swe-agent 2.x's
``swebench_backticks`` submit command (:data:`forgeflow.training.samples.SUBMIT_COMMAND`)."""

CONCLUDE_THOUGHT = (
    "THOUGHT: My last {n_calls} actions repeated {what} and gave no new information; running "
    "{it} again will not help. I stop here and submit the current state of my work."
)
"""Reasoning of a conclude target; ``what``/``it`` name the repeated command(s)."""

QUOTA_OBSERVATION = (
    "Refused: this exact command already ran at step {step} and its output is shown above. Each "
    "distinct command runs once (one-call quota). Run a different command, or submit if you are done."
)
"""Observation that replaces the repeated call's output in a ``one_call_quota`` window."""

FENCE = "```mswea_bash_command\n{}\n```"
"""mini-swe-agent's text-format action fence (``forgeflow.evaluation.supervision.MSWEA_ACTION_REGEX``)."""


class WindowConfig(BaseModel):
    """Parameters of :func:`build_windows` (defaults suit 30-100 step SWE-style runs).

    Attributes:
        replay_steps: Steps replayed verbatim before the target (K).
        stride_steps: Distance between consecutive replay targets.
        min_steps: Aligned steps a trajectory needs to get replay windows ("long"); at least
            ``replay_steps + 2`` so a window recaps at least one step.
        task_excerpt_chars: Characters of the instance message kept (the head).
        recap_command_chars: Characters of a command's first line kept in the recap.
        loop_threshold: Repetitions that make a loop (``detect_loop``'s threshold).
        loop_variants: Anti-loop window kinds to build (non-empty, no repeats).
        conclude_command: Action of the conclude target.
        include_system: Start each prompt with the trajectory's system message.

    An unknown field is refused (a misspelt key would otherwise fall back to its default unseen).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    replay_steps: int = Field(4, ge=1, le=64)
    stride_steps: int = Field(4, ge=1)
    min_steps: int = Field(8, ge=3)
    task_excerpt_chars: int = Field(4000, ge=200)
    recap_command_chars: int = Field(200, ge=20)
    loop_threshold: int = Field(DEFAULT_LOOP_THRESHOLD, ge=2)
    loop_variants: tuple[LoopVariant, ...] = LOOP_VARIANTS
    conclude_command: str = Field(CONCLUDE_COMMAND, min_length=1)
    include_system: bool = True

    @field_validator("loop_variants")
    @classmethod
    def _distinct(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"loop_variants {list(value)} repeats a variant")
        return value

    @model_validator(mode="after")
    def _long_enough(self) -> WindowConfig:
        if self.min_steps < self.replay_steps + 2:
            raise ValueError(
                f"min_steps ({self.min_steps}) must be >= replay_steps + 2 ({self.replay_steps + 2}): "
                "a replay window recaps at least one step before the replayed ones"
            )
        return self


class WindowStats(BaseModel):
    """Counts of one :func:`build_windows` run (sums over trajectories).

    Attributes:
        trajectories: Trajectories read.
        aligned_steps: Assistant messages with exactly one action (usable steps).
        dropped_no_action: Assistant messages with no action (reasoning dropped).
        dropped_several_actions: Assistant messages with several actions (reasoning dropped).
        short_trajectories: Trajectories with fewer than ``min_steps`` steps (no replay windows).
        loops_detected: Trajectories with a loop.
        skipped_no_switch: ``early_switch`` windows not built: the run never left its loop.
        windows_by_kind: Windows built per kind.
    """

    model_config = ConfigDict(frozen=True)

    trajectories: int = Field(ge=0)
    aligned_steps: int = Field(ge=0)
    dropped_no_action: int = Field(ge=0)
    dropped_several_actions: int = Field(ge=0)
    short_trajectories: int = Field(ge=0)
    loops_detected: int = Field(ge=0)
    skipped_no_switch: int = Field(ge=0)
    windows_by_kind: dict[str, int]


@dataclass(frozen=True)
class TrainingWindows:
    """The result of :func:`build_windows`.

    Attributes:
        dataset: Columns ``prompt`` (list of messages), ``completion`` (one assistant message)
            and ``provenance`` (``instance_id``, ``trajectory_sha256``,
            ``window_index`` (0-based within its trajectory), ``kind``, ``target_step`` (0-based
            index of the aligned step the target reproduces or replaces)).
        stats: The counts.
    """

    dataset: Any
    stats: WindowStats


@dataclass(frozen=True)
class Step:
    """One aligned step: an assistant message with exactly one action, and its observation.

    Attributes:
        index: 0-based position among the trajectory's aligned steps.
        message_index: Position of the assistant message in ``messages``.
        assistant: The assistant message (reasoning + action), verbatim but normalized to the
            dataset's message keys.
        call: Its action as a :class:`~forgeflow.evaluation.supervision.ToolCall`.
        observations: The ``user``/``tool`` messages answering it (normalized).
        returncode: The command's return code as recorded (``extra.returncode``), if any.
        call_id: The tool call's ``id`` (tool-call format), else None.
    """

    index: int
    message_index: int
    assistant: dict[str, Any]
    call: ToolCall
    observations: tuple[dict[str, Any], ...]
    returncode: int | None
    call_id: str | None = None


@dataclass(frozen=True)
class ParsedTrajectory:
    """A trajectory split into aligned steps (see :func:`parse_trajectory`)."""

    instance_id: str
    sha256: str
    action_format: Literal["text", "toolcall"]
    system: str | None
    task: str
    steps: tuple[Step, ...]
    dropped_no_action: int
    dropped_several_actions: int


def _load(trajectory: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    if isinstance(trajectory, Mapping):
        return trajectory
    return read_json_object(trajectory, "trajectory")


def _text(message: Mapping[str, Any], where: str) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise InputError(f"{where}: content is {type(content).__name__}, expected text")
    return content


def _message(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A message with exactly the dataset's keys (see the module docstring)."""
    tool_calls = None
    if message.get("tool_calls"):
        tool_calls = []
        for call in message["tool_calls"]:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, sort_keys=True)
            tool_calls.append({
                "id": str(call.get("id") or ""), "type": str(call.get("type") or "function"),
                "function": {"name": str(function.get("name") or ""), "arguments": arguments},
            })
    call_id = message.get("tool_call_id")
    return {
        "role": str(message.get("role")), "content": _text(message, where), "tool_calls": tool_calls,
        "tool_call_id": str(call_id) if call_id is not None else None,
    }


def parse_trajectory(trajectory: Mapping[str, Any] | str | Path) -> ParsedTrajectory:
    """Split a mini-swe-agent trajectory (text or tool-call format) into aligned steps.

    Args:
        trajectory: The trajectory dict or its ``*.traj.json`` path; needs ``messages`` and an
            ``instance_id`` (top level, or ``info.forgeflow.instance_id``).

    Returns:
        :class:`ParsedTrajectory`; ``sha256`` is the digest of the trajectory's canonical JSON
        (:func:`forgeflow.common.fsutil.sha256_json`: re-indenting the file does not change it).

    Raises:
        InputError: unreadable file, no ``messages`` list, no ``instance_id``, no user (task)
            message before the first assistant message, or non-text content (a file's message begins
            with its path).
    """
    data = _load(trajectory)
    try:
        return _parse_loaded(data)
    except InputError as exc:
        if isinstance(trajectory, (str, Path)):
            raise InputError(f"{trajectory}: {exc}") from None
        raise


def _parse_loaded(data: Mapping[str, Any]) -> ParsedTrajectory:
    """:func:`parse_trajectory` of a loaded trajectory."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise InputError("trajectory has no 'messages' list")
    info = data.get("info") if isinstance(data.get("info"), Mapping) else {}
    forgeflow_info = info.get("forgeflow") if isinstance(info.get("forgeflow"), Mapping) else {}
    instance_id = data.get("instance_id") or forgeflow_info.get("instance_id")
    if not isinstance(instance_id, str) or not instance_id:
        raise InputError("trajectory has no 'instance_id' (top level or info.forgeflow.instance_id)")
    where = f"trajectory of {instance_id}"
    toolcall = any(isinstance(m, Mapping) and m.get("role") == "assistant" and m.get("tool_calls") for m in messages)
    calls_by_message: dict[int, list[ToolCall]] = {}
    for call in tool_calls_from_trajectory(data):
        calls_by_message.setdefault(call.message_index, []).append(call)
    system = next((_text(m, where) for m in messages if isinstance(m, Mapping) and m.get("role") == "system"), None)
    first_assistant = next(
        (i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "assistant"), len(messages)
    )
    task = next(
        (_text(m, where) for m in messages[:first_assistant] if isinstance(m, Mapping) and m.get("role") == "user"),
        None,
    )
    if task is None:
        raise InputError(f"{where} has no user (task) message before its first assistant message")
    steps: list[Step] = []
    no_action = several = 0
    for index in range(first_assistant, len(messages)):
        message = messages[index]
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            continue
        calls = calls_by_message.get(index, [])
        if len(calls) != 1:
            no_action += len(calls) == 0
            several += len(calls) > 1
            continue
        observations: list[dict[str, Any]] = []
        returncode: int | None = None
        for follow in messages[index + 1 :]:
            if not isinstance(follow, Mapping) or follow.get("role") == "assistant":
                break
            if follow.get("role") not in ("user", "tool"):
                continue  # e.g. mini-swe-agent's final "exit" message
            observations.append(_message(follow, f"{where} message {index}"))
            extra = follow.get("extra") if isinstance(follow.get("extra"), Mapping) else {}
            code = extra.get("returncode")
            if returncode is None and isinstance(code, int) and not isinstance(code, bool):
                returncode = code
        assistant = _message(message, f"{where} message {index}")
        steps.append(Step(
            index=len(steps), message_index=index, assistant=assistant, call=calls[0],
            observations=tuple(observations), returncode=returncode,
            call_id=assistant["tool_calls"][0]["id"] if assistant["tool_calls"] else None,
        ))
    return ParsedTrajectory(
        instance_id=instance_id, sha256=sha256_json(data), action_format="toolcall" if toolcall else "text",
        system=system, task=task, steps=tuple(steps),
        dropped_no_action=no_action, dropped_several_actions=several,
    )


# --- rendering -------------------------------------------------------------------------------
def task_excerpt(task: str, max_chars: int) -> str:
    """The first ``max_chars`` characters of the task, with a note of how many were cut."""
    if len(task) <= max_chars:
        return task
    return f"{task[:max_chars]}\n[... {len(task) - max_chars} more characters of the task omitted]"


def _command(call: ToolCall) -> str:
    args = call.arguments
    if isinstance(args, Mapping) and isinstance(args.get("command"), str):
        return args["command"]
    return json.dumps(args, sort_keys=True)


def recap_line(step: Step, max_chars: int) -> str:
    """``"<n>. `<first line of the command>`[ (+k more lines)] -> returncode <rc>"`` (n 1-based;
    the first line cut at ``max_chars`` with ``...``; the return code only when recorded)."""
    lines = _command(step.call).strip().splitlines() or [""]
    first = lines[0] if len(lines[0]) <= max_chars else lines[0][:max_chars] + "..."
    more = f" (+{len(lines) - 1} more lines)" if len(lines) > 1 else ""
    code = f" -> returncode {step.returncode}" if step.returncode is not None else ""
    return f"{step.index + 1}. `{first}`{more}{code}"


def recap(steps: Sequence[Step], replayed: int, max_chars: int) -> str:
    """The progress recap of ``steps`` (the ones older than the ``replayed`` steps that follow)."""
    head = (
        f"Progress so far: {len(steps)} earlier step(s), oldest first; "
        f"the last {replayed} step(s) follow in full."
    )
    return "\n".join([head, *(recap_line(s, max_chars) for s in steps)])


def _plain(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content, "tool_calls": None, "tool_call_id": None}


def _prompt(
    parsed: ParsedTrajectory, context: Sequence[Step], config: WindowConfig,
    last_observation: str | None = None,
) -> list[dict[str, Any]]:
    replayed = list(context[-config.replay_steps :])
    older = list(context[: len(context) - len(replayed)])
    first = task_excerpt(parsed.task, config.task_excerpt_chars)
    if older:
        first += "\n\n" + recap(older, len(replayed), config.recap_command_chars)
    prompt: list[dict[str, Any]] = []
    if config.include_system and parsed.system is not None:
        prompt.append(_plain("system", parsed.system))
    prompt.append(_plain("user", first))
    for position, step in enumerate(replayed):
        prompt.append(dict(step.assistant))
        if last_observation is not None and position == len(replayed) - 1:
            if step.call_id is not None:  # tool-call format: the refusal answers the call
                prompt.append({**_plain("tool", last_observation), "tool_call_id": step.call_id})
            else:
                prompt.append(_plain("user", last_observation))
        else:
            prompt.extend(dict(o) for o in step.observations)
    return prompt


CONCLUDE_CALL_ID = "forgeflow-conclude"
"""``id`` of the tool call of a conclude target in the tool-call format."""


def conclude_message(
    n_calls: int, period: int, command: str, action_format: Literal["text", "toolcall"] = "text"
) -> dict[str, Any]:
    """The conclude target: :data:`CONCLUDE_THOUGHT` and ``command``: in an action fence (text
    format) or as one ``bash`` tool call with ``{"command": ...}`` (tool-call format)."""
    what, it = ("the same command", "it") if period == 1 else ("the same two commands in turn", "them")
    thought = CONCLUDE_THOUGHT.format(n_calls=n_calls, what=what, it=it)
    if action_format == "text":
        return _plain("assistant", thought + "\n\n" + FENCE.format(command))
    call = {"id": CONCLUDE_CALL_ID, "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
    return {**_plain("assistant", thought), "tool_calls": [call]}


# --- windows ---------------------------------------------------------------------------------
_Window = tuple[str, int, list[dict[str, Any]], dict[str, Any]]


def _windows_of(parsed: ParsedTrajectory, config: WindowConfig, counts: dict[str, int]) -> list[_Window]:
    """``(kind, target_step, prompt, completion message)`` for one trajectory, in window order."""
    steps = parsed.steps
    loop: LoopDetection = detect_loop([s.call for s in steps], threshold=config.loop_threshold)
    windows: list[_Window] = []
    stop = loop.indices[loop.period] if loop.detected and loop.period is not None else len(steps)
    if len(steps) >= config.min_steps:
        for target in range(config.replay_steps + 1, stop, config.stride_steps):
            windows.append(("replay", target, _prompt(parsed, steps[:target], config), steps[target].assistant))
    else:
        counts["short_trajectories"] += 1
    if not loop.detected or loop.period is None or loop.blocked_at is None:
        return windows
    counts["loops_detected"] += 1
    period, first, blocked = loop.period, loop.indices[0], loop.blocked_at
    block_end = first + period  # exclusive: the loop's first block is steps[first:block_end]
    looping = set(loop.signatures)
    way_out = next((s for s in steps[blocked + 1 :] if s.call.signature not in looping), None)
    conclude = conclude_message(blocked - first, period, config.conclude_command, parsed.action_format)
    for variant in config.loop_variants:
        if variant == "stop_and_conclude":
            windows.append((variant, blocked, _prompt(parsed, steps[:blocked], config), conclude))
        elif variant == "early_switch":
            if way_out is None:
                counts["skipped_no_switch"] += 1
                continue
            windows.append((variant, way_out.index, _prompt(parsed, steps[:block_end], config), way_out.assistant))
        else:  # one_call_quota: the first repeated call is refused
            refused = QUOTA_OBSERVATION.format(step=block_end - period + 1)
            prompt = _prompt(parsed, steps[: block_end + 1], config, last_observation=refused)
            target_step, text = (way_out.index, way_out.assistant) if way_out else (blocked, conclude)
            windows.append((variant, target_step, prompt, text))
    return windows


def window_features() -> Any:
    """The :class:`datasets.Features` of the windows dataset."""
    from datasets import Features, List, Value

    message = {
        "role": Value("string"),
        "content": Value("string"),
        "tool_calls": List({
            "id": Value("string"),
            "type": Value("string"),
            "function": {"name": Value("string"), "arguments": Value("string")},
        }),
        "tool_call_id": Value("string"),
    }
    return Features({
        "prompt": List(message),
        "completion": List(message),
        "provenance": {
            "instance_id": Value("string"),
            "trajectory_sha256": Value("string"),
            "window_index": Value("int32"),
            "kind": Value("string"),
            "target_step": Value("int32"),
        },
    })


def build_windows(
    trajectories: Sequence[Mapping[str, Any] | str | Path], config: WindowConfig | None = None
) -> TrainingWindows:
    """Build replay and anti-loop training windows from mini-swe-agent trajectories.

    Args:
        trajectories: Trajectory dicts or ``*.traj.json`` paths (text format; see
            :func:`parse_trajectory`).
        config: :class:`WindowConfig` (defaults when None).

    Returns:
        :class:`TrainingWindows`: the dataset (rows in trajectory order, then window order:
        replay windows by target, then the loop variants in ``config.loop_variants`` order) and
        the counts.

    Raises:
        InputError: a trajectory is unreadable or malformed (see :func:`parse_trajectory`).
    """
    from datasets import Dataset

    config = config or WindowConfig()
    counts = {"short_trajectories": 0, "loops_detected": 0, "skipped_no_switch": 0}
    rows: list[dict[str, Any]] = []
    by_kind = {kind: 0 for kind in ("replay", *LOOP_VARIANTS)}
    aligned = no_action = several = 0
    for trajectory in trajectories:
        parsed = parse_trajectory(trajectory)
        aligned += len(parsed.steps)
        no_action += parsed.dropped_no_action
        several += parsed.dropped_several_actions
        for window_index, (kind, target_step, prompt, target) in enumerate(_windows_of(parsed, config, counts)):
            by_kind[kind] += 1
            rows.append({
                "prompt": prompt,
                "completion": [target],
                "provenance": {
                    "instance_id": parsed.instance_id, "trajectory_sha256": parsed.sha256,
                    "window_index": window_index, "kind": kind, "target_step": target_step,
                },
            })
    features = window_features()
    if rows:
        dataset = Dataset.from_list(rows, features=features)
    else:
        dataset = Dataset.from_dict({name: [] for name in features}, features=features)
    stats = WindowStats(
        trajectories=len(trajectories), aligned_steps=aligned, dropped_no_action=no_action,
        dropped_several_actions=several, windows_by_kind=by_kind, **counts,
    )
    return TrainingWindows(dataset=dataset, stats=stats)


def window_samples(windows: TrainingWindows) -> list[dict[str, Any]]:
    """The windows as SFT samples in the prompt-completion format
    (:func:`forgeflow.training.burst.build_sft_dataset`): ``prompt``, ``completion`` (tool calls
    kept), ``instance_id``, ``source`` = ``window:<kind>:<trajectory sha256>:<target step>`` (so the
    dataset's digest names where every sample came from) and the full ``provenance``."""
    samples = []
    for row in windows.dataset.to_list():
        prov = row["provenance"]
        samples.append({"prompt": row["prompt"], "completion": row["completion"], "instance_id": prov["instance_id"],
                        "source": f"window:{prov['kind']}:{prov['trajectory_sha256']}:{prov['target_step']}",
                        "provenance": prov})
    return samples


def write_window_jsonl(windows: TrainingWindows, path: Path | None = None, *, folder: Path | None = None,
                       name: str = "windows") -> tuple[Path, str]:
    """Write :func:`window_samples` as JSONL (one sample per line, the ``sft-burst`` flow's
    ``samples_jsonl``) atomically, never over other samples: a dataset an adapter was trained on stays.

    Args:
        windows: from :func:`build_windows`.
        path: where to write; a file there with other content is refused (the same content is
            written again, idempotent). None: ``folder / "<name>-<sha256[:12]>.jsonl"``, named by
            its content, so two sources of the same ``name`` never overwrite each other.
        folder / name: the folder and name stem of that default (``folder`` required when ``path`` is None).

    Returns:
        ``(the file written, its sha256)``.

    Raises:
        InputError: there is no window to write (the stats say why: short trajectories, no loop), or
            ``path`` holds other samples (both digests named).
    """
    samples = window_samples(windows)
    if not samples:
        stats = windows.stats
        raise InputError(f"no training window in {stats.trajectories} trajectories ({stats.aligned_steps} aligned "
                         f"steps, {stats.short_trajectories} shorter than min_steps, {stats.loops_detected} with a "
                         "loop): nothing to write")
    text = "".join(json.dumps(s, sort_keys=True) + "\n" for s in samples)
    digest = sha256_bytes(text.encode())
    if path is None:
        if folder is None:
            raise ValueError("write_window_jsonl needs a path or a folder")
        path = Path(folder) / f"{name}-{digest[:12]}.jsonl"
    path = Path(path)
    if path.is_file() and (held := sha256_file(path)) != digest:
        raise InputError(f"samples_jsonl {path} already holds other samples (sha256 {held[:12]}; these windows "
                         f"would be {digest[:12]}): an adapter may have been trained on it; give another path, or "
                         "leave samples_jsonl unset for a file named by its content")
    atomic_write_text(path, text)
    return path, digest
