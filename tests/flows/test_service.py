"""``forgeflow up`` / ``down`` for real: a Prefect server on loopback, ``prefect deploy --all``, a
process worker, flow runs launched through ``run_deployment`` and through the REST endpoint, the
freeze-ready automation and the failure notification (a webhook block posting to a loopback HTTP
server of the test), then ``down`` leaving no process of ours.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from deployments import service
from forgeflow.ledger.records import TrialRecord
from forgeflow.ledger.store import Store
from tests.flows.test_non_pytest_tasks import F2P, FIX, P2P, UNITTEST, team_rows, unittest_image  # noqa: F401 - fixture
from tests.helpers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CANDIDATE_SET = "candidates-" + "ab" * 16
"""A curate run's candidate set as a freeze-ready event names it (the store holds none of this name)."""


class _Webhook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def webhook():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", _Webhook.received
    server.shutdown()


@pytest.fixture(scope="module")
def running(tmp_path_factory, webhook):
    """``up`` on a fresh FORGEFLOW_HOME/PREFECT_HOME with a store holding two small canary jobs."""
    home = tmp_path_factory.mktemp("svc-home")
    port = free_port()
    mp = pytest.MonkeyPatch()
    mp.setenv("FORGEFLOW_HOME", str(home))
    mp.setenv("PREFECT_HOME", str(home / "prefect"))
    mp.delenv("FORGEFLOW_STORE_URL", raising=False)
    mp.delenv("PREFECT_API_URL", raising=False)
    mp.setenv("PREFECT_WORKER_QUERY_SECONDS", "2")  # the worker polls every 2 s instead of 10
    (home / "prefect").mkdir()
    store = Store(f"sqlite:///{home / 'store.db'}")
    store.upgrade()
    for job, rewards in {"a": [1.0, 0.0, 0.0], "b": [1.0, 1.0, 0.0]}.items():
        store.record_trials([TrialRecord(trial_id=f"{job}-{i}", instance_id=f"repo.task__{i}", kind="agent",
                                         job_id=job, reward=r) for i, r in enumerate(rewards)])
    store.dispose()
    started = time.monotonic()
    try:
        state = service.up(home, port=port, pool="local", notify_url=webhook[0])
    except BaseException:
        service.down(home, grace_s=3)
        mp.undo()
        raise
    print(f"up took {time.monotonic() - started:.1f} s")
    yield home, state
    service.down(home, grace_s=3)
    mp.undo()


def _settings(state):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings(updates={PREFECT_API_URL: state.api_url})


def _run_completed(state, name: str, parameters: dict, timeout_s: float = 400.0) -> dict:
    """Run deployment ``name`` with ``parameters`` through the API of ``up``'s server; wait until it ends and
    check it completed, run by ``up``'s process worker. Returns the flow run as the API reads it."""
    from prefect.deployments import run_deployment

    with _settings(state):
        flow_run = run_deployment(name, parameters=parameters, timeout=0)
    finished = _wait_state(state.api_url, str(flow_run.id), timeout_s=timeout_s)
    assert finished["state"]["type"] == "COMPLETED", (name, finished["state"])
    assert finished["work_pool_name"] == "local" and finished["infrastructure_pid"], "not run by the worker"
    return finished


