"""``python -m benchmarks.gpu_burst --small``: both training paths of the GPU benchmark run on the CPU.

The small mode trains a tiny Qwen2 (random weights) with the naive transformers + peft loop and with
the flows' own burst trainer (:func:`forgeflow.training.burst.sft_trainer`: bfd packing, padding-free
batches, fused chunked log-probability loss) for a few steps; the numbers are not a measurement (that
needs the GPU machine: ``benchmarks/gpu_check.sh``), but every key of the GPU run's JSON is there and
both paths really trained. The varlen attention's options are tested with the attention module
(``tests/core/training/test_attention.py``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_burst import SMALL, parse_variants, synthetic_samples

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def test_small_mode_trains_both_paths_and_prints_the_json_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_burst", "--small"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("naive_tokens_per_s", "burst_tokens_per_s", "ratio", "naive_peak_gb", "burst_peak_gb",
                "naive_batch16_oom"):
        assert key in summary, key
    naive, burst = summary["naive"], summary["burst"]
    steps, warmup, seq_len = naive["timed_steps"], summary["warmup_steps"], summary["seq_len"]
    # both paths ran every step with a finite loss near ln(vocabulary) (random weights)
    for path in (naive, burst):
        assert len(path["losses"]) == warmup + steps
        assert all(math.isfinite(x) and abs(x - math.log(SMALL["vocab_size"])) < 1.0 for x in path["losses"])
        assert path["tokens"] > 0 and path["seconds"] > 0
        assert path["tokens_per_s"] == pytest.approx(path["tokens"] / path["seconds"], rel=1e-6)
    assert summary["ratio"] == pytest.approx(summary["burst_tokens_per_s"] / summary["naive_tokens_per_s"], rel=1e-2)
    # the naive loop counted exactly the real tokens of the samples it was fed after warm-up
    samples = synthetic_samples(summary["n_samples"], seq_len, SMALL["vocab_size"], 0)
    batch = naive["batch_size"]
    fed = [samples[(step * batch + i) % len(samples)] for step in range(warmup, warmup + steps) for i in range(batch)]
    assert naive["tokens"] == sum(len(s) for s in fed)
    padded = [batch * max(len(s) for s in fed[i:i + batch]) for i in range(0, len(fed), batch)]
    assert naive["positions"] == sum(padded) > naive["tokens"]  # padded to the longest sample of each batch
    # the burst packed its rows (bfd): real tokens fill most of batch x seq_len per step, never more
    capacity = steps * burst["batch_size"] * seq_len
    assert 0.8 * capacity <= burst["tokens"] <= capacity
    assert summary["naive_batch16_oom"] is None and summary["naive_peak_gb"] == summary["burst_peak_gb"] == 0.0
    # the burst ran as the flows' bursts do on this machine (forgeflow's device plan)
    assert (summary["burst_attention"], summary["dtype"], summary["packing"]) == ("sdpa", "float32", "bfd")
    assert summary["gradient_checkpointing"] is False



def test_the_burst_takes_the_flows_gradient_checkpointing_switch_and_runs_each_variant() -> None:
    """``--gradient-checkpointing on`` reaches the burst's trainer through BurstConfig (the flows'
    ``params.training`` switch): the CPU plan would leave it off; the burst still trains with a finite loss.
    ``--variants off:2,auto:3`` trains the burst twice more with those switches and rows per step, each
    reported with what its trainer used and its activation estimate; ``best`` is the fastest of all."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_burst", "--small", "--gradient-checkpointing", "on",
                           "--variants", "off:2,auto:3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["gradient_checkpointing"] is True  # the trainer's own arguments
    assert all(math.isfinite(x) for x in summary["burst"]["losses"])
    variants = summary["variants"]
    assert [(v["requested"], v["batch_size"], v["gradient_checkpointing"], v["oom"]) for v in variants] == [
        ("off", 2, False, False), ("auto", 3, False, False)]  # auto on the CPU: off
    for variant in variants:
        assert variant["tokens"] > 0 and all(math.isfinite(x) for x in variant["losses"])
    # the estimate is per token: 2 and 3 rows of the same length against the burst's 4
    estimates = [run["activation_estimate_gb"] for run in (summary["burst"], *variants)]
    assert estimates[0] > 0 and estimates[1:] == pytest.approx([estimates[0] / 2, estimates[0] * 3 / 4], rel=1e-3)
    fastest = max([summary["burst"], *variants], key=lambda run: run["tokens_per_s"])
    assert summary["best"]["tokens_per_s"] == pytest.approx(fastest["tokens_per_s"], abs=0.1)
    # the JSON rounds the ratio to 3 decimals: at CPU speeds (a few hundred tokens/s) that is all its precision
    assert summary["anchor_ratio"] == pytest.approx(summary["burst_tokens_per_s"] / 52_000, abs=5e-4)


def test_a_malformed_variant_is_refused_naming_it() -> None:
    with pytest.raises(SystemExit, match="'fast:2' is not CHECKPOINTING:ROWS"):
        parse_variants("on:16,fast:2")
    with pytest.raises(SystemExit, match="'off:0'"):
        parse_variants("off:0")
    assert parse_variants("on:16, off:32,") == [("on", 16), ("off", 32)]
