"""forgeflow.gguf_edit on small synthetic GGUFs written with gguf-py's GGUFWriter."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from forgeflow.errors import GGUFError, InputError
from forgeflow.gguf_edit import read_header_index, read_metadata, set_metadata, tensor_sha256


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
    from gguf import GGUFReader

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


def test_same_size_edit_is_in_place_and_keeps_tensors(small: Path) -> None:
    before = tensor_sha256(small)
    inode = small.stat().st_ino
    result = set_metadata(small, "llama.context_length", 8192)
    assert result.in_place and result.old_value == 4096 and result.new_value == 8192
    assert result.tensors_verified == 3 and small.stat().st_ino == inode
    assert result.data_offset_before == result.data_offset_after
    assert read_metadata(small, "llama.context_length") == 8192
    assert tensor_sha256(small) == before


def test_growing_edit_streams_a_new_file_with_aligned_data(small: Path) -> None:
    from gguf import GGUFReader

    before = {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in GGUFReader(str(small)).tensors}
    inode = small.stat().st_ino
    result = set_metadata(small, "general.name", "a much longer model name " * 20)
    assert not result.in_place and small.stat().st_ino != inode  # renamed over
    assert result.data_offset_after > result.data_offset_before
    reader = GGUFReader(str(small))  # gguf-py reads the result: alignment and offsets valid
    assert reader.get_field("general.name").contents() == "a much longer model name " * 20
    assert reader.data_offset % reader.alignment == 0
    assert {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in reader.tensors} == before
    assert not list(small.parent.glob(".*.tmp"))


def test_small_growth_absorbed_by_padding_stays_in_place(small: Path) -> None:
    index = read_header_index(small)
    slack = index.data_offset - index.header_end
    if slack == 0:
        pytest.skip("header ends exactly on the alignment")
    result = set_metadata(small, "general.name", "tiny" + "x" * slack)
    assert result.in_place and result.data_offset_after == index.data_offset
    assert read_metadata(small, "general.name") == "tiny" + "x" * slack


def test_out_path_leaves_source_untouched(small: Path, tmp_path: Path) -> None:
    original = small.read_bytes()
    result = set_metadata(small, "llama.rope.freq_base", 5e5, out_path=tmp_path / "o" / "x.gguf")
    assert not result.in_place and result.new_value == 5e5
    assert small.read_bytes() == original
    assert read_metadata(tmp_path / "o" / "x.gguf", "llama.rope.freq_base") == 5e5


def test_array_edit(small: Path) -> None:
    result = set_metadata(small, "demo.ids", [7, 8, 9, 10])
    assert result.new_value == [7, 8, 9, 10] and result.value_type == "ARRAY"


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("no.such.key", 1, r"'no.such.key' expected present, found no such key"),
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
        set_metadata(small, key, value)
    assert small.read_bytes() == original


def test_alignment_and_non_gguf_are_refused(small: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="general.alignment"):
        set_metadata(small, "general.alignment", 64)
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_header_index(bogus)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(small.read_bytes()[:-100])
    with pytest.raises(GGUFError, match="truncated"):
        read_header_index(truncated)
