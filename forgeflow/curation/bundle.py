"""The export bundle of a freeze: what a team hands to its trainers.

Beside the manifest: ``<name>.bundle/`` (a ``datasets.DatasetDict`` via ``save_to_disk``, one split per
manifest split, columns :data:`FEATURES`), ``<name>.bundle.tar`` (a deterministic tarball: the same
freeze gives the same bytes anywhere; its sha256 is the freeze's third digest) and ``<name>.bundle.json``
(the sidecar, written last: a bundle without it was never committed). A freeze made before bundles
keeps its manifest; :func:`verify_bundle` says it has no bundle.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from forgeflow.common.errors import FreezeConflictError, InputError
from forgeflow.common.fsutil import (
    atomic_folder,
    atomic_output_file,
    atomic_write_json,
    read_digested_json,
    sha256_file,
    sha256_tree,
    with_semantic_digest,
)
from forgeflow.curation.freeze import SPLITS, FreezeManifest, validate_freeze_name

BUNDLE_SCHEMA_VERSION = 1
"""Version of the sidecar layout and of the bundle's columns."""

COLUMNS: tuple[str, ...] = ("instance_id", "repo", "split", "FAIL_TO_PASS", "PASS_TO_PASS", "image_ref",
                            "image_digest", "patch_sha256", "patch", "problem_statement")
"""The bundle's columns, in order (SWE-bench's names for the test lists)."""

_TAR_FILE_MODE, _TAR_DIR_MODE = 0o644, 0o755


class BundleTask(BaseModel):
    """What the freeze knows of one task, to become one bundle row: the store's record, not yet a
    :class:`~forgeflow.common.task.Task` (no test command; the image may be unknown), in its spelling."""

    model_config = ConfigDict(frozen=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    FAIL_TO_PASS: list[str] = Field(default_factory=list, validation_alias=AliasChoices("FAIL_TO_PASS", "fail_to_pass"),
                                    description="FAIL_TO_PASS test ids from validation")
    PASS_TO_PASS: list[str] = Field(default_factory=list, validation_alias=AliasChoices("PASS_TO_PASS", "pass_to_pass"),
                                    description="PASS_TO_PASS test ids from validation")
    image_ref: str | None = Field(None, description="the task image reference, if known")
    image_digest: str | None = Field(None, description="the task image's manifest digest (sha256:...), if known")
    patch_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
        description="hex sha256 of the bug patch, if known")
    patch: str | None = Field(None, description="the bug patch (unified diff), if known (stored since migration 0007)")
    problem_statement: str | None = Field(None, description="the task's issue text, if its source has one")


class FreezeBundle(BaseModel):
    """A written, verified export bundle."""

    model_config = ConfigDict(frozen=True)

    name: str
    dataset_dir: Path = Field(description="the save_to_disk folder (<name>.bundle)")
    tarball: Path = Field(description="the deterministic tarball (<name>.bundle.tar)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex sha256 of the tarball (the freeze's third digest)")
    sidecar: Path = Field(description="the sidecar JSON (<name>.bundle.json)")
    manifest_semantic_sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
        description="semantic sha256 of the manifest the bundle was made from")
    counts: dict[str, int] = Field(description="split name -> rows")


def bundle_paths(name: str, out_dir: Path) -> tuple[Path, Path, Path]:
    """``(dataset_dir, tarball, sidecar)`` of freeze ``name`` in ``out_dir``.

    Raises:
        InputError: the name is invalid.
    """
    validate_freeze_name(name)
    base = Path(out_dir)
    return base / f"{name}.bundle", base / f"{name}.bundle.tar", base / f"{name}.bundle.json"


def _features() -> Any:
    import datasets  # noqa: PLC0415  (heavy: only where a bundle is written or read)

    text, texts = datasets.Value("string"), datasets.Sequence(datasets.Value("string"))
    return datasets.Features({column: texts if column in ("FAIL_TO_PASS", "PASS_TO_PASS") else text
                              for column in COLUMNS})


def bundle_rows(manifest: FreezeManifest, tasks: Iterable[BundleTask]) -> dict[str, list[dict[str, Any]]]:
    """The bundle's rows: split name -> one dict per task (keys :data:`COLUMNS`), in the manifest's order.

    Raises:
        InputError: a manifest id has no task (up to five named), or a task's id appears twice.
    """
    by_id: dict[str, BundleTask] = {}
    for task in tasks:
        if task.instance_id in by_id:
            raise InputError(f"bundle tasks of freeze {manifest.name!r}: instance id {task.instance_id!r} "
                             "appears twice")
        by_id[task.instance_id] = task
    wanted = [iid for ids in manifest.splits.values() for iid in ids]
    missing = [iid for iid in wanted if iid not in by_id]
    if missing:
        raise InputError(f"bundle tasks of freeze {manifest.name!r}: {len(missing)} of the manifest's {len(wanted)} "
                         f"tasks have no row (e.g. {', '.join(missing[:5])})")
    rows: dict[str, list[dict[str, Any]]] = {}
    for split, ids in manifest.splits.items():
        rows[split] = []
        for iid in ids:
            task = by_id[iid]
            rows[split].append({"instance_id": iid, "repo": task.repo, "split": split,
                                "FAIL_TO_PASS": list(task.FAIL_TO_PASS), "PASS_TO_PASS": list(task.PASS_TO_PASS),
                                "image_ref": task.image_ref, "image_digest": task.image_digest,
                                "patch_sha256": task.patch_sha256, "patch": task.patch,
                                "problem_statement": task.problem_statement})
    return rows


