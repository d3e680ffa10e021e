"""Tag sanitizing and the base-sharded-tags layout (pure; no registry needed)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from pydantic import ValidationError

from forgeflow.common.errors import InputError, PlanRejectedError
from forgeflow.registry.layout import (
    TAG_PATTERN,
    ShardLayout,
    basecache_tag,
    sanitize_tag,
)


def _digest(seed: str) -> str:
    return "sha256:" + hashlib.sha256(seed.encode()).hexdigest()


NASTY_IDS = [
    "a" * 66 + "/b" * 40,  # long, with slashes
    "x" * 200,  # valid characters, too long
    "Owner__Repo.ABC123.func_pm_ctrl_shuffle__9x7k",  # uppercase (already valid)
    ".hidden-task",  # leading dot
    "-dash-first",
    "../../etc/passwd",
    "owner/repo:tag@sha",
    "spaces and\ttabs\nnewline",
    "ünïcödé-task-名字",
    "_",
]


@pytest.mark.parametrize("task_id", NASTY_IDS)
def test_sanitized_tags_fit_the_oci_grammar(task_id: str) -> None:
    tag = sanitize_tag(task_id)
    assert TAG_PATTERN.fullmatch(tag), tag
    assert len(tag) <= 128


def test_valid_ids_are_kept_and_changed_ids_carry_their_hash() -> None:
    assert sanitize_tag("django__django-11099") == "django__django-11099"
    assert sanitize_tag("Owner__Repo.X") == "Owner__Repo.X"
    long_id = "a" * 66 + "/b" * 40
    tag = sanitize_tag(long_id)
    assert tag.endswith("-" + hashlib.sha256(long_id.encode()).hexdigest()[:10])
    assert len(tag) == 128
    assert sanitize_tag(".hidden").startswith("_hidden-")


def test_ids_that_sanitize_alike_get_distinct_tags() -> None:
    ids = ["owner/repo", "owner:repo", "owner repo", "owner@repo", "owner-repo"]
    tags = [sanitize_tag(i) for i in ids]
    assert len(set(tags)) == len(ids), tags
    long_a, long_b = "t" * 130 + "A", "t" * 130 + "B"  # same after truncation
    assert sanitize_tag(long_a) != sanitize_tag(long_b)


def test_sanitize_is_deterministic_and_rejects_empty() -> None:
    assert [sanitize_tag(i) for i in NASTY_IDS] == [sanitize_tag(i) for i in NASTY_IDS]
    with pytest.raises(InputError, match="task_id is empty"):
        sanitize_tag("")


def test_basecache_tag_uses_twelve_hex_and_rejects_bad_digests() -> None:
    digest = "sha256:" + "0123456789ab" + "f" * 52
    assert basecache_tag(digest) == "basecache-0123456789ab"
    for bad in ["0123", "sha256:XYZ", "md5:" + "a" * 64, "sha256:" + "A" * 64]:
        with pytest.raises(InputError, match="base digest"):
            basecache_tag(bad)


def test_place_follows_the_documented_rule() -> None:
    layout = ShardLayout()
    base = _digest("base-1")
    placement = layout.place("six__six.1234.func_pm__abc", base)
    primary = int(base[7:15], 16) % 80
    lane = int(hashlib.sha256(b"six__six.1234.func_pm__abc").hexdigest()[:8], 16) % 5
    assert placement.lane == lane
    assert placement.shard == (primary + lane) % 80
    assert placement.repository == f"task-{placement.shard:02d}"
    assert layout.place("six__six.1234.func_pm__abc", base) == placement


def test_one_base_spreads_over_its_lanes_only() -> None:
    layout = ShardLayout(shards=80, lanes=5)
    base = _digest("base-lanes")
    primary = int(base[7:15], 16) % 80
    placements = [layout.place(f"task-{i}", base) for i in range(500)]
    lanes = Counter(p.lane for p in placements)
    assert set(lanes) == set(range(5))
    assert min(lanes.values()) >= 60  # ~100 each; a broken hash would pile them up
    assert {p.shard for p in placements} == {(primary + lane) % 80 for lane in range(5)}


def test_plan_counts_task_and_basecache_tags_per_repository() -> None:
    layout = ShardLayout(shards=3, lanes=1, tag_cap=100)
    bases = [_digest(f"b{i}") for i in range(4)]
    tasks = [(f"t{i}", bases[i % 4]) for i in range(20)]
    plan = layout.plan(tasks)
    assert [p.task_id for p in plan.placements] == [t for t, _ in tasks]
    for repo, count in plan.projected_tag_counts.items():
        in_repo = [p for p in plan.placements if p.repository == repo]
        used_bases = {p.base_digest for p in in_repo}
        assert plan.basecache[repo] == {basecache_tag(b): b for b in used_bases}
        assert count == len(in_repo) + len(used_bases)
    assert plan.basecache_tag_count == sum(len(v) for v in plan.basecache.values())
    assert plan.rejected_repositories == []
    assert plan.check() is plan


def test_plan_over_the_cap_is_rejected_naming_each_repository() -> None:
    layout = ShardLayout(shards=2, lanes=1, tag_cap=5)
    base = _digest("one-base")
    repo = layout.place("x", base).repository
    plan = layout.plan([(f"task-{i}", base) for i in range(5)])  # 5 tasks + 1 basecache = 6
    assert plan.rejected_repositories == [repo]
    assert plan.projected_tag_counts[repo] == 6
    with pytest.raises(PlanRejectedError, match=rf"{repo} \(6 tags\)"):
        plan.check()
    ok = layout.plan([(f"task-{i}", base) for i in range(4)])  # exactly at the cap
    assert ok.check() is ok


def test_plan_rejects_repeated_task_ids_and_bad_layouts() -> None:
    with pytest.raises(InputError, match="repeated"):
        ShardLayout().plan([("a", _digest("1")), ("a", _digest("2"))])
    with pytest.raises(ValidationError, match="lanes"):
        ShardLayout(shards=3, lanes=4)
    for bad in ("Bad/Prefix", "team//task", "/task", "team/task/", "../task"):
        with pytest.raises(ValidationError):
            ShardLayout(prefix=bad)
    # a registry namespace may lead the prefix: the shard repositories are then paths under it
    layout = ShardLayout(shards=2, lanes=1, prefix="team/agents/task")
    assert [layout.repository(i) for i in range(2)] == ["team/agents/task-00", "team/agents/task-01"]


def test_an_id_whose_sanitized_tag_equals_another_valid_id_is_rejected() -> None:
    """'a/b1' sanitizes to 'a-b1-<hash>'; a task literally named so would share its image tag."""
    clashing = sanitize_tag("a/b1")
    with pytest.raises(InputError, match=r"same image tag.*'a/b1'") as info:
        ShardLayout().plan([("a/b1", _digest("1")), (clashing, _digest("1"))])
    assert clashing in str(info.value)


@pytest.mark.parametrize("kwargs,message", [
    (dict(shards=0), r"shards=0: Input should be greater than or equal to 1"),
    (dict(shards=4, lanes=5), r"lanes \(5\) must not exceed shards \(4\)"),
    (dict(tag_cap=0), r"tag_cap=0: Input should be greater than or equal to 1"),
    (dict(prefix="Task/x"), r"prefix='Task/x': String should match pattern"),
])
def test_shard_layout_names_the_bad_parameter(kwargs: dict, message: str) -> None:
    from forgeflow.registry.layout import shard_layout

    params = dict(shards=80, lanes=5, prefix="task", tag_cap=100) | kwargs
    with pytest.raises(InputError, match=message):
        shard_layout(**params)
    assert shard_layout(80, 5, "task", 100) == ShardLayout()
