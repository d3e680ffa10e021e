"""Cached results survive their pod when the work pool names a shared result storage block.

Two separate Python processes (tests/flows/cache_pod.py) stand in for two flow-run pods of the
``k8s`` pool: each has its own PREFECT_HOME, working directory and local result storage, both talk
to the one Prefect API of the session harness. They get the result environment the pool's base job
template renders (``PREFECT_RESULTS_PERSIST_BY_DEFAULT``, ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK``),
with the block a ``LocalFileSystem`` on a third directory standing in for shared storage (object
storage or a volume every pod mounts). Pod A runs forgeflow's cached ``compare_jobs``; pod B must get
it as ``Cached``. The control: without the block (each pod its own ``$PREFECT_HOME/storage``), pod B
runs the task again (``Completed``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POD_SCRIPT = Path(__file__).with_name("cache_pod.py")


def _template_result_env(block_slug: str) -> dict[str, str]:
    """The PREFECT_RESULTS_* environment a ``k8s`` flow-run pod gets, rendered by prefect-kubernetes."""
    from deployments import work_pool

    config = work_pool.validate_template(work_pool.base_job_template(work_pool.POOL, block_slug))
    env = config.job_manifest["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if e["name"].startswith("PREFECT_RESULTS_")}


def _run_pod(root: Path, name: str, api_url: str, extra_env: dict[str, str]) -> dict:
    """Run cache_pod.py as pod ``name`` under ``root/name`` (its own home, cwd and local storage)."""
    pod = root / name
    (pod / "work").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FORGEFLOW_"))}
    env |= {
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(pod / "prefect"),
        "PREFECT_LOCAL_STORAGE_PATH": str(pod / "prefect" / "storage"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "FORGEFLOW_HOME": str(pod / "forgeflow"),
        "PYTHONPATH": str(REPO),
        **extra_env,
    }
    done = subprocess.run([sys.executable, str(POD_SCRIPT)], cwd=pod / "work", env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cached_task_result_is_found_by_a_second_pod_through_the_storage_block(tmp_path: Path,
                                                                                 prefect_harness) -> None:
    from prefect.filesystems import LocalFileSystem
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    shared = tmp_path / "shared-storage"
    block_name = f"forgeflow-results-{uuid.uuid4().hex[:8]}"
    LocalFileSystem(basepath=str(shared)).save(block_name)
    env = _template_result_env(f"local-file-system/{block_name}")
    assert env == {"PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
                   "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": f"local-file-system/{block_name}"}

    a = _run_pod(tmp_path / "shared", "pod-a", api_url, env)
    assert a["state"] == "Completed"
    assert any(shared.iterdir()), "pod A wrote no result or cache record to the shared storage"
    b = _run_pod(tmp_path / "shared", "pod-b", api_url, env)
    assert b["state"] == "Cached", b
    assert (b["verdict"], b["reason"]) == (a["verdict"], a["reason"])
    assert not any((tmp_path / "shared" / "pod-b" / "prefect" / "storage").glob("*"))  # nothing local in B

    # the control: no block, each pod its own local storage -> pod B cannot see pod A's record
    local = {"PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true"}
    a = _run_pod(tmp_path / "local", "pod-a", api_url, local)
    assert a["state"] == "Completed"
    assert any((tmp_path / "local" / "pod-a" / "prefect" / "storage").iterdir())  # persisted, but only in A
    b = _run_pod(tmp_path / "local", "pod-b", api_url, local)
    assert b["state"] == "Completed", b
