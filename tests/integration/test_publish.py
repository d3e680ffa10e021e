"""Publishing a GGUF and its lineage JSON: to a local store folder, and to the HF Hub.

The Hub cannot be reached from the machines these tests run on, so the Hub tests drive the real
``huggingface_hub`` client (``HfApi.create_repo``/``create_commit``/``get_paths_info``, Git LFS
batch uploads) against ``tests/fakes/hf_hub.py``: a loopback fake of the HF Hub HTTP API that
keeps the uploaded bytes and computes real sha256s, started on a free port and stopped after the
test. The GGUF is a small real one written with gguf-py's ``GGUFWriter``.
"""

from __future__ import annotations

import json
import logging
import secrets
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from forgeflow.common.errors import (
    GGUFError,
    InputError,
    ModelStoreError,
    PublishDigestMismatchError,
    StaleParentCommitError,
)
from forgeflow.common.fsutil import sha256_file
from forgeflow.packaging.publish import (
    RECORD_FILE,
    HubTarget,
    git_blob_sha1,
    publish_hub,
    publish_local,
    read_local_record,
)
from tests.fakes.hf_hub import FakeHub, git_blob_id

TOKEN = "hf_" + secrets.token_hex(16)  # made per run: no token-shaped literal in the repository
REPO = "forgeflow/tiny-gguf"


@pytest.fixture
def artifact(tmp_path: Path) -> tuple[Path, Path]:
    """A small real GGUF (one f32 tensor) and its lineage JSON."""
    from gguf import GGUFWriter

    gguf_path = tmp_path / "tiny-q8_0.gguf"
    writer = GGUFWriter(str(gguf_path), "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = tmp_path / "lineage.json"
    metadata.write_text(json.dumps({"adapter_sha256": "a" * 64, "quantization": "Q8_0"}, indent=2))
    return gguf_path, metadata


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    """The loopback fake Hub on a free port, stopped at the end of the test."""
    server = FakeHub(token=TOKEN)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _lfs(hub: FakeHub) -> HubTarget:
    """The test repository on the fake Hub, uploaded through Git LFS (the fake has no Xet storage)."""
    return HubTarget(repo_id=REPO, endpoint=hub.endpoint, transfer="lfs")


def test_local_publish_is_atomic_verified_and_idempotent(artifact: tuple[Path, Path], tmp_path: Path) -> None:
    gguf_path, metadata = artifact
    store = tmp_path / "store"
    record = publish_local(gguf_path, metadata, store, "tiny")
    folder = Path(record.location)
    assert folder.parent == (store / "tiny").resolve() and folder.name == record.revision
    assert sorted(p.name for p in folder.iterdir()) == sorted([gguf_path.name, metadata.name, RECORD_FILE])
    assert [(f.path_in_store, f.sha256, f.size_bytes) for f in record.files] == [
        (p.name, sha256_file(p), p.stat().st_size) for p in (gguf_path, metadata)
    ]
    assert sha256_file(folder / gguf_path.name) == sha256_file(gguf_path)
    assert not [p for p in (store / "tiny").iterdir() if p.name.startswith(".")]  # no temp folder left
    assert read_local_record(folder) == record
    # a re-run is a no-op that returns the first record; changed metadata is a new revision
    assert publish_local(gguf_path, metadata, store, "tiny") == record
    metadata.write_text(json.dumps({"adapter_sha256": "b" * 64}))
    second = publish_local(gguf_path, metadata, store, "tiny")
    assert second.revision != record.revision and read_local_record(folder) == record
    # bytes changed in the store are caught
    (folder / gguf_path.name).write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(PublishDigestMismatchError, match=gguf_path.name):
        read_local_record(folder)
    with pytest.raises(InputError, match="name"):
        publish_local(gguf_path, metadata, store, "../escape")
    with pytest.raises(GGUFError, match="not a GGUF"):
        publish_local(metadata, gguf_path, store, "tiny")


def test_hub_publish_commits_on_the_pinned_parent_and_verifies(artifact: tuple[Path, Path], hub: FakeHub) -> None:
    from huggingface_hub import HfApi

    gguf_path, metadata = artifact
    record = publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN)
    initial = hub.repos[REPO].commits
    assert record.backend == "hf_hub" and record.repo_id == REPO
    assert record.revision == hub.head(REPO) and record.parent_revision in initial
    assert record.parent_revision != record.revision
    # the server holds exactly the local bytes; the GGUF went through Git LFS, the JSON did not
    assert hub.stored_bytes(REPO, gguf_path.name, record.revision) == gguf_path.read_bytes()
    assert hub.stored_bytes(REPO, metadata.name, record.revision) == metadata.read_bytes()
    paths = [path for _, path in hub.requests]
    assert f"/{REPO}.git/info/lfs/objects/batch" in paths
    assert [p for p in paths if p.startswith("/_lfs/")] == [f"/_lfs/{REPO}/{sha256_file(gguf_path)}"]
    # what a user would check with the client itself
    infos = {i.path: i for i in HfApi(endpoint=hub.endpoint, token=TOKEN).get_paths_info(
        REPO, [gguf_path.name, metadata.name], revision=record.revision)}
    assert infos[gguf_path.name].lfs.sha256 == sha256_file(gguf_path) == record.files[0].sha256
    assert infos[metadata.name].lfs is None and infos[metadata.name].blob_id == git_blob_sha1(metadata)
    assert git_blob_sha1(metadata) == git_blob_id(metadata.read_bytes())


