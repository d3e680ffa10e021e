"""A full disk during a GGUF write: a real 16 MiB tmpfs (mounted by the fixture; the tests run as
root) receives the tiny model's GGUF from the converter, the quantizer and the metadata editor.
Each fails with DiskFullError naming the file, leaves nothing under the final name (an older file
there is kept byte for byte), removes its temporary file and gives the space back."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgeflow.common.errors import DiskFullError, GGUFError, InfraError
from forgeflow.common.fsutil import atomic_write_bytes, free_bytes, sha256_file
from forgeflow.common.settings import cache_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TMPFS_MIB = 16  # the tiny model's GGUFs are 49 MB (Q8_0) and 87 MB (f16)


@pytest.fixture(scope="module")
def tiny() -> dict[str, Path]:
    """The seed-0 tiny model: HF folder, f16 and Q8_0 GGUFs (built once per machine, as in
    tests/integration/test_serving.py)."""
    from forgeflow.packaging.base_model import build_tiny_model
    from forgeflow.packaging.gguf import convert_to_gguf, quantize

    root = cache_dir() / "test-fixtures" / "tiny-seed0"
    f16, q8 = root / "tiny-f16.gguf", root / "tiny-q8_0.gguf"
    if not (f16.is_file() and q8.is_file() and (root / "hf" / "config.json").is_file()):
        record = build_tiny_model(root / "hf", seed=0)
        convert_to_gguf(record.path, f16, outtype="f16")
        quantize(f16, q8, "Q8_0")
    return {"hf": root / "hf", "f16": f16, "q8": q8}


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 16 MiB tmpfs, unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path_factory.mktemp("small-fs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m,mode=0755", "forgeflow-test", str(mount_point)],
                   check=True, capture_output=True, timeout=30)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, capture_output=True, timeout=30)


@pytest.fixture
def models_dir(small_fs: Path) -> Iterator[Path]:
    """An empty folder on the tmpfs; asserts afterwards that the failure gave every byte back."""
    folder = small_fs / "models"
    folder.mkdir()
    capacity = free_bytes(small_fs)
    yield folder
    for leftover in folder.iterdir():
        leftover.unlink()
    folder.rmdir()
    assert free_bytes(small_fs) == capacity


def _assert_clean_failure(exc: DiskFullError, final: Path, small_fs: Path) -> None:
    assert isinstance(exc, InfraError) and not isinstance(exc, GGUFError)  # infrastructure, not bad input
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    assert str(final) in str(exc) and str(small_fs) in str(exc)
    assert not final.exists()
    assert list(final.parent.iterdir()) == []  # no temporary file either


def test_quantize_into_a_full_disk(tiny: dict[str, Path], models_dir: Path, small_fs: Path) -> None:
    from forgeflow.packaging.gguf import quantize

    final = models_dir / "tiny-q8_0.gguf"
    with pytest.raises(DiskFullError) as info:
        quantize(tiny["f16"], final, "Q8_0")
    _assert_clean_failure(info.value, final, small_fs)
    assert "Q8_0" in str(info.value)

    # an older file under the final name is kept byte for byte
    final.write_bytes(b"GGUF previous generation\n" * 1000)
    before = sha256_file(final)
    with pytest.raises(DiskFullError):
        quantize(tiny["f16"], final, "Q8_0")
    assert sha256_file(final) == before
    assert [p.name for p in models_dir.iterdir()] == [final.name]


def test_metadata_edit_into_a_full_disk(tiny: dict[str, Path], models_dir: Path, small_fs: Path) -> None:
    from forgeflow.packaging.gguf_metadata import MetadataEdit, apply_metadata_edits

    final = models_dir / "tiny-renamed.gguf"
    source = sha256_file(tiny["q8"])
    with pytest.raises(DiskFullError) as info:
        apply_metadata_edits(tiny["q8"], [MetadataEdit(op="set", key="general.name", value="renamed-tiny")],
                             out_path=final)
    _assert_clean_failure(info.value, final, small_fs)
    assert sha256_file(tiny["q8"]) == source  # the source is intact


def test_convert_into_a_full_disk(tiny: dict[str, Path], models_dir: Path, small_fs: Path) -> None:
    from forgeflow.packaging.gguf import convert_to_gguf

    final = models_dir / "tiny-f16.gguf"
    with pytest.raises(DiskFullError) as info:
        convert_to_gguf(tiny["hf"], final, outtype="f16")
    _assert_clean_failure(info.value, final, small_fs)
    # the converter's own words are kept as the cause (numpy's fallocate check or ENOSPC)
    assert "Not enough free space to write" in str(info.value) or "No space left" in str(info.value)


def test_atomic_write_into_a_full_disk_then_a_small_write_fits(models_dir: Path, small_fs: Path) -> None:
    final = models_dir / "state.json"
    with pytest.raises(DiskFullError) as info:
        atomic_write_bytes(final, b"\0" * ((TMPFS_MIB + 1) << 20))
    _assert_clean_failure(info.value, final, small_fs)
    assert atomic_write_bytes(final, b"{}\n").read_bytes() == b"{}\n"
