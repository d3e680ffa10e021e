"""Publish a packaged model (a GGUF file plus its lineage/metadata JSON) to a model store.

Local directory (:func:`publish_local`): content-addressed, atomic, idempotent. HF Hub
(:func:`publish_hub`): one ``create_commit`` pinned to a parent commit (the Hub answers HTTP 412 when
the branch moved), then every file read back with ``get_paths_info`` and compared (LFS oid = sha256;
a regular file's git blob id = ``sha1("blob <size>\\0" + bytes)``).

The Hub token comes only from the caller (a Prefect Secret block): never read from the environment
or the local login (``HfApi(token=False)``), never logged, recorded or left in a message (scrubbed).
``transfer="lfs"`` forces the Git LFS batch protocol for servers without Xet storage by setting
``huggingface_hub.constants.HF_HUB_DISABLE_XET`` under a module lock (a process-wide switch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from forgeflow.common.errors import (
    ForgeflowError,
    InputError,
    ModelStoreError,
    ModelStoreUnavailableError,
    PublishDigestMismatchError,
    StaleParentCommitError,
)
from forgeflow.common.fsutil import (
    FILE_MODE,
    atomic_write_text,
    fsync_dir,
    sha256_file,
    sha256_json,
)

logger = logging.getLogger(__name__)

PUBLISH_SCHEMA_VERSION = 1
"""Schema version of :class:`PublishRecord` (``publish.json``)."""

RECORD_FILE = "publish.json"
"""Name of the record written into a local store folder."""

HF_ENDPOINT = "https://huggingface.co"
"""The public HF Hub (``huggingface_hub.constants._HF_DEFAULT_ENDPOINT``)."""

_CHUNK_BYTES = 1 << 20
_XET_LOCK = threading.Lock()


class PublishedFile(BaseModel):
    """One file of a published artifact."""

    model_config = ConfigDict(frozen=True)

    path_in_store: str = Field(min_length=1, description="name of the file inside the store folder / repository")
    sha256: str = Field(min_length=64, max_length=64, description="hex sha256 of its bytes")
    size_bytes: int = Field(ge=0)
    role: Literal["gguf", "metadata", "mmproj", "adapter", "checkpoint"] = Field(
        description="gguf, metadata, mmproj (projector), adapter (under adapter/) or checkpoint (under checkpoint/)")


class PublishRecord(BaseModel):
    """What was published where, as verified after publishing (holds no credential)."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = PUBLISH_SCHEMA_VERSION
    backend: Literal["local", "hf_hub"]
    location: str = Field(description="the store folder (local) or <endpoint>/<repo_id> (Hub)")
    repo_id: str | None = Field(None, description="the Hub repository (None for local)")
    revision: str = Field(min_length=1, description="local: 16 hex digits of the content digest; Hub: the commit oid")
    parent_revision: str | None = Field(None,
        description="the Hub commit the new commit was pinned to (None for local)")
    files: list[PublishedFile] = Field(min_length=1)
    published_at_unix_s: float = Field(
        description="when the publish finished (an idempotent local re-run keeps the first time)")


