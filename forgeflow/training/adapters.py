"""Adapters and their lineage (``lineage.json`` beside ``adapter_config.json`` and
``adapter_model.safetensors``): digests, pinning, publishing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import (
    atomic_folder,
    atomic_write_json,
    atomic_write_text,
    read_json_object,
    sha256_file,
    sha256_json,
    sha256_tree,
)
from forgeflow.training.health import HealthReport
from forgeflow.training.staging import STAGING_LOCK_FILE


class LoraSettings(BaseModel):
    """The LoRA adapter of a burst, as flat TRL-style options (SFT and RL bursts share them, names and defaults)."""

    model_config = ConfigDict(frozen=True)

    lora_r: int = Field(default=8, ge=1, le=256, description="rank of the update matrices; a continued adapter "
                        "must have the same rank")
    lora_alpha: int = Field(None, ge=1, validate_default=True, description="scaling numerator: the update is "
                            "scaled by lora_alpha / lora_r; null: 2 x lora_r")  # None is filled in before validation
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout on the LoRA path")
    lora_target_modules: tuple[str, ...] = Field(("q_proj", "k_proj", "v_proj", "o_proj"),
        description="modules that get adapters (Qwen2's attention projections by default)")

    @model_validator(mode="before")
    @classmethod
    def _alpha_follows_rank(cls, data: Any) -> Any:
        rank = data.get("lora_r", cls.model_fields["lora_r"].default) if isinstance(data, dict) else None
        if isinstance(rank, int) and data.get("lora_alpha") is None:
            return {**data, "lora_alpha": 2 * rank}
        return data


def lora_config(config: LoraSettings) -> Any:
    """``peft.LoraConfig`` of a burst's :class:`LoraSettings` (the one place they are translated)."""
    from peft import LoraConfig

    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")

LINEAGE_FILE = "lineage.json"


