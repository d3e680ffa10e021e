"""Verification of GGUF metadata edits: a :class:`MetadataSnapshot` of the source taken before the
edits and :func:`verify_metadata_edits`, the checks of the result against it.

Modes (``verify`` of :func:`forgeflow.packaging.gguf_metadata.apply_metadata_edits`): ``"sampled"``
(default; ``True``): key set and order, the edited keys' types and values, every untouched entry's
bytes, the tensor infos' bytes and the first/middle/last :data:`SAMPLE_BYTES` (4 KiB) of every tensor
vs the source, milliseconds whatever the size, blind to a corrupted byte inside a tensor. ``"full"``:
also every tensor's sha256 (``benchmarks/gguf_edit.py``, 2 GB: full 3.84-4.68 s, sampled
1.18-1.34 s, ``cp`` + ``sync`` 1.55-2.03 s): the result is a new file, so the source, still
unchanged, is hashed alongside the result. ``"none"`` (``False``): only the values are read back.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import GGUFError, InputError
from forgeflow.packaging.gguf_edit import kv_end
from forgeflow.packaging.gguf_reader import (
    DEFAULT_CHUNK_BYTES,
    HeaderIndex,
    TensorSpan,
    read_header_index,
    read_metadata,
    tensor_sha256,
)

SAMPLE_BYTES = 4096
"""Bytes per data sample of the sampled verification (first, middle and last of each tensor)."""
_VERIFY_MODES = ("sampled", "full", "none")
VerifyMode = Literal["sampled", "full", "none"]
Expected = dict[str, tuple[str, str | None, Any]]
"""Edited key -> (value type name, element type name or None, the value it must hold)."""


class MetadataSnapshot(BaseModel):
    """What :func:`verify_metadata_edits` compares a result against, taken from the source before the edits."""

    model_config = ConfigDict(frozen=True)

    index: HeaderIndex = Field(description="the source's header index")
    keys: tuple[str, ...] = Field(description="the result's keys, in order")
    expected: Expected = Field(
        description="edited key -> (value type name, element type name or None, value it must hold)")
    entry_sha256: dict[str, str] = Field(description="untouched key -> sha256 of its whole entry bytes")
    tensor_infos_sha256: str = Field(description="sha256 of the tensor infos (end of the entries to header end)")
    sample_bytes: int = Field(ge=1, description="bytes per data sample")
    samples: dict[str, tuple[str, ...]] = Field(
        description="tensor name -> sha256 of its first, middle and last sample_bytes, in tensor order")


def check_verify_mode(verify: Any) -> VerifyMode:
    """The verification mode of ``verify`` (True: ``"sampled"``, False: ``"none"``).

    Raises:
        InputError: not a bool nor one of ``"sampled"``, ``"full"``, ``"none"``.
    """
    if verify is True:
        return "sampled"
    if verify is False:
        return "none"
    if verify not in _VERIFY_MODES:
        raise InputError(
            f"verify expected one of {list(_VERIFY_MODES)} or a bool, found {verify!r:.80}"
        )
    return verify


def sha256_range(fd: int, offset: int, n: int, chunk_bytes: int, path: Path) -> str:
    """sha256 (hex) of ``n`` bytes of the open file ``fd`` from ``offset``, read ``chunk_bytes`` at a time.

    Raises:
        GGUFError: the file ends first (``path`` named).
    """
    h = hashlib.sha256()
    while n > 0:
        data = os.pread(fd, min(n, chunk_bytes), offset)
        if not data:
            raise GGUFError(f"{path}: unexpected end of file at byte {offset} ({n} bytes missing)")
        h.update(data)
        offset += len(data)
        n -= len(data)
    return h.hexdigest()


def _sample_ranges(t: TensorSpan, sample_bytes: int) -> list[tuple[int, int]]:
    """(absolute offset, length) of the first, middle and last ``sample_bytes`` of a tensor."""
    n = t.size_bytes
    if n <= sample_bytes:
        return [(t.offset, n)]
    mid = (n - sample_bytes) // 2
    return [(t.offset + start, sample_bytes) for start in (0, mid, n - sample_bytes)]


def sample_digests(fd: int, index: HeaderIndex, sample_bytes: int) -> dict[str, tuple[str, ...]]:
    """Tensor name -> sha256 (hex) of its first, middle and last ``sample_bytes`` (one sample for a
    tensor of at most ``sample_bytes``), in tensor order."""
    return {
        t.name: tuple(sha256_range(fd, off, n, sample_bytes, index.path)
                      for off, n in _sample_ranges(t, sample_bytes))
        for t in index.tensors
    }


def _entry_digests(fd: int, index: HeaderIndex, keys: Sequence[str], chunk_bytes: int) -> dict[str, str]:
    return {k: sha256_range(fd, index.fields[k].offset, index.fields[k].size_bytes, chunk_bytes, index.path)
            for k in keys}


def roundtrip_f32(value: Any) -> Any:
    """``value`` (a float or a list of them) as it reads back from a GGUF ``float32`` field."""
    if isinstance(value, list):
        return [roundtrip_f32(v) for v in value]
    return struct.unpack("<f", struct.pack("<f", value))[0]


def snapshot_metadata(path: Path, index: HeaderIndex, keys: Sequence[str], expected: Expected, *,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> MetadataSnapshot:
    """Record what :func:`verify_metadata_edits` needs from the source ``path`` (``index``: its header).

    Args:
        keys: the result's keys, in order (untouched ones are those of ``index`` not in ``expected``).
        expected: see :data:`Expected`; values as lists for arrays.

    Raises:
        GGUFError: the file ends before its header says.
        InputError: ``chunk_bytes`` < 4096.
    """
    if chunk_bytes < 4096:
        raise InputError(f"chunk_bytes {chunk_bytes} is below 4096")
    untouched = [k for k in keys if k not in expected]
    end = kv_end(index)
    fd = os.open(path, os.O_RDONLY)
    try:
        return MetadataSnapshot(
            index=index, keys=tuple(keys), expected=expected,
            entry_sha256=_entry_digests(fd, index, untouched, chunk_bytes),
            tensor_infos_sha256=sha256_range(fd, end, index.header_end - end, chunk_bytes, Path(path)),
            sample_bytes=SAMPLE_BYTES, samples=sample_digests(fd, index, SAMPLE_BYTES))
    finally:
        os.close(fd)


def verify_metadata_edits(result_path: Path, before: MetadataSnapshot, *, full: bool = False,
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> HeaderIndex:
    """Check that ``result_path`` is ``before``'s source with only ``before.expected``'s keys changed.

    With ``full`` every tensor's sha256 is compared too, against the source's, hashed in a second
    thread (the source must be unchanged: the result is a new file). FLOAT32 values compare after
    rounding.

    Returns:
        The result's header index.

    Raises:
        GGUFError: the result is not a readable GGUF, differs from the source in anything but the
            edited keys (key set or order, an untouched entry, tensor infos, data length, a data
            sample or, with ``full``, a tensor's sha256; result and difference named), or an edited
            key has another type or value.
    """
    src = before.index
    after = read_header_index(result_path)
    _check_layout(result_path, before, after)
    for key, (vtype, sub, value) in before.expected.items():
        span = after.fields[key]
        if (span.value_type, span.sub_type) != (vtype, sub):
            raise GGUFError(f"{result_path}: key {key!r} expected type {vtype}/{sub}, found "
                            f"{span.value_type}/{span.sub_type}")
        if "FLOAT32" in (vtype, sub):
            value = roundtrip_f32(value)
        found = read_metadata(result_path, key, after)
        if found != value:
            raise GGUFError(f"{result_path}: key {key!r} expected {value!r:.200} after the edit, "
                            f"found {found!r:.200}")
    if not full:
        _check_bytes(result_path, before, after, None, chunk_bytes)
        return after
    with ThreadPoolExecutor(max_workers=1) as pool:  # hash the (unchanged) source alongside
        src_full = pool.submit(tensor_sha256, src.path, src, chunk_bytes)
        _check_bytes(result_path, before, after, src_full, chunk_bytes)
    return after


def _changed(result_path: Path, what: str) -> GGUFError:
    """The error for an edit result that differs from its source in ``what``."""
    return GGUFError(f"{result_path}: {what} changed by the metadata edits")


def _check_layout(result_path: Path, before: MetadataSnapshot, after: HeaderIndex) -> None:
    """Tensor infos, key set and order, version, alignment and data length of the result vs the source."""
    src = before.index
    layout = [(t.name, t.ggml_type, t.shape, t.relative_offset, t.size_bytes) for t in src.tensors]
    found = [(t.name, t.ggml_type, t.shape, t.relative_offset, t.size_bytes) for t in after.tensors]
    if layout != found:
        diff = [f[0] for f, e in zip(found, layout) if f != e] or ["(tensor count)"]
        raise _changed(result_path, f"tensor infos ({diff[:5]})")
    if list(after.fields) != list(before.keys):
        raise GGUFError(f"{result_path}: keys expected {list(before.keys)[:8]}..., "
                        f"found {list(after.fields)[:8]}...")
    if after.version != src.version or after.alignment != src.alignment:
        raise _changed(result_path, "version/alignment")
    data_before = src.file_size_bytes - src.data_offset
    data_after = after.file_size_bytes - after.data_offset
    if data_after != data_before:
        raise _changed(result_path, f"data section length ({data_before} -> {data_after} bytes)")


def _check_bytes(result_path: Path, before: MetadataSnapshot, after: HeaderIndex,
                 src_hashes: Future[dict[str, str]] | None, chunk_bytes: int) -> None:
    """Untouched entries, tensor info bytes, data samples and (``src_hashes`` given: a Future computing
    the source's tensor sha256) whole-tensor sha256 of the result vs the source."""
    fd = os.open(result_path, os.O_RDONLY)
    try:
        got = _entry_digests(fd, after, list(before.entry_sha256), chunk_bytes)
        moved = [k for k, digest in before.entry_sha256.items() if got[k] != digest]
        if moved:
            raise _changed(result_path, f"entries of {moved[:5]} (keys the edits do not name)")
        end = kv_end(after)
        if sha256_range(fd, end, after.header_end - end, chunk_bytes, result_path) != before.tensor_infos_sha256:
            raise _changed(result_path, "tensor info bytes")
        samples = sample_digests(fd, after, before.sample_bytes)
    finally:
        os.close(fd)
    where = ("first", "middle", "last")
    for name, digests in before.samples.items():
        bad = [where[i] if len(digests) > 1 else "whole"
               for i, (a, b) in enumerate(zip(digests, samples[name])) if a != b]
        if bad:
            raise _changed(result_path, f"tensor {name!r} data ({'/'.join(bad)} {before.sample_bytes} bytes "
                                        "differ from the source: data at a wrong offset or overwritten)")
    if src_hashes is not None:
        got_full = tensor_sha256(result_path, after, chunk_bytes)
        diff = [name for name, digest in src_hashes.result().items() if got_full.get(name) != digest]
        if diff:
            raise _changed(result_path, f"tensor data (sha256 of {diff[:5]})")
