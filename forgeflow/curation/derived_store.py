"""Derived sets on disk: written once with their digests, refused or replaced (the old kept), read
back and verified against their sources (:mod:`forgeflow.curation.derived` defines and evaluates
them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

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
    """What :func:`save_derived` did.

    Attributes:
        path: ``out_dir/<name>.json``.
        written: False when the file already held the same content (an identical rebuild).
        previous: The set the file held before, when it was replaced and still readable.
        previous_path: Where the replaced file was kept, when one was replaced.
    """

    model_config = ConfigDict(frozen=True)

    path: Path
    written: bool
    previous: DerivedSet | None = None
    previous_path: Path | None = None


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

    The document holds ``schema_version``, the :class:`DerivedSet` fields, ``count``,
    ``forgeflow_version`` and ``semantic_sha256`` (sha256 of the canonical JSON of everything
    else). When the file exists: the same set (ids, definitions, inputs and split counts; the
    forgeflow version aside) is a no-op; different content is refused unless ``replace``, and a
    replaced file is first kept under ``out_dir/replaced/`` (:data:`REPLACED_DIR`).

    Args:
        derived: The set to write.
        out_dir: The derived sets' folder (created if missing).
        replace: Replace a file of this name with different (or unreadable) content.

    Returns:
        What was done (:class:`DerivedWrite`).

    Raises:
        DerivedSetConflictError: the file exists with other content (or cannot be read) and
            ``replace`` is False; the message names the file, what it holds (count and ids
            sha256), what the rebuild holds and what differs. Nothing is written.
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


def write_derived(derived: DerivedSet, out_dir: str | Path, *, replace: bool = False) -> Path:
    """:func:`save_derived`, returning only the path of ``out_dir/<name>.json``.

    Raises:
        DerivedSetConflictError: as :func:`save_derived` (other content exists, no ``replace``).
    """
    return save_derived(derived, out_dir, replace=replace).path


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
    """Rebuild a written derived set from its sources and check every digest.

    Each input is loaded again from its provenance (the store, the frozen manifest — whose own
    digests :func:`~forgeflow.curation.freeze.verify_freeze` checks —, the id-list file), or taken from
    ``inputs`` when given there (required for explicit sets). Then the definitions are evaluated
    again and the result compared with the stored ids.

    Args:
        path: The file written by :func:`write_derived`.
        store: The :class:`forgeflow.ledger.store.Store` for store-backed inputs.
        inputs: Source sets overriding or supplying inputs by name.

    Returns:
        The verified set.

    Raises:
        InputError: the file is altered (:func:`read_derived`); an input cannot be loaded;
            an input's ids changed (the message names each changed input with both digests and
            counts); or the rebuilt ids differ from the stored ones.
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
