"""``forgeflow up --database postgresql://...`` for real: a throwaway PostgreSQL 15 cluster (Debian's
server binaries, tests/pgcluster.py) on 127.0.0.1:5441-5443 holds both the Prefect server's database
and forgeflow's store; the deployments are registered (by ``up``, and ``compare`` again by
``prefect deploy``), a flow run launched through the API
(``run_deployment``) is executed by the process worker, reads its trials from the PostgreSQL store and
reaches Completed, and the run, its state and its artifact are rows in PostgreSQL (read back with
psycopg); ``forgeflow down`` then leaves no process of ours and no open Prefect connection.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from deployments import service
from forgeflow.ledger.records import TrialRecord
from forgeflow.ledger.store import Store
from tests import pgcluster
from tests.helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]



@pytest.fixture(scope="module")
def cluster():
    """A fresh PostgreSQL cluster with the databases ``prefect`` and ``forgeflow``."""
    reason = pgcluster.missing_reason()
    if reason is not None:
        pytest.fail(f"{reason} (scripts/setup.sh installs it)")
    port = free_port()
    with pgcluster.postgres_cluster(port) as pg:
        pg.create_database("prefect")
        pg.create_database("forgeflow")
        yield pg


def _psql(pg, database: str, sql: str, params: tuple = ()) -> list[tuple]:
    import psycopg

    with psycopg.connect(host=pg.host, port=pg.port, user=pg.user, dbname=database) as conn:
        return conn.execute(sql, params).fetchall()


@pytest.fixture(scope="module")
def running(cluster, tmp_path_factory):
    """``forgeflow up --database postgresql://...`` (the CLI) with the store on the same cluster."""
    home = tmp_path_factory.mktemp("pg-svc-home")
    port = free_port()
    store_url = cluster.url("forgeflow", driver="postgresql+psycopg")
    store = Store(store_url)
    store.upgrade()
    for job, rewards in {"a": [1.0, 0.0, 0.0], "b": [1.0, 1.0, 0.0]}.items():
        store.record_trials([TrialRecord(trial_id=f"{job}-{i}", instance_id=f"repo.task__{i}", kind="agent",
                                         job_id=job, reward=r) for i, r in enumerate(rewards)])
    store.dispose()
    env = {k: v for k, v in os.environ.items() if k not in {"PREFECT_API_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL"}}
    env.update(FORGEFLOW_HOME=str(home), PREFECT_HOME=str(home / "prefect"), FORGEFLOW_STORE_URL=store_url,
               PREFECT_WORKER_QUERY_SECONDS="2")  # the worker (and its flow runs) inherit the store URL
    database = cluster.url("prefect")  # plain postgresql://: up rewrites it to the asyncpg driver
    started = time.monotonic()
    try:
        up = subprocess.run([sys.executable, "-m", "deployments.cli", "up", "--port", str(port), "--database", database,
                             "--json"], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        print(f"forgeflow up --database took {time.monotonic() - started:.1f} s")
        yield home, env, service.ServiceState.model_validate_json(up.stdout)
    finally:
        subprocess.run([sys.executable, "-m", "deployments.cli", "down", "--grace-s", "5"], env=env,
                       capture_output=True, text=True, timeout=120)


def test_up_runs_the_prefect_server_on_postgresql(running, cluster):
    home, _, state = running
    assert state.database == f"postgresql+asyncpg://forgeflow@127.0.0.1:{cluster.port}/prefect"
    assert httpx.get(f"{state.api_url}/health", timeout=10).status_code == 200
    assert not (home / "prefect" / "prefect.db").exists(), "the server wrote the SQLite default"
    in_postgres = {f"{flow}/{dep}" for flow, dep in _psql(
        cluster, "prefect", "SELECT f.name, d.name FROM deployment d JOIN flow f ON f.id = d.flow_id")}
    assert {"compare/compare", "freeze/freeze", "lifecycle/lifecycle"} <= in_postgres
    assert in_postgres == set(state.deployments)
    assert _psql(cluster, "prefect", "SELECT type FROM work_pool WHERE name = 'local'") == [("process",)]


def test_prefect_deploy_from_prefect_yaml_updates_the_deployment_without_a_422(running, cluster):
    """``prefect deploy`` of prefect.yaml's ``compare`` deployment against the server: after creating
    or updating a deployment the 3.9.1 CLI asks for the pool's workers with ``"limit": null``, which
    FastAPI >= 0.151 answers with 422 (pyproject pins fastapi below it). One deployment keeps the
    test short; ``--all`` runs the same code once per deployment."""
    from forgeflow.common.settings import REPO_ROOT

    _, env, state = running
    before = dict(_psql(cluster, "prefect", "SELECT name, id FROM deployment"))
    deploy = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--name", "compare"],
                            cwd=REPO_ROOT, env={**env, "PREFECT_API_URL": state.api_url, "FORGEFLOW_REPO": str(REPO_ROOT)},
                            capture_output=True, text=True, timeout=180)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    # an HTTP 422 in the output ("422 Unprocessable Entity"), not the digits inside the deployment's UUID
    # (CI once printed ...-25422d47aada)
    assert not re.search(r"(?<![0-9a-fA-F-])422(?![0-9a-fA-F-])", deploy.stdout + deploy.stderr), deploy.stdout[-3000:]
    assert "Deployment 'compare/compare' successfully" in " ".join(deploy.stdout.split())
    assert dict(_psql(cluster, "prefect", "SELECT name, id FROM deployment")) == before  # updated in place
    pulls = _psql(cluster, "prefect", "SELECT pull_steps FROM deployment WHERE name = 'compare'")
    assert pulls == [([{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO_ROOT)}}],)]


