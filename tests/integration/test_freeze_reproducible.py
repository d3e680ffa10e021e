"""Same commit, two homes, one freeze digest: generation, validation and selection repeat exactly.

Each home runs what the lifecycle runs up to its freeze, on two pinned projects (inflection,
cachetools; their suites take about a second): checkouts under the home, SWE-smith candidates
(seeded), task images, NOP and repeated Oracle runs in podman with the verifier's pinned
environment, repository-disjoint splits, the manifest with the task images it names. The two
manifests must have the same semantic sha256. Task images are shared through podman's storage (tags
are digests of their inputs), as two homes on one machine share them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeflow.common.settings import apply_container_env
from forgeflow.curation.bugs import generate_candidates
from forgeflow.curation.freeze import (
    SplitQuotas,
    TaskRef,
    select_splits,
    write_freeze,
)
from forgeflow.registry.images import build_task_image
from forgeflow.registry.projects import get_project, prepare_checkout
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.trial import validate_candidate
from tests.helpers import ensure_env_image

pytestmark = pytest.mark.integration

PROJECTS = ("inflection", "cachetools")
QUOTAS = SplitQuotas(train=1, validation=0, test=1, max_per_repo=2, min_repos=2)


def _freeze_in(home: Path) -> tuple[str, dict, list[str]]:
    accepted, image_ids, reasons = [], {}, []
    for name in PROJECTS:
        project = get_project(name)
        checkout = prepare_checkout(project, home / "checkouts" / name)
        env = ensure_env_image(project)
        for candidate in generate_candidates(name, checkout, project.source_path, 3, 0):
            image = build_task_image(env.name, candidate.instance_id, candidate.patch)
            outcome = validate_candidate(candidate, image.name, project.test_command, timeout_s=180,
                                         spec=SandboxSpec(memory_mb=1024), run_key=f"repro-{home.name}")
            assert outcome.report is not None, outcome.failed_trial
            reasons.append(f"{candidate.instance_id}: {outcome.report.reason}")
            if outcome.report.accepted:
                accepted.append(TaskRef(instance_id=candidate.instance_id, repo=name))
                image_ids[candidate.instance_id] = image.image_id
    manifest = write_freeze("repro-v1", select_splits(accepted, QUOTAS, 0), QUOTAS, 0, home / "freezes",
                            {"image_ids": image_ids})
    return manifest.semantic_sha256, manifest.splits, reasons


def test_two_homes_from_the_same_commit_freeze_the_same_digest(tmp_path: Path, monkeypatch) -> None:
    apply_container_env()
    digests = []
    for label in ("home-a", "home-b"):
        home = tmp_path / label
        monkeypatch.setenv("FORGEFLOW_HOME", str(home))
        digests.append(_freeze_in(home))
    (digest_a, splits_a, reasons_a), (digest_b, splits_b, reasons_b) = digests
    assert reasons_a == reasons_b  # every candidate got the same verdict for the same reason
    assert splits_a == splits_b and sum(len(v) for v in splits_a.values()) >= 2
    assert digest_a == digest_b
