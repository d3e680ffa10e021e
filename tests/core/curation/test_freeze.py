"""Freeze: repository-disjoint, capped, deterministic splits; manifests never overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import FreezeConflictError, InputError, PreflightError
from forgeflow.common.fsutil import sha256_file
from forgeflow.curation.freeze import (
    SplitQuotas,
    TaskRef,
    feasibility_text,
    freeze_ready,
    quota_feasibility,
    select_splits,
    verify_freeze,
    write_freeze,
)


def tasks(repos: dict[str, int]) -> list[TaskRef]:
    return [
        TaskRef(instance_id=f"{repo}.{i}", repo=repo)
        for repo, count in repos.items()
        for i in range(count)
    ]


TWELVE_REPOS = tasks({f"org/r{n:02d}": 3 + n % 4 for n in range(12)})
QUOTAS = SplitQuotas(train=16, validation=4, test=8, max_per_repo=4, min_repos=8)


def test_splits_are_repository_disjoint_capped_and_meet_quotas() -> None:
    selection = select_splits(TWELVE_REPOS, QUOTAS, seed=7)
    assert selection.ready and selection.unmet == []
    repo_sets = [set(selection.repos_per_split[s]) for s in ("train", "validation", "test")]
    assert not (
        repo_sets[0] & repo_sets[1] or repo_sets[0] & repo_sets[2] or repo_sets[1] & repo_sets[2]
    )
    for split, ids in selection.splits.items():
        assert {i.rsplit(".", 1)[0] for i in ids} == set(selection.repos_per_split[split])
        for repo in selection.repos_per_split[split]:
            assert sum(i.startswith(repo + ".") for i in ids) <= 4
    counts = selection.counts
    assert counts["train"] >= 16 and counts["validation"] >= 4 and counts["test"] >= 8
    # 12 repos of sizes 3,4,5,6 (x3) capped at 4: 3*(3+4+4+4) = 45 kept, 3*(1+2) = 9 capped.
    assert sum(counts.values()) == 45 and len(selection.capped) == 9
    # Repos required per split: ceil(8 * target / 28) -> train 5, validation 2, test 3.
    assert len(selection.repos_per_split["train"]) >= 5
    assert len(selection.repos_per_split["validation"]) >= 2
    assert len(selection.repos_per_split["test"]) >= 3


def test_min_repos_are_proportional_to_the_split_target() -> None:
    assert [QUOTAS.min_repos_for(s) for s in ("train", "validation", "test")] == [5, 2, 3]
    assert (
        SplitQuotas(train=10, validation=0, test=1, max_per_repo=1, min_repos=4).min_repos_for(
            "validation"
        )
        == 0
    )


def test_same_seed_same_selection_and_input_order_does_not_matter() -> None:
    first = select_splits(TWELVE_REPOS, QUOTAS, seed=3)
    again = select_splits(list(reversed(TWELVE_REPOS)), QUOTAS, seed=3)
    assert first == again
    other_seeds = {json.dumps(select_splits(TWELVE_REPOS, QUOTAS, seed=s).splits) for s in range(6)}
    assert len(other_seeds) > 1


def test_unmet_quotas_are_named_with_what_is_missing() -> None:
    few = tasks({"a/x": 10, "b/y": 2})
    selection = select_splits(
        few, SplitQuotas(train=8, validation=2, test=4, max_per_repo=5, min_repos=3), seed=0
    )
    assert not selection.ready
    unmet = {q.name: q for q in selection.unmet}
    assert (
        unmet["repos"].required == 3 and unmet["repos"].found == 2 and unmet["repos"].missing == 1
    )
    # a/x (5 after the cap) goes to train; b/y to test (same relative gap as validation, but
    # test misses more tasks); validation gets nothing.
    assert unmet["validation.tasks"].found == 0 and unmet["validation.tasks"].missing == 2
    assert unmet["train.tasks"].found == 5 and unmet["test.tasks"].found == 2
    assert selection.repos_per_split == {"train": ["a/x"], "validation": [], "test": ["b/y"]}


def test_freeze_ready_equals_select_splits_and_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert freeze_ready(TWELVE_REPOS, QUOTAS, seed=1) == select_splits(TWELVE_REPOS, QUOTAS, seed=1)
    assert list(tmp_path.iterdir()) == []


def test_the_manifest_bytes_are_those_of_the_code_before_one_task_model(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35 (one Task model) must not move a freeze digest: the digests of a manifest written by the code
    before it, for the same selection, inputs and version."""
    import forgeflow

    monkeypatch.setattr(forgeflow, "__version__", "0.0.0-pinned")
    manifest = write_freeze("v1", select_splits(TWELVE_REPOS, QUOTAS, seed=7), QUOTAS, 7, tmp_path,
                            {"image_digests": {"org/r00.0": "sha256:" + "a" * 64}})
    assert manifest.semantic_sha256 == "d9e63688f04013e25ad168327db84500863cd4c58a1efe0c4abd03f1b0d1e5f8"
    assert manifest.file_sha256 == "8ba8de11c8d0bebf5b5fb0851ed21d06be62f77566568956a5224e8cb76c8bcc"