class HubTarget(BaseModel):
    """Where on an HF Hub :func:`publish_hub` commits a release (holds no credential); the ``forgeflow-model-store``
    block (:class:`blocks.core.ModelStore`) extends it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    repo_id: str = Field(min_length=1, description="HF Hub model repository 'namespace/name'")
    endpoint: str = Field(HF_ENDPOINT, min_length=1, description="the Hub's base URL")
    revision: str = Field("main", min_length=1, description="the branch the commit goes to")
    private: bool = Field(True, description="visibility of the repository if publishing creates it")
    transfer: Literal["auto", "lfs"] = Field("auto", description="auto (Xet if installed) or lfs (Git LFS)")


# --- the artifact ----------------------------------------------------------------------------
FOLDER_ROLES = ("adapter", "checkpoint")
"""Folders a release may carry beside its GGUF, each under ``<role>/`` in the revision: the LoRA
adapter merged into it and the HF checkpoint it was converted from."""


def _folder_files(folder: Path, role: str) -> list[tuple[Path, str]]:
    """The regular files of a folder as (path, path in store under ``<role>/``), sorted; no symlinks or dot-files.

    Raises:
        InputError: the folder is missing or holds no file (named as ``<role>_dir``).
    """
    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"{role}_dir {root} is not a folder")
    found = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not found:
        raise InputError(f"{role}_dir {root} holds no file")
    return [(p, f"{role}/{p.relative_to(root).as_posix()}") for p in found]


def _check_artifact(gguf_path: Path, metadata_path: Path, adapter_dir: Path | None = None,
                    checkpoint_dir: Path | None = None,
                    mmproj_path: Path | None = None) -> list[tuple[Path, PublishedFile]]:
    """Preflight: the GGUF header reads, the metadata is a JSON object, the names differ, and the projector
    is the one the metadata names (``mmproj_sha256``).

    Raises:
        InputError: as :func:`publish_local` says.
    """
    from forgeflow.packaging.gguf_reader import read_header_index

    gguf_path, metadata_path = Path(gguf_path), Path(metadata_path)
    read_header_index(gguf_path)  # GGUFError: missing, not GGUF, truncated header
    if not metadata_path.is_file():
        raise InputError(f"metadata_path {metadata_path} does not exist")
    try:
        metadata = json.loads(metadata_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"metadata_path {metadata_path} is not JSON: {exc}") from exc
    if not isinstance(metadata, dict):
        raise InputError(f"metadata_path {metadata_path} holds {type(metadata).__name__}, not a JSON object")
    named = [(gguf_path, gguf_path.name, "gguf"), (metadata_path, metadata_path.name, "metadata")]
    want = metadata.get("mmproj_sha256")
    if want and mmproj_path is None:
        raise InputError(f"{metadata_path} says {gguf_path.name} serves with the vision projector sha256 {want}: "
                         "give mmproj_path, the projector is published beside the GGUF")
    if mmproj_path is not None:
        read_header_index(Path(mmproj_path))  # GGUFError: the projector is not a GGUF
        named.append((Path(mmproj_path), Path(mmproj_path).name, "mmproj"))
    names = [in_store for _, in_store, _ in named]
    if len(set(names)) < len(names) or RECORD_FILE in names:
        raise InputError(f"file names must differ from each other and from {RECORD_FILE!r}: {names}")
    for role, folder in zip(FOLDER_ROLES, (adapter_dir, checkpoint_dir)):
        named += [(p, in_store, role) for p, in_store in (_folder_files(folder, role) if folder else [])]
    pairs = [(path, PublishedFile(path_in_store=in_store, sha256=sha256_file(path), size_bytes=path.stat().st_size,
                                  role=role)) for path, in_store, role in named]  # type: ignore[arg-type]
    found = next((f.sha256 for _, f in pairs if f.role == "mmproj"), None)
    if want and found != want:
        raise InputError(f"mmproj_path {mmproj_path} has sha256 {found}, not the projector {want} that "
                         f"{metadata_path} names")
    return pairs


def local_revision(files: list[PublishedFile]) -> str:
    """The local store revision of a set of files: 16 hex digits of the sha256 of the canonical
    JSON list of ``[path_in_store, sha256]`` pairs, sorted by path."""
    return sha256_json(sorted([f.path_in_store, f.sha256] for f in files))[:16]


def git_blob_sha1(path: Path) -> str:
    """Git's object id of a file's bytes: ``sha1(b"blob <size>\\0" + bytes)`` (git's loose-object
    format; what the Hub reports as the ``oid`` of a regular, non-LFS file)."""
    digest = hashlib.sha1(f"blob {Path(path).stat().st_size}\0".encode())  # noqa: S324 - git's id
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- local directory -------------------------------------------------------------------------
def _copy_fsynced(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, _CHUNK_BYTES)
        fout.flush()
        os.fsync(fout.fileno())
    os.chmod(dst, FILE_MODE)


def _verify_local(folder: Path, files: list[PublishedFile]) -> None:
    for expected in files:
        path = folder / expected.path_in_store
        if not path.is_file():
            raise PublishDigestMismatchError(f"{path}: expected a file of sha256 {expected.sha256}, found none")
        found_sha, found_size = sha256_file(path), path.stat().st_size
        if (found_sha, found_size) != (expected.sha256, expected.size_bytes):
            raise PublishDigestMismatchError(
                f"{path}: expected sha256 {expected.sha256} ({expected.size_bytes} bytes), "
                f"found sha256 {found_sha} ({found_size} bytes)"
            )


def read_local_record(folder: Path) -> PublishRecord:
    """Read ``publish.json`` of a local store folder and re-check every file's sha256 and size.

    Raises:
        InputError: no record, or it is not a valid :class:`PublishRecord`.
        PublishDigestMismatchError: a file is missing or its bytes changed since publishing.
    """
    folder = Path(folder)
    path = folder / RECORD_FILE
    try:
        record = PublishRecord.model_validate_json(path.read_bytes())
    except FileNotFoundError as exc:
        raise InputError(f"{folder} holds no {RECORD_FILE}") from exc
    except ValueError as exc:  # pydantic ValidationError
        raise InputError(f"{path} is not a publish record: {exc}") from exc
    _verify_local(folder, record.files)
    return record



def check_model_name(name: str) -> str:
    """``name`` when it is one safe path component (letters, digits, ``._-``; not ``.`` or ``..``).

    Raises:
        InputError: it is not (a path such as ``../x`` would leave the store).
    """
    if not name or name in (".", "..") or not all(c.isalnum() or c in "._-" for c in name):
        raise InputError(f"name {name!r} must be one path component of letters, digits and '._-'")
    return name

def publish_local(gguf_path: Path, metadata_path: Path, store_root: Path, name: str,
                  adapter_dir: Path | None = None, checkpoint_dir: Path | None = None,
                  mmproj_path: Path | None = None) -> PublishRecord:
    """Publish a GGUF and its metadata JSON (and the adapter merged into it, the checkpoint it was
    converted from) into a local store folder (atomic, idempotent).

    Layout: ``<store_root>/<name>/<revision>/`` with ``revision`` = :func:`local_revision` of the files
    (adapter files under ``adapter/``, checkpoint files under ``checkpoint/``) and ``publish.json``
    written last. Copies are fsynced and re-hashed in a temporary sibling, then renamed into place; an
    existing folder of the revision is re-checked and its record returned.

    Args:
        mmproj_path: the vision projector GGUF; required when the metadata names one, and then that file.

    Raises:
        InputError: ``name`` is not one safe path component, the metadata is not a JSON object,
            the files share a name, ``adapter_dir`` / ``checkpoint_dir`` is not a folder
            with files, or the projector the metadata names is not ``mmproj_path``.
        GGUFError: ``gguf_path`` or ``mmproj_path`` is missing or not a GGUF file.
        PublishDigestMismatchError: a copy differs from its source, or an existing folder of the
            same revision holds different bytes (corruption).
    """
    check_model_name(name)
    pairs = _check_artifact(gguf_path, metadata_path, adapter_dir, checkpoint_dir, mmproj_path)
    files = [f for _, f in pairs]
    revision = local_revision(files)
    parent = Path(store_root) / name
    final = parent / revision
    if final.exists():
        record = read_local_record(final)
        logger.info("local store already holds %s revision %s; nothing copied", name, revision)
        return record
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{revision}."))
    try:
        for src, expected in pairs:
            _copy_fsynced(src, tmp / expected.path_in_store)
        _verify_local(tmp, files)
        record = PublishRecord(
            backend="local", location=str(final.resolve()), revision=revision, files=files,
            published_at_unix_s=time.time(),
        )
        atomic_write_text(tmp / RECORD_FILE, record.model_dump_json(indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if final.exists():  # a concurrent publish of the same revision won the rename
                return read_local_record(final)
            raise
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("published %s revision %s to %s", name, revision, final)
    return record


# --- HF Hub ----------------------------------------------------------------------------------
@contextmanager
def _lfs_transfer(transfer: str) -> Iterator[None]:
    """Force the Git LFS batch protocol (Xet off) while the block runs, when ``transfer="lfs"``."""
    if transfer == "auto":
        yield
        return
    from huggingface_hub import constants

    with _XET_LOCK:
        saved = constants.HF_HUB_DISABLE_XET
        constants.HF_HUB_DISABLE_XET = True
        try:
            yield
        finally:
            constants.HF_HUB_DISABLE_XET = saved


class _Scrubber:
    """Removes the token from any text that leaves this module (messages, logs)."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def __call__(self, text: str) -> str:
        return text.replace(self._token, "<redacted>") if self._token else text


