"""A CPU stand-in for verl's PPO entrypoint, run as a Ray job by tests/flows/test_ppo_flow.py.

It does what the ``ppo`` flow needs of a verl run and nothing of PPO itself: prints a line per step
(the log the flow follows), then writes a real peft LoRA adapter of the tiny base model under
``<checkpoint_dir>/global_step_<N>/actor/lora_adapter`` for each step, as verl's checkpoint manager
lays it out; ``--sleep`` seconds between steps let a test cancel it mid-run.

Usage: python ppo_standin.py --base DIR --checkpoint-dir DIR [--steps N] [--sleep S]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args.base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for step in range(1, args.steps + 1):
        print(f"stand-in step {step}/{args.steps}", flush=True)
        with torch.no_grad():  # a stand-in for an update: the adapter changes every step
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.01 * step)
        model.save_pretrained(args.checkpoint_dir / f"global_step_{step}" / "actor" / "lora_adapter")
        time.sleep(args.sleep)
    print("stand-in done", flush=True)


if __name__ == "__main__":
    main()
