"""SFT bursts: short LoRA training runs (TRL ``SFTTrainer``, peft) that continue an adapter lineage.

Packed bursts use TRL's bfd packing with padding-free batches (TRL docs, "Packing") and TRL 1.16's fused
chunked ``loss_type="nll"`` (``trl.trainer.utils.add_fused_lm_head``): a 150k vocabulary never builds
``(tokens, vocabulary)`` logits. ``tests/core/training/test_burst_packing.py`` checks packed = unpacked loss.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_json
from forgeflow.training import sample_images, vl_burst
from forgeflow.training.adapters import (
    LINEAGE_FILE,
    AdapterRecord,
    Lineage,
    LoraSettings,
    lora_config,
    publish_adapter,
    read_adapter_record,
    resolve_lineage_inputs,
)
from forgeflow.training.attention import VARLEN_ATTENTION
from forgeflow.training.device import DeviceChoice, DevicePlan, device_plan
from forgeflow.training.health import (
    HealthGates,
    check_health,
    enforce_health,
    health_callback,
)
from forgeflow.training.memory import CheckpointingDecision, checkpointing_decision
from forgeflow.training.preflight import burst_preflight
from forgeflow.training.staging import StagingDir, remove_dead_staging_dirs

log = logging.getLogger(__name__)

_ROLES = frozenset({"system", "user", "assistant", "tool"})


class BurstData(BaseModel):
    """A burst's dataset and the digest that identifies it (its adapter's ``lineage.dataset_sha256``): SFT rows
    (:func:`build_sft_dataset`) or RL prompts (:func:`forgeflow.training.rl.build_rl_dataset`, which also names the
    prompt template the prompts were rendered from)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    dataset: Any = Field(description="datasets.Dataset: SFT messages (or prompt/completion), instance_id and source "
                         "columns; RL prompt, instance_id and the verifier's columns")
    sha256: str = Field(min_length=64, max_length=64, description="sha256_json of the rows, in order")
    prompt_template: Path | None = Field(None, description="RL: the template the prompts were rendered from; "
                                         "None for SFT")
    prompt_template_sha256: str | None = Field(None, min_length=64, max_length=64,
                                               description="RL: sha256_file of prompt_template when rendered")


