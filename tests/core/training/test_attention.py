"""The attention of padding-free bursts: the torch varlen registration checked on the CPU against
SDPA's block-causal mask (a CPU reference kernel with ``varlen_attn``'s signature stands in for the
CUDA one), and its call options for this torch and torch 2.10 (the GPU machine may run another)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from forgeflow.training.attention import (
    VARLEN_ATTENTION,
    choose_attention,
    register_torch_varlen_attention,
    varlen_call_options,
)

DIMS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, max_position_embeddings=512, tie_word_embeddings=True)
"""A tiny Qwen2 with grouped-query attention (4 query heads, 2 key/value heads)."""


def _reference_kernel(query: Any, key: Any, value: Any, cu_seq_q: Any, cu_seq_k: Any, max_q: int, max_k: int, *,
                      return_aux: Any = None, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                      enable_gqa: bool = False) -> Any:
    """``varlen_attn``'s contract on the CPU: causal attention within each document of
    ``(total_tokens, heads, head_dim)`` tensors delimited by ``cu_seq_q``."""
    import torch
    import torch.nn.functional as F

    assert window_size == (-1, 0) and cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert max_q == int(cu_seq_q.diff().max())
    bounds = cu_seq_q.tolist()
    out = [F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (query, key, value)), is_causal=True,
                                          scale=scale, enable_gqa=enable_gqa).transpose(0, 1)
           for s, e in zip(bounds, bounds[1:], strict=False)]
    return torch.cat(out)


def _torch_2_10_kernel(query: Any, key: Any, value: Any, cu_seq_q: Any, cu_seq_k: Any, max_q: int, max_k: int,
                       is_causal: bool = False, return_aux: Any = None) -> Any:
    """torch 2.10's ``varlen_attn`` signature (``is_causal``, no ``scale``/``enable_gqa``)."""
    assert is_causal and query.shape[1] == key.shape[1]  # key/value heads repeated by the caller
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0))


def _model(attn: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**DIMS, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn).eval()


@pytest.mark.parametrize("kernel", [_reference_kernel, _torch_2_10_kernel], ids=["this-torch", "torch-2.10"])
def test_registered_varlen_attention_matches_sdpa_on_a_packed_row(kernel: Any) -> None:
    import torch

    assert register_torch_varlen_attention(kernel) == VARLEN_ATTENTION
    lengths = [5, 9, 3]
    ids = torch.randint(2, DIMS["vocab_size"], (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    boundaries = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 9, "max_length_k": 9}
    with torch.no_grad():
        sdpa = _model("sdpa")(input_ids=ids, position_ids=positions, use_cache=False).logits
        varlen = _model(VARLEN_ATTENTION)(input_ids=ids, position_ids=positions, use_cache=False, **boundaries).logits
        alone = _model("sdpa")(input_ids=ids[:, 5:14], use_cache=False).logits  # the second document by itself
    torch.testing.assert_close(varlen, sdpa, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(varlen[:, 5:14], alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="needs a padding-free batch"):
        _model(VARLEN_ATTENTION)(input_ids=ids, position_ids=positions, use_cache=False)


def test_varlen_options_follow_this_torch_and_older_signatures() -> None:
    """This torch's real ``varlen_attn`` signature, then torch 2.10's, whose grouped-query heads must be
    repeated."""
    from torch.nn.attention.varlen import varlen_attn

    here = frozenset(inspect.signature(varlen_attn).parameters)
    options, repeat = varlen_call_options(here, 14, 2, 64, 64 ** -0.5)
    assert options == {"window_size": (-1, 0), "scale": 64 ** -0.5, "enable_gqa": True} and repeat == 1
    assert varlen_call_options(here, 4, 4, 64, None) == ({"window_size": (-1, 0), "scale": None}, 1)
    old = frozenset(inspect.signature(_torch_2_10_kernel).parameters)
    assert varlen_call_options(old, 14, 2, 64, 64 ** -0.5) == ({"is_causal": True}, 7)
    with pytest.raises(RuntimeError, match="takes no scale"):
        varlen_call_options(old, 14, 2, 64, 0.5)
    with pytest.raises(RuntimeError, match="not a multiple"):
        varlen_call_options(here, 14, 4, 64, None)


def test_attention_follows_device_dtype_and_installed_kernels() -> None:
    assert choose_attention("cpu", "float32", flash_attn=True, torch_varlen=True) == "sdpa"
    assert choose_attention("cuda", "bfloat16", flash_attn=True, torch_varlen=True) == "flash_attention_2"
    assert choose_attention("cuda", "bfloat16", flash_attn=False, torch_varlen=True) == VARLEN_ATTENTION
    assert choose_attention("cuda", "bfloat16", flash_attn=False, torch_varlen=False) == "sdpa"
    assert choose_attention("cuda", "float32", flash_attn=True, torch_varlen=True) == "sdpa"  # kernels: half only
