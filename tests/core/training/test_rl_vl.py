"""Issue 36: an RL burst (TRL GRPO, CPU) on the tiny multimodal base: loaded as image-text-to-text with its vision
tower frozen, LoRA on the language model only, text prompts; the tower checked unchanged and recorded in the
lineage as an SFT VL burst records it. The verifier is replaced by alternating rewards (an advantage to learn
from; the real verifier's runs are tests/integration/test_rl_burst.py's)."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest

from forgeflow.common.settings import cache_dir
from forgeflow.training import rewards, vl_burst
from forgeflow.training.health import BurstHealthError
from forgeflow.training.rewards import RewardOutcome
from forgeflow.training.rl import RLBurstConfig, build_rl_dataset, run_rl_burst

pytestmark = [pytest.mark.slow]

TASK = {"instance_id": "calc-1", "image_ref": "localhost/calc:1", "problem_statement": "add fails",
        "test_command": "pytest -rA", "FAIL_TO_PASS": ["tests/test_calc.py::test_add"], "task_timeout_s": 60.0}
CONFIG = RLBurstConfig(max_steps=1, num_generations=2, max_completion_length=8, lora_r=4, device="cpu")


@pytest.fixture
def alternating(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewards 1, 0, 1, 0, ... instead of the verifier's (no sandbox here)."""
    counter, lock = itertools.count(), threading.Lock()

    def score(completion, task, **kwargs) -> RewardOutcome:  # noqa: ANN001
        with lock:
            return RewardOutcome(reward=float(next(counter) % 2), verifier_timeout_s=10.0)

    monkeypatch.setattr(rewards, "score_completion", score)


def test_an_rl_burst_on_tiny_vl_trains_the_language_model_and_keeps_the_tower(alternating, tmp_path: Path) -> None:
    from safetensors import safe_open

    from forgeflow.packaging import vl_model

    base = vl_model.build_tiny_vl_model(cache_dir() / "test-fixtures" / "tiny-vl-seed0", seed=0)  # reused
    record = run_rl_burst(base.path, build_rl_dataset([TASK]), tmp_path / "rl", CONFIG, run_id="vl")
    assert record.weights_changed and record.adapter.steps == 1
    lineage = record.adapter.lineage
    assert lineage.vision_tower_frozen is True
    assert lineage.vision_tower_sha256 == base.vision_sha256 == vl_model.vision_tower_sha256(base.path)
    with safe_open(str(record.adapter.path / "adapter_model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    assert names and not [n for n in names if "visual" in n]
    assert {"in_proj_qkv", "out_proj", "q_proj", "gate_proj"} <= {n.split(".")[-3] for n in names}


def test_a_tower_that_moved_during_an_rl_burst_writes_no_adapter(
        alternating, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from forgeflow.packaging import vl_model

    base = vl_model.build_tiny_vl_model(cache_dir() / "test-fixtures" / "tiny-vl-seed0", seed=0)
    real, calls = vl_burst.vision_state_sha256, []

    def digest(model) -> str:  # noqa: ANN001 - before training the real digest, after it another one
        calls.append(model)
        return real(model) if len(calls) == 1 else "0" * 64

    monkeypatch.setattr(vl_burst, "vision_state_sha256", digest)
    with pytest.raises(BurstHealthError, match="vision tower changed during the burst"):
        run_rl_burst(base.path, build_rl_dataset([TASK]), tmp_path / "rl", CONFIG, run_id="moved")
    assert len(calls) == 2 and not (tmp_path / "rl").exists()
