"""The metadata JSON that travels with a released GGUF (``<gguf stem>.lineage.json``): what it is and
where it comes from, so ``sha256(GGUF)`` leads back to the base model.
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
    """What a GGUF was made from, as its release names (and optionally carries) it."""

    model_config = ConfigDict(frozen=True)

    hf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
        description="sha256_tree of the HF checkpoint folder the GGUF was converted from")
    adapter_dir: Path | None = Field(None,
        description="the LoRA adapter merged into it (lineage in the JSON, files under adapter/), or None")
    checkpoint_dir: Path | None = Field(None,
        description="that checkpoint folder when the release carries it (under checkpoint/), else None")
    mmproj_path: Path | None = Field(None,
        description="the vision projector GGUF the model is served with, else None (text-only)")


class ReleaseMetadata(BaseModel):
    """The lineage/metadata of one released GGUF (holds no credential)."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = RELEASE_SCHEMA_VERSION
    gguf_file: str = Field(min_length=1)
    gguf_sha256: str = Field(min_length=64, max_length=64, description="hex sha256 of the GGUF's bytes")
    gguf_size_bytes: int = Field(ge=1)
    quantization: str = Field(description="its tensor type (Q8_0, Q4_K_M, F16, <preset>+mixed, ...)")
    tensor_types: dict[str, str] | None = Field(None,
        description="per-tensor overrides of a mixed quantization (regex -> ggml type), or None")
    hf_sha256: str = Field(min_length=64, max_length=64,
        description="sha256_tree of the HF checkpoint it was converted from (the merged one after a merge)")
    adapter_sha256: str | None = Field(None,
        description="adapter_sha256 of the merged LoRA adapter, or None (base model only)")
    adapter_lineage: dict[str, Any] | None = Field(None, description="the adapter's lineage.json record")
    mmproj_file: str | None = Field(None,
        description="file name of the vision projector GGUF served with it, or None (text-only)")
    mmproj_sha256: str | None = Field(None, min_length=64, max_length=64,
        description="hex sha256 of that projector, or None")
    run_id: str = Field("", description="the Prefect flow run that packaged it (empty outside a run)")
    created_at: datetime = Field(description="UTC time this metadata was written")


def write_release_metadata(
    gguf_path: Path, gguf_sha256: str, quantization: str, hf_sha256: str, out_path: Path, *,
    adapter_dir: Path | None = None, tensor_types: dict[str, str] | None = None, run_id: str = "",
    mmproj_path: Path | None = None,
) -> ReleaseMetadata:
    """Write the release metadata JSON of a packaged GGUF (atomically) and return it.

    The GGUF is hashed again and must still have ``gguf_sha256`` (the digest the package stage checked).

    Args:
        adapter_dir: the merged adapter folder (its ``lineage.json`` is read and re-digested).
        mmproj_path: the vision projector GGUF served with it (name and sha256 recorded), or None.

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
