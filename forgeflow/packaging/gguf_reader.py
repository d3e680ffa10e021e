"""Reading a GGUF file's header without loading it: metadata spans, tensor spans, digests.

Value type numbers are those of ``gguf.GGUFValueType`` (ggml's ``docs/gguf.md``, "enum
gguf_metadata_value_type").
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import GGUFError

GGUF_MAGIC = b"GGUF"


DEFAULT_CHUNK_BYTES = 8 << 20

DEFAULT_ALIGNMENT = 32


SUPPORTED_VERSIONS = (2, 3)


# GGUFValueType number -> struct format (little endian); the numbers are those of
# gguf.GGUFValueType (ggml docs/gguf.md "enum gguf_metadata_value_type").
SCALAR_FORMATS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
STRING_TYPE = 8
ARRAY_TYPE = 9
INT_RANGES: dict[int, tuple[int, int]] = {
    0: (0, 2**8 - 1), 1: (-(2**7), 2**7 - 1), 2: (0, 2**16 - 1), 3: (-(2**15), 2**15 - 1),
    4: (0, 2**32 - 1), 5: (-(2**31), 2**31 - 1), 10: (0, 2**64 - 1), 11: (-(2**63), 2**63 - 1),
}
FLOAT_TYPES = (6, 12)


BOOL_TYPE = 7


def type_name(vtype: int) -> str:
    from gguf import GGUFValueType

    return GGUFValueType(vtype).name


class FieldSpan(BaseModel):
    """Where one key/value entry lies in a GGUF file (offsets and sizes in bytes)."""

    model_config = ConfigDict(frozen=True)

    key: str
    value_type: str = Field(description="gguf value type name (UINT32, STRING, ARRAY, ...)")
    sub_type: str | None = Field(None, description="element type name for arrays, else None")
    offset: int = Field(ge=24, description="absolute offset of the entry (its key's length prefix)")
    size_bytes: int = Field(ge=13, description="bytes of the whole entry (key, type, value)")


class TensorSpan(BaseModel):
    """Where one tensor's data lies (offsets and sizes in bytes)."""

    model_config = ConfigDict(frozen=True)

    name: str
    ggml_type: str = Field(description="ggml type name (F16, Q8_0, Q4_K, ...)")
    shape: tuple[int, ...] = Field(description="dims in ggml order (ne[0], the row length, first)")
    offset: int = Field(ge=0, description="absolute offset of the data")
    relative_offset: int = Field(ge=0, description="offset inside the data section, as stored in the tensor info")
    size_bytes: int = Field(ge=0, description="data bytes (from gguf.GGML_QUANT_SIZES)")


class HeaderIndex(BaseModel):
    """Offsets of a GGUF header, found without materializing its values."""

    model_config = ConfigDict(frozen=True)

    path: Path
    version: int = Field(description="GGUF version (2 or 3)")
    alignment: int = Field(ge=1, description="data alignment in bytes (general.alignment or 32)")
    header_end: int = Field(ge=24, description="offset just after the last tensor info")
    data_offset: int = Field(ge=24, description="start of the data section (header_end rounded up to alignment)")
    file_size_bytes: int = Field(ge=24)
    fields: dict[str, FieldSpan] = Field(description="key -> span, in file order")
    tensors: tuple[TensorSpan, ...] = Field(description="tensor spans in file order")


