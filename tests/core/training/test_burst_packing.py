"""Packing keeps each document to itself and keeps the loss masks: a packed burst's first step has the
loss of the same samples trained unpacked, for both dataset formats.

The tiny model (real Qwen2 vocabulary, random weights) trains three samples once packed into one row
of ``max_length`` tokens (bfd, padding-free, SDPA with the block-causal mask from ``position_ids``)
and once unpacked as one padded batch of three. The first step's loss is the mean negative
log-likelihood of the same target tokens under the same weights (a new LoRA adapter starts at zero),
so the two agree to float rounding if and only if no packed document sees another and the
assistant / completion masks survived packing. A control lets the packed documents attend to each
other (an all-ones attention mask over the row) and shows the loss then moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeflow.packaging.base_model import build_tiny_model
from forgeflow.training.burst import BurstConfig, build_sft_dataset, burst_plan, run_sft_burst, sft_trainer

pytestmark = [pytest.mark.slow]

PROMPTS = ["Tests fail in module parser.", "Fix the off-by-one in range_sum.", "Why does the cache never expire?"]
ANSWERS = ["--- a/p.py\n+++ b/p.py\n-    return x\n+    return x + 1",
           "Use `range(n + 1)`: the last element was skipped.",
           "The TTL is compared in milliseconds against seconds; divide by 1000."]


def _samples(fmt: str) -> list[dict]:
    out = []
    for i, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS, strict=True)):
        context = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": prompt}]
        reply = [{"role": "assistant", "content": answer}]
        row = {"messages": context + reply} if fmt == "messages" else {"prompt": context, "completion": reply}
        out.append({"instance_id": f"proj__{i}", "source": "unit-test", **row})
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("packing") / "base", seed=0).path


@pytest.mark.parametrize("fmt", ["messages", "prompt-completion"])
def test_packed_first_step_loss_equals_the_unpacked_one(base: Path, tmp_path: Path, fmt: str) -> None:
    data = build_sft_dataset(_samples(fmt))
    packed = run_sft_burst(base, data, tmp_path / "packed", BurstConfig(max_steps=2, max_length=512))
    unpacked = run_sft_burst(base, data, tmp_path / "unpacked",
                             BurstConfig(max_steps=2, max_length=512, packing=False, batch_size=3))
    (step_p, loss_p), (step_u, loss_u) = packed.health.losses[0], unpacked.health.losses[0]
    print(f"{fmt}: first-step loss packed {loss_p!r}, unpacked {loss_u!r}, |diff| {abs(loss_p - loss_u):.3g}")
    assert step_p == step_u == 1
    assert loss_p == pytest.approx(loss_u, rel=1e-5, abs=1e-5)
    # the lineage says how each trained (this machine: the CPU, float32, SDPA)
    assert (packed.lineage.device, packed.lineage.dtype, packed.lineage.attention) == ("cpu", "float32", "sdpa")
    assert (packed.lineage.packing, unpacked.lineage.packing) == ("bfd", "none")
    assert packed.lineage.hyperparameters["packing"] is True and unpacked.lineage.hyperparameters["packing"] is False


def test_gradient_checkpointing_trains_the_same_loss_and_the_lineage_records_it(base: Path, tmp_path: Path) -> None:
    """Recomputing activations changes memory and time, not the math: a checkpointed burst's first step has
    the plain burst's loss; each lineage records what was used (the CPU's default: off)."""
    data = build_sft_dataset(_samples("messages"))
    plain = run_sft_burst(base, data, tmp_path / "plain", BurstConfig(max_steps=1, max_length=512))
    checkpointed = run_sft_burst(base, data, tmp_path / "checkpointed",
                                 BurstConfig(max_steps=1, max_length=512, gradient_checkpointing=True))
    assert checkpointed.health.losses[0][1] == pytest.approx(plain.health.losses[0][1], rel=1e-5, abs=1e-5)
    assert (plain.lineage.gradient_checkpointing, checkpointed.lineage.gradient_checkpointing) == (False, True)
    assert checkpointed.lineage.hyperparameters["gradient_checkpointing"] is True
    assert plain.lineage.hyperparameters["gradient_checkpointing"] is None  # the device plan decided


def test_the_packed_row_holds_every_sample_and_isolates_them(base: Path, tmp_path: Path) -> None:
    """The same trainer ``run_sft_burst`` uses: one row of three documents, labels -100 off the
    assistant turns and at each document's first token; the loss of that row with the block-causal
    mask is the trainer's, and it moves when the documents may attend to each other."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = BurstConfig(max_steps=1, max_length=512)
    plan = burst_plan(config)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), **plan.model_kwargs())
    data = build_sft_dataset(_samples("messages"))
    trainer = sft_trainer(model, tokenizer, data.dataset.select_columns(["messages"]), config, plan, tmp_path / "t")
    assert len(trainer.train_dataset) == 1 and len(trainer.train_dataset[0]["seq_lengths"]) == 3
    batch = next(iter(trainer.get_train_dataloader()))
    ids, positions, labels = batch["input_ids"].cpu(), batch["position_ids"].cpu(), batch["labels"].cpu()
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    assert len(starts) == 3 and all(labels[0, s] == -100 for s in starts)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert not (labels[0] == im_start).any()  # no role header is a target: the assistant mask survived
    trainer.train()
    trained_first = trainer.state.log_history[0]["loss"]

    # use_cache=False as in training: with a cache transformers builds no packed-sequence mask
    reference = AutoModelForCausalLM.from_pretrained(str(base), **plan.model_kwargs()).eval()
    with torch.no_grad():
        isolated = float(reference(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss)
        leaking = float(reference(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids),
                                  labels=labels, use_cache=False).loss)
    print(f"packed row: trainer {trained_first!r}, block-causal {isolated!r}, cross-document {leaking!r}")
    assert isolated == pytest.approx(trained_first, rel=1e-5)
    assert abs(leaking - isolated) > 1e-3
