"""Typed GGUF metadata edits (``set`` / ``add`` / ``delete``), validated before any compute and
applied to a GGUF in one bounded-memory streaming pass, then verified.

The header is rewritten as :mod:`forgeflow.packaging.gguf_edit` streams one edit, for any number of
edits: untouched entries and tensor infos are copied verbatim (tensor offsets are relative to the data
section, ggml ``docs/gguf.md``) and the data section is copied in chunks. Peak memory: ``chunk_bytes``
plus 1 MiB plus the new entries, whatever the file size. A failed check leaves the source untouched.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forgeflow.common.errors import GGUFError, InputError
from forgeflow.common.fsutil import fsync_dir, raise_if_disk_full
from forgeflow.packaging.gguf_edit import (
    _check_value,
    _copy_data,
    _pack_value,
)
from forgeflow.packaging.gguf_reader import (
    ARRAY_TYPE,
    DEFAULT_CHUNK_BYTES,
    HeaderIndex,
    pump,
    read_header_index,
    read_metadata,
    tensor_sha256,
    write_all,
)
from forgeflow.packaging.gguf_verify import (
    VerifyMode,
    check_verify_mode,
    roundtrip_f32,
    sample_digests,
    sha256_range,
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
_HEAD_BYTES = 24  # magic, version, tensor count, key/value count


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


class AppliedEdit(BaseModel):
    """One edit as it landed in a file (values read back from the result)."""

    model_config = ConfigDict(frozen=True)

    op: EditOp
    key: str
    value_type: str = Field(description="its gguf value type name in the result (delete: the type it had)")
    sub_type: str | None = Field(None, description="element type name of an array, else None")
    old_value: Any = Field(None, description="the value before (None for add)")
    new_value: Any = Field(None, description="the value after (None for delete)")


class MetadataEditResult(BaseModel):
    """Outcome of :func:`apply_metadata_edits` (offsets and sizes in bytes)."""

    model_config = ConfigDict(frozen=True)

    path: Path
    edits: tuple[AppliedEdit, ...] = Field(description="the edits applied, in the order given")
    data_offset_before: int = Field(ge=_HEAD_BYTES)
    data_offset_after: int = Field(ge=_HEAD_BYTES)
    size_bytes: int = Field(ge=_HEAD_BYTES)
    verification: VerifyMode = Field(description="sampled, full or none (see gguf_edit)")
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
        if sub is None:
            _check_value(Path(where), edit.key, vtype, edit.value)
        else:
            for item in edit.value:
                _check_value(Path(where), edit.key, sub, item, what="array element")
    except GGUFError as exc:
        raise InputError(str(exc)) from None
    return vtype, sub


def _check_plain(value: Any, where: str) -> None:
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, (bool, int, float, str)):
            raise InputError(f"{where}: value {value!r:.80} expected an int, float, bool, str or a "
                             "list of them")


def type_name(vtype: int) -> str:
    """The :class:`gguf.GGUFValueType` name of a value type number."""
    from gguf import GGUFValueType

    return GGUFValueType(vtype).name


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
def _pack(key: str, vtype: int, sub: int | None, value: Any) -> bytes:
    raw = key.encode("utf-8")
    head = struct.pack("<Q", len(raw)) + raw + struct.pack("<I", vtype)
    if vtype != ARRAY_TYPE:
        return head + _pack_value(vtype, value)
    return head + struct.pack("<IQ", sub, len(value)) + b"".join(_pack_value(sub, v) for v in value)


class _Plan(BaseModel):
    """The new header's entries: key -> packed bytes (None: copied verbatim), in order."""

    entries: dict[str, bytes | None]
    types: dict[str, tuple[str, str | None]]
    values: dict[str, Any]


def _plan(path: Path, index: HeaderIndex, edits: Sequence[MetadataEdit]) -> _Plan:
    from gguf import GGUFValueType

    entries: dict[str, bytes | None] = {key: None for key in index.fields}
    types: dict[str, tuple[str, str | None]] = {}
    values: dict[str, Any] = {}
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
                if sub is None:
                    _check_value(path, edit.key, vtype, edit.value)
                elif not isinstance(edit.value, (list, tuple)):
                    raise GGUFError(f"{path}: key {edit.key!r} expected an ARRAY of {span.sub_type}, "
                                    f"found {edit.value!r:.80}")
                else:
                    for item in edit.value:
                        _check_value(path, edit.key, sub, item, what="array element")
            except GGUFError as exc:
                raise GGUFError(f"{where}: {exc}") from None
        entries[edit.key] = _pack(edit.key, vtype, sub, edit.value)
        types[edit.key] = (type_name(vtype), type_name(sub) if sub is not None else None)
        values[edit.key] = list(edit.value) if isinstance(edit.value, tuple) else edit.value
    return _Plan(entries=entries, types=types, values=values)


