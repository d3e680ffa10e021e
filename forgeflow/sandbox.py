"""Sandboxes: one container per trial, no network, memory/CPU limits.

A backend implements :class:`Sandbox`: ``start`` a container from an image, ``exec`` commands in it,
``stop`` it. A *failing command is a result* (:class:`ExecResult` with its exit code); a *broken
sandbox is an exception* (:class:`~forgeflow.errors.SandboxError` and subclasses).

Backends are chosen by a string kind (:func:`get_backend`); the embedded default is ``podman``
(daemonless, runc runtime, lowered ulimits via ``infra/containers.conf``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Protocol

from pydantic import BaseModel, ConfigDict, Field

from forgeflow import errors
from forgeflow.settings import tool_env

OOM_EXIT_CODE = 137
"""Exit status of a process killed by SIGKILL (the kernel OOM killer under a memory limit)."""

DEFAULT_PIDS_LIMIT = 1024
"""Default of :attr:`SandboxSpec.pids_limit` (processes + threads per container)."""

_PIDS_MAX_EVENT = re.compile(r"^max (\d+)$", re.MULTILINE)


class SandboxSpec(BaseModel):
    """Resource limits of one sandbox.

    Attributes:
        memory_mb: memory limit in MiB (``--memory``).
        cpus: CPU quota in cores (``--cpus``).
        network: False gives ``--network none``.
        pids_limit: most processes and threads alive at once in the container (``--pids-limit``,
            the pids cgroup); bounds a fork bomb. 1024 by default: a pytest run needs a few dozen,
            podman's own default (``pids_limit`` in containers.conf) is 2048. ``None`` leaves
            podman's default. The Kubernetes backend ignores it (a pod's PID limit is the
            kubelet's ``podPidsLimit``).
    """

    model_config = ConfigDict(frozen=True)

    memory_mb: int = Field(default=2048, ge=16)
    cpus: float = Field(default=1.0, gt=0)
    network: bool = False
    pids_limit: int | None = Field(default=DEFAULT_PIDS_LIMIT, ge=8)


class ExecResult(BaseModel):
    """The outcome of one command in a sandbox (a failing command is a result, not an error)."""

    model_config = ConfigDict(frozen=True)

    exit_code: int
    stdout: str
    stderr: str
    duration_s: float = Field(ge=0)


class Sandbox(Protocol):
    """A running sandbox. Lifecycle: ``start`` -> ``exec``* -> ``stop`` (also a context manager)."""

    def start(self) -> None: ...

    def exec(self, command: list[str] | str, timeout_s: float, workdir: str | None = None) -> ExecResult: ...

    def write_file(self, path: str, content: str) -> None: ...

    def stop(self) -> None: ...


class PodmanSandbox:
    """A podman container kept alive (``sleep infinity`` under ``--init``) while commands run in it.

    Args:
        image: image reference (local name or ``127.0.0.1:PORT/repo:tag``; pulled if missing).
        spec: resource limits.
        name: container name (sanitized by the caller to the backend's alphabet, <= 63 chars).

    Raises (from :meth:`start`/:meth:`exec`):
        ToolMissingError: podman is not installed.
        ImageNotFoundError: the image cannot be pulled.
        SandboxError: the container did not start.
        SandboxOOMError: a command was killed for memory (exit 137).
        SandboxPidsLimitError: a fork was refused at ``spec.pids_limit`` while a command ran
            (counted by the container's pids cgroup, ``pids.events``), whatever the command's exit.
        VerifierTimeoutError: a command exceeded ``timeout_s``.
    """

    def __init__(self, image: str, spec: SandboxSpec | None = None, name: str | None = None) -> None:
        self.image = image
        self.spec = spec or SandboxSpec()
        self.name = name or f"ff-{uuid.uuid4().hex[:12]}"
        self._started = False
        self._pids_events: Path | None = None

    def __enter__(self) -> "PodmanSandbox":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def _podman() -> str:
        exe = shutil.which("podman")
        if exe is None:
            raise errors.ToolMissingError("podman is not installed (apt-get install podman)")
        return exe

    def start(self) -> None:
        """Create and start the container; pull the image if it is not local."""
        args = [
            self._podman(), "run", "-d", "--init", "--name", self.name,
            "--memory", f"{self.spec.memory_mb}m", "--memory-swap", f"{self.spec.memory_mb}m",
            "--cpus", str(self.spec.cpus),
        ]
        if self.spec.pids_limit is not None:
            args += ["--pids-limit", str(self.spec.pids_limit)]
        if not self.spec.network:
            args += ["--network", "none"]
        args += [self.image, "sleep", "infinity"]
        proc = subprocess.run(args, capture_output=True, text=True, env=tool_env(), timeout=600)
        if proc.returncode != 0:
            msg = proc.stderr.strip()
            if "manifest unknown" in msg or "not found" in msg or "name unknown" in msg:
                raise errors.ImageNotFoundError(f"image {self.image!r} not found: {msg}")
            raise errors.SandboxError(f"podman could not start {self.image!r}: {msg}")
        self._started = True
        if self.spec.pids_limit is not None:
            self._pids_events = self._find_pids_events()

    def _find_pids_events(self) -> Path | None:
        """The host path of the container's ``pids.events`` (cgroup v1 ``pids`` hierarchy or the
        v2 unified one), found from its init process's ``/proc/<pid>/cgroup``; None when it cannot
        be read (the limit still applies, only its detection is lost)."""
        proc = subprocess.run(
            [self._podman(), "inspect", "--format", "{{.State.Pid}}", self.name],
            capture_output=True, text=True, env=tool_env(), timeout=60,
        )
        try:
            lines = Path(f"/proc/{int(proc.stdout.strip())}/cgroup").read_text().splitlines()
        except (ValueError, OSError):
            return None
        unified = None
        for line in lines:
            hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            if "pids" in controllers.split(","):
                found = Path("/sys/fs/cgroup/pids") / path.lstrip("/") / "pids.events"
                return found if found.is_file() else None
            if hierarchy == "0" and not controllers:
                unified = Path("/sys/fs/cgroup") / path.lstrip("/") / "pids.events"
        return unified if unified is not None and unified.is_file() else None

    def _pids_max_events(self) -> int | None:
        """How many forks the pids cgroup has refused so far (``max`` in ``pids.events``)."""
        if self._pids_events is None:
            return None
        try:
            match = _PIDS_MAX_EVENT.search(self._pids_events.read_text())
        except OSError:
            return None
        return int(match.group(1)) if match else None

    def _check_pids_limit(self, before: int | None, argv: list[str]) -> None:
        after = self._pids_max_events()
        if before is not None and after is not None and after > before:
            raise errors.SandboxPidsLimitError(
                f"command {argv!r} in {self.image!r} hit the process limit "
                f"({self.spec.pids_limit} pids, --pids-limit): {after - before} forks refused"
            )

    def exec(self, command: list[str] | str, timeout_s: float, workdir: str | None = None) -> ExecResult:
        """Run ``command`` (argv list, or a string for ``bash -lc``) in the container.

        Args:
            command: argv, or one shell string.
            timeout_s: wall-clock limit in seconds; exceeding it raises VerifierTimeoutError.
            workdir: working directory inside the container.

        Raises:
            SandboxError: the sandbox is not started.
            SandboxOOMError: the command was killed for memory (exit 137).
            SandboxPidsLimitError: a fork was refused at ``spec.pids_limit`` meanwhile.
            VerifierTimeoutError: the command exceeded ``timeout_s``.
        """
        if not self._started:
            raise errors.SandboxError(f"sandbox {self.name} is not started")
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        args = [self._podman(), "exec"]
        if workdir:
            args += ["--workdir", workdir]
        args += [self.name, *argv]
        before = self._pids_max_events()
        t0 = time.monotonic()
        try:
            proc = subprocess.run(args, capture_output=True, text=True, env=tool_env(), timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            # kill the runaway process tree by restarting nothing: the container is torn down by stop()
            self._check_pids_limit(before, argv)
            raise errors.VerifierTimeoutError(
                f"command {argv!r} in {self.image!r} exceeded {timeout_s:.0f} s"
            ) from exc
        duration = time.monotonic() - t0
        if proc.returncode == OOM_EXIT_CODE:
            raise errors.SandboxOOMError(
                f"command {argv!r} in {self.image!r} was killed (exit 137, memory limit {self.spec.memory_mb} MiB)"
            )
        self._check_pids_limit(before, argv)
        return ExecResult(exit_code=proc.returncode, stdout=proc.stdout, stderr=proc.stderr, duration_s=duration)

    def write_file(self, path: str, content: str) -> None:
        """Write a text file inside the container (through ``podman exec -i ... tee``)."""
        proc = subprocess.run(
            [self._podman(), "exec", "-i", self.name, "bash", "-c", f"cat > {path!s}"],
            input=content, capture_output=True, text=True, env=tool_env(), timeout=60,
        )
        if proc.returncode != 0:
            raise errors.SandboxError(f"could not write {path} in {self.name}: {proc.stderr.strip()}")

    def stop(self) -> None:
        """Remove the container (idempotent)."""
        if not self._started:
            return
        subprocess.run(
            [self._podman(), "rm", "-f", "-t", "0", self.name],
            capture_output=True, text=True, env=tool_env(), timeout=120,
        )
        self._started = False


def _kubernetes_sandbox(*args: object, **kwargs: object) -> Sandbox:
    """Build a :class:`forgeflow.k8s.KubernetesSandbox` (imported lazily: ``k8s`` imports this module)."""
    from forgeflow.k8s import KubernetesSandbox

    return KubernetesSandbox(*args, **kwargs)  # type: ignore[arg-type]


BACKENDS: dict[str, Callable[..., Sandbox]] = {"podman": PodmanSandbox, "kubernetes": _kubernetes_sandbox}
"""Sandbox factories by kind: each takes ``(image, spec, name, ...)`` and returns a :class:`Sandbox`."""


def get_backend(kind: str) -> Callable[..., Sandbox]:
    """Return the sandbox factory for ``kind`` (``podman`` on the embedded default).

    Raises:
        InputError: ``kind`` is unknown; the message lists the valid kinds.
    """
    try:
        return BACKENDS[kind]
    except KeyError:
        raise errors.InputError(
            f"unknown sandbox backend {kind!r}; valid kinds: {', '.join(sorted(BACKENDS))}"
        ) from None
