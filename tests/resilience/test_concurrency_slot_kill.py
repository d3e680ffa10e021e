"""kill -9 of a flow process that holds a Prefect global concurrency slot: the slot is not stuck.

How Prefect 3.9.1 frees it (read from its source): ``prefect.concurrency.sync.concurrency`` takes
the slot with a *lease* (``POST /v2/concurrency_limits/increment-with-lease``, ``lease_duration``
seconds, default 300, the server accepts 60 to 86,400) and a background thread renews it every
``0.75 * lease_duration`` (``prefect/concurrency/_leases.py``) while the holder lives. A killed
holder stops renewing; the server's *repossessor* service (``prefect/server/services/
repossessor.py``, every ``PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS``, default 15) revokes
expired leases and decrements the limit's active slots. So the slot is held for at most the lease
time after the last renewal, plus one repossessor loop.

Here: a real ``prefect server start`` on loopback (port 4310-4319, repossessor every 1 s), forgeflow's own registry
limit (``tasks.registry.ensure_registry_limits``, 1 slot), a flow run in a separate process
that takes the slot with the shortest lease the server allows (60 s) and is killed with SIGKILL at
once. The test checks that the slot is held (another acquisition times out) right after the kill,
that it is still held well inside the lease, and that it is free again within the lease time + a
repossessor loop + scheduling margin, measured from the acquisition; then it can be taken again.
(forgeflow's migrate tasks use the default 300 s lease: the same mechanism frees their slot within
~315 s.)

What the lease does not survive is a restart of the Prefect server while a killed holder's lease
is pending: Prefect's default lease storage is the server's memory
(``prefect.server.concurrency.lease_storage.memory``) while the limit's ``active_slots`` is in the
database, so the restarted server has no lease to expire and the slot stays taken for good
(measured: still 1 at 75 s after a 60 s lease). ``forgeflow up`` therefore starts its server with
the file-system lease storage (``deployments/service.py``); ``test_concurrency_slot_restart.py`` checks it.
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

from forgeflow.common.settings import REPO_ROOT
from tests.helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LEASE_S = 60.0  # the server's minimum lease (Body(ge=60) in prefect/server/api/concurrency_limits_v2.py)
REPOSSESSOR_LOOP_S = 1
REGISTRY = "127.0.0.1:5999"
HOLDER = (
    "import sys, time\n"
    "from prefect import flow\n"
    "from prefect.concurrency.sync import concurrency\n"
    "from tasks.registry import ensure_registry_limits\n"
    "@flow(name='slot-holder')\n"
    "def hold(address: str, lease_s: float):\n"
    "    name, _ = ensure_registry_limits(address, 1)\n"
    "    with concurrency(name, occupy=1, lease_duration=lease_s, strict=True):\n"
    "        print('HELD', name, flush=True)\n"
    "        time.sleep(600)\n"
    "hold(sys.argv[1], float(sys.argv[2]))\n"
)


def _healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _active_slots(api_url: str, name: str) -> int:
    response = httpx.get(f"{api_url}/v2/concurrency_limits/{name}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["active_slots"]


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_slot_of_a_killed_holder_is_free_again_within_the_lease_time(tmp_path: Path) -> None:
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings

    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_UI_ENABLED="false", PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS=str(REPOSSESSOR_LOOP_S))
    server_log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
    holder_log = tmp_path / "holder.log"
    holder = None
    try:
        deadline = time.monotonic() + 120
        while not _healthy(api_url):
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prefect server did not answer /health within 120 s"
            time.sleep(0.5)
        with open(holder_log, "w") as log:
            holder = subprocess.Popen([sys.executable, "-u", "-c", HOLDER, REGISTRY, str(LEASE_S)], cwd=REPO_ROOT,
                                      env={**env, "PREFECT_API_URL": api_url}, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        deadline = time.monotonic() + 60
        while "HELD" not in holder_log.read_text():
            assert holder.poll() is None, holder_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the holder flow never took the slot"
            time.sleep(0.05)
        acquired = time.monotonic()
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        name = holder_log.read_text().split("HELD", 1)[1].split()[0]
        assert name == "registry-127.0.0.1-5999"

        assert _active_slots(api_url, name) == 1, "the killed holder's slot must still count as taken"
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            with pytest.raises(TimeoutError):
                with concurrency(name, occupy=1, timeout_seconds=3, lease_duration=LEASE_S, strict=True):
                    pass
        while time.monotonic() - acquired < LEASE_S / 2:
            time.sleep(1)
        assert _active_slots(api_url, name) == 1, "freed before the lease ran out: not the lease at work"

        limit_s = LEASE_S + REPOSSESSOR_LOOP_S + 10  # + scheduling margin on two busy cores
        while _active_slots(api_url, name) != 0:
            assert time.monotonic() - acquired < limit_s, f"slot still held {limit_s:.0f} s after it was taken"
            time.sleep(0.5)
        freed_after_s = time.monotonic() - acquired
        print(f"slot freed {freed_after_s:.1f} s after the killed holder took it (lease {LEASE_S:.0f} s)")
        assert freed_after_s >= LEASE_S - 5
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            with concurrency(name, occupy=1, timeout_seconds=5, lease_duration=LEASE_S, strict=True):
                assert _active_slots(api_url, name) == 1
        assert _active_slots(api_url, name) == 0
    finally:
        if holder is not None:
            _stop_group(holder)
        _stop_group(server)
        server_log.close()
