"""Prefect tasks of packaging: the base model (the tiny one, a local folder or a Hub repository),
merge/convert/quantize into GGUFs and their store records, the release check and publishing to a model store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from blocks.core import ModelStore, secret_token
from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import sha256_file, sha256_tree
from forgeflow.ledger import records
from forgeflow.ledger import store as ledger
from forgeflow.packaging import base_model as model
from forgeflow.packaging import checkpoint, gguf, mmproj, vl_model
from forgeflow.packaging import gguf_metadata as metadata
from forgeflow.packaging import publish as publishing
from forgeflow.packaging.release import ReleaseSources, metadata_path_for, write_release_metadata
from tasks.common import (
    RESUMABLE,
    io_task,
    load_block,
    run_logger,
    table_artifact,
)


@task(cache_policy=RESUMABLE)
def base_model(out_dir: Path, seed: int) -> tuple[model.ModelRecord, model.TokenizerCheck]:
    """Build the tiny Qwen2-shaped model with the real Qwen2 tokenizer.

    The saved tokenizer (the one the model ships with) is checked against llama.cpp's tokenizer
    test vectors first; any mismatch stops the stage before a model is built.
    """
    check = model.verify_tokenizer(model.ensure_tokenizer())
    if check.matched != check.total:
        raise PreflightError(f"tokenizer matches {check.matched}/{check.total} llama.cpp vectors: {check.failures[:3]}")
    return model.build_tiny_model(out_dir, seed=seed), check


def _hub_token(source: checkpoint.BaseModelSource) -> str | None:
    if not source.token_secret:
        return None
    return secret_token(source.token_secret, "base model token_secret").get_secret_value()


@io_task()
def base_model_preflight(source: checkpoint.BaseModelSource) -> str | None:
    """Before any compute: the base checkpoint ``source`` names can be had (a local folder with a
    config, weights and a tokenizer; a Hub revision that resolves to such a commit); the Secret
    block is read here too. Returns the Hub commit (None otherwise). Raises as
    :func:`forgeflow.packaging.checkpoint.preflight_source` (InputError names what is missing)."""
    return checkpoint.preflight_source(source, _hub_token(source))


@io_task()
def base_checkpoint(source: checkpoint.BaseModelSource, hub_dir: Path) -> checkpoint.CheckpointRecord:
    """The team's base checkpoint, checked: a local folder in place, or a Hub repository fetched at the
    commit its revision resolves to now (the token from the Secret block ``source.token_secret``); or the
    tiny multimodal model (``tiny-vl``), built in ``hub_dir``'s parent folder as ``base-vl``.

    Not cached: a folder's files or a branch's commit can change between runs; the record's digest
    and commit say what this run used. Transient Hub failures are retried.

    Args:
        source: a ``local``, ``hub`` or ``tiny-vl`` :class:`~forgeflow.packaging.checkpoint.BaseModelSource`.
        hub_dir: the ``huggingface_hub`` cache folder Hub snapshots go to.

    Raises:
        InputError: the tiny source (use :func:`base_model`), a missing Secret block, or see
            :func:`forgeflow.packaging.checkpoint.check_checkpoint` / ``download_checkpoint``.
        TransientInfraError: the Hub did not answer after the retries.
    """
    if source.kind == "local":
        return checkpoint.check_checkpoint(source.local_dir)  # type: ignore[arg-type]
    if source.kind == "tiny-vl":  # built beside the Hub snapshots (the run's models folder), once per folder
        record = checkpoint.tiny_vl_checkpoint(Path(hub_dir).parent / "base-vl")
        run_logger().info("tiny-vl base model %s: sha256 %s, %d parameters", record.path, record.sha256[:12],
                              record.num_parameters)
        return record
    if source.kind != "hub":
        raise InputError("base_checkpoint takes a local folder or a Hub repository; the tiny model is base_model")
    record = checkpoint.download_checkpoint(source, hub_dir, _hub_token(source))
    get_run_logger().info("base model %s@%s (commit %s) fetched to %s, sha256 %s, %d parameters", source.repo_id,
                          source.revision, record.commit, record.path, record.sha256[:12], record.num_parameters)
    return record


@task(cache_policy=RESUMABLE)
def package(hf_dir: Path, hf_sha256: str, out_dir: Path, quantizations: tuple[str | gguf.QuantSpec, ...],
            adapter_dir: Path | None = None, adapter_sha256: str | None = None,
            metadata_edits: tuple[metadata.MetadataEdit, ...] = ()) -> dict[str, gguf.GGUFArtifact]:
    """Merge (if an adapter is given) -> convert to GGUF f16 -> quantize -> check -> load
    [-> metadata edits -> verify -> check -> load].

    Args:
        quantizations: the quantization plan: :data:`forgeflow.packaging.gguf.QUANT_PLANS` names
            and/or :class:`forgeflow.packaging.gguf.QuantSpec` (a preset with per-tensor types).
        metadata_edits: edits applied, after every artifact passed its check and loaded, to each
            artifact they name (all by default) with
            :func:`forgeflow.packaging.gguf_metadata.apply_metadata_edits` (one bounded-memory
            pass, verified), each edited file then checked and loaded again.

    An image-text-to-text checkpoint (a ``vision_config``: ``tiny-vl``, Qwen3.5, Qwen3-VL) is merged through
    ``AutoModelForImageTextToText``; its language model is converted and quantized as above and its vision
    projector converted once more (``--mmproj``, kept in its converted type) as the ``mmproj`` artifact,
    checked tensor by tensor against the vision tower (:func:`forgeflow.packaging.mmproj.check_mmproj`).

    Returns:
        {"f16": artifact, "<key>": artifact, ..., ["mmproj": projector]} (key: :attr:`QuantSpec.key`); every artifact
        checked against the HF config (a mixed one also tensor by tensor; edited keys against
        their edits) and loaded with llama-cpp-python; an edited one carries the sha256 of the
        edited file and its ``edit_lineage``.

    Raises:
        InputError: an unknown plan name or preset, repeated artifact keys, an invalid edit
            (before any compute).
        GGUFError: a check failed, or an edit does not fit the file (a set/delete of an absent
            key, an add of a present one, a value that does not fit the stored type).
    """
    plan = gguf.quant_plan(quantizations)
    edits = metadata.validate_metadata_edits(metadata_edits, ("f16", *(spec.key for spec in plan)))
    out_dir.mkdir(parents=True, exist_ok=True)
    source = hf_dir
    if adapter_dir is not None:
        source = gguf.merge_adapter(hf_dir, adapter_dir, out_dir / "merged")
    multimodal = vl_model.is_multimodal(source)
    convert = mmproj.convert_text if multimodal else gguf.convert_to_gguf
    artifacts = {"f16": convert(source, out_dir / "model-f16.gguf", outtype="f16")}
    for spec in plan:
        artifacts[spec.key] = gguf.quantize(artifacts["f16"].path, out_dir / f"model-{spec.key}.gguf", spec.preset,
                                            tensor_types=dict(spec.tensor_types) or None)
    for artifact in artifacts.values():
        gguf.check_gguf(artifact.path, source)
        gguf.load_gguf(artifact.path)
    for key, artifact in list(artifacts.items()):
        mine = [edit for edit in edits if edit.applies_to(key)]
        if mine:
            artifacts[key] = _edit_artifact(artifact, mine, source)
    if multimodal:  # the projector, in its converted type, checked against the vision tower it came from
        projector = mmproj.convert_mmproj(source, out_dir / "mmproj-f16.gguf")
        check = mmproj.check_mmproj(projector.path, source)
        run_logger().info("projector %s (%s, %d tensors equal to the vision tower %s): sha256 %s",
                              projector.path.name, check.projector_type, check.tensors_compared,
                              check.vision_sha256[:12], projector.sha256[:12])
        artifacts[mmproj.MMPROJ_KEY] = projector
    return artifacts


def _edit_artifact(artifact: gguf.GGUFArtifact, edits: list[metadata.MetadataEdit], hf_dir: Path) -> gguf.GGUFArtifact:
    """Apply ``edits`` to a checked artifact in place, check and load the result; the artifact as edited."""
    logger = get_run_logger()
    result = metadata.apply_metadata_edits(artifact.path, edits)
    gguf.check_gguf(artifact.path, hf_dir, edited={e.key: e.new_value for e in result.edits if e.op != "delete"})
    gguf.load_gguf(artifact.path)
    edited = artifact.model_copy(update={"sha256": sha256_file(artifact.path), "size_bytes": result.size_bytes,
                                         "edit_lineage": metadata.edit_lineage(result, artifact.sha256)})
    logger.info("edited the metadata of %s (%s; %s verification, %.2f s): sha256 %s -> %s", artifact.path.name,
                ", ".join(f"{e.op} {e.key}" for e in result.edits), result.verification, result.duration_s,
                artifact.sha256[:12], edited.sha256[:12])
    return edited


class PackageInputs(BaseModel):
    """The digests of what the ``package`` flow packages.

    Attributes:
        hf_sha256: ``sha256_tree`` of the HF checkpoint.
        adapter_sha256: the adapter's digest (:func:`forgeflow.training.adapters.adapter_sha256`: its
            lineage's name); None without an adapter.
        adapter_tree_sha256: ``sha256_tree`` of the adapter folder (every file: the package task's cache
            key); None without an adapter.
    """

    model_config = ConfigDict(frozen=True)

    hf_sha256: str
    adapter_sha256: str | None = None
    adapter_tree_sha256: str | None = None


@task(cache_policy=NO_CACHE)
def package_inputs(hf_dir: Path, adapter_dir: Path | None) -> PackageInputs:
    """Hash the checkpoint ``hf_dir`` and the adapter ``adapter_dir`` (if any) as they are now."""
    from forgeflow.training.adapters import adapter_sha256

    return PackageInputs(hf_sha256=sha256_tree(hf_dir),
                         adapter_sha256=adapter_sha256(adapter_dir) if adapter_dir else None,
                         adapter_tree_sha256=sha256_tree(adapter_dir) if adapter_dir else None)


@task(cache_policy=NO_CACHE)
def checkpoint_sha256(hf_dir: Path) -> str:
    """``sha256_tree`` of the checkpoint folder ``hf_dir`` as it is now (what a release names as the
    checkpoint its GGUF was converted from). Never cached, like :func:`package_inputs`: a folder's files
    can change under the same path."""
    return sha256_tree(hf_dir)


class ReleaseInputs(BaseModel):
    """What the ``publish`` flow checks a release against, read by :func:`release_inputs`.

    Attributes:
        gguf_sha256: the GGUF's sha256 now.
        hf_sha256: ``sha256_tree`` of the checkpoint folder now.
        edited: key -> value the store records metadata edits set on the GGUF ({} when none).
        cross_checked: the store knows the GGUF and its recorded chain matched the sources; False: the
            store does not know it (nothing to cross-check).
    """

    model_config = ConfigDict(frozen=True)

    gguf_sha256: str
    hf_sha256: str
    edited: dict[str, Any] = {}
    cross_checked: bool


@io_task()
def release_inputs(gguf_path: Path, hf_dir: Path, adapter_dir: Path | None) -> ReleaseInputs:
    """Before a release is written or sent: the files exist, their digests now, and what the store
    (``settings.store_url()``, upgraded first) records about the GGUF: its recorded chain must have been
    converted from ``hf_dir`` (and ``adapter_dir``) (:func:`forgeflow.packaging.lineage.check_release_sources`;
    a GGUF the store does not know is logged as not cross-checked), and the metadata edits a ``package``
    run set on it (:func:`forgeflow.packaging.gguf_metadata.recorded_edited_values`).

    Never cached: the files and the store can change between runs. Transient store failures are retried.

    Raises:
        InputError: ``gguf_path`` is not a file, ``hf_dir``/``adapter_dir`` is not a folder (each named as the
            ``publish`` flow's ``params`` field), or they are not what the store records the GGUF was
            converted from.
    """
    from forgeflow.packaging.lineage import check_release_sources

    if not Path(gguf_path).is_file():
        raise InputError(f"params.gguf_path {str(gguf_path)!r} is not a file")
    if not Path(hf_dir).is_dir():
        raise InputError(f"params.hf_dir {str(hf_dir)!r} is not a folder")
    if adapter_dir is not None and not Path(adapter_dir).is_dir():
        raise InputError(f"params.adapter_dir {str(adapter_dir)!r} is not a folder")
    gguf_sha, hf_sha = sha256_file(gguf_path), sha256_tree(hf_dir)
    store = ledger.Store()
    try:
        store.upgrade()
        known = check_release_sources(store, gguf_sha, hf_sha, Path(hf_dir), adapter_dir) is not None
        if not known:
            get_run_logger().warning("the store (%s) does not know GGUF %s: its lineage (hf_dir %s, adapter_dir %s) "
                                     "could not be cross-checked", store.display_url, gguf_sha, hf_dir, adapter_dir)
        edited = metadata.recorded_edited_values(store, gguf_sha)  # keys the package run's metadata edits set
    finally:
        store.dispose()
    return ReleaseInputs(gguf_sha256=gguf_sha, hf_sha256=hf_sha, edited=edited, cross_checked=known)


@io_task()
def record_packaged(artifacts: dict[str, gguf.GGUFArtifact], hf_dir: Path, adapter_dir: Path | None,
                    inputs: PackageInputs, out_dir: Path, run_id: str | None) -> None:
    """Record a ``package`` run in the store (``settings.store_url()``, upgraded first): the checkpoint as a
    ``base`` root and the adapter (parent: the checkpoint) when the store has not seen them, then the
    artifacts as :func:`record_package` records them, with ``run_id`` as their producer.

    Raises:
        InputError: a digest is already recorded with another kind or quantization.
    """
    store = ledger.Store()
    try:
        store.upgrade()
        if not store.producers(inputs.hf_sha256):  # a base checkpoint the store has not seen: a root
            store.record_model_artifact(records.ModelArtifactRecord(sha256=inputs.hf_sha256, kind="base",
                                                                   path=str(hf_dir), run_id=run_id))
        if adapter_dir and inputs.adapter_sha256 and not store.producers(inputs.adapter_sha256):
            store.record_model_artifact(records.ModelArtifactRecord(
                sha256=inputs.adapter_sha256, kind="adapter", path=str(adapter_dir), parent_sha256=inputs.hf_sha256,
                run_id=run_id))
        record_package(store, artifacts, inputs.hf_sha256, Path(out_dir), inputs.adapter_sha256, run_id, Path(hf_dir))
    finally:
        store.dispose()


def record_package(store: ledger.Store, artifacts: dict[str, gguf.GGUFArtifact], hf_sha256: str, out_dir: Path,
                   adapter_sha256: str | None, run_id: str | None, hf_dir: Path | None = None) -> str:
    """Record what :func:`package` made in the store, one production each with ``run_id``: the merged
    checkpoint ``out_dir/merged`` (made from the adapter) when an adapter was merged, the f16 GGUF
    as made from the checkpoint it was converted from, and each quantized GGUF as made from the f16
    one. An artifact whose metadata was edited is recorded with the edited file's sha256 and path and
    its ``edit_lineage`` (sha256 before the edits, the edits applied) as the record's ``lineage``. A
    projector (``mmproj``) is recorded as made from the checkpoint, its lineage naming its role, the text
    GGUFs it serves with and the vision tower's digest (``hf_dir``'s, or the merged one's); each text GGUF's
    lineage names the projector's ``mmproj_sha256`` and path.
    The lifecycle's package stages and the standalone ``package`` flow both record this way.

    Args:
        store: the ledger.
        artifacts: :func:`package`'s result (``{"f16": ..., "<QTYPE>": ...}``).
        hf_sha256: ``sha256_tree`` of the HF checkpoint given to :func:`package` (the base).
        out_dir: :func:`package`'s ``out_dir``.
        adapter_sha256: the merged adapter's digest, or None when nothing was merged.
        run_id: the Prefect flow run id.
        hf_dir: the checkpoint folder (for the vision tower digest of a projector); None: not recorded.

    Returns:
        The digest the f16 GGUF is recorded as made from: ``hf_sha256`` without an adapter, else the
        merged checkpoint's ``sha256_tree`` (the adapter's digest if no merged folder is there).

    Raises:
        InputError: a digest is already recorded with another kind or quantization.
    """
    source_sha = hf_sha256
    if adapter_sha256 is not None:
        merged = Path(out_dir) / "merged"
        source_sha = adapter_sha256
        if (merged / "config.json").is_file():  # the merged checkpoint the GGUFs came from
            source_sha = sha256_tree(merged)
            store.record_model_artifact(records.ModelArtifactRecord(
                sha256=source_sha, kind="merged", path=str(merged), parent_sha256=adapter_sha256, run_id=run_id))
    projector = artifacts.get(mmproj.MMPROJ_KEY)
    for qtype, art in artifacts.items():
        from_source = qtype in ("f16", mmproj.MMPROJ_KEY) or "f16" not in artifacts
        parent = source_sha if from_source else artifacts["f16"].sha256
        lineage = dict(art.edit_lineage)
        if projector is not None and qtype == mmproj.MMPROJ_KEY:
            source_dir = Path(out_dir) / "merged" if adapter_sha256 is not None else hf_dir
            vision = vl_model.vision_tower_sha256(source_dir) if source_dir else None
            lineage.update(role=mmproj.MMPROJ_KEY, vision_sha256=vision,
                           serves_with={k: a.sha256 for k, a in artifacts.items() if a is not art})
        elif projector is not None:  # a text GGUF that serves with this projector only
            lineage.update(mmproj_sha256=projector.sha256, mmproj_path=str(projector.path))
        store.record_model_artifact(records.ModelArtifactRecord(sha256=art.sha256, kind="gguf", path=str(art.path),
                                    quantization=qtype, parent_sha256=parent, run_id=run_id, lineage=lineage))
    return source_sha


def load_model_store(block_name: str) -> ModelStore:
    """Load the ModelStore block ``block_name`` and check its kind's fields (preflight; no token read).

    Raises:
        InputError: no such block, or its fields do not fit its kind.
    """
    return load_block(ModelStore, block_name, "model store").validate_kind()


@task(cache_policy=NO_CACHE, task_run_name="model-store-{block_name}")
def model_store_preflight(block_name: str) -> str:
    """Before any compute of a publishing flow: the ModelStore block ``block_name`` is saved and its
    fields fit its kind (:func:`load_model_store`; no token read). Not cached: a block can be saved
    again between runs.

    Returns:
        The block's kind (``local`` or ``hf_hub``).

    Raises:
        InputError: no such block, or its fields do not fit its kind.
    """
    return load_model_store(block_name).kind


@task(cache_policy=RESUMABLE)
def check_release(gguf_path: Path, gguf_sha256: str, hf_dir: Path, hf_sha256: str,
                  edited: dict[str, Any] | None = None) -> gguf.GGUFCheck:
    """:func:`forgeflow.packaging.gguf.check_gguf` of a GGUF against the checkpoint it was made from;
    keys in ``edited`` (the metadata edits the store records for it,
    :func:`forgeflow.packaging.gguf_metadata.recorded_edited_values`) against those values.

    Cached on the two digests (with the paths and this task's source): the check of the same bytes
    against the same checkpoint gives the same answer, so publishing one GGUF to a second store does
    not read its 150k-token vocabulary again. A failed check (GGUFError) is never cached.
    """
    return gguf.check_gguf(gguf_path, hf_dir, edited=edited)


# Publishing is a side effect, never answered from a cache: a local re-publish is a no-op that
# returns the stored record, and a Hub re-publish of identical files makes no commit.
@io_task()
def publish_gguf(store_block: str, gguf_path: Path, gguf_sha256: str, quantization: str, name: str,
                 sources: ReleaseSources, tensor_types: dict[str, str] | None = None,
                 run_id: str = "") -> publishing.PublishRecord:
    """Write ``<gguf stem>.lineage.json`` beside the GGUF and publish both to the store ``store_block``,
    with the adapter merged into it and, if ``sources.checkpoint_dir``, the checkpoint it was
    converted from.

    Args:
        store_block: name of a saved :class:`~blocks.core.ModelStore` block.
        gguf_path: the checked GGUF.
        gguf_sha256: its sha256 when it was checked (the file must still have it).
        quantization: its tensor type.
        name: the model name (local store folder; one path component).
        sources: what it was made from (:class:`forgeflow.packaging.release.ReleaseSources`): the
            checkpoint's digest, the merged adapter (its lineage goes into the JSON and its files
            under ``adapter/``) and the checkpoint folder to carry (under ``checkpoint/``).
        tensor_types: per-tensor overrides of a mixed quantization.
        run_id: the packaging flow run id (recorded in the JSON).

    Returns:
        The verified :class:`~forgeflow.packaging.publish.PublishRecord` (no credential in it).

    Raises:
        InputError: the block is missing or inconsistent, the Secret is missing, bad arguments.
        DigestMismatchError: the GGUF changed since it was checked; PublishDigestMismatchError: the
            store holds other bytes than the local files after publishing.
        StaleParentCommitError, ModelStoreError, ModelStoreUnavailableError: see
            :func:`forgeflow.packaging.publish.publish_hub`.
    """
    logger = get_run_logger()
    store = load_model_store(store_block)
    metadata_path = metadata_path_for(gguf_path)
    adapter_dir, checkpoint_dir = sources.adapter_dir, sources.checkpoint_dir
    write_release_metadata(gguf_path, gguf_sha256, quantization, sources.hf_sha256, metadata_path,
                           adapter_dir=adapter_dir, tensor_types=tensor_types, run_id=run_id,
                           mmproj_path=sources.mmproj_path)
    if store.kind == "local":
        logger.info("publishing %s (sha256 %s) to local store %s as %r", Path(gguf_path).name,
                    gguf_sha256[:12], store.path, name)
        record = publishing.publish_local(gguf_path, metadata_path, store.path, name, adapter_dir=adapter_dir,
                                          checkpoint_dir=checkpoint_dir, mmproj_path=sources.mmproj_path)
    else:
        logger.info("publishing %s (sha256 %s) to %s/%s@%s (token from Secret block %r)", Path(gguf_path).name,
                    gguf_sha256[:12], store.endpoint, store.repo_id, store.revision, store.token_secret)
        hub = publishing.HubTarget(repo_id=store.repo_id, endpoint=store.endpoint, revision=store.revision,
                                   private=store.private, transfer=store.transfer)
        record = publishing.publish_hub(gguf_path, metadata_path, hub, token=store.hub_token(),
                                        adapter_dir=adapter_dir, checkpoint_dir=checkpoint_dir,
                                        mmproj_path=sources.mmproj_path)
    logger.info("published to %s at revision %s (parent %s); sha256 and size verified", record.location,
                record.revision, record.parent_revision)
    table_artifact("publish", [
        {"file": f.path_in_store, "role": f.role, "sha256": f.sha256, "size_bytes": f.size_bytes,
         "store": record.backend, "location": record.location, "revision": record.revision}
        for f in record.files
    ], f"Published {Path(gguf_path).name} to model store block {store_block!r}")
    return record
