"""SFT bursts: short LoRA training runs that continue an adapter lineage.

A burst trains a LoRA adapter on a chat dataset with TRL's ``SFTTrainer`` and peft on CPU, with
the loss on assistant tokens only (TRL 1.x recognises the official Qwen2.5 chat template and swaps
in its ``{% generation %}``-tagged training template). A burst may continue a parent adapter
(``PeftModel.from_pretrained(..., is_trainable=True)``); its lineage records the digests of the
base model, the parent adapter and the dataset, the hyperparameters and the run id, in
``lineage.json`` inside the adapter folder.

The TRL-style flat options of :class:`BurstConfig` (``lora_r``, ``lora_alpha``, ...) are turned
into ``peft.LoraConfig`` and ``trl.SFTConfig`` in one place, :func:`_trl_objects`.

Shared by SFT and RL bursts (:mod:`forgeflow.training.rl`):

* **health gates** (:class:`HealthGates`, :func:`check_health`) — every logged loss and gradient
  norm finite, gradient norms inside a band, and the least-squares slope of the last ``window``
  logged losses not above a tolerance. :func:`health_callback` stops training at the first
  non-finite or out-of-band value; after training :func:`enforce_health` raises
  :class:`BurstHealthError` (or :class:`BurstDivergedError`) with the logged values, and no
  adapter is written. An adapter folder exists only with a passing :class:`HealthReport` in its
  ``lineage.json``; an adapter without one is never reused or promotable (no flag files: the
  record is the state).
* **preflight** (:func:`preflight`) — template files exist and are non-empty, each class of the
  validation split has enough items (or is excluded with a warning), early-stopping patience
  (counted in *evaluations*) fits the run, and the checkpoint folder has the free space the
  adapter needs — all checked before a model is loaded (:func:`burst_preflight` for one burst).
* **staging folders** (:class:`StagingDir`) — a burst writes into ``.<name>.XXXX`` beside the
  adapter folder and renames it only when published. The folder holds an owner lock
  (``fcntl.flock`` plus host, pid, boot id and process start time), so the next burst removes a
  killed burst's leftover (:func:`remove_dead_staging_dirs`) and never a live burst's folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import (
    atomic_write_json,
    sha256_file,
    sha256_json,
    sha256_tree,
)

LINEAGE_FILE = "lineage.json"
LINEAGE_SCHEMA_VERSION = 3
"""2: adds ``lineage.algorithm`` and ``health`` (version 1 files read as algorithm ``sft``
without a health report, hence not reusable). 3: ``sha256`` is :func:`adapter_sha256` of the
weights and config only (versions 1-2 digested every file but ``lineage.json``, README included;
such files are still verified with that older scheme)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""The files that are the trained adapter (peft ``save_pretrained`` with safetensors)."""
_ROLES = frozenset({"system", "user", "assistant", "tool"})


class BurstHealthError(InputError):
    """A burst failed a health gate. ``report`` is the :class:`HealthReport` with every logged
    loss and gradient norm; the message names the failed gates and their evidence. Caused by the
    inputs (hyperparameters, data, a broken checkpoint), so never retried; no adapter is written."""

    def __init__(self, message: str, report: "HealthReport | None" = None) -> None:
        super().__init__(message)
        self.report = report


class BurstDivergedError(BurstHealthError):
    """Training produced a NaN or infinite loss or gradient norm, or logged no loss at all (the
    message lists the logged values)."""


# --- health gates ----------------------------------------------------------------------------
class HealthGates(BaseModel):
    """Health gates checked during and after a burst.

    Attributes:
        grad_norm_min: smallest allowed logged gradient norm (L2 over trainable parameters, before
            clipping, as ``transformers.Trainer`` logs it). 0 allows steps with no gradient (an RL
            step whose rewards are all equal has zero advantage, hence zero gradient).
        grad_norm_max: largest allowed logged gradient norm; above it the step is taken as an
            explosion.
        loss_trend_window: number of most recent logged losses the trend gate fits a line to
            (least squares, ``numpy.polyfit`` degree 1). 0 turns the gate off. The gate is only
            evaluated once a full window is logged (a shorter history is reported as not
            evaluated: a few noisy per-step losses are no evidence of a trend).
        loss_trend_max_slope: tolerance of that slope in loss units (nats per token) per logged
            step; a larger slope fails the gate. The default 0.05 leaves room for the per-step
            noise of small batches on a flat loss; tighten it for large batches.
    """

    model_config = ConfigDict(frozen=True)

    grad_norm_min: float = Field(default=0.0, ge=0.0)
    grad_norm_max: float = Field(default=1e4, gt=0.0)
    loss_trend_window: int = Field(default=10, ge=0)
    loss_trend_max_slope: float = 0.05

    @model_validator(mode="after")
    def _consistent(self) -> "HealthGates":
        if self.grad_norm_min > self.grad_norm_max:
            raise ValueError(
                f"grad_norm_min {self.grad_norm_min} is above grad_norm_max {self.grad_norm_max}"
            )
        if self.loss_trend_window in (1, 2):
            raise ValueError(
                f"loss_trend_window must be 0 (off) or >= 3 losses, got {self.loss_trend_window}"
            )
        if not math.isfinite(self.loss_trend_max_slope):
            raise ValueError("loss_trend_max_slope must be finite")
        return self


class HealthGateResult(BaseModel):
    """One gate's verdict.

    Attributes:
        name: ``finite``, ``grad_norm_band`` or ``loss_trend``.
        passed: False iff the gate was evaluated and failed.
        evaluated: False when there was not enough history (the gate then passes).
        detail: the evidence in words (values, steps, bounds).
    """

    model_config = ConfigDict(frozen=True)

    name: str
    passed: bool
    evaluated: bool = True
    detail: str = ""


class HealthReport(BaseModel):
    """The health of one burst: every gate's verdict and the logged values behind them.

    Attributes:
        passed: True iff every gate passed.
        gates: one :class:`HealthGateResult` per gate.
        losses: ``(step, loss)`` as logged by the trainer (nats per token for SFT; the policy
            surrogate for GRPO/RLOO).
        grad_norms: ``(step, gradient norm)`` as logged.
        loss_slope: the fitted slope of the trend gate (loss per step), None when not evaluated.
        gates_config: the :class:`HealthGates` checked, as a dict.
    """

    model_config = ConfigDict(frozen=True)

    passed: bool
    gates: list[HealthGateResult]
    losses: list[tuple[int, float]]
    grad_norms: list[tuple[int, float]]
    loss_slope: float | None = None
    gates_config: dict[str, Any]

    def failed(self) -> list[HealthGateResult]:
        """The gates that failed."""
        return [g for g in self.gates if not g.passed]


def _logged(history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every log entry holding ``key`` with a number (None entries skipped)."""
    out = []
    for entry in history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((int(entry.get("step", len(out) + 1)), float(value)))
    return out


