"""SFT bursts: short LoRA training runs that continue an adapter lineage.

A burst trains a LoRA adapter on a chat dataset with TRL's ``SFTTrainer`` and peft, with the loss
on assistant tokens only (TRL 1.x recognises the official Qwen2.5 chat template and swaps in its
``{% generation %}``-tagged training template). A burst may continue a parent adapter
(``PeftModel.from_pretrained(..., is_trainable=True)``); its lineage records the digests of the
base model, the parent adapter and the dataset, the hyperparameters, the run id, and how it
trained (device, dtype, attention, packing, gradient checkpointing), in ``lineage.json`` inside the adapter folder.

One training path for every device (:func:`sft_trainer`, which :func:`run_sft_burst` and the GPU
benchmark ``benchmarks/gpu_burst.py`` both call): the device plan
(:func:`forgeflow.training.device.device_plan`: CUDA in bfloat16, with gradient checkpointing where a
step's activations would not fit the GPU's free memory (:mod:`forgeflow.training.memory`), else the CPU
in float32) and, unless ``BurstConfig.packing`` is off,

* **bfd packing, padding-free**: TRL's best-fit-decreasing packing (``packing_strategy="bfd"``) puts
  whole samples into rows of ``max_length`` tokens, and the padding-free collator flattens a batch
  into one sequence with per-document ``position_ids`` and ``cu_seq_lens``: no pad token is computed,
  and the attention of :attr:`DevicePlan.attention` keeps each document to itself
  (:mod:`forgeflow.training.attention`; TRL docs, "Packing" in the SFTTrainer guide).
* **the fused, chunked loss**: TRL 1.16's ``loss_type="nll"`` projects only the positions that carry
  a label through the LM head, in tiles, and never builds the ``(tokens, vocabulary)`` logits
  (``trl.trainer.utils.add_fused_lm_head``), so a 150k vocabulary does not dominate memory.

Packing keeps the loss masks of both dataset formats: TRL 1.16 folds the assistant mask
(``messages`` rows) and the completion mask (``prompt``/``completion`` rows) into a ``labels``
column (-100 off the target) while it tokenizes, before ``pack_dataset`` moves ``input_ids`` and
``labels`` together into rows; the collator then sets the label of each packed document's first
token to -100, so no document is trained to follow another's last token. A packed first step has
the loss of the same samples trained unpacked (``tests/core/training/test_burst_packing.py``).

The TRL-style flat options of :class:`BurstConfig` (``lora_r``, ``lora_alpha``, ...) are turned
into ``peft.LoraConfig`` and ``trl.SFTConfig`` in one place, :func:`sft_arguments` and
:func:`_trl_objects`.

The pieces shared with RL bursts live beside it: health gates (:mod:`forgeflow.training.health`),
the preflight (:mod:`forgeflow.training.preflight`), staging folders
(:mod:`forgeflow.training.staging`) and adapters with their lineage
(:mod:`forgeflow.training.adapters`).
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


class SFTData(BaseModel):
    """An SFT dataset and the digest that identifies it.

    Attributes:
        dataset: a ``datasets.Dataset`` with columns ``messages`` (list of ``{role, content}``),
            ``instance_id`` and ``source`` (provenance).
        sha256: sha256 of the canonical JSON of the rows, in order (:func:`forgeflow.common.fsutil.sha256_json`).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    dataset: Any
    sha256: str = Field(min_length=64, max_length=64)


class BurstConfig(LoraSettings):
    """Hyperparameters of one SFT burst (flat, TRL-style names; translated in one place).

    The LoRA fields (``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``) are
    :class:`~forgeflow.training.adapters.LoraSettings`. Defaults suit the tiny CPU model: a few
    steps at a high learning rate. ``gates`` are the :class:`HealthGates` the burst must pass for
    its adapter to be written. ``device``: ``auto`` (CUDA in bfloat16 when available, else the CPU in
    float32), ``cpu`` or ``cuda`` (:func:`forgeflow.training.device.device_plan`); the lineage records
    what was used. ``packing``: True (default) packs samples into rows of ``max_length`` tokens
    (TRL's bfd packing, padding-free batches; ``per_device_train_batch_size`` counts packed rows);
    False trains one sample per row, padded to the longest of its batch. ``gradient_checkpointing``:
    recompute activations in the backward pass (less memory, about a third more compute); None (default)
    decides by the machine (on CUDA: on only when a step's activations would not fit the GPU's free
    memory, :func:`resolve_checkpointing`; off on the CPU), True or False overrides it; the lineage
    records what was used.
    """

    model_config = ConfigDict(frozen=True)

    learning_rate: float = Field(default=1e-3, gt=0.0)
    max_steps: int = Field(default=2, ge=1)
    per_device_train_batch_size: int = Field(default=1, ge=1)
    max_length: int = Field(default=512, ge=16)
    seed: int = 0
    gates: HealthGates = Field(default_factory=HealthGates)
    device: DeviceChoice = "auto"
    packing: bool = True
    gradient_checkpointing: bool | None = None


