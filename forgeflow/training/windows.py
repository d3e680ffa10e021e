"""Training windows from agent trajectories: replay windows and anti-loop windows.

Cuts mini-swe-agent trajectories (fenced text or OpenAI ``tool_calls``) into TRL prompt/completion
samples. A step is an assistant message with exactly one action and its observation; messages with
zero or several actions are dropped and counted, never guessed. A prompt: ``[system]``, the task
excerpt plus a one-line recap of older steps, then the last ``replay_steps`` steps verbatim.

Kinds: ``replay`` (targets from step ``replay_steps + 1``, every ``stride_steps``, none inside a loop)
and, from the earliest loop :func:`forgeflow.evaluation.supervision.detect_loop` finds (the
supervisor's definition): ``stop_and_conclude``, ``early_switch`` (the run's own first call outside the
loop) and ``one_call_quota`` (the repetition answered by :data:`QUOTA_OBSERVATION`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import atomic_write_text, read_json_object, sha256_bytes, sha256_file, sha256_json
from forgeflow.evaluation.chat_images import ImageRef
from forgeflow.evaluation.supervision import (
    DEFAULT_LOOP_THRESHOLD,
    LoopDetection,
    ToolCall,
    detect_loop,
    tool_calls_from_trajectory,
)
from forgeflow.training.adapters import AdapterRecord
from forgeflow.training.samples import SUBMIT_COMMAND
from forgeflow.training.window_images import copy_images, image_parts, turn_images

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
    """Parameters of :func:`build_windows` (defaults suit 30-100 step SWE-style runs; unknown keys refused)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replay_steps: int = Field(4, ge=1, le=64, description="steps replayed verbatim before the target (K)")
    stride_steps: int = Field(4, ge=1, description="distance between consecutive replay targets")
    min_steps: int = Field(8, ge=3,
        description="aligned steps a trajectory needs for replay windows (>= replay_steps + 2)")
    task_excerpt_chars: int = Field(4000, ge=200, description="characters of the instance message kept (the head)")
    recap_command_chars: int = Field(200, ge=20, description="characters of a command's first line kept in the recap")
    loop_threshold: int = Field(DEFAULT_LOOP_THRESHOLD, ge=2,
        description="repetitions that make a loop (detect_loop's threshold)")
    loop_variants: tuple[LoopVariant, ...] = Field(LOOP_VARIANTS,
        description="anti-loop window kinds to build (non-empty, no repeats)")
    conclude_command: str = Field(CONCLUDE_COMMAND, min_length=1, description="action of the conclude target")
    include_system: bool = Field(True, description="start each prompt with the trajectory's system message")

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
    """Counts of one :func:`build_windows` run (sums over trajectories)."""

    model_config = ConfigDict(frozen=True)

    trajectories: int = Field(ge=0, description="trajectories read")
    aligned_steps: int = Field(ge=0, description="assistant messages with exactly one action")
    dropped_no_action: int = Field(ge=0, description="assistant messages with no action (dropped)")
    dropped_several_actions: int = Field(ge=0, description="assistant messages with several actions (dropped)")
    short_trajectories: int = Field(ge=0, description="trajectories under min_steps (no replay windows)")
    loops_detected: int = Field(ge=0, description="trajectories with a loop")
    skipped_no_switch: int = Field(ge=0, description="early_switch windows not built: the run never left its loop")
    windows_by_kind: dict[str, int] = Field(description="windows built per kind")


class WindowsResult(BaseModel):
    """Training windows written as JSONL (and trained on, when asked): what the ``windows`` flow returns."""

    model_config = ConfigDict(frozen=True)

    samples_jsonl: Path = Field(description="the windows as JSONL (sft-burst's samples_jsonl)")
    samples_sha256: str = Field(description="sha256 of that file")
    dataset_sha256: str = Field(description="the dataset digest an sft-burst on the file records in its lineage")
    trajectories: int = Field(ge=0, description="trajectories read")
    windows_by_kind: dict[str, int] = Field(description="windows per kind (replay, stop_and_conclude, early_switch, "
                                            "one_call_quota)")
    stats: WindowStats
    burst: AdapterRecord | None = Field(None, description="the SFT burst on the windows (None: only the dataset)")