def check_health(history: Sequence[Mapping[str, Any]], gates: HealthGates) -> HealthReport:
    """Evaluate the health gates on a trainer's log history (``trainer.state.log_history``).

    Args:
        history: log entries as ``transformers.Trainer`` writes them: dicts with ``step`` and,
            on training steps, ``loss`` and ``grad_norm`` (the end-of-training summary, which
            has ``train_loss`` instead, is ignored).
        gates: the bounds.

    Returns:
        The report (never raises on a failed gate; see :func:`enforce_health`). Gates:
        ``finite`` — at least one loss logged and every loss and gradient norm finite;
        ``grad_norm_band`` — every finite gradient norm within ``[grad_norm_min, grad_norm_max]``;
        ``loss_trend`` — least-squares slope (``numpy.polyfit(steps, losses, 1)``) of the last
        ``loss_trend_window`` finite losses <= ``loss_trend_max_slope``.
    """
    import numpy as np

    losses, norms = _logged(history, "loss"), _logged(history, "grad_norm")
    results = []
    bad = [(s, v) for s, v in losses + norms if not math.isfinite(v)]
    if not losses:
        results.append(HealthGateResult(name="finite", passed=False, detail="training logged no loss"))
    else:
        results.append(HealthGateResult(
            name="finite", passed=not bad,
            detail=f"not finite (step, value): {bad}" if bad else f"{len(losses)} losses finite",
        ))
    outside = [(s, v) for s, v in norms
               if math.isfinite(v) and not gates.grad_norm_min <= v <= gates.grad_norm_max]
    results.append(HealthGateResult(
        name="grad_norm_band", passed=not outside, evaluated=bool(norms),
        detail=(f"gradient norms outside [{gates.grad_norm_min}, {gates.grad_norm_max}] "
                f"(step, grad_norm): {outside}") if outside else
               f"{len(norms)} gradient norms within [{gates.grad_norm_min}, {gates.grad_norm_max}]",
    ))
    slope = None
    finite_losses = [(s, v) for s, v in losses if math.isfinite(v)]
    window = gates.loss_trend_window
    if window == 0:
        results.append(HealthGateResult(name="loss_trend", passed=True, evaluated=False, detail="gate off"))
    elif len(finite_losses) < window:
        results.append(HealthGateResult(
            name="loss_trend", passed=True, evaluated=False,
            detail=f"{len(finite_losses)} finite losses logged, the window needs {window}",
        ))
    else:
        tail = finite_losses[-window:]
        xs = np.array([s for s, _ in tail], dtype=float)
        ys = np.array([v for _, v in tail], dtype=float)
        slope = float(np.polyfit(xs, ys, 1)[0])
        rising = slope > gates.loss_trend_max_slope
        results.append(HealthGateResult(
            name="loss_trend", passed=not rising,
            detail=(f"least-squares slope {slope:.4g} per step over the last {window} losses "
                    f"{'exceeds' if rising else 'is within'} the tolerance "
                    f"{gates.loss_trend_max_slope}; (step, loss): {tail}"),
        ))
    return HealthReport(
        passed=all(r.passed for r in results), gates=results, losses=losses, grad_norms=norms,
        loss_slope=slope, gates_config=gates.model_dump(mode="json"),
    )


