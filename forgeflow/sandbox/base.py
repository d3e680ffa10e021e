"""The Sandbox protocol and its data: one container per trial, no network, memory/CPU limits.

A backend implements :class:`Sandbox`: ``start`` a container from an image, ``exec`` commands in it,
``write_file``, ``stop`` it. A *failing command is a result* (:class:`ExecResult` with its exit code);
a *broken sandbox is an exception* (:class:`~forgeflow.common.errors.SandboxError` and subclasses).
Backends: :mod:`forgeflow.sandbox.podman` (the embedded default), :mod:`forgeflow.sandbox.kubernetes`;
chosen by kind in :mod:`forgeflow.sandbox.backends`.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from forgeflow.sandbox.limits import SandboxLimits

OOM_EXIT_CODE = 137
"""Exit status of a process killed by SIGKILL (128 + 9). The kernel's OOM killer under a memory
limit gives it, but so does a process that kills itself or simply ``exit 137``: the status alone is
never evidence of an OOM (see :meth:`PodmanSandbox.exec`)."""


DEFAULT_PIDS_LIMIT = 1024
"""Default of :attr:`SandboxSpec.pids_limit` (processes + threads per container)."""


DEFAULT_USER_NAMESPACE = "0:1879048192:65536"
"""Default of :attr:`SandboxSpec.user_namespace`: container ids 0..65535 are host ids
1879048192.. (0x70000000): root in the sandbox is no host user."""


UNSAFE_CAPABILITIES = ("DAC_OVERRIDE", "DAC_READ_SEARCH", "SYS_PTRACE", "SYS_ADMIN")
"""Capabilities a sandbox never gets: with any of them a command could read or write the memory of
the process that reports its end and exit status (:meth:`PodmanSandbox.run_once
<forgeflow.sandbox.podman.PodmanSandbox.run_once>` keeps that process out of reach of root without
them), or mount over what the verifier reads."""


class SandboxSpec(SandboxLimits):
    """Resource limits of one sandbox: :class:`~forgeflow.sandbox.limits.SandboxLimits` (``memory_mb`` gives
    ``--memory``, ``cpus`` ``--cpus``) and the container's isolation.

    Attributes:
        network: False gives ``--network none``.
        pids_limit: most processes and threads alive at once in the container (``--pids-limit``,
            the pids cgroup); bounds a fork bomb. 1024 by default: a pytest run needs a few dozen,
            podman's own default (``pids_limit`` in containers.conf) is 2048. ``None`` leaves
            podman's default. The Kubernetes backend ignores it (a pod's PID limit is the
            kubelet's ``podPidsLimit``).
        capabilities: Linux capabilities added back after all are dropped (``--cap-drop=all``,
            then ``--cap-add`` each; names without ``CAP_``, e.g. ``("CHOWN",)``). Empty by
            default: ``git apply``, pytest and an agent's shell work as root without any (the
            files of ``/testbed`` are root's own; root needs no ``CAP_DAC_OVERRIDE`` for them).
            Every container also gets ``no-new-privileges`` (no setuid or file-capability gain).
            :data:`UNSAFE_CAPABILITIES` are refused (ValueError).
        user_namespace: the container's user namespace: ``"CONTAINER:HOST:SIZE"`` maps container
            uids and gids ``CONTAINER..`` to host ids ``HOST..`` (``--uidmap``/``--gidmap``; root
            in the sandbox is an unprivileged host uid), ``"auto"`` lets podman pick a range
            (``--userns=auto``: needs a ``containers`` entry in /etc/subuid and /etc/subgid),
            ``None`` shares the host's (root in the sandbox is host root). The default maps
            65,536 ids at host uid/gid 1879048192 (0x70000000), far above the ranges
            ``useradd`` hands out for subordinate ids. The Kubernetes backend ignores it
            (``KubernetesSandboxSpec.host_users``).
        read_only_root: True makes the container's root filesystem read-only (``--read-only``)
            except ``/tmp``, ``/var/tmp`` and ``/run`` (podman's tmpfs) and ``writable_paths``,
            each a tmpfs filled with the image's content at that path (``tmpcopyup``; its bytes
            count against ``memory_mb``). False by default: the repository's copy costs memory,
            and a suite that writes elsewhere (``$HOME``) would fail where its pristine runs passed.
        writable_paths: absolute paths kept writable when ``read_only_root`` is True.
    """

    model_config = ConfigDict(frozen=True)

    network: bool = False
    pids_limit: int | None = Field(default=DEFAULT_PIDS_LIMIT, ge=8)
    capabilities: tuple[str, ...] = Field(default=(), max_length=41)
    user_namespace: str | None = Field(default=DEFAULT_USER_NAMESPACE, pattern=r"^(auto|\d+:\d+:\d+)$")
    read_only_root: bool = False
    writable_paths: tuple[str, ...] = ("/testbed",)

    @classmethod
    def of(cls, limits: SandboxLimits, *, network: bool = False) -> SandboxSpec:
        """The spec of ``limits``' memory and CPUs (any model extending :class:`SandboxLimits`: its other fields
        are not taken) with ``network``; the isolation fields at their defaults."""
        return cls(memory_mb=limits.memory_mb, cpus=limits.cpus, network=network)

    @field_validator("capabilities")
    @classmethod
    def _capability_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not re.fullmatch(r"[A-Z][A-Z_]*", name) or name.startswith("CAP_"):
                raise ValueError(f"capability {name!r} is not a capability name without CAP_ (e.g. 'CHOWN')")
            if name in UNSAFE_CAPABILITIES:
                raise ValueError(f"capability {name!r} would let a command reach the process that reports its "
                                 f"exit (one of {', '.join(UNSAFE_CAPABILITIES)})")
        return value

    @field_validator("writable_paths")
    @classmethod
    def _absolute_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.startswith("/") or "," in path or ":" in path or ".." in path.split("/"):
                raise ValueError(f"writable path {path!r} is not an absolute path without ',', ':' or '..'")
        return value


class ExecResult(BaseModel):
    """The outcome of one command in a sandbox (a failing command is a result, not an error).

    Output is kept whatever its bytes: ``stdout``/``stderr`` are decoded as UTF-8 with undecodable
    bytes replaced by U+FFFD (a test that prints Latin-1 never loses its trial), and the raw bytes
    are digested so the original output can still be identified.

    Attributes:
        exit_code: the command's exit status.
        stdout: standard output, decoded (``errors="replace"``).
        stderr: standard error, decoded likewise.
        duration_s: wall-clock seconds of the command.
        stdout_sha256: hex sha256 of the raw stdout bytes (None when a backend did not record it).
        stderr_sha256: hex sha256 of the raw stderr bytes.
        undecodable: True when either stream held bytes that are not UTF-8 (they were replaced).
        dropped_bytes: output bytes past :data:`OUTPUT_MAX_BYTES` per stream, read and not kept.
    """

    model_config = ConfigDict(frozen=True)

    exit_code: int
    stdout: str
    stderr: str
    duration_s: float = Field(ge=0)
    stdout_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    stderr_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    undecodable: bool = False
    dropped_bytes: int = Field(default=0, ge=0)

    @classmethod
    def from_bytes(cls, exit_code: int, stdout: bytes, stderr: bytes, duration_s: float,
                   dropped_bytes: int = 0) -> "ExecResult":
        """Build a result from raw output: decode with replacement, digest the bytes."""
        out, out_bad = decode_output(stdout)
        err, err_bad = decode_output(stderr)
        return cls(exit_code=exit_code, stdout=out, stderr=err, duration_s=max(0.0, duration_s),
                   stdout_sha256=hashlib.sha256(stdout).hexdigest(), dropped_bytes=dropped_bytes,
                   stderr_sha256=hashlib.sha256(stderr).hexdigest(), undecodable=out_bad or err_bad)


OUTPUT_MAX_BYTES = 64 << 20
"""The most bytes of each output stream of one command kept on the host (64 MiB): a command that
floods its output cannot exhaust the host's memory (a red-team run took a scorer to 416 MB with 300 MiB);
the rest is read and dropped (:attr:`ExecResult.dropped_bytes`)."""


def run_bounded(args: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
                cwd: str | None = None, max_bytes: int = OUTPUT_MAX_BYTES) -> tuple[int, bytes, bytes, int]:
    """Run ``args`` (stdin closed) and keep at most ``max_bytes`` of each of its output streams.

    Returns:
        ``(exit status, stdout, stderr, bytes dropped past the bound, both streams together)``.

    Raises:
        subprocess.TimeoutExpired: the process ran past ``timeout_s`` seconds (it is killed first).
        OSError: the process could not be started.
    """
    proc = subprocess.Popen(list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(env) if env is not None else None, cwd=cwd)
    kept: list[bytearray] = [bytearray(), bytearray()]
    dropped = [0, 0]

    def drain(index: int, pipe: object) -> None:
        while chunk := pipe.read1(1 << 16):  # type: ignore[attr-defined]
            room = max_bytes - len(kept[index])
            kept[index] += chunk[:room]
            dropped[index] += max(0, len(chunk) - room)

    readers = [threading.Thread(target=drain, args=(i, pipe), daemon=True)
               for i, pipe in enumerate((proc.stdout, proc.stderr))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s
    try:  # the pipes close when the process ends: joining the readers waits without polling
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        if any(reader.is_alive() for reader in readers):
            raise subprocess.TimeoutExpired(list(args), timeout_s)
        code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for reader in readers:
            reader.join(timeout=10)
        raise
    return code, bytes(kept[0]), bytes(kept[1]), sum(dropped)


def decode_output(raw: bytes) -> tuple[str, bool]:
    """``(text, had_undecodable_bytes)``: ``raw`` decoded as UTF-8, bad bytes replaced by U+FFFD."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


