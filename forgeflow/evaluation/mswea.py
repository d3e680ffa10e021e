"""mini-swe-agent wiring: its config, its model class on forgeflow's ModelClient, its supervised agent.

mini-swe-agent 2.4.6's ``DefaultAgent`` with its text-based model, whose chat calls go through
:class:`forgeflow.evaluation.model_client.ModelClient` instead of LiteLLM; commands run in the trial's sandbox
(:class:`forgeflow.evaluation.sandbox_env.SandboxEnvironment`), the loop and model calls on the host."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from forgeflow.common import errors
from forgeflow.common.fsutil import atomic_output_file
from forgeflow.common.settings import apply_container_env
from forgeflow.evaluation.agent_config import AgentConfig
from forgeflow.evaluation.chat_images import ImageRef, with_images
from forgeflow.evaluation.context_budget import ContextBudget, endpoint_counter, read_slot_tokens
from forgeflow.evaluation.model_client import ChatResponse, ModelClient, chat_request
from forgeflow.evaluation.supervision import (
    DEFAULT_LOOP_THRESHOLD,
    HangWatchdog,
    LoopDetector,
    tool_calls_of_message,
)
from forgeflow.sandbox.verifier import (
    TESTBED,
)

CONTEXT_OVERFLOW_PATTERN = re.compile(
    r"context_length_exceeded|maximum context length|context window|exceeds the available context size",
    re.IGNORECASE,
)
"""How a 400 (:class:`~forgeflow.common.errors.ModelRequestError`) names a context overflow: OpenAI's and
llama-cpp-python's ``context_length_exceeded`` ("This model's maximum context length is N tokens",
``llama_cpp/server/errors.py``) and llama.cpp server's "exceeds the available context size"; the
same strings LiteLLM maps to ``ContextWindowExceededError``."""

MODEL_API_KEY_ENV = "FORGEFLOW_MODEL_API_KEY"
"""The variable the agent's model client reads its endpoint's API key from when a trial builds it (the
canary flow sets it from the endpoint's Secret block for the run); never written into a config or trajectory."""

_MSWEA_DIR: Path | None = None
"""The folder mini-swe-agent keeps its global config in when MSWEA_GLOBAL_CONFIG_DIR is not set."""


def prepare_mswea_env() -> None:
    """Environment mini-swe-agent reads at import time (set before importing it)."""
    global _MSWEA_DIR
    if _MSWEA_DIR is None and "MSWEA_GLOBAL_CONFIG_DIR" not in os.environ:
        _MSWEA_DIR = Path(tempfile.mkdtemp(prefix="forgeflow-mswea-"))
        os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = str(_MSWEA_DIR)
    os.environ.setdefault("MSWEA_CONFIGURED", "true")
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    apply_container_env()


def mswea_templates(config_name: str) -> dict[str, str]:
    """The ``system``, ``instance`` and ``observation`` templates of a built-in mini-swe-agent config.

    Raises:
        InputError: ``config_name`` is not a mini-swe-agent config.
    """
    prepare_mswea_env()
    from minisweagent.config import get_config_from_spec

    try:
        base = get_config_from_spec(config_name)
    except Exception as exc:  # mini-swe-agent raises FileNotFoundError/ValueError for unknown specs
        raise errors.InputError(f"mini-swe-agent config {config_name!r} not found: {exc}") from exc
    return {"system": base["agent"]["system_template"], "instance": base["agent"]["instance_template"],
            "observation": base["model"]["observation_template"]}


def mswea_config(
    image_ref: str, base_url: str, model_alias: str, config: AgentConfig
) -> dict[str, Any]:
    """The mini-swe-agent config dict (agent / environment / model sections) for one trial."""
    prepare_mswea_env()
    from minisweagent.config import get_config_from_spec
    from minisweagent.utils.serialize import recursive_merge

    base = get_config_from_spec(config.config_name)
    overrides = {
        "agent": {
            "step_limit": config.step_limit,
            "cost_limit": 0.0,
            "wall_time_limit_seconds": max(1, int(config.agent_timeout_s)),
        },
        "environment": {"image": image_ref, "cwd": TESTBED, "timeout": config.command_timeout_s},
        "model": {
            "model_name": model_alias,
            "cost_tracking": "ignore_errors",
            "model_kwargs": {
                "api_base": base_url.rstrip("/"),
                "temperature": config.temperature,
                "max_tokens": config.max_tokens,
                "seed": config.seed,
            },
        },
    }
    merged = recursive_merge(base, overrides)
    merged["agent"].pop("mode", None)  # interactive-agent key, unknown to DefaultAgent
    merged["environment"].pop("environment_class", None)  # the environment is forgeflow's SandboxEnvironment
    return merged


class _SupervisedChat:
    """The chat calls of :func:`endpoint_model_class`'s model, watched by its :class:`HangWatchdog`
    and bounded by the agent's deadline (a mixin: the model class sets ``client``, ``watchdog``,
    ``deadline_monotonic``, ``sampling`` and mini-swe-agent's ``config``)."""

    client: ModelClient
    watchdog: HangWatchdog | None
    budget: ContextBudget
    deadline_monotonic: float
    sampling: dict[str, Any]
    config: Any

    def _hang_error(self, during: str) -> errors.AgentHangError:
        check = self.watchdog.hang if self.watchdog is not None else None
        evidence = {**(check.model_dump(mode="json") if check is not None else {}), "during": during}
        idle = f"{check.idle_s:.1f} s" if check is not None else "the idle limit"
        return errors.AgentHangError(
            f"no new message or model call for {idle} (limit {evidence.get('idle_limit_s', '?')} s) "
            f"during {during}: run stopped by the watchdog", evidence)

    def _send(self, request: Any) -> ChatResponse:
        """``client.chat`` in a helper thread, abandoned when the watchdog flags a hang."""
        if self.watchdog is None:
            return self.client.chat(request)
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["response"] = self.client.chat(request)
            except BaseException as exc:  # noqa: BLE001 - handed to the agent's thread
                box["error"] = exc
            finally:
                done.set()

        worker = threading.Thread(target=call, name="forgeflow-model-call", daemon=True)
        worker.start()
        # wake on the answer at once (not at the next 0.1 s tick: that cost up to 100 ms a step); look at the
        # watchdog between waits
        while not done.wait(0.1):
            if self.watchdog.hung:
                raise self._hang_error("a model call")
        if "error" in box:
            raise box["error"]
        return box["response"]

    def _chat(self, messages: list[dict[str, Any]]) -> ChatResponse:
        if self.watchdog is not None:
            if self.watchdog.hung:
                raise self._hang_error("a command")
            self.watchdog.touch_model_call()
        remaining_s = self.deadline_monotonic - time.monotonic()
        if remaining_s <= 0:
            raise errors.AgentTimeoutError("agent budget spent before the model call")
        self.client.retry = self.client.retry.model_copy(update={"total_budget_s": remaining_s})
        account = self.budget.check(messages)
        if not account.fits:  # the model's outcome, decided before anything is sent
            self._context_exceeded(
                f"request not sent: its prompt holds at least {account.floor_tokens} tokens and max_tokens is "
                f"{account.max_completion_tokens}, over the slot's {account.slot_tokens} tokens (context window "
                f"exceeded; GET /props)", None)
        if getattr(self, "images", None):  # the task's images ride on the first user turn (by digest)
            messages = with_images(messages, self.images)
        request = chat_request(self.config.model_name, messages, **self.sampling)
        try:
            response = self._send(request)
            if self.watchdog is not None:
                self.watchdog.touch_model_call()
            self.budget.observe(len(messages), response.prompt_tokens, response.completion_tokens)
            return response
        except errors.ModelEndpointError as exc:
            if self.watchdog is not None and self.watchdog.hung:
                raise self._hang_error("a model call") from exc
            if time.monotonic() >= self.deadline_monotonic:
                raise errors.AgentTimeoutError(f"model call outlived the agent budget: {exc}") from exc
            raise
        except errors.ModelRequestError as exc:
            if CONTEXT_OVERFLOW_PATTERN.search(str(exc)):  # the model's outcome, not a fault
                self._context_exceeded(str(exc), exc)
            raise

    @staticmethod
    def _context_exceeded(why: str, cause: BaseException | None) -> None:
        """End the run with mini-swe-agent's ``ContextWindowExceeded`` exit (the model's outcome)."""
        from minisweagent.exceptions import InterruptAgentFlow

        raise InterruptAgentFlow({
            "role": "exit", "content": "ContextWindowExceeded",
            "extra": {"exit_status": "ContextWindowExceeded", "submission": "", "exception_str": why},
        }) from cause


def endpoint_model_class() -> type:
    """mini-swe-agent's text-based model with its chat calls sent through :class:`ModelClient`."""
    logging.getLogger("minisweagent").setLevel(logging.WARNING)  # its DEBUG lines drown the flow log
    from minisweagent.exceptions import FormatError
    from minisweagent.models import GLOBAL_MODEL_STATS
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel
    from minisweagent.models.utils.actions_text import parse_regex_actions
    from minisweagent.models.utils.actions_toolcall import (
        BASH_TOOL,
        format_toolcall_observation_messages,
        parse_toolcall_actions,
    )

    class EndpointModel(_SupervisedChat, LitellmTextbasedModel):
        def __init__(self, *, deadline_monotonic: float, action_format: str = "text",
                     watchdog: HangWatchdog | None = None, images: list[ImageRef] | None = None,
                     **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.images = images or []  # the task's images, sent with the first user turn of every request
            self.deadline_monotonic = deadline_monotonic
            self.action_format = action_format
            self.watchdog = watchdog
            params = dict(self.config.model_kwargs)
            self.api_base = str(params.pop("api_base", ""))
            if action_format == "toolcall":
                params["tools"] = [BASH_TOOL]
            self.sampling = params
            read_timeout_s = 600.0 if watchdog is None else min(600.0, watchdog.idle_limit_s + 5.0)
            api_key = os.environ.get(MODEL_API_KEY_ENV)
            self.client = ModelClient(self.api_base, api_key=api_key, read_timeout_s=read_timeout_s)
            slot_tokens = read_slot_tokens(self.api_base, api_key) if self.api_base else None
            self.budget = ContextBudget(slot_tokens, int(params.get("max_tokens") or 0),
                                        endpoint_counter(self.api_base, self.config.model_name, api_key)
                                        if slot_tokens else None)

        def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict:
            response = self._chat(self._prepare_messages_for_api(messages))
            GLOBAL_MODEL_STATS.add(0.0)
            extra = {"cost": 0.0, "response": response.model_dump(mode="json")}
            try:
                if self.action_format == "toolcall":
                    actions = parse_toolcall_actions(
                        [SimpleNamespace(id=c.get("id"), function=SimpleNamespace(**(c.get("function") or {})))
                         for c in response.tool_calls],
                        format_error_template=self.config.format_error_template,
                        template_kwargs={"finish_reason": response.finish_reason},
                    )
                else:
                    actions = parse_regex_actions(
                        response.content, action_regex=self.config.action_regex,
                        format_error_template=self.config.format_error_template,
                        template_kwargs={"finish_reason": response.finish_reason},
                    )
            except FormatError as exc:
                exc.messages[0]["extra"].update(extra)
                raise
            message: dict[str, Any] = {"role": "assistant", "content": response.content}
            if self.action_format == "toolcall":
                message["tool_calls"] = response.tool_calls
            message["extra"] = {"actions": actions, **extra, "timestamp": time.time()}
            return message

        def format_observation_messages(self, message: dict, outputs: list[dict],
                                        template_vars: dict | None = None) -> list[dict]:
            if self.action_format != "toolcall":
                return super().format_observation_messages(message, outputs, template_vars)
            return format_toolcall_observation_messages(
                actions=message.get("extra", {}).get("actions", []), outputs=outputs,
                observation_template=self.config.observation_template, template_vars=template_vars,
                multimodal_regex=self.config.multimodal_regex,
            )

        def close(self) -> None:
            self.client.close()

    return EndpointModel


STREAM_SUFFIX = ".messages.jsonl"
"""The streamed trajectory beside ``<trial>.traj.json``: ``<trial>.messages.jsonl``, one message a line."""


def stream_path(traj_path: Path) -> Path:
    """Where the messages of the run whose final trajectory is ``traj_path`` are streamed as they happen."""
    return traj_path.with_name(traj_path.name.removesuffix(".traj.json") + STREAM_SUFFIX)


def write_trajectory(path: Path, data: dict[str, Any]) -> int:
    """Write a trajectory (mini-swe-agent's format) atomically, one message at a time; returns its bytes.

    Raises:
        DiskFullError: the filesystem ran out of space (``path`` keeps its previous content, if any).
    """
    head = {k: v for k, v in data.items() if k != "messages"}
    written = 0
    with atomic_output_file(path) as tmp:
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                opening = json.dumps(head, ensure_ascii=False, indent=1)[:-1].rstrip() + ",\n" if head else "{\n"
                fh.write(opening + ' "messages": [')
                for i, message in enumerate(data.get("messages") or []):
                    fh.write(("," if i else "") + "\n  " + json.dumps(message, ensure_ascii=False))
                fh.write("\n ]\n}\n")
                written = fh.tell()
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise errors.DiskFullError(f"no space left writing the trajectory {path}: {exc}") from exc
            raise
    return written


def supervised_agent_class() -> type:
    """mini-swe-agent's DefaultAgent, supervised, with its trajectory streamed to disk as steps happen."""
    from minisweagent.agents.default import DefaultAgent

    class SupervisedAgent(DefaultAgent):
        def __init__(self, *args: Any, loop_threshold: int = DEFAULT_LOOP_THRESHOLD,
                     watchdog: HangWatchdog | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loop_threshold = loop_threshold
            self.watchdog = watchdog
            self.loop_detector = LoopDetector(loop_threshold)
            self.stream_stats = {"messages": 0, "bytes": 0, "writes": 0}
            self._streamed = 0
            self._stream: Any = None

        def add_messages(self, *messages: dict) -> list[dict]:
            if not self.messages:  # a new run (mini-swe-agent's run() resets the messages)
                self.loop_detector = LoopDetector(self.loop_threshold)
                self._streamed = 0
            first = len(self.messages)
            added = super().add_messages(*messages)
            for offset, message in enumerate(added):
                for call in tool_calls_of_message(message, first + offset):
                    self.loop_detector.add(call)
            if self.watchdog is not None:
                self.watchdog.touch_message()
            return added

        def query(self) -> dict:
            message = super().query()
            verdict = self.loop_detector.detection
            if verdict is not None:
                raise errors.AgentLoopError(
                    f"dead loop: the same {'call' if verdict.period == 1 else 'two calls'} repeated "
                    f"{verdict.repeats} times (period {verdict.period}; calls {verdict.indices}); "
                    f"run stopped before call {verdict.blocked_at} ran: {verdict.signatures[0][:200]}",
                    verdict.model_dump(mode="json"),
                )
            return message

        def step(self) -> list[dict]:
            observations = super().step()
            if self.watchdog is not None and self.watchdog.hung:
                raise self.model._hang_error("a command")
            return observations

        def _append_stream(self, path: Path) -> None:
            new = self.messages[self._streamed:]
            if not new:
                return
            if self._stream is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._stream = open(stream_path(path), "a", encoding="utf-8")  # noqa: SIM115 - held for the run
            text = "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in new)
            self._stream.write(text)
            self._stream.flush()
            self._streamed = len(self.messages)
            self.stream_stats["messages"] += len(new)
            self.stream_stats["bytes"] += len(text.encode("utf-8"))
            self.stream_stats["writes"] += 1

        def close_stream(self) -> None:
            """Close the stream file (idempotent)."""
            if self._stream is not None:
                self._stream.close()
                self._stream = None

        def save(self, path: Path | None, *extra_dicts: dict) -> dict:
            if not extra_dicts:  # mini-swe-agent's save after every step: append the step's messages
                if path:
                    self._append_stream(Path(path))
                return {}
            data = self.serialize(*extra_dicts)
            if path:
                self._append_stream(Path(path))
                self.close_stream()
                write_trajectory(Path(path), data)
                stream_path(Path(path)).unlink(missing_ok=True)
            return data

    return SupervisedAgent


def usage_totals(messages: list[dict[str, Any]]) -> tuple[int, int]:
    """Sum prompt/completion tokens over the model responses (ChatResponse dicts) in a trajectory."""
    n_in = n_out = 0
    for message in messages:
        response = (message.get("extra") or {}).get("response") or {}
        n_in += int(response.get("prompt_tokens") or 0)
        n_out += int(response.get("completion_tokens") or 0)
    return n_in, n_out