def enforce_health(report: HealthReport, hyperparameters: Mapping[str, Any]) -> None:
    """Raise if a gate failed.

    Raises:
        BurstDivergedError: the ``finite`` gate failed (message: ``training loss is not finite
            (step, loss): [...]; (step, grad_norm): [...]`` or ``training logged no loss``).
        BurstHealthError: another gate failed (message: each failed gate and its evidence).
        Both carry ``report`` and name the hyperparameters.
    """
    failed = report.failed()
    if not failed:
        return
    if any(g.name == "finite" for g in failed):
        if not report.losses:
            raise BurstDivergedError(f"training logged no loss; hyperparameters {dict(hyperparameters)}", report)
        raise BurstDivergedError(
            f"training loss is not finite (step, loss): {report.losses}; (step, grad_norm): "
            f"{report.grad_norms}; hyperparameters {dict(hyperparameters)}", report,
        )
    raise BurstHealthError(
        "burst failed its health gate(s): "
        + "; ".join(f"{g.name}: {g.detail}" for g in failed)
        + f"; hyperparameters {dict(hyperparameters)}", report,
    )


def health_callback(gates: HealthGates) -> Any:
    """A ``transformers.TrainerCallback`` that stops training at the first bad logged value.

    On each log with a ``loss`` or ``grad_norm`` it sets ``control.should_training_stop`` when
    the value is not finite or the gradient norm is outside the band, so a diverged burst does
    not spend its remaining steps; :func:`check_health` then reports the evidence. The trend gate
    is only judged after training (it needs the whole window).
    """
    from transformers import TrainerCallback

    class HealthGateCallback(TrainerCallback):
        def __init__(self) -> None:
            self.stopped_at: int | None = None

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            logs = logs or {}
            values = [logs.get(k) for k in ("loss", "grad_norm")]
            bad = any(isinstance(v, (int, float)) and not math.isfinite(v) for v in values)
            norm = logs.get("grad_norm")
            if isinstance(norm, (int, float)) and math.isfinite(norm):
                bad = bad or not gates.grad_norm_min <= norm <= gates.grad_norm_max
            if bad:
                self.stopped_at = int(state.global_step)
                control.should_training_stop = True

    return HealthGateCallback()