def _hub_error(exc: BaseException, action: str, where: str, scrub: _Scrubber) -> ForgeflowError:
    """Map a ``huggingface_hub`` or transport exception to forgeflow's errors (token scrubbed); HTTP
    429/5xx and transport failures are transient.
    """
    from huggingface_hub.errors import HfHubHTTPError

    cause: BaseException = exc
    if isinstance(exc, RuntimeError) and exc.__cause__ is not None:  # LFS upload wrapper
        cause = exc.__cause__
    if isinstance(cause, HfHubHTTPError) and cause.response is not None:
        status = cause.response.status_code
        lines = str(cause.server_message or cause).strip().splitlines()
        message = f"{action} on {where} failed: HTTP {status}: {scrub(lines[0] if lines else '')}"
        if status == 429 or status >= 500:
            return ModelStoreUnavailableError(message)
        return ModelStoreError(message)
    message = f"{action} on {where} failed: {type(cause).__name__}: {scrub(str(cause))}"
    if isinstance(cause, ValueError):  # huggingface_hub: malformed server answer
        return ModelStoreError(message)
    return ModelStoreUnavailableError(message)


def _is_hub_failure(exc: BaseException) -> bool:
    """True for what ``huggingface_hub`` raises when the server or the transport fails."""
    return (
        isinstance(exc, OSError | RuntimeError | ValueError)  # HfHubHTTPError is an OSError
        or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore")
    )


