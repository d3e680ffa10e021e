"""Freeze accepted tasks into repository-disjoint train/validation/test splits.

:func:`select_splits` is pure (a preflight runs it alone); :func:`write_freeze` writes a manifest that
is never overwritten, identified by a ``semantic_sha256`` over its canonical JSON. Every ordering uses
``sha256(f"{seed}:{id}")``, never Python's salted ``hash`` or input order.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

import forgeflow
from forgeflow.common.errors import FreezeConflictError, InputError, PreflightError
from forgeflow.common.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    read_digested_json,
    sha256_file,
    with_semantic_digest,
)

SCHEMA_VERSION = 1
"""Version of the manifest layout written by :func:`write_freeze`."""

SPLITS: tuple[str, ...] = ("train", "validation", "test")
"""Split names, in the order used to break ties."""

FREEZE_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]*")
"""Valid freeze names (``fullmatch``): lower-case, safe as a file name."""

FREEZE_NAME_MAX_CHARS = 128


def stable_key(seed: int, item: str) -> str:
    """The deterministic ordering key ``sha256(f"{seed}:{item}")`` (hex)."""
    return hashlib.sha256(f"{seed}:{item}".encode()).hexdigest()


class TaskRef(BaseModel):
    """A task by id and repository: a candidate to select a batch from (:mod:`forgeflow.curation.selection`) or an
    accepted task to freeze (:func:`select_splits`)."""

    model_config = ConfigDict(frozen=True)

    instance_id: str = Field(min_length=1, description="the task's instance id")
    repo: str = Field(min_length=1, description="the repository (owner/name) it comes from")
    image_available: bool = Field(True, description="its image is in the registry (a candidate without one is "
                                                    "never selected; an accepted task's was)")


class SplitQuotas(BaseModel):
    """What a freeze needs (a split target of 0: split not wanted)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train: int = Field(ge=0, description="minimum tasks in the train split (0: not wanted)")
    validation: int = Field(ge=0, description="minimum tasks in the validation split")
    test: int = Field(ge=0, description="minimum tasks in the test split")
    max_per_repo: int = Field(ge=1, description="at most this many tasks of one repository enter the freeze")
    min_repos: int = Field(default=1, ge=1,
        description="minimum distinct repositories overall, required per split in proportion to its size")

    def target(self, split: str) -> int:
        """The minimum task count of ``split``."""
        return int(getattr(self, split))

    def min_repos_for(self, split: str) -> int:
        """Minimum repositories for ``split`` (the proportional rule in the class docstring)."""
        total = self.train + self.validation + self.test
        target = self.target(split)
        if target == 0 or total == 0:
            return 0
        return max(1, math.ceil(self.min_repos * target / total))


class UnmetQuota(BaseModel):
    """One quota the accepted tasks cannot meet (``missing = required - found``)."""

    model_config = ConfigDict(frozen=True)

    name: str
    required: int = Field(ge=0)
    found: int = Field(ge=0)
    missing: int = Field(ge=1)


class SplitSelection(BaseModel):
    """The result of :func:`select_splits`."""

    model_config = ConfigDict(frozen=True)

    splits: dict[str, list[str]] = Field(description="split name -> sorted instance ids")
    repos_per_split: dict[str, list[str]] = Field(description="split name -> sorted repository names")
    capped: list[str] = Field(default_factory=list,
        description="instance ids left out because their repository exceeded max_per_repo")
    unmet: list[UnmetQuota] = Field(default_factory=list, description="quotas not met (empty when ready)")
    ready: bool = Field(description="every quota is met and a freeze may be written")

    @property
    def counts(self) -> dict[str, int]:
        """Split name -> number of tasks."""
        return {split: len(ids) for split, ids in self.splits.items()}