LINEAGE_SCHEMA_VERSION = 6
"""2: adds ``lineage.algorithm`` and ``health`` (version 1 files read as algorithm ``sft``
without a health report, hence not reusable). 3: ``sha256`` is :func:`adapter_sha256` of the
weights and config only (versions 1-2 digested every file but ``lineage.json``, README included;
such files are still verified with that older scheme). 4: adds ``lineage.attention`` and
``lineage.packing`` (None in older files). 5: adds ``lineage.gradient_checkpointing`` (None in older
files). 6: adds ``lineage.vision_tower_frozen`` and ``lineage.vision_tower_sha256`` (None in older files)."""


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""The files that are the trained adapter (peft ``save_pretrained`` with safetensors)."""


UNORDERED_CONFIG_FIELDS = ("target_modules", "exclude_modules")
"""``adapter_config.json`` lists that peft holds as Python sets (``LoraConfig.__post_init__``) and
writes in set iteration order, which follows the process's string hash seed (``PYTHONHASHSEED``):
the same config reloaded and saved by another process can list them in another order."""


def canonicalize_adapter_config(adapter_dir: Path) -> None:
    """Rewrite ``adapter_dir/adapter_config.json`` with :data:`UNORDERED_CONFIG_FIELDS` sorted (peft's layout).

    Raises:
        InputError: the file is missing or not a JSON object.
    """
    path = Path(adapter_dir) / "adapter_config.json"
    config = read_json_object(path, "adapter config")
    changed = False
    for key in UNORDERED_CONFIG_FIELDS:
        value = config.get(key)
        if isinstance(value, list) and all(isinstance(v, str) for v in value) and value != sorted(value):
            config[key], changed = sorted(value), True
    if changed:
        # peft's own serialisation (``PeftConfigMixin.save_pretrained``), so a file peft happened to write
        # sorted and a rewritten one are the same bytes
        atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True))


class Lineage(BaseModel):
    """Where an adapter comes from; the optional fields are None where not recorded (older adapters, verl)."""

    model_config = ConfigDict(frozen=True)

    algorithm: str = Field("sft", description="sft, grpo, rloo or ppo")
    base_model_sha256: str = Field(description="sha256_tree of the base model folder")
    parent_adapter_sha256: str | None = Field(description="adapter_sha256 of the adapter this one continues, or None")
    dataset_sha256: str = Field(description="digest of the SFT or RL dataset")
    hyperparameters: dict[str, Any] = Field(description="the burst's config as a dict")
    run_id: str = Field(description="the run that trained it (a Prefect flow run id or a uuid4)")
    created_at: datetime = Field(description="UTC time the adapter was written")
    device: str | None = Field(None, description="cpu or cuda")
    dtype: str | None = Field(None, description="float32 or bfloat16")
    attention: str | None = Field(None,
        description="SFT: the attention implementation (sdpa, flash_attention_2, torch_varlen)")
    packing: str | None = Field(None, description="SFT: bfd (packed, padding-free) or none (padded)")
    gradient_checkpointing: bool | None = Field(None,
        description="whether the trainer recomputed activations in the backward pass")
    vision_tower_frozen: bool | None = Field(None,
        description="image-text-to-text base: the tower was frozen and checked unchanged")
    vision_tower_sha256: str | None = Field(None, min_length=64, max_length=64,
        description="image-text-to-text base: vision_tower_sha256 of the base's tower")


class AdapterRecord(BaseModel):
    """A trained LoRA adapter folder and its lineage."""

    model_config = ConfigDict(frozen=True)

    path: Path = Field(description="the adapter folder (peft save_pretrained output plus lineage.json)")
    sha256: str = Field(min_length=64, max_length=64, description="adapter_sha256 of the folder")
    lineage: Lineage
    final_loss: float | None = Field(
        description="training loss at the last step (nats per assistant token for SFT); None for a verl checkpoint")
    steps: int = Field(ge=1, description="optimizer steps run")
    health: HealthReport | None = Field(None,
        description="the burst's health report (None: written before the gates existed, never promotable)")

    @property
    def parent_sha256(self) -> str:
        """What the adapter continues: its parent adapter's digest, else its base model's (a lineage row's parent)."""
        return self.lineage.parent_adapter_sha256 or self.lineage.base_model_sha256

    @property
    def promotable(self) -> bool:
        """True iff the burst passed every health gate (the only adapters a release may use)."""
        return self.health is not None and self.health.passed


# --- adapters --------------------------------------------------------------------------------
def adapter_sha256(adapter_dir: Path) -> str:
    """Digest of :data:`ADAPTER_FILES` only (``sha256_tree`` scheme): lineage and README never change it.

    Raises:
        InputError: one of :data:`ADAPTER_FILES` is missing (named with the folder).
    """
    base = Path(adapter_dir)
    missing = [name for name in ADAPTER_FILES if not (base / name).is_file()]
    if missing:
        raise InputError(f"adapter folder {base} lacks {', '.join(missing)}")
    return sha256_json([(name, sha256_file(base / name)) for name in ADAPTER_FILES])


def _legacy_adapter_sha256(adapter_dir: Path) -> str:
    """The digest ``lineage.json`` schema versions 1-2 recorded: every file but ``lineage.json``."""
    base = Path(adapter_dir)
    entries = sorted(
        (p.relative_to(base).as_posix(), sha256_file(p))
        for p in base.rglob("*")
        if p.is_file() and p.relative_to(base).as_posix() != LINEAGE_FILE
    )
    return sha256_json(entries)


def adapter_matches(adapter_dir: Path, sha256: str) -> bool:
    """True iff ``adapter_dir`` holds the adapter ``sha256`` (or lineage schema 1-2's all-files digest)."""
    base = Path(adapter_dir)
    if not base.is_dir():
        return False
    try:
        if adapter_sha256(base) == sha256:
            return True
    except InputError:
        return False
    return _legacy_adapter_sha256(base) == sha256


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
        final_loss=data.get("final_loss"),
        steps=data["steps"],
        health=HealthReport.model_validate(data["health"]) if data.get("health") else None,
    )
    legacy = int(data.get("schema_version", 1)) < 3
    actual = _legacy_adapter_sha256(adapter_dir) if legacy else adapter_sha256(adapter_dir)
    if actual != record.sha256:
        raise InputError(
            f"adapter {adapter_dir} digest {actual} differs from {record.sha256} in {LINEAGE_FILE}"
        )
    return record


def pin_adapter(record: AdapterRecord, adapters_dir: Path) -> AdapterRecord:
    """Copy an adapter into ``<adapters_dir>/<sha256>`` (idempotent; a stale pinned folder is replaced).

    Raises:
        InputError: neither the pinned folder nor ``record.path`` holds the adapter ``record.sha256``.
    """
    adapters_dir = Path(adapters_dir).resolve()
    dest = adapters_dir / record.sha256
    if adapter_matches(dest, record.sha256):
        return record.model_copy(update={"path": dest})
    source = Path(record.path)
    if not adapter_matches(source, record.sha256):
        try:
            found = adapter_sha256(source)
        except InputError as exc:
            found = f"no adapter ({exc})"
        raise InputError(
            f"adapter {record.sha256} is not pinned under {adapters_dir}, and {source} now holds "
            f"{found}: train it again"
        )
    # an existing dest is replaced: its content no longer matched its name
    with atomic_folder(dest) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(STAGING_LOCK_FILE, "trainer"))
        if not adapter_matches(tmp, record.sha256):  # the source changed while it was copied
            raise InputError(f"adapter {source} changed while it was copied to {dest}")
    return record.model_copy(update={"path": dest})