def test_a_run_deployment_run_completes_and_is_recorded_in_postgresql(running, cluster):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home, _, state = running
    report = home / "compare.md"
    with temporary_settings(updates={PREFECT_API_URL: state.api_url}):
        run = run_deployment("compare/compare", timeout=0,  # the compare flow's one CompareParams
                             parameters={"params": {"job_a": "a", "job_b": "b", "report_path": str(report)}})
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        rows = _psql(cluster, "prefect", "SELECT state_type, infrastructure_pid FROM flow_run WHERE id = %s",
                     (run.id,))
        if rows and rows[0][0] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
            break
        time.sleep(2)
    assert rows and rows[0][0] == "COMPLETED", rows
    assert rows[0][1], "not run by the process worker"
    api = httpx.get(f"{state.api_url}/flow_runs/{run.id}", timeout=10).json()
    assert api["state"]["type"] == "COMPLETED" and api["work_pool_name"] == "local"
    # the flow read both jobs from the PostgreSQL store: b vs a is 3 pairs, 1 win, 2 ties, 0 losses
    assert "| 3 | 1 | 2 | 0 |" in report.read_text()
    artifacts = _psql(cluster, "prefect", "SELECT key, type FROM artifact WHERE flow_run_id = %s", (run.id,))
    assert ("compare-standalone", "markdown") in artifacts
    states = [s for (s,) in _psql(cluster, "prefect", "SELECT type FROM flow_run_state WHERE flow_run_id = %s "
                                  "ORDER BY timestamp", (run.id,))]
    assert states[0] == "SCHEDULED" and states[-1] == "COMPLETED" and "RUNNING" in states
    assert _psql(cluster, "forgeflow", "SELECT job_id, count(*) FROM trials GROUP BY job_id ORDER BY job_id") == [
        ("a", 3), ("b", 3)]


def test_down_leaves_no_process_and_no_prefect_connection(running, cluster):
    home, env, state = running
    down = subprocess.run([sys.executable, "-m", "deployments.cli", "down", "--grace-s", "5"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "server: pid" in down.stdout and "worker: pid" in down.stdout
    for proc in (state.server, state.worker):
        assert service.group_members(proc.pid) == [], f"{proc.role} process group {proc.pid} still has members"
    assert not service.port_in_use(state.port)
    assert _psql(cluster, "postgres", "SELECT count(*) FROM pg_stat_activity WHERE datname = 'prefect'") == [(0,)]
    assert not (home / "service" / "service.json").exists()


def test_database_urls_are_rewritten_for_the_server_and_bad_ones_named():
    from forgeflow.common.errors import InputError

    assert service.prefect_database_url("postgresql://u:pw@127.0.0.1:5441/prefect") == (
        "postgresql+asyncpg://u:pw@127.0.0.1:5441/prefect")
    assert service.prefect_database_url("postgresql+psycopg://u@h/db?sslmode=require") == (
        "postgresql+asyncpg://u@h/db?sslmode=require")
    assert service.prefect_database_url("sqlite:////tmp/p.db") == "sqlite+aiosqlite:////tmp/p.db"
    with pytest.raises(InputError, match=r"'mysql' is not supported") as err:
        service.prefect_database_url("mysql://u:secret@h/db")
    assert "secret" not in str(err.value)  # the password never reaches an error message
    with pytest.raises(InputError, match="names no database"):
        service.prefect_database_url("postgresql://u@h:5432")
    with pytest.raises(InputError, match="does not parse"):
        service.prefect_database_url("not a url")
