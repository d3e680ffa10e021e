"""kill -9 of a flow process holding a Prefect global concurrency slot, then a restart of the Prefect
server started the way ``forgeflow up`` starts it: the slot is still freed when its lease runs out.

With Prefect's default in-memory lease storage the restarted server would have forgotten the
killed holder's lease while the limit's ``active_slots`` (in the database) still counts it: a slot
taken for good (measured on 3.9.1: still taken 75 s after a 60 s lease; see
``test_concurrency_slot_kill.py``). ``deployments.service`` starts the server with the file-system lease
storage (``PREFECT_HOME/concurrency_leases``), so the lease outlives the restart and the server's
repossessor revokes it when it expires. Real server processes on loopback ports 4310-4319, a real
flow run in a separate process, SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deployments import service
from forgeflow.common.settings import REPO_ROOT
from tests.helpers import free_port
from tests.resilience.test_concurrency_slot_kill import HOLDER, LEASE_S, REGISTRY

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _active_slots(api_url: str, name: str) -> int:
    response = httpx.get(f"{api_url}/v2/concurrency_limits/{name}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["active_slots"]


def test_slot_of_a_killed_holder_is_freed_after_a_server_restart(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    for name in [k for k in os.environ if k.startswith("PREFECT_")]:
        monkeypatch.delenv(name)  # the server gets forgeflow's settings, not the test runner's
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    monkeypatch.setenv("PREFECT_SERVER_UI_ENABLED", "false")
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS", "1")
    api_url = f"http://127.0.0.1:{port}/api"
    sdir = service.service_dir(tmp_path)
    server = service._start_server(tmp_path, port, sdir, 120.0)
    holder = None
    try:
        assert dict(p.split("=", 1) for p in Path(f"/proc/{server.pid}/environ").read_bytes().decode(
            errors="replace").split("\0") if "=" in p).get(service.LEASE_STORAGE_ENV) == service.LEASE_STORAGE_FILESYSTEM
        log = tmp_path / "holder.log"
        with open(log, "w") as handle:
            holder = subprocess.Popen([sys.executable, "-u", "-c", HOLDER, REGISTRY, str(LEASE_S)], cwd=REPO_ROOT,
                                      env={**os.environ, "PREFECT_API_URL": api_url}, stdout=handle,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while "HELD" not in log.read_text():
            assert holder.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the holder flow never took the slot"
            time.sleep(0.05)
        acquired = time.monotonic()
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        name = log.read_text().split("HELD", 1)[1].split()[0]

        assert service._stop(server, grace_s=10) in {"terminated", "killed"}
        server = service._start_server(tmp_path, port, sdir, 120.0)  # the restart
        assert _active_slots(api_url, name) == 1, "the slot is still taken after the restart (lease not yet out)"
        assert list((tmp_path / "prefect" / "concurrency_leases").glob("*.json")), "no lease on disk"

        limit_s = LEASE_S + 1 + 10  # lease + one repossessor loop + scheduling margin on two busy cores
        while _active_slots(api_url, name) != 0:
            assert time.monotonic() - acquired < limit_s, (
                f"slot still taken {limit_s:.0f} s after the killed holder took it, across a server restart")
            time.sleep(0.5)
        print(f"slot freed {time.monotonic() - acquired:.1f} s after it was taken (lease {LEASE_S:.0f} s, restart)")
    finally:
        if holder is not None and holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(timeout=10)
        service._stop(server, grace_s=10)
