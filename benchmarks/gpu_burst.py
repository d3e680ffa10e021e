"""Benchmark: forgeflow's SFT burst path (TRL 1.16) vs a naive transformers + peft training loop.

``python -m benchmarks.gpu_burst [--small] [--steps N] [--warmup N]`` trains LoRA adapters on the same
model and the same synthetic SFT data twice, in one process:

* **model**: a Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` with random weights (transformers
  ``Qwen2Config``: hidden 896, 24 layers, 14 attention heads, 2 KV heads, intermediate 4864,
  vocabulary 151,936, tied embeddings; the shape of ``Qwen/Qwen2.5-0.5B``'s ``config.json``), bf16 on
  CUDA; LoRA r=16, alpha 32 on every linear layer of the blocks (peft ``target_modules="all-linear"``:
  q/k/v/o and gate/up/down projections; the LM head is not adapted).
* **data**: token sequences of random ids whose lengths are drawn uniformly from
  [``seq_len`` / 8, ``seq_len``] (``seq_len`` 2048), like SFT samples of mixed length; loss on every token.
  Throughput counts only real tokens (never padding), so both paths are measured in the same unit.
* **naive**: the standard loop: batches padded to their longest sample with an attention mask,
  ``model(input_ids, attention_mask, labels=labels)`` (transformers upcasts the full
  ``(batch, seq, 151936)`` logits to fp32 for the cross-entropy), ``torch.optim.AdamW``, SDPA
  attention, at batch 8; then one step at batch 16, where the fp32 logits are expected to run out
  of memory on one H200 (the OOM is caught and reported).
* **burst**: the path of :func:`forgeflow.training.burst.run_sft_burst`, TRL ``SFTTrainer`` with
  ``packing=True, packing_strategy="bfd", padding_free=True`` (best-fit-decreasing packing into rows
  of ``seq_len`` tokens, the batch flattened into one sequence with per-document ``position_ids``
  and ``cu_seq_lens``; no pad token is computed) and TRL 1.16's default loss: ``loss_type="nll"``
  computes the per-token log-probabilities through the fused LM head (``trl.trainer.utils
  .add_fused_lm_head``: tiles of 4096 tokens, Triton on CUDA), never materializing the full logits
  (``"chunked_nll"`` is its deprecated alias in 1.16; Liger's fused cross-entropy is refused by the
  trainer). That frees the memory for ``--burst-batch`` (default 16) packed rows per step. Attention
  on CUDA: ``flash_attention_2`` when the ``flash_attn`` package is installed, else PyTorch's own
  FlashAttention varlen kernel (``torch.nn.attention.varlen.varlen_attn``, registered as a
  transformers attention function ``torch_varlen`` that reads TRL's ``cu_seq_lens``), so packed
  documents never attend to each other. On CPU (``--small``) SDPA with the block-causal mask
  transformers derives from the packed ``position_ids``.

Each path runs ``--warmup`` untimed steps, then ``--steps`` timed steps (CUDA synchronized at the
edges); peak memory is ``torch.cuda.max_memory_allocated`` since that path started (0 on CPU).
Human lines first, then as the last line one JSON object: ``naive_tokens_per_s``,
``burst_tokens_per_s``, ``ratio`` (burst / naive; goal >= 1.5), ``naive_peak_gb``, ``burst_peak_gb``,
``naive_batch16_oom`` (None when not tried), and details (losses, token counts, batch sizes, attention
implementation, device). ``--small`` uses tiny dimensions on the CPU for a few steps (a smoke test of
both paths, not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

QWEN25_05B = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
    vocab_size=151_936, max_position_embeddings=32_768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
"""Qwen2.5-0.5B's shape (its ``config.json`` on the Hub): 494 M parameters with random weights here."""

SMALL = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=1024, max_position_embeddings=512, rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
"""A tiny model of the same architecture for ``--small`` (CPU smoke test)."""

VARLEN_ATTENTION = "torch_varlen"
"""Name under which :func:`register_torch_varlen_attention` registers PyTorch's varlen FlashAttention."""


