"""Which candidate tasks to validate next: a repository-balanced batch (pure, no I/O).

Each batch favours repositories with no accepted task yet and spreads its slots round-robin.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from forgeflow.common.errors import InputError
from forgeflow.curation.freeze import TaskRef, stable_key

DEFAULT_BATCH_SIZE = 40


def select_batch(
    candidates: list[TaskRef],
    processed: set[str],
    accepted_per_repo: dict[str, int],
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
) -> list[str]:
    """Pick the next batch of candidates to validate (up to ``batch_size`` ids, in pick order).

    Algorithm:
        1. Drop candidates already ``processed`` and those whose image is not available.
        2. Group by repository; order each group by ``stable_key(seed, instance_id)`` (sha256: the
           same in every process and for every input order).
        3. Order repositories: no accepted task first, then fewer accepted tasks, then fewer
           processed candidates, then ``stable_key(seed, repo)``.
        4. Round-robin, at most one task per repository per round, until ``batch_size``.

    Raises:
        InputError: ``batch_size`` < 1 or duplicate instance ids.
    """
    selector = BatchSelector(candidates, seed)
    selector.mark_processed(processed)
    return selector.select(accepted_per_repo, batch_size)


class BatchSelector:
    """:func:`select_batch` kept incrementally: O(repositories + batch) per batch, not O(candidates) (30,000
    candidates take ~750 batches); :meth:`select` returns exactly what :func:`select_batch` would.

    Raises:
        InputError: duplicate instance ids (from the constructor).
    """

    def __init__(self, candidates: Sequence[TaskRef], seed: int = 0) -> None:
        """Group ``candidates`` (the run's, instance ids unique) by repository; ``seed`` as :func:`select_batch`'s."""
        self.seed = seed
        self._repo_of: dict[str, str] = {}
        groups: dict[str, list[str]] = defaultdict(list)
        for candidate in candidates:
            if candidate.instance_id in self._repo_of:
                raise InputError(f"candidates: instance id {candidate.instance_id!r} appears twice")
            self._repo_of[candidate.instance_id] = candidate.repo
            if candidate.image_available:
                groups[candidate.repo].append(candidate.instance_id)
        self._queues = {repo: sorted(ids, key=lambda instance_id: stable_key(seed, instance_id))
                        for repo, ids in groups.items()}
        self._heads = dict.fromkeys(self._queues, 0)  # each queue's first index not known to be processed
        self._pending = {repo: len(ids) for repo, ids in self._queues.items()}
        self._repo_key = {repo: stable_key(seed, repo) for repo in self._queues}
        self._available = {instance_id for ids in groups.values() for instance_id in ids}
        self._processed: set[str] = set()
        self._processed_per_repo: dict[str, int] = defaultdict(int)

    def mark_processed(self, instance_ids: Iterable[str]) -> None:
        """Take ``instance_ids`` (any of the run's, known or not, seen before or not) out of the queues."""
        for instance_id in instance_ids:
            repo = self._repo_of.get(instance_id)
            if repo is None or instance_id in self._processed:
                continue
            self._processed.add(instance_id)
            self._processed_per_repo[repo] += 1
            if instance_id in self._available:
                self._pending[repo] -= 1

    def _first(self, repo: str, n: int) -> list[str]:
        """The first ``n`` unprocessed ids of ``repo``'s queue (the head moved past processed ones)."""
        queue, head = self._queues[repo], self._heads[repo]
        while head < len(queue) and queue[head] in self._processed:
            head += 1
        self._heads[repo] = head
        out: list[str] = []
        for instance_id in queue[head:]:
            if len(out) == n:
                break
            if instance_id not in self._processed:
                out.append(instance_id)
        return out

    def select(self, accepted_per_repo: Mapping[str, int], batch_size: int = DEFAULT_BATCH_SIZE) -> list[str]:
        """The next batch, as :func:`select_batch` picks it (its Algorithm) for the ids marked processed.

        Raises:
            InputError: ``batch_size`` < 1.
        """
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        repo_order = sorted(
            (repo for repo, left in self._pending.items() if left > 0),
            key=lambda repo: (accepted_per_repo.get(repo, 0) > 0, accepted_per_repo.get(repo, 0),
                              self._processed_per_repo[repo], self._repo_key[repo]),
        )
        # how many each repository gives: the round-robin on the queue lengths alone
        take: dict[str, int] = defaultdict(int)
        taken = depth = 0
        while taken < batch_size:
            took = False
            for repo in repo_order:
                if depth < self._pending[repo]:
                    take[repo] += 1
                    taken += 1
                    took = True
                    if taken == batch_size:
                        break
            if not took:
                break
            depth += 1
        queues = {repo: self._first(repo, n) for repo, n in take.items()}
        batch: list[str] = []
        for level in range(depth + 1):
            for repo in repo_order:
                if level < take.get(repo, 0):
                    batch.append(queues[repo][level])
        return batch


def longest_first(ids: Sequence[str], seconds: Mapping[str, float]) -> list[str]:
    """``ids`` ordered longest known validation first (the longest-processing-time rule; Graham, "Bounds on
    multiprocessing timing anomalies", SIAM J. Appl. Math. 17(2), 1969).

    An unknown time counts as the median of the known ones; ties keep ``ids``' order.
    """
    known = sorted(seconds[i] for i in ids if i in seconds)
    typical = known[len(known) // 2] if known else 0.0
    return sorted(ids, key=lambda i: -seconds.get(i, typical))