@contextmanager
def _quiet_progress() -> Iterator[None]:
    import datasets  # noqa: PLC0415

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _save_dataset_dict(rows: dict[str, list[dict[str, Any]]], folder: Path) -> None:
    import datasets  # noqa: PLC0415

    features = _features()
    splits = [s for s in SPLITS if s in rows] + sorted(s for s in rows if s not in SPLITS)
    dataset_dict = datasets.DatasetDict({
        split: datasets.Dataset.from_dict({c: [row[c] for row in rows[split]] for c in COLUMNS}, features=features)
        for split in splits})
    with _quiet_progress():
        # one shard per split, also for an empty split (0 shards would not load back)
        dataset_dict.save_to_disk(str(folder), num_shards={split: 1 for split in splits})


def write_deterministic_tar(folder: Path, arcname: str, sink: BinaryIO) -> None:
    """Write ``folder`` as an uncompressed PAX tarball under ``arcname/`` to ``sink``: members sorted, mtime 0,
    uid/gid 0, no owner names, modes 0644/0755, so equal contents give equal bytes.

    Raises:
        InputError: ``folder`` holds something other than plain files and folders (a link).
    """
    root = Path(folder)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in [root, *sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix())]:
            rel = path.relative_to(root).as_posix()
            info = tarfile.TarInfo(arcname if rel == "." else f"{arcname}/{rel}")
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise InputError(f"bundle folder {root}: {path} is not a plain file or folder")
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, _TAR_DIR_MODE
                tar.addfile(info)
            else:
                info.mode, info.size = _TAR_FILE_MODE, path.stat().st_size
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)


