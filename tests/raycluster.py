"""A real local Ray cluster for tests: ``ray start --head --block`` (dashboard and job server on
127.0.0.1, free ports, its own temp folder), stopped by PID (the process group of the blocking
``ray start``: SIGTERM, then SIGKILL) and removed afterwards. Ray's ``--block`` keeps every process
it starts (GCS, raylet, dashboard, dashboard agent) under that ``ray start``, so one group holds them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers import free_port

NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
"""The nodes' environment: no usage stats; no token authentication, which Ray 2.60 turns on for every cluster
started once ``~/.ray/auth_token`` exists (a local ``ray.init()`` anywhere on the machine writes it), and the
dashboard would then answer this module's probes 401."""


@dataclass(frozen=True)
class RayCluster:
    """A running head node: its dashboard URL (the Ray job server), GCS address and process group."""

    dashboard_url: str
    address: str
    pgid: int
    temp_dir: Path


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of a blocking ``ray start``, then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if not _group_alive(proc.pid):
            break
        os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    proc.wait(timeout=10)


@dataclass(frozen=True)
class RayNode:
    """A worker node: its process group (kill it with ``os.killpg(node.pgid, SIGKILL)``) and its Ray node id."""

    pgid: int
    node_id: str


@contextmanager
def ray_worker(head: RayCluster, resources: dict[str, float], num_cpus: int = 1,
               startup_timeout_s: float = 120.0, attempts: int = 2,
               env: dict[str, str] | None = None) -> Iterator[RayNode]:
    """Join a worker node to ``head`` (``ray start --address --block --resources``); yield it once the
    cluster lists it alive; stop its process group afterwards (a no-op when a test killed it). ``env`` is
    added to the node's environment (its raylet's and workers': ``CONTAINERS_STORAGE_CONF`` gives the node a
    podman storage of its own, as another machine has).

    A ``ray start`` that exits before its node is listed (Ray gives a raylet 30 s to register, which a
    loaded 2-core machine can miss) is started again, up to ``attempts`` times.

    Raises:
        RuntimeError: the node did not join within ``startup_timeout_s`` (the log's end in the message).
    """
    import json

    ray = Path(sys.executable).with_name("ray")
    known = {n["node_id"] for n in _nodes(head)}
    for attempt in range(1, attempts + 1):
        log_path = head.temp_dir / f"worker-{len(known)}-{attempt}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [str(ray), "start", f"--address={head.address}", "--block", "--node-ip-address=127.0.0.1",
             f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps(resources)}",
             "--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}",
             f"--metrics-export-port={free_port()}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **NODE_ENV, **(env or {})})
        deadline = time.monotonic() + startup_timeout_s
        new: list[dict] = []
        while proc.poll() is None and time.monotonic() < deadline:
            new = [n for n in _nodes(head) if n["node_id"] not in known and n["state"] == "ALIVE"
                   and "node:__internal_head__" not in (n.get("resources_total") or {})]
            if new:
                break
            time.sleep(1)
        if new:
            break
        _stop_group(proc)
        log.close()
        if attempt == attempts:
            raise RuntimeError(f"the Ray worker did not join {head.address}: "
                               f"{log_path.read_text(errors='replace')[-2000:]}")
    try:
        yield RayNode(pgid=proc.pid, node_id=new[0]["node_id"])
    finally:
        _stop_group(proc)
        log.close()


def _nodes(head: RayCluster) -> list[dict]:
    """The cluster's nodes as the dashboard's state API lists them (``node_id``, ``state``)."""
    try:
        body = httpx.get(f"{head.dashboard_url}/api/v0/nodes", params={"limit": 100}, timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return []
    return list(body.get("data", {}).get("result", {}).get("result", []))


@contextmanager
def ray_head(num_cpus: int = 2, startup_timeout_s: float = 180.0) -> Iterator[RayCluster]:
    """Start a Ray head node with the job server; yield it; stop every process of its group.

    Raises:
        RuntimeError: the job server did not answer ``/api/version`` within ``startup_timeout_s``
            (the end of ``ray start``'s output is in the message).
    """
    ray = Path(sys.executable).with_name("ray")
    temp_dir = Path(tempfile.mkdtemp(prefix="ffray-", dir="/tmp"))  # Ray's socket paths must stay short
    gcs_port, dashboard_port = free_port(), free_port()
    log = open(temp_dir / "ray-start.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [str(ray), "start", "--head", "--block", f"--port={gcs_port}", f"--dashboard-port={dashboard_port}",
         "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--num-gpus=0",
         "--include-dashboard=true", "--disable-usage-stats", f"--temp-dir={temp_dir}",
         f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
         f"--ray-client-server-port={free_port()}"],  # not 10001: another head may be running beside this one
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **NODE_ENV})
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited {proc.returncode}: "
                                   f"{(temp_dir / 'ray-start.log').read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(f"{url}/api/version", timeout=2).status_code == 200 and \
                        httpx.get(f"{url}/api/jobs/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray job server {url} did not answer within {startup_timeout_s:g} s: "
                                   f"{(temp_dir / 'ray-start.log').read_text(errors='replace')[-2000:]}")
            time.sleep(1)
        yield RayCluster(dashboard_url=url, address=f"127.0.0.1:{gcs_port}", pgid=proc.pid, temp_dir=temp_dir)
    finally:
        _stop_group(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def node_storage(parent: Path) -> Iterator[dict[str, str]]:
    """A podman storage of a node's own (graph and run roots under ``parent``; this host's images visible
    read-only through ``additionalimagestores``): the environment for :func:`ray_worker`, so the node's
    containers are not this host's podman's to list or remove, as on another machine. Removed afterwards.
    """
    from forgeflow.common.settings import tool_env

    images = subprocess.run(["podman", "info", "--format", "{{.Store.GraphRoot}}"], env=tool_env(), check=True,
                            capture_output=True, text=True).stdout.strip()
    root = Path(tempfile.mkdtemp(prefix="ffnode-", dir=parent))
    conf = root / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{root / "graph"}"\nrunroot = "{root / "run"}"\n'
                    f'[storage.options]\nadditionalimagestores = ["{images}"]\n')
    try:
        yield {"CONTAINERS_STORAGE_CONF": str(conf)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
