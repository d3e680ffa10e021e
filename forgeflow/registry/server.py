"""A local container registry: Debian's ``docker-registry`` (distribution 2.8) on 127.0.0.1.

The Debian package's default config enables htpasswd auth on a wrong path and answers 401/400
(measured with docker-registry 2.8.2), so :class:`RegistryServer` writes its own config next to the storage folder:

    <storage_dir.parent>/<name>.config.yml   the config (JSON, which YAML accepts)
    <storage_dir.parent>/<name>.pid          PID of the running server
    <storage_dir.parent>/<name>.log          its stdout/stderr"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from types import TracebackType

from forgeflow.common.errors import InputError, ServerStartError, ToolMissingError
from forgeflow.common.fsutil import atomic_write_text

REGISTRY_BINARY = "docker-registry"
"""The Debian package's binary (``apt install docker-registry``)."""

_LOG_TAIL_LINES = 30


class RegistryServer:
    """One ``docker-registry`` process serving plain HTTP on ``127.0.0.1:<port>``.

    Args:
        port: TCP port on 127.0.0.1 (1024-65535). infra/registries.conf marks 5701-5730 insecure.

    Raises:
        InputError: a bad name or port, or a missing htpasswd file.
    """

    def __init__(
        self,
        name: str,
        port: int,
        storage_dir: Path,
        htpasswd_path: Path | None = None,
    ) -> None:
        if not name or not all(c.isalnum() or c in "_.-" for c in name):
            raise InputError(f"registry name {name!r} must be non-empty [A-Za-z0-9_.-]")
        if not 1024 <= port <= 65535:
            raise InputError(f"registry port {port} is outside 1024-65535")
        if htpasswd_path is not None and not Path(htpasswd_path).is_file():
            raise InputError(f"htpasswd file {htpasswd_path} does not exist")
        self.name = name
        self.port = port
        self.storage_dir = Path(storage_dir).resolve()
        self.htpasswd_path = Path(htpasswd_path).resolve() if htpasswd_path else None
        self._process: subprocess.Popen[bytes] | None = None

    # --- paths and identity -------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, the registry part of image references."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{self.address}"

    @property
    def pid_path(self) -> Path:
        """The pid file, beside the storage folder."""
        return self.storage_dir.parent / f"{self.name}.pid"

    @property
    def log_path(self) -> Path:
        """The server's log file, beside the storage folder."""
        return self.storage_dir.parent / f"{self.name}.log"

    @property
    def config_path(self) -> Path:
        """The generated config file, beside the storage folder."""
        return self.storage_dir.parent / f"{self.name}.config.yml"

    @property
    def pid(self) -> int | None:
        """PID of the live server process this object knows of (pid file), else None."""
        pid = self._read_pid()
        return pid if pid is not None and _is_registry_process(pid) else None

    # --- lifecycle ----------------------------------------------------------------------------
    def config(self) -> dict[str, object]:
        """The distribution config this server runs with (``http.secret`` is a fresh random)."""
        config: dict[str, object] = {
            "version": 0.1,
            "log": {"level": "info", "fields": {"service": "registry", "name": self.name}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage_dir)},
                "delete": {"enabled": True},
                "cache": {"blobdescriptor": "inmemory"},
            },
            "http": {
                "addr": self.address,
                "secret": secrets.token_hex(32),
                "headers": {"X-Content-Type-Options": ["nosniff"]},
            },
        }
        if self.htpasswd_path is not None:
            config["auth"] = {"htpasswd": {"realm": "forgeflow", "path": str(self.htpasswd_path)}}
        return config

    def start(self, timeout_s: float = 30.0) -> RegistryServer:
        """Start the server and wait up to ``timeout_s`` seconds until ``GET /v2/`` answers 200 or 401; returns self.

        Raises:
            ToolMissingError: ``docker-registry`` is not installed.
            ServerStartError: the port is served by another process, the process exited, or it did not answer
                in time (the message holds the log tail).
        """
        binary = shutil.which(REGISTRY_BINARY)
        if binary is None:
            raise ToolMissingError(
                f"{REGISTRY_BINARY} not found on PATH (apt install docker-registry)"
            )
        if self.pid is not None:
            raise ServerStartError(
                f"registry {self.name!r} already runs as PID {self.pid}; use ensure_running()"
            )
        if self._answers():
            raise ServerStartError(
                f"port {self.port} already answers /v2/ from another process; "
                f"registry {self.name!r} cannot bind it"
            )
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_path, json.dumps(self.config(), indent=2) + "\n")
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [binary, "serve", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atomic_write_text(self.pid_path, f"{self._process.pid}\n")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                self._forget()
                raise ServerStartError(
                    f"registry {self.name!r} exited with code {code} "
                    f"on start; log tail:\n{self._log_tail()}"
                )
            if self._answers():
                return self
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(
            f"registry {self.name!r} did not answer {self.url}/v2/ within {timeout_s:.0f} s; "
            f"log tail:\n{self._log_tail()}"
        )

    def ensure_running(self, timeout_s: float = 30.0) -> RegistryServer:
        """Reuse the server from the pid file if it is alive and answers, else start one.

        Raises:
            ToolMissingError, ServerStartError: as :meth:`start`.
        """
        if self.is_ready():
            return self
        if self.pid is not None:  # alive but not answering (starting or wedged): replace it
            self.stop()
        return self.start(timeout_s=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server by PID (SIGTERM, then SIGKILL after ``timeout_s``); no-op if down."""
        pid = self.pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout_s
            while _is_registry_process(pid) and time.monotonic() < deadline:
                self._reap(pid)
                time.sleep(0.05)
            if _is_registry_process(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                while _is_registry_process(pid):
                    self._reap(pid)
                    time.sleep(0.05)
            self._reap(pid)
        self._forget()

    @property
    def instance_id(self) -> str:
        """A random id stored inside ``storage_dir``, created on first use."""
        marker = self.storage_dir / "forgeflow-instance-id"
        if not marker.is_file():
            self.storage_dir.mkdir(parents=True, exist_ok=True)
            try:
                with open(marker, "x", encoding="utf-8") as handle:  # first writer wins
                    handle.write(uuid.uuid4().hex)
            except FileExistsError:
                pass
        return marker.read_text(encoding="utf-8").strip()

    def is_ready(self) -> bool:
        """True if this server's process is alive and answers ``GET /v2/``."""
        return self.pid is not None and self._answers()

    def __enter__(self) -> RegistryServer:
        return self.ensure_running()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RegistryServer(name={self.name!r}, address={self.address!r}, pid={self.pid})"

    # --- helpers -------------------------------------------------------------------------------
    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v2/", timeout=2) as response:
                return response.status == 200
        except urllib.error.HTTPError as err:
            return err.code == 401
        except (urllib.error.URLError, OSError):
            return False

    def _read_pid(self) -> int | None:
        try:
            return int(self.pid_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _reap(self, pid: int) -> None:
        if self._process is not None and self._process.pid == pid:
            self._process.poll()
            return
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass

    def _forget(self) -> None:
        self.pid_path.unlink(missing_ok=True)
        self._process = None

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-_LOG_TAIL_LINES:])


def _is_registry_process(pid: int) -> bool:
    """True if ``pid`` is a live (not zombie) docker-registry process (guards PID reuse)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X") and REGISTRY_BINARY.encode() in cmdline