PACKING_STRATEGY = "bfd"
"""TRL's packing strategy of a packed burst: best-fit decreasing, whole samples per row (a sample
longer than a row would be truncated; :func:`_check_lengths` refuses one first)."""


# --- data ------------------------------------------------------------------------------------
def _clean_message(message: Any, where: str) -> dict[str, Any]:
    """One chat message checked: ``role`` (system/user/assistant/tool), ``content`` a string or text/image parts
    (:func:`forgeflow.training.sample_images.clean_content`: image files absolute, checked, by sha256); the tool
    keys are kept when the message has them: ``tool_calls`` (None, or a list of ``{id, type:
    "function", function: {name, arguments}}`` with string name and JSON-string arguments) and
    ``tool_call_id`` (None or a string).

    Raises:
        InputError: a field is missing or malformed (``where`` and the field named).
    """
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


def build_sft_dataset(samples: list[dict]) -> SFTData:
    """Turn chat samples into a ``datasets.Dataset`` with a content digest.

    Two formats, one per dataset (TRL's conversational formats):

    * ``messages``: a non-empty list of messages with at least one assistant turn; the loss is on
      the assistant turns.
    * ``prompt`` + ``completion`` (e.g. training windows from trajectories,
      :func:`forgeflow.training.windows.window_samples`): the context, and the assistant message(s)
      to learn; the loss is on the completion only.

    A message is ``{"role", "content"}`` (a string, or text and image parts: image turns for an
    image-text-to-text base, :mod:`forgeflow.training.vl_burst`), with ``tool_calls`` / ``tool_call_id``
    kept when present (the chat template renders the calls). Rows with parts are stored with every
    content a list of uniform parts (one Arrow type, :func:`~forgeflow.training.sample_images.uniform_parts`).

    Args:
        samples: dicts in one of the formats above, each with ``instance_id`` and ``source``
            (non-empty strings: the sample's provenance). Other keys are dropped.

    Returns:
        The dataset (columns ``messages`` or ``prompt``/``completion``, then ``instance_id``,
        ``source``, in input order) and their :func:`dataset_sha256`.

    Raises:
        InputError: ``samples`` is empty, mixes the two formats, or a sample is malformed (the
            message names its index and the field).
    """
    from datasets import Dataset

    rows = sft_rows(samples)
    table = sample_images.uniform_parts(rows) if sample_images.has_parts(rows) else rows
    return SFTData(dataset=Dataset.from_list(table), sha256=dataset_sha256(rows))


def dataset_sha256(rows: list[dict[str, Any]]) -> str:
    """The digest of checked rows (:func:`sft_rows`): ``sha256_json`` of them with each image part named by its
    sha256 only (:func:`forgeflow.training.sample_images.digest_view`); text-only rows: ``sha256_json(rows)``."""
    return sha256_json(sample_images.digest_view(rows))


def sft_rows(samples: list[dict]) -> list[dict[str, Any]]:
    """The checked, cleaned rows of :func:`build_sft_dataset` (whose sha256 is ``sha256_json`` of them:
    the ``dataset_sha256`` an adapter's lineage records), without building the dataset.

    Raises:
        InputError: as :func:`build_sft_dataset`.
    """
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
    """The ``SFTConfig`` loss-mask options for a dataset with these training columns.

    * ``messages`` (conversational): ``assistant_only_loss`` (TRL's assistant mask).
    * ``prompt`` + ``completion`` (conversational prompt-completion): ``completion_only_loss`` and
      ``assistant_only_loss`` (the completion holds assistant messages only, so both masks agree).
    * ``input_ids`` (already tokenized language-modeling rows, e.g. the GPU benchmark's synthetic
      tokens): the loss on every token.

    Raises:
        InputError: the columns are none of these.
    """
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
    """How a burst of ``config`` batches samples, as its lineage records it: :data:`PACKING_STRATEGY`
    (packed, padding-free) or ``none`` (one sample per row, padded)."""
    return PACKING_STRATEGY if config.packing else "none"


