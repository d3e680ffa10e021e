"""The metadata JSON that travels with a released GGUF: what it is and where it comes from.

A release is the pair a model store receives (:mod:`forgeflow.packaging.publish`): the quantized GGUF and
``<gguf stem>.lineage.json``, written here. The JSON names the GGUF by sha256 and size, the
checkpoint it was converted from (``sha256_tree`` of the HF folder), the adapter merged into it with
that adapter's own lineage (base model, parent adapter, dataset, hyper-parameters, training run),
and the run that packaged it, so ``sha256(GGUF)`` leads back to the base model through the chain.
A multimodal model's GGUF serves only with its vision projector: the JSON names the projector's file
and sha256 (``mmproj_file``, ``mmproj_sha256``) and the release carries it (role ``mmproj``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import DigestMismatchError, InputError
from forgeflow.common.fsutil import atomic_write_text, sha256_file

RELEASE_SCHEMA_VERSION = 1
"""Schema version of :class:`ReleaseMetadata`."""


class ReleaseSources(BaseModel):
    """What a GGUF was made from, as its release names (and optionally carries) it.

    Attributes:
        hf_sha256: ``sha256_tree`` of the HF checkpoint folder the GGUF was converted from.
        adapter_dir: the LoRA adapter merged into it, or None; its lineage goes into the metadata
            JSON and its files into the release (``adapter/``).
        checkpoint_dir: that checkpoint folder (the one ``hf_sha256`` was computed from), when the
            release carries it too (``checkpoint/``, each file sha256-verified on publish), else None.
        mmproj_path: the vision projector GGUF the model is served with (a package run of an
            image-text-to-text checkpoint writes it: its ``mmproj`` artifact), else None (text-only).
    """

    model_config = ConfigDict(frozen=True)

    hf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    adapter_dir: Path | None = None
    checkpoint_dir: Path | None = None
    mmproj_path: Path | None = None


class ReleaseMetadata(BaseModel):
    """The lineage/metadata of one released GGUF (holds no credential).

    Attributes:
        schema_version: :data:`RELEASE_SCHEMA_VERSION`.
        gguf_file: file name of the GGUF.
        gguf_sha256: hex sha256 of its bytes (64 characters).
        gguf_size_bytes: its size.
        quantization: its tensor type (``Q8_0``, ``Q4_K_M``, ``F16``, ``<preset>+mixed``...).
        tensor_types: per-tensor overrides of a mixed quantization (regex -> ggml type), or None.
        hf_sha256: ``sha256_tree`` of the HF checkpoint folder the GGUF was converted from (the merged
            checkpoint when an adapter was merged; the adapter's lineage names the base model).
        adapter_sha256: ``adapter_sha256`` of the merged LoRA adapter, or None (base model only).
        adapter_lineage: the adapter's ``lineage.json`` record (see :class:`forgeflow.training.burst.Lineage`).
        mmproj_file: file name of the vision projector GGUF served with it, or None (text-only).
        mmproj_sha256: hex sha256 of that projector's bytes, or None.
        run_id: the Prefect flow run that packaged/published it ("" outside a run).
        created_at: UTC time this metadata was written.
    """

    model_config = ConfigDict(frozen=True)

    schema_version: int = RELEASE_SCHEMA_VERSION
    gguf_file: str = Field(min_length=1)
    gguf_sha256: str = Field(min_length=64, max_length=64)
    gguf_size_bytes: int = Field(ge=1)
    quantization: str
    tensor_types: dict[str, str] | None = None
    hf_sha256: str = Field(min_length=64, max_length=64)
    adapter_sha256: str | None = None
    adapter_lineage: dict[str, Any] | None = None
    mmproj_file: str | None = None
    mmproj_sha256: str | None = Field(None, min_length=64, max_length=64)
    run_id: str = ""
    created_at: datetime


def write_release_metadata(
    gguf_path: Path, gguf_sha256: str, quantization: str, hf_sha256: str, out_path: Path, *,
    adapter_dir: Path | None = None, tensor_types: dict[str, str] | None = None, run_id: str = "",
    mmproj_path: Path | None = None,
) -> ReleaseMetadata:
    """Write the release metadata JSON of a packaged GGUF (atomically) and return it.

    The GGUF's bytes are hashed again and must equal ``gguf_sha256`` (the digest of the file the
    package stage checked): a file changed since then is never described as the checked one.

    Args:
        gguf_path: the GGUF file.
        gguf_sha256: its sha256 as recorded when it was checked.
        quantization: its tensor type (``GGUFArtifact.type``).
        hf_sha256: ``sha256_tree`` of the HF checkpoint the GGUF was converted from.
        out_path: where the JSON goes (``<gguf stem>.lineage.json`` by convention).
        adapter_dir: the merged adapter folder (its ``lineage.json`` is read and re-digested).
        tensor_types: per-tensor overrides of a mixed quantization.
        run_id: the Prefect run id.
        mmproj_path: the vision projector GGUF served with it (its name and sha256 are recorded), or None.

    Returns:
        The :class:`ReleaseMetadata` written.

    Raises:
        GGUFError / InputError: the GGUF, projector or adapter is missing (or not a GGUF); the adapter's
            ``lineage.json`` is missing or does not match its files.
        DigestMismatchError: the GGUF's bytes no longer have ``gguf_sha256`` (both digests named).
    """
    from forgeflow.packaging.gguf_reader import read_header_index
    from forgeflow.training.adapters import read_adapter_record

    gguf_path = Path(gguf_path)
    read_header_index(gguf_path)  # GGUFError: missing, not GGUF, truncated
    found = sha256_file(gguf_path)
    if found != gguf_sha256:
        raise DigestMismatchError(
            f"GGUF {gguf_path}: expected sha256 {gguf_sha256} (the checked file), found {found}"
        )
    adapter_sha, adapter_lineage = None, None
    if adapter_dir is not None:
        if not Path(adapter_dir).is_dir():
            raise InputError(f"adapter_dir {adapter_dir} is not a folder")
        record = read_adapter_record(Path(adapter_dir))
        adapter_sha, adapter_lineage = record.sha256, record.lineage.model_dump(mode="json")
    if mmproj_path is not None:
        read_header_index(Path(mmproj_path))  # GGUFError: missing or not a GGUF
    metadata = ReleaseMetadata(
        gguf_file=gguf_path.name, gguf_sha256=found, gguf_size_bytes=gguf_path.stat().st_size,
        quantization=quantization, tensor_types=tensor_types, hf_sha256=hf_sha256,
        adapter_sha256=adapter_sha, adapter_lineage=adapter_lineage, run_id=run_id,
        mmproj_file=Path(mmproj_path).name if mmproj_path else None,
        mmproj_sha256=sha256_file(mmproj_path) if mmproj_path else None,
        created_at=datetime.now(timezone.utc),
    )
    atomic_write_text(out_path, metadata.model_dump_json(indent=2) + "\n")
    return metadata


def metadata_path_for(gguf_path: Path) -> Path:
    """The conventional metadata file beside a GGUF: ``<stem>.lineage.json``."""
    gguf_path = Path(gguf_path)
    return gguf_path.with_name(f"{gguf_path.stem}.lineage.json")
