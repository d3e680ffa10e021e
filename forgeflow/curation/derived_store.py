"""Derived sets on disk: written once with their digests, replaced only on request, verified against their sources."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import forgeflow
from forgeflow.common.errors import DerivedSetConflictError, InputError
from forgeflow.common.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    read_digested_json,
    sha256_bytes,
    with_semantic_digest,
)
from forgeflow.curation.derived import (
    SCHEMA_VERSION,
    DerivedSet,
    InputDigest,
    SourceSet,
    derive,
    frozen_split_sets,
    id_list_set,
    store_images_available_set,
    store_status_set,
)


# --- storage -----------------------------------------------------------------------------------
def _document(derived: DerivedSet) -> dict[str, Any]:
    document: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        **derived.model_dump(mode="json"),
        "count": derived.count,
        "forgeflow_version": forgeflow.__version__,
    }
    return with_semantic_digest(document)


REPLACED_DIR = "replaced"
"""Folder under a derived sets' folder where ``replace=True`` keeps each replaced file, as
``<name>.<file sha256[:16]>.json`` (readable with :func:`read_derived` / :func:`verify_derived`)."""


class DerivedWrite(BaseModel):
    """What :func:`save_derived` did."""

    model_config = ConfigDict(frozen=True)

    path: Path
    written: bool = Field(description="False when the file already held the same content")
    previous: DerivedSet | None = Field(None,
        description="the set the file held before, when replaced and still readable")
    previous_path: Path | None = Field(None, description="where the replaced file was kept")


def _differences(old: DerivedSet, new: DerivedSet) -> str:
    parts = []
    if old.ids != new.ids:
        parts.append(f"ids ({len(set(new.ids) - set(old.ids))} added, {len(set(old.ids) - set(new.ids))} removed)")
    if old.definitions != new.definitions:
        parts.append("definitions")
    changed = sorted(k for k in old.inputs.keys() | new.inputs.keys() if old.inputs.get(k) != new.inputs.get(k))
    if changed:
        parts.append("inputs " + ", ".join(repr(k) for k in changed))
    if old.split_counts != new.split_counts:
        parts.append("split counts")
    return ", ".join(parts) or "recorded fields"


def save_derived(derived: DerivedSet, out_dir: str | Path, *, replace: bool = False) -> DerivedWrite:
    """Write ``out_dir/<name>.json`` atomically, never silently overwriting other content.

    The document holds the :class:`DerivedSet` fields and a ``semantic_sha256`` of the rest. The same
    set again is a no-op; other content is refused unless ``replace``, which first keeps the old file
    under :data:`REPLACED_DIR`.

    Raises:
        DerivedSetConflictError: the file exists with other content (or cannot be read) and
            ``replace`` is False; the message names the file, both counts and ids sha256 and what
            differs. Nothing is written.
        DiskFullError: the filesystem is full (the previous file is left as it was).
    """
    path = Path(out_dir) / f"{derived.name}.json"
    previous: DerivedSet | None = None
    if path.exists():
        try:
            previous = read_derived(path)
        except InputError as exc:
            if not replace:
                raise DerivedSetConflictError(
                    f"derived set {derived.name!r}: {path} exists but cannot be read ({exc}); pass "
                    f"--replace (replace=True) to replace it (the file is kept under {path.parent / REPLACED_DIR})"
                ) from exc
        if previous == derived:
            return DerivedWrite(path=path, written=False, previous=previous)
        if previous is not None and not replace:
            raise DerivedSetConflictError(
                f"derived set {derived.name!r} already exists at {path} with {previous.count} ids, ids sha256 "
                f"{previous.ids_sha256}; the rebuild has {derived.count} ids, ids sha256 {derived.ids_sha256} "
                f"(differs in {_differences(previous, derived)}). Pass --replace (replace=True) to replace it "
                f"(the previous file is kept under {path.parent / REPLACED_DIR}), or build under a new name."
            )
        data = path.read_bytes()
        kept = atomic_write_bytes(path.parent / REPLACED_DIR / f"{derived.name}.{sha256_bytes(data)[:16]}.json", data)
        atomic_write_json(path, _document(derived))
        return DerivedWrite(path=path, written=True, previous=previous, previous_path=kept)
    atomic_write_json(path, _document(derived))
    return DerivedWrite(path=path, written=True)


def read_derived(path: str | Path) -> DerivedSet:
    """Read a derived-set file and check its embedded ``semantic_sha256`` (no rebuild).

    Raises:
        InputError: missing file, not JSON, unknown schema version, or altered content.
    """
    document = read_digested_json(path, "derived set", SCHEMA_VERSION)
    fields = {k: v for k, v in document.items() if k in DerivedSet.model_fields}
    return DerivedSet.model_validate(fields)


def _reload(name: str, recorded: InputDigest, store: Any) -> SourceSet:
    provenance = recorded.provenance
    if recorded.kind == "store_status":
        if store is None:
            raise InputError(f"input {name!r} comes from the store: pass store= to verify it")
        return store_status_set(name, store, provenance["status"])
    if recorded.kind == "store_images":
        if store is None:
            raise InputError(f"input {name!r} comes from the store: pass store= to verify it")
        return store_images_available_set(name, store)
    if recorded.kind == "frozen_split":
        sets = frozen_split_sets(provenance["manifest_path"], prefix="_")
        key = "_" if provenance["split"] is None else f"_.{provenance['split']}"
        if key not in sets:
            raise InputError(
                f"input {name!r}: split {provenance['split']!r} is no longer in "
                f"{provenance['manifest_path']}"
            )
        return sets[key].model_copy(update={"name": name})
    if recorded.kind == "id_list":
        source = provenance.get("path", provenance.get("ids", []))
        return id_list_set(name, source, provenance["source_revision"])
    raise InputError(f"input {name!r} is an explicit set: pass it in inputs= to verify it")


def verify_derived(
    path: str | Path,
    *,
    store: Any = None,
    inputs: Iterable[SourceSet] | Mapping[str, SourceSet] | None = None,
) -> DerivedSet:
    """Rebuild a saved derived set from its sources and check every digest.

    Each input is loaded again from its provenance, or taken from ``inputs`` (required for explicit sets).

    Raises:
        InputError: the file is altered; an input cannot be loaded; an input's ids changed (each
            changed input named with both digests and counts); or the rebuilt ids differ.
    """
    stored = read_derived(path)
    given: dict[str, SourceSet] = {}
    if inputs is not None:
        given = {s.name: s for s in (inputs.values() if isinstance(inputs, Mapping) else inputs)}
    current: dict[str, SourceSet] = {}
    changed: list[str] = []
    for name, recorded in stored.inputs.items():
        source = given.get(name) or _reload(name, recorded, store)
        current[name] = source
        if source.sha256 != recorded.ids_sha256:
            changed.append(
                f"{name!r} ({recorded.kind}): recorded {recorded.count} ids sha256 "
                f"{recorded.ids_sha256}, now {len(source.ids)} ids sha256 {source.sha256}"
            )
    if changed:
        raise InputError(
            f"derived set {stored.name!r} ({path}): inputs changed: " + "; ".join(changed)
        )
    rebuilt = derive(stored.definitions, current)[stored.name]
    if rebuilt.ids_sha256 != stored.ids_sha256:
        raise InputError(
            f"derived set {stored.name!r} ({path}): rebuilt ids sha256 {rebuilt.ids_sha256} "
            f"differs from the stored {stored.ids_sha256}"
        )
    return stored
