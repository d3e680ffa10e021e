"""``forgeflow ui`` as a user runs it (a real process): a real Prefect server comes up on the given
port, SIGTERM to ``forgeflow ui`` stops that server (no orphan keeps the port), and an invalid or
busy port is refused in one line before anything starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from forgeflow.common.settings import REPO_ROOT
from tests.helpers import free_port

pytestmark = pytest.mark.integration


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "FORGEFLOW_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_HOME": str(tmp_path / "prefect")}


def _pids_in_group(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid="], capture_output=True, text=True, check=True).stdout
    return [int(pid) for pid, group in (line.split() for line in out.splitlines()) if int(group) == pgid]


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_sigterm_to_forgeflow_ui_stops_the_prefect_server_it_started(tmp_path) -> None:
    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "deployments.cli", "ui", "--port", str(port)], cwd=REPO_ROOT,
                          env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        healthy = False
        while time.monotonic() < deadline and ui.poll() is None and not healthy:
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(1)
        assert healthy, f"the Prefect server did not answer on port {port}"
        server_groups = {int(g) for pid, g in (line.split() for line in subprocess.run(
            ["ps", "-e", "-o", "ppid=,pgid="], capture_output=True, text=True, check=True).stdout.splitlines())
            if int(pid) == ui.pid}
        assert server_groups, "forgeflow ui started no child process"
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (any(_pids_in_group(g) for g in server_groups) or not _port_free(port)):
            time.sleep(0.5)
        assert not any(_pids_in_group(g) for g in server_groups), "the Prefect server outlived forgeflow ui"
        assert _port_free(port), f"port {port} is still held after forgeflow ui stopped"
    finally:
        if ui.poll() is None:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()


@pytest.mark.parametrize("port", ["0", "70000"])
def test_an_invalid_port_is_refused_in_one_line(tmp_path, port: str) -> None:
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "ui", "--port", port], cwd=REPO_ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [f"error: forgeflow ui: --port must be in 1..65535, got {port}"], done.stderr


def test_a_busy_port_is_refused_in_one_line(tmp_path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "deployments.cli", "ui", "--port", str(port)], cwd=REPO_ROOT,
                              env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert " ".join(done.stderr.split()).startswith(f"error: forgeflow ui: port {port} on 127.0.0.1 is not free")
    assert "Traceback" not in done.stderr + done.stdout
