"""The podman sandbox backend: a daemonless container per trial (runc runtime, lowered ulimits via
``infra/containers.conf``), ``--network none``, memory, CPU and pids limits, no capability,
``no-new-privileges`` and its own user namespace (:class:`~forgeflow.sandbox.base.SandboxSpec`), and
the kernel's own evidence of an OOM kill or a refused fork (the container's cgroup counters)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from forgeflow.common import errors
from forgeflow.common.settings import tool_env
from forgeflow.sandbox.base import OOM_EXIT_CODE, ExecResult, SandboxSpec, run_bounded
from forgeflow.sandbox.podman_layers import NAME_ANNOTATION, container_exit_code, end_orphans, sweep_containers

_PIDS_MAX_EVENT = re.compile(r"^max (\d+)$", re.MULTILINE)
_OOM_KILL_EVENT = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)


class PodmanSandbox:
    """A podman container kept alive (``sleep infinity`` under ``--init``) while commands run in it.

    Args:
        image: image reference (local name or ``127.0.0.1:PORT/repo:tag``; pulled if missing).
        spec: resource limits.
        name: container name (sanitized by the caller to the backend's alphabet, <= 63 chars).
        labels: labels (and OCI annotations) of the container, e.g. the flow run that started it.

    Raises (from :meth:`start`/:meth:`exec`):
        ToolMissingError: podman is not installed.
        ImageNotFoundError: the image cannot be pulled.
        SandboxError: the container did not start.
        SandboxOOMError: the kernel OOM-killed a process while a command ran (the memory cgroup's
            ``oom_kill`` counter; an exit status of 137 alone is not evidence).
        SandboxPidsLimitError: a fork was refused at ``spec.pids_limit`` while a command ran
            (counted by the container's pids cgroup, ``pids.events``), whatever the command's exit.
        VerifierTimeoutError: a command exceeded ``timeout_s``.
    """

    def __init__(self, image: str, spec: SandboxSpec | None = None, name: str | None = None,
                 labels: dict[str, str] | None = None) -> None:
        self.image = image
        self.spec = spec or SandboxSpec()
        self.name = name or f"ff-{uuid.uuid4().hex[:12]}"
        self.labels = dict(labels or {})  # label + OCI annotation each: e.g. the flow run, for its sweep
        self._started = False
        self._pids_events: Path | None = None
        self._oom_events: Path | None = None
        self._once: list[subprocess.Popen[bytes]] = []
        self.setup_s: float | None = None

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
        """Create and start the container; pull the image if it is not local.

        A container already holding the name (left by a crashed run of the same trial) is removed first
        (:func:`remove_podman_container`) and the start tried once more.

        Raises:
            ToolMissingError: podman is not installed.
            ImageNotFoundError: the registry does not have the image.
            SandboxError: podman could not start the container (its message as evidence).
        """
        end_orphans(self.name)  # a runtime container of this name podman no longer lists
        pidfile = Path(tempfile.gettempdir()) / f"forgeflow-{self.name}-{uuid.uuid4().hex[:8]}.pid"
        args = [self._podman(), "run", "-d", "--init", "--name", self.name, "--pidfile", str(pidfile),
                *self._limit_args(), *self._hardening_args(), self.image, "sleep", "infinity"]
        try:
            proc = subprocess.run(args, capture_output=True, text=True, env=tool_env(), timeout=600,
                                  cwd=conmon_cwd())
            if proc.returncode != 0 and _name_in_use(proc.stderr):
                remove_podman_container(self.name)  # left by a crashed run of the same trial
                proc = subprocess.run(args, capture_output=True, text=True, env=tool_env(), timeout=600,
                                      cwd=conmon_cwd())
            init_pid = pidfile.read_text().strip() if proc.returncode == 0 and pidfile.is_file() else ""
        finally:
            pidfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            msg = proc.stderr.strip()
            if "manifest unknown" in msg or "not found" in msg or "name unknown" in msg:
                raise errors.ImageNotFoundError(f"image {self.image!r} not found (evidence: podman run said: {msg})")
            raise errors.SandboxError(f"podman could not start {self.image!r} (evidence: podman run said: {msg})")
        self._started = True
        self._find_cgroup_files(init_pid)

    def _find_cgroup_files(self, init_pid: str = "") -> None:
        """Locate the container's ``pids.events`` and memory OOM counter on the host from its init process
        (cgroup v1: ``pids.events``, ``memory.oom_control``; v2: ``pids.events``, ``memory.events``). A file that
        cannot be read leaves the limit in force and only its evidence unavailable."""
        if not init_pid.isdigit():
            init_pid = subprocess.run(
                [self._podman(), "inspect", "--format", "{{.State.Pid}}", self.name],
                capture_output=True, text=True, env=tool_env(), timeout=60,
            ).stdout.strip()
        try:
            lines = Path(f"/proc/{int(init_pid)}/cgroup").read_text().splitlines()
        except (ValueError, OSError):
            return
        v1: dict[str, Path] = {}
        unified: Path | None = None
        for line in lines:
            hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            for controller in controllers.split(","):
                if controller in ("pids", "memory"):
                    v1[controller] = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
            if hierarchy == "0" and not controllers:
                unified = Path("/sys/fs/cgroup") / path.lstrip("/")

        def pick(*candidates: Path | None) -> Path | None:
            return next((c for c in candidates if c is not None and c.is_file()), None)

        if self.spec.pids_limit is not None:
            self._pids_events = pick(v1["pids"] / "pids.events" if "pids" in v1 else None,
                                     unified / "pids.events" if unified else None)
        self._oom_events = pick(v1["memory"] / "memory.oom_control" if "memory" in v1 else None,
                                unified / "memory.events" if unified else None)

    @staticmethod
    def _counter(path: Path | None, pattern: re.Pattern[str]) -> int | None:
        if path is None:
            return None
        try:
            match = pattern.search(path.read_text())
        except OSError:
            return None
        return int(match.group(1)) if match else None

    def _pids_max_events(self) -> int | None:
        """How many forks the pids cgroup has refused so far (``max`` in ``pids.events``)."""
        return self._counter(self._pids_events, _PIDS_MAX_EVENT)

    def _oom_kills(self) -> int | None:
        """How many processes the kernel's OOM killer has killed in the container's memory cgroup."""
        return self._counter(self._oom_events, _OOM_KILL_EVENT)

    def _inspect_oom_killed(self) -> bool:
        """``State.OOMKilled`` of the container (set when its init process was OOM-killed)."""
        proc = subprocess.run(
            [self._podman(), "inspect", "--format", "{{.State.OOMKilled}}", self.name],
            capture_output=True, text=True, env=tool_env(), timeout=60,
        )
        return proc.returncode == 0 and proc.stdout.strip() == "true"

    def _check_pids_limit(self, before: int | None, argv: list[str], after: int | None = None) -> None:
        after = self._pids_max_events() if after is None else after
        if before is not None and after is not None and after > before:
            raise errors.SandboxPidsLimitError(
                f"command {argv!r} in {self.image!r} hit the process limit "
                f"({self.spec.pids_limit} pids, --pids-limit): {after - before} forks refused "
                f"(evidence: {self._pids_events} max {before} -> {after})"
            )

    def _check_oom(self, before: int | None, argv: list[str], exit_code: int, after: int | None = None) -> None:
        """Raise SandboxOOMError iff the memory cgroup's ``oom_kill`` counter grew during the command (counter
        unreadable: podman's ``State.OOMKilled``); an exit 137 alone is the command's own result."""
        after = self._oom_kills() if after is None else after
        if before is not None and after is not None:
            if after > before:
                raise errors.SandboxOOMError(
                    f"command {argv!r} in {self.image!r} was OOM-killed (exit {exit_code}, memory limit "
                    f"{self.spec.memory_mb} MiB; evidence: {self._oom_events} oom_kill {before} -> {after})"
                )
            return
        if exit_code == OOM_EXIT_CODE and self._inspect_oom_killed():
            raise errors.SandboxOOMError(
                f"command {argv!r} in {self.image!r} was OOM-killed (exit {exit_code}, memory limit "
                f"{self.spec.memory_mb} MiB; evidence: podman inspect State.OOMKilled=true)"
            )

    def exec(self, command: list[str] | str, timeout_s: float, workdir: str | None = None,
             env: Mapping[str, str] | None = None) -> ExecResult:
        """Run ``command`` (argv list, or a string for ``bash -c``) in the container.

        A non-zero exit, 137 included, is a result; output that is not UTF-8 is decoded with replacement.

        Raises:
            SandboxError: the sandbox is not started, or ``podman exec`` could not be started.
            SandboxOOMError: the kernel OOM-killed a process of the container while the command ran.
            SandboxPidsLimitError: a fork was refused at ``spec.pids_limit`` meanwhile.
            VerifierTimeoutError: the command exceeded ``timeout_s`` seconds.
        """
        if not self._started:
            raise errors.SandboxError(f"sandbox {self.name} is not started")
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        args = [self._podman(), "exec"]
        if workdir:
            args += ["--workdir", workdir]
        for key, value in (env or {}).items():
            args += ["--env", f"{key}={value}"]
        args += [self.name, *argv]
        pids_before, oom_before = self._pids_max_events(), self._oom_kills()
        t0 = time.monotonic()
        try:
            code, out, err, dropped = run_bounded(args, env=tool_env(), timeout_s=timeout_s, cwd=conmon_cwd())
        except subprocess.TimeoutExpired as exc:
            # the runaway process tree dies with the container in stop()
            self._check_pids_limit(pids_before, argv)
            raise errors.VerifierTimeoutError(
                f"command {argv!r} in {self.image!r} exceeded {timeout_s:g} s (evidence: forgeflow's wall clock, "
                f"{time.monotonic() - t0:.1f} s)"
            ) from exc
        except OSError as exc:  # e.g. E2BIG: one argv string over the kernel's 128 KiB
            raise errors.SandboxError(f"podman exec in {self.name} could not be started: {exc} "
                                      f"(command of {sum(len(a) for a in args)} characters)") from exc
        duration = time.monotonic() - t0
        self._check_oom(oom_before, argv, code)
        self._check_pids_limit(pids_before, argv)
        return ExecResult.from_bytes(code, out, err, duration, dropped)

    def write_file(self, path: str, content: str | bytes) -> None:
        """Write a file inside the container (text as UTF-8, bytes as given).

        Raises:
            SandboxError: the write failed (podman's message as evidence).
        """
        data = content.encode() if isinstance(content, str) else content
        proc = subprocess.run([self._podman(), "exec", "-i", self.name, "sh", "-c", 'cat > "$1"', "sh", path],
                              input=data, capture_output=True, env=tool_env(), timeout=600)
        if proc.returncode != 0:
            raise errors.SandboxError(f"could not write {path} in {self.name}: "
                                      f"{proc.stderr.decode('utf-8', errors='replace').strip()[-300:]}")

    def run_once(self, command: str, timeout_s: float, workdir: str | None = None,
                 env: Mapping[str, str] | None = None) -> ExecResult:
        """Run one shell ``command`` as the container's own process (``podman run -i --rm``): one podman call per
        trial, for runs that need no interaction (a NOP or Oracle run).

        The exit status is the container's, never text the command could print. PID 1 is a wrapper the command
        cannot reach: an execute-only copy of bash (mode 0111, not dumpable without ``CAP_DAC_OVERRIDE``; see
        ptrace(2)) that brackets the output with a random nonce read on stdin and keeps the cgroup alive until its
        counters are read. The exit status comes from conmon's exit file; ``--rm``'s removal runs after the return
        (:meth:`stop_async` waits for it). :attr:`setup_s` holds the container's start time, seconds.

        Raises:
            SandboxError: already started, podman could not start the container, or the wrapper never reported
                the command's end (podman's exit status and stderr as evidence).
            ImageNotFoundError, ToolMissingError: as :meth:`start`.
            SandboxOOMError, SandboxPidsLimitError, VerifierTimeoutError: as :meth:`exec`.
        """
        if self._started or self._once:
            raise errors.SandboxError(f"sandbox {self.name} is already started: run_once starts its own container")
        nonce = uuid.uuid4().hex
        for attempt in (1, 2):
            if attempt == 1:
                end_orphans(self.name)  # a runtime container of this name podman no longer lists
            pidfile = Path(tempfile.gettempdir()) / f"forgeflow-{self.name}-{uuid.uuid4().hex[:8]}.pid"
            cidfile = pidfile.with_suffix(".cid")
            args = [self._podman(), "run", "-i", "--rm", "--name", self.name, "--pidfile", str(pidfile),
                    "--cidfile", str(cidfile), *self._limit_args(), *self._hardening_args()]
            if workdir:
                args += ["--workdir", workdir]
            for key, value in (env or {}).items():
                args += ["--env", f"{key}={value}"]
            args += [self.image, "bash", "-c", _ONCE_WRAPPER, "forgeflow-once", command]
            try:
                return self._run_once(args, nonce, pidfile, cidfile, command, timeout_s)
            except _NameInUse:
                if attempt == 2:
                    raise errors.SandboxError(f"podman could not start {self.image!r}: the name {self.name} "
                                              "stays in use after removing the container left under it") from None
                remove_podman_container(self.name)  # left by a crashed run of the same trial
            finally:
                pidfile.unlink(missing_ok=True)
                cidfile.unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def _hardening_args(self) -> list[str]:
        """``podman run`` options that take privileges away (capabilities, ``no-new-privileges``, user namespace,
        read-only root) plus the name annotation and ``labels`` (each as a label and an annotation)."""
        args = ["--cap-drop=all", *(f"--cap-add={cap}" for cap in self.spec.capabilities),
                "--security-opt=no-new-privileges", "--annotation", f"{NAME_ANNOTATION}={self.name}",
                *(arg for k, v in sorted(self.labels.items()) for arg in ("--label", f"{k}={v}", "--annotation",
                                                                           f"{k}={v}"))]
        userns = self.spec.user_namespace
        if userns == "auto":
            args.append("--userns=auto")
        elif userns is not None:
            inside, host, size = userns.split(":")
            args += ["--uidmap", f"{inside}:{host}:{size}", "--gidmap", f"{inside}:{host}:{size}"]
        if self.spec.read_only_root:
            args += ["--read-only", "--read-only-tmpfs"]
            for path in self.spec.writable_paths:
                args += ["--mount", f"type=tmpfs,destination={path},tmpfs-mode=0755,tmpcopyup"]
        return args

    def _limit_args(self) -> list[str]:
        """``podman run`` options of ``spec``'s limits (memory without swap, CPUs, pids, no network)."""
        args = ["--memory", f"{self.spec.memory_mb}m", "--memory-swap", f"{self.spec.memory_mb}m",
                "--cpus", str(self.spec.cpus)]
        if self.spec.pids_limit is not None:
            args += ["--pids-limit", str(self.spec.pids_limit)]
        if not self.spec.network:
            args += ["--network", "none"]
        return args

    def _run_once(self, args: list[str], nonce: str, pidfile: Path, cidfile: Path, command: str,
                  timeout_s: float) -> ExecResult:
        """One attempt of :meth:`run_once` (raises :class:`_NameInUse` when the name is taken)."""
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=tool_env(), cwd=conmon_cwd())
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self._once.append(proc)
        start_mark = nonce.encode() + b" start\n"
        end_mark = b"\n" + nonce.encode() + b" end\n"
        out, err = _Stream(proc.stdout, start_mark, end_mark), _Stream(proc.stderr, start_mark, end_mark)
        try:
            proc.stdin.write(nonce.encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # podman ended before reading it: its exit status and stderr below say why
        out.started.wait(timeout=600)  # set at the start mark, or when podman ends without one
        if out.start_s is not None:
            self.setup_s = out.start_s - t0
            out.ended.wait(timeout=max(0.0, timeout_s - (time.monotonic() - out.start_s)))
            if out.end_s is not None:
                err.ended.wait(timeout=30)  # the same mark on stderr follows at once
        if out.start_s is None or out.end_s is None or err.end_s is None:
            return self._once_failed(proc, out, err, command, timeout_s, t0)
        duration = out.end_s - out.start_s
        argv = ["bash", "-c", command]
        init_pid = pidfile.read_text().strip() if pidfile.is_file() else ""
        self._find_cgroup_files(init_pid)  # the container still runs: its wrapper waits on stdin
        oom_kills, pids_refused = self._oom_kills(), self._pids_max_events()
        cid = cidfile.read_text().strip() if cidfile.is_file() else ""
        _close(proc.stdin)  # the wrapper exits with the command's status
        exit_code = container_exit_code(proc, cid)
        if exit_code is None:
            proc.kill()
            proc.wait()
            raise errors.SandboxError(f"podman run of {self.image!r} did not end within 120 s of the end of "
                                      f"command {argv!r} (evidence: forgeflow's wall clock)") from None
        self._check_oom(0, argv, exit_code, after=oom_kills)
        self._check_pids_limit(0, argv, after=pids_refused)
        return ExecResult.from_bytes(exit_code, out.body(), err.body(), duration)

    def _once_failed(self, proc: "subprocess.Popen[bytes]", out: "_Stream", err: "_Stream", command: str,
                     timeout_s: float, t0: float) -> ExecResult:
        """What a :meth:`run_once` attempt that saw no end of the command is: a timeout (the
        container still runs: its pids counter read, then it is removed), a start podman refused,
        or a container process that died without reporting (an infrastructure error)."""
        argv = ["bash", "-c", command]
        if proc.poll() is None and out.start_s is not None:  # still running: the command's own clock ran out
            self._find_cgroup_files(self._inspect_pid())
            try:
                self._check_pids_limit(0, argv)
            finally:
                _close(proc.stdin)
                self._once.append(subprocess.Popen([self._podman(), "rm", "-f", "-t", "0", self.name],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                   env=tool_env()))
            raise errors.VerifierTimeoutError(
                f"command {argv!r} in {self.image!r} exceeded {timeout_s:g} s (evidence: forgeflow's wall clock, "
                f"{time.monotonic() - out.start_s:.1f} s)")
        _close(proc.stdin)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        out.done.wait(timeout=5)
        err.done.wait(timeout=5)
        msg = bytes(err.data).decode("utf-8", errors="replace").strip()
        if out.start_s is None:
            self._once.remove(proc)
            if _name_in_use(msg):
                raise _NameInUse()
            if "manifest unknown" in msg or "not found" in msg or "name unknown" in msg:
                raise errors.ImageNotFoundError(f"image {self.image!r} not found (evidence: podman run said: {msg})")
            raise errors.SandboxError(f"podman could not start {self.image!r} (evidence: podman run exited {code} "
                                      f"after {time.monotonic() - t0:.1f} s: {msg[-500:]})")
        raise errors.SandboxError(
            f"the container of {self.image!r} ended without reporting the end of command {argv!r} (evidence: "
            f"podman run exited {code}; stderr ends {msg[-300:]!r})")

    def _inspect_pid(self) -> str:
        return subprocess.run([self._podman(), "inspect", "--format", "{{.State.Pid}}", self.name],
                              capture_output=True, text=True, env=tool_env(), timeout=60).stdout.strip()

    def stop(self) -> None:
        """Remove the container (idempotent)."""
        self.stop_async()()

    def stop_async(self) -> Callable[[], None]:
        """Start removing the container and return a callable that waits until it is removed (at most 120 s);
        ``podman rm`` takes 0.16-0.33 s on 2 cores. Idempotent."""
        procs, self._once = self._once, []
        if self._started:
            self._started = False
            procs.append(subprocess.Popen([self._podman(), "rm", "-f", "-t", "0", self.name],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=tool_env()))
        for proc in procs:
            _close(proc.stdin)

        def wait() -> None:
            for proc in procs:
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

        return wait


class _NameInUse(Exception):
    """``podman run`` of :meth:`PodmanSandbox.run_once` refused the name: a container holds it."""


def _close(stream: object) -> None:
    try:
        if stream is not None:
            stream.close()  # type: ignore[attr-defined]
    except OSError:
        pass


_ONCE_WRAPPER = (
    # an execute-only copy of bash: exec'd by root without CAP_DAC_OVERRIDE it leaves PID 1 not dumpable
    'w=$(mktemp /tmp/.forgeflow-once.XXXXXX) && cat "$BASH" > "$w" && chmod 0111 "$w" '
    '|| { echo "forgeflow: cannot write the wrapper to /tmp" >&2; exit 125; }\n'
    'exec -a forgeflow-once "$w" -c \''
    'rm -f -- "$2"; IFS= read -r n || exit 125; printf "%s start\\n" "$n"; printf "%s start\\n" "$n" >&2\n'
    'bash -c "$1" forgeflow-run </dev/null; rc=$?\n'
    'printf "\\n%s end\\n" "$n"; printf "\\n%s end\\n" "$n" >&2\n'
    'IFS= read -r _; exit "$rc"\' forgeflow-once "$1" "$w"\n')
"""The process of a :meth:`PodmanSandbox.run_once` container (``bash -c`` with the command as ``$1``)."""


_MARK_MAX = 128
"""Bytes a mark of :meth:`PodmanSandbox.run_once` can span (newline, 32-hex nonce, word)."""


class _Stream:
    """Reads one output pipe of a :meth:`PodmanSandbox.run_once` container in a thread: every byte
    after the wrapper's start mark is the command's, but the wrapper's end mark (the last one)."""

    def __init__(self, pipe: object, start: bytes, end: bytes) -> None:
        self.data = bytearray()
        self.started, self.ended, self.done = threading.Event(), threading.Event(), threading.Event()
        self.start_s: float | None = None
        self.end_s: float | None = None
        self._begin = -1
        self._start, self._end_mark = start, end
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: object) -> None:
        scanned = 0  # marks are searched from a little before the new bytes only
        try:
            while chunk := pipe.read1(65536):  # type: ignore[attr-defined]
                self.data += chunk
                if self._begin < 0 and (at := self.data.find(self._start, max(0, scanned - _MARK_MAX))) >= 0:
                    self._begin, self.start_s = at + len(self._start), time.monotonic()
                    scanned = self._begin
                    self.started.set()
                if self._begin >= 0 and self.end_s is None:
                    if self.data.find(self._end_mark, max(self._begin, scanned - _MARK_MAX)) >= 0:
                        self.end_s = time.monotonic()
                        self.ended.set()
                scanned = len(self.data)
        except (OSError, ValueError):
            pass
        finally:
            self.started.set()
            self.ended.set()
            self.done.set()

    def body(self) -> bytes:
        """The command's output: the bytes between the start mark and the last end mark read so far
        (the wrapper prints its end mark after the command's own output; bytes a leftover background
        process writes after it are not the command's result)."""
        data = bytes(self.data)
        at = data.rfind(self._end_mark, self._begin) if self._begin >= 0 else -1
        return data[self._begin:at] if at >= 0 else b""


def conmon_cwd() -> Path:
    """The working directory podman's ``run`` and ``exec`` are started in. Their conmon inherits it
    and, when the kernel OOM-kills the container's command, creates an empty ``oom`` marker file
    there (conmon 2.1, relative to its cwd): without this it lands in whatever folder the flow or
    test was started from. ``<tmp>/forgeflow-conmon``, created on first use."""
    path = Path(tempfile.gettempdir()) / "forgeflow-conmon"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _name_in_use(stderr: str) -> bool:
    """Whether ``podman run`` failed because a container of that name exists. podman 4.3 words it
    "the container name ... is already in use" or, when the entry is half removed (state "Removing"
    after a SIGKILL of the process that ran it), 'name ... is in use: container already exists'."""
    return "already in use" in stderr or "is in use: container already exists" in stderr


def remove_podman_container(name: str) -> None:
    """Remove the container a crashed run of the same trial left, and check it is gone.

    After a SIGKILL, conmon can race the removal and leave an entry "Removing" that no longer holds the name
    (podman 4.3; seen in tests/flows/test_curate_kill.py): it is removed again by id, up to three rounds."""
    sweep_containers(lambda n: n == name)
    for round_no in range(3):
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, text=True, env=tool_env(),
                       timeout=120)
        listed = subprocess.run(["podman", "ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.ID}}"],
                                capture_output=True, text=True, env=tool_env(), timeout=60)
        if listed.returncode == 0 and not listed.stdout.split():
            return
        if listed.stdout.split():
            subprocess.run(["podman", "rm", "-f", "-t", "0", *listed.stdout.split()], capture_output=True,
                           text=True, env=tool_env(), timeout=120)
        time.sleep(0.5 * (round_no + 1))