# --- preflight -------------------------------------------------------------------------------
class PreflightReport(BaseModel):
    """What :func:`preflight` checked and what it decided.

    Attributes:
        template_files: each checked file -> its size in bytes.
        validation_classes: class -> item count, for the classes kept.
        excluded_classes: class -> item count, for classes with fewer than the minimum items.
        validation_instance_ids: instance ids of the kept validation items, in input order.
        early_stopping_patience_evals: patience in *evaluations* (``transformers``'
            ``EarlyStoppingCallback`` counts evaluation calls, not steps), or None.
        early_stopping_patience_steps: that patience in optimizer steps (patience x
            ``eval_steps``), or None.
        checkpoint_dir: the folder whose file system was checked, or None.
        free_bytes: free bytes on that file system (``shutil.disk_usage``), or None.
        required_free_bytes: the estimate it had to meet.
        warnings: human-readable warnings (excluded classes, patience longer than the run).
    """

    model_config = ConfigDict(frozen=True)

    template_files: dict[str, int] = Field(default_factory=dict)
    validation_classes: dict[str, int] = Field(default_factory=dict)
    excluded_classes: dict[str, int] = Field(default_factory=dict)
    validation_instance_ids: list[str] = Field(default_factory=list)
    early_stopping_patience_evals: int | None = None
    early_stopping_patience_steps: int | None = None
    checkpoint_dir: Path | None = None
    free_bytes: int | None = None
    required_free_bytes: int = 0
    warnings: list[str] = Field(default_factory=list)


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


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
    """Check what a burst needs before any model is loaded; collect every problem, then fail once.

    Args:
        template_files: prompt/chat template files the burst reads; each must be a non-empty
            file (a missing template is never replaced by an empty default).
        validation_items: the validation split, dicts with ``instance_id`` and ``class_key``.
        class_key: the field naming an item's class / task type.
        min_items_per_class: classes with fewer items are excluded (with a warning), not
            evaluated on a handful of items.
        early_stopping_patience_evals: early-stopping patience, counted in **evaluations** (as
            ``transformers.EarlyStoppingCallback`` counts it: the number of evaluation calls
            without improvement before training stops), not in steps. Needs a validation split.
        eval_steps: optimizer steps between evaluations (to express the patience in steps).
        max_steps: the burst's length in steps; a patience longer than the run is a warning.
        checkpoint_dir: where the adapter / checkpoints are written (need not exist yet; its
            nearest existing parent's file system is measured).
        required_free_bytes: free bytes needed there (e.g. :func:`estimate_checkpoint_bytes`).

    Returns:
        The :class:`PreflightReport` (warnings included).

    Raises:
        InputError: an argument is malformed (``min_items_per_class`` < 1, a validation item
            without ``instance_id`` or ``class_key``).
        PreflightError: a template is missing or empty, every validation class is excluded,
            patience is given without validation items or is < 1, or free space is short (the
            message names the path, the free and the required bytes). All problems are listed.
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

    kept: dict[str, int] = {}
    excluded: dict[str, int] = {}
    kept_ids: list[str] = []
    if validation_items is not None:
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
_ADAPTER_OVERHEAD_BYTES = 1 << 20
"""adapter_config.json, lineage.json, README and the safetensors header, rounded up to 1 MiB."""


def lora_parameter_count(base_model_dir: Path, lora_r: int, target_modules: Sequence[str]) -> int:
    """Trainable parameters of a LoRA adapter on a Llama/Qwen2-shaped model.

    Each targeted linear layer of shape ``(in, out)`` gets ``A (r x in)`` and ``B (out x r)``:
    ``r * (in + out)`` parameters (Hu et al. 2021, LoRA), per decoder layer.

    Raises:
        InputError: no ``config.json``, or a target module that is not a Llama/Qwen2 projection.
    """
    path = Path(base_model_dir) / "config.json"
    if not path.is_file():
        raise InputError(f"base_model_dir {base_model_dir} holds no config.json")
    cfg = json.loads(path.read_text(encoding="utf-8"))
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
    """Free bytes a burst needs where it writes its adapter.

    ``copies`` x (fp32 LoRA weights + 1 MiB of metadata): the new adapter is written to a
    temporary sibling folder while the previous one may still exist, so 2 by default. Bursts save
    no optimizer state (``save_strategy="no"``).
    """
    weights = lora_parameter_count(base_model_dir, lora_r, target_modules) * _FP32_BYTES
    return copies * (weights + _ADAPTER_OVERHEAD_BYTES)


def chat_template_files(model_dir: Path) -> list[Path]:
    """The chat template files a burst on ``model_dir`` reads, for :func:`preflight`.

    ``chat_template.jinja`` (transformers 5 saves the template there); when the tokenizer config
    embeds the template inline instead, that config file.

    Raises:
        PreflightError: the model folder has neither (a burst would train without a template).
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
    """The preflight of one burst (SFT or RL) on ``base_model_dir`` writing ``out_dir``, before any
    model is loaded: :func:`preflight` with the model's chat template plus ``extra_template_files``
    (e.g. an RL burst's prompt template) and the free space :func:`estimate_checkpoint_bytes` asks
    for on ``out_dir``'s file system. Run by :func:`run_sft_burst`, :func:`forgeflow.training.rl.run_rl_burst`
    and, as its own Prefect task, by the lifecycle's burst stage.

    A model folder without any chat template is reported as a missing ``chat_template.jinja``
    together with the other problems (one error listing them all).

    Returns:
        The :class:`PreflightReport`.

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


class BurstConfig(BaseModel):
    """Hyperparameters of one SFT burst (flat, TRL-style names; translated in one place).

    Defaults suit the tiny CPU model: a few steps at a high learning rate. ``gates`` are the
    :class:`HealthGates` the burst must pass for its adapter to be written.
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
    gates: HealthGates = Field(default_factory=HealthGates)


