"""The end of a verl PPO run on a Ray cluster: its newest LoRA checkpoint ingested as an adapter.

verl's FSDP checkpoint manager writes ``<checkpoint_dir>/global_step_<N>/actor/...`` and, for a
LoRA actor, the adapter as peft saves it (``adapter_config.json`` + ``adapter_model.safetensors``);
:data:`DEFAULT_ADAPTER_GLOB` finds it there (the ``ppo`` flow takes another pattern for another
layout). :func:`ingest_adapter` copies the adapter files of the highest step into a staging folder,
writes forgeflow's ``lineage.json`` (algorithm ``ppo``, base model, dataset digest, the verl
settings, the Ray job, the step) and renames it into place, so the adapter continues a lineage like
any burst's (:func:`forgeflow.training.adapters.pin_adapter`, the store's ``model_artifacts``).
"""

from __future__ import annotations

import re
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from forgeflow.common import errors
from forgeflow.common.fsutil import atomic_folder, atomic_write_json, sha256_file, sha256_json
from forgeflow.training.adapters import (
    ADAPTER_FILES,
    LINEAGE_FILE,
    LINEAGE_SCHEMA_VERSION,
    AdapterRecord,
    Lineage,
    adapter_sha256,
)

DEFAULT_ADAPTER_GLOB = "global_step_*/actor/lora_adapter"
"""Where verl's checkpoint manager keeps a LoRA actor's adapter, relative to ``checkpoint_dir``."""
_STEP = re.compile(r"global_step_(\d+)")


def newest_adapter(checkpoint_dir: Path, pattern: str = DEFAULT_ADAPTER_GLOB) -> tuple[Path, int]:
    """The adapter folder of the highest ``global_step_<N>`` under ``checkpoint_dir`` matching ``pattern``.

    Returns:
        ``(folder, N)``.

    Raises:
        InfraError: no folder matches, or the newest lacks a peft adapter file (the job succeeded
            but left nothing to ingest; the message names the folder and the pattern).
    """
    found = []
    for folder in Path(checkpoint_dir).glob(pattern):
        match = _STEP.search(folder.as_posix())
        if folder.is_dir() and match:
            found.append((int(match.group(1)), folder))
    if not found:
        raise errors.InfraError(f"no checkpoint matches {pattern!r} under {checkpoint_dir}: the job wrote no adapter")
    step, folder = max(found)
    missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        raise errors.InfraError(f"checkpoint {folder} (step {step}) lacks {', '.join(missing)}: not a peft adapter")
    return folder, step


def dataset_sha256(train_files: tuple[str, ...] | list[str]) -> str:
    """The digest of a PPO run's training data: of each file's content when the paths are readable
    here (a shared filesystem), else of the paths themselves (files that live only on the cluster)."""
    paths = [Path(f) for f in train_files]
    if all(p.is_file() for p in paths):
        return sha256_json([[str(p), sha256_file(p)] for p in paths])
    return sha256_json(sorted(str(f) for f in train_files))


def ingest_adapter(folder: Path, step: int, out_dir: Path, lineage: Lineage, extra: dict[str, Any] | None = None
                   ) -> AdapterRecord:
    """Copy the adapter files of ``folder`` (a checkpoint at ``step``) into ``out_dir`` with a
    ``lineage.json``, through :func:`forgeflow.common.fsutil.atomic_folder` (a crash leaves no half
    adapter under the name; an existing ``out_dir`` is replaced).

    Args:
        folder: the checkpoint's adapter folder (:func:`newest_adapter`).
        step: its training step (recorded as ``steps``).
        out_dir: where the adapter goes.
        lineage: its lineage (algorithm ``ppo``).
        extra: more keys for ``lineage.json`` (the Ray job id, the checkpoint path).

    Returns:
        The :class:`~forgeflow.training.adapters.AdapterRecord` (no final loss: verl logs its own metrics).
    """
    out_dir = Path(out_dir)
    with atomic_folder(out_dir) as tmp:
        for name in ADAPTER_FILES:
            shutil.copy2(Path(folder) / name, tmp / name)
        digest = adapter_sha256(tmp)
        atomic_write_json(tmp / LINEAGE_FILE, {
            **dict(extra or {}), "schema_version": LINEAGE_SCHEMA_VERSION, "sha256": digest, "final_loss": None,
            "steps": step, "lineage": lineage.model_dump(mode="json"), "health": None})
    return AdapterRecord(path=out_dir, sha256=digest, lineage=lineage, final_loss=None, steps=step)


def ppo_lineage(base_model_sha256: str, train_files: tuple[str, ...], hyperparameters: dict[str, Any],
                run_id: str) -> Lineage:
    """The :class:`~forgeflow.training.adapters.Lineage` of a PPO adapter (no parent adapter: verl
    starts its LoRA from the base model)."""
    return Lineage(algorithm="ppo", base_model_sha256=base_model_sha256, parent_adapter_sha256=None,
                   dataset_sha256=dataset_sha256(train_files), hyperparameters=hyperparameters, run_id=run_id,
                   created_at=datetime.now(timezone.utc))