@dataclass(frozen=True)
class TrainingWindows:
    """The result of :func:`build_windows`: ``dataset`` (columns ``prompt``, ``completion``, ``provenance``:
    ``instance_id``, ``trajectory_sha256``, ``window_index``, ``kind``, ``target_step``), ``stats`` and the
    ``images`` the prompts name (by sha256; a message with images has them as sha256s under ``images``).
    """

    dataset: Any
    stats: WindowStats
    images: Mapping[str, ImageRef] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One aligned step: an assistant message with exactly one action, and its observation.

    ``index`` counts aligned steps, ``message_index`` positions in ``messages``; messages are normalized
    to the dataset's keys; ``returncode`` is ``extra.returncode`` as recorded.
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
    task_images: tuple[str, ...] = ()
    images: Mapping[str, ImageRef] = field(default_factory=dict)


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


def _message(message: Mapping[str, Any], where: str, images: dict[str, ImageRef] | None = None,
             folder: Path | None = None) -> dict[str, Any]:
    """A message with exactly the dataset's keys (see the module docstring), plus ``images`` (sha256s, each
    added to ``images``) when it carries some (:func:`~forgeflow.training.window_images.turn_images`)."""
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
    out = {
        "role": str(message.get("role")), "content": _text(message, where), "tool_calls": tool_calls,
        "tool_call_id": str(call_id) if call_id is not None else None,
    }
    refs = turn_images(message, where, folder)
    if refs:
        out["images"] = [ref.sha256 for ref in refs]
        if images is not None:
            images.update((ref.sha256, ref) for ref in refs)
    return out


def parse_trajectory(trajectory: Mapping[str, Any] | str | Path) -> ParsedTrajectory:
    """Split a mini-swe-agent trajectory (dict or ``*.traj.json``) into aligned steps.

    Image files a turn names (relative: to the trajectory's folder) must still hold their sha256.

    Raises:
        InputError: unreadable, no ``messages`` or ``instance_id``, no task message first, non-text content, or
            a turn's image missing or changed (its sha256 named).
    """
    data = _load(trajectory)
    folder = Path(trajectory).resolve().parent if isinstance(trajectory, (str, Path)) else None
    try:
        return _parse_loaded(data, folder)
    except InputError as exc:
        if isinstance(trajectory, (str, Path)):
            raise InputError(f"{trajectory}: {exc}") from None
        raise