class Lineage(BaseModel):
    """Where an adapter comes from.

    Attributes:
        base_model_sha256: :func:`forgeflow.common.fsutil.sha256_tree` of the base model folder.
        parent_adapter_sha256: :func:`adapter_sha256` of the adapter this one continues, or None.
        dataset_sha256: :attr:`SFTData.sha256` (or :attr:`forgeflow.training.rl.RLData.sha256`).
        hyperparameters: :class:`BurstConfig` (or :class:`forgeflow.training.rl.RLBurstConfig`) as a dict.
        run_id: the run that trained it (a Prefect flow run id, or a generated uuid4).
        created_at: UTC time the adapter was written.
        algorithm: ``sft``, ``grpo`` or ``rloo``.
    """

    model_config = ConfigDict(frozen=True)

    algorithm: str = "sft"
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
        sha256: :func:`adapter_sha256` of the folder (weights and adapter config only; not
            ``lineage.json`` nor README).
        lineage: see :class:`Lineage`.
        final_loss: training loss logged at the last step (nats per assistant token for SFT).
        steps: optimizer steps run.
        health: the burst's :class:`HealthReport` (None for an adapter written before the gates
            existed, which is therefore never promotable).
    """

    model_config = ConfigDict(frozen=True)

    path: Path
    sha256: str = Field(min_length=64, max_length=64)
    lineage: Lineage
    final_loss: float
    steps: int = Field(ge=1)
    health: HealthReport | None = None

    @property
    def promotable(self) -> bool:
        """True iff the burst passed every health gate (the only adapters a release may use)."""
        return self.health is not None and self.health.passed


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
    """Digest of the trained adapter in a folder: :data:`ADAPTER_FILES` only.

    The canonical JSON of ``[[name, sha256 of the file], ...]`` for ``adapter_config.json`` and
    ``adapter_model.safetensors`` (the :func:`forgeflow.common.fsutil.sha256_tree` scheme restricted to
    those two files). ``lineage.json``, peft's ``README.md`` (which names the base model's path)
    and any other file are left out, so the digest names the trained weights and their config:
    re-running identical training gives the same digest, and lineage metadata never changes it.

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
    """True iff ``adapter_dir`` holds the adapter with digest ``sha256`` (:func:`adapter_sha256`,
    or the older all-files digest of ``lineage.json`` schema 1-2); False for a missing or
    incomplete folder."""
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
        final_loss=data["final_loss"],
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
    """Copy an adapter into its content-addressed folder ``<adapters_dir>/<sha256>``.

    A burst's working folder (``out_dir`` of :func:`run_sft_burst`) is reused by the next burst;
    a pinned folder is named by the adapter's digest, so it never holds other content and a store
    row or a GGUF's lineage can point at it for good. The copy goes to a temporary sibling, is
    digested, and is renamed into place. Idempotent: an intact pinned folder is returned as is
    (also when ``record.path`` has since been overwritten, e.g. a cached record of an older
    burst); a pinned folder whose content no longer matches its name is replaced.

    Args:
        record: the adapter (its ``path`` is where it was trained).
        adapters_dir: the folder holding pinned adapters (created if missing).

    Returns:
        The record with ``path`` set to the pinned folder (absolute).

    Raises:
        InputError: neither the pinned folder nor ``record.path`` holds the adapter
            ``record.sha256`` (the message names both).
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
    adapters_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=adapters_dir, prefix=f".{record.sha256}."))
    os.chmod(tmp, 0o755)
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(STAGING_LOCK_FILE, "trainer"))
        if not adapter_matches(tmp, record.sha256):  # the source changed while it was copied
            raise InputError(f"adapter {source} changed while it was copied to {dest}")
        if dest.exists():
            shutil.rmtree(dest)  # its content no longer matched its name
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record.model_copy(update={"path": dest})


TRAINER_RUN_ARGS: dict[str, Any] = {
    "use_cpu": True, "bf16": False, "fp16": False, "gradient_checkpointing": False,
    "logging_steps": 1,
    # Trainer by default replaces a NaN/inf step loss by the running mean before logging, which
    # would hide a divergence from the health gates: log the real values.
    "logging_nan_inf_filter": False,
    "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "dataloader_num_workers": 0,
    "lr_scheduler_type": "constant", "warmup_steps": 0,
}
"""``transformers.TrainingArguments`` fields every burst sets the same way (SFT and RL): CPU, fp32,
a log line per step with real NaN/inf values, no checkpoints or reporting, a constant learning rate."""


def lora_config(config: Any) -> Any:
    """``peft.LoraConfig`` from a config with ``lora_r``, ``lora_alpha``, ``lora_dropout`` and
    ``lora_target_modules`` (:class:`BurstConfig`, :class:`forgeflow.training.rl.RLBurstConfig`)."""
    from peft import LoraConfig

    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")


def _trl_objects(config: BurstConfig, output_dir: Path, with_lora: bool) -> tuple[Any, Any]:
    """Translate :class:`BurstConfig` into ``(trl.SFTConfig, peft.LoraConfig | None)``."""
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
        **TRAINER_RUN_ARGS,
    )
    return sft, (lora_config(config) if with_lora else None)


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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

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
    burst_preflight(base_model_dir, out_dir, config.lora_r, config.lora_target_modules)

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    _check_lengths(tokenizer, data, config.max_length)
    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    if parent_adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(parent_adapter_dir), is_trainable=True)
    with StagingDir(out_dir) as tmp:
        sft_config, lora = _trl_objects(config, tmp / "trainer", with_lora=parent_adapter_dir is None)
        trainer = SFTTrainer(
            model=model,
            args=sft_config,
            train_dataset=data.dataset.select_columns(["messages"]),
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[health_callback(config.gates)],
        )
        trainer.train()
        report = check_health(trainer.state.log_history, config.gates)
        enforce_health(report, hyperparameters)
        lineage = Lineage(
            algorithm="sft",
            base_model_sha256=base_sha,
            parent_adapter_sha256=parent_sha,
            dataset_sha256=data.sha256,
            hyperparameters=hyperparameters,
            run_id=run_id or uuid.uuid4().hex,
            created_at=datetime.now(timezone.utc),
        )
        return publish_adapter(trainer, tmp, out_dir, lineage, report)


def resolve_lineage_inputs(
    base_model_dir: Path, parent_adapter_dir: Path | None, lora_r: int
) -> tuple[str, str | None]:
    """Digest the base model and check the parent adapter fits it (shared by SFT and RL bursts).

    Returns:
        ``(base_model_sha256, parent_adapter_sha256 or None)``.

    Raises:
        InputError: no ``config.json`` in ``base_model_dir``; the parent has no intact
            ``lineage.json``, was trained on another base model, or has another LoRA rank.
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
        raise InputError(f"config.lora_r {lora_r} differs from the parent adapter's r {parent_r}")
    return base_sha, parent.sha256