class _HashSink(io.RawIOBase):
    """A write-only stream that only hashes what it is given."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return len(data)


def write_bundle(manifest: FreezeManifest, tasks: Iterable[BundleTask], out_dir: Path | None = None) -> FreezeBundle:
    """Write the export bundle of ``manifest`` (folder, tarball, sidecar last) once; never replace it.

    Args:
        tasks: what is known of each task; every manifest id needs one (others are ignored).
        out_dir: where to write; default the manifest's folder.

    Returns:
        The bundle; if one with the same tarball sha256 exists, that one (verified), untouched.

    Raises:
        InputError: a manifest task has no row, or an existing bundle fails :func:`verify_bundle`.
        FreezeConflictError: a bundle of this freeze exists with another tarball sha256 (both named).
        DiskFullError: the filesystem filled up (nothing is left under the final names).
    """
    out = Path(out_dir) if out_dir is not None else manifest.path.parent
    dataset_dir, tarball, sidecar = bundle_paths(manifest.name, out)
    rows = bundle_rows(manifest, tasks)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=out, prefix=f".{manifest.name}.bundle-build."))
    try:
        _save_dataset_dict(rows, scratch / "dataset")
        hashing = _HashSink()
        write_deterministic_tar(scratch / "dataset", dataset_dir.name, hashing)
        sha256 = hashing.digest.hexdigest()
        if sidecar.exists():
            existing = verify_bundle(manifest, None, out)
            if existing is not None and existing.sha256 != sha256:
                raise FreezeConflictError(
                    f"freeze {manifest.name!r} already has an export bundle {existing.tarball} with sha256 "
                    f"{existing.sha256}; the tasks given now make {sha256}. A frozen bundle is never replaced: "
                    "choose a new freeze name.")
            if existing is not None:
                return existing
        with atomic_folder(dataset_dir) as staged:
            shutil.copytree(scratch / "dataset", staged, dirs_exist_ok=True)
        with atomic_output_file(tarball) as staged_tar:
            with open(staged_tar, "wb") as handle:
                write_deterministic_tar(dataset_dir, dataset_dir.name, handle)
                handle.flush()
                os.fsync(handle.fileno())
        counts = {split: len(split_rows) for split, split_rows in rows.items()}
        atomic_write_json(sidecar, with_semantic_digest({
            "schema_version": BUNDLE_SCHEMA_VERSION, "name": manifest.name,
            "manifest_semantic_sha256": manifest.semantic_sha256, "dataset_dir": dataset_dir.name,
            "tarball": tarball.name, "sha256": sha256_file(tarball), "counts": counts, "columns": list(COLUMNS)}))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    verified = verify_bundle(manifest, sha256, out)
    assert verified is not None  # the sidecar was just written
    return verified


def with_bundle(manifest: FreezeManifest, bundle: FreezeBundle | None) -> FreezeManifest:
    """``manifest`` with its ``bundle_path`` / ``bundle_sha256`` set from ``bundle`` (None: left unset)."""
    if bundle is None:
        return manifest
    return manifest.model_copy(update={"bundle_path": bundle.tarball, "bundle_sha256": bundle.sha256})


def verify_bundle(manifest: FreezeManifest, expected_sha256: str | None,
                  out_dir: Path | None = None) -> FreezeBundle | None:
    """Check the export bundle of ``manifest``: its sidecar, the tarball's sha256, and the dataset.

    The sidecar's digest and manifest; the tarball's sha256 against the sidecar and ``expected_sha256``
    (the store's); the ``DatasetDict``'s splits and ids in order; the unpacked folder against the tarball.

    Returns:
        The bundle, or None when the freeze has no bundle and none was expected.

    Raises:
        InputError: any check fails; a tarball digest mismatch starts with ``bundle sha256``.
    """
    out = Path(out_dir) if out_dir is not None else manifest.path.parent
    dataset_dir, tarball, sidecar = bundle_paths(manifest.name, out)
    if not sidecar.exists():
        if expected_sha256 is None:
            return None
        raise InputError(f"bundle sha256: the store records export bundle {expected_sha256} for freeze "
                         f"{manifest.name!r}, but its sidecar {sidecar} does not exist")
    document = read_digested_json(sidecar, "freeze bundle sidecar", BUNDLE_SCHEMA_VERSION)
    if document.get("name") != manifest.name or document.get("manifest_semantic_sha256") != manifest.semantic_sha256:
        raise InputError(f"freeze bundle sidecar {sidecar} is of freeze {document.get('name')!r} with manifest "
                         f"{document.get('manifest_semantic_sha256')}, not {manifest.name!r} with "
                         f"{manifest.semantic_sha256}")
    if not tarball.is_file():
        raise InputError(f"bundle sha256: the export bundle tarball {tarball} does not exist")
    actual = sha256_file(tarball)
    for source, wanted in (("its sidecar", document.get("sha256")), ("the store", expected_sha256)):
        if wanted is not None and actual != wanted:
            raise InputError(f"bundle sha256: {tarball} has sha256 {actual}; {source} records {wanted}")
    # unpacked under the system's temp folder: verifying never writes beside the freeze
    with tempfile.TemporaryDirectory(prefix=f"forgeflow-{manifest.name}.bundle-verify.") as tmp:
        unpacked = _unpack(tarball, Path(tmp), dataset_dir.name)
        counts = _check_dataset(unpacked, manifest, tarball)
        if not dataset_dir.is_dir():
            raise InputError(f"freeze bundle folder {dataset_dir} does not exist (the tarball {tarball} is intact)")
        if sha256_tree(dataset_dir) != sha256_tree(unpacked):
            raise InputError(f"freeze bundle folder {dataset_dir} differs from its tarball {tarball} "
                             f"(sha256 {actual}): a file in the folder was changed, added or removed")
    return FreezeBundle(name=manifest.name, dataset_dir=dataset_dir, tarball=tarball, sha256=actual, sidecar=sidecar,
                        manifest_semantic_sha256=manifest.semantic_sha256, counts=counts)


def _unpack(tarball: Path, into: Path, root: str) -> Path:
    """Extract ``tarball`` into ``into`` (tarfile's ``data`` filter: no links out, no absolute
    paths) and return ``into / root``."""
    try:
        with tarfile.open(tarball, mode="r:") as tar:
            names = tar.getnames()
            stray = [n for n in names if n != root and not n.startswith(f"{root}/")]
            if stray:
                raise InputError(f"freeze bundle tarball {tarball} has members outside {root}/: {stray[:5]}")
            tar.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise InputError(f"freeze bundle tarball {tarball} cannot be unpacked: {exc}") from exc
    return into / root


def _check_dataset(folder: Path, manifest: FreezeManifest, tarball: Path) -> dict[str, int]:
    import datasets  # noqa: PLC0415

    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, pyarrow errors
        raise InputError(f"freeze bundle tarball {tarball}: its DatasetDict does not load with "
                         f"datasets.load_from_disk: {type(exc).__name__}: {exc}") from exc
    if not isinstance(loaded, datasets.DatasetDict):
        raise InputError(f"freeze bundle tarball {tarball} holds a single Dataset, not a DatasetDict of splits")
    if sorted(loaded) != sorted(manifest.splits):
        raise InputError(f"freeze bundle tarball {tarball} has splits {sorted(loaded)}; the manifest "
                         f"{manifest.path} has {sorted(manifest.splits)}")
    for split, ids in manifest.splits.items():
        found = list(loaded[split]["instance_id"])
        if found != ids:
            raise InputError(f"freeze bundle tarball {tarball}: split {split!r} has {len(found)} rows whose instance "
                             f"ids differ from the {len(ids)} of the manifest {manifest.path}")
        if set(loaded[split]["split"]) - {split}:
            raise InputError(f"freeze bundle tarball {tarball}: split {split!r} has rows labelled with another split")
    return {split: loaded[split].num_rows for split in manifest.splits}