def _kv_end(index: HeaderIndex) -> int:
    return max((s.offset + s.size_bytes for s in index.fields.values()), default=_HEAD_BYTES)


class MetadataSnapshot(BaseModel):
    """What :func:`verify_metadata_edits` compares a result against, taken from the source."""

    model_config = ConfigDict(frozen=True)

    index: HeaderIndex
    entry_sha256: dict[str, str] = Field(description="key -> sha256 of its whole entry bytes, for the untouched keys")
    tensor_infos_sha256: str = Field(description="sha256 of the tensor infos (end of the entries to header end)")
    samples: dict[str, tuple[str, ...]] = Field(description="tensor name -> sha256 of its first/middle/last 4 KiB")
    tensor_sha256: dict[str, str] | None = Field(None,
        description="tensor name -> sha256 of its whole data, or None when not taken")


def _entry_digests(fd: int, index: HeaderIndex, keys: Sequence[str], chunk_bytes: int) -> dict[str, str]:
    return {k: sha256_range(fd, index.fields[k].offset, index.fields[k].size_bytes, chunk_bytes, index.path)
            for k in keys}


def _snapshot(path: Path, index: HeaderIndex, untouched: Sequence[str], chunk_bytes: int) -> MetadataSnapshot:
    fd = os.open(path, os.O_RDONLY)
    try:
        end = _kv_end(index)
        return MetadataSnapshot(
            index=index, entry_sha256=_entry_digests(fd, index, untouched, chunk_bytes),
            tensor_infos_sha256=sha256_range(fd, end, index.header_end - end, chunk_bytes, path),
            samples=sample_digests(fd, index, 4096))
    finally:
        os.close(fd)