STAGING_LOCK_FILE = ".forgeflow-staging.lock"
"""The owner lock inside a staging folder: ``flock``-ed by the burst that made the folder for as
long as the burst runs, and holding its owner record (:func:`_owner_record`) as JSON."""


def _boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``), None where the file is missing."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (field 22 of ``/proc/<pid>/stat``,
    proc(5)), None when the process does not exist (or /proc is missing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # fields after "(comm)" start at field 3


def _owner_record() -> dict[str, Any]:
    """Who owns a staging folder: host, pid, boot id and the process' start time (ticks)."""
    import socket

    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "boot_id": _boot_id(),
            "start_ticks": _process_start_ticks(pid), "created_at": datetime.now(timezone.utc).isoformat()}


def _owner_alive(record: Mapping[str, Any]) -> bool:
    """Second check after the lock: is the recorded owner possibly still running?

    True for an owner on another host (its process cannot be inspected from here) and for a
    process of this host and boot that runs with the recorded start time (a reused pid has another
    one). False for a record of an earlier boot, a gone process, or no readable record (then the
    free lock is the only evidence, and it suffices: a live owner writes its record before the lock
    file gets its name).
    """
    import socket

    host = record.get("host")
    if not host:
        return False
    if host != socket.gethostname():
        return True
    boot = _boot_id()
    if boot is None or record.get("boot_id") != boot:
        return False
    pid, ticks = record.get("pid"), record.get("start_ticks")
    now = _process_start_ticks(pid) if isinstance(pid, int) else None
    return now is not None and (ticks is None or now == ticks)


