"""One burst for every device: the device plan a burst config resolves to on a CPU machine and on a
CUDA one (the machine's answers given explicitly: this machine has no GPU), and the merge reading the
training dtype back from an adapter's lineage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import PreflightError
from forgeflow.packaging.gguf import training_dtype
from forgeflow.training.burst import BurstConfig
from forgeflow.training.device import device_plan
from forgeflow.training.rl import RLBurstConfig


def test_auto_is_cuda_in_bfloat16_with_checkpointing_when_a_gpu_is_there() -> None:
    plan = device_plan("auto", cuda_available=True, bf16_supported=True)
    assert (plan.device, plan.dtype) == ("cuda", "bfloat16")
    assert plan.trainer_args == {"use_cpu": False, "bf16": True, "fp16": False, "gradient_checkpointing": True}
    older = device_plan("auto", cuda_available=True, bf16_supported=False)  # e.g. a V100: no bf16
    assert (older.dtype, older.trainer_args["bf16"]) == ("float32", False)


def test_auto_is_the_cpu_in_float32_without_a_gpu_and_cuda_is_refused() -> None:
    plan = device_plan("auto", cuda_available=False)
    assert (plan.device, plan.dtype) == ("cpu", "float32")
    assert plan.trainer_args == {"use_cpu": True, "bf16": False, "fp16": False, "gradient_checkpointing": False}
    assert device_plan("cpu", cuda_available=True, bf16_supported=True).device == "cpu"
    with pytest.raises(PreflightError, match="device 'cuda' was asked for but torch.cuda.is_available"):
        device_plan("cuda", cuda_available=False)
    import torch

    assert device_plan().device == ("cuda" if torch.cuda.is_available() else "cpu")  # this machine's answer


def test_both_burst_configs_take_a_device_and_refuse_others() -> None:
    assert BurstConfig().device == RLBurstConfig().device == "auto"
    with pytest.raises(ValueError, match="device"):
        BurstConfig(device="tpu")


def test_the_merge_uses_the_dtype_the_lineage_records(tmp_path: Path) -> None:
    assert training_dtype(tmp_path) == "float32"  # no lineage.json: float32
    (tmp_path / "lineage.json").write_text(json.dumps({"lineage": {"dtype": "bfloat16"}}))
    assert training_dtype(tmp_path) == "bfloat16"
    (tmp_path / "lineage.json").write_text(json.dumps({"lineage": {"dtype": "int4"}}))
    assert training_dtype(tmp_path) == "float32"