class BurstConfig(LoraSettings):
    """Hyperparameters of one SFT burst: the ``sft-burst`` and ``windows`` flows' ``params.training``.

    A continued adapter must have the same ``lora_r``. Tokens per step = ``batch_size`` x ``max_length`` at most (the
    GPU check measures 16 rows of 2,048 tokens).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(2, ge=1, le=100_000, description="optimizer steps")
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0, description="constant learning rate (no warm-up)")
    max_length: int = Field(2048, ge=16, le=131_072, description="tokens per sample and per packed row; a longer "
                            "sample is refused, not truncated (the windows flow's windows have about 1,300-1,500)")
    batch_size: int = Field(1, ge=1, le=4096, description="rows per optimizer step: packed rows of max_length "
                            "tokens (unpacked: samples); TRL's per_device_train_batch_size")
    seed: int = Field(0, description="training and data-order seed")
    gates: HealthGates = Field(default_factory=HealthGates,
        description="health gates the burst must pass for its adapter to be written")
    device: DeviceChoice = Field("auto", description="auto: CUDA in bfloat16 when the worker has a GPU, else the CPU "
                                 "in float32; cpu; or cuda (refused where CUDA is not available)")
    packing: bool = Field(True, description="true: bfd packing of whole samples into rows of max_length tokens, "
                          "padding-free batches; false: one sample per row, padded")
    gradient_checkpointing: bool | None = Field(None, description="recompute activations in the backward pass (less "
                                                "GPU memory, more compute); null: on CUDA only when a step's "
                                                "activations would not fit the free GPU memory; off on the CPU")


PACKING_STRATEGY = "bfd"
"""TRL's packing strategy of a packed burst: best-fit decreasing, whole samples per row (a sample
longer than a row would be truncated; :func:`_check_lengths` refuses one first)."""


# --- data ------------------------------------------------------------------------------------
def _clean_message(message: Any, where: str) -> dict[str, Any]:
    """One chat message checked; an ``InputError`` names ``where`` and the malformed field."""
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise InputError(f"{where}.role must be one of {sorted(_ROLES)}")
    clean: dict[str, Any] = {"role": message["role"],
                             "content": sample_images.clean_content(message.get("content"), message["role"], where)}
    if "tool_calls" in message:
        calls = message["tool_calls"]
        if calls is not None:
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str)
                    and isinstance(c["function"].get("arguments"), str) for c in calls):
                raise InputError(f"{where}.tool_calls must be a list of {{id, type, function: {{name, arguments}}}} "
                                 "with string name and arguments")
            calls = [{"id": str(c.get("id") or ""), "type": "function",
                      "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                     for c in calls]
        clean["tool_calls"] = calls
    if "tool_call_id" in message:
        if message["tool_call_id"] is not None and not isinstance(message["tool_call_id"], str):
            raise InputError(f"{where}.tool_call_id must be a string or null")
        clean["tool_call_id"] = message["tool_call_id"]
    return clean


def _clean_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where} must be a non-empty list")
    return [_clean_message(m, f"{where}[{j}]") for j, m in enumerate(messages)]


def build_sft_dataset(samples: list[dict]) -> BurstData:
    """Turn chat samples (``messages``, or ``prompt`` + ``completion``; one format) into a dataset with a digest.

    Raises:
        InputError: ``samples`` is empty, mixes the two formats, or a sample is malformed (index and field named).
    """
    from datasets import Dataset

    rows = sft_rows(samples)
    table = sample_images.uniform_parts(rows) if sample_images.has_parts(rows) else rows
    return BurstData(dataset=Dataset.from_list(table), sha256=dataset_sha256(rows))


def dataset_sha256(rows: list[dict[str, Any]]) -> str:
    """``sha256_json`` of checked rows, each image part named by its sha256 only."""
    return sha256_json(sample_images.digest_view(rows))


def sft_rows(samples: list[dict]) -> list[dict[str, Any]]:
    """The checked, cleaned rows of :func:`build_sft_dataset` (raising as it does), without the dataset."""
    if not samples:
        raise InputError("samples is empty: an SFT dataset needs at least one sample")
    rows = []
    formats = set()
    for i, sample in enumerate(samples):
        for key in ("instance_id", "source"):
            if not isinstance(sample.get(key), str) or not sample[key]:
                raise InputError(f"samples[{i}].{key} must be a non-empty string")
        if "messages" in sample or "prompt" not in sample:
            formats.add("messages")
            clean = _clean_messages(sample.get("messages"), f"samples[{i}].messages")
            if not any(m["role"] == "assistant" for m in clean):
                raise InputError(f"samples[{i}].messages has no assistant turn to train on")
            row: dict[str, Any] = {"messages": clean}
        else:
            formats.add("prompt-completion")
            completion = _clean_messages(sample.get("completion"), f"samples[{i}].completion")
            if any(m["role"] != "assistant" for m in completion):
                raise InputError(f"samples[{i}].completion must hold assistant messages only")
            row = {"prompt": _clean_messages(sample.get("prompt"), f"samples[{i}].prompt"), "completion": completion}
        if len(formats) > 1:
            raise InputError(f"samples[{i}] is in another format than samples[0]: one dataset is either "
                             "'messages' rows or 'prompt' + 'completion' rows")
        rows.append({**row, "instance_id": sample["instance_id"], "source": sample["source"]})
    return rows


def _conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The whole conversation of a dataset row (``messages``, or ``prompt`` + ``completion``)."""
    return row["messages"] if "messages" in row else [*row["prompt"], *row["completion"]]


TRAINER_RUN_ARGS: dict[str, Any] = {
    "logging_steps": 1,
    # Trainer by default replaces a NaN/inf step loss by the running mean before logging, which
    # would hide a divergence from the health gates: log the real values.
    "logging_nan_inf_filter": False,
    "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "dataloader_num_workers": 0,
    "lr_scheduler_type": "constant", "warmup_steps": 0,
}
"""``transformers.TrainingArguments`` fields every burst sets the same way (SFT and RL): a log line per
step with real NaN/inf values, no checkpoints or reporting, a constant learning rate. The device
fields come from :func:`forgeflow.training.device.device_plan`."""


def loss_scope(columns: Sequence[str]) -> dict[str, bool]:
    """The ``SFTConfig`` loss-mask options for these columns (``InputError`` if they are no SFT format)."""
    names = set(columns)
    if "messages" in names:
        return {"assistant_only_loss": True, "completion_only_loss": False}
    if {"prompt", "completion"} <= names:
        return {"assistant_only_loss": True, "completion_only_loss": True}
    if "input_ids" in names:
        return {"assistant_only_loss": False, "completion_only_loss": False}
    raise InputError(f"an SFT dataset has 'messages', 'prompt' + 'completion' or 'input_ids' columns; "
                     f"got {sorted(names)}")


def packing_label(config: BurstConfig) -> str:
    """:data:`PACKING_STRATEGY` (packed, padding-free) or ``none`` (one padded sample per row)."""
    return PACKING_STRATEGY if config.packing else "none"