def _token_value(token: SecretStr | str | None) -> str | None:
    value = token.get_secret_value() if isinstance(token, SecretStr) else token
    return value or None


def publish_hub(
    gguf_path: Path,
    metadata_path: Path,
    hub: HubTarget,
    *,
    token: SecretStr | str | None,
    parent_commit: str | None = None,
    commit_message: str | None = None,
    adapter_dir: Path | None = None,
    checkpoint_dir: Path | None = None,
    mmproj_path: Path | None = None,
) -> PublishRecord:
    """Publish a GGUF and its metadata JSON (and adapter, checkpoint, projector files) to an HF Hub model
    repository in one commit, then verify them at the new commit.

    Args:
        token: a write token from the caller, or None for a server that needs none.
        parent_commit: the 40-hex commit the branch must still point at; None pins the head read at the
            start (``create_commit`` drops unchanged files, so a stale parent is refused before upload).
        commit_message: default ``Publish <gguf name> (sha256 <first 12 hex>)``.

    Returns:
        The :class:`PublishRecord`; ``revision`` equals ``parent_revision`` when every file was already there.

    Raises:
        InputError: ``hub.repo_id`` is not ``namespace/name``, ``hub.transfer`` is unknown, the metadata
            is not a JSON object, the projector it names is not ``mmproj_path``, or ``parent_commit`` is
            not 40 hex digits.
        GGUFError: ``gguf_path`` is missing or not a GGUF file.
        StaleParentCommitError: the branch does not point at ``parent_commit`` (before or during upload).
        PublishDigestMismatchError: a file read back at the new commit is missing or differs.
        ModelStoreError: the Hub refused a request (401/403/404/4xx).
        ModelStoreUnavailableError: the Hub is unreachable or answered 429/5xx (transient).
    """
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    repo_id, revision, transfer = hub.repo_id, hub.revision, hub.transfer
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise InputError(f"repo_id {repo_id!r} must be 'namespace/name'")
    if transfer not in ("auto", "lfs"):
        raise InputError(f"transfer {transfer!r} is not one of ['auto', 'lfs']")
    if parent_commit is not None and (
        len(parent_commit) != 40 or any(c not in "0123456789abcdef" for c in parent_commit)
    ):
        raise InputError(f"parent_commit {parent_commit!r} is not a 40-hex commit id")
    pairs = _check_artifact(gguf_path, metadata_path, adapter_dir, checkpoint_dir, mmproj_path)
    files = [f for _, f in pairs]
    secret = _token_value(token)
    scrub = _Scrubber(secret)
    endpoint = hub.endpoint.rstrip("/")
    where = f"{endpoint}/{repo_id}"
    api = HfApi(endpoint=endpoint, token=secret if secret else False)
    gguf = files[0]
    message = commit_message or f"Publish {gguf.path_in_store} (sha256 {gguf.sha256[:12]})"

    try:
        api.create_repo(repo_id, repo_type="model", private=hub.private, exist_ok=True)
        head = api.repo_info(repo_id, repo_type="model", revision=revision).sha
    except Exception as exc:
        if _is_hub_failure(exc):
            raise _hub_error(exc, "create_repo/repo_info", where, scrub) from exc
        raise
    if not head:
        raise ModelStoreError(f"{where} reported no head commit for branch {revision!r}")
    parent = parent_commit or head
    if head != parent:
        # Checked here too because create_commit drops files already identical at the branch
        # head and then returns the head without sending a commit (so without the 412 check).
        raise StaleParentCommitError(
            f"{where}: branch {revision!r} points at {head}, not at the parent commit {parent}; "
            "nothing was committed"
        )
    logger.info("publishing %s to %s@%s on parent %s", gguf.path_in_store, where, revision, parent)

    operations = [CommitOperationAdd(path_in_repo=f.path_in_store, path_or_fileobj=str(p)) for p, f in pairs]
    try:
        with _lfs_transfer(transfer):
            commit = api.create_commit(
                repo_id, operations, commit_message=message, repo_type="model",
                revision=revision, parent_commit=parent,
            )
    except HfHubHTTPError as exc:
        if exc.response is not None and exc.response.status_code == 412:
            raise StaleParentCommitError(
                f"{where}: branch {revision!r} no longer points at parent commit {parent} "
                f"(HTTP 412: {scrub(str(exc.server_message or '').strip())}); nothing was committed"
            ) from exc
        raise _hub_error(exc, "create_commit", where, scrub) from exc
    except Exception as exc:
        if _is_hub_failure(exc):
            raise _hub_error(exc, "create_commit", where, scrub) from exc
        raise
    new_commit = commit.oid
    _verify_hub(api, repo_id, new_commit, pairs, where, scrub)
    record = PublishRecord(
        backend="hf_hub", location=where, repo_id=repo_id, revision=new_commit,
        parent_revision=parent, files=files, published_at_unix_s=time.time(),
    )
    logger.info("published %s to %s at commit %s (verified)", gguf.path_in_store, where, new_commit)
    return record