def test_hub_sha256_mismatch_is_detected(artifact: tuple[Path, Path], hub: FakeHub) -> None:
    gguf_path, metadata = artifact
    hub.corrupt_uploads = True
    with pytest.raises(PublishDigestMismatchError) as caught:
        publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN)
    stored = hub.stored_bytes(REPO, gguf_path.name)
    message = str(caught.value)
    assert gguf_path.name in message and sha256_file(gguf_path) in message
    import hashlib

    assert hashlib.sha256(stored).hexdigest() in message


def test_stale_parent_commit_is_refused(artifact: tuple[Path, Path], hub: FakeHub) -> None:
    gguf_path, metadata = artifact
    first = publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN)
    metadata.write_text(json.dumps({"adapter_sha256": "c" * 64}))
    # the caller's pinned parent is behind the branch: refused before any upload
    with pytest.raises(StaleParentCommitError) as caught:
        publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN,
                    parent_commit=first.parent_revision)
    assert first.parent_revision in str(caught.value) and first.revision in str(caught.value)
    assert hub.head(REPO) == first.revision  # nothing was committed
    # another writer commits while we upload: the Hub answers 412 to our commit
    hub.concurrent_commit = ("README.md", b"written by someone else\n")
    with pytest.raises(StaleParentCommitError) as caught:
        publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN,
                    parent_commit=first.revision)
    assert "412" in str(caught.value) and first.revision in str(caught.value)
    racer = hub.head(REPO)
    assert racer != first.revision and hub.stored_bytes(REPO, metadata.name) != metadata.read_bytes()
    second = publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN,
                         parent_commit=racer)
    assert second.parent_revision == racer and hub.head(REPO) == second.revision
    assert hub.stored_bytes(REPO, metadata.name) == metadata.read_bytes()
    # publishing identical files again makes no commit
    again = publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN)
    assert again.revision == again.parent_revision == second.revision == hub.head(REPO)


def test_the_token_is_in_no_log_exception_or_record(
    artifact: tuple[Path, Path], hub: FakeHub, caplog: pytest.LogCaptureFixture
) -> None:
    gguf_path, metadata = artifact
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    record = publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN)
    texts.append(record.model_dump_json())
    failures = [
        (StaleParentCommitError, {"token": TOKEN, "parent_commit": record.parent_revision}),
        (ModelStoreError, {"token": TOKEN[:-1] + "X"}),  # refused by the server: 401
    ]
    for error, kwargs in failures:
        with pytest.raises(error) as caught:
            publish_hub(gguf_path, metadata, _lfs(hub), **kwargs)
        texts.append("".join(traceback.format_exception(caught.value)))
    assert "401" in texts[-1]
    assert any(path.endswith("/commit/main") for _, path in hub.requests)  # the token was used
    assert caplog.records, "huggingface_hub and forgeflow debug logs were captured"
    for text in [*texts, caplog.text, *(str(r.args) for r in caplog.records)]:
        assert TOKEN not in text and TOKEN[:-1] not in text