def sft_arguments(config: BurstConfig, plan: DevicePlan, columns: Sequence[str]) -> dict[str, Any]:
    """The ``trl.SFTConfig`` keyword arguments (all but ``output_dir``) of a burst.

    ``config``'s hyperparameters, :data:`TRAINER_RUN_ARGS`, the device fields of ``plan``
    (``use_cpu``, ``bf16``, ``gradient_checkpointing``; ``config.gradient_checkpointing`` wins when set), the
    loss masks of :func:`loss_scope`, TRL's
    fused chunked ``loss_type="nll"``, and with ``config.packing`` bfd packing into rows of
    ``max_length`` tokens with padding-free batches (``packing=False``: neither).

    Raises:
        InputError: ``columns`` are no SFT format (:func:`loss_scope`).
    """
    return {
        "learning_rate": config.learning_rate, "max_steps": config.max_steps,
        "per_device_train_batch_size": config.per_device_train_batch_size, "max_length": config.max_length,
        "seed": config.seed, "data_seed": config.seed, "loss_type": "nll",
        "packing": config.packing, "packing_strategy": PACKING_STRATEGY, "padding_free": config.packing,
        **loss_scope(columns),
        **TRAINER_RUN_ARGS,
        **plan.trainer_args,
        **_checkpointing(config),
    }


def _checkpointing(config: BurstConfig) -> dict[str, bool]:
    """``{"activation_checkpointing": ...}`` (transformers 5's name for gradient checkpointing; its
    ``gradient_checkpointing`` is a deprecated alias) where ``config`` sets it; empty where the device plan decides."""
    return {} if config.gradient_checkpointing is None else {"activation_checkpointing": config.gradient_checkpointing}


def _trl_objects(config: BurstConfig, output_dir: Path, with_lora: bool, plan: DevicePlan,
                 columns: Sequence[str], overrides: dict[str, Any]) -> tuple[Any, Any]:
    """Translate :class:`BurstConfig` into ``(trl.SFTConfig, peft.LoraConfig | None)``."""
    from trl import SFTConfig

    sft = SFTConfig(output_dir=str(output_dir), **{**sft_arguments(config, plan, columns), **overrides})
    return sft, (lora_config(config) if with_lora else None)


def burst_plan(config: BurstConfig, plan: DevicePlan | None = None) -> DevicePlan:
    """The device plan of a burst: :func:`device_plan` of ``config.device`` (or ``plan``), with SDPA
    instead of ``torch_varlen`` for an unpacked burst (that kernel reads the boundaries of a
    padding-free batch; a padded batch has none), and ``config.gradient_checkpointing`` in its
    ``trainer_args`` when set."""
    plan = plan or device_plan(config.device)
    if not config.packing and plan.attention == VARLEN_ATTENTION:
        plan = plan.model_copy(update={"attention": "sdpa"})
    if config.gradient_checkpointing is not None:
        plan = plan.model_copy(update={"trainer_args": {**plan.trainer_args, **_checkpointing(config)}})
    return plan


def tokens_per_step(config: BurstConfig) -> int:
    """Most tokens one step of ``config`` trains on: ``per_device_train_batch_size`` rows of at most
    ``max_length`` tokens (a packed row, or an unpacked batch padded to its longest sample)."""
    return config.per_device_train_batch_size * config.max_length


