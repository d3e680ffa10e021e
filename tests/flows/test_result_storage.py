"""Cached results survive their pod when the work pool names a shared result storage block.

Two separate Python processes (tests/flows/cache_pod.py) stand in for two flow-run pods of the
``k8s`` pool: each has its own PREFECT_HOME, working directory and local result storage, both talk
to the one Prefect API of the session harness. They get the result environment the pool's base job
template renders (``PREFECT_RESULTS_PERSIST_BY_DEFAULT``, ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK``),
with the block a ``LocalFileSystem`` on a third directory standing in for shared storage (object
storage or a volume every pod mounts). Pod A runs forgeflow's cached ``compare_stored_jobs`` (the
``compare`` flow's comparison) on two canary jobs this test recorded in a store both pods read (one
``FORGEFLOW_STORE_URL``: the store is not under test, Prefect's result storage is); pod B must get
it as ``Cached``. The control: without the block (each pod its own ``$PREFECT_HOME/storage``), pod B
runs the task again (``Completed``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POD_SCRIPT = Path(__file__).with_name("cache_pod.py")
JOBS = ("pod-baseline", "pod-candidate")


def _record_jobs(store_url: str) -> None:
    """Two canary jobs on one frozen split, three trials each (recorded as the canary records them),
    and the repository of each task, in the store at ``store_url``."""
    from forgeflow.ledger.records import JobRecord, TaskRecord, TrialRecord
    from forgeflow.ledger.store import Store
    from forgeflow.sandbox.trial import TrialResult

    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    rewards = {"six.t1": (1.0, 1.0), "six.t2": (0.0, 1.0), "toolz.t1": (0.0, 1.0)}
    store = Store(store_url)
    store.upgrade()
    for instance_id in rewards:
        store.record_task(TaskRecord(instance_id=instance_id, repo=instance_id.split(".")[0], status="accepted"))
    for n, job_id in enumerate(JOBS):
        store.record_job(JobRecord(job_id=job_id, kind="canary", freeze_name="demo-v1", split="test"))
        for instance_id, pair in rewards.items():
            agent_s = 4.0 / (n + 1)
            store.record_trial(TrialRecord.from_trial(TrialResult(
                trial_id=f"{job_id}-{instance_id}", instance_id=instance_id, kind="agent", reward=pair[n],
                started_at=started, env_setup_s=0.1, agent_s=agent_s, verifier_s=1.0, agent_steps=2,
                input_tokens=100), job_id, None, None))


def _template_result_env(block_slug: str) -> dict[str, str]:
    """The PREFECT_RESULTS_* environment a ``k8s`` flow-run pod gets, rendered by prefect-kubernetes."""
    from deployments import work_pool

    config = work_pool.validate_template(work_pool.base_job_template(work_pool.POOL, block_slug))
    env = config.job_manifest["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if e["name"].startswith("PREFECT_RESULTS_")}


def _run_pod(root: Path, name: str, api_url: str, store_url: str, extra_env: dict[str, str]) -> dict:
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
        "FORGEFLOW_STORE_URL": store_url,  # one store for all pods (what the comparison reads)
        "PYTHONPATH": str(REPO),
        **extra_env,
    }
    done = subprocess.run([sys.executable, str(POD_SCRIPT), *JOBS], cwd=pod / "work", env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cached_task_result_is_found_by_a_second_pod_through_the_storage_block(tmp_path: Path,
                                                                                 prefect_harness,
                                                                                 flow_store_url: str) -> None:
    from prefect.filesystems import LocalFileSystem
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    _record_jobs(flow_store_url)
    shared = tmp_path / "shared-storage"
    block_name = f"forgeflow-results-{uuid.uuid4().hex[:8]}"
    LocalFileSystem(basepath=str(shared)).save(block_name)
    env = _template_result_env(f"local-file-system/{block_name}")
    assert env == {"PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
                   "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": f"local-file-system/{block_name}"}

    a = _run_pod(tmp_path / "shared", "pod-a", api_url, flow_store_url, env)
    assert a["state"] == "Completed"
    assert any(shared.iterdir()), "pod A wrote no result or cache record to the shared storage"
    b = _run_pod(tmp_path / "shared", "pod-b", api_url, flow_store_url, env)
    assert b["state"] == "Cached", b
    assert (b["verdict"], b["reason"]) == (a["verdict"], a["reason"])
    assert a["verdict"] == "hold" and a["reason"].startswith("not enough evidence: 3 pairs < 30")
    assert not any((tmp_path / "shared" / "pod-b" / "prefect" / "storage").glob("*"))  # nothing local in B

    # the control: no block, each pod its own local storage -> pod B cannot see pod A's record
    local = {"PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true"}
    a = _run_pod(tmp_path / "local", "pod-a", api_url, flow_store_url, local)
    assert a["state"] == "Completed"
    assert any((tmp_path / "local" / "pod-a" / "prefect" / "storage").iterdir())  # persisted, but only in A
    b = _run_pod(tmp_path / "local", "pod-b", api_url, flow_store_url, local)
    assert b["state"] == "Completed", b