def sft_arguments(config: BurstConfig, plan: DevicePlan, columns: Sequence[str]) -> dict[str, Any]:
    """The ``trl.SFTConfig`` keyword arguments (all but ``output_dir``; ``InputError`` as :func:`loss_scope`)."""
    return {
        "learning_rate": config.learning_rate, "max_steps": config.max_steps,
        "per_device_train_batch_size": config.batch_size, "max_length": config.max_length,
        "seed": config.seed, "data_seed": config.seed, "loss_type": "nll",
        "packing": config.packing, "packing_strategy": PACKING_STRATEGY, "padding_free": config.packing,
        **loss_scope(columns),
        **TRAINER_RUN_ARGS,
        **plan.trainer_args,
        **_checkpointing(config),
    }


def _checkpointing(config: BurstConfig) -> dict[str, bool]:
    """transformers 5's ``activation_checkpointing`` where ``config`` sets it; empty otherwise."""
    return {} if config.gradient_checkpointing is None else {"activation_checkpointing": config.gradient_checkpointing}


def _trl_objects(config: BurstConfig, output_dir: Path, with_lora: bool, plan: DevicePlan,
                 columns: Sequence[str], overrides: dict[str, Any]) -> tuple[Any, Any]:
    """Translate :class:`BurstConfig` into ``(trl.SFTConfig, peft.LoraConfig | None)``."""
    from trl import SFTConfig

    sft = SFTConfig(output_dir=str(output_dir), **{**sft_arguments(config, plan, columns), **overrides})
    return sft, (lora_config(config) if with_lora else None)


def burst_plan(config: BurstConfig, plan: DevicePlan | None = None) -> DevicePlan:
    """:func:`device_plan` of ``config.device``, with SDPA for an unpacked burst (``torch_varlen`` needs no padding)."""
    plan = plan or device_plan(config.device)
    if not config.packing and plan.attention == VARLEN_ATTENTION:
        plan = plan.model_copy(update={"attention": "sdpa"})
    if config.gradient_checkpointing is not None:
        plan = plan.model_copy(update={"trainer_args": {**plan.trainer_args, **_checkpointing(config)}})
    return plan


def tokens_per_step(config: BurstConfig) -> int:
    """Most tokens one step trains on: ``batch_size`` x ``max_length``."""
    return config.batch_size * config.max_length


def resolve_checkpointing(model: Any, config: BurstConfig, plan: DevicePlan,
                          free_bytes: int | None = None) -> tuple[DevicePlan, CheckpointingDecision | None]:
    """The plan with checkpointing decided (:func:`~forgeflow.training.memory.checkpointing_decision`) and the decision.

    Raises:
        ValueError: the model's config lacks a field the estimate needs.
    """
    if config.gradient_checkpointing is not None:
        log.info("burst: gradient checkpointing %s, as the burst's config sets it",
                 "on" if config.gradient_checkpointing else "off")
        return plan, None
    if plan.device != "cuda":
        log.info("burst: gradient checkpointing off on the %s", plan.device)
        return plan, None
    if free_bytes is None:
        import torch

        free_bytes = int(torch.cuda.mem_get_info()[0])
    shape = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    decision = checkpointing_decision(shape, tokens_per_step(config), plan.dtype, config.lora_r, free_bytes)
    log.info("burst %s", decision.describe())
    args = {**plan.trainer_args, "activation_checkpointing": decision.checkpointing}
    return plan.model_copy(update={"trainer_args": args}), decision


def sft_trainer(model: Any, tokenizer: Any, dataset: Any, config: BurstConfig, plan: DevicePlan,
                output_dir: Path, *, with_lora: bool = True, callbacks: Sequence[Any] = (),
                overrides: dict[str, Any] | None = None) -> Any:
    """The ``trl.SFTTrainer`` of a burst, ready to ``train()`` (a peft ``model``: ``with_lora=False``).

    Raises:
        InputError: the dataset's columns are no SFT format.
    """
    from trl import SFTTrainer

    plan, _ = resolve_checkpointing(model, config, plan)
    sft_config, lora = _trl_objects(config, output_dir, with_lora, plan, dataset.column_names, overrides or {})
    return SFTTrainer(model=model, args=sft_config, train_dataset=dataset, processing_class=tokenizer,
                      peft_config=lora, callbacks=list(callbacks))


def _reusable(out_dir: Path, expected: dict[str, Any]) -> AdapterRecord | None:
    """The adapter in ``out_dir`` if trained from the same inputs and passed its health gates."""
    if not (out_dir / LINEAGE_FILE).is_file():
        return None
    try:
        record = read_adapter_record(out_dir)
    except (InputError, KeyError, ValueError):
        return None
    if not record.promotable:  # written before the gates, or tampered: train again
        return None
    lineage = record.lineage
    found = {
        "algorithm": lineage.algorithm,
        "base_model_sha256": lineage.base_model_sha256,
        "parent_adapter_sha256": lineage.parent_adapter_sha256,
        "dataset_sha256": lineage.dataset_sha256,
        "hyperparameters": lineage.hyperparameters,
    }
    return record if found == expected else None