def resolve_checkpointing(model: Any, config: BurstConfig, plan: DevicePlan,
                          free_bytes: int | None = None) -> tuple[DevicePlan, CheckpointingDecision | None]:
    """The plan with gradient checkpointing decided for this model and step size.

    ``config.gradient_checkpointing`` set, or a CPU plan: ``plan`` as it is and no decision. On CUDA
    with ``config.gradient_checkpointing`` None: :func:`forgeflow.training.memory.checkpointing_decision`
    on ``model.config``, :func:`tokens_per_step` and the GPU memory free now (the model loaded), which
    turns checkpointing off where the activations of a step fit. Each case logs one line on this module's
    logger (the burst flows forward it to the run's log).

    Args:
        model: the loaded model (or peft model); its ``config`` gives the shape.
        config: the burst's hyperparameters.
        plan: the device plan (:func:`burst_plan`).
        free_bytes: GPU memory free (default: ``torch.cuda.mem_get_info()[0]``); given by tests.

    Returns:
        (the plan with ``trainer_args["activation_checkpointing"]`` decided, the decision or None).

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
    """The ``trl.SFTTrainer`` of a burst, ready to ``train()``: the one training path of SFT.

    :func:`run_sft_burst` wraps it (preflight, lineage, health gates, staging); the GPU benchmark
    (``benchmarks/gpu_burst.py``) times it against a naive loop.

    Args:
        model: a causal LM loaded with ``plan.model_kwargs()`` (dtype and attention), or a peft model
            continuing an adapter (then ``with_lora=False``).
        tokenizer: its tokenizer (chat template for conversational rows; pad and eos ids always).
        dataset: a ``datasets.Dataset`` with only training columns: ``messages``, ``prompt`` +
            ``completion``, or ``input_ids`` (:func:`loss_scope`).
        config: hyperparameters (``packing``, ``max_length``: tokens per packed row or per sample).
        plan: the device plan (:func:`burst_plan`); on CUDA with ``config.gradient_checkpointing`` None,
            gradient checkpointing is decided here by memory (:func:`resolve_checkpointing`).
        output_dir: the trainer's scratch folder (no checkpoints are saved).
        with_lora: add a new LoRA adapter of ``config`` (peft ``LoraConfig``).
        callbacks: ``transformers.TrainerCallback`` objects (health gates, timers).
        overrides: ``trl.SFTConfig`` fields set over :func:`sft_arguments` (a VL burst's loss mask).

    Returns:
        The trainer (its ``train_dataset`` is the tokenized, packed dataset; ``args.activation_checkpointing``
        says whether it recomputes activations).

    Raises:
        InputError: the dataset's columns are no SFT format.
    """
    from trl import SFTTrainer

    plan, _ = resolve_checkpointing(model, config, plan)
    sft_config, lora = _trl_objects(config, output_dir, with_lora, plan, dataset.column_names, overrides or {})
    return SFTTrainer(model=model, args=sft_config, train_dataset=dataset, processing_class=tokenizer,
                      peft_config=lora, callbacks=list(callbacks))


def _reusable(out_dir: Path, expected: dict[str, Any]) -> AdapterRecord | None:
    """Return the existing adapter in ``out_dir`` if it was trained from the same inputs and
    passed its health gates (a record is the only evidence of a finished burst)."""
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


def _check_lengths(tokenizer: Any, data: SFTData, max_length: int) -> None:
    """Preflight: every sample fits ``max_length`` tokens once the chat template is applied.

    TRL truncates from the right, so an over-long conversation loses its last assistant turns
    (the training target) and, when every sample does, trains on nothing. Fail before training.

    Raises:
        InputError: how many samples do not fit, the longest's token count (the ``max_length`` that
            would take them all) and the first five (instance_id, token count), then how many more.
    """
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
    data: SFTData,
    out_dir: Path,
    config: BurstConfig,
    parent_adapter_dir: Path | None = None,
    run_id: str | None = None,
) -> AdapterRecord:
    """Train a LoRA adapter on ``data`` with TRL ``SFTTrainer`` (assistant-only loss) on the device
    ``config.device`` resolves to (:func:`forgeflow.training.device.device_plan`: CUDA in bfloat16
    when available, gradient checkpointing where a step's activations would not fit the GPU
    (:func:`resolve_checkpointing`), else the CPU in float32), through :func:`sft_trainer`:
    bfd-packed padding-free rows (``config.packing``) and TRL's fused chunked loss. The lineage
    records device, dtype, attention implementation, packing and gradient checkpointing.

    A base with a ``vision_config`` (image turns allowed) trains through :mod:`forgeflow.training.vl_burst`:
    ``AutoModelForImageTextToText``, vision tower frozen (checked unchanged after training), LoRA on the
    language model only, images through the processor, unpacked rows; the lineage records the tower frozen
    and its sha256. Image turns on a text-only base are refused (InputError) before any model loads.

    With ``parent_adapter_dir`` the burst continues that adapter
    (``PeftModel.from_pretrained(base, parent, is_trainable=True)``); its LoRA rank must equal
    ``config.lora_r`` and its lineage must name the same base model. Staging folders that killed
    bursts left beside ``out_dir`` are removed first (:func:`remove_dead_staging_dirs`; a live
    burst's never), then :func:`burst_preflight` runs. The adapter is trained in a
    :class:`StagingDir` (a temporary sibling folder holding its owner's lock), ``lineage.json``
    is written there atomically, and the folder is
    renamed onto ``out_dir`` only after the health gates (``config.gates``) passed. If ``out_dir``
    already holds an intact adapter trained from the same base, parent, dataset and
    hyperparameters with a passing health report, it is returned without training (a resumed run
    does not train twice; a failed earlier burst left no folder to be mistaken for a finished one).

    Args:
        base_model_dir: HF model folder with tokenizer (e.g. from
            :func:`forgeflow.packaging.base_model.build_tiny_model`).
        data: from :func:`build_sft_dataset`.
        out_dir: the adapter folder to create.
        config: hyperparameters.
        parent_adapter_dir: an adapter folder written by an earlier burst, or None.
        run_id: recorded in the lineage; a uuid4 hex when None.

    Returns:
        The adapter's record (digest, lineage, final loss, steps).

    Raises:
        InputError: a folder is missing, or the parent does not fit (rank, base model).
        PreflightError: the chat template is missing or empty, or the adapter folder's file
            system lacks the space :func:`estimate_checkpoint_bytes` asks for (nothing trained).
        BurstDivergedError: a logged loss or gradient norm is NaN or infinite (the message lists
            every logged step with its loss and gradient norm); training stops at the first one.
        BurstHealthError: a gradient norm left ``config.gates``' band or the loss trend rose
            (the message carries the logged values). No adapter is written in either case.
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


