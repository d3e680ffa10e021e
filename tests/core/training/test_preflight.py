"""The burst preflight (forgeflow.training.preflight): templates, validation classes, early-stopping
patience and free disk space checked before any model loads, on real file systems."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.training.preflight import (
    estimate_checkpoint_bytes,
    lora_parameter_count,
    preflight,
)


def test_preflight_errors_on_missing_and_empty_templates_listing_both(tmp_path: Path) -> None:
    good, empty, blank = tmp_path / "good.jinja", tmp_path / "empty.jinja", tmp_path / "blank.md"
    good.write_text("{{ messages }}")
    empty.write_text("")
    blank.write_text("  \n\n")
    with pytest.raises(PreflightError) as info:
        preflight(template_files=[good, empty, tmp_path / "missing.md", blank])
    message = str(info.value)
    assert f"{tmp_path / 'missing.md'} does not exist" in message
    assert f"{empty} is empty" in message and f"{blank} is empty" in message
    assert str(good) not in message
    assert preflight(template_files=[good]).template_files == {str(good): good.stat().st_size}


def test_preflight_excludes_a_class_with_too_few_items_with_a_warning() -> None:
    items = ([{"instance_id": f"a{i}", "task_type": "func_pm_op_swap"} for i in range(3)]
             + [{"instance_id": "b0", "task_type": "func_pm_remove_assign"}])
    report = preflight(validation_items=items, min_items_per_class=2)
    assert report.validation_classes == {"func_pm_op_swap": 3}
    assert report.excluded_classes == {"func_pm_remove_assign": 1}
    assert report.validation_instance_ids == ["a0", "a1", "a2"]
    assert len(report.warnings) == 1 and "'func_pm_remove_assign' has 1 item(s)" in report.warnings[0]
    with pytest.raises(PreflightError, match="nothing left to validate"):
        preflight(validation_items=items, min_items_per_class=4)
    with pytest.raises(InputError, match=r"validation_items\[1\]\.task_type"):
        preflight(validation_items=[items[0], {"instance_id": "x"}])


def test_preflight_counts_patience_in_evaluations() -> None:
    items = [{"instance_id": f"a{i}", "task_type": "t"} for i in range(2)]
    report = preflight(validation_items=items, early_stopping_patience_evals=3, eval_steps=5, max_steps=10)
    assert (report.early_stopping_patience_evals, report.early_stopping_patience_steps) == (3, 15)
    assert "15 steps exceeds max_steps=10" in report.warnings[0]
    with pytest.raises(PreflightError, match="needs a validation split"):
        preflight(early_stopping_patience_evals=3)
    with pytest.raises(PreflightError, match=">= 1 evaluation"):
        preflight(validation_items=items, early_stopping_patience_evals=0)


def test_preflight_checks_free_disk_space_naming_path_and_numbers(tmp_path: Path) -> None:
    target = tmp_path / "not-yet" / "adapter"  # measured on its nearest existing parent
    free = shutil.disk_usage(tmp_path).free
    report = preflight(checkpoint_dir=target, required_free_bytes=1024)
    assert report.free_bytes is not None and report.free_bytes > 1024 and report.checkpoint_dir == target
    need = free + 10 * 2**40  # 10 TiB more than there is
    with pytest.raises(PreflightError, match=rf"{target} \(file system of {tmp_path}\) has \d+ bytes free") as info:
        preflight(checkpoint_dir=target, required_free_bytes=need)
    assert f"{need} bytes" in str(info.value)


def test_checkpoint_estimate_matches_peft_trainable_parameters(tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")
    model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=4, target_modules=list(targets)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameter_count(tmp_path, 4, targets) == trainable
    assert estimate_checkpoint_bytes(tmp_path, 4, targets) == 2 * (4 * trainable + 2**20)
    with pytest.raises(InputError, match="lm_head"):
        lora_parameter_count(tmp_path, 4, ["lm_head"])
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == 64
