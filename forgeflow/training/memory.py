"""Whether a CUDA burst needs gradient checkpointing: its activations against the GPU's free memory.

Gradient checkpointing keeps only each decoder layer's input for the backward pass and recomputes the
rest, which costs about one more forward pass (a third more compute) to save most of the activation
memory. It is worth that only when the activations of a step would not fit: a 0.5B model with
16 packed rows of 2,048 tokens keeps about 65 GB of activations, which a 141 GB H200 holds and an
80 GB GPU does not.
:func:`checkpointing_decision` estimates the activation memory of one step without checkpointing
(:func:`activation_bytes`) and turns checkpointing off when that fits :data:`ACTIVATION_BUDGET` of
the memory the GPU has free once the model is loaded. ``BurstConfig.gradient_checkpointing`` True or
False overrides it; on the CPU a burst never checkpoints (memory is rarely what limits it there).

The estimate counts, per token and decoder layer, the tensors autograd keeps for a Llama/Qwen2-style
block (RMSNorm, grouped-query attention with rotary embeddings through a kernel that keeps no
``(seq, seq)`` scores, a gated MLP, LoRA on the seven projections with frozen weights), the method of
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198,
section 4.1: ``34 * hidden`` bytes per token for a fully trained GPT layer in 16-bit, without the
attention scores), redone term by term in :func:`per_token_layer_bytes` for frozen weights with LoRA,
whose projections keep less and whose float32 adapters keep float32 copies of their inputs.
``benchmarks/gpu_burst.py`` prints this estimate beside the measured peak memory of each burst it runs,
so the estimate is checked on the GPU it is used on.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

ACTIVATION_BUDGET = 0.7
"""Share of the GPU memory free after the model is loaded that a step's activations may take without
gradient checkpointing. The rest is for the backward pass's transient gradients, the optimizer's state,
the allocator's fragmentation and what the estimate leaves out (the fused loss's tiles, the embedding's
token ids)."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per element of the training dtypes a device plan names."""


class CheckpointingDecision(BaseModel):
    """Whether one burst checkpoints, and the figures it was decided on.

    Attributes:
        checkpointing: recompute activations in the backward pass.
        activation_bytes: estimated activations of one step without checkpointing (bytes).
        free_bytes: GPU memory free once the model was loaded (bytes).
        budget_bytes: :data:`ACTIVATION_BUDGET` of ``free_bytes``.
        tokens_per_step: rows x tokens per row the estimate was made for.
    """

    model_config = ConfigDict(frozen=True)

    checkpointing: bool
    activation_bytes: int
    free_bytes: int
    budget_bytes: int
    tokens_per_step: int

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
    """Bytes autograd keeps per token in one decoder layer of a Llama/Qwen2-style model with LoRA on its
    seven projections, without gradient checkpointing.

    With ``e`` bytes per element of ``dtype``, ``a`` of ``adapter_dtype`` (peft keeps adapters in float32
    when the model is in bfloat16: ``get_peft_model(..., autocast_adapter_dtype=True)``), ``h`` the hidden
    size, ``kv`` the key/value width (``num_key_value_heads * head_dim``) and ``I`` the MLP's intermediate
    size, the tensors kept are:

    * the two RMSNorms' float32 inputs and reciprocal RMS (transformers computes them in float32):
      ``2 * (4*h + 4)``;
    * the frozen projections keep nothing (their input gradient needs only the weight); each LoRA keeps
      its input for ``lora_A``'s gradient: when ``a != e`` a float32 copy per projection (q, k, v, o,
      gate, up: ``6 * a*h``; down: ``a*I``), else the shared inputs (attention input and MLP input:
      ``2 * e*h``, the o projection's input is the attention output; down: ``e*I``); and its rank-``r``
      intermediate for ``lora_B``'s (``7 * a*r``);
    * attention: queries, keys and values after the rotary embedding and the output (``e*(2*h + 2*kv)``)
      and the kernel's float32 log-sum-exp per head (``4 * heads``), no ``(seq, seq)`` scores;
    * the gated MLP: the SiLU's input, the up projection's output and the SiLU's output (``3 * e*I``).

    Checked against ``torch.autograd.graph.saved_tensors_hooks`` on a small Qwen2 in float32 and bfloat16
    (``tests/core/training/test_memory.py``).

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
    """Estimated activations of one training step without gradient checkpointing (bytes):
    :func:`per_token_layer_bytes` x ``num_hidden_layers`` x ``tokens_per_step``, plus per token the rotary
    tables (``2 * e*head_dim``), the final norm (``4*h + 4``) and the LM head's input (``e*h``). The logits
    add nothing: the fused chunked loss never builds them (:mod:`forgeflow.training.burst`).

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
    """Checkpoint when a step's estimated activations exceed :data:`ACTIVATION_BUDGET` of ``free_bytes``.

    Args:
        model_config: the model's config (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``; a transformers config or a dict).
        tokens_per_step: rows per step x tokens per row (a packed row's ``max_length``).
        dtype: the training dtype (``bfloat16``, ``float16`` or ``float32``).
        lora_r: the adapter's rank.
        free_bytes: GPU memory free with the model loaded (``torch.cuda.mem_get_info()[0]``).

    Raises:
        ValueError: the config lacks a field the estimate needs.
    """
    need = activation_bytes(model_config, tokens_per_step, dtype, lora_r)
    budget = int(ACTIVATION_BUDGET * free_bytes)
    return CheckpointingDecision(checkpointing=need > budget, activation_bytes=need, free_bytes=free_bytes,
                                 budget_bytes=budget, tokens_per_step=tokens_per_step)