def _adapter(folder: Path) -> Path:
    """An adapter folder as a burst pins it (weights, config, lineage) plus a staging dot-file."""
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(secrets.token_bytes(40_000))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (folder / "lineage.json").write_text(json.dumps({"sha256": "c" * 64}))
    (folder / ".staging").write_text("not part of a release")
    return folder


def test_the_adapter_and_checkpoint_are_published_beside_their_gguf_locally_and_on_the_hub(
        artifact: tuple[Path, Path], tmp_path: Path, hub: FakeHub) -> None:
    """What a lineage names is kept: the adapter merged into the GGUF (``adapter/``) and the
    checkpoint it was converted from (``checkpoint/``) go into the same release, every file
    sha256-verified, locally and in the same Hub commit; a dot-file is left out; an empty or
    missing folder is refused before anything is written."""
    from huggingface_hub import HfApi

    gguf_path, metadata = artifact
    adapter = _adapter(tmp_path / "adapter")
    expected = {f"adapter/{p.name}": sha256_file(p) for p in adapter.iterdir() if not p.name.startswith(".")}
    record = publish_local(gguf_path, metadata, tmp_path / "store", "tiny", adapter_dir=adapter)
    folder = Path(record.location)
    assert {f.path_in_store: f.sha256 for f in record.files if f.role == "adapter"} == expected
    assert {f"adapter/{p.name}": sha256_file(p) for p in (folder / "adapter").iterdir()} == expected
    assert read_local_record(folder) == record
    without = publish_local(gguf_path, metadata, tmp_path / "store", "tiny")
    assert without.revision != record.revision  # the adapter is part of the release's identity
    checkpoint = tmp_path / "merged"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (checkpoint / "model.safetensors").write_bytes(secrets.token_bytes(30_000))
    both = publish_local(gguf_path, metadata, tmp_path / "store", "tiny", adapter_dir=adapter, checkpoint_dir=checkpoint)
    assert {f.path_in_store for f in both.files if f.role == "checkpoint"} == {"checkpoint/config.json",
                                                                              "checkpoint/model.safetensors"}
    assert sha256_file(Path(both.location) / "checkpoint" / "model.safetensors") == \
        sha256_file(checkpoint / "model.safetensors")

    pushed = publish_hub(gguf_path, metadata, _lfs(hub), token=TOKEN,
                         adapter_dir=adapter, checkpoint_dir=checkpoint)
    expected["checkpoint/model.safetensors"] = sha256_file(checkpoint / "model.safetensors")
    for path, sha in expected.items():
        assert sha256_file_bytes(hub.stored_bytes(REPO, path, pushed.revision)) == sha
    infos = HfApi(endpoint=hub.endpoint, token=TOKEN).get_paths_info(REPO, list(expected), revision=pushed.revision)
    assert sorted(i.path for i in infos) == sorted(expected)

    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no file"):
        publish_local(gguf_path, metadata, tmp_path / "store", "tiny", adapter_dir=tmp_path / "empty")
    with pytest.raises(InputError, match="checkpoint_dir .*nowhere is not a folder"):
        publish_hub(gguf_path, metadata, HubTarget(repo_id=REPO, endpoint=hub.endpoint), token=TOKEN,
                    checkpoint_dir=tmp_path / "nowhere")


def sha256_file_bytes(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_a_hub_target_is_checked_before_anything_is_read_or_sent(artifact: tuple[Path, Path]) -> None:
    """The target's fields are typed (an unknown transfer is refused when it is built), and
    ``publish_hub`` refuses a target built without validation by name, before any request."""
    from pydantic import ValidationError

    gguf_path, metadata = artifact
    with pytest.raises(ValidationError, match="transfer"):
        HubTarget(repo_id=REPO, transfer="ftp")
    nowhere = "http://127.0.0.1:9"  # nothing listens: a request would be a ModelStoreUnavailableError
    for fields, message in [({"repo_id": "no-namespace"}, "repo_id 'no-namespace' must be 'namespace/name'"),
                            ({"repo_id": REPO, "transfer": "ftp"}, r"transfer 'ftp' is not one of \['auto', 'lfs'\]")]:
        target = HubTarget.model_construct(**{"endpoint": nowhere, "revision": "main", "private": True,
                                              "transfer": "auto", **fields})
        with pytest.raises(InputError, match=message):
            publish_hub(gguf_path, metadata, target, token=None)