def _wait_state(api_url: str, flow_run_id: str, timeout_s: float = 150.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = httpx.get(f"{api_url}/flow_runs/{flow_run_id}", timeout=10).json()
        if run["state"] and run["state"]["type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
            return run
        time.sleep(2)
    raise AssertionError(f"flow run {flow_run_id} did not finish within {timeout_s} s: {run['state']}")


def test_up_records_processes_pool_deployments_and_automations(running):
    home, state = running
    assert httpx.get(f"{state.api_url}/health", timeout=10).status_code == 200
    assert service.is_ours(state.server) and service.is_ours(state.worker)
    sdir = home / "service"
    assert int((sdir / "server.pid").read_text()) == state.server.pid
    assert int((sdir / "worker.pid").read_text()) == state.worker.pid
    pool = httpx.get(f"{state.api_url}/work_pools/local", timeout=10).json()
    assert pool["type"] == "process"
    assert {"freeze/freeze", "compare/compare", "lifecycle/lifecycle", "curate/curate"} <= set(state.deployments)
    assert set(state.automations) == {"forgeflow-freeze-on-ready", "forgeflow-canary-on-freeze",
                                      "forgeflow-notify-on-failure"}
    assert state.ui_url == f"http://127.0.0.1:{state.port}"
    # the publish deployment's model store exists: a local folder under FORGEFLOW_HOME
    assert state.model_store == str(home / "model-store")
    block = httpx.get(f"{state.api_url}/block_types/slug/forgeflow-model-store/block_documents/name/"
                      f"{service.MODEL_STORE_BLOCK}", timeout=10).json()
    assert block["data"]["kind"] == "local" and block["data"]["path"] == str(home / "model-store")
    # every forgeflow block type is on the API (the UI's Blocks page offers them), with its fields
    assert set(state.block_types) == {"forgeflow-registry", "forgeflow-sandbox", "forgeflow-serving",
                                      "forgeflow-model-store", "forgeflow-store", "forgeflow-dispatcher"}
    schemas = httpx.post(f"{state.api_url}/block_schemas/filter", timeout=10, json={
        "block_schemas": {"block_type_id": {"any_": [httpx.get(
            f"{state.api_url}/block_types/slug/forgeflow-serving", timeout=10).json()["id"]]}}}).json()
    assert {"kind", "n_parallel", "required_context_tokens", "n_gpu_layers"} <= set(
        schemas[0]["fields"]["properties"])


def test_runs_from_run_deployment_and_rest_complete_and_freeze_ready_triggers_freeze(running, webhook):
    from prefect.deployments import run_deployment
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    home, state = running
    params = {"job_a": "a", "job_b": "b"}  # the compare flow's CompareParams
    quotas = {"train": 5, "validation": 0, "test": 3, "max_per_repo": 7, "min_repos": 2}  # not the deployment's
    with _settings(state):
        api_run = run_deployment("compare/compare",
                                 parameters={"params": {**params, "report_path": str(home / "api.md")}}, timeout=0)
        freeze_runs_before = httpx.post(
            f"{state.api_url}/flow_runs/filter", timeout=10,
            json={"deployments": {"id": {"any_": [state.deployments["freeze/freeze"]]}}}).json()

        async def emit():
            async with get_events_client() as client:
                await client.emit(Event(event="forgeflow.dataset.freeze-ready",
                                        resource={"prefect.resource.id": "forgeflow.store.test"},
                                        payload={"freeze_name": "team-v7", "quotas": quotas, "seed": 3,
                                                 "candidate_set": CANDIDATE_SET, "counts": {"train": 2}}))
        asyncio.run(emit())
    for _ in range(30):  # SQLite busy under concurrent writers answers 503: a REST client retries
        rest = httpx.post(f"{state.api_url}/deployments/{state.deployments['compare/compare']}/create_flow_run",
                          json={"parameters": {"params": {**params, "report_path": str(home / "rest.md")}}},
                          timeout=10)
        if rest.status_code != 503:
            break
        time.sleep(1)
    assert rest.status_code == 201, rest.text

    for run_id, report in ((str(api_run.id), home / "api.md"), (rest.json()["id"], home / "rest.md")):
        run = _wait_state(state.api_url, run_id)
        assert run["state"]["type"] == "COMPLETED", run["state"]
        assert run["work_pool_name"] == "local" and run["infrastructure_pid"], "not run by the process worker"
        assert "| 3 | 1 | 2 | 0 |" in report.read_text()  # pairs, wins, ties, losses of b vs a

    assert freeze_runs_before == []
    deadline = time.monotonic() + 60
    freeze_runs = []
    while not freeze_runs and time.monotonic() < deadline:
        freeze_runs = httpx.post(f"{state.api_url}/flow_runs/filter", timeout=10, json={
            "deployments": {"id": {"any_": [state.deployments["freeze/freeze"]]}}}).json()
        time.sleep(2)
    assert len(freeze_runs) == 1, "the freeze-ready event did not start the freeze deployment"
    # the freeze runs with one params object of what the curate run carried in its event, not the
    # deployment's demo defaults
    assert freeze_runs[0]["parameters"] == {"params": {"name": "team-v7", "quotas": quotas, "seed": 3,
                                                       "candidate_set": CANDIDATE_SET}}
    # the store holds no such candidate set (no curate run recorded it): the freeze fails naming it, notified
    run = _wait_state(state.api_url, freeze_runs[0]["id"])
    assert run["state"]["type"] == "FAILED"
    assert f"the store holds no candidate set {CANDIDATE_SET!r}" in run["state"]["message"], run["state"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(freeze_runs[0]["id"] in m.get("body", "") for m in webhook[1]):
        time.sleep(1)
    messages = [m for m in webhook[1] if freeze_runs[0]["id"] in m.get("body", "")]
    assert messages and messages[0]["subject"] == "forgeflow: flow run failed", webhook[1]
    assert "of flow freeze failed" in messages[0]["body"]


def test_a_team_runs_the_model_deployments_on_its_checkpoint_folder_and_llama_server(running, tmp_path):
    """What a team does first with its own model, through the deployments ``up`` registered and the process
    worker: ``base-model`` on a checkpoint folder, ``package`` of that folder, ``sft-burst`` on it (2 steps),
    ``serve`` of its Q8_0 on a ``forgeflow-serving`` block of llama.cpp's llama-server with 2 slots. Each run
    completes, the store traces the served GGUF and the adapter to the folder, and the server answers with
    the block's slots."""
    import shutil

    from blocks.core import ServingBackend
    from forgeflow.common.fsutil import sha256_file, sha256_tree
    from forgeflow.packaging.lineage import lineage_of
    from forgeflow.serving import bluegreen
    from forgeflow.serving.llama_server import ensure_llama_server
    from tests.helpers import tiny_ggufs

    home, state = running
    ensure_llama_server()  # the cached CPU build
    folder = tmp_path / "team-checkpoint"
    shutil.copytree(tiny_ggufs()[0].parent / "hf", folder)
    ports = [free_port(), free_port()]

    with _settings(state):
        ServingBackend(kind="llama-server", ports=tuple(ports), n_ctx=2048, n_parallel=2, n_threads=2,
                       required_context_tokens=1000).save("team-two-slots", overwrite=True)
    _run_completed(state, "base-model/base-model", {"params": {"source": {"local_dir": str(folder)}}})
    _run_completed(state, "package/package", {"params": {
        "hf_dir": str(folder), "out_dir": str(tmp_path / "gguf"), "quantizations": ["Q8_0"]}})
    store = Store(f"sqlite:///{home / 'store.db'}")
    try:
        q8 = next(a for a in store.model_artifacts() if a.kind == "gguf" and a.quantization == "Q8_0")
        assert lineage_of(store, q8.sha256).chain[0].sha256 == sha256_tree(folder)  # the folder is the root
        # an SFT burst on the same folder: the adapter's lineage starts at the folder
        samples = tmp_path / "chats.jsonl"
        samples.write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"add(2, {n}) returns {2 - n}; fix it"},
            {"role": "assistant", "content": "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n"
                                             "-    return a - b\n+    return a + b\n"}]}) + "\n" for n in range(4)))
        _run_completed(state, "sft-burst/sft-burst", {"params": {
            "hf_dir": str(folder), "samples_jsonl": str(samples), "out_dir": str(tmp_path / "models"),
            "training": {"max_steps": 2}}})
        adapter = next(a for a in store.model_artifacts() if a.kind == "adapter")
        assert [p.parent_sha256 for p in store.producers(adapter.sha256)] == [sha256_tree(folder)]
        _run_completed(state, "serve/serve", {"params": {
            "gguf_path": q8.path, "block": "team-two-slots",
            "state_path": str(tmp_path / "serving" / "state.json")}})
        serving = bluegreen.read_state(tmp_path / "serving" / "state.json")
        try:
            assert serving.gguf_sha256 == sha256_file(q8.path) and serving.active_port in ports
            props = httpx.get(f"http://127.0.0.1:{serving.active_port}/props", timeout=10).json()
            assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (2, 1024)
            assert [(g.generation, g.status) for g in store.serving_generations()] == [(1, "active")]
        finally:
            bluegreen.stop_active(tmp_path / "serving" / "state.json")
    finally:
        store.dispose()


