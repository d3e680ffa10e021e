"""Supervision of long agent runs: dead loops and hangs (the answer judge is :mod:`forgeflow.evaluation.judge`)."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import canonical_json

DEFAULT_LOOP_THRESHOLD = 3
"""Repetitions of the same call (or A-B cycle) at which a run is blocked."""

DEFAULT_HANG_IDLE_S = 11 * 60.0
"""Seconds without a new message or model call after which a running run counts as hung."""

MSWEA_ACTION_REGEX = r"```mswea_bash_command\s*\n(.*?)\n```"
"""mini-swe-agent's action regex of the text format (``LitellmTextbasedModelConfig.action_regex``)."""

BASH_TOOL = "bash"
"""Tool name given to mini-swe-agent's shell commands."""


# --- tool calls and their signatures -------------------------------------------------------------
class ToolCall(BaseModel):
    """One tool call of a trajectory."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1, description="Tool name (bash for mini-swe-agent commands).")
    arguments: Any = Field(None, description="The arguments as recorded: a JSON string, a mapping, or a raw string.")
    message_index: int = Field(default=-1, ge=-1,
                               description="Index of the assistant message holding the call in the trajectory (-1 "
                                           "when unknown).")
    timestamp_unix_s: float | None = Field(None, description="When the call was made, if recorded.")

    @property
    def signature(self) -> str:
        """The canonical signature (see :func:`call_signature`)."""
        return call_signature(self.name, self.arguments)


def call_signature(name: str, arguments: Any) -> str:
    """The canonical signature of a tool call.

    Returns:
        Canonical JSON text ``{"arguments": ..., "tool": name}`` (sorted keys, no whitespace).
    """
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            value = arguments.strip()
    return canonical_json({"tool": name, "arguments": value}).decode("utf-8")


class LoopDetection(BaseModel):
    """The verdict of :func:`detect_loop`, with its evidence."""

    model_config = ConfigDict(frozen=True)

    detected: bool = Field(description="True when the run must be blocked.")
    period: Literal[1, 2] | None = Field(
        None,
        description="1 (same call repeated) or 2 (two calls alternating); None when not detected.")
    repeats: int = Field(default=0, ge=0, description="Times the block was repeated (== the threshold when detected).")
    signatures: list[str] = Field(default_factory=list,
                                  description="The repeated block's call signatures (period of them).")
    indices: list[int] = Field(default_factory=list,
                               description="Positions in the call list of the calls forming the loop.")
    message_indices: list[int] = Field(default_factory=list,
                                       description="Trajectory message indices of those calls (-1 where unknown).")
    blocked_at: int | None = Field(None, description="Position in the call list of the call that completed the loop.")


class LoopDetector:
    """:func:`detect_loop` applied as calls arrive, with a cost per call that does not grow with the run.

    Keeps the last ``2 * threshold`` signatures; ``comparisons`` counts its work, ``detection`` holds the
    first loop found (later calls do not replace it).

    Raises:
        InputError: ``threshold < 2``.
    """

    def __init__(self, threshold: int = DEFAULT_LOOP_THRESHOLD) -> None:
        if threshold < 2:
            raise InputError(f"threshold must be >= 2 (a call is not a loop with itself), got {threshold}")
        self.threshold = threshold
        self._sigs: deque[str] = deque(maxlen=2 * threshold)
        self._message_indices: deque[int] = deque(maxlen=2 * threshold)
        self.n_calls = 0
        self.signatures_computed = 0
        self.comparisons = 0
        self.detection: LoopDetection | None = None

    def _tail_loop(self, period: int) -> bool:
        span = period * self.threshold
        if len(self._sigs) < span:
            return False
        tail = list(self._sigs)[-span:]
        self.comparisons += 1
        if period == 2 and tail[0] == tail[1]:
            return False  # that is a period-1 loop
        for i in range(span):
            self.comparisons += 1
            if tail[i] != tail[i % period]:
                return False
        return True

    def add(self, call: ToolCall) -> LoopDetection:
        """Add the next call; the verdict on the calls so far (period 1 checked first; positions count every call)."""
        self._sigs.append(call.signature)
        self._message_indices.append(call.message_index)
        self.signatures_computed += 1
        self.n_calls += 1
        for period in (1, 2):
            if self._tail_loop(period):
                span = period * self.threshold
                verdict = LoopDetection(
                    detected=True, period=period, repeats=self.threshold, signatures=list(self._sigs)[-span:][:period],
                    indices=list(range(self.n_calls - span, self.n_calls)),
                    message_indices=list(self._message_indices)[-span:], blocked_at=self.n_calls - 1,
                )
                if self.detection is None:
                    self.detection = verdict
                return verdict
        return LoopDetection(detected=False)


def detect_loop(calls: Sequence[ToolCall], threshold: int = DEFAULT_LOOP_THRESHOLD) -> LoopDetection:
    """Find the first point where the calls end in a period-1 or period-2 loop of ``threshold`` repeats.

    Raises:
        InputError: ``threshold < 2``.
    """
    detector = LoopDetector(threshold)
    for call in calls:
        verdict = detector.add(call)
        if verdict.detected:
            return verdict
    return LoopDetection(detected=False)


# --- hangs ------------------------------------------------------------------------------------
class HangCheck(BaseModel):
    """The verdict of :func:`detect_hang`."""

    model_config = ConfigDict(frozen=True)

    hung: bool = Field(description="True when nothing happened for longer than idle_limit_s.")
    idle_s: float = Field(description="Seconds since the last activity.")
    idle_limit_s: float = Field(gt=0.0, description="The limit applied.")
    last_activity_unix_s: float = Field(description="The latest of the activity timestamps given.")


def _unix_s(value: float | datetime, name: str) -> float:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InputError(f"{name} must be timezone-aware, got naive {value.isoformat()}")
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(f"{name} must be Unix seconds or an aware datetime, got {value!r}")
    return float(value)


def detect_hang(
    *,
    last_message_at: float | datetime | None = None,
    last_model_call_at: float | datetime | None = None,
    started_at: float | datetime | None = None,
    now: float | datetime | None = None,
    idle_limit_s: float = DEFAULT_HANG_IDLE_S,
) -> HangCheck:
    """Flag a running run with no new message or model call for more than ``idle_limit_s`` (default 660 s).

    Times are Unix seconds or aware datetimes; idle exactly at the limit is not yet hung.

    Raises:
        InputError: no timestamp is given, one is naive or not finite, or ``idle_limit_s <= 0``.
    """
    if idle_limit_s <= 0:
        raise InputError(f"idle_limit_s must be > 0, got {idle_limit_s}")
    given = {
        name: _unix_s(value, name)
        for name, value in (
            ("last_message_at", last_message_at),
            ("last_model_call_at", last_model_call_at),
            ("started_at", started_at),
        )
        if value is not None
    }
    if not given:
        raise InputError("detect_hang needs at least one of last_message_at, last_model_call_at, started_at")
    now_s = time.time() if now is None else _unix_s(now, "now")
    last = max(given.values())
    idle_s = max(0.0, now_s - last)
    return HangCheck(hung=idle_s > idle_limit_s, idle_s=idle_s, idle_limit_s=idle_limit_s, last_activity_unix_s=last)


class HangWatchdog:
    """Watch a live run from a daemon thread; call ``on_hang`` once when it is hung.

    Args:
        idle_limit_s: Idle seconds tolerated (default 660 = 11 minutes; > 0).
        poll_s: Seconds between checks (default ``min(5, idle_limit_s / 10)``, at least 0.05).

    Raises:
        InputError: ``idle_limit_s <= 0`` or ``poll_s <= 0``.
    """

    def __init__(
        self,
        idle_limit_s: float = DEFAULT_HANG_IDLE_S,
        on_hang: Callable[[HangCheck], None] | None = None,
        *,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if idle_limit_s <= 0:
            raise InputError(f"idle_limit_s must be > 0, got {idle_limit_s}")
        if poll_s is not None and poll_s <= 0:
            raise InputError(f"poll_s must be > 0, got {poll_s}")
        self.idle_limit_s = float(idle_limit_s)
        self.on_hang = on_hang
        self.poll_s = poll_s if poll_s is not None else max(0.05, min(5.0, idle_limit_s / 10.0))
        self._clock = clock
        self._lock = threading.Lock()
        self._started_at: float | None = None
        self._last_message_at: float | None = None
        self._last_model_call_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hung_event = threading.Event()
        self.hang: HangCheck | None = None
        self.callback_error: BaseException | None = None

    @property
    def hung(self) -> bool:
        """True once the watchdog has found the run hung."""
        return self.hung_event.is_set()

    def touch_message(self) -> None:
        """Record a new trajectory message now."""
        with self._lock:
            self._last_message_at = self._clock()

    def touch_model_call(self) -> None:
        """Record a model call (started or answered) now."""
        with self._lock:
            self._last_model_call_at = self._clock()

    def check(self) -> HangCheck:
        """:func:`detect_hang` on the activity recorded so far (does not call back).

        Raises:
            InputError: the watchdog was not started.
        """
        with self._lock:
            if self._started_at is None:
                raise InputError("HangWatchdog.check before start()")
            return detect_hang(
                last_message_at=self._last_message_at,
                last_model_call_at=self._last_model_call_at,
                started_at=self._started_at,
                now=self._clock(),
                idle_limit_s=self.idle_limit_s,
            )

    def start(self) -> HangWatchdog:
        """Start the clock and the thread (idempotent); returns self."""
        with self._lock:
            if self._thread is not None:
                return self
            self._started_at = self._clock()
            self._thread = threading.Thread(target=self._watch, name="forgeflow-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (idempotent); the verdict already reached is kept."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, 2 * self.poll_s))

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            verdict = self.check()
            if verdict.hung:
                self.hang = verdict
                self.hung_event.set()
                if self.on_hang is not None:
                    try:
                        self.on_hang(verdict)
                    except BaseException as exc:  # noqa: BLE001 - kept for the run to report
                        self.callback_error = exc
                return

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --- trajectories -----------------------------------------------------------------------------
def _extra(message: Mapping[str, Any]) -> Mapping[str, Any]:
    extra = message.get("extra")
    return extra if isinstance(extra, Mapping) else {}


def tool_calls_from_trajectory(trajectory: Mapping[str, Any] | str | Path) -> list[ToolCall]:
    """The tool calls of a mini-swe-agent trajectory, in order, with message indices and ``extra.timestamp``.

    Raises:
        InputError: the file is not JSON or has no ``messages`` list.
    """
    if not isinstance(trajectory, Mapping):
        path = Path(trajectory)
        try:
            trajectory = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InputError(f"trajectory {path} is not a readable JSON file: {exc}") from exc
    messages = trajectory.get("messages") if isinstance(trajectory, Mapping) else None
    if not isinstance(messages, list):
        raise InputError("trajectory has no 'messages' list")
    calls: list[ToolCall] = []
    for index, message in enumerate(messages):
        calls.extend(tool_calls_of_message(message, index))
    return calls


def tool_calls_of_message(message: Any, index: int = -1) -> list[ToolCall]:
    """The tool calls of one trajectory message (none unless it is an assistant message), in order.

    Returns:
        The calls, each with ``message_index=index`` and the message's ``extra.timestamp`` when recorded.
    """
    if not isinstance(message, Mapping) or message.get("role") != "assistant":
        return []
    stamp = _extra(message).get("timestamp")
    stamp = float(stamp) if isinstance(stamp, int | float) else None
    tool_calls = message.get("tool_calls") or []
    actions = _extra(message).get("actions") or []
    if tool_calls:
        return [ToolCall(name=(call.get("function") or {}).get("name") or "unknown",
                         arguments=(call.get("function") or {}).get("arguments"), message_index=index,
                         timestamp_unix_s=stamp) for call in tool_calls]
    if actions:
        return [ToolCall(name=BASH_TOOL, arguments={"command": str(action.get("command", "")).strip()},
                         message_index=index, timestamp_unix_s=stamp) for action in actions]
    return [ToolCall(name=BASH_TOOL, arguments={"command": command.strip()}, message_index=index,
                     timestamp_unix_s=stamp)
            for command in re.findall(MSWEA_ACTION_REGEX, str(message.get("content") or ""), re.DOTALL)]


def last_activity_unix_s(trajectory: Mapping[str, Any]) -> float | None:
    """The newest ``extra.timestamp`` of a mini-swe-agent trajectory's messages, if any."""
    stamps = [
        float(_extra(m)["timestamp"])
        for m in trajectory.get("messages") or []
        if isinstance(m, Mapping) and isinstance(_extra(m).get("timestamp"), int | float)
    ]
    return max(stamps) if stamps else None


