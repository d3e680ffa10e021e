"""Batch selection: unprocessed, image available, repositories without accepted tasks first."""

from __future__ import annotations

import pytest

from forgeflow.common.errors import InputError
from forgeflow.curation.freeze import TaskRef
from forgeflow.curation.selection import select_batch


def cands(repos: dict[str, int], missing_image: set[str] = frozenset()) -> list[TaskRef]:
    return [
        TaskRef(
            instance_id=f"{repo}.{i}", repo=repo, image_available=f"{repo}.{i}" not in missing_image
        )
        for repo, count in repos.items()
        for i in range(count)
    ]


def repo_of(instance_id: str) -> str:
    return instance_id.rsplit(".", 1)[0]


def test_processed_and_imageless_candidates_are_never_picked() -> None:
    pool = cands({"a/x": 3, "b/y": 3}, missing_image={"a/x.1"})
    batch = select_batch(pool, processed={"b/y.0"}, accepted_per_repo={}, batch_size=10)
    assert sorted(batch) == ["a/x.0", "a/x.2", "b/y.1", "b/y.2"]


def test_repos_without_accepted_tasks_come_first_then_fewer_accepted_then_fewer_processed() -> None:
    pool = cands({"many/acc": 2, "one/acc": 2, "none/p2": 4, "none/p0": 2})
    processed = {"none/p2.0", "none/p2.1"}
    batch = select_batch(pool, processed, {"many/acc": 5, "one/acc": 1}, batch_size=4)
    assert [repo_of(i) for i in batch] == ["none/p0", "none/p2", "one/acc", "many/acc"]


def test_round_robin_takes_one_per_repo_per_round() -> None:
    pool = cands({"a/x": 10, "b/y": 1, "c/z": 3})
    batch = select_batch(pool, set(), {}, batch_size=6, seed=1)
    first_round = {repo_of(i) for i in batch[:3]}
    assert first_round == {"a/x", "b/y", "c/z"}
    assert {repo_of(i) for i in batch[3:5]} == {"a/x", "c/z"}  # round 2: b/y is exhausted
    order = [repo_of(i) for i in batch[:3] if repo_of(i) != "b/y"]
    assert [repo_of(i) for i in batch[3:]] == order + order[:1]  # same repo order every round
    assert len(set(batch)) == 6


def test_batch_is_full_when_enough_remain_and_short_when_not() -> None:
    pool = cands({f"r/{n}": 5 for n in range(20)})
    assert len(select_batch(pool, set(), {}, batch_size=40)) == 40
    assert len(select_batch(cands({"a/x": 3}), set(), {}, batch_size=40)) == 3
    assert select_batch(pool, {c.instance_id for c in pool}, {}) == []


def test_selection_is_deterministic_for_a_seed_and_independent_of_input_order() -> None:
    pool = cands({f"r/{n}": 4 for n in range(6)})
    assert select_batch(pool, set(), {}, 10, seed=5) == select_batch(
        list(reversed(pool)), set(), {}, 10, seed=5
    )
    assert len({tuple(select_batch(pool, set(), {}, 10, seed=s)) for s in range(5)}) > 1


def test_bad_input_is_named() -> None:
    with pytest.raises(InputError, match="batch_size"):
        select_batch(cands({"a/x": 1}), set(), {}, batch_size=0)
    with pytest.raises(InputError, match="appears twice"):
        select_batch(cands({"a/x": 1}) * 2, set(), {})


def test_longest_first_starts_the_longest_known_validation_and_puts_unknown_ones_at_the_median() -> None:
    from forgeflow.curation.selection import longest_first

    seconds = {"slow": 35.0, "quick": 1.0, "mid": 5.0}
    assert longest_first(["quick", "new", "mid", "slow"], seconds) == ["slow", "new", "mid", "quick"]
    assert longest_first(["b", "a", "c"], {}) == ["b", "a", "c"]  # nothing known: the given order


def test_the_incremental_selector_picks_exactly_what_select_batch_picks_batch_after_batch() -> None:
    """The curate flow keeps one BatchSelector per run and marks each batch's candidates processed; every
    batch it picks must be select_batch's for the same processed set (random runs: repositories, missing
    images, a resumed run's processed ids, acceptances, batch sizes)."""
    import random

    from forgeflow.curation.selection import BatchSelector

    rng = random.Random(3)
    for _ in range(30):
        cands = [TaskRef(instance_id=f"c{i}", repo=f"r{rng.randrange(15)}", image_available=rng.random() > 0.1)
                 for i in range(rng.randrange(1, 300))]
        seed = rng.randrange(5)
        selector = BatchSelector(cands, seed)
        processed = {c.instance_id for c in cands if rng.random() < 0.2}
        selector.mark_processed(processed)
        accepted: dict[str, int] = {}
        repo_of = {c.instance_id: c.repo for c in cands}
        while batch := select_batch(cands, processed, accepted, size := rng.randrange(1, 40), seed):
            assert selector.select(accepted, size) == batch
            for instance_id in batch:
                if rng.random() < 0.5:
                    accepted[repo_of[instance_id]] = accepted.get(repo_of[instance_id], 0) + 1
            processed |= set(batch)
            selector.mark_processed(batch)
        assert selector.select(accepted, 5) == []