def _verify_hub(
    api: object, repo_id: str, commit: str, pairs: list[tuple[Path, PublishedFile]], where: str,
    scrub: _Scrubber,
) -> None:
    """``get_paths_info`` at ``commit`` must show each file with the local size and sha256 (LFS)
    or git blob id (regular file)."""
    from huggingface_hub import RepoFile

    paths = [f.path_in_store for _, f in pairs]
    try:
        infos = api.get_paths_info(repo_id, paths, revision=commit, repo_type="model")  # type: ignore[attr-defined]
    except Exception as exc:
        if _is_hub_failure(exc):
            raise _hub_error(exc, "get_paths_info", where, scrub) from exc
        raise
    by_path = {info.path: info for info in infos if isinstance(info, RepoFile)}
    for local, expected in pairs:
        at = f"{where}@{commit}: {expected.path_in_store}"
        info = by_path.get(expected.path_in_store)
        if info is None:
            raise PublishDigestMismatchError(
                f"{at}: expected sha256 {expected.sha256} ({expected.size_bytes} bytes), found no such file"
            )
        if info.lfs is not None:
            found = (info.lfs.sha256, info.lfs.size)
            wanted = (expected.sha256, expected.size_bytes)
            kind = "sha256 (LFS oid)"
        else:
            found = (info.blob_id, info.size)
            wanted = (git_blob_sha1(local), expected.size_bytes)
            kind = "git blob id"
        if found != wanted or info.size != expected.size_bytes:
            raise PublishDigestMismatchError(
                f"{at}: expected {kind} {wanted[0]} ({wanted[1]} bytes), "
                f"found {found[0]} ({found[1]} bytes; file size {info.size})"
            )
