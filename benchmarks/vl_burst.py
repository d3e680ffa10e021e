"""Benchmark: seconds per SFT burst step on the tiny multimodal base, with image turns and without.

``python -m benchmarks.vl_burst [--steps N] [--image-px PX] [--samples N]`` builds (or reuses) the tiny
Qwen3.5-shaped model (``forgeflow.packaging.vl_model``, ``tiny-vl``), then trains the same LoRA burst twice
through the flows' own VL path (:func:`forgeflow.training.vl_burst.prepare_vl_burst`: vision tower frozen, LoRA on
the language model, the processor's images; :func:`forgeflow.training.burst.sft_trainer`: TRL SFTTrainer with
assistant-only loss, one sample per step):

* **images**: each sample a user turn with one ``PX`` x ``PX`` image (16 px patches merged 2x2: ``(PX/32)^2``
  image tokens; 448 px: 196) and a question, then a short assistant answer;
* **text**: the same samples without their image.

Each step's wall time comes from a ``TrainerCallback``; the first step (warm-up) is left out and the median of
the rest is reported, with the tokens per step TRL counted. One JSON line on stdout:
``{"device", "image_px", "image_tokens", "steps", "s_per_step_images", "s_per_step_text", "ratio",
"tokens_per_step_images", "tokens_per_step_text"}``. The team's seeds saw about 80 s per step with images vs
10 s text-only on their 9B model; this reports the same shape on the tiny model and this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.options import int_option


def _samples(folder: Path, n: int, px: int, images: bool) -> list[dict[str, Any]]:
    from PIL import Image

    from forgeflow.common.fsutil import sha256_file

    rows = []
    for i in range(n):
        question: list[dict[str, Any]] = [{"type": "text", "text": f"What colour is shape {i}?"}]
        if images:
            path = folder / f"img-{i}.png"
            Image.new("RGB", (px, px), ((50 * i) % 256, 0, 255 - (50 * i) % 256)).save(path)
            question.insert(0, {"type": "image", "image": str(path), "sha256": sha256_file(path)})
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": f"Shape {i} is a coloured square."}],
                     "instance_id": f"vl-{i}", "source": "benchmark"})
    return rows


def _time_burst(base: Path, rows: list[dict[str, Any]], steps: int, out: Path) -> dict[str, float]:
    from transformers import TrainerCallback

    from forgeflow.training.burst import BurstConfig, build_sft_dataset, burst_plan, sft_trainer
    from forgeflow.training.vl_burst import prepare_vl_burst

    config = BurstConfig(max_steps=steps, lora_r=8, max_length=1024, packing=False, device="auto")
    plan = burst_plan(config)
    data = build_sft_dataset(rows)
    vl = prepare_vl_burst(base, data.dataset.to_list(), config, config.max_length, plan.model_kwargs(), None)
    marks: list[float] = []

    class _Timer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(time.perf_counter())

    trainer = sft_trainer(vl.model, vl.processor, vl.dataset, config, plan, out, with_lora=False,
                          callbacks=[_Timer()])
    with contextlib.redirect_stdout(sys.stderr):  # the trainer's log lines: stdout keeps the one JSON line
        trainer.train()
    durations = [marks[i + 1] - marks[i] for i in range(0, len(marks) - 1, 2)]
    tokens = max((float(entry.get("num_tokens", 0)) for entry in trainer.state.log_history), default=0.0)
    return {"s_per_step": statistics.median(durations[1:] or durations), "tokens_per_step": tokens / max(steps, 1),
            "device": plan.device}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its JSON line (returned too)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vl_burst", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int_option(2, 200), default=5,
                        help="optimizer steps per burst (the first is a warm-up)")
    parser.add_argument("--image-px", type=int_option(32, 1024), default=448, help="image side, pixels")
    parser.add_argument("--samples", type=int_option(1, 64), default=4, help="samples (one per step, cycled)")
    args = parser.parse_args(argv)

    from forgeflow.common.settings import cache_dir
    from forgeflow.packaging.vl_model import build_tiny_vl_model

    base = build_tiny_vl_model(cache_dir() / "test-fixtures" / "tiny-vl-seed0", seed=0).path
    with tempfile.TemporaryDirectory(prefix="vl-burst-bench-") as tmp:
        folder = Path(tmp)
        with_images = _time_burst(base, _samples(folder, args.samples, args.image_px, True), args.steps,
                                  folder / "images")
        text = _time_burst(base, _samples(folder, args.samples, args.image_px, False), args.steps, folder / "text")
    result = {
        "device": with_images["device"], "image_px": args.image_px, "image_tokens": (args.image_px // 32) ** 2,
        "steps": args.steps, "s_per_step_images": round(with_images["s_per_step"], 3),
        "s_per_step_text": round(text["s_per_step"], 3),
        "ratio": round(with_images["s_per_step"] / text["s_per_step"], 2),
        "tokens_per_step_images": with_images["tokens_per_step"], "tokens_per_step_text": text["tokens_per_step"],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