def select_splits(
    accepted: list[TaskRef], quotas: SplitQuotas, seed: int = 0
) -> SplitSelection:
    """Assign accepted tasks to repository-disjoint splits.

    Algorithm:
        1. Per repository, keep the first ``max_per_repo`` tasks by ``stable_key(seed, instance_id)``
           (the rest in ``capped``).
        2. Order repositories largest first (ties by ``stable_key(seed, repo)``): greedy
           longest-processing-time first, as in multiprocessor scheduling.
        3. Give each repository, whole, to the split with the largest remaining relative gap
           ``1 - min(tasks_s / target_s, repos_s / min_repos_s)`` (the repo term only while
           ``repos_s < min_repos_s``); ties to the split missing more tasks, then train, validation,
           test. Full splits keep growing in proportion, so every capped task is used.

    Returns:
        The selection; ``ready`` is False and ``unmet`` lists each shortfall when the quotas cannot be met.

    Raises:
        InputError: duplicate instance ids, or every split target is 0.
    """
    active = [split for split in SPLITS if quotas.target(split) > 0]
    if not active:
        raise InputError("quotas: train, validation and test are all 0; nothing to freeze")
    seen: dict[str, str] = {}
    by_repo: dict[str, list[str]] = defaultdict(list)
    for task in accepted:
        if task.instance_id in seen:
            raise InputError(f"accepted tasks: instance id {task.instance_id!r} appears twice")
        seen[task.instance_id] = task.repo
        by_repo[task.repo].append(task.instance_id)

    kept: dict[str, list[str]] = {}
    capped: list[str] = []
    for repo, ids in by_repo.items():
        ordered = sorted(ids, key=lambda instance_id: stable_key(seed, instance_id))
        kept[repo] = ordered[: quotas.max_per_repo]
        capped.extend(ordered[quotas.max_per_repo :])

    repo_order = sorted(kept, key=lambda repo: (-len(kept[repo]), stable_key(seed, repo)))
    tasks_in = {split: 0 for split in SPLITS}
    repos_in: dict[str, list[str]] = {split: [] for split in SPLITS}
    ids_in: dict[str, list[str]] = {split: [] for split in SPLITS}

    def gap(split: str) -> float:
        fill = tasks_in[split] / quotas.target(split)
        need_repos = quotas.min_repos_for(split)
        if len(repos_in[split]) < need_repos:
            fill = min(fill, len(repos_in[split]) / need_repos)
        return 1.0 - fill

    for repo in repo_order:
        best = max(
            active,
            key=lambda split: (
                gap(split),
                quotas.target(split) - tasks_in[split],
                -SPLITS.index(split),
            ),
        )
        repos_in[best].append(repo)
        ids_in[best].extend(kept[repo])
        tasks_in[best] += len(kept[repo])

    unmet: list[UnmetQuota] = []
    for split in active:
        for name, required, found in (
            (f"{split}.tasks", quotas.target(split), tasks_in[split]),
            (f"{split}.repos", quotas.min_repos_for(split), len(repos_in[split])),
        ):
            if found < required:
                unmet.append(
                    UnmetQuota(name=name, required=required, found=found, missing=required - found)
                )
    if len(kept) < quotas.min_repos:
        unmet.append(
            UnmetQuota(
                name="repos",
                required=quotas.min_repos,
                found=len(kept),
                missing=quotas.min_repos - len(kept),
            )
        )
    return SplitSelection(
        splits={split: sorted(ids_in[split]) for split in SPLITS},
        repos_per_split={split: sorted(repos_in[split]) for split in SPLITS},
        capped=sorted(capped),
        unmet=unmet,
        ready=not unmet,
    )


def quota_feasibility(repo_counts: Mapping[str, int], quotas: SplitQuotas) -> list[UnmetQuota]:
    """The quotas that even every candidate accepted could not meet (a check before any compute).

    Necessary conditions: ``repos`` (distinct repositories >= ``min_repos``), ``splits.repos`` (>= the sum
    of :meth:`SplitQuotas.min_repos_for` over non-empty splits) and ``tasks`` (the sum of
    ``min(candidates, max_per_repo)`` >= the split targets). Not sufficient: validation decides.

    Args:
        repo_counts: repository -> number of candidates.

    Returns:
        The unmet conditions (empty: the quotas are reachable).

    Raises:
        InputError: a negative count, or every split target is 0.
    """
    if not any(quotas.target(split) for split in SPLITS):
        raise InputError("quotas: train, validation and test are all 0; nothing to freeze")
    bad = {repo: n for repo, n in repo_counts.items() if n < 0}
    if bad:
        raise InputError(f"repo_counts: negative candidate counts {bad}")
    repos = sum(1 for n in repo_counts.values() if n > 0)
    split_repos = sum(quotas.min_repos_for(split) for split in SPLITS)
    tasks = sum(min(n, quotas.max_per_repo) for n in repo_counts.values())
    targets = sum(quotas.target(split) for split in SPLITS)
    unmet = []
    for name, required, found in (("repos", quotas.min_repos, repos), ("splits.repos", split_repos, repos),
                                  ("tasks", targets, tasks)):
        if found < required:
            unmet.append(UnmetQuota(name=name, required=required, found=found, missing=required - found))
    return unmet


