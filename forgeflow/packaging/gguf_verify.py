"""Verification of a GGUF metadata edit: a snapshot of the source before the edit and the checks of the
result against it (the modes are described in :mod:`forgeflow.packaging.gguf_edit`).
"""

from __future__ import annotations

import hashlib
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import GGUFError, InputError
from forgeflow.packaging.gguf_reader import (
    DEFAULT_CHUNK_BYTES,
    HeaderIndex,
    TensorSpan,
    field_span,
    read_header_index,
    read_metadata,
    tensor_sha256,
)

SAMPLE_BYTES = 4096
"""Bytes per data sample of the sampled verification (first, middle and last of each tensor)."""
_VERIFY_MODES = ("sampled", "full", "none")
VerifyMode = Literal["sampled", "full", "none"]


class EditSnapshot(BaseModel):
    """What :func:`verify_edit` compares an edited file against, taken from the source before the edit."""

    model_config = ConfigDict(frozen=True)

    index: HeaderIndex
    key: str = Field(description="the key about to be edited")
    sample_bytes: int = Field(ge=1, description="bytes per data sample")
    header_prefix_sha256: str = Field(description="sha256 of the source bytes [0, entry offset)")
    header_suffix_sha256: str = Field(description="sha256 from the end of the entry to index.header_end")
    samples: dict[str, tuple[str, ...]] = Field(
        description="tensor name -> sha256 of its first, middle and last sample_bytes, in tensor order")
    tensor_sha256: dict[str, str] | None = Field(None,
        description="tensor name -> sha256 of its whole data, or None when not taken")


def _sample_ranges(t: TensorSpan, sample_bytes: int) -> list[tuple[int, int]]:
    """(absolute offset, length) of the first, middle and last ``sample_bytes`` of a tensor."""
    n = t.size_bytes
    if n <= sample_bytes:
        return [(t.offset, n)]
    mid = (n - sample_bytes) // 2
    return [(t.offset + start, sample_bytes) for start in (0, mid, n - sample_bytes)]


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


def _header_digests(fd: int, index: HeaderIndex, key: str, chunk_bytes: int) -> tuple[str, str]:
    span = field_span(index, key)
    end = span.offset + span.size_bytes
    return (sha256_range(fd, 0, span.offset, chunk_bytes, index.path),
            sha256_range(fd, end, index.header_end - end, chunk_bytes, index.path))


def sample_digests(fd: int, index: HeaderIndex, sample_bytes: int) -> dict[str, tuple[str, ...]]:
    """Tensor name -> sha256 (hex) of its first, middle and last ``sample_bytes`` (one sample for a
    tensor of at most ``sample_bytes``), in tensor order."""
    return {
        t.name: tuple(sha256_range(fd, off, n, sample_bytes, index.path)
                      for off, n in _sample_ranges(t, sample_bytes))
        for t in index.tensors
    }


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


