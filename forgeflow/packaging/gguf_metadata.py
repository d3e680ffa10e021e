"""Typed GGUF metadata edits (``set`` / ``add`` / ``delete``), validated before any compute and
applied to a GGUF in one bounded-memory pass, then verified: the only GGUF metadata editing API.

The new header is written by :mod:`forgeflow.packaging.gguf_edit` (untouched entries and tensor
infos copied verbatim, the data section in chunks; peak memory: ``chunk_bytes`` plus 1 MiB plus the
new entries, whatever the file size) to a temporary sibling of the target, checked by
:mod:`forgeflow.packaging.gguf_verify`, then renamed over the target: a failed check or a full disk
leaves the source untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forgeflow.common.errors import GGUFError, InputError
from forgeflow.common.fsutil import fsync_dir, raise_if_disk_full
from forgeflow.packaging.gguf_edit import (
    HEAD_BYTES,
    check_value,
    new_header_end,
    pack_entry,
    stream_edited,
)
from forgeflow.packaging.gguf_reader import (
    ARRAY_TYPE,
    DEFAULT_CHUNK_BYTES,
    HeaderIndex,
    read_header_index,
    read_metadata,
    type_name,
)
from forgeflow.packaging.gguf_verify import (
    Expected,
    MetadataSnapshot,
    VerifyMode,
    check_verify_mode,
    snapshot_metadata,
    verify_metadata_edits,
)

if TYPE_CHECKING:
    from forgeflow.ledger.store import Store

EditOp = Literal["set", "add", "delete"]
EDIT_OPS: tuple[str, ...] = ("set", "add", "delete")

PROTECTED_KEYS: tuple[str, ...] = (
    "general.architecture", "general.alignment", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
    "tokenizer.chat_template",
)
"""Keys no edit may delete: llama.cpp needs them to load the model (``general.architecture``
names every ``<arch>.*`` key, ``general.alignment`` places every tensor, the tokenizer model and
tokens build the vocabulary) or the GGUF check requires them (``tokenizer.chat_template``)."""

ARCH_KEY_SUFFIXES: tuple[str, ...] = (
    "block_count", "context_length", "embedding_length", "attention.head_count",
    "attention.head_count_kv",
)
"""``<arch>.<suffix>`` keys no edit may delete (the model's hyper-parameters llama.cpp reads)."""

_FIXED_KEYS = ("general.alignment", "general.architecture")


class MetadataEdit(BaseModel):
    """One metadata edit of the GGUFs a package run makes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: EditOp = Field(description="set (an existing key), add (a new key) or delete")
    key: str = Field(min_length=1, description="the GGUF key (general.name, tokenizer.chat_template, ...)")
    value: Any = Field(None,
        description="the new value for set/add (int, float, bool, str or a list of them); None for delete")
    type: str | None = Field(None,
        description="a GGUFValueType name; None: set keeps the stored type, add infers it as gguf-py does")
    sub_type: str | None = Field(None,
        description="the element type of an ARRAY (None: inferred from the first element)")
    artifacts: tuple[str, ...] | None = Field(None,
        description="apply only to these artifact keys (f16, Q8_0, ...); None: to all")

    def applies_to(self, artifact_key: str) -> bool:
        """True when this edit is applied to the artifact ``artifact_key``."""
        return self.artifacts is None or artifact_key in self.artifacts


class MetadataEditResult(BaseModel):
    """Outcome of :func:`apply_metadata_edits` (offsets and sizes in bytes)."""

    model_config = ConfigDict(frozen=True)

    path: Path
    edits: tuple[MetadataEdit, ...] = Field(
        description="the edits applied, in the order given, as they landed: type and sub_type the result's (a "
                    "delete: the type the key had), value read back from the result (None for a delete)")
    old_values: dict[str, Any] = Field(description="edited key -> its value before (set and delete; an add has none)")
    data_offset_before: int = Field(ge=HEAD_BYTES)
    data_offset_after: int = Field(ge=HEAD_BYTES)
    size_bytes: int = Field(ge=HEAD_BYTES)
    verification: VerifyMode = Field(description="sampled, full or none (see gguf_verify)")
    tensors_verified: int = Field(ge=0, description="tensors whose data was compared")
    duration_s: float = Field(ge=0, description="wall seconds, verification included")


# --- validation ------------------------------------------------------------------------------
def _vtype(name: str, where: str, field: str) -> int:
    from gguf import GGUFValueType

    try:
        return int(GGUFValueType[name])
    except KeyError:
        raise InputError(f"{where}: {field} {name!r} is not a GGUF value type; valid: "
                         f"{[t.name for t in GGUFValueType]}") from None


def _infer(value: Any, where: str) -> int:
    from gguf import GGUFValueType

    try:
        return int(GGUFValueType.get_type(value))
    except ValueError:
        raise InputError(f"{where}: value {value!r:.80} has no GGUF value type (int, float, bool, "
                         "str or a list of them)") from None


def _resolved_types(edit: MetadataEdit, where: str) -> tuple[int | None, int | None]:
    """(value type, element type) the edit writes; (None, None) for a ``set`` that keeps the
    stored type. Checks that the value fits. Raises InputError naming ``where``."""
    if edit.type is None and edit.op == "set":
        _check_plain(edit.value, where)
        return None, None
    vtype = _vtype(edit.type, where, "type") if edit.type else _infer(edit.value, where)
    sub = None
    if vtype == ARRAY_TYPE:
        if not isinstance(edit.value, (list, tuple)):
            raise InputError(f"{where}: type ARRAY expected a list value, found {edit.value!r:.80}")
        if edit.sub_type:
            sub = _vtype(edit.sub_type, where, "sub_type")
        elif edit.value:
            sub = _infer(edit.value[0], where)
        else:
            raise InputError(f"{where}: an empty ARRAY needs a sub_type")
        if sub == ARRAY_TYPE:
            raise InputError(f"{where}: arrays of arrays are not supported")
    elif edit.sub_type:
        raise InputError(f"{where}: sub_type is only for type ARRAY, found type {type_name(vtype)}")
    try:
        _check_entry_value(Path(where), edit.key, vtype, sub, edit.value)
    except GGUFError as exc:
        raise InputError(str(exc)) from None
    return vtype, sub


def _check_entry_value(path: Path, key: str, vtype: int, sub: int | None, value: Any) -> None:
    """Check that ``value`` fits type ``vtype`` (``sub``: the element type of an ARRAY); GGUFError naming
    ``path``, ``key``, the expected type and what was found."""
    if sub is None:
        check_value(path, key, vtype, value)
    elif not isinstance(value, (list, tuple)):
        raise GGUFError(f"{path}: key {key!r} expected an ARRAY of {type_name(sub)}, found {value!r:.80}")
    else:
        for item in value:
            check_value(path, key, sub, item, what="array element")


def _check_plain(value: Any, where: str) -> None:
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, (bool, int, float, str)):
            raise InputError(f"{where}: value {value!r:.80} expected an int, float, bool, str or a "
                             "list of them")


def _protected(key: str) -> bool:
    prefix, _, rest = key.partition(".")
    return key in PROTECTED_KEYS or (prefix not in ("general", "tokenizer") and rest in ARCH_KEY_SUFFIXES)


def validate_metadata_edits(edits: Sequence[MetadataEdit | dict[str, Any]] | None,
                            artifact_keys: Sequence[str] | None = None) -> tuple[MetadataEdit, ...]:
    """Check metadata edits (models or dicts) before any compute; return them as models, in order.

    Args:
        artifact_keys: the artifact keys the run makes; when given, ``artifacts`` must name only these.

    Raises:
        InputError: naming ``metadata_edits[i]`` and the key: an unknown op or field, an empty
            key, ``value`` given to a delete or missing from a set/add, an unknown ``type`` or
            ``sub_type``, a value that does not fit its type, a key repeated by two edits, a
            delete of a key the architecture needs (:data:`PROTECTED_KEYS`,
            ``<arch>.``:data:`ARCH_KEY_SUFFIXES`), a set/add of ``general.alignment`` or
            ``general.architecture``, ``artifacts`` empty or naming an artifact not made.
    """
    out: list[MetadataEdit] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(edits or ()):
        data = raw.model_dump(exclude_unset=True) if isinstance(raw, MetadataEdit) else raw
        if not isinstance(data, dict):
            raise InputError(f"metadata_edits[{i}]: expected an edit object, found {data!r:.80}")
        key = data.get("key")
        where = f"metadata_edits[{i}] (key {key!r})"
        if data.get("op") not in EDIT_OPS:
            raise InputError(f"{where}: op {data.get('op')!r} is not one of {list(EDIT_OPS)}")
        if not isinstance(key, str) or not key.strip():
            raise InputError(f"{where}: key expected a non-empty string")
        try:
            edit = MetadataEdit.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise InputError(f"{where}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        if edit.op == "delete":
            if edit.value is not None or edit.type or edit.sub_type:
                raise InputError(f"{where}: a delete takes no value or type")
            if _protected(edit.key):
                raise InputError(f"{where}: cannot delete {edit.key!r}: the architecture needs it "
                                 "to load (or the GGUF check requires it)")
        else:
            if edit.value is None:
                raise InputError(f"{where}: op {edit.op!r} needs a value")
            if edit.key in _FIXED_KEYS:
                raise InputError(f"{where}: {edit.key!r} cannot be edited (it moves every tensor or "
                                 "renames every architecture key)")
            _resolved_types(edit, where)
        if edit.key in seen:
            raise InputError(f"{where}: the key is already edited by metadata_edits[{seen[edit.key]}]")
        seen[edit.key] = i
        if edit.artifacts is not None:
            unknown = [a for a in edit.artifacts if artifact_keys is not None and a not in artifact_keys]
            if not edit.artifacts or unknown:
                raise InputError(f"{where}: artifacts {list(edit.artifacts)} expected a non-empty list "
                                 f"of the artifacts made: {list(artifact_keys or [])}")
        out.append(edit)
    return tuple(out)


# --- applying --------------------------------------------------------------------------------
def _plan(path: Path, index: HeaderIndex, edits: Sequence[MetadataEdit]) -> tuple[dict[str, bytes | None], Expected]:
    """The new header's entries (key -> packed bytes, None: copied verbatim; in the result's order,
    added keys last) and what each set/add key must hold. Raises GGUFError naming the edit."""
    from gguf import GGUFValueType

    entries: dict[str, bytes | None] = {key: None for key in index.fields}
    expected: Expected = {}
    for i, edit in enumerate(edits):
        where = f"metadata_edits[{i}] (key {edit.key!r})"
        span = index.fields.get(edit.key)
        if edit.op in ("set", "delete") and span is None:
            raise GGUFError(f"{path}: {where}: {edit.op} of a key the file does not have")
        if edit.op == "add" and span is not None:
            raise GGUFError(f"{path}: {where}: add of a key the file has (a {span.value_type}); "
                            "use op 'set'")
        if edit.op == "delete":
            del entries[edit.key]
            continue
        vtype, sub = _resolved_types(edit, where)
        if vtype is None:  # a set keeps the stored type
            vtype = int(GGUFValueType[span.value_type])
            sub = int(GGUFValueType[span.sub_type]) if span.sub_type else None
            try:
                _check_entry_value(path, edit.key, vtype, sub, edit.value)
            except GGUFError as exc:
                raise GGUFError(f"{where}: {exc}") from None
        # a set keeps the key's position; an add is appended after the last entry, in order
        entries[edit.key] = pack_entry(edit.key, vtype, sub, edit.value)
        value = list(edit.value) if isinstance(edit.value, tuple) else edit.value
        expected[edit.key] = (type_name(vtype), type_name(sub) if sub is not None else None, value)
    return entries, expected


def apply_metadata_edits(path: Path, edits: Sequence[MetadataEdit | dict[str, Any]],
                         out_path: Path | None = None, *, verify: VerifyMode | bool = "sampled",
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> MetadataEditResult:
    """Apply ``edits`` to a GGUF (one ``MetadataEdit(op="set", ...)`` sets one key) and verify the result:
    a new file, written next to the target, fsynced, verified and renamed over it.

    Args:
        edits: every edit given is applied, in order (``artifacts`` is ignored here).
        out_path: write the result here (None: replace ``path`` atomically).
        verify: ``"sampled"``, ``"full"`` or ``"none"`` (see :mod:`forgeflow.packaging.gguf_verify`).
        chunk_bytes: header copy and hash buffer in bytes (>= 4096).

    Raises:
        InputError: an edit is invalid, ``edits`` is empty, ``chunk_bytes`` < 4096 or ``verify`` is unknown.
        GGUFError: the file is not a readable GGUF, a set/delete names an absent key, an add a
            present one, a set value does not fit the stored type (key, expected type and what was
            found named), or verification failed (the source and any file under ``out_path`` are
            untouched).
        DiskFullError: the destination ran out of space (no partial file is left; an existing file
            under ``out_path`` is untouched).
    """
    started = time.perf_counter()
    path = Path(path)
    mode = check_verify_mode(verify)
    if chunk_bytes < 4096:
        raise InputError(f"chunk_bytes {chunk_bytes} is below 4096")
    edits = validate_metadata_edits(edits)
    if not edits:
        raise InputError("metadata_edits expected at least one edit, found none")
    index = read_header_index(path)
    entries, expected = _plan(path, index, edits)
    old = {e.key: read_metadata(path, e.key, index) for e in edits if e.op != "add"}
    new_data_offset = -(-new_header_end(index, entries) // index.alignment) * index.alignment
    dst = (Path(out_path) if out_path is not None else path).resolve()
    snapshot = None if mode == "none" else snapshot_metadata(
        path, index, list(entries), expected, chunk_bytes=chunk_bytes)
    after = _stream(path, dst, index, entries, new_data_offset, snapshot, mode, chunk_bytes)
    applied = []
    for e in edits:
        vtype, sub, _ = expected.get(e.key) or (index.fields[e.key].value_type, index.fields[e.key].sub_type, None)
        applied.append(e.model_copy(update={
            "type": vtype, "sub_type": sub, "value": None if e.op == "delete" else read_metadata(dst, e.key, after)}))
    return MetadataEditResult(
        path=dst, edits=tuple(applied), old_values=old, data_offset_before=index.data_offset,
        data_offset_after=after.data_offset, size_bytes=after.file_size_bytes, verification=mode,
        tensors_verified=0 if snapshot is None else len(index.tensors),
        duration_s=time.perf_counter() - started,
    )


def _stream(path: Path, dst: Path, index: HeaderIndex, entries: dict[str, bytes | None], new_data_offset: int,
            snapshot: MetadataSnapshot | None, mode: VerifyMode, chunk_bytes: int) -> HeaderIndex:
    """Write the edited file to a temporary sibling of ``dst``, fsync it, verify it against
    ``snapshot`` (when given), rename it onto ``dst``; no temporary file is left on failure.
    Returns ``dst``'s header index (the one verification read)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        stream_edited(path, tmp, index, entries, new_data_offset, chunk_bytes)
        shutil.copymode(path, tmp)
        after = read_header_index(tmp) if snapshot is None else verify_metadata_edits(
            tmp, snapshot, full=mode == "full", chunk_bytes=chunk_bytes)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
        return after.model_copy(update={"path": dst})
    except OSError as exc:
        raise_if_disk_full(exc, dst, "writing the edited GGUF")
        raise
    finally:
        tmp.unlink(missing_ok=True)


def edit_lineage(result: MetadataEditResult, source_sha256: str) -> dict[str, Any]:
    """A store record's lineage of an edited GGUF: the sha256 before the edits and each edit as
    ``{"op", "key", "value_type", "value"}`` (read back; None for a delete).
    """
    return {"edited_from_sha256": source_sha256,
            "metadata_edits": [{"op": e.op, "key": e.key, "value_type": e.type,
                                "value": e.value} for e in result.edits]}


def recorded_edited_values(store: Store, gguf_sha256: str) -> dict[str, Any]:
    """key -> value the store's recorded edits set on the GGUF ``gguf_sha256`` ({} when none), for
    :func:`forgeflow.packaging.gguf.check_gguf`'s ``edited``.
    """
    values: dict[str, Any] = {}
    for record in store.producers(gguf_sha256):
        for edit in record.lineage.get("metadata_edits") or ():
            if edit.get("op") in ("set", "add"):
                values[edit["key"]] = edit.get("value")
    return values