def test_a_team_curates_freezes_and_canaries_its_unittest_rows_through_the_deployments(running, unittest_image,
                                                                                      tmp_path):
    """A team's own tasks through the deployments ``up`` registered, run by the process worker: a JSONL of
    SWE-bench-format rows whose tests are unittest (read by SWE-bench's ``parse_log_django`` through a
    per-repository test specification) goes to ``curate``; its freeze-ready event makes the freeze-on-ready
    automation run ``freeze`` with the curate run's name, quotas and candidates; ``canary`` then grades a
    model's fix on the frozen test split (the model: the scripted OpenAI-compatible loopback server that
    replays the fix, since the tiny model cannot fix a bug on demand)."""
    from test_agent_supervision import scripted_endpoint, text_answer

    home, state = running
    rows = team_rows(unittest_image)
    path = tmp_path / "team.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    source = {"candidates_path": str(path), "test_specs": {"team/alpha": UNITTEST, "team/beta": UNITTEST}}
    quotas = {"train": 1, "validation": 0, "test": 1, "max_per_repo": 2, "min_repos": 2}

    _run_completed(state, "curate/curate", {"params": {
        "source": source, "quotas": quotas, "freeze_name": "team-unittest-v1",
        "settings": {"batch_size": 4, "concurrency": 2, "verifier_timeout_s": 120}}})
    store = Store(f"sqlite:///{home / 'store.db'}")
    try:
        accepted = {t.instance_id: t for t in store.accepted_tasks() if t.repo.startswith("team/")}
        assert sorted(accepted) == sorted(r["instance_id"] for r in rows)
        assert all(t.FAIL_TO_PASS == [F2P] and t.PASS_TO_PASS == [P2P] for t in accepted.values())  # unittest's ids

        deadline, freeze_runs = time.monotonic() + 120, []
        while not freeze_runs and time.monotonic() < deadline:
            freeze_runs = [r for r in httpx.post(f"{state.api_url}/flow_runs/filter", timeout=10, json={
                "deployments": {"id": {"any_": [state.deployments["freeze/freeze"]]}}}).json()
                if r["parameters"]["params"]["name"] == "team-unittest-v1"]
            time.sleep(2)
        assert len(freeze_runs) == 1, "the curate run's freeze-ready event did not start the freeze deployment"
        assert freeze_runs[0]["parameters"]["params"]["quotas"] == quotas
        from forgeflow.curation.run_reads import candidate_set_ids  # the event names the run's candidates

        assert candidate_set_ids(store.engine, freeze_runs[0]["parameters"]["params"]["candidate_set"]) == sorted(
            r["instance_id"] for r in rows)
        assert _wait_state(state.api_url, freeze_runs[0]["id"], timeout_s=300)["state"]["type"] == "COMPLETED"
        assert [f.name for f in store.freezes() if f.name == "team-unittest-v1"] == ["team-unittest-v1"]

        with scripted_endpoint(lambda i: text_answer(FIX)) as (url, bodies):
            _run_completed(state, "canary/canary", {"params": {
                "freeze_name": "team-unittest-v1", "source": source, "job_id": "team-unittest-fixed",
                "endpoint": {"base_url": url, "model_sha256": "e" * 64}, "out_dir": str(tmp_path / "canary"),
                "run": {"verifier_timeout_s": 120.0,
                        "agent_config": {"step_limit": 5, "agent_timeout_s": 120, "memory_mb": 512}}}})
        trials = store.trials_for(job_id="team-unittest-fixed")
        assert len(trials) == 2 and all(t.reward == 1.0 for t in trials), trials  # the test split: 2 tasks
        assert all(t.verifier["run"]["log_parser"] == "parse_log_django" for t in trials)
        assert any("add(2, 3) returns -1 instead of 5" in json.dumps(body["messages"]) for body in bodies)
    finally:
        store.dispose()


