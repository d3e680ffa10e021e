"""Prefect task of the release step: publish a checked GGUF and its lineage JSON to a model store.

The store is a :class:`blocks.core.ModelStore` block, loaded by name when the task runs. For the
HF Hub the write token is read from the Secret block the store names only inside the task, right
before :func:`forgeflow.publish.publish_hub` needs it: it is never a task or flow parameter (so not
in Prefect's run records), never logged, and never in the returned record or the artifact.
Transient store failures (Hub 429/5xx, connection errors: ``ModelStoreUnavailableError``) are
retried; a refused request, a stale parent commit or a digest mismatch ends the task at once.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from blocks.core import ModelStore
from forgeflow import gguf, publish as publishing
from forgeflow.release import metadata_path_for, write_release_metadata
from tasks.common import RESUMABLE, TRANSIENT_RETRIES, TRANSIENT_RETRY_DELAYS_S, retry_on_transient, table_artifact


def load_model_store(block_name: str) -> ModelStore:
    """Load the ModelStore block ``block_name`` and check its kind's fields (preflight; no token read).

    Raises:
        InputError: no such block, or its fields do not fit its kind.
    """
    from forgeflow.errors import InputError

    try:
        store = ModelStore.load(block_name)
    except ValueError as exc:  # Prefect: "Unable to find block document named ..."
        raise InputError(f"model store block {block_name!r} does not exist: {exc}") from exc
    return store.validate_kind()


@task(cache_policy=RESUMABLE)
def check_release(gguf_path: Path, gguf_sha256: str, hf_dir: Path, hf_sha256: str) -> gguf.GGUFCheck:
    """:func:`forgeflow.gguf.check_gguf` of a GGUF against the checkpoint it was made from.

    Cached on the two digests (with the paths and this task's source): the check of the same bytes
    against the same checkpoint gives the same answer, so publishing one GGUF to a second store does
    not read its 150k-token vocabulary again. A failed check (GGUFError) is never cached.
    """
    return gguf.check_gguf(gguf_path, hf_dir)


# Publishing is a side effect, never answered from a cache: a local re-publish is a no-op that
# returns the stored record, and a Hub re-publish of identical files makes no commit.
@task(cache_policy=NO_CACHE, retries=TRANSIENT_RETRIES, retry_delay_seconds=TRANSIENT_RETRY_DELAYS_S,
      retry_condition_fn=retry_on_transient)
def publish_gguf(store_block: str, gguf_path: Path, gguf_sha256: str, quantization: str, hf_sha256: str,
                 name: str, adapter_dir: Path | None = None, tensor_types: dict[str, str] | None = None,
                 run_id: str = "") -> publishing.PublishRecord:
    """Write ``<gguf stem>.lineage.json`` beside the GGUF and publish both to the store ``store_block``.

    Args:
        store_block: name of a saved :class:`~blocks.core.ModelStore` block.
        gguf_path: the checked GGUF.
        gguf_sha256: its sha256 when it was checked (the file must still have it).
        quantization: its tensor type.
        hf_sha256: ``sha256_tree`` of the HF checkpoint it was converted from.
        name: the model name (local store folder; one path component).
        adapter_dir: the adapter merged into it (its lineage goes into the JSON), or None.
        tensor_types: per-tensor overrides of a mixed quantization.
        run_id: the packaging flow run id (recorded in the JSON).

    Returns:
        The verified :class:`~forgeflow.publish.PublishRecord` (no credential in it).

    Raises:
        InputError: the block is missing or inconsistent, the Secret is missing, bad arguments.
        DigestMismatchError: the GGUF changed since it was checked; PublishDigestMismatchError: the
            store holds other bytes than the local files after publishing.
        StaleParentCommitError, ModelStoreError, ModelStoreUnavailableError: see
            :func:`forgeflow.publish.publish_hub`.
    """
    logger = get_run_logger()
    store = load_model_store(store_block)
    metadata_path = metadata_path_for(gguf_path)
    write_release_metadata(gguf_path, gguf_sha256, quantization, hf_sha256, metadata_path,
                           adapter_dir=adapter_dir, tensor_types=tensor_types, run_id=run_id)
    if store.kind == "local":
        logger.info("publishing %s (sha256 %s) to local store %s as %r", Path(gguf_path).name,
                    gguf_sha256[:12], store.path, name)
        record = publishing.publish_local(gguf_path, metadata_path, store.path, name)
    else:
        logger.info("publishing %s (sha256 %s) to %s/%s@%s (token from Secret block %r)", Path(gguf_path).name,
                    gguf_sha256[:12], store.endpoint, store.repo_id, store.revision, store.token_secret)
        record = publishing.publish_hub(
            gguf_path, metadata_path, repo_id=store.repo_id, token=store.hub_token(), endpoint=store.endpoint,
            revision=store.revision, private=store.private, transfer=store.transfer,  # type: ignore[arg-type]
        )
    logger.info("published to %s at revision %s (parent %s); sha256 and size verified", record.location,
                record.revision, record.parent_revision)
    table_artifact("publish", [
        {"file": f.path_in_store, "role": f.role, "sha256": f.sha256, "size_bytes": f.size_bytes,
         "store": record.backend, "location": record.location, "revision": record.revision}
        for f in record.files
    ], f"Published {Path(gguf_path).name} to model store block {store_block!r}")
    return record
