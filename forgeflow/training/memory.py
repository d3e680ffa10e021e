"""Whether a CUDA burst needs gradient checkpointing: a step's estimated activations (Korthikanti et al.,
arXiv:2205.05198, section 4.1, redone for LoRA) against :data:`ACTIVATION_BUDGET` of the free GPU memory.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ACTIVATION_BUDGET = 0.7
"""Share of the GPU memory free after the model is loaded that a step's activations may take without
gradient checkpointing. The rest is for the backward pass's transient gradients, the optimizer's state,
the allocator's fragmentation and what the estimate leaves out (the fused loss's tiles, the embedding's
token ids)."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per element of the training dtypes a device plan names."""


class CheckpointingDecision(BaseModel):
    """Whether one burst checkpoints, and the figures (bytes) it was decided on."""

    model_config = ConfigDict(frozen=True)

    checkpointing: bool
    activation_bytes: int = Field(description="estimated activations of one step without checkpointing")
    free_bytes: int = Field(description="GPU memory free once the model was loaded")
    budget_bytes: int = Field(description="ACTIVATION_BUDGET of free_bytes")
    tokens_per_step: int = Field(description="rows x tokens per row the estimate was made for")

    def describe(self) -> str:
        """One line for the burst's log: the decision and its figures in GB (10^9 bytes)."""
        return (f"gradient checkpointing {'on' if self.checkpointing else 'off'}: activations of "
                f"{self.tokens_per_step} tokens per step estimated at {self.activation_bytes / 1e9:.1f} GB, "
                f"budget {self.budget_bytes / 1e9:.1f} GB ({ACTIVATION_BUDGET:.0%} of "
                f"{self.free_bytes / 1e9:.1f} GB free)")


def _field(model_config: Any, *names: str) -> int:
    """The first of ``names`` that ``model_config`` sets (a transformers config or a mapping)."""
    for name in names:
        value = model_config.get(name) if isinstance(model_config, dict) else getattr(model_config, name, None)
        if value:
            return int(value)
    raise ValueError(f"the model config has none of {', '.join(names)}: cannot estimate its activation memory")


def per_token_layer_bytes(model_config: Any, dtype: str, lora_r: int, adapter_dtype: str = "float32") -> int:
    """Bytes autograd keeps per token in one Llama/Qwen2-style decoder layer with LoRA on its seven
    projections, without gradient checkpointing.

    With ``e``/``a`` bytes per element of ``dtype``/``adapter_dtype`` (peft keeps adapters in float32 for a
    bfloat16 model): RMSNorm float32 inputs and reciprocal RMS ``2 * (4*h + 4)``; LoRA inputs (``6 * a*h + a*I``
    when ``a != e``, else ``2 * e*h + e*I``) and intermediates ``7 * a*r``; attention ``e*(2*h + 2*kv)`` and
    log-sum-exp ``4 * heads``; gated MLP ``3 * e*I``; frozen projections nothing (checked in ``test_memory.py``).

    Raises:
        ValueError: the config lacks the hidden size, intermediate size or head counts.
    """
    e, a = DTYPE_BYTES[dtype], DTYPE_BYTES[adapter_dtype]
    hidden = _field(model_config, "hidden_size", "n_embd")
    intermediate = _field(model_config, "intermediate_size", "n_inner")
    heads = _field(model_config, "num_attention_heads", "n_head")
    kv_heads = _field(model_config, "num_key_value_heads", "num_attention_heads", "n_head")
    kv = kv_heads * _head_dim(model_config, hidden, heads)
    norms = 2 * (4 * hidden + 4)
    lora_inputs = a * (6 * hidden + intermediate) if a != e else e * (2 * hidden + intermediate)
    attention = e * (2 * hidden + 2 * kv) + 4 * heads
    mlp = 3 * e * intermediate
    return norms + lora_inputs + 7 * a * lora_r + attention + mlp


def _head_dim(model_config: Any, hidden: int, heads: int) -> int:
    """``head_dim`` where the config sets it, else ``hidden // heads``."""
    value = model_config.get("head_dim") if isinstance(model_config, dict) else getattr(model_config, "head_dim", None)
    return int(value) if value else hidden // heads


def activation_bytes(model_config: Any, tokens_per_step: int, dtype: str, lora_r: int,
                     adapter_dtype: str = "float32") -> int:
    """Estimated activations (bytes) of one step without checkpointing; no logits (the fused loss builds none).

    Raises:
        ValueError: the config lacks a field the estimate needs.
    """
    e = DTYPE_BYTES[dtype]
    layers = _field(model_config, "num_hidden_layers", "n_layer")
    hidden = _field(model_config, "hidden_size", "n_embd")
    heads = _field(model_config, "num_attention_heads", "n_head")
    outer = 2 * e * _head_dim(model_config, hidden, heads) + 4 * hidden + 4 + e * hidden
    return tokens_per_step * (layers * per_token_layer_bytes(model_config, dtype, lora_r, adapter_dtype) + outer)


def checkpointing_decision(model_config: Any, tokens_per_step: int, dtype: str, lora_r: int,
                           free_bytes: int) -> CheckpointingDecision:
    """Checkpoint when a step's estimated activations exceed :data:`ACTIVATION_BUDGET` of ``free_bytes``
    (GPU memory free with the model loaded; ``tokens_per_step``: rows x tokens per row).

    Raises:
        ValueError: the config lacks a field the estimate needs.
    """
    need = activation_bytes(model_config, tokens_per_step, dtype, lora_r)
    budget = int(ACTIVATION_BUDGET * free_bytes)
    return CheckpointingDecision(checkpointing=need > budget, activation_bytes=need, free_bytes=free_bytes,
                                 budget_bytes=budget, tokens_per_step=tokens_per_step)
