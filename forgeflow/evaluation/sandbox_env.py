"""The agent's container as a mini-swe-agent environment over forgeflow's sandbox backends.

:class:`SandboxEnvironment` implements mini-swe-agent 2.4.6's ``Environment`` protocol (``execute``,
``get_template_vars``, ``serialize``) over one :class:`forgeflow.sandbox.base.Sandbox` of the trial's backend,
in place of its ``docker`` environment. ``execute`` returns what ``DockerEnvironment.execute`` does; a timed-out
command is returncode -1 and is not killed (as in mini-swe-agent's docker environment).

Outcomes versus breakage: a failing, timed-out, OOM-killed or pids-limited command is what the agent did (the
model sees it); a broken sandbox (container or pod gone, evicted, an exec that cannot start) raises
:class:`~forgeflow.common.errors.SandboxError` out of the agent's run: the trial's exception."""

from __future__ import annotations

import os
import platform
from typing import Any

from pydantic import ConfigDict, Field

from forgeflow.common import errors
from forgeflow.sandbox.backends import SandboxTarget, backend_kind, get_backend
from forgeflow.sandbox.base import Sandbox, SandboxSpec
from forgeflow.sandbox.limits import SandboxLimits
from forgeflow.sandbox.verifier import TESTBED

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent's submission marker: the first line of a command's output (exit 0) that ends the run."""

GIT_TIMEOUT_S = 120.0
"""Seconds a ``git`` command in the agent's container (base commit, submission diff) may take."""

PODMAN_EXEC_FAILED = 125
"""Exit status ``podman exec`` gives for its own failure (no such container, the runtime refused), not the
command's."""

INTERRUPT_TIMEOUT_S = 30.0
"""Seconds the watchdog's kill of the agent's commands (:meth:`SandboxEnvironment.interrupt`) may take."""

_LIST_PIDS = 'for p in /proc/[0-9]*; do echo "${p#/proc/}"; done; echo "self $$"'
"""Lists the container's processes (shell builtins only: nothing else is started) and the lister's own PID."""

_KILL_NEW_PIDS = ('for round in 1 2 3; do for p in /proc/[0-9]*; do p=${p#/proc/}; case " $1 $$ " in *" $p "*) ;; '
                  '*) kill -KILL "$p" 2>/dev/null;; esac; done; done')
"""SIGKILLs every process but those in ``$1`` (space-separated PIDs) and itself, three rounds (a process
forked by a dying shell between the listing and its kill is caught by the next round)."""


