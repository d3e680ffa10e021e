"""The attention implementation a padding-free SFT burst loads its model with.

A padding-free batch (TRL's ``DataCollatorForLanguageModeling(padding_free=True)``, which bfd packing
turns on) is one flattened sequence of documents, with per-document ``position_ids`` and the
boundaries ``cu_seq_lens_q/k`` (cumulative lengths, int32) and ``max_length_q/k``. Three
implementations keep each document attending only to itself (causal):

* ``flash_attention_2`` (the ``flash_attn`` package; CUDA, bf16/fp16): transformers' flash path
  reads ``cu_seq_lens_*`` and calls the varlen kernel (Dao, "FlashAttention-2", 2023).
* :data:`VARLEN_ATTENTION` (``torch_varlen``; CUDA, bf16/fp16): PyTorch's own FlashAttention varlen
  kernel ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10), registered here as a transformers
  attention function (``transformers.AttentionInterface.register``) by
  :func:`register_torch_varlen_attention`. A name outside transformers' mask registry
  (``AttentionMaskInterface``) is given no mask, so the kernel's ``cu_seq_lens`` alone delimit the
  documents.
* ``sdpa`` (CPU, or CUDA without bf16): transformers derives a block-causal mask from packed
  ``position_ids`` when no attention mask is given (``masking_utils.find_packed_sequence_indices``).

:func:`forgeflow.training.device.device_plan` picks one from the machine's answers
(:func:`flash_attn_installed`, :func:`torch_varlen_available`).
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
    """Keyword arguments for ``torch.nn.attention.varlen.varlen_attn`` as this torch spells them.

    torch 2.10 takes ``is_causal`` and has no grouped-query option; later versions take
    ``window_size=(-1, 0)`` for causal attention, ``scale`` and ``enable_gqa`` (the
    ``torch.nn.attention.varlen`` documentation of each release).

    Args:
        params: the parameter names of this torch's ``varlen_attn``.
        q_heads: query heads; kv_heads: key/value heads (``q_heads`` a multiple of it).
        head_dim: features per head.
        scale: the softmax scale the model asks for (None: the kernel's default 1/sqrt(head_dim)).

    Returns:
        (keyword arguments, how many times to repeat each key/value head before the call: 1 when
        the kernel handles grouped-query attention itself or there is none).

    Raises:
        RuntimeError: ``q_heads`` is not a multiple of ``kv_heads``, or the model asks for a scale
            other than 1/sqrt(head_dim) from a ``varlen_attn`` that takes none.
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
    """Register a varlen FlashAttention kernel as the transformers attention :data:`VARLEN_ATTENTION`.

    The registered function takes query/key/value of shape ``(1, heads, total_tokens, head_dim)``
    (one padding-free row) and the ``cu_seq_lens_q/k`` and ``max_length_q/k`` that TRL's padding-free
    collator passes through the model, calls the kernel on ``(total_tokens, heads, head_dim)`` with
    int32 boundaries, and returns ``(1, total_tokens, heads, head_dim)`` (the layout of transformers'
    flash path) and no attention weights. Grouped-query attention is native (``enable_gqa``) where the
    kernel takes it, else the key/value heads are repeated (:func:`varlen_call_options`). Registering
    again replaces the earlier function.

    Args:
        kernel: the kernel, with ``varlen_attn``'s signature (default: this torch's
            ``torch.nn.attention.varlen.varlen_attn``, CUDA and bf16/fp16 only; tests pass a CPU
            reference of the same signature).

    Returns:
        The name to pass as ``attn_implementation``.

    Raises:
        RuntimeError: no ``kernel`` and this torch has no ``torch.nn.attention.varlen`` (at
            registration); at a forward call, a batch that is not padding-free (no
            ``cu_seq_lens_q``, or more than one row).
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
    """The attention implementation of a padding-free burst (see the module docstring).

    Args:
        device: ``cpu`` or ``cuda``.
        dtype: the training dtype (``float32`` or ``bfloat16``); the FlashAttention kernels take
            half precision only.
        flash_attn: ``flash_attn`` is importable (:func:`flash_attn_installed`).
        torch_varlen: this torch has ``varlen_attn`` (:func:`torch_varlen_available`).

    Returns:
        ``flash_attention_2``, :data:`VARLEN_ATTENTION` or ``sdpa``.
    """
    if device != "cuda" or dtype == "float32":
        return "sdpa"
    if flash_attn:
        return "flash_attention_2"
    return VARLEN_ATTENTION if torch_varlen else "sdpa"
