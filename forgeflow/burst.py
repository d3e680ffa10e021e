"""SFT bursts: short LoRA training runs that continue an adapter lineage.

A burst trains a LoRA adapter on a chat dataset with TRL's ``SFTTrainer`` and peft on CPU, with
the loss on assistant tokens only (TRL 1.x recognises the official Qwen2.5 chat template and swaps
in its ``{% generation %}``-tagged training template). A burst may continue a parent adapter
(``PeftModel.from_pretrained(..., is_trainable=True)``); its lineage records the digests of the
base model, the parent adapter and the dataset, the hyperparameters and the run id, in
``lineage.json`` inside the adapter folder.

The TRL-style flat options of :class:`BurstConfig` (``lora_r``, ``lora_alpha``, ...) are turned
into ``peft.LoraConfig`` and ``trl.SFTConfig`` in one place, :func:`_trl_objects`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.errors import InputError
from forgeflow.fsutil import atomic_write_json, sha256_file, sha256_json, sha256_tree

LINEAGE_FILE = "lineage.json"
LINEAGE_SCHEMA_VERSION = 1
_ROLES = frozenset({"system", "user", "assistant", "tool"})


class BurstDivergedError(InputError):
    """Training produced a NaN or infinite loss or gradient norm (the message lists the logged
    values). Caused by the inputs (hyperparameters, data, a broken base checkpoint), so never
    retried; no adapter is written."""


class SFTData(BaseModel):
    """An SFT dataset and the digest that identifies it.

    Attributes:
        dataset: a ``datasets.Dataset`` with columns ``messages`` (list of ``{role, content}``),
            ``instance_id`` and ``source`` (provenance).
        sha256: sha256 of the canonical JSON of the rows, in order (:func:`forgeflow.fsutil.sha256_json`).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    dataset: Any
    sha256: str = Field(min_length=64, max_length=64)


class BurstConfig(BaseModel):
    """Hyperparameters of one SFT burst (flat, TRL-style names; translated in one place).

    Defaults suit the tiny CPU model: a few steps at a high learning rate.
    """

    model_config = ConfigDict(frozen=True)

    lora_r: int = Field(default=8, ge=1, le=256)
    lora_alpha: int = Field(default=16, ge=1)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    learning_rate: float = Field(default=1e-3, gt=0.0)
    max_steps: int = Field(default=2, ge=1)
    per_device_train_batch_size: int = Field(default=1, ge=1)
    max_length: int = Field(default=512, ge=16)
    seed: int = 0


class Lineage(BaseModel):
    """Where an adapter comes from.

    Attributes:
        base_model_sha256: :func:`forgeflow.fsutil.sha256_tree` of the base model folder.
        parent_adapter_sha256: :func:`adapter_sha256` of the adapter this one continues, or None.
        dataset_sha256: :attr:`SFTData.sha256`.
        hyperparameters: :class:`BurstConfig` as a dict.
        run_id: the run that trained it (a Prefect flow run id, or a generated uuid4).
        created_at: UTC time the adapter was written.
    """

    model_config = ConfigDict(frozen=True)

    base_model_sha256: str
    parent_adapter_sha256: str | None
    dataset_sha256: str
    hyperparameters: dict[str, Any]
    run_id: str
    created_at: datetime


class AdapterRecord(BaseModel):
    """A trained LoRA adapter folder and its lineage.

    Attributes:
        path: the adapter folder (peft ``save_pretrained`` output plus ``lineage.json``).
        sha256: :func:`adapter_sha256` of the folder (the adapter files, without ``lineage.json``).
        lineage: see :class:`Lineage`.
        final_loss: training loss logged at the last step (nats per assistant token).
        steps: optimizer steps run.
    """

    model_config = ConfigDict(frozen=True)

    path: Path
    sha256: str = Field(min_length=64, max_length=64)
    lineage: Lineage
    final_loss: float
    steps: int = Field(ge=1)


