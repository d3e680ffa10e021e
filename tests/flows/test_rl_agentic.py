"""The ``rl-burst`` flow's agentic mode (``episode`` block) with the seed-0 tiny model as the policy, on the calc
task's real image under podman: the episodes run in containers (none left after), their trajectories are saved
under the run, the episode table artifact counts them per step and a plot of reward and turns per step sits beside it. The tiny model samples noise (no command, a
format error each turn: reward 0 for every episode), so every group's rewards are equal and the flow refuses to
record an adapter that learned nothing, as for single-turn bursts. A run cancelled mid-episode (its process
killed, then its ``on_cancellation`` hook as Prefect's runner calls it) leaves no episode container."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forgeflow.common.settings import tool_env
from forgeflow.ledger.store import Store
from forgeflow.training.health import BurstHealthError
from tests.adversarial.calc_task import (
    BUGGY_CALC,
    CONFTEST,
    ENV_TEST,
    F2P,
    P2P,
    TASK_IMAGE,
    TEST_COMMAND,
    TESTS,
    build_task_image,
)
from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def calc_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One RL task row of the calc task's image (a JSONL file)."""
    tmp = tmp_path_factory.mktemp("calc")
    image = build_task_image(tmp, TASK_IMAGE, {
        "calc.py": BUGGY_CALC, "tests/test_calc.py": TESTS, "tests/test_env.py": ENV_TEST, "conftest.py": CONFTEST})
    tasks = tmp / "tasks.jsonl"
    tasks.write_text(json.dumps({"instance_id": "calc-add", "image_ref": image, "problem_statement": "test_add fails",
                                 "test_command": TEST_COMMAND, "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P,
                                 "task_timeout_s": 240.0}) + "\n")
    return tasks


def test_an_agentic_rl_burst_runs_episodes_in_podman_and_tables_them(
        prefect_harness, flow_store_url: str, calc_tasks: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.deployments import run_deployment
    from prefect.flow_engine import run_flow

    from deployments.register import build_deployments
    from flows.training import RLBurstParams, rl_burst
    from forgeflow.training.episodes import EpisodeSettings
    from forgeflow.training.rl import RLBurstConfig

    home = tmp_path / "home"
    monkeypatch.setenv("FORGEFLOW_HOME", str(home))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    Store().upgrade()
    params = RLBurstParams(hf_dir=tiny_ggufs()[0].parent / "hf", tasks_jsonl=calc_tasks,
                           training=RLBurstConfig(max_steps=1, num_generations=2, max_completion_length=16,
                                                  verifier_timeout_multiplier=0.5,
                                                  episode=EpisodeSettings(max_turns=2, concurrency=2, memory_mb=256,
                                                                          wall_s=120, create_concurrency=1)))
    # as a user triggers it: the registered rl-burst deployment (deployments/register.py, as prefect.yaml), its
    # parameters as JSON through the API, checked against the run form's schema, then run as a worker runs it
    (deployment,) = [d for d in build_deployments() if d.name == "rl-burst"]
    with get_client(sync_client=True) as client:  # the run form: one plain line beside each episode field
        form = client.read_deployment(deployment.apply()).parameter_openapi_schema
    described = {k: f.get("description") for k, f in form["definitions"]["EpisodeSettings"]["properties"].items()}
    assert "create_concurrency" in described and all(d and "\n" not in d and len(d) < 200 for d in described.values())
    given = {"params": params.model_dump(mode="json", exclude_defaults=True)}
    flow_run = run_deployment("rl-burst/rl-burst", parameters=given, timeout=0)
    assert flow_run.parameters == given
    state = run_flow(rl_burst, flow_run=flow_run, return_type="state")
    assert state.is_failed() and "nothing learned" in str(state.message), state
    with pytest.raises(BurstHealthError):
        state.result()
    with get_client(sync_client=True) as client:
        ours = ArtifactFilterFlowRunId(any_=[flow_run.id])
        (table,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["rl-burst-episodes"]), flow_run_id=ours))
        (plot,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["rl-burst-episodes-plot"]), flow_run_id=ours))
    (row,) = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert "data:image/png;base64," in plot.data and "2 episode(s): 0 resolved" in plot.data
    assert (row["episodes"], row["unresolved"], row["exceptions"], row["end reasons"]) == (2, 2, 0, "max_turns 2")
    assert row["turns"] == 4 and row["policy tokens"] > 0 and row["ray nodes"] == "-"
    (run_dir,) = (home / "models" / "rl-episodes").iterdir()
    trajectories = sorted((run_dir / "step-0001").glob("*.traj.json"))
    assert (run_dir / "episodes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(trajectories) == 2 and all(json.loads(t.read_text())["info"]["forgeflow"]["reward"] == 0.0
                                          for t in trajectories)
    left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", "name=ff-episode"],
                          env=tool_env(), capture_output=True, text=True, check=True).stdout.split()
    assert left == []


RUN = """
import sys
from pathlib import Path
from flows.training import RLBurstParams, rl_burst
from forgeflow.training.episodes import EpisodeSettings
from forgeflow.training.rl import RLBurstConfig
rl_burst(RLBurstParams(hf_dir=Path(sys.argv[1]), tasks_jsonl=Path(sys.argv[2]),
         training=RLBurstConfig(max_steps=1, num_generations=2, max_completion_length=16, verifier_timeout_multiplier=0.5,
                                episode=EpisodeSettings(max_turns=200, max_tokens=60000, concurrency=2, memory_mb=256,
                                                        wall_s=300))))
"""


def _labelled() -> dict[str, str]:
    """Name -> flow run of the episode containers a flow run labelled."""
    out = subprocess.run(["podman", "ps", "-a", "--filter", "label=forgeflow.dev/flow-run", "--filter",
                          "name=ff-episode", "--format", '{{.Names}} {{index .Labels "forgeflow.dev/flow-run"}}'],
                         capture_output=True, text=True, env=tool_env(), check=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def test_a_cancelled_agentic_rl_burst_leaves_no_episode_container(
        prefect_harness, calc_tasks: Path, tmp_path: Path) -> None:
    """The run's process killed mid-episode (no cleanup of its own runs: what a worker's cancel may come to),
    then the flow's ``on_cancellation`` hooks as Prefect's runner calls them: every episode container the run
    labelled is ended at every layer (podman's records, the runtime's, conmon)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from flows.training import rl_burst
    from forgeflow.sandbox.podman_layers import find_leftovers, sweep_containers

    before = _labelled()
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(tmp_path / "p"),
           "FORGEFLOW_HOME": str(tmp_path / "home"), "FORGEFLOW_STORE_URL": f"sqlite:///{tmp_path / 's.db'}"}
    log = tmp_path / "cancelled.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", RUN, str(tiny_ggufs()[0].parent / "hf"), str(calc_tasks)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (ours := {n: r for n, r in _labelled().items() if n not in before}):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no episode container was started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    runs = set(ours.values())
    assert len(runs) == 1, ours  # every episode container names the one flow run
    assert set(_labelled()) & set(ours), "the kill left no container: nothing for the hook to do"
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(runs.pop()))
    try:
        for hook in rl_burst.on_cancellation_hooks:
            hook(flow=rl_burst, flow_run=run, state=run.state)
        left = {n for n, r in _labelled().items() if r == str(run.id)}
        below = find_leftovers(lambda n: n in ours)
        assert not left and below.empty(), f"left after the hook: {left} {below}\n{log.read_text()[-3000:]}"
    finally:  # a failure above must not leave them to the next test
        sweep_containers(lambda n: n in ours)
