"""Issue 35: ``sft-burst``'s and ``windows``' ``params.training`` is the core's BurstConfig: one name and one
default per knob from the run form to TRL, no copy in between."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.training import SFTBurstParams, WindowsParams
from forgeflow.training.burst import BurstConfig, sft_arguments
from forgeflow.training.device import device_plan

SFT = {"hf_dir": "/m/hf", "samples_jsonl": "/d/chats.jsonl"}


def test_the_run_forms_training_block_is_what_the_burst_trains_with() -> None:
    params = SFTBurstParams.model_validate({**SFT, "training": {"batch_size": 3, "lora_r": 4, "max_steps": 7}})
    assert type(params.training) is BurstConfig
    assert type(WindowsParams(job_id="j").training) is BurstConfig
    args = sft_arguments(params.training, device_plan("cpu"), ["messages"])
    assert (args["per_device_train_batch_size"], args["max_steps"], args["max_length"]) == (3, 7, 2048)
    assert (params.training.lora_r, params.training.lora_alpha) == (4, 8)  # alpha follows the rank unless given
    form = SFTBurstParams.model_validate({**SFT, "training": {"lora_r": 16, "lora_alpha": None}})  # the form's null
    assert form.training.lora_alpha == 32


def test_core_knobs_are_settable_by_their_one_name_and_unknown_ones_refused() -> None:
    params = SFTBurstParams.model_validate({**SFT, "training": {"lora_r": 4, "lora_alpha": 4, "lora_dropout": 0.1}})
    assert (params.training.lora_alpha, params.training.lora_dropout) == (4, 0.1)
    with pytest.raises(ValidationError, match="training.per_device_train_batch_size"):
        SFTBurstParams.model_validate({**SFT, "training": {"per_device_train_batch_size": 2}})
    assert BurstConfig() == SFTBurstParams.model_validate(SFT).training  # the form's defaults are the core's