# --- data ------------------------------------------------------------------------------------
def build_sft_dataset(samples: list[dict]) -> SFTData:
    """Turn chat samples into a ``datasets.Dataset`` with a content digest.

    Args:
        samples: dicts with ``messages`` (a non-empty list of ``{"role", "content"}`` with string
            content and at least one assistant turn), ``instance_id`` and ``source`` (strings).
            Other keys are dropped.

    Returns:
        The dataset (columns ``messages``, ``instance_id``, ``source``, in input order) and the
        sha256 of the canonical JSON of those rows.

    Raises:
        InputError: ``samples`` is empty or a sample is malformed (the message names its index
            and the field).
    """
    from datasets import Dataset

    if not samples:
        raise InputError("samples is empty: an SFT dataset needs at least one sample")
    rows = []
    for i, sample in enumerate(samples):
        for key in ("instance_id", "source"):
            if not isinstance(sample.get(key), str) or not sample[key]:
                raise InputError(f"samples[{i}].{key} must be a non-empty string")
        messages = sample.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InputError(f"samples[{i}].messages must be a non-empty list")
        clean = []
        for j, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in _ROLES:
                raise InputError(
                    f"samples[{i}].messages[{j}].role must be one of {sorted(_ROLES)}"
                )
            if not isinstance(message.get("content"), str):
                raise InputError(f"samples[{i}].messages[{j}].content must be a string")
            clean.append({"role": message["role"], "content": message["content"]})
        if not any(m["role"] == "assistant" for m in clean):
            raise InputError(f"samples[{i}].messages has no assistant turn to train on")
        rows.append(
            {"messages": clean, "instance_id": sample["instance_id"], "source": sample["source"]}
        )
    return SFTData(dataset=Dataset.from_list(rows), sha256=sha256_json(rows))


# --- adapters --------------------------------------------------------------------------------
def adapter_sha256(adapter_dir: Path) -> str:
    """Digest of an adapter folder without its ``lineage.json``.

    Same scheme as :func:`forgeflow.fsutil.sha256_tree` (sorted relative paths with file
    digests, canonical JSON), so the digest names the weights and config, not when they were made.
    """
    base = Path(adapter_dir)
    entries = sorted(
        (p.relative_to(base).as_posix(), sha256_file(p))
        for p in base.rglob("*")
        if p.is_file() and p.relative_to(base).as_posix() != LINEAGE_FILE
    )
    return sha256_json(entries)


def read_adapter_record(adapter_dir: Path) -> AdapterRecord:
    """Read the record from ``<adapter_dir>/lineage.json`` and check the adapter digest.

    Raises:
        InputError: no ``lineage.json``, or the adapter files no longer match its digest.
    """
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / LINEAGE_FILE
    if not path.is_file():
        raise InputError(f"adapter {adapter_dir} has no {LINEAGE_FILE}")
    data = json.loads(path.read_text(encoding="utf-8"))
    record = AdapterRecord(
        path=adapter_dir,
        sha256=data["sha256"],
        lineage=Lineage.model_validate(data["lineage"]),
        final_loss=data["final_loss"],
        steps=data["steps"],
    )
    actual = adapter_sha256(adapter_dir)
    if actual != record.sha256:
        raise InputError(
            f"adapter {adapter_dir} digest {actual} differs from {record.sha256} in {LINEAGE_FILE}"
        )
    return record


def _trl_objects(config: BurstConfig, output_dir: Path, with_lora: bool) -> tuple[Any, Any]:
    """Translate :class:`BurstConfig` into ``(trl.SFTConfig, peft.LoraConfig | None)``."""
    from peft import LoraConfig
    from trl import SFTConfig

    sft = SFTConfig(
        output_dir=str(output_dir),
        learning_rate=config.learning_rate,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.per_device_train_batch_size,
        max_length=config.max_length,
        seed=config.seed,
        data_seed=config.seed,
        assistant_only_loss=True,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        # Trainer by default replaces a NaN/inf step loss by the running mean before logging,
        # which would hide a divergence: log the real values.
        logging_nan_inf_filter=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        lr_scheduler_type="constant",
        warmup_steps=0,
    )
    lora = None
    if with_lora:
        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.lora_target_modules),
            task_type="CAUSAL_LM",
        )
    return sft, lora


