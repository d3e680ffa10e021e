"""The ``freeze`` flow (flows/stages.py) writes the export bundle a team hands to its trainers and the
store records its digest beside the manifest's; ``forgeflow freeze verify`` checks all three.

A real flow run under the session Prefect harness, on a store per test (``flow_store_url``) holding
accepted tasks of four repositories with their validation results and task image digests.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from typer.testing import CliRunner

from forgeflow.common.fsutil import sha256_bytes, sha256_file
from forgeflow.curation.freeze import SplitQuotas
from forgeflow.ledger.records import ImageRecord, TaskRecord
from forgeflow.ledger.store import Store

QUOTAS = SplitQuotas(train=2, validation=1, test=1, max_per_repo=2, min_repos=3)
DIGEST = "sha256:" + "c" * 64


def _patch(repo: str, i: str | int) -> str:
    return f"diff --git a/{repo}.py b/{repo}.py\n--- a/{repo}.py\n+++ b/{repo}.py\n@@ -1 +1 @@\n-x = {i}\n+x = -{i}\n"


@pytest.fixture
def home(tmp_path: Path, flow_store_url: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("FORGEFLOW_HOME", str(home))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    store = Store()
    store.upgrade()
    for repo in ("alpha", "beta", "gamma", "delta"):
        for i in range(2):
            ref = f"127.0.0.1:5000/task-00:{repo}-{i}"
            store.record_image(ImageRecord(ref=ref, role="task", digest=DIGEST))
            store.record_task(TaskRecord(instance_id=f"team__{repo}-{i}", repo=f"team/{repo}", status="accepted",
                                         image_ref=ref, patch=_patch(repo, i), FAIL_TO_PASS=[f"t.py::{repo}{i}"],
                                         PASS_TO_PASS=["t.py::ok"]))
    store.record_task(TaskRecord(instance_id="team__alpha-9", repo="team/alpha", status="rejected"))
    store.dispose()
    return home


def test_the_freeze_flow_writes_records_and_verifies_its_export_bundle(prefect_harness, home: Path) -> None:
    from deployments.cli import app
    from flows.stages import FreezeParams, freeze

    manifest = freeze(FreezeParams(name="team-v1", quotas=QUOTAS))
    assert manifest.bundle_path == home / "freezes" / "team-v1.bundle.tar"
    assert manifest.bundle_sha256 == sha256_file(manifest.bundle_path)
    recorded = Store().get_freeze("team-v1")
    assert recorded is not None
    assert (recorded.bundle_sha256, recorded.bundle_path) == (manifest.bundle_sha256, str(manifest.bundle_path))

    loaded = datasets.load_from_disk(str(home / "freezes" / "team-v1.bundle"))
    assert {split: loaded[split]["instance_id"] for split in loaded} == manifest.splits
    row = loaded["train"][0]
    repo, i = row["instance_id"].removeprefix("team__").split("-")
    assert row["repo"] == f"team/{repo}" and row["split"] == "train"
    assert row["FAIL_TO_PASS"] == [f"t.py::{repo}{i}"] and row["PASS_TO_PASS"] == ["t.py::ok"]
    assert row["image_ref"] == f"127.0.0.1:5000/task-00:{repo}-{i}" and row["image_digest"] == DIGEST
    # the patch text travels with the task (a trainer rebuilds the task image or an Oracle sample from it)
    assert row["patch"] == _patch(repo, i) and row["patch_sha256"] == sha256_bytes(row["patch"].encode())
    assert "team__alpha-9" not in sum(manifest.splits.values(), [])

    again = freeze(FreezeParams(name="team-v1", quotas=QUOTAS))  # re-freezing the same inputs: the same three digests
    assert (again.semantic_sha256, again.file_sha256, again.bundle_sha256) == (
        manifest.semantic_sha256, manifest.file_sha256, manifest.bundle_sha256)

    # the store knows where the freeze flow wrote it: no --freezes-dir needed
    result = CliRunner().invoke(app, ["freeze", "verify", "team-v1"])
    assert result.exit_code == 0, result.output
    assert f"bundle sha256 {manifest.bundle_sha256}" in result.output and "matches the store" in result.output
