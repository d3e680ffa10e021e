"""Prefect tasks of packaging: the base model (the tiny one, a local folder or a Hub repository),
merge/convert/quantize into GGUFs and their store records, the release check and publishing to a model store."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from blocks.core import ModelStore, secret_token
from forgeflow.common import settings
from forgeflow.common.errors import InputError, PreflightError
from forgeflow.common.fsutil import JSONObject, sha256_file, sha256_tree
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
    shared_store,
    table_artifact,
)


@task(cache_policy=RESUMABLE)
def base_model(out_dir: Path, seed: int) -> tuple[model.ModelRecord, model.TokenizerCheck]:
    """Build the tiny Qwen2-shaped model with the real Qwen2 tokenizer, first checked against llama.cpp's
    tokenizer test vectors (a mismatch: PreflightError, no model built)."""
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
    """Before any compute: the base checkpoint ``source`` names can be had (and its Secret block read); the Hub
    commit, or None. InputError names what is missing."""
    return checkpoint.preflight_source(source, _hub_token(source))


@io_task()
def base_checkpoint(source: checkpoint.BaseModelSource, hub_dir: Path) -> checkpoint.CheckpointRecord:
    """The base checkpoint, checked: a local folder in place, a Hub repository fetched (into ``hub_dir``) at the commit
    its revision names now, or ``tiny-vl`` built in ``hub_dir/../base-vl``. Not cached: the record's digest and commit
    say what this run used. Raises InputError: the tiny source (use :func:`base_model`), a missing Secret block, a
    checkpoint that fails :func:`forgeflow.packaging.checkpoint.check_checkpoint`; TransientInfraError: the Hub did not
    answer after the retries."""
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
    """Merge (with an adapter) -> convert to GGUF f16 -> quantize -> check -> load [-> metadata edits -> verify -> check
    -> load]. An image-text-to-text checkpoint also yields its vision projector (``mmproj``), checked tensor by tensor
    against the vision tower. Returns ``{"f16": ..., "<QuantSpec.key>": ..., ["mmproj": ...]}``, each checked against
    the HF config and loaded. Raises InputError: an unknown plan name or preset, repeated artifact keys, an invalid edit
    (before any compute); GGUFError: a check failed, or an edit does not fit the file (a set/delete of an absent key, an
    add of a present one, a value that does not fit the stored type)."""
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
    """Apply ``edits`` to a checked artifact in place, check and load it; the edited artifact."""
    logger = get_run_logger()
    result = metadata.apply_metadata_edits(artifact.path, edits)
    gguf.check_gguf(artifact.path, hf_dir, edited={e.key: e.value for e in result.edits if e.op != "delete"})
    gguf.load_gguf(artifact.path)
    edited = artifact.model_copy(update={"sha256": sha256_file(artifact.path), "size_bytes": result.size_bytes,
                                         "edit_lineage": metadata.edit_lineage(result, artifact.sha256)})
    logger.info("edited the metadata of %s (%s; %s verification, %.2f s): sha256 %s -> %s", artifact.path.name,
                ", ".join(f"{e.op} {e.key}" for e in result.edits), result.verification, result.duration_s,
                artifact.sha256[:12], edited.sha256[:12])
    return edited


class PackageInputs(BaseModel):
    """The digests of what the ``package`` flow packages: ``adapter_sha256`` names the adapter (its lineage's),
    ``adapter_tree_sha256`` covers its every file (the package task's cache key)."""

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
    """``sha256_tree`` of the checkpoint folder ``hf_dir`` as it is now (a folder's files can change)."""
    return sha256_tree(hf_dir)


class ReleaseInputs(BaseModel):
    """What the ``publish`` flow checks a release against (:func:`release_inputs`): ``edited`` maps the keys the store
    records metadata edits set to their values (a GGUF the store does not know is not cross-checked: a warning says
    so)."""

    model_config = ConfigDict(frozen=True)

    gguf_sha256: str
    hf_sha256: str
    edited: JSONObject = {}


@io_task()
def release_inputs(gguf_path: Path, hf_dir: Path, adapter_dir: Path | None) -> ReleaseInputs:
    """Before a release is written: the files exist, their digests now, and what the store (``settings.store_url()``)
    records of the GGUF: a chain converted from ``hf_dir`` (and ``adapter_dir``), and the metadata edits a ``package``
    run set. Raises InputError: a path is not a file/folder (named as the ``publish`` flow's ``params`` field), or not
    what the store records the GGUF was converted from."""
    from forgeflow.packaging.lineage import check_release_sources

    if not Path(gguf_path).is_file():
        raise InputError(f"params.gguf_path {str(gguf_path)!r} is not a file")
    if not Path(hf_dir).is_dir():
        raise InputError(f"params.hf_dir {str(hf_dir)!r} is not a folder")
    if adapter_dir is not None and not Path(adapter_dir).is_dir():
        raise InputError(f"params.adapter_dir {str(adapter_dir)!r} is not a folder")
    gguf_sha, hf_sha = sha256_file(gguf_path), sha256_tree(hf_dir)
    store = shared_store(settings.store_url())
    known = check_release_sources(store, gguf_sha, hf_sha, Path(hf_dir), adapter_dir) is not None
    if not known:
        get_run_logger().warning("the store (%s) does not know GGUF %s: its lineage (hf_dir %s, adapter_dir %s) "
                                 "could not be cross-checked", store.display_url, gguf_sha, hf_dir, adapter_dir)
    edited = metadata.recorded_edited_values(store, gguf_sha)  # keys the package run's metadata edits set
    return ReleaseInputs(gguf_sha256=gguf_sha, hf_sha256=hf_sha, edited=edited)


@io_task()
def record_packaged(artifacts: dict[str, gguf.GGUFArtifact], hf_dir: Path, adapter_dir: Path | None,
                    inputs: PackageInputs, out_dir: Path, run_id: str | None) -> None:
    """Record a ``package`` run in the store (``settings.store_url()``): the checkpoint (a ``base`` root) and the
    adapter when the store has not seen them, then the artifacts (:func:`record_package`). Raises InputError: a digest
    is already recorded with another kind or quantization."""
    store = shared_store(settings.store_url())
    if not store.producers(inputs.hf_sha256):  # a base checkpoint the store has not seen: a root
        store.record_model_artifact(records.ModelArtifactRecord(sha256=inputs.hf_sha256, kind="base",
                                                               path=str(hf_dir), run_id=run_id))
    if adapter_dir and inputs.adapter_sha256 and not store.producers(inputs.adapter_sha256):
        store.record_model_artifact(records.ModelArtifactRecord(
            sha256=inputs.adapter_sha256, kind="adapter", path=str(adapter_dir), parent_sha256=inputs.hf_sha256,
            run_id=run_id))
    record_package(store, artifacts, inputs.hf_sha256, Path(out_dir), inputs.adapter_sha256, run_id, Path(hf_dir))


def record_package(store: ledger.Store, artifacts: dict[str, gguf.GGUFArtifact], hf_sha256: str, out_dir: Path,
                   adapter_sha256: str | None, run_id: str | None, hf_dir: Path | None = None) -> str:
    """Record what :func:`package` made, each with ``run_id``: the merged checkpoint ``out_dir/merged`` (from the
    adapter), the f16 GGUF (from the checkpoint), each quantized GGUF (from the f16), an edited one with its
    ``edit_lineage``; a projector (from the checkpoint) naming its role, the text GGUFs and the vision tower's digest
    (``hf_dir``'s), each text GGUF naming the projector. Returns the digest the f16 GGUF is recorded as made from:
    ``hf_sha256`` without an adapter, else the merged checkpoint's ``sha256_tree`` (the adapter's digest if no merged
    folder is there). Raises InputError: a digest is already recorded with another kind or quantization."""
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
    """The ModelStore block ``block_name``, its kind's fields checked (no token read). Raises InputError: no such block,
    or its fields do not fit its kind."""
    return load_block(ModelStore, block_name, "model store").validate_kind()


@task(cache_policy=NO_CACHE, task_run_name="model-store-{block_name}")
def model_store_preflight(block_name: str) -> str:
    """Before any compute: :func:`load_model_store`; the block's kind (``local`` or ``hf_hub``). Raises InputError: no
    such block, or its fields do not fit its kind."""
    return load_model_store(block_name).kind


@task(cache_policy=RESUMABLE)
def check_release(gguf_path: Path, gguf_sha256: str, hf_dir: Path, hf_sha256: str,
                  edited: JSONObject | None = None) -> gguf.GGUFCheck:
    """:func:`forgeflow.packaging.gguf.check_gguf` of a GGUF against its checkpoint, ``edited`` keys against
    their recorded values. Cached on the digests: a second publish does not read the vocabulary again."""
    return gguf.check_gguf(gguf_path, hf_dir, edited=edited)


# Publishing is a side effect, never answered from a cache: a local re-publish is a no-op that
# returns the stored record, and a Hub re-publish of identical files makes no commit.
@io_task()
def publish_gguf(store_block: str, gguf_path: Path, gguf_sha256: str, quantization: str, name: str,
                 sources: ReleaseSources, tensor_types: dict[str, str] | None = None,
                 run_id: str = "") -> publishing.PublishRecord:
    """Write ``<gguf stem>.lineage.json`` beside the GGUF and publish both to the ModelStore block ``store_block``, with
    the merged adapter (under ``adapter/``) and ``sources.checkpoint_dir`` (under ``checkpoint/``). ``gguf_sha256`` is
    the digest the file must still have; ``name`` one path component. Returns the verified
    :class:`~forgeflow.packaging.publish.PublishRecord` (no credential in it). Raises InputError: the block is missing
    or inconsistent, the Secret is missing, bad arguments; DigestMismatchError: the GGUF changed since it was checked;
    PublishDigestMismatchError: the store holds other bytes than the local files after publishing;
    StaleParentCommitError, ModelStoreError, ModelStoreUnavailableError: see
    :func:`forgeflow.packaging.publish.publish_hub`."""
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
