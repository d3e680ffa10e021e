"""Agent trials: mini-swe-agent against an OpenAI-compatible endpoint, then the verifier.

One agent trial (Harbor's and SWE-bench's shape):

1. **agent** — mini-swe-agent 2.4.6's ``DefaultAgent`` with its text-based model (its
   ``mswea_bash_command`` action parsing and format-error handling) whose chat calls go through
   :class:`forgeflow.evaluation.model_client.ModelClient` (transient-only retries, a total budget equal to the
   agent's remaining time, a circuit breaker) instead of LiteLLM, and its ``docker`` environment
   driven by podman: the loop and the model calls stay on the host, every command runs in a
   container of the task image with ``--network none`` and ``cwd /testbed`` (FACTS.md). Prompts
   come from mini-swe-agent's own ``swebench_backticks.yaml``. The trajectory JSON is written
   atomically after every step. One ModelClient (hence one circuit breaker) serves one agent run.
2. **submission** — ``git diff`` of ``/testbed`` against the image's commit, taken from the agent's
   container before it is removed (tracked files only: reproduction scripts are not submitted).
3. **verifier** — :func:`forgeflow.sandbox.verifier.verify_submission`: a fresh container of the pristine
   task image (nothing the agent did in its own container carries over), the submission screened
   (changes to the task's tests, conftest, test configuration or start-up hooks are tampering, or
   dropped, by ``AgentConfig.tamper_policy``) and applied with ``git apply``, the tests run with the
   pinned environment and read from the structured report, and the strict resolution rule gives
   reward 1.0 or 0.0.

Outcomes versus breakage (DESIGN.md):

* format errors, the step limit, a context overflow or an empty or non-applying patch are the
  model's outcomes: the verifier runs and the reward is 0 or 1;
* the endpoint refusing, resetting, answering 5xx or returning no choice (after ModelClient's
  retries) is a :class:`~forgeflow.common.errors.ModelEndpointError`: recorded as the trial's exception
  with reward None and no verifier run;
* the agent overrunning ``agent_timeout_s`` is an :class:`~forgeflow.common.errors.AgentTimeoutError`
  recorded with the exception *and* the verifier's reward (Harbor's convention);
* **supervision** (issue 5, long-horizon runs): after every model answer the calls so far go through
  :func:`forgeflow.evaluation.supervision.detect_loop` (``loop_threshold``, default: blocked at the 3rd
  repeat, before it runs); a :class:`~forgeflow.evaluation.supervision.HangWatchdog` thread flags the run
  when no new message or model call happened for ``hang_idle_s`` (default 11 minutes), kills the
  command running in the agent's container and abandons a model call in flight. Either stops the
  run with :class:`~forgeflow.common.errors.AgentLoopError` / :class:`~forgeflow.common.errors.AgentHangError`
  (subclasses of AgentTimeoutError): the trajectory is saved, the verifier still runs, and the
  trial carries ``supervision = {kind, evidence, trajectory_path}`` for the store's
  ``supervision_events`` (recorded by ``tasks.evaluation.agent_trial``);
* sandbox failures (image missing, OOM, verifier timeout, unparseable test output) are recorded as
  the exception with reward None.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.common.fsutil import atomic_write_json, sha256_json
from forgeflow.common.settings import apply_container_env, tool_env
from forgeflow.evaluation.model_client import ChatResponse, ModelClient, chat_request
from forgeflow.evaluation.supervision import (
    DEFAULT_HANG_IDLE_S,
    DEFAULT_LOOP_THRESHOLD,
    HangCheck,
    HangWatchdog,
    detect_loop,
    tool_calls_from_trajectory,
)
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.submission import TamperPolicy
from forgeflow.sandbox.trial import TrialResult, container_name, make_trial_id
from forgeflow.sandbox.verifier import (
    LOG_TAIL_CHARS,
    TESTBED,
    SubmissionVerdict,
    verify_submission,
)

MSWEA_CONFIG_NAME = "swebench_backticks"
"""mini-swe-agent's built-in SWE-bench config with the text (``mswea_bash_command`` fence) format;
tiny local models do not produce tool calls, so the text-based model class is used."""

CONTEXT_OVERFLOW_PATTERN = re.compile(
    r"context_length_exceeded|maximum context length|context window|exceeds the available context size",
    re.IGNORECASE,
)
"""How a 400 (:class:`~forgeflow.common.errors.ModelRequestError`) names a context overflow: OpenAI's and
llama-cpp-python's ``context_length_exceeded`` ("This model's maximum context length is N tokens",
``llama_cpp/server/errors.py``) and llama.cpp server's "exceeds the available context size"; the
same strings LiteLLM maps to ``ContextWindowExceededError``."""
_PODMAN_TIMEOUT_S = 120


class AgentConfig(BaseModel):
    """Sampling and budget of one agent trial.

    Attributes:
        step_limit: maximum model calls (mini-swe-agent's ``step_limit``).
        agent_timeout_s: wall-clock budget of the agent loop in seconds; overrunning it records an
            AgentTimeoutError (the verifier still runs).
        temperature: sampling temperature.
        max_tokens: completion-token cap per model call.
        seed: sampling seed sent to the endpoint.
        command_timeout_s: timeout of one agent command in the container, seconds.
        memory_mb: memory limit of the agent's and the verifier's containers, MiB.
        cpus: CPU quota of those containers, cores.
        config_name: the mini-swe-agent built-in config whose prompts are used.
        action_format: ``text`` (the ``mswea_bash_command`` fence, for models without tool calls)
            or ``toolcall`` (mini-swe-agent's ``bash`` tool is offered as an OpenAI tool and the
            actions are read from the answer's ``tool_calls``; pair it with ``config_name
            "swebench"``, mini-swe-agent's tool-call prompts).
        loop_threshold: repetitions of one call (period 1) or one A-B cycle (period 2) at which
            the supervisor stops the run (>= 2; default 3: blocked at the 3rd repeat).
        hang_idle_s: seconds without a new message or model call after which the watchdog stops
            the run (default 660 = 11 minutes).
        tamper_policy: what the verifier does with a submission that changes the task's own files
            (tests, conftest, test configuration, start-up hooks; :mod:`forgeflow.sandbox.submission`):
            ``reject`` (tampering, reward 0) or ``drop`` (those parts removed, the rest graded).
    """

    model_config = ConfigDict(frozen=True)

    step_limit: int = Field(default=4, ge=1, le=1000)
    agent_timeout_s: float = Field(default=600.0, gt=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    max_tokens: int = Field(default=256, ge=1, le=32768)
    seed: int = Field(default=0, ge=0)
    command_timeout_s: int = Field(default=60, ge=1)
    memory_mb: int = Field(default=2048, ge=64)
    cpus: float = Field(default=1.0, gt=0)
    config_name: str = MSWEA_CONFIG_NAME
    action_format: Literal["text", "toolcall"] = "text"
    loop_threshold: int = Field(default=DEFAULT_LOOP_THRESHOLD, ge=2, le=1000)
    hang_idle_s: float = Field(default=DEFAULT_HANG_IDLE_S, gt=0)
    tamper_policy: TamperPolicy = "reject"


# --- mini-swe-agent wiring -------------------------------------------------------------------
_MSWEA_DIR: Path | None = None


def _prepare_mswea_env() -> None:
    """Environment mini-swe-agent reads at import time (set before importing it).

    ``MSWEA_CONFIGURED`` skips the interactive setup, ``MSWEA_GLOBAL_CONFIG_DIR`` keeps its ``.env``
    out of the home directory, ``LITELLM_LOCAL_MODEL_COST_MAP`` stops LiteLLM (which mini-swe-agent's
    model module imports, though no call goes through it) fetching its price list from GitHub (the
    machine is offline), and the container variables make the podman that mini-swe-agent spawns use
    runc and the lowered ulimits.
    """
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
    _prepare_mswea_env()
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
    """The mini-swe-agent config dict (agent / environment / model sections) for one trial.

    Starts from mini-swe-agent's built-in ``config.config_name`` yaml and overrides the budget, the
    podman environment (FACTS.md: ``executable: podman``, ``cwd: /testbed``,
    ``run_args: ["--rm", "--network", "none"]``, plus ``--init`` so stopping is immediate and the
    memory/CPU limits) and the model (``model_name`` is the alias sent to the endpoint;
    ``model_kwargs`` holds ``api_base`` and the sampling parameters ModelClient sends; the API key
    is not in the config — it is read from ``$FORGEFLOW_MODEL_API_KEY`` when the model is built, so
    it never lands in a trajectory).
    """
    _prepare_mswea_env()
    from minisweagent.config import get_config_from_spec
    from minisweagent.utils.serialize import recursive_merge

    base = get_config_from_spec(config.config_name)
    overrides = {
        "agent": {
            "step_limit": config.step_limit,
            "cost_limit": 0.0,
            "wall_time_limit_seconds": max(1, int(config.agent_timeout_s)),
        },
        "environment": {
            "environment_class": "docker",
            "executable": shutil.which("podman") or "podman",
            "image": image_ref,
            "cwd": TESTBED,
            "timeout": config.command_timeout_s,
            "pull_timeout": _PODMAN_TIMEOUT_S,
            "run_args": [
                "--rm", "--network", "none", "--init",
                "--memory", f"{config.memory_mb}m", "--memory-swap", f"{config.memory_mb}m",
                "--cpus", str(config.cpus),
            ],
        },
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
    return merged


def _endpoint_model_class() -> type:
    """mini-swe-agent's text-based model with its chat calls sent through :class:`ModelClient`.

    Only ``query`` is overridden: the request goes to ``ModelClient.chat`` (transient-only retries,
    a total budget of the agent's remaining time, a circuit breaker; one client, hence one breaker,
    per agent run), and the answer is parsed by mini-swe-agent's own ``mswea_bash_command`` regex
    (a FormatError carries the response, as mini-swe-agent's ``query`` does). The message's
    ``extra.response`` is the :class:`ChatResponse` (``prompt_tokens``/``completion_tokens`` feed
    the trial's token counts); cost is 0 (a local endpoint has no price).

    With ``action_format="toolcall"`` the request offers mini-swe-agent's ``BASH_TOOL`` and the
    actions come from the answer's ``tool_calls`` (mini-swe-agent's ``parse_toolcall_actions``;
    observations are ``tool`` messages answering each call id).

    Supervision: every call start and answer is reported to the run's :class:`HangWatchdog`; the
    HTTP call runs in a helper thread so that a hang flagged by the watchdog stops the run at once
    (the abandoned call ends at its read timeout, capped at the idle limit plus 5 s).

    Errors: ModelClient's ModelEndpointError (CircuitOpenError included) propagates; a model call
    that outlives the agent's deadline is an AgentTimeoutError; a call during which the watchdog
    flagged a hang is an AgentHangError; a 400 naming a context overflow ends the run with exit
    status ``ContextWindowExceeded`` (the model's outcome); any other ModelRequestError propagates
    (a configuration bug).
    """
    logging.getLogger("minisweagent").setLevel(logging.WARNING)  # its DEBUG lines drown the flow log
    from minisweagent.exceptions import FormatError, InterruptAgentFlow
    from minisweagent.models import GLOBAL_MODEL_STATS
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel
    from minisweagent.models.utils.actions_text import parse_regex_actions
    from minisweagent.models.utils.actions_toolcall import (
        BASH_TOOL,
        format_toolcall_observation_messages,
        parse_toolcall_actions,
    )

    class EndpointModel(LitellmTextbasedModel):
        def __init__(self, *, deadline_monotonic: float, action_format: str = "text",
                     watchdog: HangWatchdog | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.deadline_monotonic = deadline_monotonic
            self.action_format = action_format
            self.watchdog = watchdog
            params = dict(self.config.model_kwargs)
            self.api_base = str(params.pop("api_base", ""))
            if action_format == "toolcall":
                params["tools"] = [BASH_TOOL]
            self.sampling = params
            read_timeout_s = 600.0 if watchdog is None else min(600.0, watchdog.idle_limit_s + 5.0)
            self.client = ModelClient(self.api_base, api_key=os.environ.get("FORGEFLOW_MODEL_API_KEY"),
                                      read_timeout_s=read_timeout_s)

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

            def call() -> None:
                try:
                    box["response"] = self.client.chat(request)
                except BaseException as exc:  # noqa: BLE001 - handed to the agent's thread
                    box["error"] = exc

            worker = threading.Thread(target=call, name="forgeflow-model-call", daemon=True)
            worker.start()
            while worker.is_alive():
                if self.watchdog.hung_event.wait(0.1):
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
            request = chat_request(self.config.model_name, messages, **self.sampling)
            try:
                response = self._send(request)
                if self.watchdog is not None:
                    self.watchdog.touch_model_call()
                return response
            except errors.ModelEndpointError as exc:
                if self.watchdog is not None and self.watchdog.hung:
                    raise self._hang_error("a model call") from exc
                if time.monotonic() >= self.deadline_monotonic:
                    raise errors.AgentTimeoutError(f"model call outlived the agent budget: {exc}") from exc
                raise
            except errors.ModelRequestError as exc:
                if CONTEXT_OVERFLOW_PATTERN.search(str(exc)):
                    raise InterruptAgentFlow({
                        "role": "exit", "content": "ContextWindowExceeded",
                        "extra": {"exit_status": "ContextWindowExceeded", "submission": "",
                                  "exception_str": str(exc)},
                    }) from exc
                raise

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


def _atomic_agent_class() -> type:
    """mini-swe-agent's DefaultAgent, supervised, with its per-step trajectory save made atomic.

    * every new message is reported to the watchdog (``touch_message``);
    * after each model answer (before its action runs) the tool calls of the whole trajectory
      go through :func:`detect_loop` with ``loop_threshold``: a loop raises
      :class:`~forgeflow.common.errors.AgentLoopError` whose ``evidence`` is the
      :class:`~forgeflow.evaluation.supervision.LoopDetection` (the looping answer stays in the trajectory,
      its command is not run);
    * after each step's commands, a hang flagged meanwhile raises AgentHangError.
    """
    from minisweagent.agents.default import DefaultAgent

    class SupervisedAgent(DefaultAgent):
        def __init__(self, *args: Any, loop_threshold: int = DEFAULT_LOOP_THRESHOLD,
                     watchdog: HangWatchdog | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loop_threshold = loop_threshold
            self.watchdog = watchdog

        def add_messages(self, *messages: dict) -> list[dict]:
            added = super().add_messages(*messages)
            if self.watchdog is not None:
                self.watchdog.touch_message()
            return added

        def query(self) -> dict:
            message = super().query()
            verdict = detect_loop(tool_calls_from_trajectory({"messages": self.messages}), self.loop_threshold)
            if verdict.detected:
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

        def save(self, path: Path | None, *extra_dicts: dict) -> dict:
            data = self.serialize(*extra_dicts)
            if path:
                atomic_write_json(path, data)
            return data

    return SupervisedAgent


def _start_environment(env_config: dict[str, Any]) -> Any:
    """Start mini-swe-agent's container environment; podman failures become sandbox errors."""
    from minisweagent.environments import get_environment

    try:
        return get_environment(env_config)
    except subprocess.CalledProcessError as exc:
        msg = (exc.stderr or exc.stdout or "").strip() if isinstance(exc.stderr, str) else str(exc)
        image = env_config.get("image")
        if any(s in msg for s in ("manifest unknown", "not found", "name unknown", "no such image")):
            raise errors.ImageNotFoundError(f"agent image {image!r} not found: {msg}") from exc
        raise errors.SandboxError(f"podman could not start the agent container for {image!r}: {msg}") from exc
    except subprocess.TimeoutExpired as exc:
        raise errors.SandboxError(f"starting the agent container timed out: {exc}") from exc


def _podman(*args: str, timeout_s: float = _PODMAN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("podman")
    if exe is None:
        raise errors.ToolMissingError("podman is not installed (apt-get install podman)")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=tool_env(), timeout=timeout_s)


def _container_git(container_id: str, *git_args: str) -> str:
    proc = _podman("exec", "-w", TESTBED, container_id, "git", "-c", "core.fileMode=false", *git_args)
    if proc.returncode != 0:
        raise errors.SandboxError(f"git {' '.join(git_args)} failed in the agent container: {proc.stderr.strip()}")
    return proc.stdout


def _interrupt_commands(env: Any) -> None:
    """Kill every process of the agent's container but its init (``kill -KILL -1``): a command
    stuck past the hang limit returns (exit 137) and the container stays for the submission."""
    container_id = getattr(env, "container_id", None)
    if container_id:
        try:
            _podman("exec", container_id, "sh", "-c", "kill -KILL -1", timeout_s=30)
        except (OSError, subprocess.SubprocessError):
            pass  # the run stops anyway; the container is removed by the phase's cleanup


def _remove_container(env: Any) -> None:
    container_id = getattr(env, "container_id", None)
    if container_id:
        _podman("rm", "-f", "-t", "0", container_id)
        env.container_id = None  # mini-swe-agent's __del__ would otherwise spawn its own stop


def _usage_totals(messages: list[dict[str, Any]]) -> tuple[int, int]:
    """Sum prompt/completion tokens over the model responses (ChatResponse dicts) in a trajectory."""
    n_in = n_out = 0
    for message in messages:
        response = (message.get("extra") or {}).get("response") or {}
        n_in += int(response.get("prompt_tokens") or 0)
        n_out += int(response.get("completion_tokens") or 0)
    return n_in, n_out


# --- problem statements ----------------------------------------------------------------------
MAX_TESTS_LISTED = 10
"""Failing tests named in a problem statement; the rest are counted (keeps prompts short)."""


def problem_statement_for(candidate_patch: str, failing_tests: list[str]) -> str:
    """An issue-like task text naming the failing tests, with nothing of the patch in it.

    Uses SWE-smith's static "failing tests" issue template (``swesmith.issue_gen.get_static``:
    ``PROMPT_TESTS_F2P`` filled with ``print_list`` of FAIL_TO_PASS). The patch is only validated
    (it must be a non-empty unified diff) and checked not to leak: no changed code line of the
    patch may appear in the text.

    Args:
        candidate_patch: the bug's unified diff (never shown to the agent).
        failing_tests: the FAIL_TO_PASS test ids (pytest node ids), at least one.

    Returns:
        The problem statement (plain text, one test per ``- `` line, sorted; at most
        :data:`MAX_TESTS_LISTED` named, then a line counting the others).

    Raises:
        InputError: ``failing_tests`` is empty or ``candidate_patch`` is not a unified diff.
    """
    from swesmith.issue_gen.get_static import PROMPT_TESTS_F2P, print_list
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    tests = sorted({t.strip() for t in failing_tests if t and t.strip()})
    if not tests:
        raise errors.InputError("failing_tests is empty: a problem statement needs at least one FAIL_TO_PASS test")
    try:
        patch = PatchSet(candidate_patch)
    except UnidiffParseError as exc:
        raise errors.InputError(f"candidate_patch is not a unified diff: {exc}") from exc
    if len(patch) == 0:
        raise errors.InputError("candidate_patch is empty (no file changed)")
    listed = tests[:MAX_TESTS_LISTED]
    more = f"\n- ... and {len(tests) - len(listed)} more" if len(tests) > len(listed) else ""
    text = PROMPT_TESTS_F2P.format(f2p_list=print_list(listed) + more)
    changed = {
        line.value.strip()
        for pfile in patch for hunk in pfile for line in hunk
        if (line.is_added or line.is_removed) and len(line.value.strip()) >= 8
    }
    leaked = [c for c in changed if c in text]
    if leaked:  # a test id that quotes code: drop the test names rather than leak the patch
        text = PROMPT_TESTS_F2P.format(f2p_list=f"- {len(tests)} test(s) in the test suite")
    return text


# --- the trial -------------------------------------------------------------------------------
@dataclass
class _AgentPhase:
    """What the agent phase left behind (internal)."""

    exit_status: str = ""
    submission: str = ""
    error: BaseException | None = None
    env_setup_s: float = 0.0
    agent_s: float = 0.0
    n_steps: int = 0
    n_input_tokens: int = 0
    n_output_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    supervision: dict[str, Any] | None = None


def _run_agent_phase(
    trial_id: str, instance_id: str, image_ref: str, problem_statement: str, base_url: str,
    model_alias: str, config: AgentConfig, traj_path: Path,
) -> _AgentPhase:
    """Run mini-swe-agent in a container of ``image_ref``; take the submission; remove the container.

    Endpoint failures, agent overruns and sandbox failures are caught into ``_AgentPhase.error``.
    """
    phase = _AgentPhase()
    t0 = time.monotonic()
    deadline = t0 + config.agent_timeout_s
    cfg = mswea_config(image_ref, base_url, model_alias, config)
    watchdog = HangWatchdog(config.hang_idle_s)
    model = _endpoint_model_class()(deadline_monotonic=deadline, action_format=config.action_format,
                                    watchdog=watchdog, **cfg["model"])
    agent = None
    env = None
    try:
        env = _start_environment(cfg["environment"])
        base_commit = _container_git(env.container_id, "rev-parse", "HEAD").strip()
        phase.env_setup_s = time.monotonic() - t0
        agent = _atomic_agent_class()(model, env, output_path=traj_path, loop_threshold=config.loop_threshold,
                                      watchdog=watchdog, **cfg["agent"])

        def on_hang(check: HangCheck) -> None:
            _interrupt_commands(env)

        watchdog.on_hang = on_hang
        watchdog.start()
        try:
            result = agent.run(problem_statement)
            phase.exit_status = str(result.get("exit_status", ""))
            if phase.exit_status == "ContextWindowExceeded":  # the model's outcome
                phase.notes.append(f"context window exceeded: {result.get('exception_str', '')}")
        except (errors.ModelEndpointError, errors.AgentTimeoutError) as exc:
            if watchdog.hung and not isinstance(exc, errors.AgentHangError):
                exc = model._hang_error("a model call")  # the endpoint error came from the hang
            phase.error = exc
            phase.exit_status = type(exc).__name__
            if isinstance(exc, errors.AgentLoopError | errors.AgentHangError):
                phase.supervision = {
                    "kind": "dead_loop" if isinstance(exc, errors.AgentLoopError) else "hang",
                    "evidence": exc.evidence, "trajectory_path": str(traj_path),
                }
        finally:
            watchdog.stop()
        phase.agent_s = time.monotonic() - t0
        if phase.error is None and (phase.exit_status == "TimeExceeded" or time.monotonic() > deadline):
            phase.error = errors.AgentTimeoutError(
                f"agent exceeded its {config.agent_timeout_s:.0f} s budget ({phase.agent_s:.1f} s)"
            )
        if not isinstance(phase.error, errors.ModelEndpointError):
            try:
                phase.submission = _container_git(env.container_id, "diff", "--no-color", "--binary", base_commit)
            except errors.SandboxError as exc:  # the agent broke the repository: its outcome
                phase.notes.append(f"could not take the submission: {exc}")
    except errors.ModelRequestError:  # a malformed request is a configuration bug, not an outcome
        raise
    except errors.InfraError as exc:  # sandbox broke (image missing, podman failure)
        phase.error = exc
    finally:
        watchdog.stop()
        model.close()
        if env is not None:
            _remove_container(env)
        phase.agent_s = phase.agent_s or time.monotonic() - t0
        if agent is not None:
            phase.n_steps = int(agent.n_calls)
            phase.n_input_tokens, phase.n_output_tokens = _usage_totals(agent.messages)
            agent.save(traj_path, {
                "info": {
                    "exit_status": phase.exit_status,
                    "submission": phase.submission,
                    "forgeflow": {
                        "trial_id": trial_id, "instance_id": instance_id, "image_ref": image_ref,
                        "n_steps": phase.n_steps, "n_input_tokens": phase.n_input_tokens,
                        "n_output_tokens": phase.n_output_tokens, "agent_s": phase.agent_s,
                        "error": f"{type(phase.error).__name__}: {phase.error}" if phase.error else None,
                        "supervision": phase.supervision,
                    },
                },
                "instance_id": instance_id,
            })
    return phase


def _record(
    *, trial_id: str, instance_id: str, started_at: datetime, phase: _AgentPhase,
    reward: float | None, error: BaseException | None, verdict: SubmissionVerdict | None, notes: list[str],
) -> TrialResult:
    """Build the agent's TrialRecord (with its costs: steps and tokens, and the verifier's evidence).

    An AgentTimeoutError (AgentLoopError / AgentHangError included) is recorded together with the
    verifier's reward (Harbor's convention), and a supervisor stop with its ``supervision`` evidence.
    """
    message = "\n".join([str(error) or repr(error), *notes]) if error is not None else None
    verifier = verdict.result if verdict is not None else None
    evidence = {**verdict.evidence, "notes": verdict.notes} if verdict is not None else None
    fields: dict[str, Any] = {
        "trial_id": trial_id, "instance_id": instance_id, "kind": "agent",
        "reward": reward, "exception_type": type(error).__name__ if error is not None else None,
        "exception_message": message, "started_at": started_at, "env_setup_s": phase.env_setup_s,
        "agent_s": phase.agent_s, "verifier_s": verifier.duration_s if verifier else None,
        "tests": verifier.tests if verifier else {},
        "log_tail": (verifier.log_tail if verifier else "") or "\n".join(notes)[-LOG_TAIL_CHARS:],
        "agent_steps": phase.n_steps, "input_tokens": phase.n_input_tokens,
        "output_tokens": phase.n_output_tokens, "supervision": phase.supervision, "verifier": evidence,
    }
    return TrialResult(**fields)


def supervision_event(record: TrialResult, job_id: str | None = None, run_id: str | None = None) -> Any:
    """The store row of a supervisor stop, or None when the supervisor did not stop ``record``.

    Returns:
        :class:`forgeflow.ledger.store.SupervisionEventRecord` keyed ``<trial_id>:<kind>`` (a re-recorded
        trial upserts its event) with the evidence and the trajectory path.
    """
    from forgeflow.ledger.records import SupervisionEventRecord

    if record.supervision is None:
        return None
    kind = record.supervision["kind"]
    return SupervisionEventRecord(
        event_id=f"{record.trial_id}:{kind}", trial_id=record.trial_id, job_id=job_id, kind=kind,
        evidence={**record.supervision.get("evidence", {}), "exception_type": record.exception_type,
                  "reward": record.reward},
        trajectory_path=record.supervision.get("trajectory_path"), run_id=run_id,
    )


def default_run_key(problem_statement: str, model_alias: str, base_url: str, config: AgentConfig) -> str:
    """The run key of an agent trial: sha256 of everything that changes its result but the image."""
    return sha256_json({
        "problem_statement": problem_statement, "model_alias": model_alias, "base_url": base_url,
        "config": config.model_dump(mode="json"),
    })


def run_agent_trial(
    instance_id: str,
    image_ref: str,
    problem_statement: str,
    test_command: str,
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    base_url: str,
    model_alias: str,
    config: AgentConfig,
    out_dir: Path,
    verifier_timeout_s: float = 180,
    run_key: str | None = None,
) -> TrialResult:
    """Run one agent trial: mini-swe-agent in the task image, then the verifier in a fresh one.

    Args:
        instance_id: the task's id.
        image_ref: the task image (bug applied at /testbed, a git repo with one commit).
        problem_statement: the issue text given to the agent.
        test_command: the verifier's test command (``pytest -rA`` output), run in /testbed.
        fail_to_pass: the task's FAIL_TO_PASS test ids.
        pass_to_pass: the task's PASS_TO_PASS test ids.
        base_url: OpenAI-compatible endpoint, e.g. ``http://127.0.0.1:8801/v1``.
        model_alias: the model name to request.
        config: sampling and budget.
        out_dir: where ``<trial_id>.traj.json`` is written (atomically, after every step); its
            ``info.forgeflow`` holds ``n_steps``, ``n_input_tokens``, ``n_output_tokens``.
        verifier_timeout_s: timeout of the test run in seconds.
        run_key: distinguishes repeated trials of the same inputs (e.g. a sample index, the model
            digest); default :func:`default_run_key`. The trial id is
            :func:`forgeflow.sandbox.trial.make_trial_id` of (instance, "agent", image, run key).

    Returns:
        TrialRecord with kind ``"agent"``: reward 1.0/0.0 when the verifier ran (format errors, step
        limit, context overflow, empty or non-applying patches included); reward None with
        ``exception_type`` ``ModelEndpointError`` (no verifier run) or a sandbox/verifier error;
        ``exception_type`` ``AgentTimeoutError`` together with the verifier's reward on an overrun;
        ``AgentLoopError`` / ``AgentHangError`` (with the verifier's reward and ``supervision`` =
        ``{"kind": "dead_loop" | "hang", "evidence", "trajectory_path"}``) when the supervisor
        stopped the run.

    Raises:
        InputError: an argument is empty or malformed (nothing was run).
        ModelRequestError: the endpoint rejected the request with a 4xx (other than a context
            overflow): a configuration bug, not an outcome.
    """
    for arg_name, value in (("instance_id", instance_id), ("image_ref", image_ref),
                            ("problem_statement", problem_statement), ("test_command", test_command),
                            ("base_url", base_url), ("model_alias", model_alias)):
        if not isinstance(value, str) or not value.strip():
            raise errors.InputError(f"{arg_name} must be a non-empty string, got {value!r}")
    if not base_url.startswith(("http://", "https://")):
        raise errors.InputError(f"base_url must be an http(s) URL, got {base_url!r}")
    if not fail_to_pass and not pass_to_pass:
        raise errors.InputError("fail_to_pass and pass_to_pass are both empty: nothing to grade")
    if verifier_timeout_s <= 0:
        raise errors.InputError(f"verifier_timeout_s must be > 0, got {verifier_timeout_s}")

    _prepare_mswea_env()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = run_key or default_run_key(problem_statement, model_alias, base_url, config)
    trial_id = make_trial_id(instance_id, "agent", image_ref, key)
    started_at = datetime.now(timezone.utc)
    traj_path = out_dir / f"{trial_id}.traj.json"

    phase = _run_agent_phase(trial_id, instance_id, image_ref, problem_statement, base_url,
                             model_alias, config, traj_path)
    notes = list(phase.notes)
    error = phase.error
    reward: float | None = None
    verdict: SubmissionVerdict | None = None
    if error is None or isinstance(error, errors.AgentTimeoutError):
        try:
            verdict = verify_submission(
                image_ref, phase.submission, test_command, fail_to_pass, pass_to_pass,
                timeout_s=verifier_timeout_s, spec=SandboxSpec(memory_mb=config.memory_mb, cpus=config.cpus),
                name=container_name(instance_id, "agent", trial_id), tamper_policy=config.tamper_policy,
            )
            reward = verdict.reward
            notes.extend(verdict.notes)
        except errors.InfraError as exc:  # the verifier broke: no reward, never 0
            reward = None
            notes.append(f"verifier failed: {type(exc).__name__}: {exc}")
            error = error or exc
    notes.append(f"agent exit status: {phase.exit_status or 'none'}; steps {phase.n_steps}; "
                 f"input tokens {phase.n_input_tokens}")
    return _record(trial_id=trial_id, instance_id=instance_id, started_at=started_at, phase=phase,
                   reward=reward, error=error, verdict=verdict, notes=notes)
