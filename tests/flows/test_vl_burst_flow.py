"""The ``sft-burst`` flow on the tiny multimodal base (``tiny-vl``) with the user's own samples and images.

A JSONL of chat rows with image turns (images beside it, named by their sha256 or by a relative path) trains a
LoRA through ``AutoModelForImageTextToText`` (real TRL + peft, CPU): the adapter is recorded in the store, its
lineage says the vision tower was frozen and names the tower's digest (the one packaging checks a projector
against), the adapter has no vision tensor and its language-model weights moved (the linear-attention
projections included). A second burst continues that adapter on a text-only file on the same base.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forgeflow.common.fsutil import sha256_file
from forgeflow.common.settings import cache_dir
from forgeflow.ledger.store import Store

pytestmark = [pytest.mark.slow]


@pytest.fixture
def home(tmp_path: Path, flow_store_url: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("FORGEFLOW_HOME", str(home))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    Store().upgrade()
    return home


def _image(folder: Path, rgb: tuple[int, int, int], name: str | None = None) -> str:
    """A 64 px square of one colour saved beside the samples; returns the name rows use (its sha256 or ``name``)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "new.png"
    Image.new("RGB", (64, 64), rgb).save(tmp)
    digest = sha256_file(tmp)
    tmp.rename(folder / (name or f"{digest}.png"))
    return name or digest


def _ask(image: str, question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer}]}


def test_an_sft_burst_with_image_turns_freezes_the_vision_tower_and_a_text_file_continues_it(
        prefect_harness, home: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    from flows.training import SFTBurstParams, sft_burst
    from forgeflow.packaging import vl_model
    from forgeflow.training.adapters import read_adapter_record
    from forgeflow.training.burst import BurstConfig
    from forgeflow.training.vl_burst import vl_lora_parameter_count

    base = vl_model.build_tiny_vl_model(cache_dir() / "test-fixtures" / "tiny-vl-seed0", seed=0)  # reused
    data = tmp_path / "data"
    red, blue = _image(data, (255, 0, 0)), _image(data, (0, 0, 255))
    green = _image(data / "shots", (0, 160, 0), name="green.png")
    rows = [_ask(red, "What colour is the square?", "Red."),
            _ask(f"{blue}.png", "What colour is the square?", "Blue."),
            _ask(f"shots/{green}", "And this one?", "Green.")]
    samples = data / "vl.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    training = BurstConfig(max_steps=2, learning_rate=5e-3, lora_r=4, max_length=128, seed=1)
    first = sft_burst(SFTBurstParams(hf_dir=base.path, samples_jsonl=samples, training=training))

    record = read_adapter_record(first.path)
    assert record.lineage.vision_tower_frozen is True
    assert record.lineage.vision_tower_sha256 == base.vision_sha256 == vl_model.vision_tower_sha256(base.path)
    assert record.lineage.packing == "none" and record.steps == 2
    [production] = Store().producers(first.sha256)
    assert production.lineage["vision_tower_sha256"] == base.vision_sha256
    with safe_open(str(first.path / "adapter_model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    assert tensors and not [n for n in tensors if "visual" in n]
    assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "gate_proj"} <= {n.split(".")[-3] for n in tensors}
    moved = [n for n, t in tensors.items() if "lora_B" in n and t.abs().sum() > 0]  # peft starts every B at zero
    assert len(moved) == len([n for n in tensors if "lora_B" in n])
    assert sum(t.numel() for t in tensors.values()) == vl_lora_parameter_count(base.path, 4, training.lora_target_modules)

    # the same images in another folder are the same dataset (images named by digest, not by path)
    moved_data = tmp_path / "elsewhere"
    shutil.copytree(data, moved_data)
    from forgeflow.training.burst import build_sft_dataset
    from forgeflow.training.jsonl import read_sft_jsonl

    assert build_sft_dataset(read_sft_jsonl(moved_data / "vl.jsonl")).sha256 == first.lineage.dataset_sha256

    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"messages": [{"role": "user", "content": "Name a primary colour."},
                                                  {"role": "assistant", "content": "Red."}]}) + "\n")
    second = sft_burst(SFTBurstParams(hf_dir=base.path, samples_jsonl=text_only, training=training,
                                      parent_adapter=first.sha256[:12]))
    assert second.parent_sha256 == first.sha256 != second.sha256
    assert read_adapter_record(second.path).lineage.vision_tower_sha256 == base.vision_sha256