def _check_lengths(tokenizer: Any, data: BurstData, max_length: int) -> None:
    """Refuse (``InputError``, the first five named) samples longer than ``max_length`` tokens."""
    too_long: list[tuple[str, int]] = []
    for row in data.dataset:
        text = tokenizer.apply_chat_template(_conversation(row), tokenize=False)
        n_tokens = len(tokenizer(text)["input_ids"])
        if n_tokens > max_length:
            too_long.append((row["instance_id"], n_tokens))
    if too_long:
        named = ", ".join(f"{instance_id} ({n} tokens)" for instance_id, n in too_long[:5])
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        raise InputError(
            f"{len(too_long)} of {len(data.dataset)} SFT samples exceed max_length={max_length} tokens and would "
            f"lose their assistant turns to truncation (the longest has {max(n for _, n in too_long)} tokens: give "
            f"max_length at least that): {named}{more}"
        )


def run_sft_burst(
    base_model_dir: Path,
    data: BurstData,
    out_dir: Path,
    config: BurstConfig,
    parent_adapter_dir: Path | None = None,
    run_id: str | None = None,
) -> AdapterRecord:
    """Train a LoRA adapter on ``data`` through :func:`sft_trainer` (a ``vision_config`` base through
    :mod:`forgeflow.training.vl_burst`); published only after the gates pass, reused when already there.

    Raises:
        InputError: a folder is missing, the parent does not fit (rank, base), or image turns on a text base.
        PreflightError: the chat template is missing, or the disk lacks the space needed.
        BurstDivergedError: a logged loss or gradient norm is NaN or infinite.
        BurstHealthError: a gradient norm left ``config.gates``' band or the loss trend rose.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_model_dir, out_dir = Path(base_model_dir), Path(out_dir).resolve()
    base_sha, parent_sha = resolve_lineage_inputs(base_model_dir, parent_adapter_dir, config.lora_r)
    hyperparameters = config.model_dump(mode="json")
    expected = {
        "algorithm": "sft",
        "base_model_sha256": base_sha,
        "parent_adapter_sha256": parent_sha,
        "dataset_sha256": data.sha256,
        "hyperparameters": hyperparameters,
    }
    existing = _reusable(out_dir, expected)
    if existing is not None:
        return existing
    remove_dead_staging_dirs(out_dir)  # a killed burst's leftovers: free their disk before measuring it
    vision = vl_burst.is_image_text_model(base_model_dir)
    if not vision and any(sample_images.image_count(row) for row in data.dataset):
        raise InputError(f"the samples carry images but base model {base_model_dir} has no vision_config: "
                         "image turns need an image-text-to-text base")
    if vision:  # an image-text-to-text base: unpacked rows through TRL's vision collator (forgeflow.training.vl_burst)
        config = config.model_copy(update={"packing": False})
    burst_preflight(base_model_dir, out_dir, config.lora_r, config.lora_target_modules)  # VL shapes: text_config
    columns = ["messages"] if "messages" in data.dataset.column_names else ["prompt", "completion"]
    plan = burst_plan(config)
    if vision:
        vl = vl_burst.prepare_vl_burst(base_model_dir, data.dataset.to_list(), config, config.max_length,
                                       plan.model_kwargs(), parent_adapter_dir)
        model, tokenizer, dataset = vl.model, vl.processor, vl.dataset
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
        _check_lengths(tokenizer, data, config.max_length)
        model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), **plan.model_kwargs())
        if parent_adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(parent_adapter_dir), is_trainable=True)
        dataset = data.dataset.select_columns(columns)
    with StagingDir(out_dir) as tmp:
        # VL prompt-completion rows: TRL's vision collator masks by completion (its assistant mask is for messages)
        overrides = {"assistant_only_loss": False} if vision and "prompt" in columns else {}
        trainer = sft_trainer(model, tokenizer, dataset, config, plan, tmp / "trainer",
                              with_lora=parent_adapter_dir is None and not vision,
                              callbacks=[health_callback(config.gates)], overrides=overrides)
        trainer.train()
        report = check_health(trainer.state.log_history, config.gates)
        enforce_health(report, hyperparameters)
        if vision:
            vl_burst.check_tower_unchanged(trainer.model, vl, report)
        lineage = Lineage(
            algorithm="sft", base_model_sha256=base_sha, parent_adapter_sha256=parent_sha,
            dataset_sha256=data.sha256, hyperparameters=hyperparameters, run_id=run_id or uuid.uuid4().hex,
            created_at=datetime.now(timezone.utc), device=plan.device, dtype=plan.dtype, attention=plan.attention,
            packing=packing_label(config),
            gradient_checkpointing=bool(trainer.args.activation_checkpointing),
            vision_tower_frozen=True if vision else None,
            vision_tower_sha256=vl.vision_tower_sha256 if vision else None,
        )
        return publish_adapter(trainer, tmp, out_dir, lineage, report)


