"""The model server base: one OpenAI-compatible server process per GGUF on one loopback port.

llama-cpp-python's server has no ``/health``: readiness is ``/v1/models`` (about 1.8 s after launch on
2 cores)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from forgeflow.common import errors

LOOPBACK_HOST = "127.0.0.1"
SERVER_MODULE = "llama_cpp.server"
LLAMA_SERVER_BINARY = "llama-server"
DEFAULT_ALIAS = "forgeflow"
_LOG_TAIL_CHARS = 4000
_POLL_INTERVAL_S = 0.2

# Popen handles of servers started by this process, by PID, so stop() can reap its own children
# (a PID read back from a state file written by another process is signalled and polled instead).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def check_bind_host(host: str) -> str:
    """``host`` if it is an IPv4 address a server can bind (``127.0.0.1``, an interface's address,
    or ``0.0.0.0`` for every interface).

    Raises:
        InputError: not an IPv4 address (named).
    """
    import ipaddress

    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        raise errors.InputError(f"host {host!r} is not an IPv4 address (127.0.0.1, an interface's address, "
                                "or 0.0.0.0 for every interface)") from None


def client_host(host: str) -> str:
    """The address clients on this machine reach a server bound to ``host`` at: ``host`` itself,
    or ``127.0.0.1`` for ``0.0.0.0`` (every interface)."""
    return LOOPBACK_HOST if host == "0.0.0.0" else host  # noqa: S104 - the wildcard is what is tested


def _port_is_open(port: int, host: str = LOOPBACK_HOST) -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _tail(path: Path | None, n_chars: int = _LOG_TAIL_CHARS) -> str:
    if path is None or not path.exists():
        return ""
    data = path.read_bytes()[-n_chars:]
    return data.decode("utf-8", errors="replace")


def _cmdline(pid: int) -> list[str]:
    """The argv of a live process from /proc (empty if it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode("utf-8", errors="replace") for part in raw.split(b"\0") if part]


def _is_our_server(pid: int, port: int | None = None) -> bool:
    """True if ``pid`` is a live ``llama_cpp.server`` or ``llama-server`` (on ``port`` if given)."""
    argv = _cmdline(pid)
    if SERVER_MODULE not in argv and not (argv and Path(argv[0]).name == LLAMA_SERVER_BINARY):
        return False
    if port is None:
        return True
    return "--port" in argv and argv[argv.index("--port") + 1 : argv.index("--port") + 2] == [str(port)]


def _pid_alive(pid: int) -> bool:
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive for our purposes
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_pid(pid: int, port: int | None = None, timeout_s: float = 15.0) -> bool:
    """Stop a llama-cpp-python server by PID: SIGTERM, then SIGKILL after ``timeout_s`` seconds.

    Returns:
        True if a live server process was stopped; False if none (gone, or the PID is now another process's).
    """
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        _CHILDREN.pop(pid, None)
        return False
    if not _pid_alive(pid) or not _is_our_server(pid, port):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _pid_alive(pid):
        time.sleep(0.1)
    if _pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=timeout_s)
    else:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _pid_alive(pid):
            time.sleep(0.1)
    return True