def snapshot_for_edit(path: Path, key: str, *, full: bool = False,
                      sample_bytes: int = SAMPLE_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      index: HeaderIndex | None = None) -> EditSnapshot:
    """Record what :func:`verify_edit` needs from the source of an edit of ``key``.

    Reads the header and ``3 * sample_bytes`` per tensor (milliseconds); ``full`` also hashes every
    tensor's data (about 1.7 GB/s).

    Raises:
        GGUFError: the file is not a readable GGUF or ``key`` is absent.
        InputError: ``sample_bytes`` < 1 or ``chunk_bytes`` < 4096.
    """
    if sample_bytes < 1:
        raise InputError(f"sample_bytes {sample_bytes} is below 1")
    if chunk_bytes < 4096:
        raise InputError(f"chunk_bytes {chunk_bytes} is below 4096")
    path = Path(path)
    index = index or read_header_index(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        prefix, suffix = _header_digests(fd, index, key, chunk_bytes)
        samples = sample_digests(fd, index, sample_bytes)
    finally:
        os.close(fd)
    return EditSnapshot(
        index=index, key=key, sample_bytes=sample_bytes, header_prefix_sha256=prefix,
        header_suffix_sha256=suffix, samples=samples,
        tensor_sha256=tensor_sha256(path, index, chunk_bytes) if full else None,
    )


def verify_edit(result_path: Path, before: EditSnapshot, value: Any, *, full: bool = False,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[HeaderIndex, Any]:
    """Check that ``result_path`` is ``before``'s source with only ``before.key`` set to ``value``.

    With ``full`` every tensor's sha256 is compared too, against ``before.tensor_sha256`` or else the
    source hashed in a second thread (the source must be unchanged). FLOAT32 values compare after rounding.

    Returns:
        The result's header index and the key's value read back from it.

    Raises:
        GGUFError: the result is not a readable GGUF, differs from the source in anything but the key,
            or the key does not hold ``value`` (result, key and difference named).
        InputError: ``chunk_bytes`` < 4096.
    """
    if chunk_bytes < 4096:
        raise InputError(f"chunk_bytes {chunk_bytes} is below 4096")
    result_path = Path(result_path)
    src, key = before.index, before.key
    after = read_header_index(result_path)

    layout = [(t.name, t.ggml_type, t.shape, t.relative_offset, t.size_bytes) for t in src.tensors]
    found = [(t.name, t.ggml_type, t.shape, t.relative_offset, t.size_bytes) for t in after.tensors]
    if layout != found:
        diff = [f[0] for f, e in zip(found, layout) if f != e] or ["(tensor count)"]
        raise _changed(result_path, key, f"tensor infos ({diff[:5]})")
    if list(after.fields) != list(src.fields):
        raise _changed(result_path, key, "key order/set")
    if after.version != src.version or after.alignment != src.alignment:
        raise _changed(result_path, key, "version/alignment")
    data_before = src.file_size_bytes - src.data_offset
    data_after = after.file_size_bytes - after.data_offset
    if data_after != data_before:
        raise _changed(result_path, key, f"data section length ({data_before} -> {data_after} bytes)")
    span = after.fields[key]
    if (span.value_type, span.sub_type) != (src.fields[key].value_type, src.fields[key].sub_type):
        raise _changed(result_path, key, f"value type of the key ({span.value_type}/{span.sub_type})")
    new_value = read_metadata(result_path, key, after)
    expected = list(value) if isinstance(value, tuple) else value
    if span.value_type == "FLOAT32" or span.sub_type == "FLOAT32":
        expected = roundtrip_f32(expected)
    if new_value != expected:
        raise GGUFError(
            f"{result_path}: key {key!r} expected {expected!r:.200} after the edit, "
            f"found {new_value!r:.200}"
        )
    if full and before.tensor_sha256 is None:  # hash the (unchanged) source alongside
        with ThreadPoolExecutor(max_workers=1) as pool:
            src_full = pool.submit(tensor_sha256, src.path, src, chunk_bytes)
            _compare_bytes(result_path, before, after, full, src_full, chunk_bytes)
    else:
        _compare_bytes(result_path, before, after, full, before.tensor_sha256, chunk_bytes)
    return after, new_value


def _compare_bytes(result_path: Path, before: EditSnapshot, after: HeaderIndex, full: bool,
                   src_hashes: Any, chunk_bytes: int) -> None:
    """Header bytes, data samples and (``full``) whole-tensor sha256 of the result vs the source."""
    key = before.key

    fd = os.open(result_path, os.O_RDONLY)
    try:
        prefix, suffix = _header_digests(fd, after, key, chunk_bytes)
        if (after.fields[key].offset != before.index.fields[key].offset
                or prefix != before.header_prefix_sha256):
            raise _changed(result_path, key, "header bytes before the entry")
        if suffix != before.header_suffix_sha256:
            raise _changed(result_path, key, "header bytes after the entry (other keys or tensor infos)")
        got = sample_digests(fd, after, before.sample_bytes)
    finally:
        os.close(fd)
    where = ("first", "middle", "last")
    for name, digests in before.samples.items():
        bad = [where[i] if len(digests) > 1 else "whole"
               for i, (a, b) in enumerate(zip(digests, got[name])) if a != b]
        if bad:
            raise _changed(result_path, key,
                           f"tensor {name!r} data ({'/'.join(bad)} {before.sample_bytes} bytes "
                           "differ from the source: data at a wrong offset or overwritten)")
    if full:
        got_full = tensor_sha256(result_path, after, chunk_bytes)
        if not isinstance(src_hashes, dict):  # a Future hashing the source alongside
            src_hashes = src_hashes.result()
        changed = [name for name, digest in src_hashes.items() if got_full.get(name) != digest]
        if changed:
            raise _changed(result_path, key, f"tensor data (sha256 of {changed[:5]})")


def _changed(result_path: Path, key: str, what: str) -> GGUFError:
    """The error for an edit result that differs from its source in ``what`` besides ``key``."""
    return GGUFError(f"{result_path}: {what} changed by the edit of {key!r}")


def roundtrip_f32(value: Any) -> Any:
    """``value`` (a float or a list of them) as it reads back from a GGUF ``float32`` field."""
    if isinstance(value, list):
        return [roundtrip_f32(v) for v in value]
    return struct.unpack("<f", struct.pack("<f", value))[0]
