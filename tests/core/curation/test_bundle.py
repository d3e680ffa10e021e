"""The export bundle: a HF DatasetDict per split, a tarball with the same bytes for the same freeze,
verified against its sidecar and the store's digest."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import datasets
import pytest

from forgeflow.common.errors import FreezeConflictError, InputError
from forgeflow.common.fsutil import sha256_file
from forgeflow.curation.bundle import (
    COLUMNS,
    BundleTask,
    bundle_paths,
    verify_bundle,
    write_bundle,
)
from forgeflow.curation.freeze import FreezeManifest, SplitQuotas, TaskRef, select_splits, write_freeze

QUOTAS = SplitQuotas(train=2, validation=1, test=1, max_per_repo=2, min_repos=3)
ACCEPTED = [TaskRef(instance_id=f"r{r}.t{i}", repo=f"org/r{r}") for r in range(4) for i in range(2)]


def bundle_tasks(ids_note: str = "") -> list[BundleTask]:
    return [BundleTask(instance_id=t.instance_id, repo=t.repo, FAIL_TO_PASS=[f"tests/test_{t.instance_id}.py::f{ids_note}"],
                       PASS_TO_PASS=["tests/test_ok.py::a", "tests/test_ok.py::b"],
                       image_ref=f"127.0.0.1:5000/task-00:{t.instance_id}", image_digest="sha256:" + "d" * 64,
                       patch_sha256="e" * 64, patch=f"--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+{t.instance_id}\n")
            for t in reversed(ACCEPTED)]  # input order must not matter


def frozen(out_dir: Path, quotas: SplitQuotas = QUOTAS, name: str = "v1") -> FreezeManifest:
    return write_freeze(name, select_splits(ACCEPTED, quotas, 3), quotas, 3, out_dir)


def test_the_same_freeze_gives_the_same_tarball_bytes_in_two_folders(tmp_path: Path) -> None:
    a = write_bundle(frozen(tmp_path / "a"), bundle_tasks())
    b = write_bundle(frozen(tmp_path / "b"), bundle_tasks())
    assert a.tarball.read_bytes() == b.tarball.read_bytes()
    assert a.sha256 == b.sha256 == sha256_file(a.tarball)
    with tarfile.open(a.tarball) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names) and names[0] == "v1.bundle" and "v1.bundle/dataset_dict.json" in names
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}


def test_another_process_writes_the_same_bytes(tmp_path: Path) -> None:
    """No per-process salt (a random dataset fingerprint, a timestamp) reaches the tarball."""
    here = write_bundle(frozen(tmp_path / "here"), bundle_tasks())
    script = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[2]);"
        "from tests.core.curation.test_bundle import bundle_tasks, frozen;"
        "from forgeflow.curation.bundle import write_bundle;"
        "print(write_bundle(frozen(Path(sys.argv[1])), bundle_tasks()).sha256)")
    root = Path(__file__).resolve().parents[3]
    child = subprocess.run([sys.executable, "-c", script, str(tmp_path / "there"), str(root)], capture_output=True,
                           text=True, timeout=120, cwd=root)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip().splitlines()[-1] == here.sha256
    assert (tmp_path / "there" / "v1.bundle.tar").read_bytes() == here.tarball.read_bytes()


def test_refreezing_the_same_inputs_keeps_the_bundle_untouched(tmp_path: Path) -> None:
    first = write_bundle(frozen(tmp_path), bundle_tasks())
    stamp = first.tarball.stat().st_mtime_ns
    again = write_bundle(frozen(tmp_path), bundle_tasks())
    assert again == first and first.tarball.stat().st_mtime_ns == stamp
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_rows_by_split_carry_what_the_freeze_knows(tmp_path: Path) -> None:
    manifest = frozen(tmp_path)
    bundle = write_bundle(manifest, bundle_tasks())
    loaded = datasets.load_from_disk(str(bundle.dataset_dir))
    assert sorted(loaded) == ["test", "train", "validation"]
    assert bundle.counts == manifest.counts
    for split, ids in manifest.splits.items():
        rows = loaded[split]
        assert rows.column_names == list(COLUMNS)
        assert rows["instance_id"] == ids and set(rows["split"]) == {split}
        repos = set(rows["repo"])
        assert repos == set(json.loads(manifest.path.read_text())["repos"][split])
    row = loaded["train"][0]
    assert row["FAIL_TO_PASS"] == [f"tests/test_{row['instance_id']}.py::f"]
    assert row["PASS_TO_PASS"] == ["tests/test_ok.py::a", "tests/test_ok.py::b"]
    assert row["image_digest"] == "sha256:" + "d" * 64 and row["patch"].endswith(f"+{row['instance_id']}\n")
    assert row["problem_statement"] is None  # not known: stays empty, never invented


def test_a_split_without_tasks_is_an_empty_dataset_that_loads(tmp_path: Path) -> None:
    quotas = SplitQuotas(train=2, validation=0, test=1, max_per_repo=2, min_repos=2)
    manifest = frozen(tmp_path, quotas)
    assert manifest.splits["validation"] == []
    bundle = write_bundle(manifest, bundle_tasks())
    loaded = datasets.load_from_disk(str(bundle.dataset_dir))
    assert loaded["validation"].num_rows == 0 and loaded["validation"].column_names == list(COLUMNS)
    assert verify_bundle(manifest, bundle.sha256) == bundle


def test_a_task_of_the_manifest_without_a_row_is_refused(tmp_path: Path) -> None:
    manifest = frozen(tmp_path)
    some = manifest.splits["test"][0]
    with pytest.raises(InputError, match=f"1 of the manifest's .* tasks have no row \\(e.g. {some}\\)"):
        write_bundle(manifest, [t for t in bundle_tasks() if t.instance_id != some])
    assert not bundle_paths("v1", tmp_path)[2].exists()


def test_other_rows_for_a_bundled_freeze_are_a_conflict(tmp_path: Path) -> None:
    first = write_bundle(frozen(tmp_path), bundle_tasks())
    with pytest.raises(FreezeConflictError, match=f"{first.sha256}.*never replaced"):
        write_bundle(frozen(tmp_path), bundle_tasks(ids_note="-revalidated"))
    assert sha256_file(first.tarball) == first.sha256


def test_a_freeze_made_before_bundles_verifies_as_absent(tmp_path: Path) -> None:
    manifest = frozen(tmp_path)
    assert verify_bundle(manifest, None) is None
    with pytest.raises(InputError, match="bundle sha256: the store records export bundle"):
        verify_bundle(manifest, "f" * 64)


def test_a_tampered_tarball_names_the_bundle_digest_and_the_file(tmp_path: Path) -> None:
    manifest = frozen(tmp_path)
    bundle = write_bundle(manifest, bundle_tasks())
    data = bytearray(bundle.tarball.read_bytes())
    data[-2000] ^= 1
    bundle.tarball.write_bytes(bytes(data))
    with pytest.raises(InputError, match=f"bundle sha256: {bundle.tarball} has sha256 [0-9a-f]{{64}}; its sidecar "
                                         f"records {bundle.sha256}"):
        verify_bundle(manifest, bundle.sha256)


def test_the_store_digest_is_checked_even_when_the_sidecar_agrees(tmp_path: Path) -> None:
    manifest = frozen(tmp_path)
    bundle = write_bundle(manifest, bundle_tasks())
    with pytest.raises(InputError, match=f"bundle sha256: {bundle.tarball} .* the store records {'0' * 64}"):
        verify_bundle(manifest, "0" * 64)


def test_an_edited_unpacked_folder_is_caught(tmp_path: Path) -> None:
    manifest = frozen(tmp_path)
    bundle = write_bundle(manifest, bundle_tasks())
    (bundle.dataset_dir / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(InputError, match=f"{bundle.dataset_dir} differs from its tarball"):
        verify_bundle(manifest, bundle.sha256)