def test_a_team_migrates_and_plans_its_images_on_its_registries_through_the_deployments(running, tmp_path):
    """The registry deployments on a team's own registries, named by ``forgeflow-registry`` blocks (the target
    with htpasswd credentials in the block): ``migrate-images`` copies an environment image with its digest
    and records it; ``prewarm-plan`` plans the team's tasks from a JSONL over the shard repositories and
    writes its histogram. Both run by the process worker ``up`` started."""
    import crypt  # deprecated in 3.11, still present; bcrypt for htpasswd

    from pydantic import SecretStr

    from blocks.core import RegistryEndpoint
    from forgeflow.registry.server import RegistryServer
    from forgeflow.registry.skopeo import Skopeo
    from tests.helpers import oci_image

    home, state = running
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(f"mover:{crypt.crypt('team-pw-1', crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n")
    servers = [RegistryServer("team-src", free_port(), tmp_path / "src"),
               RegistryServer("team-dst", free_port(), tmp_path / "dst", htpasswd_path=htpasswd)]
    try:
        for server in servers:
            server.start()
        source, target = (server.address for server in servers)
        digest = Skopeo(retry_times=0).copy(oci_image(tmp_path / "oci", "1", os.urandom(4_000)),
                                           f"docker://{source}/env/team:1")
        with _settings(state):
            RegistryEndpoint(address=source).save("team-src", overwrite=True)
            RegistryEndpoint(address=target, username="mover", password=SecretStr("team-pw-1")).save(
                "team-dst", overwrite=True)

        migrated = _run_completed(state, "migrate-images/migrate", {"params": {
            "source": "team-src", "target": "team-dst", "images": ["env/team:1"]}}, timeout_s=300)
        assert "team-pw-1" not in json.dumps(migrated["parameters"])
        store = Store(f"sqlite:///{home / 'store.db'}")
        try:
            row = store.get_image(f"{target}/env/team:1")
            assert row is not None and row.status == "completed" and row.digest == digest
        finally:
            store.dispose()
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"task_id": f"team__calc-{n}", "base_digest": digest}) + "\n"
                                 for n in range(12)))
        plot = tmp_path / "plan.png"
        _run_completed(state, "prewarm-plan/prewarm-plan", {"params": {
            "tasks_path": str(tasks), "shards": 4, "lanes": 2, "prefix": "team/task", "tag_cap": 20,
            "plot_path": str(plot)}}, timeout_s=300)
        assert plot.read_bytes().startswith(b"\x89PNG")
    finally:
        for server in servers:
            server.stop()