def unmet_text(unmet: Sequence[UnmetQuota]) -> str:
    """One line naming each unmet quota of a selection: ``train.tasks: need 16, found 9 (missing 7); ...``."""
    return "; ".join(f"{u.name}: need {u.required}, found {u.found} (missing {u.missing})" for u in unmet)


def feasibility_text(unmet: Sequence[UnmetQuota]) -> str:
    """One line naming each unmet condition of :func:`quota_feasibility` and by how much."""
    what = {"repos": "repositories overall (min_repos)",
            "splits.repos": "repositories for repository-disjoint splits (one or more per non-empty split)",
            "tasks": "tasks after the per-repository cap (max_per_repo) for the split targets"}
    return "; ".join(f"{what.get(u.name, u.name)}: need {u.required}, at most {u.found} possible" for u in unmet)


def freeze_ready(
    accepted: list[TaskRef], quotas: SplitQuotas, seed: int = 0
) -> SplitSelection:
    """Preflight for a freeze: exactly :func:`select_splits`, writing nothing."""
    return select_splits(accepted, quotas, seed)


class FreezeManifest(BaseModel):
    """A written, verified freeze."""

    model_config = ConfigDict(frozen=True)

    name: str
    path: Path
    semantic_sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
        description="digest of the manifest's canonical JSON without this field")
    file_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="digest of the manifest file's bytes")
    counts: dict[str, int] = Field(description="split name -> number of tasks")
    splits: dict[str, list[str]] = Field(description="split name -> sorted instance ids")
    bundle_path: Path | None = Field(None,
        description="the export bundle's tarball when written or verified with the manifest, else None")
    bundle_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
        description="hex sha256 of that tarball (the freeze's third digest), or None")


def validate_freeze_name(name: str) -> str:
    """Return ``name`` if it matches ``[a-z0-9][a-z0-9._-]*`` (at most 128 characters).

    Raises:
        InputError: the name is invalid.
    """
    if len(name) > FREEZE_NAME_MAX_CHARS or not FREEZE_NAME_PATTERN.fullmatch(name):
        raise InputError(
            f"freeze name {name!r} is invalid: use lower-case letters, digits, '.', '_' and '-', "
            f"starting with a letter or digit, at most {FREEZE_NAME_MAX_CHARS} characters"
        )
    return name


FreezeName = Annotated[str, AfterValidator(validate_freeze_name)]
"""A freeze's name as a parameter field: refused when the parameters are validated, naming the field, if
:func:`validate_freeze_name` refuses it."""


def manifest_path(name: str, out_dir: Path) -> Path:
    """Where the manifest of freeze ``name`` lives: ``out_dir / f"{name}.json"``."""
    return Path(out_dir) / f"{validate_freeze_name(name)}.json"


