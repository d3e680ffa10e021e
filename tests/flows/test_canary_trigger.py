"""A successful freeze starts the canary, and a deployment schedule produces scheduled runs, for real:
``forgeflow up`` (a Prefect server on loopback, the ``local`` process pool, every deployment, the
automations, a process worker) on a free loopback port.

* The ``freeze/freeze`` deployment is run through the API on a store holding accepted tasks; the
  worker runs it to Completed, its ``prefect.flow-run.Completed`` event fires the
  ``forgeflow-canary-on-freeze`` automation, and the ``canary/canary`` deployment gets a flow run whose
  ``freeze_name`` is the freeze just written (rendered from the freeze run's ``params.name``). (No model
  is served here, so that canary run ends Failed by its own preflight, naming the missing serving state: the check that it ran our flow.)
* The nightly ``lifecycle`` schedule (paused as shipped) is activated through the client; the
  server's scheduler service creates Scheduled flow runs at the cron's next 02:00 UTC times.
"""

from __future__ import annotations

import time
from datetime import timezone

import httpx
import pytest

from deployments import service
from forgeflow.ledger.records import TaskRecord
from forgeflow.ledger.store import Store
from tests.helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]



@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """``up`` on a fresh FORGEFLOW_HOME/PREFECT_HOME whose store holds 8 accepted tasks of 4 repos."""
    home = tmp_path_factory.mktemp("trigger-home")
    port = free_port()
    mp = pytest.MonkeyPatch()
    mp.setenv("FORGEFLOW_HOME", str(home))
    mp.setenv("PREFECT_HOME", str(home / "prefect"))
    mp.delenv("FORGEFLOW_STORE_URL", raising=False)
    mp.delenv("PREFECT_API_URL", raising=False)
    mp.setenv("PREFECT_WORKER_QUERY_SECONDS", "2")  # the worker polls every 2 s instead of 10
    mp.setenv("PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS", "3")  # the scheduler visits every 3 s, not 60
    (home / "prefect").mkdir()
    store = Store(f"sqlite:///{home / 'store.db'}")
    store.upgrade()
    for repo in range(4):
        for i in range(2):
            store.record_task(TaskRecord(instance_id=f"proj{repo}.func_pm__0000000{i}", repo=f"proj{repo}",
                                         status="accepted", FAIL_TO_PASS=["tests/test_x.py::test_a"]))
    store.dispose()
    try:
        state = service.up(home, port=port, pool="local")
    except BaseException:
        service.down(home, grace_s=3)
        mp.undo()
        raise
    yield home, state
    service.down(home, grace_s=3)
    mp.undo()


def _runs_of(api_url: str, deployment_id: str) -> list[dict]:
    response = httpx.post(f"{api_url}/flow_runs/filter", timeout=10, json={
        "deployments": {"id": {"any_": [deployment_id]}}, "limit": 50, "offset": 0})
    assert response.status_code == 200, response.text
    return response.json()


def _wait(predicate, timeout_s: float, what: str, step_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"{what} within {timeout_s} s")


def _final(api_url: str, run_id: str) -> dict | None:
    run = httpx.get(f"{api_url}/flow_runs/{run_id}", timeout=10).json()
    return run if run["state"] and run["state"]["type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"} else None


def test_completed_freeze_run_starts_the_canary_on_that_freeze(running):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home, state = running
    assert "forgeflow-canary-on-freeze" in state.automations
    canary_id, freeze_id = state.deployments["canary/canary"], state.deployments["freeze/freeze"]
    assert _runs_of(state.api_url, canary_id) == []
    with temporary_settings(updates={PREFECT_API_URL: state.api_url}):
        # params replaces the deployment's whole object: the rest are FreezeParams' defaults (the demo quotas)
        freeze_run = run_deployment("freeze/freeze", parameters={"params": {"name": "trigger-v1"}}, timeout=0)
    run = _wait(lambda: _final(state.api_url, str(freeze_run.id)), 120, "the freeze run did not finish")
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["infrastructure_pid"], "not run by the process worker"
    assert Store(f"sqlite:///{home / 'store.db'}").get_freeze("trigger-v1") is not None

    canary_runs = _wait(lambda: _runs_of(state.api_url, canary_id), 60,
                        "the completed freeze did not start the canary deployment")
    assert len(canary_runs) == 1
    # one params object, its freeze name rendered from the freeze run; the rest: CanaryParams' defaults
    assert canary_runs[0]["parameters"] == {"params": {"freeze_name": "trigger-v1"}}
    ended = _wait(lambda: _final(state.api_url, canary_runs[0]["id"]), 120, "the canary run did not finish")
    assert ended["state"]["type"] == "FAILED" and "no serving state" in ended["state"]["message"], ended["state"]
    assert len(_runs_of(state.api_url, freeze_id)) == 1  # the canary's failure started no other freeze


def test_activated_cron_schedule_produces_scheduled_runs(running):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    _, state = running
    lifecycle_id = state.deployments["lifecycle/lifecycle"]
    assert _runs_of(state.api_url, lifecycle_id) == [], "a paused schedule must not produce runs"
    with temporary_settings(updates={PREFECT_API_URL: state.api_url}), get_client(sync_client=True) as client:
        (schedule,) = client.read_deployment_schedules(lifecycle_id)
        assert schedule.active is False and schedule.schedule.cron == "0 2 * * *"
        client.update_deployment_schedule(lifecycle_id, schedule.id, active=True)
        try:
            runs = _wait(lambda: _runs_of(state.api_url, lifecycle_id), 45,
                         "the active cron schedule produced no scheduled run", step_s=2.0)
        finally:
            client.update_deployment_schedule(lifecycle_id, schedule.id, active=False)
    from datetime import datetime

    assert all(r["state"]["type"] == "SCHEDULED" and r["auto_scheduled"] for r in runs)
    starts = sorted(datetime.fromisoformat(r["expected_start_time"]).astimezone(timezone.utc) for r in runs)
    assert starts[0] > datetime.now(timezone.utc)
    assert all((s.hour, s.minute, s.second) == (2, 0, 0) for s in starts), starts