def test_a_ppo_deployment_run_killed_by_the_os_leaves_no_ray_job_running(running, tmp_path):
    """A ``ppo`` deployment run whose flow-run process is killed (SIGKILL: no handler of its own runs) is marked
    Crashed by the process worker, whose runner then calls the flow's ``on_crashed`` hook by keyword
    (``flow=``, ``flow_run=``, ``state=``): the hook stops the run's Ray job on the local cluster, and says so
    in the run's log."""
    import signal

    from prefect.deployments import run_deployment

    from tests.flows.test_ppo_flow import _entrypoint, wait_first_step, wait_stopped
    from tests.flows.test_ppo_flow import _settings as ppo_settings
    from tests.raycluster import ray_head

    _, state = running
    checkpoints = tmp_path / "ckpt"
    job_id = f"ff-ppo-kill-{os.getpid()}"
    with ray_head(num_cpus=1) as cluster:
        params = {"settings": ppo_settings(tmp_path, checkpoints), "submission_id": job_id,
                  "job": {"dashboard_url": cluster.dashboard_url, "entrypoint": _entrypoint(checkpoints, 5, 30.0),
                          "poll_s": 0.5}}
        with _settings(state):
            flow_run = run_deployment("ppo/ppo", parameters={"params": params}, timeout=0)
        wait_first_step(cluster.dashboard_url, job_id, checkpoints, 240)
        run = httpx.get(f"{state.api_url}/flow_runs/{flow_run.id}", timeout=10).json()
        pid = int(str(run["infrastructure_pid"]).rsplit(":", 1)[-1])
        os.kill(pid, signal.SIGKILL)
        ended = _wait_state(state.api_url, str(flow_run.id), timeout_s=120)
        assert ended["state"]["type"] == "CRASHED", ended["state"]
        wait_stopped(cluster.dashboard_url, job_id, 90)
        assert not (checkpoints / "global_step_5").exists()
        said = f"Ray job {job_id} at {cluster.dashboard_url}: STOPPED"
        deadline = time.monotonic() + 60
        while True:  # the runner ships the hook's log lines in batches
            logs = httpx.post(f"{state.api_url}/logs/filter", timeout=10,
                              json={"logs": {"flow_run_id": {"any_": [str(flow_run.id)]}}}).json()
            messages = [entry["message"] for entry in logs]
            if any(said in m for m in messages) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert any(said in m for m in messages), messages[-10:]
        assert not any("error was encountered while running hook" in m for m in messages), messages[-10:]


