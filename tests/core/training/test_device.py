"""One burst for every device: the device plan a burst config resolves to on a CPU machine and on a
CUDA one (the machine's answers given explicitly: this machine has no GPU), with the attention its
packed batches need and the trainer arguments that follow, and the merge reading the training dtype
back from an adapter's lineage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.packaging.gguf import training_dtype
from forgeflow.training.burst import BurstConfig, burst_plan, sft_arguments
from forgeflow.training.device import device_plan
from forgeflow.training.rl import RLBurstConfig


def test_auto_is_cuda_in_bfloat16_with_checkpointing_when_a_gpu_is_there() -> None:
    plan = device_plan("auto", cuda_available=True, bf16_supported=True, flash_attn=True)
    assert (plan.device, plan.dtype, plan.attention) == ("cuda", "bfloat16", "flash_attention_2")
    assert plan.trainer_args == {"use_cpu": False, "bf16": True, "fp16": False, "activation_checkpointing": True}
    older = device_plan("auto", cuda_available=True, bf16_supported=False, flash_attn=True)  # e.g. a V100: no bf16
    assert (older.dtype, older.trainer_args["bf16"], older.attention) == ("float32", False, "sdpa")


def test_cuda_attention_is_flash_attn_then_torch_varlen_then_sdpa() -> None:
    def attention(flash_attn: bool, torch_varlen: bool) -> str:
        return device_plan("cuda", cuda_available=True, bf16_supported=True, flash_attn=flash_attn,
                           torch_varlen=torch_varlen).attention

    assert attention(True, True) == "flash_attention_2"
    assert attention(False, True) == "torch_varlen"
    assert attention(False, False) == "sdpa"
    # an unpacked burst has no sequence boundaries for the varlen kernel: SDPA then; flash_attn unpads itself
    varlen = device_plan("cuda", cuda_available=True, bf16_supported=True, flash_attn=False, torch_varlen=True)
    assert burst_plan(BurstConfig(packing=False), varlen).attention == "sdpa"
    assert burst_plan(BurstConfig(), varlen) == varlen
    flash = device_plan("cuda", cuda_available=True, bf16_supported=True, flash_attn=True)
    assert burst_plan(BurstConfig(packing=False), flash).attention == "flash_attention_2"


def test_the_cuda_burst_packs_padding_free_with_the_fused_loss_in_bf16() -> None:
    """The ``SFTConfig`` arguments of a burst on a GPU (built here without one: SFTConfig itself would
    check for CUDA): the same packing and loss as on the CPU, plus bf16 and gradient checkpointing."""
    plan = device_plan("auto", cuda_available=True, bf16_supported=True, flash_attn=False, torch_varlen=True)
    cuda = sft_arguments(BurstConfig(), plan, ["messages"])
    cpu = sft_arguments(BurstConfig(), device_plan("auto", cuda_available=False), ["messages"])
    for args in (cuda, cpu):
        assert (args["packing"], args["packing_strategy"], args["padding_free"], args["loss_type"]) == (
            True, "bfd", True, "nll")
        assert (args["assistant_only_loss"], args["completion_only_loss"]) == (True, False)
    assert (cuda["bf16"], cuda["activation_checkpointing"], cuda["use_cpu"]) == (True, True, False)
    assert (cpu["bf16"], cpu["activation_checkpointing"], cpu["use_cpu"]) == (False, False, True)
    unpacked = sft_arguments(BurstConfig(packing=False), plan, ["prompt", "completion"])
    assert (unpacked["packing"], unpacked["padding_free"]) == (False, False)
    assert (unpacked["assistant_only_loss"], unpacked["completion_only_loss"]) == (True, True)
    tokens = sft_arguments(BurstConfig(), plan, ["input_ids"])  # the GPU benchmark's synthetic tokens
    assert (tokens["assistant_only_loss"], tokens["completion_only_loss"]) == (False, False)
    with pytest.raises(InputError, match="'messages', 'prompt' \\+ 'completion' or 'input_ids'"):
        sft_arguments(BurstConfig(), plan, ["text"])


def test_gradient_checkpointing_follows_the_device_unless_the_config_sets_it() -> None:
    """``BurstConfig.gradient_checkpointing`` None keeps the device plan's (on with CUDA, off on the CPU);
    True or False overrides it in the plan (which the lineage records) and in the trainer arguments, even
    for a plan not made by :func:`burst_plan` (the GPU benchmark's)."""
    cuda = device_plan("cuda", cuda_available=True, bf16_supported=True, flash_attn=False, torch_varlen=False)
    cpu = device_plan("cpu", cuda_available=False)
    for plan, default in ((cuda, True), (cpu, False)):
        assert burst_plan(BurstConfig(), plan).trainer_args["activation_checkpointing"] is default
        assert sft_arguments(BurstConfig(), plan, ["messages"])["activation_checkpointing"] is default
        for switch in (True, False):
            config = BurstConfig(gradient_checkpointing=switch)
            assert burst_plan(config, plan).trainer_args["activation_checkpointing"] is switch
            assert sft_arguments(config, plan, ["messages"])["activation_checkpointing"] is switch
    assert burst_plan(BurstConfig(gradient_checkpointing=False), cuda).trainer_args["bf16"] is True  # rest kept


def test_auto_is_the_cpu_in_float32_without_a_gpu_and_cuda_is_refused() -> None:
    plan = device_plan("auto", cuda_available=False, flash_attn=True)
    assert (plan.device, plan.dtype, plan.attention) == ("cpu", "float32", "sdpa")
    assert plan.model_kwargs()["attn_implementation"] == "sdpa"
    assert plan.trainer_args == {"use_cpu": True, "bf16": False, "fp16": False, "activation_checkpointing": False}
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
