"""The write path (forgeflow.packaging.gguf_edit: a streamed new file renamed over the target) and the
checks (forgeflow.packaging.gguf_verify) of one-key edits through
forgeflow.packaging.gguf_metadata.apply_metadata_edits, on small synthetic GGUFs written with
gguf-py's GGUFWriter."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from forgeflow.common.errors import GGUFError, InputError
from forgeflow.packaging.gguf_metadata import MetadataEdit, MetadataEditResult, apply_metadata_edits
from forgeflow.packaging.gguf_reader import (
    array_length,
    read_header_index,
    read_metadata,
    tensor_sha256,
)
from forgeflow.packaging.gguf_verify import (
    MetadataSnapshot,
    snapshot_metadata,
    verify_metadata_edits,
)


def set_one(path: Path, key: str, value: object, out_path: Path | None = None,
            **kwargs: object) -> MetadataEditResult:
    """A one-key set through the multi-edit API."""
    return apply_metadata_edits(path, [MetadataEdit(op="set", key=key, value=value)], out_path, **kwargs)


def _write(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("demo.flag", True)
    writer.add_array("demo.ids", [1, 2, 3])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.random((64, 96), dtype=np.float32))
    writer.add_tensor("b.weight", rng.random((33,), dtype=np.float32))  # odd size: padding
    writer.add_tensor("c.weight", rng.random((8, 16), dtype=np.float32).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return _write(tmp_path / "small.gguf")


def test_index_matches_gguf_reader(small: Path) -> None:
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(small))
    index = read_header_index(small)
    assert index.data_offset == reader.data_offset and index.alignment == reader.alignment
    assert [(t.name, t.offset, t.size_bytes) for t in index.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in reader.tensors
    ]
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert index.fields[key].offset == field.offset
            assert index.fields[key].size_bytes == sum(p.nbytes for p in field.parts)
            assert read_metadata(small, key, index) == field.contents()
            if field.types and field.types[0] == GGUFValueType.ARRAY:  # the check's vocabulary count
                assert array_length(small, key, index) == len(field.data)


def test_same_size_edit_replaces_the_file_atomically_and_keeps_tensors(small: Path) -> None:
    """Even when the header keeps its size the file is replaced atomically (a new inode renamed over it)."""
    before = tensor_sha256(small)
    inode = small.stat().st_ino
    result = set_one(small, "llama.context_length", 8192)
    (edit,) = result.edits
    assert result.old_values[edit.key] == 4096 and edit.value == 8192
    assert result.tensors_verified == 3 and small.stat().st_ino != inode
    assert result.data_offset_before == result.data_offset_after
    assert read_metadata(small, "llama.context_length") == 8192
    assert tensor_sha256(small) == before and not list(small.parent.glob(".*.tmp"))


def test_growing_edit_streams_a_new_file_with_aligned_data(small: Path) -> None:
    from gguf import GGUFReader

    before = {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in GGUFReader(str(small)).tensors}
    inode = small.stat().st_ino
    result = set_one(small, "general.name", "a much longer model name " * 20)
    assert small.stat().st_ino != inode  # renamed over
    assert result.data_offset_after > result.data_offset_before
    reader = GGUFReader(str(small))  # gguf-py reads the result: alignment and offsets valid
    assert reader.get_field("general.name").contents() == "a much longer model name " * 20
    assert reader.data_offset % reader.alignment == 0
    assert {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in reader.tensors} == before
    assert not list(small.parent.glob(".*.tmp"))


def test_out_path_leaves_source_untouched(small: Path, tmp_path: Path) -> None:
    original = small.read_bytes()
    result = set_one(small, "llama.rope.freq_base", 5e5, tmp_path / "o" / "x.gguf")
    assert result.edits[0].value == 5e5
    assert small.read_bytes() == original
    assert read_metadata(tmp_path / "o" / "x.gguf", "llama.rope.freq_base") == 5e5


def test_array_edit(small: Path) -> None:
    result = set_one(small, "demo.ids", [7, 8, 9, 10])
    (edit,) = result.edits
    assert edit.value == [7, 8, 9, 10] and result.old_values[edit.key] == [1, 2, 3]
    assert (edit.type, edit.sub_type) == ("ARRAY", "INT32")


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("no.such.key", 1, r"metadata_edits\[0\] \(key 'no.such.key'\): set of a key the file does not have"),
        ("llama.context_length", "4096", r"'llama.context_length' expected a UINT32 value, found str"),
        ("llama.context_length", -1, r"expected a UINT32 value, found int -1"),
        ("llama.context_length", True, r"expected a UINT32 value, found bool"),
        ("demo.flag", 1, r"'demo.flag' expected a BOOL value, found int"),
        ("demo.ids", ["a"], r"'demo.ids' expected a INT32 array element, found str"),
        ("general.name", 3, r"'general.name' expected a STRING value, found int"),
    ],
)
def test_bad_key_or_type_names_key_expected_and_found(
    small: Path, key: str, value: object, pattern: str
) -> None:
    original = small.read_bytes()
    with pytest.raises(GGUFError, match=pattern):
        set_one(small, key, value)
    assert small.read_bytes() == original and not list(small.parent.glob(".*.tmp"))


def test_alignment_and_non_gguf_are_refused(small: Path, tmp_path: Path) -> None:
    original = small.read_bytes()
    with pytest.raises(InputError, match="'general.alignment' cannot be edited"):
        set_one(small, "general.alignment", 64)
    assert small.read_bytes() == original
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_header_index(bogus)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(small.read_bytes()[:-100])
    with pytest.raises(GGUFError, match="truncated"):
        read_header_index(truncated)


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
def unverified_edit(small: Path, tmp_path: Path) -> tuple[Path, MetadataSnapshot]:
    """A streamed edit written without verification, and the source's snapshot."""
    value = "renamed " * 40
    out = tmp_path / "out.gguf"
    result = set_one(small, "general.name", value, out, verify="none")
    assert result.verification == "none" and result.tensors_verified == 0
    index = read_header_index(small)
    snapshot = snapshot_metadata(small, index, list(index.fields), {"general.name": ("STRING", None, value)})
    verify_metadata_edits(out, snapshot)  # the intact result passes
    return out, snapshot


