"""The attention implementation a padding-free SFT burst loads its model with.

Each keeps a packed document attending to itself: ``flash_attention_2`` (Dao, "FlashAttention-2", 2023),
:data:`VARLEN_ATTENTION` (torch >= 2.10's ``varlen_attn``, registered with transformers; no mask, the
``cu_seq_lens`` delimit documents) and ``sdpa`` (``masking_utils.find_packed_sequence_indices``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

VARLEN_ATTENTION = "torch_varlen"
"""Name under which :func:`register_torch_varlen_attention` registers PyTorch's varlen FlashAttention."""


def flash_attn_installed() -> bool:
    """True iff the ``flash_attn`` package can be imported (transformers' ``flash_attention_2``)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def torch_varlen_available() -> bool:
    """True iff this torch has ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_call_options(params: frozenset[str], q_heads: int, kv_heads: int, head_dim: int,
                        scale: float | None) -> tuple[dict[str, Any], int]:
    """``varlen_attn`` keyword arguments as this torch spells them, and how often to repeat each kv head.

    Raises:
        RuntimeError: ``q_heads`` not a multiple of ``kv_heads``, or a scale ``varlen_attn`` cannot take.
    """
    if kv_heads <= 0 or q_heads % kv_heads:
        raise RuntimeError(f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads")
    options: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        options["scale"] = scale
    elif scale is not None and abs(scale - head_dim ** -0.5) > 1e-6 * head_dim ** -0.5:
        raise RuntimeError(f"this torch's varlen_attn takes no scale; the model asks for {scale} "
                           f"instead of 1/sqrt({head_dim})")
    repeat = q_heads // kv_heads
    if repeat > 1 and "enable_gqa" in params:
        options["enable_gqa"] = True
        repeat = 1
    return options, repeat


def register_torch_varlen_attention(kernel: Callable[..., Any] | None = None) -> str:
    """Register a varlen FlashAttention kernel as :data:`VARLEN_ATTENTION`; returns that name.

    q/k/v ``(1, heads, total_tokens, head_dim)`` in, ``(1, total_tokens, heads, head_dim)`` out; ``kernel``
    defaults to this torch's ``varlen_attn`` (CUDA, bf16/fp16).

    Raises:
        RuntimeError: no kernel available; at a forward call, a batch that is not padding-free.
    """
    import inspect

    import torch
    from transformers import AttentionInterface

    if kernel is None:
        try:
            from torch.nn.attention.varlen import varlen_attn as kernel
        except ImportError as exc:  # torch < 2.10
            raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen") from exc
    params = frozenset(inspect.signature(kernel).parameters)

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                  dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is None or cu_k is None or query.shape[0] != 1:
            raise RuntimeError(f"{VARLEN_ATTENTION} attention needs a padding-free batch "
                               "(one row with cu_seq_lens_q/k from TRL's collator)")
        # (1, heads, total_tokens, head_dim) -> (total_tokens, heads, head_dim)
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        options, repeat = varlen_call_options(params, q.shape[1], k.shape[1], q.shape[2], scaling)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = kernel(q, k, v, cu_q.to(device=q.device, dtype=torch.int32),
                     cu_k.to(device=q.device, dtype=torch.int32), int(kwargs["max_length_q"]),
                     int(kwargs["max_length_k"]), **options)
        return out.unsqueeze(0), None

    AttentionInterface.register(VARLEN_ATTENTION, attention)
    return VARLEN_ATTENTION


def choose_attention(device: str, dtype: str, flash_attn: bool, torch_varlen: bool) -> str:
    """``flash_attention_2``, :data:`VARLEN_ATTENTION` or ``sdpa`` (the FlashAttention kernels: CUDA half precision)."""
    if device != "cuda" or dtype == "float32":
        return "sdpa"
    if flash_attn:
        return "flash_attention_2"
    return VARLEN_ATTENTION if torch_varlen else "sdpa"
