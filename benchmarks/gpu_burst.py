"""Benchmark: forgeflow's SFT burst (TRL 1.16) vs a naive transformers + peft training loop.

``python -m benchmarks.gpu_burst [--small] [--steps N] [--warmup N]`` trains LoRA adapters on the same
model and the same synthetic SFT data twice, in one process:

* **model**: a Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` with random weights (transformers
  ``Qwen2Config``: hidden 896, 24 layers, 14 attention heads, 2 KV heads, intermediate 4864,
  vocabulary 151,936, tied embeddings; the shape of ``Qwen/Qwen2.5-0.5B``'s ``config.json``), in the
  dtype of forgeflow's device plan (bf16 on CUDA); LoRA r=16, alpha 32 on every linear layer of the
  blocks (:data:`QWEN2_LINEAR`: q/k/v/o and gate/up/down projections, what peft's ``all-linear`` picks;
  the LM head is not adapted), the same ``peft.LoraConfig`` for both paths
  (:func:`forgeflow.training.adapters.lora_config`).
* **data**: token sequences of random ids whose lengths are drawn uniformly from
  [``seq_len`` / 8, ``seq_len``] (``seq_len`` 2048), like SFT samples of mixed length; loss on every token.
  Throughput counts only real tokens (never padding), so both paths are measured in the same unit.
* **naive**: the standard loop: batches padded to their longest sample with an attention mask,
  ``model(input_ids, attention_mask, labels=labels)`` (transformers upcasts the full
  ``(batch, seq, 151936)`` logits to fp32 for the cross-entropy), ``torch.optim.AdamW``, SDPA
  attention, at batch 8; then one step at batch 16, where the fp32 logits are expected to run out
  of memory on one H200 (the OOM is caught and reported).
* **burst**: the flows' own training path, :func:`forgeflow.training.burst.sft_trainer` (which
  :func:`~forgeflow.training.burst.run_sft_burst` wraps with preflight, lineage and health gates),
  given a :class:`~forgeflow.training.burst.BurstConfig` and forgeflow's device plan
  (:func:`forgeflow.training.device.device_plan`; the model loaded with its ``model_kwargs()``): no
  trainer configuration of its own here. That is TRL ``SFTTrainer`` with bfd packing into rows of
  ``seq_len`` tokens and padding-free batches (one flattened sequence with per-document
  ``position_ids`` and ``cu_seq_lens``; no pad token is computed), TRL 1.16's fused chunked
  ``loss_type="nll"`` (log-probabilities through the fused LM head, ``trl.trainer.utils
  .add_fused_lm_head``: tiles of tokens, Triton on CUDA, never the full logits), bf16 and gradient
  checkpointing as the flows decide it (``--gradient-checkpointing auto``: on CUDA only where a step's
  activations would not fit the GPU's free memory, :func:`forgeflow.training.burst.resolve_checkpointing`),
  at ``--burst-batch`` (default 16) packed rows per step. The rows are token
  ids, so the loss is on every token (:func:`forgeflow.training.burst.loss_scope`; a flow's chat rows
  mask all but the assistant turns). Attention is the plan's (:mod:`forgeflow.training.attention`):
  on CUDA ``flash_attention_2`` when ``flash_attn`` is installed, else PyTorch's varlen FlashAttention
  (``torch_varlen``), so packed documents never attend to each other; on CPU (``--small``) SDPA with
  the block-causal mask transformers derives from the packed ``position_ids``. Per-step time and
  TRL's token count come from a ``TrainerCallback`` passed through ``sft_trainer``'s ``callbacks``.

``--variants`` runs the burst again for each ``CHECKPOINTING:ROWS`` it lists (``auto``, ``on`` or
``off``, and packed rows per step; e.g. ``on:16,off:32``), so one GPU session measures the choices the
flows' ``params.training`` offers; a variant that runs out of CUDA memory is reported as such. Every burst
reports :func:`forgeflow.training.memory.activation_bytes` (the activations its step would keep without
checkpointing, the estimate the ``auto`` choice rests on) beside its measured peak.

Each path runs ``--warmup`` untimed steps, then ``--steps`` timed steps (CUDA synchronized at the
edges); peak memory is ``torch.cuda.max_memory_allocated`` since that path started (0 on CPU).
Human lines first, then as the last line one JSON object: ``naive_tokens_per_s``,
``burst_tokens_per_s``, ``ratio`` (burst / naive; goal >= 1.5), ``anchor_ratio`` (burst / the
:data:`NAIVE_ANCHOR_TOKENS_PER_S` naive figure the goal was set against; goal >= 1.5),
``best`` (the fastest burst of all variants, with its own ratios), ``variants``, ``naive_peak_gb``, ``burst_peak_gb``,
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
from pathlib import Path
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

NAIVE_ANCHOR_TOKENS_PER_S = 52_000.0
"""The naive-loop throughput the burst's goal (>= 1.5x) was set against when the goal was written: a
naive transformers + peft loop on one H200. This harness's own naive loop (padded batches, fp32 logits)
is slower, so the JSON gives the burst against both."""

CHECKPOINTING_SWITCH = {"auto": None, "on": True, "off": False}
"""``--gradient-checkpointing`` / ``--variants`` choices -> ``BurstConfig.gradient_checkpointing``."""

QWEN2_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Qwen2 block (peft's ``all-linear`` for this model: the LM head left out)."""


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
        gradient_checkpointing: whether the trainer checkpointed activations (its own arguments; None for
            the naive loop, which never does).
        requested: the burst's ``--gradient-checkpointing`` choice (``auto``, ``on``, ``off``; None: naive).
        activation_estimate_gb: the activations one step would keep without checkpointing,
            :func:`forgeflow.training.memory.activation_bytes` (GB; None for the naive loop).
        oom: the burst ran out of CUDA memory (the other figures are then 0).
    """

    tokens_per_s: float
    peak_gb: float
    batch_size: int
    timed_steps: int
    tokens: int
    positions: int
    seconds: float
    losses: list[float]
    gradient_checkpointing: bool | None = None
    requested: str | None = None
    activation_estimate_gb: float | None = None
    oom: bool = False


def build_model(dims: dict[str, Any], device: str, seed: int, **model_kwargs: Any) -> Any:
    """A randomly initialized ``Qwen2ForCausalLM`` of ``dims`` on ``device`` (same weights for a seed);
    ``model_kwargs`` (``dtype``, ``attn_implementation``) go to ``from_config``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**dims, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, **model_kwargs)
    return model


