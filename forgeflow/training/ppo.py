"""The end of a verl PPO run: its newest LoRA checkpoint (``global_step_<N>/actor/``) ingested as an adapter.

Only what *this* job wrote is ingested: every path's (size, mtime, inode) is stamped before submission,
and a checkpoint with unchanged stamps is an earlier job's.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forgeflow.common import errors
from forgeflow.common.fsutil import (
    SEMANTIC_KEY,
    atomic_folder,
    atomic_write_json,
    fsync_dir,
    read_digested_json,
    sha256_file,
    sha256_json,
    with_semantic_digest,
)
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


CHECKPOINTS_BEFORE_SCHEMA_VERSION = 1
CHECKPOINTS_BEFORE_FILE = "checkpoints-before.json"
"""The record of a checkpoint folder before a job, kept at ``<home>/ppo/<submission id>/`` (:func:`record_path`)."""


class CheckpointsBefore(BaseModel):
    """What a checkpoint folder held just before a Ray job was submitted."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = CHECKPOINTS_BEFORE_SCHEMA_VERSION
    checkpoint_dir: Path = Field(description="the folder, absolute")
    submission_id: str = Field(min_length=1)
    taken_at: datetime = Field(description="when the stamps were taken (UTC)")
    stamps: dict[str, tuple[int, int, int]] = Field(
        description="relative path -> (size_bytes, mtime_ns, inode) of everything under checkpoint_dir")

    def step_folders(self) -> list[str]:
        """The ``global_step_<N>`` folders the record holds, by step."""
        steps = {key.split("/")[0] for key in self.stamps if _STEP.fullmatch(key.split("/")[0])}
        return sorted(steps, key=lambda name: int(_STEP.fullmatch(name).group(1)))


def local_checkpoint_dir(checkpoint_dir: str, working_dir: str | None) -> Path:
    """Where the ``ppo`` flow reads a job's checkpoints: ``checkpoint_dir`` itself when absolute, else
    under the job's ``working_dir`` (when given; else relative to this process's directory)."""
    path = Path(checkpoint_dir)
    if not path.is_absolute() and working_dir:
        path = Path(working_dir) / path
    return path


