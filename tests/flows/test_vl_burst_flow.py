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

    record = read_adapter_record(first.adapter_path)
    assert record.lineage.vision_tower_frozen is True
    assert record.lineage.vision_tower_sha256 == base.vision_sha256 == vl_model.vision_tower_sha256(base.path)
    assert record.lineage.packing == "none" and record.steps == 2
    [production] = Store().producers(first.adapter_sha256)
    assert production.lineage["vision_tower_sha256"] == base.vision_sha256
    with safe_open(str(first.adapter_path / "adapter_model.safetensors"), framework="pt") as handle:
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

    assert build_sft_dataset(read_sft_jsonl(moved_data / "vl.jsonl")).sha256 == first.dataset_sha256

    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"messages": [{"role": "user", "content": "Name a primary colour."},
                                                  {"role": "assistant", "content": "Red."}]}) + "\n")
    second = sft_burst(SFTBurstParams(hf_dir=base.path, samples_jsonl=text_only, training=training,
                                      parent_adapter=first.adapter_sha256[:12]))
    assert second.parent_sha256 == first.adapter_sha256 != second.adapter_sha256
    assert read_adapter_record(second.adapter_path).lineage.vision_tower_sha256 == base.vision_sha256
