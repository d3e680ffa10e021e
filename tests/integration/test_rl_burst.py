"""RL bursts: the verifier reward in real podman containers of the calc task image (shared with
test_agent), and a 2-step GRPO burst (TRL + peft, CPU) on the seed-0 tiny model continuing an
SFT adapter, then a 1-step RLOO burst continuing the GRPO adapter (the ``algorithm="rloo"`` path,
trl.RLOOTrainer, run for real). The tiny model's completions are noise: their patches do not
apply (reward 0), which is what a real rollout of an untrained model looks like."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from forgeflow.common.errors import InputError
from forgeflow.common.settings import cache_dir
from forgeflow.packaging.base_model import build_tiny_model
from forgeflow.training.adapters import (
    LINEAGE_FILE,
    adapter_sha256,
    read_adapter_record,
)
from forgeflow.training.burst import BurstConfig, build_sft_dataset, run_sft_burst
from forgeflow.training.rewards import VerifierReward, extract_patch, score_completion
from forgeflow.training.rl import (
    RLBurstConfig,
    RLTask,
    build_rl_dataset,
    run_rl_burst,
)
from tests.integration.test_agent import (  # noqa: F401
    BUG_PATCH,
    F2P,
    FIX_PATCH,
    P2P,
    TEST_COMMAND,
    task_image,
)

WRONG_PATCH = """\
diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -3,4 +3,4 @@ def add(a, b):
 
 
 def mul(a, b):