class StagingDir:
    """A temporary sibling ``.<name>.XXXX`` of an adapter folder that a burst writes into before
    the rename, owned by the running burst.

    On enter: ``tempfile.mkdtemp`` (mode set to 0755), then the owner lock :data:`STAGING_LOCK_FILE`
    is created under a temporary name, ``fcntl.flock``-ed (exclusive), filled with the owner record
    (host, pid, boot id, process start time) and renamed into place, so a lock file that exists is
    always held while its owner lives. The kernel drops a ``flock`` when its holder dies (kill -9
    included), which is what lets :func:`remove_dead_staging_dirs` tell a dead burst's leftover from
    a live burst's folder. On exit: the folder (if not published) is removed and the lock released.

    Use: ``with StagingDir(out_dir) as tmp: ...`` (``tmp`` is the folder's path).
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.path: Path | None = None
        self._fd: int | None = None

    def __enter__(self) -> Path:
        import fcntl

        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(dir=self.out_dir.parent, prefix=f".{self.out_dir.name}."))
        os.chmod(path, 0o755)
        pending = path / (STAGING_LOCK_FILE + ".tmp")
        fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # O_CLOEXEC: not inherited
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps(_owner_record()).encode())
            os.fsync(fd)
            os.rename(pending, path / STAGING_LOCK_FILE)
        except BaseException:
            os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        self.path, self._fd = path, fd
        return path

    def __exit__(self, *exc: Any) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)  # a published folder was renamed away already
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def remove_dead_staging_dirs(out_dir: Path) -> list[Path]:
    """Remove the staging folders ``.<out_dir name>.*`` beside ``out_dir`` whose owner is provably dead.

    A folder is removed only when its :data:`STAGING_LOCK_FILE` exists, an exclusive non-blocking
    ``flock`` on it succeeds (no live process holds it: the kernel released the dead owner's lock),
    and the owner record does not name a process that is running on this host and boot with the
    recorded start time. The lock is held while the folder is removed. A folder without a lock file
    (being created, being published, or written by a forgeflow without owner locks) and a folder whose
    lock is held (a live burst, in this process or another) are never touched.

    Returns:
        The removed folders, sorted.
    """
    import fcntl

    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return []
    removed = []
    for folder in sorted(out_dir.parent.glob(f".{out_dir.name}.*")):
        lock = folder / STAGING_LOCK_FILE
        if not folder.is_dir() or folder.is_symlink():
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # no owner lock: not provably dead
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # held: a live burst's folder
            try:
                record = json.loads(lock.read_text(encoding="utf-8") or "{}")
            except (OSError, ValueError):
                record = {}
            if _owner_alive(record):
                continue  # lock free but the owner runs (e.g. flock unsupported there): keep it
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


def publish_adapter(
    trainer: Any, tmp: Path, out_dir: Path, lineage: Lineage, report: HealthReport,
    extra: Mapping[str, Any] | None = None,
) -> AdapterRecord:
    """Save the trained adapter into ``tmp`` with its ``lineage.json``, then rename it onto ``out_dir``.

    Only called after :func:`enforce_health` passed: an adapter folder exists only with a passing
    health report. ``tmp`` is a :class:`StagingDir` folder; its owner lock file is removed first. ``extra`` keys (e.g. an RL burst's reward counts) are added to ``lineage.json``.

    Returns:
        The :class:`AdapterRecord` of ``out_dir``.
    """
    losses = report.losses
    shutil.rmtree(tmp / "trainer", ignore_errors=True)
    # the owner lock is not part of the adapter; the burst keeps holding it (open descriptor) until
    # the rename, and a staging folder without a lock file is never removed by another burst
    (tmp / STAGING_LOCK_FILE).unlink(missing_ok=True)
    trainer.model.save_pretrained(str(tmp))
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
