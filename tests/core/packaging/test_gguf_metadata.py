"""forgeflow.packaging.gguf_metadata: edits validated before any file is read, and set + add +
delete applied in one pass to small GGUFs written with gguf-py's GGUFWriter, read back with
gguf-py's GGUFReader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forgeflow.common.errors import GGUFError, InputError
from forgeflow.common.fsutil import sha256_file
from forgeflow.packaging.gguf_metadata import apply_metadata_edits, validate_metadata_edits
from forgeflow.packaging.gguf_reader import tensor_sha256


def _write(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_string("general.url", "https://stale.example")
    writer.add_array("demo.ids", [1, 2, 3])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.random((64, 96), dtype=np.float32))
    writer.add_tensor("b.weight", rng.random((33,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _fields(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {name: (field.types[0].name, field.contents()) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


@pytest.mark.parametrize(("edits", "message"), [
    ([{"op": "rename", "key": "general.name", "value": "x"}],
     r"metadata_edits\[0\] \(key 'general.name'\): op 'rename' is not one of \['set', 'add', 'delete'\]"),
    ([{"op": "set", "key": "general.name", "value": "x"}, {"op": "set", "key": " ", "value": "y"}],
     r"metadata_edits\[1\] \(key ' '\): key expected a non-empty string"),
    ([{"op": "delete", "key": "general.architecture"}],
     r"metadata_edits\[0\] \(key 'general.architecture'\): cannot delete 'general.architecture'"),
    ([{"op": "delete", "key": "qwen2.block_count"}],
     r"metadata_edits\[0\] \(key 'qwen2.block_count'\): cannot delete"),
    ([{"op": "add", "key": "demo.n", "value": 300, "type": "UINT8"}],
     r"metadata_edits\[0\] \(key 'demo.n'\): key 'demo.n' expected a UINT8 value, found int 300"),
    ([{"op": "add", "key": "demo.n", "value": 1, "type": "UINT7"}],
     r"metadata_edits\[0\] \(key 'demo.n'\): type 'UINT7' is not a GGUF value type"),
    ([{"op": "add", "key": "demo.n"}], r"metadata_edits\[0\] \(key 'demo.n'\): op 'add' needs a value"),
    ([{"op": "delete", "key": "general.url", "value": "x"}], r"a delete takes no value or type"),
    ([{"op": "set", "key": "general.name", "value": "a"}, {"op": "delete", "key": "general.name"}],
     r"metadata_edits\[1\] \(key 'general.name'\): the key is already edited by metadata_edits\[0\]"),
    ([{"op": "set", "key": "general.alignment", "value": 64}], r"'general.alignment' cannot be edited"),
    ([{"op": "set", "key": "general.name", "value": "a", "artifacts": ["Q5_K"]}],
     r"metadata_edits\[0\] \(key 'general.name'\): artifacts \['Q5_K'\] expected .* made: \['f16', 'Q8_0'\]"),
    ([{"op": "set", "key": "general.name", "value": "a", "colour": "red"}],
     r"metadata_edits\[0\] \(key 'general.name'\): colour: Extra inputs are not permitted"),
])
def test_invalid_edits_are_refused_naming_the_edit_and_its_key(edits: list, message: str) -> None:
    with pytest.raises(InputError, match=message):
        validate_metadata_edits(edits, ("f16", "Q8_0"))


def test_valid_edits_become_models_in_order() -> None:
    edits = validate_metadata_edits([
        {"op": "set", "key": "general.name", "value": "agent"},
        {"op": "add", "key": "demo.tags", "value": ["a", "b"]},
        {"op": "delete", "key": "general.url", "artifacts": ["Q8_0"]},
    ], ("f16", "Q8_0"))
    assert [(e.op, e.key) for e in edits] == [("set", "general.name"), ("add", "demo.tags"),
                                              ("delete", "general.url")]
    assert not edits[2].applies_to("f16") and edits[2].applies_to("Q8_0") and edits[0].applies_to("f16")


@pytest.mark.parametrize("verify", ["sampled", "full"])
def test_set_add_delete_in_one_pass_keeps_every_tensor(tmp_path: Path, verify: str) -> None:
    src = _write(tmp_path / "m.gguf")
    before_fields, before_tensors = _fields(src), tensor_sha256(src)
    result = apply_metadata_edits(src, [
        {"op": "set", "key": "general.name", "value": "a much longer model name than before"},
        {"op": "set", "key": "llama.context_length", "value": 8192},
        {"op": "add", "key": "forgeflow.release", "value": 3, "type": "UINT32"},
        {"op": "add", "key": "demo.tags", "value": ["x", "yz"]},
        {"op": "delete", "key": "general.url"},
    ], verify=verify)
    after = _fields(src)
    assert after["general.name"] == ("STRING", "a much longer model name than before")
    assert after["llama.context_length"] == ("UINT32", 8192)  # the stored type kept
    assert after["forgeflow.release"] == ("UINT32", 3)
    assert after["demo.tags"] == ("ARRAY", ["x", "yz"])
    assert "general.url" not in after
    untouched = {k: v for k, v in before_fields.items()
                 if k not in ("general.name", "llama.context_length", "general.url")}
    assert {k: after[k] for k in untouched} == untouched
    assert list(after)[-2:] == ["forgeflow.release", "demo.tags"]  # appended in order
    assert tensor_sha256(src) == before_tensors
    assert result.size_bytes == src.stat().st_size and result.tensors_verified == 2
    assert [(e.op, e.key, result.old_values.get(e.key), e.value) for e in result.edits][-1] == (
        "delete", "general.url", "https://stale.example", None)
    assert not list(tmp_path.glob(".*.tmp"))


def test_edits_that_do_not_fit_the_file_leave_it_untouched(tmp_path: Path) -> None:
    src = _write(tmp_path / "m.gguf")
    digest = sha256_file(src)
    with pytest.raises(GGUFError, match=r"metadata_edits\[1\] \(key 'general.license'\): set of a key "
                                        r"the file does not have"):
        apply_metadata_edits(src, [{"op": "set", "key": "general.name", "value": "x"},
                                   {"op": "set", "key": "general.license", "value": "mit"}])
    with pytest.raises(GGUFError, match=r"add of a key the file has \(a STRING\); use op 'set'"):
        apply_metadata_edits(src, [{"op": "add", "key": "general.name", "value": "x"}])
    with pytest.raises(GGUFError, match=r"key 'llama.block_count' expected a UINT32 value, found str"):
        apply_metadata_edits(src, [{"op": "set", "key": "llama.block_count", "value": "two"}])
    assert sha256_file(src) == digest and not list(tmp_path.glob(".*.tmp"))


def test_edits_to_another_path_keep_the_source(tmp_path: Path) -> None:
    src = _write(tmp_path / "m.gguf")
    digest = sha256_file(src)
    out = tmp_path / "out" / "edited.gguf"
    result = apply_metadata_edits(src, [{"op": "delete", "key": "demo.ids"}], out)
    assert result.path == out.resolve() and "demo.ids" not in _fields(out)
    assert sha256_file(src) == digest and tensor_sha256(out) == tensor_sha256(src)