def test_sampled_check_catches_bytes_overwritten_at_a_tensor_start(unverified_edit) -> None:
    out, snapshot = unverified_edit
    a = next(t for t in read_header_index(out).tensors if t.name == "a.weight")
    _patch(out, a.offset, b"\xff" * 16)
    with pytest.raises(GGUFError, match=r"tensor 'a.weight' data \(first 4096 bytes differ"):
        verify_metadata_edits(out, snapshot)


def test_sampled_check_catches_a_data_section_at_a_wrong_offset(unverified_edit) -> None:
    out, snapshot = unverified_edit
    index = read_header_index(out)
    raw = out.read_bytes()  # data shifted by one alignment unit, same file size
    out.write_bytes(raw[:index.data_offset] + bytes(32) + raw[index.data_offset:-32])
    with pytest.raises(GGUFError, match=r"tensor 'a.weight' data \(first/middle/last"):
        verify_metadata_edits(out, snapshot)


def test_sampled_check_catches_another_key_changed(unverified_edit) -> None:
    out, snapshot = unverified_edit
    span = read_header_index(out).fields["llama.context_length"]
    _patch(out, span.offset + span.size_bytes - 4, (8192).to_bytes(4, "little"))
    with pytest.raises(GGUFError, match=r"entries of \['llama.context_length'\] \(keys the edits do not name\)"):
        verify_metadata_edits(out, snapshot)


def test_sampled_check_catches_a_data_section_of_another_length(unverified_edit) -> None:
    out, snapshot = unverified_edit
    raw = out.read_bytes()
    out.write_bytes(raw + bytes(64))  # trailing bytes: the data section grew
    with pytest.raises(GGUFError, match=r"data section length"):
        verify_metadata_edits(out, snapshot)


def test_full_check_catches_an_interior_byte_the_samples_skip(unverified_edit) -> None:
    out, snapshot = unverified_edit
    a = next(t for t in read_header_index(out).tensors if t.name == "a.weight")
    assert a.size_bytes == 64 * 96 * 4  # samples: [0, 4096), [10240, 14336), [20480, 24576)
    _patch(out, a.offset + 6000, b"\x00\x00\x00\x00")
    verify_metadata_edits(out, snapshot)  # sampled: not seen
    with pytest.raises(GGUFError, match=r"sha256 of \['a.weight'\]"):
        verify_metadata_edits(out, snapshot, full=True)


