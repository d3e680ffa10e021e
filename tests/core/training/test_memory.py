"""Gradient checkpointing decided by memory: the activation estimate against what autograd really keeps,
and the decision a CUDA burst takes from it (the GPU's free memory given explicitly: no GPU here).

The estimate is checked against a real forward pass of a small Qwen2 with LoRA on the CPU: the bytes
of every tensor autograd saves for the backward pass (``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once, the model's own weights left out) must not exceed the estimate, and the
estimate must not overstate them by more than half (a gross overstatement would checkpoint bursts that
fit). On the GPU, ``benchmarks/gpu_burst.py`` prints the estimate beside each burst's measured peak.
"""

from __future__ import annotations

from typing import Any

import pytest

from forgeflow.training.burst import BurstConfig, burst_plan, resolve_checkpointing, sft_arguments, tokens_per_step
from forgeflow.training.device import device_plan
from forgeflow.training.memory import ACTIVATION_BUDGET, activation_bytes, checkpointing_decision

QWEN2_SMALL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, tie_word_embeddings=True)
"""A small Qwen2 with the ratios of the real ones (grouped-query attention, a gated MLP 2.75x wide)."""

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2)
"""Qwen2.5-0.5B's shape (its config.json), the GPU check's model."""

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4)
"""Qwen2.5-7B's shape (its config.json)."""


def _saved_activation_bytes(dtype: str, tokens: int, lora_r: int) -> int:
    """Bytes of the tensors autograd keeps for one forward pass of :data:`QWEN2_SMALL` with LoRA on every
    linear layer of its blocks, ``tokens`` tokens in one sequence (SDPA, causal, no mask), each storage
    once, parameters excluded."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_SMALL), dtype=getattr(torch, dtype),
                                             attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    model.train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(2, QWEN2_SMALL["vocab_size"], (1, tokens))
    # no loss: the burst's fused loss never builds the full logits (the LM head's input is counted)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=ids).logits
    assert logits.requires_grad  # the graph (and every saved tensor) is alive while the sizes are summed
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_estimate_covers_what_autograd_keeps_and_does_not_overstate_it(dtype: str) -> None:
    tokens, lora_r = 512, 8
    measured = _saved_activation_bytes(dtype, tokens, lora_r)
    estimate = activation_bytes(QWEN2_SMALL, tokens, dtype, lora_r)
    assert measured <= estimate <= 1.5 * measured, (measured, estimate)


def test_the_estimate_grows_with_tokens_layers_and_element_size() -> None:
    one = activation_bytes(QWEN25_05B, 2048, "bfloat16", 16)
    assert activation_bytes(QWEN25_05B, 16 * 2048, "bfloat16", 16) == 16 * one
    deeper = activation_bytes({**QWEN25_05B, "num_hidden_layers": 48}, 2048, "bfloat16", 16)
    assert 1.9 * one < deeper < 2 * one  # the embedding and final norm do not double
    # float32 throughout keeps more, but not twice: in bfloat16 the norms and the adapters' inputs are float32
    assert 1.1 * one < activation_bytes(QWEN25_05B, 2048, "float32", 16) < 2 * one
    with pytest.raises(ValueError, match="intermediate_size"):
        activation_bytes({"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14}, 2048,
                         "bfloat16", 16)


def test_checkpointing_goes_off_where_a_steps_activations_fit_the_gpu() -> None:
    """The GPU check's burst (0.5B, 16 rows of 2,048 tokens: about 65 GB of activations) fits an H200 (about
    139 GB free with the model loaded) without checkpointing, not an 80 GB GPU (8 rows do); 64 rows need it
    on the H200; a 7B model's 8 rows of 4,096 tokens need it, one row fits."""
    h200, a100 = 139 * 10**9, 78 * 10**9
    step = checkpointing_decision(QWEN25_05B, 16 * 2048, "bfloat16", 16, h200)
    assert not step.checkpointing and step.activation_bytes <= step.budget_bytes == int(ACTIVATION_BUDGET * h200)
    assert checkpointing_decision(QWEN25_05B, 16 * 2048, "bfloat16", 16, a100).checkpointing
    assert not checkpointing_decision(QWEN25_05B, 8 * 2048, "bfloat16", 16, a100).checkpointing
    assert checkpointing_decision(QWEN25_05B, 64 * 2048, "bfloat16", 16, h200).checkpointing
    assert checkpointing_decision(QWEN25_7B, 8 * 4096, "bfloat16", 16, h200).checkpointing
    assert not checkpointing_decision(QWEN25_7B, 4096, "bfloat16", 16, h200).checkpointing
    assert "gradient checkpointing off" in step.describe() and "GB free" in step.describe()


class _Model:
    """What :func:`resolve_checkpointing` reads of a loaded model: its config."""

    def __init__(self, **config: Any) -> None:
        self.config = config


def test_a_cuda_burst_decides_checkpointing_by_memory_unless_the_config_sets_it() -> None:
    cuda = burst_plan(BurstConfig(), device_plan("cuda", cuda_available=True, bf16_supported=True, flash_attn=False,
                                                 torch_varlen=True))
    model = _Model(**QWEN25_05B)
    config = BurstConfig(batch_size=16, max_length=2048, lora_r=16)
    assert tokens_per_step(config) == 16 * 2048
    plan, decision = resolve_checkpointing(model, config, cuda, free_bytes=139 * 10**9)
    assert decision is not None and decision.checkpointing is False
    assert sft_arguments(config, plan, ["messages"])["activation_checkpointing"] is False
    crowded, decision = resolve_checkpointing(model, config, cuda, free_bytes=20 * 10**9)
    assert decision is not None and crowded.trainer_args["activation_checkpointing"] is True
    for switch in (True, False):  # the user's choice is kept whatever the memory says
        forced = BurstConfig(batch_size=16, max_length=2048, gradient_checkpointing=switch)
        plan, decision = resolve_checkpointing(model, forced, burst_plan(forced, cuda), free_bytes=10**9)
        assert decision is None and plan.trainer_args["activation_checkpointing"] is switch
    cpu = device_plan("cpu", cuda_available=False)
    assert resolve_checkpointing(model, config, cpu, free_bytes=10**9) == (cpu, None)