def write_freeze(
    name: str,
    selection: SplitSelection,
    quotas: SplitQuotas,
    seed: int,
    out_dir: Path,
    extra_inputs: dict[str, Any] | None = None,
) -> FreezeManifest:
    """Write the manifest ``out_dir/<name>.json`` of freeze ``name`` once; never overwrite it.

    Written to a temp file and hard-linked into place (fails if another writer got there first).

    Returns:
        The manifest; for identical content already on disk, the existing one (a no-op).

    Raises:
        InputError: invalid name, or ``extra_inputs`` not JSON-serialisable.
        PreflightError: ``selection.ready`` is False (the unmet quotas listed).
        FreezeConflictError: a freeze of this name exists with different content (both semantic digests named).
    """
    path = manifest_path(name, out_dir)
    if not selection.ready:
        raise PreflightError(f"freeze {name!r}: quotas not met: {unmet_text(selection.unmet)}")
    document: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "splits": selection.splits,
        "repos": selection.repos_per_split,
        "counts": selection.counts,
        "quotas": quotas.model_dump(),
        "seed": seed,
        "inputs": extra_inputs or {},
        "forgeflow_version": forgeflow.__version__,
    }
    try:
        document = with_semantic_digest(document)
    except (TypeError, ValueError) as exc:
        raise InputError(f"freeze {name!r}: extra_inputs is not JSON-serialisable: {exc}") from exc
    if path.exists():
        return _existing_or_conflict(name, path, document["semantic_sha256"])
    payload = (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.staged")
    atomic_write_bytes(staging, payload)
    try:
        os.link(staging, path)
    except FileExistsError:
        return _existing_or_conflict(name, path, document["semantic_sha256"])
    finally:
        staging.unlink(missing_ok=True)
    return verify_freeze(path)


def _existing_or_conflict(name: str, path: Path, new_digest: str) -> FreezeManifest:
    existing = verify_freeze(path)
    if existing.semantic_sha256 != new_digest:
        raise FreezeConflictError(
            f"freeze {name!r} already exists at {path} with semantic_sha256 "
            f"{existing.semantic_sha256}; the new content has {new_digest}. A frozen manifest is "
            "never overwritten: choose a new name."
        )
    return existing


def verify_freeze(path: Path, expected_file_sha256: str | None = None) -> FreezeManifest:
    """Read a manifest and recompute its digests.

    Args:
        expected_file_sha256: if given (e.g. the store's ``freezes`` row), the file's bytes must have it.

    Raises:
        InputError: the file is missing or not JSON, its schema version is unknown, its
            ``semantic_sha256`` does not match its content, its counts disagree with its splits,
            or the file digest differs from ``expected_file_sha256``.
    """
    path = Path(path)
    document = read_digested_json(path, "freeze manifest", SCHEMA_VERSION)
    absent = [key for key in ("name", "splits", "counts") if key not in document]
    if absent:
        raise InputError(f"freeze manifest {path} lacks {absent}")
    splits = document["splits"]
    counts = {split: len(ids) for split, ids in splits.items()}
    if counts != document["counts"]:
        raise InputError(
            f"freeze manifest {path}: counts {document['counts']} disagree with splits {counts}"
        )
    file_sha256 = sha256_file(path)
    if expected_file_sha256 is not None and file_sha256 != expected_file_sha256:
        raise InputError(
            f"freeze manifest {path} has file sha256 {file_sha256}; expected {expected_file_sha256}"
        )
    return FreezeManifest(
        name=document["name"],
        path=path,
        semantic_sha256=document["semantic_sha256"],
        file_sha256=file_sha256,
        counts=counts,
        splits=splits,
    )


def inputs_path(name: str, out_dir: Path) -> Path:
    """Where the inputs that made freeze ``name`` are recorded: ``out_dir / f"{name}.inputs.json"``."""
    return Path(out_dir) / f"{validate_freeze_name(name)}.inputs.json"


def check_freeze_inputs(name: str, out_dir: Path, inputs: dict[str, Any]) -> None:
    """Refuse, before any work, a run whose freeze ``name`` already exists from other inputs.

    Compares ``inputs`` (JSON values: lists, not tuples) with those :func:`record_freeze_inputs`
    recorded; a freeze without a recorded inputs file is not checked here (its freeze stage still
    refuses other content).

    Raises:
        FreezeConflictError: the freeze exists and its recorded inputs differ (each input, both values).
        InputError: the recorded inputs file is not a JSON object.
    """
    manifest, recorded_path = manifest_path(name, out_dir), inputs_path(name, out_dir)
    if not manifest.is_file() or not recorded_path.is_file():
        return
    try:
        recorded = json.loads(recorded_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{recorded_path}: not readable JSON ({err})") from err
    if not isinstance(recorded, dict):
        raise InputError(f"{recorded_path}: expected a JSON object of inputs")
    differing = [f"{key}: {recorded.get(key)!r} then, {inputs.get(key)!r} now"
                 for key in sorted(set(recorded) | set(inputs)) if recorded.get(key) != inputs.get(key)]
    if differing:
        raise FreezeConflictError(
            f"freeze {name!r} already exists ({manifest}) and was made from other inputs ("
            + "; ".join(differing) + "): a frozen dataset is never replaced; choose a new freeze name "
            "or run with the same inputs")


def record_freeze_inputs(name: str, out_dir: Path, inputs: dict[str, Any]) -> Path:
    """Write the inputs that made freeze ``name`` beside its manifest (atomic; kept if already
    there, since a freeze is immutable); returns the path. See :func:`check_freeze_inputs`."""
    path = inputs_path(name, out_dir)
    if not path.exists():
        atomic_write_json(path, inputs)
    return path
