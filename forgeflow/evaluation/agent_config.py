"""The sampling and budget of one agent trial (mini-swe-agent's limits, the supervisor's, the
verifier's tamper policy)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from forgeflow.evaluation.supervision import (
    DEFAULT_HANG_IDLE_S,
    DEFAULT_LOOP_THRESHOLD,
)
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.limits import LimitOverrides, SandboxLimits
from forgeflow.sandbox.submission import ScreenPolicy, TamperPolicy

MSWEA_CONFIG_NAME = "swebench_backticks"
"""mini-swe-agent's built-in SWE-bench config with the text (``mswea_bash_command`` fence) format;
tiny local models do not produce tool calls, so the text-based model class is used."""


class AgentConfig(LimitOverrides):
    """Sampling and budget of one agent trial, and its containers' limits (``memory_mb``, ``cpus``:
    :class:`~forgeflow.sandbox.limits.LimitOverrides`; None: the canary's sandbox block's, else the
    defaults; the canary flow records the resolved values, :meth:`resolved`).

    Attributes:
        step_limit: maximum model calls (mini-swe-agent's ``step_limit``).
        agent_timeout_s: wall-clock budget of the agent loop in seconds; overrunning it records an
            AgentTimeoutError (the verifier still runs).
        temperature: sampling temperature.
        max_tokens: completion-token cap per model call.
        seed: sampling seed sent to the endpoint.
        command_timeout_s: timeout of one agent command in the container, seconds.
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
            ``reject`` (tampering, reward 0) or ``drop`` (those paths put back as the image has them,
            the rest graded).
        screen_policy: what the verifier does when the lines a submission added reach into the test
            run (the test framework's internals, exit hooks, interpreter introspection;
            :func:`forgeflow.sandbox.submission.screen_added_lines`): ``reject`` (tampering, reward 0),
            ``flag`` (recorded only: for a repository that is itself a test framework) or ``off``.
        verifier_backend: the sandbox backend the verifier's fresh container runs on
            (:data:`forgeflow.sandbox.backends.BACKENDS`: ``podman`` or ``kubernetes``, or a
            :class:`~forgeflow.sandbox.backends.SandboxTarget`: a kubernetes cluster and namespace).
        sandbox_backend: the sandbox backend the agent's own container runs on (the same kinds and
            targets; :class:`forgeflow.evaluation.sandbox_env.SandboxEnvironment`: every command of
            the agent, its submission's ``git diff`` and the hang watchdog's kill go through it).
            The canary flow's ``sandbox`` block sets it and ``verifier_backend`` alike; a config
            recorded before this field existed (a job's params) reads as ``podman``, where its agent ran.
            Default ``podman``.
        verifier_ray: a Ray cluster (:class:`forgeflow.sandbox.dispatch.RayPlacement`, a
            ``forgeflow-dispatcher`` block's). The canary's trial task
            (:func:`tasks.evaluation.agent_trial`, through
            :func:`forgeflow.evaluation.agent.run_agent_trial_on`) runs the whole trial there as one Ray
            task on a sandbox node (agent, container, verifier); :func:`run_agent_trial` called with it
            runs only the verifier there. Either way the trial's verifier record names the node. Where
            it runs, not what: it is not part of the trial's run key. None: in this process.
    """

    model_config = ConfigDict(frozen=True)

    step_limit: int = Field(default=4, ge=1, le=1000)
    agent_timeout_s: float = Field(default=600.0, gt=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    max_tokens: int = Field(default=256, ge=1, le=32768)
    seed: int = Field(default=0, ge=0)
    command_timeout_s: int = Field(default=60, ge=1)
    config_name: str = MSWEA_CONFIG_NAME
    action_format: Literal["text", "toolcall"] = "text"
    loop_threshold: int = Field(default=DEFAULT_LOOP_THRESHOLD, ge=2, le=1000)
    hang_idle_s: float = Field(default=DEFAULT_HANG_IDLE_S, gt=0)
    tamper_policy: TamperPolicy = "reject"
    screen_policy: ScreenPolicy = "reject"
    verifier_backend: Literal["podman", "kubernetes"] | SandboxTarget = "podman"
    sandbox_backend: Literal["podman", "kubernetes"] | SandboxTarget = "podman"
    verifier_ray: RayPlacement | None = None

    def resolved(self, block: SandboxLimits | None = None) -> AgentConfig:
        """This config with its limits resolved (its own, else ``block``'s, else the defaults): what a
        trial runs with and a job records (:meth:`LimitOverrides.over`)."""
        return self.model_copy(update=self.over(block).model_dump())