class SandboxEnvironmentConfig(SandboxLimits):
    """The agent's environment: mini-swe-agent's environment settings plus where the container runs and
    its limits (:class:`~forgeflow.sandbox.limits.SandboxLimits`).

    Attributes:
        image: the task image.
        backend: the sandbox backend kind (``podman`` or ``kubernetes``).
        name: the container's (pod's) name.
        cwd: working directory of every command (``/testbed``).
        env: variables set for every command (mini-swe-agent's config: ``PAGER=cat``, ...).
        forward_env: host variables passed on to every command when they are set (``env`` wins).
        timeout: default timeout of one command, seconds (mini-swe-agent's name).
        interpreter: the argv the command string is appended to (``["bash", "-c"]``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str = Field(min_length=1)
    backend: str = "podman"
    name: str = Field(min_length=1)
    cwd: str = TESTBED
    env: dict[str, str] = Field(default_factory=dict)
    forward_env: list[str] = Field(default_factory=list)
    timeout: int = Field(default=60, ge=1)
    interpreter: list[str] = Field(default_factory=lambda: ["bash", "-c"], min_length=1)


class SandboxEnvironment:
    """mini-swe-agent's environment protocol over a started :class:`~forgeflow.sandbox.base.Sandbox`.

    Build it with :meth:`start`; ``stop`` removes the container (idempotent).

    Args:
        sandbox: a started sandbox.
        config: the environment's settings (:class:`SandboxEnvironmentConfig`).
        keep_pids: the container's processes before any agent command ran (spared by :meth:`interrupt`).
    """

    def __init__(self, sandbox: Sandbox, config: SandboxEnvironmentConfig, keep_pids: frozenset[str]) -> None:
        self.sandbox = sandbox
        self.config = config
        self.keep_pids = keep_pids
        self._stopped = False

    @classmethod
    def start(cls, backend: "str | SandboxTarget", config: SandboxEnvironmentConfig) -> "SandboxEnvironment":
        """Start the container of ``config.image`` on ``backend`` (no network, ``config``'s memory and
        CPU limits, named ``config.name``) and record the processes it holds before any command. On
        Kubernetes the pod shares ``config.cwd`` with a ``tree`` sidecar (``tree_repo``) for the submission.

        Args:
            backend: a kind (``podman``, ``kubernetes``) or a :class:`~forgeflow.sandbox.backends.SandboxTarget`
                (the cluster and namespace; ``config.backend`` records its kind).
            config: the environment's settings (:class:`SandboxEnvironmentConfig`).

        Raises:
            InputError: an unknown backend kind.
            ToolMissingError: podman is not installed (podman backend).
            ImageNotFoundError / RegistryUnavailableError: the image cannot be pulled.
            SandboxError: the container could not start (nothing is left running).
        """
        spec = SandboxSpec.of(config, network=False)
        # on Kubernetes the repository is shared with a tree sidecar, where the agent's tree is taken
        extra = {"tree_repo": config.cwd} if backend_kind(backend) == "kubernetes" else {}
        sandbox = get_backend(backend)(config.image, spec, config.name, **extra)
        sandbox.start()
        try:
            listed = sandbox.exec(["sh", "-c", _LIST_PIDS], timeout_s=GIT_TIMEOUT_S)
            if listed.exit_code != 0:
                raise errors.SandboxError(f"could not list the processes of the agent's container {config.name}: "
                                          f"exit {listed.exit_code}: {listed.stderr.strip()[-400:]}")
        except BaseException:
            sandbox.stop()
            raise
        lines = listed.stdout.split()
        own = lines[lines.index("self") + 1] if "self" in lines else ""
        keep = frozenset(p for p in lines if p.isdigit() and p != own)
        return cls(sandbox, config, keep)

    # --- mini-swe-agent's Environment protocol ------------------------------------------------
    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the container; mini-swe-agent's ``DockerEnvironment.execute``.

        Returns:
            ``{"output": stdout+stderr, "returncode": int, "exception_info": str}``; a timeout, OOM kill or process
            limit gives returncode -1, ``exception_info`` and ``extra`` (``exception_type``, ``exception``).

        Raises:
            Submitted: the output's first line is the submission marker and the exit status 0.
            SandboxError: the sandbox broke (container or pod gone, evicted, exec not started).
        """
        command = action.get("command", "")
        env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None} | self.config.env
        argv = ["sh", "-c", 'exec "$@" 2>&1', "sh", *self.config.interpreter, command]
        limit_s = timeout or self.config.timeout
        try:
            result = self.sandbox.exec(argv, timeout_s=limit_s, workdir=cwd or self.config.cwd, env=env or None)
            if result.exit_code == PODMAN_EXEC_FAILED:
                self._check_alive(result.stderr)
            output: dict[str, Any] = {"output": result.stdout + result.stderr, "returncode": result.exit_code,
                                      "exception_info": ""}
        except errors.VerifierTimeoutError as exc:  # the command's timeout (the sandbox's name for it)
            output = self._failed(f"Command {command!r} timed out after {limit_s} seconds", exc)
        except (errors.SandboxOOMError, errors.SandboxPidsLimitError) as exc:  # what the command did
            output = self._failed(str(exc), exc)
        self._check_finished(output)
        return output

    def _check_alive(self, stderr: str) -> None:
        """Raise SandboxError when the agent's podman container is gone (an exec answered 125, podman's own
        failure, and ``podman container exists`` says no): an operator, conmon or the runtime removed it;
        the agent would otherwise see exit 125 for every command and be scored on a tree it never had."""
        if self.config.backend != "podman":
            return
        from forgeflow.sandbox.tree import container_exists

        if not container_exists(self.config.name):
            raise errors.SandboxError(f"the agent's container {self.config.name} vanished mid-run (evidence: podman "
                                      f"exec exited 125: {stderr.strip()[-200:]!r}; podman container exists: no)")

    @staticmethod
    def _failed(what: str, exc: BaseException) -> dict[str, Any]:
        return {"output": "", "returncode": -1, "exception_info": f"An error occurred while executing the command: "
                f"{what}", "extra": {"exception_type": type(exc).__name__, "exception": str(exc)}}

    @staticmethod
    def _check_finished(output: dict[str, Any]) -> None:
        """Raise mini-swe-agent's ``Submitted`` as its ``DockerEnvironment._check_finished`` does."""
        from minisweagent.exceptions import Submitted

        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config's fields, the host's ``platform.uname()`` and ``kwargs`` (as mini-swe-agent's envs)."""
        from minisweagent.utils.serialize import recursive_merge

        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict[str, Any]:
        """The trajectory's ``info.config.environment`` (this config) and ``environment_type``."""
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}

    # --- forgeflow's own ------------------------------------------------------------------------
    def git(self, *git_args: str) -> str:
        """``git -c core.fileMode=false <git_args>`` in ``config.cwd``; returns its stdout.

        Raises:
            SandboxError: git exited non-zero (the message has its stderr), or the sandbox broke.
        """
        result = self.sandbox.exec(["git", "-c", "core.fileMode=false", *git_args], timeout_s=GIT_TIMEOUT_S,
                                   workdir=self.config.cwd)
        if result.exit_code != 0:
            raise errors.SandboxError(f"git {' '.join(git_args)} failed in the agent container: "
                                      f"{result.stderr.strip()}")
        return result.stdout

    def interrupt(self) -> None:
        """SIGKILL every process an agent command started (all but those :meth:`start` found), so a stuck command
        returns (exit 137) and the container stays for the submission; errors are swallowed."""
        if self._stopped:
            return
        try:
            self.sandbox.exec(["sh", "-c", _KILL_NEW_PIDS, "sh", " ".join(sorted(self.keep_pids))],
                              timeout_s=INTERRUPT_TIMEOUT_S)
        except errors.ForgeflowError:
            pass

    def stop(self) -> None:
        """Remove the container (``Sandbox.stop``; idempotent).

        Raises:
            SandboxError: the backend could not remove it (e.g. the API refused the delete).
        """
        if not self._stopped:
            self._stopped = True
            self.sandbox.stop()


def environment_config(env_section: dict[str, Any], *, image: str, backend: "str | SandboxTarget", name: str,
                       memory_mb: int, cpus: float) -> SandboxEnvironmentConfig:
    """The :class:`SandboxEnvironmentConfig` of mini-swe-agent's ``environment`` config section.

    Takes ``cwd``, ``env``, ``forward_env``, ``timeout`` and ``interpreter`` from it; docker-only keys
    (``environment_class``, ``executable``, ``run_args``, ``pull_timeout``, ``container_timeout``) do
    not apply to a sandbox and are not read.

    Args:
        env_section: mini-swe-agent's ``environment`` section (:func:`forgeflow.evaluation.mswea.mswea_config`).
        image: the task image.
        backend: the sandbox backend (its kind is recorded).
        name: the container's (pod's) name.
        memory_mb: memory limit, MiB.
        cpus: CPU quota, cores.

    Raises:
        InputError: an unknown backend kind.
    """
    known = {k: env_section[k] for k in ("cwd", "env", "forward_env", "timeout", "interpreter") if k in env_section}
    return SandboxEnvironmentConfig(image=image, backend=backend_kind(backend), name=name, memory_mb=memory_mb,
                                    cpus=cpus, **known)
