"""GPU check: the flows' own SFT burst (:func:`forgeflow.training.burst.run_sft_burst`) on CUDA, and what its
adapter's lineage records.

``python -m benchmarks.gpu_lineage --tokenizer-dir DIR [--device cuda|cpu|auto] [--steps N]`` builds a
small Qwen2-shaped model with random weights (transformers ``Qwen2Config``: hidden 64, 2 layers, 4
attention heads, 2 KV heads, intermediate 128, tied embeddings; the vocabulary of the tokenizer in
``DIR``: ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, e.g. the tiny model's
Qwen2 tokenizer that ``benchmarks/gpu_check.sh --prepare`` copies), writes it as an HF folder and
trains one LoRA burst on 12 short chat samples through ``run_sft_burst`` (preflight, device plan,
packing, health gates, staging, lineage), the function the ``sft-burst`` flow runs. Not a speed
measurement (``benchmarks.gpu_burst`` is): it shows, on a GPU machine, that the burst selects CUDA and
records the device, dtype, attention and packing it trained with.

Human lines first, then as the last line one JSON object: ``device``, ``dtype``, ``attention``,
``packing`` (from the adapter's ``lineage.json``), ``steps``, ``final_loss`` (nats per token),
``adapter_sha256``, ``seconds`` (wall time of the burst), ``cuda_available``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""What ``--tokenizer-dir`` must hold (copied next to the random model's weights)."""


def build_model_dir(tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """An HF folder at ``out``: a random small Qwen2 model (fp32 safetensors) with the tokenizer of
    ``tokenizer_dir``.

    Raises:
        FileNotFoundError: a file of :data:`TOKENIZER_FILES` is missing in ``tokenizer_dir``.
    """
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    missing = [name for name in TOKENIZER_FILES if not (tokenizer_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"--tokenizer-dir {tokenizer_dir} lacks {missing}")
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def samples(n: int = 12) -> list[dict]:
    """``n`` short ``messages`` samples (a question about a failing test and a one-line answer)."""
    return [{"instance_id": f"check-{i}", "source": "gpu_lineage",
             "messages": [{"role": "user", "content": f"Test test_{i} fails with KeyError {i}. What do you change?"},
                          {"role": "assistant", "content": f"Guard the lookup of key {i} with dict.get."}]}
            for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    import torch

    from forgeflow.training.burst import BurstConfig, build_sft_dataset, run_sft_burst

    with tempfile.TemporaryDirectory(prefix="gpu-lineage-") as tmp:
        hf_dir = build_model_dir(args.tokenizer_dir, Path(tmp) / "hf")
        config = BurstConfig(max_steps=args.steps, learning_rate=1e-3, lora_r=8, lora_alpha=16, max_length=256,
                             device=args.device)
        start = time.perf_counter()
        record = run_sft_burst(hf_dir, build_sft_dataset(samples()), Path(tmp) / "adapter", config)
        seconds = time.perf_counter() - start
        lineage = json.loads((record.path / "lineage.json").read_text())
    found = lineage.get("lineage", lineage)
    result = {"device": found.get("device"), "dtype": found.get("dtype"), "attention": found.get("attention"),
              "packing": found.get("packing"), "steps": record.steps, "final_loss": record.final_loss,
              "adapter_sha256": record.sha256, "seconds": round(seconds, 2),
              "cuda_available": torch.cuda.is_available()}
    print(f"run_sft_burst on {result['device']} ({result['dtype']}, attention {result['attention']}, packing "
          f"{result['packing']}): {record.steps} steps in {seconds:.1f} s, final loss {record.final_loss:.4f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
