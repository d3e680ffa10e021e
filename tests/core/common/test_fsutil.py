"""Atomic writes and digests (forgeflow.common.fsutil)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from forgeflow.common import fsutil


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "manifest.json"
    fsutil.atomic_write_json(target, {"b": 1, "a": [1, 2]})
    fsutil.atomic_write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in target.parent.iterdir()] == ["manifest.json"]


def test_semantic_digest_ignores_key_order_but_not_values():
    assert fsutil.sha256_json({"a": 1, "b": [1, 2]}) == fsutil.sha256_json({"b": [1, 2], "a": 1})
    assert fsutil.sha256_json({"a": 1}) != fsutil.sha256_json({"a": 2})


def test_sha256_file_matches_hashlib(tmp_path):
    data = b"x" * (3 * (1 << 20) + 17)  # spans several read chunks
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert fsutil.sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_sha256_tree_changes_with_content_and_names(tmp_path):
    (tmp_path / "a").write_text("1")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_text("2")
    first = fsutil.sha256_tree(tmp_path)
    (tmp_path / "d" / "b").write_text("3")
    second = fsutil.sha256_tree(tmp_path)
    (tmp_path / "d" / "b").rename(tmp_path / "d" / "c")
    assert len({first, second, fsutil.sha256_tree(tmp_path)}) == 3



def test_atomic_write_gives_a_shareable_file_mode(tmp_path):
    path = fsutil.atomic_write_text(tmp_path / "summary.json", "{}")
    assert path.stat().st_mode & 0o777 == fsutil.FILE_MODE


def test_atomic_folder_replaces_on_success_and_keeps_the_old_on_failure(tmp_path: Path) -> None:
    from forgeflow.common.fsutil import atomic_folder

    target = tmp_path / "model"
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_text("v1")
        assert not target.exists()  # nothing under the final name while it is written
    assert (target / "weights").read_text() == "v1"
    with pytest.raises(RuntimeError, match="save failed"), atomic_folder(target) as tmp:
        (tmp / "weights").write_text("half")
        raise RuntimeError("save failed")
    assert (target / "weights").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # the temporary folder is gone
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_text("v2")
    assert (target / "weights").read_text() == "v2" and sorted(p.name for p in target.iterdir()) == ["weights"]


def test_atomic_output_file_for_a_tool_that_writes_a_path(tmp_path: Path) -> None:
    from forgeflow.common.fsutil import atomic_output_file

    out = tmp_path / "model.gguf"
    with pytest.raises(ValueError), atomic_output_file(out) as tmp:
        tmp.write_bytes(b"partial")
        raise ValueError("quantizer failed")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with atomic_output_file(out) as tmp:
        tmp.write_bytes(b"GGUF")
    assert out.read_bytes() == b"GGUF" and oct(out.stat().st_mode & 0o777) == "0o644"


def test_start_writeback_is_an_advice_that_changes_no_bytes(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    data = bytes(range(256)) * 4096  # 1 MiB, dirty in the page cache
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        assert fsutil.start_writeback(fd, 0, len(data)) is sys.platform.startswith("linux")
        assert fsutil.start_writeback(fd, 0, 0) is False  # nothing to write
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    read_end, write_end = os.pipe()
    try:  # a pipe has no page cache to write back: refused, not raised
        assert fsutil.start_writeback(write_end, 0, 4096) is False
    finally:
        os.close(read_end)
        os.close(write_end)