@pytest.mark.parametrize(("where", "verify", "error"), [
    (0, "sampled", r"tensor 'a.weight' data \(first 4096 bytes differ"),
    (6000, "sampled", None),  # between the samples: not seen
    (6000, "full", r"sha256 of \['a.weight'\]"),  # the unchanged source hashed alongside
    (6000, "none", None),
])
def test_verification_catches_a_tensor_changed_in_the_streamed_copy(
    small: Path, monkeypatch: pytest.MonkeyPatch, where: int, verify: str, error: str | None
) -> None:
    """A tensor byte changed while the new file is written is caught before the rename (at a
    sample by default, anywhere with ``full``); a caught one leaves the source untouched."""
    from forgeflow.packaging import gguf_metadata

    stream = gguf_metadata.stream_edited
    original = small.read_bytes()

    def stream_and_corrupt(src: Path, dst: Path, *args: object) -> None:
        stream(src, dst, *args)
        a = next(t for t in read_header_index(dst).tensors if t.name == "a.weight")
        _patch(dst, a.offset + where, b"\xff" * 4)

    monkeypatch.setattr(gguf_metadata, "stream_edited", stream_and_corrupt)
    if error is None:
        assert set_one(small, "llama.context_length", 8192, verify=verify).verification == verify
    else:
        with pytest.raises(GGUFError, match=error):
            set_one(small, "llama.context_length", 8192, verify=verify)
        assert small.read_bytes() == original and not list(small.parent.glob(".*.tmp"))


@pytest.mark.parametrize(("key", "value"), [
    ("llama.context_length", 8192),  # the data section stays put
    ("general.name", "a much longer model name " * 20),  # the data section moves
])
def test_full_verification_is_opt_in(small: Path, key: str, value: object) -> None:
    result = set_one(small, key, value, verify="full")
    assert result.verification == "full"
    assert result.tensors_verified == 3 and result.edits[0].value == value
    assert set_one(small, key, value).verification == "sampled"
    assert set_one(small, key, value, verify=True).verification == "sampled"


def test_unknown_verify_mode_is_refused(small: Path) -> None:
    with pytest.raises(InputError, match=r"verify expected one of \['sampled', 'full', 'none'\]"):
        set_one(small, "general.name", "x", verify="sha256")


@pytest.mark.parametrize("name", ["big", "a much longer model name " * 20])
def test_data_larger_than_the_copy_buffer_survives_both_copy_paths(
    tmp_path: Path, name: str
) -> None:
    """A moved data section goes through the 1 MiB buffer copy; an unmoved one (same-size value
    to ``out_path``) through ``copy_file_range``: both give tensors equal to the source."""
    import gguf

    src = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(src), arch="llama")
    writer.add_name("big")
    rng = np.random.default_rng(1)
    writer.add_tensor("x.weight", rng.random((777, 1031), dtype=np.float32))  # 3.2 MB
    writer.add_tensor("y.weight", rng.random((5,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out.gguf"
    result = set_one(src, "general.name", name, out, verify="full")
    moved = result.data_offset_after != result.data_offset_before
    assert moved is (name != "big") and result.tensors_verified == 2
    assert tensor_sha256(out) == tensor_sha256(src)
    data_bytes = src.stat().st_size - result.data_offset_before
    assert out.stat().st_size - result.data_offset_after == data_bytes


@pytest.mark.parametrize("name", ["big", "a much longer model name " * 20])
def test_writeback_is_started_behind_both_copy_paths_over_the_whole_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every ``_WRITEBACK_BYTES`` of output the copy hands what it wrote since the last time to
    writeback (the header included, from byte 0): the ranges follow each other without a gap
    and the result still verifies in full."""
    import gguf

    from forgeflow.packaging import gguf_edit

    src = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(src), arch="llama")
    writer.add_name("big")
    writer.add_tensor("x.weight", np.random.default_rng(2).random((777, 1031), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ranges: list[tuple[int, int]] = []
    started = gguf_edit.start_writeback

    def record(fd: int, offset: int, n: int) -> bool:
        ranges.append((offset, n))
        return started(fd, offset, n)

    monkeypatch.setattr(gguf_edit, "_WRITEBACK_BYTES", 1 << 20)
    monkeypatch.setattr(gguf_edit, "start_writeback", record)
    out = tmp_path / "out.gguf"
    result = set_one(src, "general.name", name, out, verify="full")
    assert (result.data_offset_after != result.data_offset_before) is (name != "big")
    assert len(ranges) == 3  # 3.2 MB of output in 1 MiB steps; the fsync writes the rest
    assert ranges[0][0] == 0 and all(n >= 1 << 20 for _, n in ranges)
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    assert tensor_sha256(out) == tensor_sha256(src)
