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


RL = {"hf_dir": "/m/hf", "tasks_jsonl": "/d/tasks.jsonl"}


def test_rl_bursts_training_block_is_the_core_config_and_a_bad_value_is_named_there() -> None:
    """Issue 35: ``rl-burst``'s ``params.training`` is :class:`RLBurstConfig` itself (no ``RLHyperParams`` copy):
    every core knob is in the form by its one name, and the core model's own check names the user's field."""
    from flows.training import RLBurstParams
    from forgeflow.training.rl import RLBurstConfig, _trl_objects

    params = RLBurstParams.model_validate({**RL, "training": {"lora_r": 4, "prompts_per_step": 2, "temperature": 0.7,
                                                              "num_generations": 3, "max_steps": 5}})
    assert type(params.training) is RLBurstConfig
    assert RLBurstConfig() == RLBurstParams.model_validate(RL).training  # the form's defaults are the core's
    args, lora = _trl_objects(params.training, "/tmp/unused", with_lora=True)
    assert (args.per_device_train_batch_size, args.max_steps, args.temperature) == (6, 5, 0.7)
    assert (lora.r, lora.lora_alpha) == (4, 8)  # alpha follows the rank unless given, as in an SFT burst
    for bad, field, reason in [({"temperature": 3.0}, "training.temperature", "less than or equal to 2"),
                               ({"lora_alpha": 0}, "training.lora_alpha", "greater than or equal to 1"),
                               ({"verifier_memory_mb": 15}, "training.verifier_memory_mb", "greater than or equal to 16"),
                               ({"algorithm": "rloo", "episode": {}}, "training", "needs algorithm 'grpo'"),
                               ({"memory_mb": 512}, "training.memory_mb", "Extra inputs")]:
        with pytest.raises(ValidationError, match=reason) as caught:
            RLBurstParams.model_validate({**RL, "training": bad})
        (error,) = caught.value.errors()
        assert ".".join(str(p) for p in error["loc"]) == field, error


def test_a_knob_of_both_bursts_has_one_name_and_one_default() -> None:
    """The knobs SFT and RL bursts share are spelt and defaulted alike; the learning rate and the health gates
    differ on purpose (an RL surrogate loss is not an SFT loss: its trend gate is off)."""
    from forgeflow.training.rl import RLBurstConfig

    shared = set(BurstConfig.model_fields) & set(RLBurstConfig.model_fields)
    assert {"max_steps", "learning_rate", "seed", "device", "gates", "lora_r", "lora_alpha", "lora_dropout",
            "lora_target_modules"} <= shared
    differ = {name for name in shared if getattr(BurstConfig(), name) != getattr(RLBurstConfig(), name)}
    assert differ == {"learning_rate", "gates"}
    assert not {"batch_size", "per_device_train_batch_size", "memory_mb", "cpus", "verifier_backend"} \
        & set(RLBurstConfig.model_fields)  # rows per step: prompts_per_step x num_generations; the rest: params.sandbox
