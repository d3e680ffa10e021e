"""``python -m benchmarks.registry`` runs end to end on a reduced workload and prints its JSON.

Real registries (docker-registry on 127.0.0.1:5740/5741, the latency proxy on 5742) and real
skopeo; the figures are not asserted against their targets here (a 2-core machine under test load
says nothing about them), only that every figure the benchmark promises is measured and sane.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_registry_benchmark_prints_every_figure() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.registry", "--images", "2", "--rounds", "1", "--shards", "10",
         "--sized-mb", "1", "--registry-latency-ms", "5"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert 0 < summary["plan_50k_s"] < 30
    # the flows imported, as in a flow-run process: ~130 MB (Prefect alone ~80 MB; statsmodels left the
    # compare path's imports on 2026-12-07, ~20 MB less)
    assert summary["flow_process_rss_mb"] > 110
    for key in ("copy_overhead_ratio", "copy_overhead_median_ratio", "copy_overhead_ratio_tiny",
                "copy_overhead_ratio_flow_process",
                "prewarm_parallel_speedup", "prewarm_parallel_speedup_loopback"):
        assert 0.2 < summary[key] < 20, (key, summary)
    assert summary["prewarm_registry_latency_ms"] == 5 and summary["prewarm_shards"] == 10
    # 10 repositories, each copy a few requests 5 ms apart: serial can't beat 10 x 2 x 5 ms
    assert summary["prewarm_serial_s"] > 0.1
    assert any("registry 5 ms away" in line for line in lines), lines


def test_registry_benchmark_refuses_bad_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.registry", "--registry-latency-ms", "-1"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2 and "--registry-latency-ms" in proc.stderr


_ROOT = Path(__file__).resolve().parents[2]


def _answers(port: int) -> bool:
    """True when ``GET http://127.0.0.1:PORT/v2/`` gets any HTTP answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def test_registry_benchmark_sigterm_stops_registries_and_removes_its_folder() -> None:
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("forgeflow-bench-*"))
    assert not _answers(5740) and not _answers(5741), "ports 5740/5741 are busy before the test"
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.registry", "--images", "2", "--rounds", "1", "--shards", "10",
         "--sized-mb", "1", "--registry-latency-ms", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_ROOT,
    )
    try:
        deadline = time.monotonic() + 40
        while not (_answers(5740) and _answers(5741)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the benchmark's registries never answered"
            time.sleep(0.1)
        ours = [path for path in set(tmp.glob("forgeflow-bench-*")) - before if (path / "source").exists()]
        assert len(ours) == 1, ours
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not _answers(5740) and not _answers(5741)
    assert not ours[0].exists()


def test_registry_benchmark_busy_port_is_one_error_line() -> None:
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", 5740))
        squatter.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.registry", "--images", "1", "--rounds", "1", "--shards", "5",
             "--sized-mb", "1"],
            capture_output=True, text=True, timeout=60, cwd=_ROOT,
        )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ") and "5740" in proc.stderr
