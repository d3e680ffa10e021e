"""Agent trials and RL rewards on a real local Ray cluster: a head node without sandboxes and two worker
nodes declaring ``{"sandbox": 1}`` (``ray start --address`` processes, tests/raycluster.py, stopped by
PID). The ``forgeflow-dispatcher`` block sends each canary trial (whole) and each RL reward's verifier run
there as a Ray task; the trial's verifier record, and the RL burst's counts per step, name the node.

The canary's model is the scripted loopback endpoint of tests/flows/test_canary_flow.py (it replays
the fix), the RL rewards are the verifier's on the calc task image of tests/integration/test_agent.py.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_agent import F2P, FIX_PATCH, P2P, TEST_COMMAND, task_image  # noqa: E402,F401 - fixture
from test_agent_supervision import scripted_endpoint, text_answer  # noqa: E402

from tests.flows.test_canary_flow import FIX, MODEL_SHA, recorded_freeze  # noqa: E402,F401 - fixture
from tests.raycluster import ray_head, ray_worker  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    """The head (no sandbox resource) and two sandbox workers; yields (head, {worker node ids})."""
    with ray_head(num_cpus=1) as head, ray_worker(head, {"sandbox": 1}) as one, \
            ray_worker(head, {"sandbox": 1}) as two:
        yield head, {one.node_id, two.node_id}


def _dispatcher(head) -> str:
    from blocks.core import TrialDispatcher

    name = f"test-ray-rewards-{uuid.uuid4().hex[:8]}"
    TrialDispatcher(kind="ray", address=head.address).save(name, overwrite=True)
    return name


def test_rl_rewards_are_scored_on_the_sandbox_nodes(prefect_harness, cluster, task_image: str) -> None:  # noqa: F811
    """The TRL reward function on Ray: the fix scores 1, a wrong patch 0, a missing image None (an
    exception raised on the node, never 0); the counts per step name the nodes that scored."""
    import ray

    from forgeflow.sandbox import dispatch
    from forgeflow.sandbox.dispatch import RayPlacement
    from forgeflow.training.rewards import VerifierReward

    head, workers = cluster
    wrong = FIX_PATCH.replace("a + b", "a * b")
    answers = [[{"role": "assistant", "content": f"```diff\n{p}```"}] for p in (FIX_PATCH, wrong, FIX_PATCH)]
    reward = VerifierReward(verifier_timeout_multiplier=0.5, memory_mb=512, concurrency=3,
                            ray=RayPlacement(address=head.address))
    try:
        got = reward(prompts=["p"] * 3, completions=answers, instance_id=["calc-1", "calc-2", "calc-3"],
                     image_ref=[task_image, task_image, "localhost/forgeflow/no-such-image:0"],
                     test_command=[TEST_COMMAND] * 3, FAIL_TO_PASS=[F2P] * 3, PASS_TO_PASS=[P2P] * 3,
                     verifier_timeout_s=[120.0] * 3)
    finally:
        dispatch.disconnect()
    assert got == [1.0, 0.0, None]
    outcomes = [o for _, _, o in reward.outcomes]
    assert outcomes[2].exception_type in {"ImageNotFoundError", "SandboxError"} and outcomes[2].node_id is None
    assert {o.node_id for o in outcomes[:2]} <= workers  # never the head: it has no sandbox resource
    counts = reward.counts[1]
    assert (counts.resolved, counts.unresolved, counts.exceptions) == (1, 1, 1)
    assert sum(counts.nodes.values()) == 2 and set(counts.nodes) <= workers
    assert not ray.is_initialized()


def test_canary_trials_run_on_the_sandbox_nodes(prefect_harness, cluster, recorded_freeze, tmp_path: Path) -> None:  # noqa: F811
    """The canary flow with a ``ray`` dispatcher block: each agent trial runs whole as one Ray task on a sandbox
    node (Ray's own task list says where: never the head), with the same rewards as in-process; the verifier
    ran there too (no separate verifier task), the trial's verifier record (in the store too) names the node,
    the job records the placement, and the flow leaves the cluster when its trials are in. The endpoint needs
    an API key: the node's agent sends the key of the endpoint's Secret block. A missing block is refused
    before any trial."""
    import ray
    from prefect.blocks.system import Secret
    from ray.util.state import list_tasks

    from flows.canary import CanaryParams, canary
    from forgeflow.common.errors import InputError

    store, manifest, generated = recorded_freeze
    head, workers = cluster
    with pytest.raises(InputError, match="dispatcher block 'no-such-dispatcher' does not exist"):
        canary(CanaryParams(freeze_name="canary-test", endpoint={"base_url": "http://x/v1", "model_sha256": MODEL_SHA},
               source={"generated_path": generated}, dispatcher="no-such-dispatcher"))
    key = "sk-ray-" + uuid.uuid4().hex
    Secret(value=key).save("ray-endpoint-key", overwrite=True)
    with scripted_endpoint(lambda i: text_answer(FIX), api_key=key) as (url, bodies):
        result = canary(CanaryParams(freeze_name="canary-test", source={"generated_path": generated}, out_dir=tmp_path / "canary",
                        endpoint={"base_url": url, "model_sha256": MODEL_SHA, "api_key_secret": "ray-endpoint-key"},
                        job_id="on-ray", dispatcher=_dispatcher(head),
                        run={"verifier_timeout_s": 120.0, "agent_config": {"step_limit": 5, "agent_timeout_s": 120}}))
    assert [(t.exception_type, t.reward) for t in result.trials] == [(None, 1.0)] * 2
    assert len(bodies) == 2  # the model calls came with the key (the endpoint refuses any other)
    trials = store.trials_for(job_id="on-ray")
    assert len(trials) == 2 and {t.verifier["node_id"] for t in trials} <= workers
    assert store.get_job("on-ray").params["agent_config"]["verifier_ray"]["address"] == head.address
    assert not ray.is_initialized()
    ran = list_tasks(address=head.dashboard_url, filters=[("name", "=", f"agent trial of {manifest.splits['test'][0]}")],
                     raise_on_missing_output=False)
    assert len(ran) == 1 and ran[0].node_id in workers and ran[0].state == "FINISHED", ran
    assert ran[0].node_id == next(t.verifier["node_id"] for t in trials
                                  if t.instance_id == manifest.splits["test"][0])


def test_rl_burst_flow_scores_its_rollouts_on_ray(prefect_harness, cluster, task_image: str, tmp_path: Path,  # noqa: F811
                                                  monkeypatch) -> None:
    """The rl-burst flow end to end with a ``ray`` dispatcher block, on the tiny model: its rollouts are
    verified as Ray tasks on the sandbox nodes (Ray's own task list says where, and so do the burst's
    ``lineage.json`` counts per step). A random model's 4-token completions hold no diff (each its own 0
    without a container), so the patch read from every completion is the task's fix here
    (``extract_patch`` replaced in this process, which scores): both rollouts reach a sandbox node and
    get 1.0. Equal rewards mean no advantage and no update: the new adapter is peft's initialisation, so
    the flow fails saying nothing was learned and records no adapter."""
    import json

    import ray
    from ray.util.state import list_tasks

    from flows.training import RLBurstParams, rl_burst
    from forgeflow.common.settings import cache_dir
    from forgeflow.ledger.store import Store
    from forgeflow.packaging.base_model import build_tiny_model
    from forgeflow.training.adapters import LINEAGE_FILE
    from forgeflow.training.health import BurstHealthError
    from forgeflow.training.rl import RLBurstConfig

    head, workers = cluster
    monkeypatch.setattr("forgeflow.training.rewards.extract_patch", lambda text: FIX_PATCH)
    monkeypatch.setenv("FORGEFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", f"sqlite:///{tmp_path / 'store.db'}")
    base = build_tiny_model(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf", seed=0)
    task = {"instance_id": "calc-ray-1", "image_ref": task_image, "problem_statement": "test_add fails",
            "test_command": TEST_COMMAND, "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P, "verifier_timeout_s": 120.0}
    tasks_jsonl = tmp_path / "tasks.jsonl"
    tasks_jsonl.write_text(json.dumps(task) + "\n")
    training = RLBurstConfig(max_steps=1, num_generations=2, max_completion_length=4, verifier_timeout_multiplier=0.5,
                             verifier_concurrency=2)
    def verifier_tasks() -> list:
        return list_tasks(address=head.dashboard_url, filters=[("name", "=", f"verifier of {task_image}")],
                          raise_on_missing_output=False, limit=10_000)

    earlier = {t.task_id for t in verifier_tasks()}  # other tests' verifications on this cluster
    with pytest.raises(BurstHealthError, match=r"left its new adapter at peft's initial weights .*nothing learned"):
        rl_burst(RLBurstParams(hf_dir=base.path, tasks_jsonl=tasks_jsonl, training=training,
                               dispatcher=_dispatcher(head), out_dir=tmp_path / "models"))
    assert not ray.is_initialized()
    written = json.loads((tmp_path / "models" / "rl-adapter" / LINEAGE_FILE).read_text())
    (counts,) = written["reward_counts"]
    assert (counts["completions"], counts["resolved"], counts["exceptions"]) == (2, 2, 0), counts
    assert set(counts["nodes"]) <= workers and sum(counts["nodes"].values()) == 2, counts
    assert written["weights_changed"] is False
    assert not Store().producers(written["sha256"])  # nothing learned: no adapter recorded
    ran = [t for t in verifier_tasks() if t.task_id not in earlier]
    assert len(ran) == 2 and {t.node_id for t in ran} <= workers and {t.state for t in ran} == {"FINISHED"}, ran
