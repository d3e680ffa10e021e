"""``forgeflow demo`` as a user runs it (a real process in its own session): a stop signal stops every
process the demo started, Prefect's temporary server included, and the demo says it was stopped.

Regression (new-user trial): SIGTERM to ``forgeflow demo`` left ``python -m uvicorn ...
prefect.server.api.server:create_app`` running, re-parented to PID 1. Prefect stops that server from
an atexit handler, which SIGTERM's default action skips; while a flow runs, Prefect's engine turns
SIGTERM into ``TerminationSignal`` and then re-sends it to the handler it found (the default one).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from forgeflow.common.settings import REPO_ROOT

pytestmark = pytest.mark.integration

SERVER_MARK = "prefect.server.api.server:create_app"
"""In the argv of Prefect's temporary server (``SubprocessASGIServer``: uvicorn)."""
DEMO_REGISTRY_PORTS = (5701, 5702)
"""The demo's registries' fixed loopback ports (its default config; the CLI has no option for them)."""


def _port_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections in TIME_WAIT do not count: the servers reuse the address)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_demo(tmp_path: Path, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "FORGEFLOW_HOME": str(tmp_path / "home"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # so the demo starts Prefect's temporary server
    with log_path.open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "deployments.cli", "demo"], cwd=REPO_ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(demo: subprocess.Popen, log_path: Path, log_line: str | None) -> list[psutil.Process]:
    """The demo's processes once its temporary server exists (and ``log_line`` is in its output)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and demo.poll() is None:
        children = psutil.Process(demo.pid).children(recursive=True)
        servers = [c for c in children if SERVER_MARK in " ".join(_argv(c))]
        if servers and (log_line is None or log_line in log_path.read_text()):
            return children
        time.sleep(0.2)
    raise AssertionError(f"the demo (exit {demo.poll()}) started no temporary Prefect server or did not log "
                         f"{log_line!r} in 300 s:\n{log_path.read_text()[-3000:]}")


def _argv(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stop_and_check(tmp_path: Path, log_path: Path, log_line: str | None) -> None:
    """Start the demo, SIGTERM it at ``log_line``, and check that it exits 143 saying so and that no
    process it had started (captured by PID before the signal) is left."""
    demo = _start_demo(tmp_path, log_path)
    children: list[psutil.Process] = []
    try:
        children = _wait_for(demo, log_path, log_line)
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(timeout=120)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        left = [(c.pid, " ".join(_argv(c))[:120]) for c in children if _alive(c)]
        assert not left, f"processes the demo started outlived it (exit {code}): {left}"
        output = log_path.read_text()
        assert code == 128 + signal.SIGTERM, output[-3000:]
        assert "forgeflow demo stopped by SIGTERM" in output, output[-3000:]
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
        for child in children:  # by PID (psutil checks the start time, so a reused PID is left alone)
            try:
                child.kill()
            except psutil.Error:
                pass


def test_sigterm_while_the_temporary_prefect_server_starts_stops_it(tmp_path: Path) -> None:
    _stop_and_check(tmp_path, tmp_path / "demo.log", None)


def test_sigterm_while_the_lifecycle_flow_runs_stops_every_child_and_a_rerun_works(tmp_path: Path) -> None:
    busy = [port for port in DEMO_REGISTRY_PORTS if not _port_free(port)]
    assert not busy, f"the demo's fixed registry ports {busy} on 127.0.0.1 are held: is another demo running?"
    started = "Beginning subflow run 'environments'"  # after the registries came up
    _stop_and_check(tmp_path, tmp_path / "demo-1.log", started)
    _stop_and_check(tmp_path, tmp_path / "demo-2.log", started)  # the same home again
