"""The ``rl-burst`` flow's agentic mode (``episode`` block) with the seed-0 tiny model as the policy, on the calc
task's real image under podman: the episodes run in containers (none left after), their trajectories are saved
under the run, the episode table artifact counts them per step. The tiny model samples noise (no command, a
format error each turn: reward 0 for every episode), so every group's rewards are equal and the flow refuses to
record an adapter that learned nothing, as for single-turn bursts."""

from __future__ import annotations

import json
import subprocess
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


def test_an_agentic_rl_burst_runs_episodes_in_podman_and_tables_them(
        prefect_harness, flow_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.training import RLBurstParams, RLHyperParams, rl_burst
    from forgeflow.training.episodes import EpisodeSettings

    home = tmp_path / "home"
    monkeypatch.setenv("FORGEFLOW_HOME", str(home))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    Store().upgrade()
    image = build_task_image(tmp_path / "calc", TASK_IMAGE, {
        "calc.py": BUGGY_CALC, "tests/test_calc.py": TESTS, "tests/test_env.py": ENV_TEST, "conftest.py": CONFTEST})
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"instance_id": "calc-add", "image_ref": image, "problem_statement": "test_add fails",
                                 "test_command": TEST_COMMAND, "fail_to_pass": F2P, "pass_to_pass": P2P,
                                 "task_timeout_s": 240.0}) + "\n")
    params = RLBurstParams(hf_dir=tiny_ggufs()[0].parent / "hf", tasks_jsonl=tasks,
                           training=RLHyperParams(steps=1, num_generations=2, max_completion_length=16,
                                                  verifier_timeout_multiplier=0.5),
                           episode=EpisodeSettings(max_turns=2, concurrency=2, memory_mb=256, wall_s=120))
    with pytest.raises(BurstHealthError, match="nothing learned"):
        rl_burst(params)
    with get_client(sync_client=True) as client:
        (table,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rl-burst-episodes"])))
    (row,) = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert (row["episodes"], row["unresolved"], row["exceptions"], row["end reasons"]) == (2, 2, 0, "max_turns 2")
    assert row["turns"] == 4 and row["policy tokens"] > 0
    (run_dir,) = (home / "models" / "rl-episodes").iterdir()
    trajectories = sorted((run_dir / "step-0001").glob("*.traj.json"))
    assert len(trajectories) == 2 and all(json.loads(t.read_text())["info"]["forgeflow"]["reward"] == 0.0
                                          for t in trajectories)
    left = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", "name=ff-episode"],
                          env=tool_env(), capture_output=True, text=True, check=True).stdout.split()
    assert left == []