def test_duplicate_instance_ids_are_rejected() -> None:
    with pytest.raises(InputError, match="appears twice"):
        select_splits(tasks({"a/x": 1}) * 2, QUOTAS)


def test_write_then_verify_and_identical_rewrite_is_a_no_op(tmp_path: Path) -> None:
    selection = select_splits(TWELVE_REPOS, QUOTAS, seed=7)
    manifest = write_freeze("v1", selection, QUOTAS, 7, tmp_path, {"accepted_sha256": "x"})
    assert manifest.path == tmp_path / "v1.json"
    assert manifest.counts == selection.counts and manifest.splits == selection.splits
    assert manifest.file_sha256 == sha256_file(manifest.path)
    document = json.loads(manifest.path.read_text())
    assert document["schema_version"] == 1 and document["seed"] == 7
    assert document["semantic_sha256"] == manifest.semantic_sha256
    mtime = manifest.path.stat().st_mtime_ns
    again = write_freeze("v1", selection, QUOTAS, 7, tmp_path, {"accepted_sha256": "x"})
    assert again == manifest and manifest.path.stat().st_mtime_ns == mtime
    assert verify_freeze(manifest.path, expected_file_sha256=manifest.file_sha256) == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1.json"]


def test_same_name_different_content_conflicts_and_names_both_digests(tmp_path: Path) -> None:
    selection = select_splits(TWELVE_REPOS, QUOTAS, seed=7)
    manifest = write_freeze("v1", selection, QUOTAS, 7, tmp_path, {})
    before = manifest.path.read_bytes()
    with pytest.raises(FreezeConflictError) as info:
        write_freeze("v1", selection, QUOTAS, 8, tmp_path, {})
    message = str(info.value)
    assert "'v1'" in message and manifest.semantic_sha256 in message
    assert manifest.path.read_bytes() == before


def test_a_tampered_manifest_fails_verification(tmp_path: Path) -> None:
    manifest = write_freeze(
        "v1", select_splits(TWELVE_REPOS, QUOTAS, seed=7), QUOTAS, 7, tmp_path, {}
    )
    document = json.loads(manifest.path.read_text())
    document["splits"]["test"].append("org/r99.0")
    document["counts"]["test"] += 1
    manifest.path.write_text(json.dumps(document))
    with pytest.raises(InputError, match="altered"):
        verify_freeze(manifest.path)


def test_a_manifest_reformatted_keeps_its_semantic_digest(tmp_path: Path) -> None:
    manifest = write_freeze(
        "v1", select_splits(TWELVE_REPOS, QUOTAS, seed=7), QUOTAS, 7, tmp_path, {}
    )
    manifest.path.write_text(json.dumps(json.loads(manifest.path.read_text())))
    reread = verify_freeze(manifest.path)
    assert reread.semantic_sha256 == manifest.semantic_sha256
    with pytest.raises(InputError, match="file sha256"):
        verify_freeze(manifest.path, expected_file_sha256=manifest.file_sha256)


def test_unready_selection_and_bad_names_are_refused(tmp_path: Path) -> None:
    unready = select_splits(tasks({"a/x": 1}), QUOTAS)
    with pytest.raises(PreflightError, match=r"train\.tasks: need 16, found"):
        write_freeze("v1", unready, QUOTAS, 0, tmp_path, {})
    ready = select_splits(TWELVE_REPOS, QUOTAS, seed=7)
    for bad in ("V1", "-v1", "a/b", "", "x" * 200):
        with pytest.raises(InputError, match="freeze name"):
            write_freeze(bad, ready, QUOTAS, 7, tmp_path, {})
    assert list(tmp_path.iterdir()) == []


def test_a_used_freeze_name_with_other_inputs_is_refused_before_any_work(tmp_path) -> None:
    """The lifecycle checks this first: a run that would freeze other content under an existing name
    used to fail only at its freeze stage, after rewriting the shared candidates file."""
    from forgeflow.common.errors import FreezeConflictError
    from forgeflow.config import LifecycleConfig
    from forgeflow.curation.freeze import (
        check_freeze_inputs,
        inputs_path,
        manifest_path,
        record_freeze_inputs,
    )

    made = LifecycleConfig().freeze_inputs()
    check_freeze_inputs("demo-v1", tmp_path, made)  # nothing frozen yet: fine
    manifest_path("demo-v1", tmp_path).write_text("{}")
    check_freeze_inputs("demo-v1", tmp_path, made)  # frozen, inputs not recorded (older freeze): fine
    recorded = record_freeze_inputs("demo-v1", tmp_path, made)
    assert recorded == inputs_path("demo-v1", tmp_path) and json.loads(recorded.read_text())["seed"] == 0
    check_freeze_inputs("demo-v1", tmp_path, made)  # same inputs: the run reuses the freeze
    no_validation = {"quotas": {"train": 2, "validation": 0, "test": 2, "max_per_repo": 4, "min_repos": 2}}
    other = LifecycleConfig(candidates_per_project=3, projects=("six", "toolz"), freeze=no_validation).freeze_inputs()
    with pytest.raises(FreezeConflictError) as err:
        check_freeze_inputs("demo-v1", tmp_path, other)
    assert "candidates_per_project: 5 then, 3 now" in str(err.value)
    assert "projects:" in str(err.value) and "choose a new freeze name" in str(err.value)
    check_freeze_inputs("demo-v2", tmp_path, other)  # another name is free
    record_freeze_inputs("demo-v1", tmp_path, other)  # a freeze is immutable: its inputs file too
    assert json.loads(recorded.read_text())["candidates_per_project"] == 5


