"""The Prefect UI, checked in a real browser: headless Chromium (Debian package ``chromium``) opens
the pages a user opens after a lifecycle run and the test reads what they render.

``forgeflow up`` (SQLite default) starts the Prefect server, which serves the UI bundled in the
prefect wheel (``prefect/server/ui`` and ``ui-v2``; V2 is the default, under ``/v2``). A small flow
runs against that server with the lifecycle's own artifact code on recorded data (the two canaries'
agent trials of a demo run, ``tests/flows/data/demo_canary_trials.json``): per-stage bookkeeping
with ``flows.stagekit.StageLog`` whose ``finish`` publishes the stage table artifact; the canary stages
record both jobs and their trials in the store (as the canary does), and the compare stage runs the
``compare`` flow on them as a subflow (as flows/lifecycle.py's), which publishes the
``compare-standalone`` markdown artifact. Chromium (``--headless
--no-sandbox``: the tests run as root) is driven over the DevTools protocol, one browser for all
pages, each page read once its single-page app has rendered the expected text (instead of a fixed
``--virtual-time-budget`` per ``--dump-dom`` process). The rendered DOM and a PNG screenshot of each
page are kept under the test's tmp dir (paths printed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.browser import Browser
from deployments import service
from forgeflow.common.settings import REPO_ROOT
from tests.helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA = Path(__file__).parent / "data" / "demo_canary_trials.json"


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """``forgeflow up`` on a fresh FORGEFLOW_HOME / PREFECT_HOME (the SQLite default)."""
    home = tmp_path_factory.mktemp("ui-home")
    port = free_port()
    mp = pytest.MonkeyPatch()
    mp.setenv("FORGEFLOW_HOME", str(home))
    mp.setenv("PREFECT_HOME", str(home / "prefect"))
    mp.delenv("PREFECT_API_URL", raising=False)
    mp.delenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", raising=False)
    (home / "prefect").mkdir()
    started = time.monotonic()
    try:
        state = service.up(home, port=port, pool="local")
        print(f"forgeflow up took {time.monotonic() - started:.1f} s; UI {state.ui_url}")
        yield home, state
    finally:
        service.down(home, grace_s=3)
        mp.undo()


@pytest.fixture
def browser(tmp_path):
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        pytest.fail("Debian package chromium is not installed (scripts/setup.sh installs it)")
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    b = Browser(profile)
    yield b
    b.close()


def _run_demo_flow(out_dir: Path):
    """The lifecycle's stage bookkeeping and compare stage on the recorded canary trials: the canary
    stages record each job and its trials in the store (``settings.store_url()``), the compare stage
    runs the ``compare`` flow on the two jobs as a subflow."""
    from prefect import flow
    from prefect.runtime import flow_run

    from flows.stagekit import StageLog
    from flows.stages import CompareParams
    from flows.stages import compare as compare_flow
    from forgeflow.ledger.records import JobRecord, TaskRecord, TrialRecord
    from forgeflow.ledger.store import Store
    from forgeflow.sandbox.trial import TrialResult

    data = json.loads(DATA.read_text())
    store = Store()
    store.upgrade()
    for instance_id, repo in data["repo_of"].items():  # the freeze's task rows: the repositories
        store.record_task(TaskRecord(instance_id=instance_id, repo=repo, status="accepted"))

    @flow(name="lifecycle-ui-demo")
    def lifecycle_ui_demo() -> dict:
        log = StageLog(out_dir / "summary.json", str(flow_run.get_id()))
        job_ids = {}
        for label in ("baseline", "candidate"):
            with log.stage(f"canary_{label}") as st:
                job_ids[label] = job_id = data["jobs"][label]["job_id"]
                trials = [TrialResult.model_validate(t) for t in data["jobs"][label]["trials"]]
                store.record_job(JobRecord(job_id=job_id, kind="canary", freeze_name="demo-v1", split="test"))
                for t in trials:
                    store.record_trial(TrialRecord.from_trial(t, job_id, None, str(flow_run.get_id())))
                st["counts"] = {"scored": sum(t.reward is not None for t in trials),
                                "reward_1": sum(t.reward == 1.0 for t in trials)}
        with log.stage("compare") as st:  # as flows/lifecycle.py's compare stage
            comparison = compare_flow(CompareParams(job_a=job_ids["baseline"], job_b=job_ids["candidate"],
                                                    report_path=out_dir / "compare.md", merge_recovery=False))
            paired = comparison.paired
            st["counts"] = {"pairs": paired.n_pairs, "wins": paired.wins, "ties": paired.ties,
                            "losses": paired.losses}
        log.finish({"comparison": {"verdict": comparison.decision.verdict}})
        return {"run_id": str(flow_run.get_id()), "jobs": job_ids, "n_pairs": paired.n_pairs,
                "verdict": comparison.decision.verdict, "rows": log.table_rows()}

    return lifecycle_ui_demo()


def test_the_flow_run_and_its_stage_table_and_comparison_report_render_in_chromium(running, browser, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home, state = running
    with temporary_settings(updates={PREFECT_API_URL: state.api_url}):
        result = _run_demo_flow(home)
    run_id = result["run_id"]
    run = httpx.get(f"{state.api_url}/flow_runs/{run_id}", timeout=10).json()
    assert run["state"]["type"] == "COMPLETED"
    # the compare stage's subflow run (the ``compare`` flow) holds the report artifact
    children = httpx.post(f"{state.api_url}/flow_runs/filter", timeout=10, json={
        "flow_runs": {"parent_flow_run_id": {"operator": "and_", "any_": [run_id]}}}).json()
    flows = {f["id"]: f["name"] for f in httpx.post(f"{state.api_url}/flows/filter", timeout=10, json={}).json()}
    compare_runs = [c for c in children if flows.get(c["flow_id"]) == "compare"]
    assert len(compare_runs) == 1 and compare_runs[0]["state"]["type"] == "COMPLETED", children
    compare_run = compare_runs[0]
    artifacts = {a["key"]: a for a in httpx.post(f"{state.api_url}/artifacts/filter", timeout=10, json={
        "artifacts": {"flow_run_id": {"any_": [run_id, compare_run["id"]]}}}).json()}
    assert artifacts["lifecycle-stages"]["flow_run_id"] == run_id
    assert artifacts["compare-standalone"]["flow_run_id"] == compare_run["id"]

    # the flow run pages, Artifacts tab: the run, its state and its artifact listed
    page = browser.open(f"{state.ui_url}/v2/runs/flow-run/{run_id}?tab=Artifacts",
                        [run["name"], "Completed", "lifecycle-stages"], tmp_path / "flow-run")
    assert "Can't connect to Server API" not in page
    browser.open(f"{state.ui_url}/v2/runs/flow-run/{compare_run['id']}?tab=Artifacts",
                 [compare_run["name"], "Completed", "compare-standalone"], tmp_path / "compare-run")

    # the stage table: every stage of summary.json with its status and counts
    rows = result["rows"]
    assert [r["stage"] for r in rows] == ["canary_baseline", "canary_candidate", "compare"]
    browser.open(f"{state.ui_url}/v2/artifacts/artifact/{artifacts['lifecycle-stages']['id']}",
                 [r["stage"] for r in rows] + [r["counts"] for r in rows], tmp_path / "stage-table")
    rendered = browser.tables()
    header = next(cells for cells in rendered if cells[:2] == ["stage", "status"])
    shown = {cells[0]: dict(zip(header, cells)) for cells in rendered if cells and cells[0] in {r["stage"] for r in rows}}
    for r in rows:
        cells = shown[r["stage"]]
        assert (cells["status"], cells["counts"], cells["tasks_run"]) == (r["status"], r["counts"], str(r["tasks_run"]))
    summary = json.loads((home / "summary.json").read_text())
    assert {k: v["status"] for k, v in summary["stages"].items()} == {r["stage"]: r["status"] for r in rows}

    # the comparison report: its headline, the paired table and the promotion verdict, rendered
    jobs = result["jobs"]
    report = browser.open(f"{state.ui_url}/v2/artifacts/artifact/{artifacts['compare-standalone']['id']}",
                          [f"{jobs['candidate']} vs {jobs['baseline']}", f"Paired on {result['n_pairs']} instances scored in both runs",
                           "McNemar exact p", f"Promotion gate: {result['verdict']}"], tmp_path / "compare-report")
    assert "| pairs |" not in report, "the markdown was shown as source, not rendered"
    for repo in sorted(set(json.loads(DATA.read_text())["repo_of"].values())):
        assert repo in report
    assert (tmp_path / "flow-run.png").stat().st_size > 10_000


def _post(url: str, body: dict, budget_s: float = 60.0) -> httpx.Response:
    """POST ``body`` to ``url``, again after a 503 as Prefect's own client does (the server answers 503 while its
    SQLite database is locked by its just-started services, a retryable state, not the UI-port bug checked here)."""
    deadline = time.monotonic() + budget_s
    while True:
        response = httpx.post(url, json=body, timeout=10)
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        time.sleep(1)


def test_forgeflow_ui_on_a_non_default_port_shows_the_flow_runs_of_its_own_server(browser, tmp_path):
    """``forgeflow ui --port P`` (P not 4200): the UI page calls the API on P, so it lists the server's
    flow runs instead of "Can't connect to Server API" (the UI called 127.0.0.1:4200 before)."""
    port = free_port()
    assert port != 4200
    env = {**os.environ, "FORGEFLOW_HOME": str(tmp_path / "home"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for name in ("PREFECT_API_URL", "PREFECT_UI_API_URL", "PREFECT_SERVER_API_PORT",
                 "PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        env.pop(name, None)
    ui = subprocess.Popen([sys.executable, "-m", "deployments.cli", "ui", "--port", str(port)], cwd=REPO_ROOT,
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180
        while ui.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"forgeflow ui --port {port} did not answer {api}/health (exit {ui.poll()})")
        # a flow with one completed run, made through the REST API (no flow engine in this process)
        flow_id = _post(f"{api}/flows/", {"name": "ui-port-check"}).json()["id"]
        run = _post(f"{api}/flow_runs/", {"flow_id": flow_id, "name": "non-default-port-run",
                                          "state": {"type": "COMPLETED", "name": "Completed"}})
        assert run.status_code in (200, 201), run.text
        page = browser.open(f"http://127.0.0.1:{port}/v2/runs", ["non-default-port-run"], tmp_path / "runs")
        assert "Can't connect to Server API" not in page and "Unable to connect to Prefect server" not in page
        ui_settings = httpx.get(f"http://127.0.0.1:{port}/ui-settings", timeout=10).json()
        assert ui_settings["api_url"] == api, ui_settings
    finally:
        os.killpg(ui.pid, 15)
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, 9)
            ui.wait()