# --- reading ---------------------------------------------------------------------------------
class HeaderCursor:
    """Sequential little-endian reads over a buffered file, tracking the offset."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f, self.path, self.pos = f, path, 0

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFError(f"{self.path}: truncated GGUF header at byte {self.pos} (wanted {n})")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> str:
        raw = self.read(self.u64())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{self.path}: invalid UTF-8 string at byte {self.pos}") from exc

    def skip_value(self, vtype: int) -> int | None:
        """Skip one value; returns the array element type for arrays."""
        if vtype in SCALAR_FORMATS:
            self.skip(struct.calcsize(SCALAR_FORMATS[vtype]))
            return None
        if vtype == STRING_TYPE:
            self.skip(self.u64())
            return None
        if vtype == ARRAY_TYPE:
            sub, count = self.u32(), self.u64()
            if sub in SCALAR_FORMATS:
                self.skip(count * struct.calcsize(SCALAR_FORMATS[sub]))
            elif sub == STRING_TYPE:
                for _ in range(count):
                    self.skip(self.u64())
            else:
                raise GGUFError(f"{self.path}: unsupported array element type {sub} at {self.pos}")
            return sub
        raise GGUFError(f"{self.path}: unknown value type {vtype} at byte {self.pos}")

    def value(self, vtype: int) -> Any:
        if vtype in SCALAR_FORMATS:
            fmt = SCALAR_FORMATS[vtype]
            return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]
        if vtype == STRING_TYPE:
            return self.string()
        if vtype == ARRAY_TYPE:
            sub, count = self.u32(), self.u64()
            return [self.value(sub) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown value type {vtype} at byte {self.pos}")


def read_header_index(path: Path) -> HeaderIndex:
    """Index a GGUF header (1 MiB buffer, offsets only: a few MB even for a 150k-token vocabulary).

    Raises:
        GGUFError: the file is missing, not GGUF, big-endian, of an unsupported version, or its
            header is truncated or malformed (the path named).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb", buffering=1 << 20) as f:
        cur = HeaderCursor(f, path)
        if cur.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (magic is not 'GGUF')")
        version = cur.u32()
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(
                f"{path}: GGUF version {version} unsupported (expected one of "
                f"{list(SUPPORTED_VERSIONS)}; a big-endian file reads as a huge version)"
            )
        n_tensors, n_kv = cur.u64(), cur.u64()
        fields: dict[str, FieldSpan] = {}
        alignment = DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string()
            vtype = cur.u32()
            if key == "general.alignment" and vtype == 4:
                alignment = struct.unpack("<I", cur.read(4))[0]
                sub = None
            else:
                sub = cur.skip_value(vtype)
            if key in fields:
                raise GGUFError(f"{path}: duplicate key {key!r} at byte {start}")
            fields[key] = FieldSpan(
                key=key, value_type=type_name(vtype),
                sub_type=type_name(sub) if sub is not None else None,
                offset=start, size_bytes=cur.pos - start,
            )
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: general.alignment {alignment} is not a power of two")
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            shape = tuple(cur.u64() for _ in range(n_dims))
            ggml_type, rel = cur.u32(), cur.u64()
            infos.append((name, shape, ggml_type, rel))
        header_end = cur.pos
    data_offset = -(-header_end // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, rel in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from exc
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        nbytes = n_elements // block * block_bytes
        if data_offset + rel + nbytes > size:
            raise GGUFError(
                f"{path}: tensor {name!r} data ends at byte {data_offset + rel + nbytes}, past "
                f"the end of the file ({size} bytes): truncated"
            )
        tensors.append(TensorSpan(
            name=name, ggml_type=qtype.name, shape=shape, offset=data_offset + rel,
            relative_offset=rel, size_bytes=nbytes,
        ))
    return HeaderIndex(
        path=path, version=version, alignment=alignment, header_end=header_end,
        data_offset=data_offset, file_size_bytes=size, fields=fields, tensors=tuple(tensors),
    )


def read_metadata(path: Path, key: str, index: HeaderIndex | None = None) -> Any:
    """Return one metadata value (arrays as lists) without parsing the rest of the header.

    Raises:
        GGUFError: the key is absent (the message lists a few present keys) or the file is bad.
    """
    index = index or read_header_index(path)
    with open(path, "rb") as f:
        cur, vtype = _entry(f, path, field_span(index, key))
        return cur.value(vtype)


def _entry(f: BinaryIO, path: Path, span: FieldSpan) -> tuple[HeaderCursor, int]:
    """A cursor on the value of the entry at ``span`` (its key read) and the value's type number."""
    f.seek(span.offset)
    cur = HeaderCursor(f, Path(path))
    cur.string()
    return cur, cur.u32()


def array_length(path: Path, key: str, index: HeaderIndex | None = None) -> int:
    """The element count of the array ``key`` (e.g. ``tokenizer.ggml.tokens``: the vocabulary), read from its
    header alone (the elements are not read).

    Raises:
        GGUFError: the key is absent, not an array, or the file is bad.
    """
    index = index or read_header_index(path)
    span = field_span(index, key)
    with open(path, "rb") as f:
        cur, vtype = _entry(f, path, span)
        if vtype != ARRAY_TYPE:
            raise GGUFError(f"{path}: {key} is a {span.value_type}, not an array")
        cur.u32()
        return cur.u64()


def tensor_sha256(path: Path, index: HeaderIndex | None = None,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, str]:
    """tensor name -> sha256 (hex) of its data region, read in ``chunk_bytes`` pieces."""
    index = index or read_header_index(path)
    buf = bytearray(chunk_bytes)
    out: dict[str, str] = {}
    with open(path, "rb", buffering=0) as f:
        for t in index.tensors:
            h = hashlib.sha256()
            f.seek(t.offset)
            pump(f, None, t.size_bytes, buf, h, path)
            out[t.name] = h.hexdigest()
    return out


# --- writing ---------------------------------------------------------------------------------
def field_span(index: HeaderIndex, key: str) -> FieldSpan:
    span = index.fields.get(key)
    if span is None:
        some = ", ".join(list(index.fields)[:8])
        raise GGUFError(
            f"{index.path}: key {key!r} expected present, found no such key "
            f"({len(index.fields)} keys: {some}, ...)"
        )
    return span


def pump(fin: BinaryIO, fout: BinaryIO | None, n: int, buf: bytearray,
          hasher: Any = None, path: Path | None = None) -> None:
    """Copy (or only read, when ``fout`` is None) ``n`` bytes through ``buf``, hashing them."""
    view = memoryview(buf)
    while n > 0:
        want = min(n, len(buf))
        got = fin.readinto(view[:want])
        if not got:
            raise GGUFError(f"{path or fin}: unexpected end of file ({n} bytes missing)")
        chunk = view[:got]
        if hasher is not None:
            hasher.update(chunk)
        if fout is not None:
            write_all(fout, chunk)
        n -= got


def write_all(fout: BinaryIO, data: bytes | memoryview) -> None:
    """Write all of ``data`` to an unbuffered file: a raw write may be short (a filling disk
    returns the bytes it took; the next write raises ENOSPC)."""
    view = memoryview(data)
    while view:
        view = view[fout.write(view):]