def burst_config(*, lora_r: int, batch: int, seq_len: int, max_steps: int, seed: int, device: str,
                 gradient_checkpointing: bool | None = None) -> Any:
    """The :class:`~forgeflow.training.burst.BurstConfig` both paths train with (LoRA on
    :data:`QWEN2_LINEAR`, learning rate 1e-4); the burst packs ``batch`` rows of ``seq_len`` tokens.
    ``gradient_checkpointing`` None: the device plan's choice (on with CUDA), else forced."""
    from forgeflow.training.burst import BurstConfig

    return BurstConfig(lora_r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, lora_target_modules=QWEN2_LINEAR,
                       learning_rate=1e-4, max_steps=max_steps, batch_size=batch, max_length=seq_len,
                       seed=seed, device=device, gradient_checkpointing=gradient_checkpointing)


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


def run_naive(dims: dict[str, Any], samples: list[list[int]], *, config: Any, oom_batch: int | None, warmup: int,
              steps: int, plan: Any) -> tuple[PathResult, bool | None]:
    """The naive transformers + peft loop at ``config.batch_size`` samples per step (SDPA,
    padded batches, the plan's dtype, ``config``'s LoRA); then one step at ``oom_batch`` (OOM caught).

    Returns:
        (the measurement at that batch, whether ``oom_batch`` ran out of CUDA memory; None if not tried).
    """
    import torch
    from peft import get_peft_model

    from forgeflow.training.adapters import lora_config

    device, batch = plan.device, config.batch_size
    _reset_memory(device)
    model = get_peft_model(build_model(dims, device, config.seed, dtype=plan.torch_dtype(), attn_implementation="sdpa"),
                           lora_config(config))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
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