def _parse_loaded(data: Mapping[str, Any], folder: Path | None = None) -> ParsedTrajectory:
    """:func:`parse_trajectory` of a loaded trajectory (``folder``: where its image paths are relative to)."""
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
    task_index = next(
        (i for i, m in enumerate(messages[:first_assistant]) if isinstance(m, Mapping) and m.get("role") == "user"),
        None,
    )
    if task_index is None:
        raise InputError(f"{where} has no user (task) message before its first assistant message")
    images: dict[str, ImageRef] = {}
    task_message = _message(messages[task_index], f"{where} message {task_index}", images, folder)
    task = task_message["content"]
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
            observations.append(_message(follow, f"{where} message {index}", images, folder))
            extra = follow.get("extra") if isinstance(follow.get("extra"), Mapping) else {}
            code = extra.get("returncode")
            if returncode is None and isinstance(code, int) and not isinstance(code, bool):
                returncode = code
        assistant = _message(message, f"{where} message {index}", images, folder)
        steps.append(Step(
            index=len(steps), message_index=index, assistant=assistant, call=calls[0],
            observations=tuple(observations), returncode=returncode,
            call_id=assistant["tool_calls"][0]["id"] if assistant["tool_calls"] else None,
        ))
    return ParsedTrajectory(
        instance_id=instance_id, sha256=sha256_json(data), action_format="toolcall" if toolcall else "text",
        system=system, task=task, steps=tuple(steps),
        dropped_no_action=no_action, dropped_several_actions=several,
        task_images=tuple(task_message.get("images", ())), images=images,
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
    prompt.append({**_plain("user", first), "images": list(parsed.task_images)} if parsed.task_images
                  else _plain("user", first))
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
    """The conclude target: :data:`CONCLUDE_THOUGHT` and ``command`` as a fence or one ``bash`` tool call."""
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


def window_features(with_images: bool = False) -> Any:
    """The :class:`datasets.Features` of the windows dataset (``with_images``: each message has ``images``, a
    list of sha256s or null)."""
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
    if with_images:
        message["images"] = List(Value("string"))
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
    """Build replay and anti-loop training windows, in trajectory order, then by target and variant.

    Raises:
        InputError: a trajectory is unreadable or malformed (see :func:`parse_trajectory`).
    """
    from datasets import Dataset

    config = config or WindowConfig()
    counts = {"short_trajectories": 0, "loops_detected": 0, "skipped_no_switch": 0}
    rows: list[dict[str, Any]] = []
    images: dict[str, ImageRef] = {}
    by_kind = {kind: 0 for kind in ("replay", *LOOP_VARIANTS)}
    aligned = no_action = several = 0
    for trajectory in trajectories:
        parsed = parse_trajectory(trajectory)
        images.update(parsed.images)
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
    named = {d for row in rows for m in (*row["prompt"], *row["completion"]) for d in m.get("images", ())}
    images = {digest: ref for digest, ref in images.items() if digest in named}  # a dropped step's are not kept
    features = window_features(with_images=bool(images))
    if images:  # one Arrow type per column: every message has images, null where it has none
        rows = [{**row, **{key: [{"images": None, **m} for m in row[key]] for key in ("prompt", "completion")}}
                for row in rows]
    if rows:
        dataset = Dataset.from_list(rows, features=features)
    else:
        dataset = Dataset.from_dict({name: [] for name in features}, features=features)
    stats = WindowStats(
        trajectories=len(trajectories), aligned_steps=aligned, dropped_no_action=no_action,
        dropped_several_actions=several, windows_by_kind=by_kind, **counts,
    )
    return TrainingWindows(dataset=dataset, stats=stats, images=images)


def _sft_message(message: dict[str, Any]) -> dict[str, Any]:
    """A window message as an SFT turn: one with images has text and image parts (sha256s) as its content."""
    if "images" not in message:
        return message
    turn = {key: value for key, value in message.items() if key != "images"}
    return {**turn, "content": image_parts(turn["content"], message["images"])} if message["images"] else turn


def window_samples(windows: TrainingWindows) -> list[dict[str, Any]]:
    """The windows as prompt-completion SFT samples (``source``: ``window:<kind>:<sha256>:<step>``); an image
    part names its file's sha256 (the file beside the JSONL, :func:`write_window_jsonl`)."""
    samples = []
    for row in windows.dataset.to_list():
        prov = row["provenance"]
        prompt, completion = ([_sft_message(m) for m in row[key]] for key in ("prompt", "completion"))
        samples.append({"prompt": prompt, "completion": completion, "instance_id": prov["instance_id"],
                        "source": f"window:{prov['kind']}:{prov['trajectory_sha256']}:{prov['target_step']}",
                        "provenance": prov})
    return samples


def write_window_jsonl(windows: TrainingWindows, path: Path | None = None, *, folder: Path | None = None,
                       name: str = "windows", field: str = "samples_jsonl") -> tuple[Path, str]:
    """Write :func:`window_samples` as JSONL (default ``folder / "<name>-<sha256[:12]>.jsonl"``), the images they
    name first, beside it as ``<sha256>.<ext>``; (file, sha256 of the file).

    Raises:
        InputError: no window to write (the stats say why), ``path`` holds other samples (``field`` named), or an
            image changed since the trajectories were read.
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
        raise InputError(f"{field} {path} already holds other samples (sha256 {held[:12]}; these windows "
                         f"would be {digest[:12]}): an adapter may have been trained on it; give another path, or "
                         f"leave {field} unset for a file named by its content")
    copy_images(windows.images, path.parent)
    atomic_write_text(path, text)
    return path, digest