def resolve_lineage_inputs(
    base_model_dir: Path, parent_adapter_dir: Path | None, lora_r: int
) -> tuple[str, str | None]:
    """``(base_model_sha256, parent_adapter_sha256 or None)``, the parent checked against the base.

    Raises:
        InputError: no ``config.json``; a parent without intact lineage, of another base or LoRA rank.
    """
    base_model_dir = Path(base_model_dir)
    if not (base_model_dir / "config.json").is_file():
        raise InputError(f"base_model_dir {base_model_dir} holds no config.json")
    base_sha = sha256_tree(base_model_dir)
    if parent_adapter_dir is None:
        return base_sha, None
    parent_adapter_dir = Path(parent_adapter_dir)
    parent = read_adapter_record(parent_adapter_dir)
    if parent.lineage.base_model_sha256 != base_sha:
        raise InputError(
            f"parent_adapter_dir {parent_adapter_dir} was trained on base model "
            f"{parent.lineage.base_model_sha256}, not {base_sha} ({base_model_dir})"
        )
    parent_r = json.loads((parent_adapter_dir / "adapter_config.json").read_text())["r"]
    if parent_r != lora_r:
        raise InputError(f"lora_r {lora_r} differs from the parent adapter's r {parent_r}")
    return base_sha, parent.sha256


def publish_adapter(
    trainer: Any, tmp: Path, out_dir: Path, lineage: Lineage, report: HealthReport,
    extra: Mapping[str, Any] | None = None,
) -> AdapterRecord:
    """Save the adapter and ``lineage.json`` into staging ``tmp`` (after the gates); rename onto ``out_dir``."""
    losses = report.losses
    shutil.rmtree(tmp / "trainer", ignore_errors=True)
    # the owner lock is not part of the adapter; the burst keeps holding it (open descriptor) until
    # the rename, and a staging folder without a lock file is never removed by another burst
    (tmp / STAGING_LOCK_FILE).unlink(missing_ok=True)
    trainer.model.save_pretrained(str(tmp))
    canonicalize_adapter_config(tmp)
    digest = adapter_sha256(tmp)
    final_loss, steps = float(losses[-1][1]), int(trainer.state.global_step)
    atomic_write_json(
        tmp / LINEAGE_FILE,
        {
            **dict(extra or {}),
            "schema_version": LINEAGE_SCHEMA_VERSION,
            "sha256": digest,
            "final_loss": final_loss,
            "steps": steps,
            "lineage": lineage.model_dump(mode="json"),
            "health": report.model_dump(mode="json"),
        },
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return AdapterRecord(
        path=out_dir, sha256=digest, lineage=lineage, final_loss=final_loss, steps=steps, health=report
    )