-    return a * b
+    return b * a
"""


def _task(image: str, instance_id: str = "calc-add-1", timeout_s: float = 120.0) -> RLTask:
    return RLTask(instance_id=instance_id, image_ref=image, problem_statement="test_add fails",
                  test_command=TEST_COMMAND, FAIL_TO_PASS=tuple(F2P), PASS_TO_PASS=tuple(P2P),
                  verifier_timeout_s=timeout_s)


def _answer(patch: str) -> list[dict]:
    """A conversational completion as TRL hands it to reward functions."""
    return [{"role": "assistant", "content": f"The sign is wrong.\n```diff\n{patch}```\nDone."}]


def test_patch_extraction_trainer_choice_and_bad_input(tmp_path: Path) -> None:
    from trl import GRPOConfig, RLOOConfig

    from forgeflow.training.rl import _trl_objects

    assert extract_patch(_answer(FIX_PATCH)[0]["content"]) == FIX_PATCH
    assert extract_patch("I think\n" + FIX_PATCH) == FIX_PATCH  # unfenced diff
    assert extract_patch("no idea") == ""
    rloo, lora = _trl_objects(RLBurstConfig(algorithm="rloo", num_generations=4, prompts_per_step=2), tmp_path, True)
    assert type(rloo) is RLOOConfig and (rloo.per_device_train_batch_size, rloo.num_generations) == (8, 4)
    assert (rloo.use_cpu, rloo.bf16, rloo.gradient_checkpointing) == (True, False, False)  # auto, no GPU here
    assert type(_trl_objects(RLBurstConfig(), tmp_path, False)[0]) is GRPOConfig and lora.r == 8
    with pytest.raises(ValidationError, match="algorithm"):
        RLBurstConfig(algorithm="ppo")
    with pytest.raises(InputError, match=r"tasks\[0\]\.verifier_timeout_s"):
        build_rl_dataset([{**_task("img").model_dump(), "verifier_timeout_s": 0}])


@pytest.mark.integration
def test_reward_is_1_for_the_oracle_fix_0_for_wrong_patches_none_for_infra(task_image: str) -> None:  # noqa: F811
    task = _task(task_image)
    wrong = score_completion(_answer(WRONG_PATCH), task, verifier_timeout_multiplier=0.5, memory_mb=512)
    assert (wrong.reward, wrong.exception_type, wrong.verifier_timeout_s) == (0.0, None, 60.0)  # applies, still fails
    stale = score_completion(_answer(BUG_PATCH), task, verifier_timeout_multiplier=0.5, memory_mb=512)
    assert stale.reward == 0.0 and "did not apply" in stale.note
    # 120 s x 0.0001 = 12 ms: the training timeout cuts the test run short -> exception, not 0
    slow = score_completion(_answer(FIX_PATCH), task, verifier_timeout_multiplier=0.0001, memory_mb=512)
    assert (slow.reward, slow.exception_type) == (None, "VerifierTimeoutError")

    # the TRL reward function: the oracle fix in the task image, the same fix on a missing image
    reward = VerifierReward(verifier_timeout_multiplier=0.5, memory_mb=512, concurrency=2)
    images = [task_image, "localhost/forgeflow/no-such-image:0"]
    got = reward(prompts=["p", "p"], completions=[_answer(FIX_PATCH), _answer(FIX_PATCH)],
                 instance_id=["calc-add-1", "calc-add-2"], image_ref=images, test_command=[TEST_COMMAND] * 2,
                 FAIL_TO_PASS=[F2P] * 2, PASS_TO_PASS=[P2P] * 2, verifier_timeout_s=[120.0] * 2)
    assert got == [1.0, None]
    missing = reward.outcomes[1][2]
    assert missing.exception_type in {"ImageNotFoundError", "SandboxError"} and "no-such-image" in missing.exception_message
    counts = reward.counts[1]
    assert (counts.completions, counts.resolved, counts.unresolved, counts.exceptions) == (2, 1, 0, 1)


@pytest.mark.integration
@pytest.mark.slow
def test_grpo_burst_continues_an_sft_adapter_and_records_reward_counts(task_image: str, tmp_path: Path) -> None:  # noqa: F811
    base = build_tiny_model(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf", seed=0)
    sft = build_sft_dataset([{"instance_id": "calc-add-1", "source": "oracle", "messages": [
        {"role": "user", "content": "test_add fails"}, {"role": "assistant", "content": FIX_PATCH}]}])
    parent = run_sft_burst(base.path, sft, tmp_path / "sft", BurstConfig(max_steps=1), run_id="sft-run")
    data = build_rl_dataset([_task(task_image)])
    config = RLBurstConfig(max_steps=2, num_generations=2, max_completion_length=8, verifier_memory_mb=512,
                           verifier_timeout_multiplier=0.5, verifier_concurrency=2)
    record = run_rl_burst(base.path, data, tmp_path / "grpo", config, parent_adapter_dir=parent.path, run_id="rl-run")

    written = json.loads((tmp_path / "grpo" / LINEAGE_FILE).read_text())
    lineage = written["lineage"]
    assert lineage["algorithm"] == "grpo" and lineage["run_id"] == "rl-run"
    assert lineage["parent_adapter_sha256"] == parent.sha256
    # GRPO moves the weights only where a group's rewards differ (advantage = reward - group mean);
    # with 2 generations per prompt and step that is a step with exactly one of the two resolved
    spread = any(0 < c.resolved < c.completions for c in record.reward_counts)
    assert record.weights_changed == spread == (record.adapter.sha256 != parent.sha256)
    assert lineage["base_model_sha256"] == base.sha256 and lineage["dataset_sha256"] == data.sha256
    assert lineage["hyperparameters"]["verifier_timeout_multiplier"] == 0.5
    # what the trainer did on this machine: float32 on the CPU, no recomputation of activations
    assert (lineage["device"], lineage["dtype"], lineage["gradient_checkpointing"]) == ("cpu", "float32", False)
    assert written["sha256"] == adapter_sha256(tmp_path / "grpo") == record.adapter.sha256
    assert record.adapter.steps == 2 and record.adapter.promotable
    assert [c.step for c in record.reward_counts] == [1, 2]
    for counts in record.reward_counts:  # one prompt x 2 generations per step, all scored
        assert counts.completions == 2 and counts.resolved + counts.unresolved == 2 and counts.exceptions == 0
    assert written["reward_counts"] == [c.model_dump(mode="json") for c in record.reward_counts]

    again = run_rl_burst(base.path, data, tmp_path / "grpo", config, parent_adapter_dir=parent.path, run_id="other")
    assert again == record  # same inputs, passing gates: reused, not retrained

    # RLOO (leave-one-out baseline, trl.RLOOTrainer) continues the GRPO adapter for one real step
    rloo_config = RLBurstConfig(algorithm="rloo", max_steps=1, num_generations=2, max_completion_length=4,
                                verifier_memory_mb=512, verifier_timeout_multiplier=0.5, verifier_concurrency=2)
    rloo = run_rl_burst(base.path, data, tmp_path / "rloo", rloo_config, parent_adapter_dir=record.adapter.path,
                        run_id="rloo-run")
    rloo_written = json.loads((tmp_path / "rloo" / LINEAGE_FILE).read_text())
    assert rloo_written["lineage"]["algorithm"] == "rloo" == rloo.adapter.lineage.algorithm
    assert rloo_written["lineage"]["parent_adapter_sha256"] == record.adapter.sha256
    assert rloo_written["sha256"] == adapter_sha256(tmp_path / "rloo") == rloo.adapter.sha256
    assert rloo.adapter.steps == 1 and rloo.adapter.promotable
    assert [step for step, _ in rloo.adapter.health.losses] == [1] and len(rloo.adapter.health.grad_norms) == 1
    (counts,) = rloo.reward_counts  # one prompt x 2 generations, scored by the verifier
    assert (counts.step, counts.completions, counts.resolved + counts.unresolved, counts.exceptions) == (1, 2, 2, 0)
    assert rloo.weights_changed == (0 < counts.resolved < 2) == (rloo.adapter.sha256 != record.adapter.sha256)
    assert [p.name for p in tmp_path.glob(".rloo.*")] == []  # the staging folder went with the burst

    written["health"]["passed"] = False  # a record that does not show passing gates is never promotable
    (tmp_path / "grpo" / LINEAGE_FILE).write_text(json.dumps(written))
    assert not read_adapter_record(tmp_path / "grpo").promotable


def test_a_new_adapter_whose_rewards_never_differ_learned_nothing(task_image: str, tmp_path: Path) -> None:  # noqa: F811
    """Without a parent, an RL burst whose every group got equal rewards (the random tiny model writes no
    fix: all 0) leaves peft's initial adapter as it was: ``weights_changed`` is False (measured on the
    trainable weights, not from a parent's digest), kept in ``lineage.json`` and read back on reuse."""
    base = build_tiny_model(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf", seed=0)
    data = build_rl_dataset([_task(task_image)])
    config = RLBurstConfig(algorithm="rloo", max_steps=1, num_generations=2, max_completion_length=4,
                           verifier_memory_mb=512, verifier_timeout_multiplier=0.5, verifier_concurrency=2)
    fresh = run_rl_burst(base.path, data, tmp_path / "fresh", config, run_id="fresh")
    (counts,) = fresh.reward_counts
    assert (counts.completions, counts.unresolved, counts.exceptions) == (2, 2, 0)
    assert fresh.adapter.lineage.parent_adapter_sha256 is None and fresh.weights_changed is False
    assert json.loads((tmp_path / "fresh" / LINEAGE_FILE).read_text())["weights_changed"] is False
    assert run_rl_burst(base.path, data, tmp_path / "fresh", config, run_id="again") == fresh  # reused as it was