def test_a_demo_home_frozen_by_the_flat_config_is_reused_by_the_grouped_one(tmp_path) -> None:
    """``demo-v1.inputs.json`` as the flat LifecycleConfig (train_min, ..., validation = the checks)
    recorded it: the grouped config with the same values passes the check and would record the
    same bytes."""
    from forgeflow.common.fsutil import atomic_write_json
    from forgeflow.config import LifecycleConfig
    from forgeflow.curation.freeze import check_freeze_inputs, inputs_path, manifest_path, record_freeze_inputs

    flat = {"projects": ["boltons", "cachetools", "inflection", "six", "tabulate", "toolz"],
            "candidates_per_project": 5, "seed": 0,
            "validation": {"oracle_runs": 2, "flaky_policy": "reject", "log_parser": None},
            "train_min": 2, "validation_min": 1, "test_min": 2, "max_tasks_per_repo": 4, "min_repos": 2}
    home, fresh = tmp_path / "home", tmp_path / "fresh"
    home.mkdir()
    manifest_path("demo-v1", home).write_text("{}")
    atomic_write_json(inputs_path("demo-v1", home), flat)
    check_freeze_inputs("demo-v1", home, LifecycleConfig().freeze_inputs())  # no FreezeConflictError
    fresh.mkdir()
    assert record_freeze_inputs("demo-v1", fresh, LifecycleConfig().freeze_inputs()).read_bytes() \
        == inputs_path("demo-v1", home).read_bytes()


def test_quotas_no_validation_can_meet_are_named_before_any_work() -> None:
    quotas = SplitQuotas(train=2, validation=1, test=2, max_per_repo=4, min_repos=2)
    # 2 repositories cannot fill 3 repository-disjoint splits, whatever validation accepts
    unmet = quota_feasibility({"six": 5, "toolz": 5}, quotas)
    assert [(u.name, u.required, u.found) for u in unmet] == [("splits.repos", 3, 2)]
    assert "repository-disjoint splits" in feasibility_text(unmet) and "need 3, at most 2" in feasibility_text(unmet)
    # the per-repository cap bounds the tasks: 3 repos x min(5, 1) = 3 < 5
    capped = quota_feasibility({"a": 5, "b": 5, "c": 5}, quotas.model_copy(update={"max_per_repo": 1}))
    assert [(u.name, u.required, u.found) for u in capped] == [("tasks", 5, 3)]
    # too few repositories overall; a repository without candidates does not count
    few = quota_feasibility({"a": 9, "b": 9, "c": 9, "d": 0}, quotas.model_copy(update={"min_repos": 4}))
    assert [(u.name, u.required, u.found) for u in few] == [("repos", 4, 3), ("splits.repos", 5, 3)]  # 2 + 1 + 2
    assert quota_feasibility({"a": 2, "b": 1, "c": 2}, quotas) == []


def test_quota_feasibility_agrees_with_the_selection_when_everything_is_accepted() -> None:
    """Whenever the real selection can freeze all candidates, the pre-check must not refuse them."""
    import itertools

    for counts in itertools.product(range(0, 4), repeat=4):
        repo_counts = {f"r{i}": n for i, n in enumerate(counts)}
        accepted = [TaskRef(instance_id=f"r{i}.{k}", repo=f"r{i}") for i, n in enumerate(counts) for k in range(n)]
        for quotas in (SplitQuotas(train=2, validation=1, test=2, max_per_repo=2, min_repos=2),
                       SplitQuotas(train=1, validation=0, test=1, max_per_repo=3, min_repos=1)):
            if select_splits(accepted, quotas, 0).ready:
                assert quota_feasibility(repo_counts, quotas) == [], (counts, quotas)


def test_quota_feasibility_refuses_bad_input() -> None:
    with pytest.raises(InputError, match="all 0"):
        quota_feasibility({"a": 1}, SplitQuotas(train=0, validation=0, test=0, max_per_repo=1))
    with pytest.raises(InputError, match="negative"):
        quota_feasibility({"a": -1}, SplitQuotas(train=1, validation=0, test=1, max_per_repo=1))
