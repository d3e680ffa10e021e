"""A multimodal release: the vision projector travels beside its GGUF, named in the release JSON by sha256.

Real small GGUFs (gguf-py's ``GGUFWriter``) stand for the text model and its projector; the Hub side drives
the real ``huggingface_hub`` client against the loopback fake Hub (``tests/fakes/hf_hub.py``)."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import numpy as np
import pytest

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file
from forgeflow.packaging.publish import HubTarget, publish_hub, publish_local, read_local_record
from forgeflow.packaging.release import metadata_path_for, write_release_metadata
from tests.fakes.hf_hub import FakeHub


def _gguf(path: Path, arch: str, fill: float) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("t.weight", np.full((16, 16), fill, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_projector_is_published_beside_its_gguf_and_named_in_the_release(tmp_path: Path) -> None:
    text = _gguf(tmp_path / "model-q4_k_m.gguf", "qwen35", 1.0)
    projector = _gguf(tmp_path / "mmproj-f16.gguf", "clip", 2.0)
    metadata = metadata_path_for(text)
    release = write_release_metadata(text, sha256_file(text), "Q4_K_M", "b" * 64, metadata, mmproj_path=projector)
    assert (release.mmproj_file, release.mmproj_sha256) == ("mmproj-f16.gguf", sha256_file(projector))
    assert json.loads(metadata.read_text())["mmproj_sha256"] == sha256_file(projector)

    record = publish_local(text, metadata, tmp_path / "store", "vl", mmproj_path=projector)
    assert {(f.role, f.path_in_store, f.sha256) for f in record.files if f.role == "mmproj"} == {
        ("mmproj", "mmproj-f16.gguf", sha256_file(projector))}
    folder = Path(record.location)
    assert sha256_file(folder / "mmproj-f16.gguf") == sha256_file(projector) and read_local_record(folder) == record
    # a release whose JSON names a projector is refused without it, or with another one, before anything is copied
    with pytest.raises(InputError, match="give mmproj_path"):
        publish_local(text, metadata, tmp_path / "store2", "vl")
    other = _gguf(tmp_path / "other-mmproj.gguf", "clip", 3.0)
    with pytest.raises(InputError, match=f"not the projector {sha256_file(projector)}"):
        publish_local(text, metadata, tmp_path / "store2", "vl", mmproj_path=other)
    assert not (tmp_path / "store2" / "vl").exists() or not any((tmp_path / "store2" / "vl").iterdir())

    token = "hf_" + secrets.token_hex(16)
    hub = FakeHub(token=token)
    hub.start()
    try:
        pushed = publish_hub(text, metadata, HubTarget(repo_id="forgeflow/tiny-vl", endpoint=hub.endpoint,
                                                       transfer="lfs"), token=token, mmproj_path=projector)
        assert hub.stored_bytes("forgeflow/tiny-vl", "mmproj-f16.gguf", pushed.revision) == projector.read_bytes()
        assert {f.path_in_store: f.role for f in pushed.files} == {
            "model-q4_k_m.gguf": "gguf", metadata.name: "metadata", "mmproj-f16.gguf": "mmproj"}
    finally:
        hub.stop()