def test_the_windows_flow_keeps_a_trajectorys_images_and_sft_burst_trains_tiny_vl_on_its_output(
        prefect_harness, home: Path, tmp_path: Path) -> None:
    """Issue 36: a canary trajectory whose task turn carried an image -> the windows flow's JSONL (the image part
    in every window's task turn, the file beside it by digest) -> an SFT burst on tiny-vl, as a subflow."""
    from flows.training import WindowsParams, windows
    from forgeflow.evaluation.chat_images import image_ref
    from forgeflow.packaging import vl_model
    from forgeflow.training.adapters import read_adapter_record
    from forgeflow.training.burst import BurstConfig
    from forgeflow.training.windows import WindowConfig
    from tests.core.training.test_windows import text_trajectory

    base = vl_model.build_tiny_vl_model(cache_dir() / "test-fixtures" / "tiny-vl-seed0", seed=0)  # reused
    folder = tmp_path / "canary"
    red = _image(folder / "images", (255, 0, 0))
    trajectory = text_trajectory([f"cat file{i}.py" for i in range(5)])
    trajectory["messages"][1]["images"] = [image_ref(folder / "images" / f"{red}.png", folder / "images")
                                           .model_dump(mode="json")]
    (folder / "t-1.traj.json").write_text(json.dumps(trajectory))
    config = WindowConfig(replay_steps=1, stride_steps=2, min_steps=3, task_excerpt_chars=200, include_system=False,
                          loop_variants=("stop_and_conclude",))
    training = BurstConfig(max_steps=1, lora_r=4, max_length=1024, seed=0)
    result = windows(WindowsParams(trajectories_dir=folder, windows=config, hf_dir=base.path, training=training))
    rows = [json.loads(line) for line in result.samples_jsonl.read_text().splitlines()]
    assert rows and all({"type": "image", "image": red} in r["prompt"][0]["content"] for r in rows)
    assert (result.samples_jsonl.parent / f"{red}.png").is_file()
    assert result.burst is not None and result.burst.steps == 1
    lineage = read_adapter_record(result.burst.path).lineage
    assert lineage.vision_tower_frozen is True and lineage.vision_tower_sha256 == base.vision_sha256
    assert lineage.dataset_sha256 == result.dataset_sha256


def test_rl_burst_continues_a_tiny_vl_sft_adapter_with_the_tower_frozen_and_recorded(
        prefect_harness, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36: the rl-burst flow on tiny-vl (text prompts, GRPO on CPU) continues an SFT VL adapter; the store's
    lineage records the frozen tower. Rewards alternate 1, 0 in place of the verifier's (no sandbox here)."""
    import itertools

    from flows.training import RLBurstParams, SFTBurstParams, rl_burst, sft_burst
    from forgeflow.packaging import vl_model
    from forgeflow.training import rewards
    from forgeflow.training.burst import BurstConfig
    from forgeflow.training.rl import RLBurstConfig

    counter = itertools.count()
    monkeypatch.setattr(rewards, "score_completion", lambda completion, task, **kwargs: rewards.RewardOutcome(
        reward=float(next(counter) % 2), verifier_timeout_s=10.0))
    base = vl_model.build_tiny_vl_model(cache_dir() / "test-fixtures" / "tiny-vl-seed0", seed=0)  # reused
    data = tmp_path / "data"
    samples = data / "vl.jsonl"
    samples.write_text(json.dumps(_ask(_image(data, (255, 0, 0)), "What colour?", "Red.")) + "\n")
    sft = sft_burst(SFTBurstParams(hf_dir=base.path, samples_jsonl=samples,
                                   training=BurstConfig(max_steps=1, lora_r=4, max_length=128)))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"instance_id": "calc-1", "image_ref": "localhost/calc:1", "problem_statement":
                                 "add fails", "test_command": "pytest -rA", "FAIL_TO_PASS": ["t.py::test_add"]}) + "\n")
    rl = rl_burst(RLBurstParams(hf_dir=base.path, tasks_jsonl=tasks, parent_adapter=sft.sha256,
                                training=RLBurstConfig(max_steps=1, max_completion_length=8, lora_r=4)))
    assert rl.parent_sha256 == sft.sha256 != rl.sha256 and rl.steps == 1
    (production,) = [p for p in Store().producers(rl.sha256) if p.kind == "adapter"]
    assert production.lineage["algorithm"] == "grpo" and production.lineage["vision_tower_frozen"] is True
    assert production.lineage["vision_tower_sha256"] == base.vision_sha256