def test_second_up_reuses_the_running_processes(running, webhook):
    home, state = running
    again = service.up(home, port=state.port, pool="local", notify_url=webhook[0])
    assert set(again.reused) == {"server", "worker"}
    assert (again.server.pid, again.worker.pid) == (state.server.pid, state.worker.pid)
    assert again.deployments == state.deployments
    names = [a["name"] for a in httpx.post(f"{state.api_url}/automations/filter", json={}, timeout=10).json()]
    assert sorted(names) == ["forgeflow-canary-on-freeze", "forgeflow-freeze-on-ready", "forgeflow-notify-on-failure"]


def test_down_stops_everything_it_started_and_nothing_else(running):
    home, state = running
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        reports = service.down(home, grace_s=10)
        assert {(r.role, r.pid) for r in reports} == {("server", state.server.pid), ("worker", state.worker.pid)}
        assert all(r.outcome in {"terminated", "killed"} for r in reports), reports
        for pid in (state.server.pid, state.worker.pid):
            assert service.group_members(pid) == [], f"process group {pid} still has members"
        assert not service.port_in_use(state.port)
        assert not any((home / "service" / n).exists() for n in ("server.pid", "worker.pid", "service.json"))
        # a recorded PID now running something else is left alone
        fake = service.ServiceState(port=state.port, pool="local", api_url=state.api_url, ui_url=state.ui_url,
                                    server=service.ManagedProcess(role="server", pid=bystander.pid,
                                                                  argv=state.server.argv, log_path="x"))
        (home / "service" / "service.json").write_text(fake.model_dump_json())
        assert [r.outcome for r in service.down(home)] == ["not ours (left alone)"]
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    assert os.path.isdir(home / "service")


def test_cli_up_prints_the_ui_address_and_down_stops_it(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"PREFECT_API_URL", "FORGEFLOW_STORE_URL"}}
    env.update(FORGEFLOW_HOME=str(tmp_path), PREFECT_HOME=str(tmp_path / "prefect"))
    try:
        up = subprocess.run([sys.executable, "-m", "deployments.cli", "up", "--port", str(port)], env=env,
                            capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"Prefect UI: http://127.0.0.1:{port}" in up.stdout
        assert f"forgeflow store: sqlite:///{tmp_path}/store.db" in up.stdout.replace("\n", "")  # rich wraps
        state = service.read_state(tmp_path)
        assert service.is_ours(state.server) and service.is_ours(state.worker)
        assert "forgeflow-notify-on-failure" not in state.automations  # no webhook URL given
        status = subprocess.run([sys.executable, "-m", "deployments.cli", "status", "--json"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["last_lifecycle"] is None  # nothing has run yet
        reported = json.loads(status.stdout)["service"]
        assert reported["ui_url"] == f"http://127.0.0.1:{port}" and reported["pool"] == "local"
        assert reported["server_running"] and reported["worker_running"]
        assert "lifecycle/lifecycle" in reported["deployments"]
    finally:
        down = subprocess.run([sys.executable, "-m", "deployments.cli", "down", "--grace-s", "5"], env=env,
                              capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "server: pid" in down.stdout and "worker: pid" in down.stdout
    assert not service.port_in_use(port)
    assert all(service.group_members(p.pid) == [] for p in (state.server, state.worker))