class Sandbox(Protocol):
    """A running sandbox. Lifecycle: ``start`` -> ``exec``* -> ``stop`` (also a context manager)."""

    def start(self) -> None: ...

    def exec(self, command: list[str] | str, timeout_s: float, workdir: str | None = None,
             env: Mapping[str, str] | None = None) -> ExecResult: ...

    def write_file(self, path: str, content: str | bytes) -> None: ...

    def stop(self) -> None: ...

    def stop_async(self) -> Callable[[], None]:
        """Start the removal and return a callable that waits until it is done (for backends whose
        removal is slow: the next trial starts meanwhile). ``stop`` is ``stop_async()()``."""
        ...


@runtime_checkable
class OneShotSandbox(Sandbox, Protocol):
    """A sandbox that can also run one command as its container's own process, instead of
    ``start`` + ``exec``: one container start per run that needs no interaction (a NOP or Oracle
    run), with the same limits and the same evidence (:meth:`PodmanSandbox.run_once
    <forgeflow.sandbox.podman.PodmanSandbox.run_once>`). ``setup_s`` is then the container's start
    time in seconds."""

    setup_s: float | None

    def run_once(self, command: str, timeout_s: float, workdir: str | None = None,
                 env: Mapping[str, str] | None = None) -> ExecResult: ...