class ModelServer:
    """One ``python -m llama_cpp.server`` process serving one GGUF on a port (loopback by default).

    Args:
        port: TCP port (1024-65535); it must be free.
        log_path: the server's stdout and stderr (default: ``<gguf>.<port>.log`` beside the GGUF).
        startup_timeout_s: seconds :meth:`start` waits for ``/v1/models``.
        host: the IPv4 address it binds: ``127.0.0.1`` (default), an interface's address, or ``0.0.0.0``.

    Raises:
        InputError: the GGUF does not exist, or the port/alias/n_ctx/host is out of range.
    """

    def __init__(
        self,
        gguf_path: Path,
        port: int,
        model_alias: str,
        n_ctx: int = 4096,
        log_path: Path | None = None,
        startup_timeout_s: float = 120.0,
        n_threads: int | None = None,
        host: str = LOOPBACK_HOST,
    ) -> None:
        self.gguf_path = Path(gguf_path).resolve()
        if not self.gguf_path.is_file():
            raise errors.InputError(f"gguf_path {str(gguf_path)!r} is not a file")
        if not 1024 <= port <= 65535:
            raise errors.InputError(f"port must be in 1024..65535, got {port}")
        if not model_alias or any(c.isspace() for c in model_alias):
            raise errors.InputError(f"model_alias must be a non-empty word, got {model_alias!r}")
        if n_ctx < 16:
            raise errors.InputError(f"n_ctx must be >= 16 tokens, got {n_ctx}")
        self.host = check_bind_host(host)
        self.port = port
        self.model_alias = model_alias
        self.n_ctx = n_ctx
        self.log_path = Path(log_path) if log_path else self.gguf_path.with_name(f"{self.gguf_path.name}.{port}.log")
        self.startup_timeout_s = startup_timeout_s
        self.n_threads = n_threads
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://<host>:PORT/v1`` (``127.0.0.1`` for a server bound to
        every interface: :func:`client_host`)."""
        return f"http://{client_host(self.host)}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        """PID of the server process (None before :meth:`start`)."""
        return self._proc.pid if self._proc is not None else None

    def argv(self) -> list[str]:
        """The server's command line."""
        argv = [
            sys.executable, "-m", SERVER_MODULE,
            "--model", str(self.gguf_path),
            "--host", self.host,
            "--port", str(self.port),
            "--model_alias", self.model_alias,
            "--n_ctx", str(self.n_ctx),
        ]
        if self.n_threads is not None:
            argv += ["--n_threads", str(self.n_threads)]
        return argv

    def start(self) -> "ModelServer":
        """Launch the server and wait until ``/v1/models`` answers 200; returns self.

        Raises:
            ServerStartError: the port is taken, the process exited, or :attr:`ready_url` did not answer within
                ``startup_timeout_s`` (the message carries the log's tail); the process is stopped first.
        """
        if self._proc is not None and self._proc.poll() is None:
            return self
        if _port_is_open(self.port, client_host(self.host)):
            raise errors.ServerStartError(f"port {self.port} on {client_host(self.host)} is already in use")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _CHILDREN[self._proc.pid] = self._proc
        deadline = time.monotonic() + self.startup_timeout_s
        url = self.ready_url
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    _CHILDREN.pop(self._proc.pid, None)
                    raise errors.ServerStartError(
                        f"model server for {self.gguf_path.name} exited with {code} before answering; "
                        f"log {self.log_path}:\n{_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    self.stop()
                    raise errors.ServerStartError(
                        f"model server for {self.gguf_path.name} did not answer {url} within "
                        f"{self.startup_timeout_s:.0f} s; log {self.log_path}:\n{_tail(self.log_path)}"
                    )
                time.sleep(_POLL_INTERVAL_S)
        try:
            self._after_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def ready_url(self) -> str:
        """The URL :meth:`start` polls until it answers 200 (llama-cpp-python has no ``/health``)."""
        return f"{self.base_url}/models"

    def _after_ready(self) -> None:
        """Checks run once the server answers (none here; :class:`forgeflow.serving.backend.LlamaServer`
        reads ``/props``); raising stops the server."""

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the server by PID (SIGTERM, SIGKILL after ``timeout_s``); idempotent."""
        if self._proc is None:
            return
        stop_pid(self._proc.pid, self.port, timeout_s=timeout_s)
        if self._proc.poll() is None:  # not recognisable as ours any more: kill our own child anyway
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout_s)
        _CHILDREN.pop(self._proc.pid, None)

    def log_tail(self) -> str:
        """The last characters of the server log."""
        return _tail(self.log_path)

    def __enter__(self) -> "ModelServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