def _stamps(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` (relative, ``/``-separated) -> ``(size_bytes, mtime_ns, inode)``."""
    out: dict[str, tuple[int, int, int]] = {}
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            out[path.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def checkpoints_before(checkpoint_dir: Path, submission_id: str) -> CheckpointsBefore:
    """Stamp what ``checkpoint_dir`` holds now, before job ``submission_id`` is submitted (stat only)."""
    root = Path(checkpoint_dir).resolve()
    return CheckpointsBefore(checkpoint_dir=root, submission_id=submission_id,
                             taken_at=datetime.now(timezone.utc), stamps=_stamps(root))


def record_path(home: Path, submission_id: str) -> Path:
    """``<home>/ppo/<submission_id>/checkpoints-before.json``.

    Raises:
        InputError: ``submission_id`` is not a plain name (empty, ``.``, ``..`` or holds a ``/``).
    """
    if submission_id in ("", ".", "..") or "/" in submission_id or "\\" in submission_id:
        raise errors.InputError(f"Ray submission id {submission_id!r} is not a plain name")
    return Path(home) / "ppo" / submission_id / CHECKPOINTS_BEFORE_FILE


def write_checkpoints_before(path: Path, record: CheckpointsBefore) -> Path:
    """Write ``record`` to ``path`` atomically (only for a job Ray accepted: :func:`kept_if_accepted`)."""
    return atomic_write_json(path, with_semantic_digest(record.model_dump(mode="json")))


@contextmanager
def kept_if_accepted(path: Path, record: CheckpointsBefore | None) -> Iterator[None]:
    """Write ``record`` beside ``path``; rename it onto ``path`` if the block ends normally, else remove it."""
    if record is None:
        yield
        return
    path = Path(path)
    pending = write_checkpoints_before(path.with_name(f".{path.name}.pending"), record)
    try:
        yield
    except BaseException:
        pending.unlink(missing_ok=True)
        raise
    os.replace(pending, path)
    fsync_dir(path.parent)


def read_checkpoints_before(path: Path, submission_id: str) -> CheckpointsBefore:
    """The record of what the checkpoint folder held before job ``submission_id``.

    Raises:
        InfraError: there is none at ``path``: the job's checkpoints cannot be told from older ones.
        InputError: the record is not valid JSON, was altered, is of another schema version or another job.
    """
    path = Path(path)
    if not path.is_file():
        raise errors.InfraError(f"no record of what the checkpoint folder held before Ray job {submission_id} was "
                                f"submitted ({path} is missing): its checkpoints cannot be told from older ones, "
                                "so none is ingested")
    document = read_digested_json(path, "checkpoint record", CHECKPOINTS_BEFORE_SCHEMA_VERSION)
    document.pop(SEMANTIC_KEY)
    try:
        record = CheckpointsBefore.model_validate(document)
    except ValidationError as exc:
        raise errors.InputError(f"checkpoint record {path} is not one: {exc}") from exc
    if record.submission_id != submission_id:
        raise errors.InputError(f"checkpoint record {path} is of Ray job {record.submission_id}, not {submission_id}")
    return record


def written_since(folder: Path, before: CheckpointsBefore, relative: str | None = None) -> bool:
    """Whether ``folder`` or anything in it was created, rewritten, replaced or removed since ``before``.

    Args:
        relative: ``folder``'s ``/``-separated path relative to the checkpoint folder; None: worked out.
    """
    rel = relative if relative is not None else Path(folder).resolve().relative_to(before.checkpoint_dir).as_posix()
    then = {k: v for k, v in before.stamps.items() if k == rel or k.startswith(rel + "/")}
    st = Path(folder).stat()
    now = {rel: (st.st_size, st.st_mtime_ns, st.st_ino)}
    now.update({f"{rel}/{k}": v for k, v in _stamps(Path(folder)).items()})
    return now != then


def newest_adapter(checkpoint_dir: Path, pattern: str = DEFAULT_ADAPTER_GLOB,
                   before: CheckpointsBefore | None = None) -> tuple[Path, int]:
    """``(folder, N)`` of the highest ``global_step_<N>`` matching ``pattern`` (with ``before``: this job's).

    Raises:
        InfraError: no folder matches, every match predates the job, or the newest lacks a peft adapter file.
        InputError: ``before`` is the record of another folder.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if before is not None and checkpoint_dir.resolve() != before.checkpoint_dir:
        raise errors.InputError(f"the checkpoint record of Ray job {before.submission_id} is of "
                                f"{before.checkpoint_dir}, not of {checkpoint_dir}")
    found = []
    for folder in checkpoint_dir.glob(pattern):
        match = _STEP.search(folder.as_posix())
        if folder.is_dir() and match:
            found.append((int(match.group(1)), folder))
    if not found:
        raise errors.InfraError(f"no checkpoint matches {pattern!r} under {checkpoint_dir}: the job wrote no adapter")
    if before is not None:
        written = [(step, folder) for step, folder in found
                   if written_since(folder, before, folder.relative_to(checkpoint_dir).as_posix())]
        if not written:
            steps = ", ".join(str(step) for step, _ in sorted(found))
            plural = "s" if len(found) > 1 else ""
            raise errors.InfraError(
                f"no checkpoint matching {pattern!r} under {checkpoint_dir} was written by Ray job "
                f"{before.submission_id}: the job wrote no adapter. The {len(found)} checkpoint{plural} there "
                f"(step{plural} {steps}) {'predate' if plural else 'predates'} the job (unchanged since "
                f"{before.taken_at:%Y-%m-%d %H:%M:%S} UTC, just before it was submitted) "
                "and are not ingested; check that the job saves there, and give each run its own checkpoint_dir")
        found = written
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
    """Copy checkpoint ``folder``'s adapter files into ``out_dir`` with a ``lineage.json``, atomically."""
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
    """The :class:`~forgeflow.training.adapters.Lineage` of a PPO adapter (no parent: verl starts from the base)."""
    return Lineage(algorithm="ppo", base_model_sha256=base_model_sha256, parent_adapter_sha256=None,
                   dataset_sha256=dataset_sha256(train_files), hyperparameters=hyperparameters, run_id=run_id,
                   created_at=datetime.now(timezone.utc))
