"""Evidence that the promotion gate can say yes and no: the ``promote`` flow promotes a better
candidate, holds when the evidence cannot tell the two apart, rejects a worse one, and the recorded
serving endpoint follows only the promotion.

The canaries are real flow runs (session Prefect harness, real podman sandboxes, mini-swe-agent, the
verifier in a fresh container). The models are the scripted OpenAI-compatible loopback server of
``tests/integration/test_agent_supervision.py`` — one script replays the fix (reward 1), the other
submits without fixing (reward 0) — since a real tiny model cannot be made to fix a bug on demand;
the serving side is real: the tiny GGUFs on llama-cpp-python's server through the ``serve`` flow.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_agent import BUG_PATCH, F2P, P2P, TEST_COMMAND, task_image  # noqa: E402,F401 - fixture
from test_agent_supervision import scripted_endpoint, text_answer  # noqa: E402

from forgeflow.common.errors import InputError  # noqa: E402
from forgeflow.common.fsutil import sha256_file  # noqa: E402
from tests.helpers import free_port, tiny_ggufs  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIX = "sed -i 's/a - b/a + b/' calc.py && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
NO_FIX = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# four repositories, two tasks each: one repository goes to train, three (six tasks) to test
TASKS = {f"calc{r}.func_pm_op_swap__0000000{n}": f"calc{r}"
         for n, r in enumerate("aabbccdd", start=1)}
GATE = {"min_pairs": 6, "min_repos": 3, "max_wall_s_ratio": None}  # six pairs here; wall time is too noisy


@pytest.fixture()
def frozen(task_image: str, tmp_path: Path, flow_store_url: str, monkeypatch: pytest.MonkeyPatch):
    """Eight accepted tasks frozen as ``promote-test`` (test split: 6 tasks from 3 repositories)."""
    from forgeflow.curation import freeze
    from forgeflow.curation.generated import GeneratedTask, write_generated
    from forgeflow.ledger.records import FreezeRecord, TaskRecord
    from forgeflow.ledger.store import Store
    from forgeflow.registry import images

    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    store = Store()
    store.upgrade()
    for instance_id, repo in TASKS.items():
        store.record_task(TaskRecord(instance_id=instance_id, repo=repo, image_ref=task_image, status="accepted",
                                     FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P))
    quotas = freeze.SplitQuotas(train=2, validation=0, test=6, max_per_repo=2, min_repos=4)
    selection = freeze.select_splits([freeze.TaskRef(instance_id=i, repo=r) for i, r in TASKS.items()], quotas, 0)
    manifest = freeze.write_freeze("promote-test", selection, quotas, 0, tmp_path / "freezes")
    store.record_freeze(FreezeRecord(name=manifest.name, semantic_sha256=manifest.semantic_sha256,
                                     file_sha256=manifest.file_sha256, manifest_path=str(manifest.path),
                                     counts=manifest.counts))
    assert len(manifest.splits["test"]) == 6
    image_id = images.image_id(task_image)
    generated = write_generated(tmp_path / "candidates.jsonl", [
        GeneratedTask(instance_id=i, repo=r, patch=BUG_PATCH, modifier="func_pm_op_swap", file_path="calc.py",
                      func_name="add", image=task_image, image_id=image_id, test_command=TEST_COMMAND)
        for i, r in TASKS.items()])
    return store, generated


def test_the_gate_promotes_a_better_candidate_holds_on_a_tie_and_rejects_a_worse_one(
        prefect_harness, frozen, tmp_path: Path) -> None:
    from flows.canary import CanaryParams, canary
    from flows.promote import PromoteParams, promote
    from flows.stages import ServeParams, serve
    from forgeflow.serving.bluegreen import read_state, stop_active

    store, generated = frozen
    candidate_gguf, baseline_gguf = tiny_ggufs()  # Q8_0 is the candidate, f16 serves now
    hf_dir = candidate_gguf.parent / "hf"
    baseline_sha, candidate_sha = sha256_file(baseline_gguf), sha256_file(candidate_gguf)
    state_path = tmp_path / "serving" / "state.json"
    ports = (free_port(), free_port())

    def run_canary(job_id: str, model_sha256: str, command: str) -> None:
        with scripted_endpoint(lambda i: text_answer(command)) as (url, _):
            result = canary(CanaryParams(freeze_name="promote-test", endpoint={"base_url": url, "model_sha256": model_sha256},
                            source={"generated_path": generated}, out_dir=tmp_path / "canary", job_id=job_id,
                            run={"concurrency": 2, "verifier_timeout_s": 120.0,
                                 "agent_config": {"step_limit": 5, "agent_timeout_s": 120, "memory_mb": 512}}))
        expected = 6 if command == FIX else 0
        assert (result.report.scored, result.report.reward_1) == (6, expected)

    run_canary("base-fixes", baseline_sha, FIX)
    run_canary("base-fails", baseline_sha, NO_FIX)
    run_canary("cand-fixes", candidate_sha, FIX)
    run_canary("cand-fails", candidate_sha, NO_FIX)

    serve(ServeParams(gguf_path=baseline_gguf, state_path=state_path, ports=ports, hf_dir=hf_dir))
    try:
        serving_before = read_state(state_path)
        assert serving_before.gguf_sha256 == baseline_sha

        common = dict(gguf_path=candidate_gguf, comparison={"gate": GATE}, state_path=state_path,
                      ports=ports, hf_dir=hf_dir)
        held = promote(PromoteParams(baseline_job="base-fixes", candidate_job="cand-fixes", **common))  # 6 ties: no evidence either way
        assert (held.decision.verdict, held.rolled_back, held.current) == ("hold", True, serving_before)
        rejected = promote(PromoteParams(baseline_job="base-fixes", candidate_job="cand-fails", **common))  # 6 losses
        assert (rejected.decision.verdict, rejected.rolled_back) == ("reject", True)
        assert read_state(state_path) == serving_before  # nothing moved, nothing was started
        assert "reject" in rejected.report_path.read_text()

        with pytest.raises(InputError, match="canaried model .* not params.gguf_path's"):
            promote(PromoteParams(baseline_job="base-fails", candidate_job="cand-fixes", **{**common, "gguf_path": baseline_gguf}))

        promoted = promote(PromoteParams(baseline_job="base-fails", candidate_job="cand-fixes", **common))  # 6 wins
        assert (promoted.decision.verdict, promoted.rolled_back) == ("promote", False)
        serving_after = read_state(state_path)
        assert serving_after.gguf_sha256 == candidate_sha and serving_after.generation == serving_before.generation + 1
        assert serving_after.active_port != serving_before.active_port
        generations = {g.generation: g for g in store.serving_generations()}
        assert generations[serving_after.generation].status == "active"
        assert generations[serving_before.generation].status == "retired"

        # the baseline must be what serves now: base-fails canaried f16, the Q8_0 serves
        with pytest.raises(InputError, match="not the one it replaces"):
            promote(PromoteParams(baseline_job="base-fails", candidate_job="cand-fixes", **common))
    finally:
        stop_active(state_path)