@dataclass
class PathResult:
    """What one training path measured.

    Attributes:
        tokens_per_s: real (non-pad) tokens trained per second over the timed steps.
        peak_gb: peak CUDA memory allocated by the path (GB = 1e9 bytes; 0 on CPU).
        batch_size: samples (naive) or packed rows (burst) per step.
        timed_steps: optimizer steps timed.
        tokens: real tokens in the timed steps.
        positions: token positions computed in the timed steps, padding included (= ``tokens`` for the
            padding-free burst).
        seconds: wall time of the timed steps.
        losses: training loss of every step (warm-up included), in nats per token.
    """

    tokens_per_s: float
    peak_gb: float
    batch_size: int
    timed_steps: int
    tokens: int
    positions: int
    seconds: float
    losses: list[float]


def build_model(dims: dict[str, Any], device: str, dtype: Any, attn: str, seed: int) -> Any:
    """A randomly initialized ``Qwen2ForCausalLM`` of ``dims`` on ``device`` (same weights for a seed)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**dims, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model


def lora_config(r: int) -> Any:
    """LoRA on every linear layer of the blocks (peft ``all-linear`` leaves the LM head out)."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def synthetic_samples(n: int, seq_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` sequences of random token ids (ids 2.. ``vocab_size``-1; 0 is pad, 1 is eos), each ending in
    eos, with lengths uniform in [``seq_len`` // 8, ``seq_len``]."""
    import random

    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(max(2, seq_len // 8), seq_len)
        samples.append([rng.randrange(2, vocab_size) for _ in range(length - 1)] + [1])
    return samples


def varlen_call_options(params: frozenset[str], q_heads: int, kv_heads: int, head_dim: int,
                        scale: float | None) -> tuple[dict[str, Any], int]:
    """Keyword arguments for ``torch.nn.attention.varlen.varlen_attn`` as this torch spells them.

    torch 2.10 takes ``is_causal`` and has no grouped-query option; later versions take
    ``window_size=(-1, 0)`` for causal attention, ``scale`` and ``enable_gqa`` (torch's
    ``torch/nn/attention/varlen.py`` of each release).

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


def register_torch_varlen_attention() -> str:
    """Register PyTorch's FlashAttention varlen kernel as the transformers attention ``torch_varlen``.

    The function reads the ``cu_seq_lens_q/k`` and ``max_length_q/k`` that TRL's padding-free collator
    passes through the model (``DataCollatorForLanguageModeling``), so each packed document attends
    only to itself (causal); grouped-query attention is native (``enable_gqa``) where this torch has
    it, else the key/value heads are repeated (:func:`varlen_call_options`). No attention mask is
    built (a name outside transformers' mask registry gets none). CUDA, bf16/fp16 only.

    Returns:
        The name to pass as ``attn_implementation``.

    Raises:
        RuntimeError: this torch has no ``torch.nn.attention.varlen``.
    """
    import inspect

    import torch
    from transformers import AttentionInterface

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:  # torch < 2.10
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen") from exc
    params = frozenset(inspect.signature(varlen_attn).parameters)

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                  dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
        # query/key/value: (1, heads, total_tokens, head_dim) -> (total_tokens, heads, head_dim)
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is None or query.shape[0] != 1:
            raise RuntimeError("torch_varlen attention needs a padding-free batch (cu_seq_lens_q from TRL's collator)")
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        options, repeat = varlen_call_options(params, q.shape[1], k.shape[1], q.shape[2], scaling)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), int(kwargs["max_length_q"]),
                          int(kwargs["max_length_k"]), **options)
        return out.unsqueeze(0), None  # (1, total_tokens, heads, head_dim), like transformers' flash path

    AttentionInterface.register(VARLEN_ATTENTION, attention)
    return VARLEN_ATTENTION


def burst_attention(device: str) -> str:
    """The attention implementation of the burst path: flash_attention_2 (flash_attn installed) or
    :data:`VARLEN_ATTENTION` on CUDA; SDPA (block-causal mask from position_ids) on CPU."""
    import importlib.util

    if device != "cuda":
        return "sdpa"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return register_torch_varlen_attention()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _reset_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0


def _pad_batch(samples: list[list[int]], device: str) -> tuple[Any, Any, Any, int]:
    """Right-pad to the longest sample: (input_ids, attention_mask, labels with -100 on pads, real tokens)."""
    import torch

    longest = max(len(s) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids.to(device), mask.to(device), labels.to(device), int(mask.sum())


def naive_step(model: Any, optimizer: Any, batch: list[list[int]], device: str) -> tuple[float, int, int]:
    """One step of the naive loop: forward with labels (full fp32 logits), backward, AdamW.

    Returns:
        (loss in nats per token, real tokens in the batch, positions computed = batch x longest).
    """
    ids, mask, labels, n_tokens = _pad_batch(batch, device)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), n_tokens, ids.numel()


def run_naive(dims: dict[str, Any], samples: list[list[int]], *, batch: int, oom_batch: int | None, warmup: int,
              steps: int, lora_r: int, device: str, dtype: Any, seed: int) -> tuple[PathResult, bool | None]:
    """The naive transformers + peft loop at ``batch``; then one step at ``oom_batch`` (OOM caught).

    Returns:
        (the measurement at ``batch``, whether ``oom_batch`` ran out of CUDA memory; None if not tried).
    """
    import torch
    from peft import get_peft_model

    _reset_memory(device)
    model = get_peft_model(build_model(dims, device, dtype, "sdpa", seed), lora_config(lora_r))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    losses, tokens, positions, start = [], 0, 0, 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        chunk = [samples[(step * batch + i) % len(samples)] for i in range(batch)]
        loss, n_tokens, n_positions = naive_step(model, optimizer, chunk, device)
        losses.append(loss)
        if step >= warmup:
            tokens, positions = tokens + n_tokens, positions + n_positions
    _sync(device)
    seconds = time.perf_counter() - start
    result = PathResult(tokens_per_s=tokens / seconds, peak_gb=_peak_gb(device), batch_size=batch,
                        timed_steps=steps, tokens=tokens, positions=positions, seconds=seconds, losses=losses)
    oom: bool | None = None
    if oom_batch is not None:
        # The longest samples: the batch the loop would meet sooner or later.
        longest = sorted(samples, key=len, reverse=True)[:oom_batch]
        try:
            naive_step(model, optimizer, longest, device)
            _sync(device)
            oom = False
        except torch.OutOfMemoryError:
            oom = True
        optimizer.zero_grad(set_to_none=True)
    del model, optimizer
    _reset_memory(device)
    return result, oom


def run_burst(dims: dict[str, Any], samples: list[list[int]], *, batch: int, warmup: int, steps: int,
              lora_r: int, seq_len: int, device: str, dtype: Any, seed: int, attn: str) -> PathResult:
    """forgeflow's burst path: TRL ``SFTTrainer`` with bfd packing, padding-free batches and the fused
    (chunked) log-probability loss, at ``batch`` packed rows of ``seq_len`` tokens per step."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    _reset_memory(device)
    model = build_model(dims, device, dtype, attn, seed)
    marks: dict[str, Any] = {}

    class Timer(TrainerCallback):
        """Synchronizes and records time and TRL's token count at the edges of the timed steps."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup:
                _sync(device)
                marks["start"] = time.perf_counter()
                marks["tokens_at_start"] = marks["trainer"]._total_train_tokens

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup + steps:
                _sync(device)
                marks["end"] = time.perf_counter()
                marks["tokens_at_end"] = marks["trainer"]._total_train_tokens

    with tempfile.TemporaryDirectory(prefix="gpu-burst-") as out:
        config = SFTConfig(
            output_dir=out, max_steps=warmup + steps, per_device_train_batch_size=batch, learning_rate=1e-4,
            lr_scheduler_type="constant", warmup_steps=0, max_length=seq_len, packing=True, packing_strategy="bfd",
            padding_free=True, loss_type="nll", bf16=device == "cuda" and dtype == torch.bfloat16, fp16=False,
            use_cpu=device != "cuda", gradient_checkpointing=False, logging_steps=1, logging_nan_inf_filter=False,
            save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=seed,
            data_seed=seed, optim="adamw_torch",
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"input_ids": samples}),
                             processing_class=_tokenizer(), peft_config=lora_config(lora_r), callbacks=[Timer()])
        marks["trainer"] = trainer  # TRL's count of real tokens (``_total_train_tokens``) is read by the Timer
        rows = len(trainer.train_dataset)
        if rows < batch * (warmup + steps):
            raise ValueError(f"{rows} packed rows cannot feed {warmup + steps} steps of {batch}: pass more samples")
        trainer.train()
        losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    tokens = int(marks["tokens_at_end"] - marks["tokens_at_start"])
    seconds = marks["end"] - marks["start"]
    result = PathResult(tokens_per_s=tokens / seconds, peak_gb=_peak_gb(device), batch_size=batch, timed_steps=steps,
                        tokens=tokens, positions=tokens, seconds=seconds, losses=losses)
    marks.clear()
    del trainer, model
    _reset_memory(device)
    return result


def _tokenizer() -> Any:
    """A two-token tokenizer (``<pad>`` = 0, ``<eos>`` = 1): the data is already token ids; TRL needs the
    pad and eos ids only."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both paths and print the comparison (last line: one JSON object). Returns that object."""
    import torch

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_burst", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny model on the CPU, a few steps (smoke test)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default 2048; --small 64)")
    parser.add_argument("--naive-batch", type=int, default=8)
    parser.add_argument("--oom-batch", type=int, default=16, help="naive batch expected to run out of memory (0: skip)")
    parser.add_argument("--burst-batch", type=int, default=16, help="packed rows of seq-len tokens per burst step")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per path (default 3; --small 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per path (default 10; --small 2)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.small:
        dims, device, dtype = SMALL, "cpu", torch.float32
        seq_len, warmup, steps = args.seq_len or 64, 1 if args.warmup is None else args.warmup, args.steps or 2
        naive_batch, burst_batch = min(args.naive_batch, 4), min(args.burst_batch, 4)
        oom_batch = None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --small on a CPU machine (see the README, 'GPU check')")
        dims, device, dtype = QWEN25_05B, "cuda", torch.bfloat16
        seq_len, warmup, steps = args.seq_len or 2048, 3 if args.warmup is None else args.warmup, args.steps or 10
        naive_batch, burst_batch = args.naive_batch, args.burst_batch
        oom_batch = args.oom_batch or None
    attn = burst_attention(device)
    # Enough samples that bfd packing fills every burst step: a sample averages 0.56 seq_len tokens, so
    # 2.5 samples per packed row leave a margin of 40%.
    n_samples = max(naive_batch * (warmup + steps), int(2.5 * burst_batch * (warmup + steps)) + 8, oom_batch or 0)
    samples = synthetic_samples(n_samples, seq_len, dims["vocab_size"], args.seed)
    where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"device {where}; torch {torch.__version__}; model {dims}; seq_len {seq_len}; {n_samples} samples; "
          f"burst attention {attn}", flush=True)

    naive, oom = run_naive(dims, samples, batch=naive_batch, oom_batch=oom_batch, warmup=warmup, steps=steps,
                           lora_r=args.lora_r, device=device, dtype=dtype, seed=args.seed)
    print(f"naive: batch {naive.batch_size}: {naive.tokens_per_s:,.0f} tokens/s "
          f"({naive.positions / naive.seconds:,.0f} positions/s with padding), peak {naive.peak_gb:.1f} GB; "
          f"batch {oom_batch}: {'out of memory' if oom else 'fits' if oom is False else 'not tried'}", flush=True)
    burst = run_burst(dims, samples, batch=burst_batch, warmup=warmup, steps=steps, lora_r=args.lora_r,
                      seq_len=seq_len, device=device, dtype=dtype, seed=args.seed, attn=attn)
    print(f"burst: {burst.batch_size} packed rows of {seq_len}: {burst.tokens_per_s:,.0f} tokens/s, "
          f"peak {burst.peak_gb:.1f} GB", flush=True)
    ratio = burst.tokens_per_s / naive.tokens_per_s
    print(f"ratio burst/naive {ratio:.2f} (goal >= 1.5)", flush=True)
    finite = all(math.isfinite(x) for x in naive.losses + burst.losses)
    summary = {
        "naive_tokens_per_s": round(naive.tokens_per_s, 1), "burst_tokens_per_s": round(burst.tokens_per_s, 1),
        "ratio": round(ratio, 3), "naive_peak_gb": round(naive.peak_gb, 2), "burst_peak_gb": round(burst.peak_gb, 2),
        "naive_batch16_oom": oom, "goal_ratio": 1.5, "losses_finite": finite, "small": args.small,
        "device": where, "seq_len": seq_len, "n_samples": n_samples, "warmup_steps": warmup,
        "burst_attention": attn,
        "naive": asdict(naive), "burst": asdict(burst),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