def _reusable(out_dir: Path, expected: dict[str, Any]) -> AdapterRecord | None:
    """Return the existing adapter in ``out_dir`` if it was trained from the same inputs."""
    if not (out_dir / LINEAGE_FILE).is_file():
        return None
    try:
        record = read_adapter_record(out_dir)
    except (InputError, KeyError, ValueError):
        return None
    lineage = record.lineage
    found = {
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
        InputError: names each sample (instance_id, token count) that does not fit.
    """
    too_long = []
    for row in data.dataset:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        n_tokens = len(tokenizer(text)["input_ids"])
        if n_tokens > max_length:
            too_long.append(f"{row['instance_id']} ({n_tokens} tokens)")
    if too_long:
        raise InputError(
            f"{len(too_long)} of {len(data.dataset)} SFT samples exceed max_length={max_length} "
            f"tokens and would lose their assistant turns to truncation: {', '.join(too_long[:5])}"
        )


def run_sft_burst(
    base_model_dir: Path,
    data: SFTData,
    out_dir: Path,
    config: BurstConfig,
    parent_adapter_dir: Path | None = None,
    run_id: str | None = None,
) -> AdapterRecord:
    """Train a LoRA adapter on ``data`` with TRL ``SFTTrainer`` on CPU (assistant-only loss).

    With ``parent_adapter_dir`` the burst continues that adapter
    (``PeftModel.from_pretrained(base, parent, is_trainable=True)``); its LoRA rank must equal
    ``config.lora_r`` and its lineage must name the same base model. The adapter is trained in a
    temporary sibling folder, ``lineage.json`` is written there atomically, and the folder is
    renamed onto ``out_dir``. If ``out_dir`` already holds an intact adapter trained from the
    same base, parent, dataset and hyperparameters, it is returned without training (a resumed
    run does not train twice).

    Args:
        base_model_dir: HF model folder with tokenizer (e.g. from
            :func:`forgeflow.model.build_tiny_model`).
        data: from :func:`build_sft_dataset`.
        out_dir: the adapter folder to create.
        config: hyperparameters.
        parent_adapter_dir: an adapter folder written by an earlier burst, or None.
        run_id: recorded in the lineage; a uuid4 hex when None.

    Returns:
        The adapter's record (digest, lineage, final loss, steps).

    Raises:
        InputError: a folder is missing, or the parent does not fit (rank, base model).
        BurstDivergedError: a logged loss or gradient norm is NaN or infinite (the message lists
            every logged step with its loss and gradient norm).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    base_model_dir, out_dir = Path(base_model_dir), Path(out_dir).resolve()
    if not (base_model_dir / "config.json").is_file():
        raise InputError(f"base_model_dir {base_model_dir} holds no config.json")
    base_sha = sha256_tree(base_model_dir)
    parent_sha = None
    if parent_adapter_dir is not None:
        parent_adapter_dir = Path(parent_adapter_dir)
        parent = read_adapter_record(parent_adapter_dir)
        if parent.lineage.base_model_sha256 != base_sha:
            raise InputError(
                f"parent_adapter_dir {parent_adapter_dir} was trained on base model "
                f"{parent.lineage.base_model_sha256}, not {base_sha} ({base_model_dir})"
            )
        parent_r = json.loads((parent_adapter_dir / "adapter_config.json").read_text())["r"]
        if parent_r != config.lora_r:
            raise InputError(
                f"config.lora_r {config.lora_r} differs from the parent adapter's r {parent_r}"
            )
        parent_sha = parent.sha256
    hyperparameters = config.model_dump(mode="json")
    expected = {
        "base_model_sha256": base_sha,
        "parent_adapter_sha256": parent_sha,
        "dataset_sha256": data.sha256,
        "hyperparameters": hyperparameters,
    }
    existing = _reusable(out_dir, expected)
    if existing is not None:
        return existing

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    _check_lengths(tokenizer, data, config.max_length)
    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    if parent_adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(parent_adapter_dir), is_trainable=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    os.chmod(tmp, 0o755)
    try:
        sft_config, lora = _trl_objects(config, tmp / "trainer", with_lora=parent_adapter_dir is None)
        trainer = SFTTrainer(
            model=model,
            args=sft_config,
            train_dataset=data.dataset.select_columns(["messages"]),
            processing_class=tokenizer,
            peft_config=lora,
        )
        trainer.train()
        history = trainer.state.log_history
        losses = [(e["step"], e["loss"]) for e in history if "loss" in e]
        norms = [(e["step"], e["grad_norm"]) for e in history if "grad_norm" in e]
        if not losses:
            raise BurstDivergedError(f"training logged no loss; log history: {history}")
        if any(not math.isfinite(v) for _, v in losses + norms):
            raise BurstDivergedError(
                f"training loss is not finite (step, loss): {losses}; (step, grad_norm): "
                f"{norms}; hyperparameters {hyperparameters}"
            )
        shutil.rmtree(tmp / "trainer", ignore_errors=True)
        trainer.model.save_pretrained(str(tmp))
        digest = adapter_sha256(tmp)
        lineage = Lineage(
            base_model_sha256=base_sha,
            parent_adapter_sha256=parent_sha,
            dataset_sha256=data.sha256,
            hyperparameters=hyperparameters,
            run_id=run_id or uuid.uuid4().hex,
            created_at=datetime.now(timezone.utc),
        )
        final_loss, steps = float(losses[-1][1]), int(trainer.state.global_step)
        atomic_write_json(
            tmp / LINEAGE_FILE,
            {
                "schema_version": LINEAGE_SCHEMA_VERSION,
                "sha256": digest,
                "final_loss": final_loss,
                "steps": steps,
                "lineage": lineage.model_dump(mode="json"),
            },
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return AdapterRecord(
        path=out_dir, sha256=digest, lineage=lineage, final_loss=final_loss, steps=steps
    )