def run_burst(dims: dict[str, Any], samples: list[list[int]], *, config: Any, warmup: int, steps: int,
              plan: Any) -> PathResult:
    """forgeflow's burst: :func:`forgeflow.training.burst.sft_trainer` (bfd packing, padding-free batches, the
    fused chunked log-probability loss, the plan's dtype, attention and gradient checkpointing) at
    ``config.batch_size`` packed rows of ``config.max_length`` tokens per step, timed by a
    callback."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from forgeflow.training.burst import sft_trainer

    device, batch = plan.device, config.batch_size
    _reset_memory(device)
    model = build_model(dims, device, config.seed, **plan.model_kwargs())
    requested, estimate_gb = _labels(dims, config, plan)
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
        trainer = sft_trainer(model, _tokenizer(), Dataset.from_dict({"input_ids": samples}), config, plan, Path(out),
                              callbacks=[Timer()])
        marks["trainer"] = trainer  # TRL's count of real tokens (``_total_train_tokens``) is read by the Timer
        rows = len(trainer.train_dataset)
        if rows < batch * (warmup + steps):
            raise ValueError(f"{rows} packed rows cannot feed {warmup + steps} steps of {batch}: pass more samples")
        trainer.train()
        losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
        checkpointing = bool(trainer.args.gradient_checkpointing)
    tokens = int(marks["tokens_at_end"] - marks["tokens_at_start"])
    seconds = marks["end"] - marks["start"]
    result = PathResult(tokens_per_s=tokens / seconds, peak_gb=_peak_gb(device), batch_size=batch, timed_steps=steps,
                        tokens=tokens, positions=tokens, seconds=seconds, losses=losses,
                        gradient_checkpointing=checkpointing, requested=requested,
                        activation_estimate_gb=estimate_gb)
    marks.clear()
    del trainer, model
    _reset_memory(device)
    return result


def _labels(dims: dict[str, Any], config: Any, plan: Any) -> tuple[str, float]:
    """A burst's ``--gradient-checkpointing`` choice (``auto``/``on``/``off``) and the activations one of its
    steps would keep without checkpointing (:func:`forgeflow.training.memory.activation_bytes`, GB)."""
    from forgeflow.training.burst import tokens_per_step
    from forgeflow.training.memory import activation_bytes

    requested = {value: key for key, value in CHECKPOINTING_SWITCH.items()}[config.gradient_checkpointing]
    return requested, round(activation_bytes(dims, tokens_per_step(config), plan.dtype, config.lora_r) / 1e9, 6)


def parse_variants(text: str) -> list[tuple[str, int]]:
    """``"on:16,off:32"`` -> ``[("on", 16), ("off", 32)]``: gradient checkpointing (``auto``/``on``/``off``)
    and packed rows per step of each extra burst run.

    Raises:
        SystemExit: an entry is not ``CHECKPOINTING:ROWS`` with a known choice and a positive count.
    """
    variants = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        switch, _, rows = entry.partition(":")
        if switch not in CHECKPOINTING_SWITCH or not rows.isdigit() or int(rows) < 1:
            raise SystemExit(f"--variants: {entry!r} is not CHECKPOINTING:ROWS with CHECKPOINTING one of "
                             f"{', '.join(CHECKPOINTING_SWITCH)} and ROWS a positive integer")
        variants.append((switch, int(rows)))
    return variants


def run_burst_variant(dims: dict[str, Any], samples: list[list[int]], *, config: Any, warmup: int, steps: int,
                      plan: Any) -> PathResult:
    """:func:`run_burst`, with a CUDA out-of-memory error reported as ``oom=True`` (figures 0) instead of
    raised, so one variant that does not fit does not end the GPU check."""
    import torch

    try:
        return run_burst(dims, samples, config=config, warmup=warmup, steps=steps, plan=plan)
    except torch.OutOfMemoryError:
        _reset_memory(plan.device)
        requested, estimate_gb = _labels(dims, config, plan)
        return PathResult(tokens_per_s=0.0, peak_gb=_peak_gb(plan.device),
                          batch_size=config.batch_size, timed_steps=0, tokens=0, positions=0,
                          seconds=0.0, losses=[],
                          gradient_checkpointing=config.gradient_checkpointing, requested=requested,
                          activation_estimate_gb=estimate_gb, oom=True)


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

    from forgeflow.training.burst import packing_label
    from forgeflow.training.device import device_plan

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
    parser.add_argument("--gradient-checkpointing", choices=tuple(CHECKPOINTING_SWITCH), default="auto",
                        help="the burst's gradient checkpointing (the flows' BurstConfig.gradient_checkpointing): "
                             "auto = as the flows decide (on CUDA: only where a step's activations do not fit)")
    parser.add_argument("--variants", default="", help="more burst runs, CHECKPOINTING:ROWS,... (e.g. on:16,off:32)")
    args = parser.parse_args(argv)
    variants = parse_variants(args.variants)

    if args.small:
        dims, device = SMALL, "cpu"
        seq_len, warmup, steps = args.seq_len or 64, 1 if args.warmup is None else args.warmup, args.steps or 2
        naive_batch, burst_batch = min(args.naive_batch, 4), min(args.burst_batch, 4)
        variants = [(switch, min(rows, 4)) for switch, rows in variants]
        oom_batch = None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --small on a CPU machine (see the README, 'GPU check')")
        dims, device = QWEN25_05B, "cuda"
        seq_len, warmup, steps = args.seq_len or 2048, 3 if args.warmup is None else args.warmup, args.steps or 10
        naive_batch, burst_batch = args.naive_batch, args.burst_batch
        oom_batch = args.oom_batch or None
    plan = device_plan(device)
    checkpointing = CHECKPOINTING_SWITCH[args.gradient_checkpointing]
    naive_config = burst_config(lora_r=args.lora_r, batch=naive_batch, seq_len=seq_len, max_steps=warmup + steps,
                                seed=args.seed, device=device)
    config = burst_config(lora_r=args.lora_r, batch=burst_batch, seq_len=seq_len, max_steps=warmup + steps,
                          seed=args.seed, device=device, gradient_checkpointing=checkpointing)

    # Enough samples that bfd packing fills every burst step: a sample averages 0.56 seq_len tokens, so
    # 2.5 samples per packed row leave a margin of 40%.
    most_rows = max([burst_batch] + [rows for _, rows in variants])
    n_samples = max(naive_batch * (warmup + steps), int(2.5 * most_rows * (warmup + steps)) + 8, oom_batch or 0)
    samples = synthetic_samples(n_samples, seq_len, dims["vocab_size"], args.seed)
    where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"device {where}; torch {torch.__version__}; model {dims}; seq_len {seq_len}; {n_samples} samples; "
          f"plan {plan.device}/{plan.dtype}, burst attention {plan.attention}, "
          f"burst gradient checkpointing {args.gradient_checkpointing}", flush=True)

    naive, oom = run_naive(dims, samples, config=naive_config, oom_batch=oom_batch, warmup=warmup, steps=steps,
                           plan=plan)
    print(f"naive: batch {naive.batch_size}: {naive.tokens_per_s:,.0f} tokens/s "
          f"({naive.positions / naive.seconds:,.0f} positions/s with padding), peak {naive.peak_gb:.1f} GB; "
          f"batch {oom_batch}: {'out of memory' if oom else 'fits' if oom is False else 'not tried'}", flush=True)

    def report(name: str, run: PathResult) -> None:
        if run.oom:
            print(f"{name}: {run.batch_size} packed rows, checkpointing {run.requested}: out of CUDA memory "
                  f"(estimated activations without checkpointing {run.activation_estimate_gb:.1f} GB)", flush=True)
            return
        print(f"{name}: {run.batch_size} packed rows of {seq_len}, checkpointing {run.requested} -> "
              f"{'on' if run.gradient_checkpointing else 'off'}: {run.tokens_per_s:,.0f} tokens/s "
              f"({run.tokens_per_s / naive.tokens_per_s:.2f}x naive, "
              f"{run.tokens_per_s / NAIVE_ANCHOR_TOKENS_PER_S:.2f}x the {NAIVE_ANCHOR_TOKENS_PER_S:,.0f} anchor), "
              f"peak {run.peak_gb:.1f} GB (activations without checkpointing estimated at "
              f"{run.activation_estimate_gb:.1f} GB)", flush=True)

    burst = run_burst(dims, samples, config=config, warmup=warmup, steps=steps, plan=plan)
    report("burst", burst)
    extra = []
    for switch, rows in variants:
        variant_config = burst_config(lora_r=args.lora_r, batch=rows, seq_len=seq_len, max_steps=warmup + steps,
                                      seed=args.seed, device=device,
                                      gradient_checkpointing=CHECKPOINTING_SWITCH[switch])
        extra.append(run_burst_variant(dims, samples, config=variant_config, warmup=warmup, steps=steps, plan=plan))
        report(f"variant {switch}:{rows}", extra[-1])
    ratio = burst.tokens_per_s / naive.tokens_per_s
    best = max([burst] + extra, key=lambda run: run.tokens_per_s)
    print(f"ratio burst/naive {ratio:.2f} (goal >= 1.5); burst/anchor "
          f"{burst.tokens_per_s / NAIVE_ANCHOR_TOKENS_PER_S:.2f}; best: {best.requested}:{best.batch_size} "
          f"{best.tokens_per_s:,.0f} tokens/s = {best.tokens_per_s / NAIVE_ANCHOR_TOKENS_PER_S:.2f}x the anchor",
          flush=True)
    finite = all(math.isfinite(x) for x in naive.losses + burst.losses + [x for run in extra for x in run.losses])
    summary = {
        "naive_tokens_per_s": round(naive.tokens_per_s, 1), "burst_tokens_per_s": round(burst.tokens_per_s, 1),
        "ratio": round(ratio, 3), "anchor_tokens_per_s": NAIVE_ANCHOR_TOKENS_PER_S,
        "anchor_ratio": round(burst.tokens_per_s / NAIVE_ANCHOR_TOKENS_PER_S, 3),
        "best": {"requested": best.requested, "batch_size": best.batch_size,
                 "gradient_checkpointing": best.gradient_checkpointing,
                 "tokens_per_s": round(best.tokens_per_s, 1), "peak_gb": round(best.peak_gb, 2),
                 "ratio": round(best.tokens_per_s / naive.tokens_per_s, 3),
                 "anchor_ratio": round(best.tokens_per_s / NAIVE_ANCHOR_TOKENS_PER_S, 3)},
        "variants": [asdict(run) for run in extra],
        "naive_peak_gb": round(naive.peak_gb, 2), "burst_peak_gb": round(burst.peak_gb, 2),
        "naive_batch16_oom": oom, "goal_ratio": 1.5, "losses_finite": finite, "small": args.small,
        "device": where, "seq_len": seq_len, "n_samples": n_samples, "warmup_steps": warmup,
        "burst_attention": plan.attention, "dtype": plan.dtype,
        "gradient_checkpointing": burst.gradient_checkpointing, "packing": packing_label(config),
        "naive": asdict(naive), "burst": asdict(burst),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
