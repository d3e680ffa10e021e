"""A burst's preflight: what it needs is checked before a model is loaded."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError, PreflightError


# --- preflight -------------------------------------------------------------------------------
class PreflightReport(BaseModel):
    """What :func:`preflight` checked and what it decided."""

    model_config = ConfigDict(frozen=True)

    template_files: dict[str, int] = Field(default_factory=dict, description="each checked file -> its size in bytes")
    validation_classes: dict[str, int] = Field(default_factory=dict,
        description="class -> item count, for the classes kept")
    excluded_classes: dict[str, int] = Field(default_factory=dict,
        description="class -> item count, for classes below the minimum")
    validation_instance_ids: list[str] = Field(default_factory=list,
        description="ids of the kept validation items, in input order")
    early_stopping_patience_evals: int | None = Field(None,
        description="patience in evaluations (EarlyStoppingCallback counts evaluation calls)")
    early_stopping_patience_steps: int | None = Field(None,
        description="that patience in optimizer steps (patience x eval_steps)")
    checkpoint_dir: Path | None = Field(None, description="the folder whose file system was checked")
    free_bytes: int | None = Field(None, description="free bytes on that file system")
    required_free_bytes: int = Field(0, description="the estimate it had to meet")
    warnings: list[str] = Field(default_factory=list)


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _validation_classes(validation_items: Sequence[Mapping[str, Any]], class_key: str, min_items_per_class: int,
                        problems: list[str], warnings: list[str]) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """The validation classes kept and excluded (name -> items) and the kept ids; problems are appended.

    Raises:
        InputError: an item without a non-empty ``instance_id`` or ``class_key``.
    """
    kept: dict[str, int] = {}
    excluded: dict[str, int] = {}
    counts: dict[str, int] = {}
    for i, item in enumerate(validation_items):
        if not isinstance(item.get("instance_id"), str) or not item["instance_id"]:
            raise InputError(f"validation_items[{i}].instance_id must be a non-empty string")
        if not isinstance(item.get(class_key), str) or not item[class_key]:
            raise InputError(f"validation_items[{i}].{class_key} must be a non-empty string")
        counts[item[class_key]] = counts.get(item[class_key], 0) + 1
    for name, n in sorted(counts.items()):
        if n >= min_items_per_class:
            kept[name] = n
        else:
            excluded[name] = n
            warnings.append(
                f"validation class {name!r} has {n} item(s), fewer than min_items_per_class="
                f"{min_items_per_class}: excluded from validation"
            )
    kept_ids = [item["instance_id"] for item in validation_items if item[class_key] in kept]
    if not kept:
        problems.append(
            f"every validation class has fewer than {min_items_per_class} items "
            f"({dict(sorted(counts.items())) or 'no items'}): nothing left to validate on"
        )
    return kept, excluded, kept_ids


def preflight(
    *,
    template_files: Sequence[Path] = (),
    validation_items: Sequence[Mapping[str, Any]] | None = None,
    class_key: str = "task_type",
    min_items_per_class: int = 1,
    early_stopping_patience_evals: int | None = None,
    eval_steps: int | None = None,
    max_steps: int | None = None,
    checkpoint_dir: Path | None = None,
    required_free_bytes: int = 0,
) -> PreflightReport:
    """Check what a burst needs before any model is loaded; collect every problem, then fail once (patience
    counted in evaluations, as ``transformers.EarlyStoppingCallback`` counts it).

    Raises:
        InputError: ``min_items_per_class`` < 1, or a validation item without ``instance_id`` or ``class_key``.
        PreflightError: a missing or empty template, every class excluded, patience without validation
            items or < 1, or free space short; all listed.
    """
    if min_items_per_class < 1:
        raise InputError(f"min_items_per_class must be >= 1, got {min_items_per_class}")
    if required_free_bytes < 0:
        raise InputError(f"required_free_bytes must be >= 0, got {required_free_bytes}")
    problems: list[str] = []
    warnings: list[str] = []
    sizes: dict[str, int] = {}
    for raw in template_files:
        path = Path(raw)
        if not path.is_file():
            problems.append(f"template file {path} does not exist")
        elif path.stat().st_size == 0 or not path.read_text(encoding="utf-8", errors="replace").strip():
            problems.append(f"template file {path} is empty")
        else:
            sizes[str(path)] = path.stat().st_size

    kept, excluded, kept_ids = {}, {}, []
    if validation_items is not None:
        kept, excluded, kept_ids = _validation_classes(validation_items, class_key, min_items_per_class,
                                                       problems, warnings)

    patience_steps = None
    if early_stopping_patience_evals is not None:
        if early_stopping_patience_evals < 1:
            problems.append(
                f"early_stopping_patience_evals must be >= 1 evaluation, got {early_stopping_patience_evals}"
            )
        elif not validation_items:
            problems.append("early stopping needs a validation split, but validation_items is empty")
        if eval_steps is not None:
            if eval_steps < 1:
                problems.append(f"eval_steps must be >= 1, got {eval_steps}")
            else:
                patience_steps = early_stopping_patience_evals * eval_steps
                if max_steps is not None and patience_steps > max_steps:
                    warnings.append(
                        f"early-stopping patience of {early_stopping_patience_evals} evaluations x "
                        f"{eval_steps} steps = {patience_steps} steps exceeds max_steps={max_steps}: "
                        "early stopping cannot trigger"
                    )

    free = None
    checked_dir = None
    if checkpoint_dir is not None:
        checked_dir = Path(checkpoint_dir)
        measured = _existing_ancestor(checked_dir)
        free = shutil.disk_usage(measured).free
        if free < required_free_bytes:
            problems.append(
                f"checkpoint folder {checked_dir} (file system of {measured}) has {free} bytes free "
                f"({free / 2**20:.1f} MiB), {required_free_bytes} bytes "
                f"({required_free_bytes / 2**20:.1f} MiB) are needed"
            )
    if problems:
        raise PreflightError("burst preflight failed: " + "; ".join(problems))
    return PreflightReport(
        template_files=sizes, validation_classes=kept, excluded_classes=excluded,
        validation_instance_ids=kept_ids, early_stopping_patience_evals=early_stopping_patience_evals,
        early_stopping_patience_steps=patience_steps, checkpoint_dir=checked_dir, free_bytes=free,
        required_free_bytes=required_free_bytes, warnings=warnings,
    )


_FP32_BYTES = 4
"""Bytes per parameter of an fp32 adapter checkpoint."""
_ADAPTER_OVERHEAD_BYTES = 1 << 20
"""adapter_config.json, lineage.json, README and the safetensors header, rounded up to 1 MiB."""


def lora_parameter_count(base_model_dir: Path, lora_r: int, target_modules: Sequence[str]) -> int:
    """Trainable LoRA parameters on a Llama/Qwen2 model: ``r * (in + out)`` per targeted layer (Hu et al. 2021).

    Raises:
        InputError: no ``config.json``, or a target module that is not a Llama/Qwen2 projection.
    """
    path = Path(base_model_dir) / "config.json"
    if not path.is_file():
        raise InputError(f"base_model_dir {base_model_dir} holds no config.json")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(cfg.get("vision_config"), dict):  # an image-text-to-text checkpoint: its text model's shapes
        from forgeflow.training.vl_burst import vl_lora_parameter_count

        return vl_lora_parameter_count(base_model_dir, lora_r, target_modules)
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads", heads)) * int(cfg.get("head_dim") or hidden // heads)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (hidden, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    unknown = [m for m in target_modules if m not in shapes]
    if unknown:
        raise InputError(f"lora_target_modules {unknown} are not Llama/Qwen2 projections {sorted(shapes)}")
    per_layer = sum(lora_r * (shapes[m][0] + shapes[m][1]) for m in target_modules)
    return per_layer * int(cfg["num_hidden_layers"])


def estimate_checkpoint_bytes(
    base_model_dir: Path, lora_r: int, target_modules: Sequence[str], copies: int = 2
) -> int:
    """Free bytes a burst needs for its adapter: ``copies`` (old and staged) x (fp32 LoRA weights + 1 MiB)."""
    weights = lora_parameter_count(base_model_dir, lora_r, target_modules) * _FP32_BYTES
    return copies * (weights + _ADAPTER_OVERHEAD_BYTES)


def chat_template_files(model_dir: Path) -> list[Path]:
    """The chat template files a burst reads: ``chat_template.jinja``, else the tokenizer config embedding it.

    Raises:
        PreflightError: the model folder has neither.
    """
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return [jinja]
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file() and json.loads(tok_cfg.read_text(encoding="utf-8")).get("chat_template"):
        return [tok_cfg]
    raise PreflightError(f"model folder {model_dir} has no chat template (chat_template.jinja or "
                         "tokenizer_config.json's chat_template)")


def burst_preflight(
    base_model_dir: Path,
    out_dir: Path,
    lora_r: int,
    lora_target_modules: Sequence[str],
    extra_template_files: Sequence[Path] = (),
) -> PreflightReport:
    """:func:`preflight` of one burst: its templates and the free space :func:`estimate_checkpoint_bytes` asks.

    Raises:
        InputError: no ``config.json`` in ``base_model_dir`` or an unknown LoRA target module.
        PreflightError: every problem found, in one message starting ``burst preflight failed:``.
    """
    base_model_dir = Path(base_model_dir)
    try:
        templates = chat_template_files(base_model_dir)
    except PreflightError:
        templates = [base_model_dir / "chat_template.jinja"]  # reported as missing by preflight
    return preflight(
        template_files=[*templates, *(Path(t) for t in extra_template_files)],
        checkpoint_dir=Path(out_dir).parent,
        required_free_bytes=estimate_checkpoint_bytes(base_model_dir, lora_r, lora_target_modules),
    )
