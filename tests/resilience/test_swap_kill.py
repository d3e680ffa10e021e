"""kill -9 of a blue/green swap (forgeflow.serving.server) while its new llama-cpp-python server starts.

The swap runs in its own process, as a flow run would; it is killed with SIGKILL once its new
server process exists (between ``stage`` starting it and ``promote`` recording it), so that server
is orphaned. Then the swap is run again in a fresh process. Real servers on free loopback ports;
every server is found by PID and command line and stopped at the end.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from forgeflow.common.fsutil import sha256_file
from forgeflow.serving.backend import BackendConfig
from forgeflow.serving.bluegreen import read_state, stop_active, swap
from forgeflow.serving.health import gate
from forgeflow.serving.server import stop_pid
from tests.helpers import tiny_ggufs
from tests.resilience.conftest import free_port, pid_alive, pids_matching

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_CTX = 512
SWAP_SCRIPT = (
    "import sys; from pathlib import Path; from forgeflow.serving.backend import BackendConfig; "
    "from forgeflow.serving.bluegreen import swap; "
    "r = swap(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], "
    "BackendConfig(ports=(int(sys.argv[4]), int(sys.argv[5])), model_alias='tiny', n_ctx=512)); print('generation', r.current.generation)"
)


def _servers_on(*ports: int) -> list[int]:
    """PIDs of llama-cpp-python servers listening (by command line) on any of ``ports``."""
    return sorted(pid for port in ports for pid in pids_matching("llama_cpp.server", "--port", str(port)))


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[1])


def _swap_process(state: Path, gguf: Path, ports: tuple[int, int]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SWAP_SCRIPT, str(state), str(gguf), sha256_file(gguf), *map(str, ports)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.fixture(scope="module")
def ggufs() -> tuple[Path, Path]:
    """(Q8_0, f16) of the seed-0 tiny model (built once per machine)."""
    return tiny_ggufs()


def test_swap_killed_mid_way_leaves_the_old_server_serving_and_the_rerun_leaves_no_orphan(
    ggufs: tuple[Path, Path], tmp_path: Path
) -> None:
    q8, f16 = ggufs
    state_path = tmp_path / "serving" / "state.json"
    ports = (free_port(), free_port())
    try:
        gen1 = swap(state_path, q8, sha256_file(q8), BackendConfig(ports=ports, model_alias="tiny", n_ctx=N_CTX)).current
        assert _servers_on(*ports) == [gen1.pid]

        # 1. the swap to f16 is killed once its new server process exists (it is still loading)
        victim = _swap_process(state_path, f16, ports)
        deadline = time.monotonic() + 60
        while not (new := [p for p in _servers_on(ports[1]) if _ppid(p) == victim.pid]):
            assert victim.poll() is None, victim.communicate()[0]
            assert time.monotonic() < deadline, "the swap never started its new server"
            time.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        victim.communicate(timeout=30)
        assert victim.returncode == -signal.SIGKILL
        orphan = new[0]

        # the state file is valid and unchanged, the old server still serves; the new one is orphaned
        assert read_state(state_path) == gen1
        assert gate(gen1.base_url, "tiny").passed
        assert pid_alive(orphan) and _ppid(orphan) != victim.pid
        assert _servers_on(*ports) == sorted([gen1.pid, orphan])
        # the orphan finishes loading and holds the idle port (as it would by the time of a rerun)
        deadline = time.monotonic() + 60
        while not _answers(ports[1]):
            assert pid_alive(orphan) and time.monotonic() < deadline, "the orphaned server died"
            time.sleep(0.1)

        # 2. the rerun (a fresh process) completes the swap and leaves exactly the recorded server
        rerun = _swap_process(state_path, f16, ports)
        output = rerun.communicate(timeout=180)[0]
        assert rerun.returncode == 0, output
        assert "generation 2" in output
        gen2 = read_state(state_path)
        assert gen2 is not None and gen2.generation == 2 and gen2.active_port == ports[1]
        assert gen2.gguf_sha256 == sha256_file(f16) and gen2.pid not in (gen1.pid, orphan)
        assert gate(gen2.base_url, "tiny").passed
        assert not pid_alive(orphan) and not pid_alive(gen1.pid)
        assert _servers_on(*ports) == [gen2.pid]  # no orphan llama server on either port
    finally:
        stop_active(state_path)
        for port in ports:
            for pid in _servers_on(port):
                stop_pid(pid, port)
    assert _servers_on(*ports) == []