def verify_metadata_edits(result_path: Path, before: MetadataSnapshot, keys: Sequence[str],
                          types: dict[str, tuple[str, str | None]], values: dict[str, Any], *,
                          full: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> HeaderIndex:
    """Check that ``result_path`` is ``before``'s source with only the edited keys changed.

    Args:
        types: edited key -> (value type name, element type name or None) it must have.
        values: edited key -> the value it must hold (FLOAT32 compared after rounding).
        full: also compare every tensor's sha256 with the source's (the source must be unchanged).

    Returns:
        The result's header index.

    Raises:
        GGUFError: the result differs in anything but the edited keys (key set or order, an untouched
            entry, tensor infos, data length, a data sample or, with ``full``, a tensor's sha256), or an
            edited key has another type or value.
    """
    src = before.index
    after = read_header_index(result_path)

    def changed(what: str) -> GGUFError:
        return GGUFError(f"{result_path}: {what} changed by the metadata edits")

    layout = [(t.name, t.ggml_type, t.shape, t.relative_offset, t.size_bytes) for t in src.tensors]
    if layout != [(t.name, t.ggml_type, t.shape, t.relative_offset, t.size_bytes) for t in after.tensors]:
        raise changed("tensor infos")
    if list(after.fields) != list(keys):
        raise GGUFError(f"{result_path}: keys expected {list(keys)[:8]}..., found {list(after.fields)[:8]}...")
    if after.version != src.version or after.alignment != src.alignment:
        raise changed("version/alignment")
    if after.file_size_bytes - after.data_offset != src.file_size_bytes - src.data_offset:
        raise changed("data section length")
    for key, (vtype, sub) in types.items():
        span = after.fields[key]
        if (span.value_type, span.sub_type) != (vtype, sub):
            raise GGUFError(f"{result_path}: key {key!r} expected type {vtype}/{sub}, found "
                            f"{span.value_type}/{span.sub_type}")
        expected = values[key]
        if "FLOAT32" in (vtype, sub):
            expected = roundtrip_f32(expected)
        found = read_metadata(result_path, key, after)
        if found != expected:
            raise GGUFError(f"{result_path}: key {key!r} expected {expected!r:.200} after the edit, "
                            f"found {found!r:.200}")
    pool = ThreadPoolExecutor(max_workers=1) if full else None
    src_full = pool.submit(tensor_sha256, src.path, src, chunk_bytes) if pool else None
    try:
        fd = os.open(result_path, os.O_RDONLY)
        try:
            if _entry_digests(fd, after, list(before.entry_sha256), chunk_bytes) != before.entry_sha256:
                raise changed("an entry the edits do not name")
            end = _kv_end(after)
            if sha256_range(fd, end, after.header_end - end, chunk_bytes, result_path) != before.tensor_infos_sha256:
                raise changed("tensor info bytes")
            got = sample_digests(fd, after, 4096)
        finally:
            os.close(fd)
        bad = [name for name, digests in before.samples.items() if got.get(name) != digests]
        if bad:
            raise changed(f"tensor data samples of {bad[:5]}")
        if src_full is not None:
            got_full = tensor_sha256(result_path, after, chunk_bytes)
            diff = [n for n, d in src_full.result().items() if got_full.get(n) != d]
            if diff:
                raise changed(f"tensor data (sha256 of {diff[:5]})")
    finally:
        if pool is not None:
            pool.shutdown()
    return after


def apply_metadata_edits(path: Path, edits: Sequence[MetadataEdit | dict[str, Any]],
                         out_path: Path | None = None, *, verify: VerifyMode | bool = "sampled",
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> MetadataEditResult:
    """Apply ``edits`` to a GGUF in one streaming pass and verify the result.

    Args:
        edits: every edit given is applied (``artifacts`` is ignored here).
        out_path: write the result here (None: replace ``path`` atomically).
        verify: ``"sampled"``, ``"full"`` or ``"none"``, as in :func:`forgeflow.packaging.gguf_edit.set_metadata`.
        chunk_bytes: header copy and hash buffer in bytes (>= 4096).

    Raises:
        InputError: an edit is invalid, ``edits`` is empty, ``chunk_bytes`` < 4096 or ``verify`` is unknown.
        GGUFError: the file is not a readable GGUF, a set/delete names an absent key, an add a
            present one, a set value does not fit the stored type, or verification failed.
        DiskFullError: the destination ran out of space (no partial file is left).
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
    plan = _plan(path, index, edits)
    old = {e.key: read_metadata(path, e.key, index) for e in edits if e.op != "add"}
    untouched = [k for k, v in plan.entries.items() if v is None]
    snapshot = None if mode == "none" else _snapshot(path, index, untouched, chunk_bytes)
    new_entries = [e for e in edits if e.op == "add"]
    for e in new_entries:
        plan.entries[e.key] = plan.entries.pop(e.key)  # appended after the last entry, in order

    kv_end = _kv_end(index)
    new_header_end = (_HEAD_BYTES + sum(index.fields[k].size_bytes if v is None else len(v)
                                        for k, v in plan.entries.items()) + index.header_end - kv_end)
    new_data_offset = -(-new_header_end // index.alignment) * index.alignment
    dst = (Path(out_path) if out_path is not None else path).resolve()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    buf = bytearray(chunk_bytes)
    try:
        with open(path, "rb", buffering=0) as fin, open(tmp, "wb", buffering=0) as fout:
            pump(fin, fout, 16, buf, path=path)
            write_all(fout, struct.pack("<Q", len(plan.entries)))
            for key, packed in plan.entries.items():
                if packed is None:
                    fin.seek(index.fields[key].offset)
                    pump(fin, fout, index.fields[key].size_bytes, buf, path=path)
                else:
                    write_all(fout, packed)
            fin.seek(kv_end)
            pump(fin, fout, index.header_end - kv_end, buf, path=path)
            write_all(fout, b"\0" * (new_data_offset - new_header_end))
            _copy_data(fin.fileno(), fout.fileno(), index.data_offset, new_data_offset,
                       index.file_size_bytes - index.data_offset, path)
            os.fsync(fout.fileno())
        shutil.copymode(path, tmp)
        if snapshot is not None:
            verify_metadata_edits(tmp, snapshot, list(plan.entries), plan.types, plan.values,
                                  full=mode == "full", chunk_bytes=chunk_bytes)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
    except OSError as exc:
        raise_if_disk_full(exc, dst, "writing the edited GGUF")
        raise
    finally:
        tmp.unlink(missing_ok=True)
    after = read_header_index(dst)
    applied = []
    for e in edits:
        vtype, sub = plan.types.get(e.key) or (index.fields[e.key].value_type, index.fields[e.key].sub_type)
        applied.append(AppliedEdit(op=e.op, key=e.key, value_type=vtype, sub_type=sub,
                                   old_value=old.get(e.key),
                                   new_value=None if e.op == "delete" else read_metadata(dst, e.key, after)))
    return MetadataEditResult(
        path=dst, edits=tuple(applied), data_offset_before=index.data_offset,
        data_offset_after=after.data_offset, size_bytes=after.file_size_bytes, verification=mode,
        tensors_verified=0 if snapshot is None else len(index.tensors),
        duration_s=time.perf_counter() - started,
    )


def edit_lineage(result: MetadataEditResult, source_sha256: str) -> dict[str, Any]:
    """A store record's lineage of an edited GGUF: the sha256 before the edits and each edit as
    ``{"op", "key", "value_type", "value"}`` (read back; None for a delete).
    """
    return {"edited_from_sha256": source_sha256,
            "metadata_edits": [{"op": e.op, "key": e.key, "value_type": e.value_type,
                                "value": e.new_value} for e in result.edits]}


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
