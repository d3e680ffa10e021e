"""Which candidate tasks to validate next: a repository-balanced batch (pure, no I/O).

Validation (NOP and Oracle runs) is the expensive step, and a freeze needs many repositories
(see :mod:`forgeflow.curation.freeze`), so each batch favours repositories that have no accepted task
yet and spreads its slots over repositories round-robin instead of draining one repository.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.curation.freeze import stable_key

DEFAULT_BATCH_SIZE = 40


class CandidateRef(BaseModel):
    """A candidate task: its id, its repository and whether its image is in the registry."""

    model_config = ConfigDict(frozen=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    image_available: bool


def select_batch(
    candidates: list[CandidateRef],
    processed: set[str],
    accepted_per_repo: dict[str, int],
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
) -> list[str]:
    """Pick the next batch of candidates to validate.

    Algorithm:
        1. Drop candidates already ``processed`` and those whose image is not available.
        2. Group the rest by repository; order each group by ``stable_key(seed, instance_id)``
           (sha256, so the order is the same in every process and for every input order).
        3. Order repositories: no accepted task first, then fewer accepted tasks, then fewer
           processed candidates, then ``stable_key(seed, repo)``.
        4. Round-robin: each round takes at most one task per repository, in that order, until
           ``batch_size`` tasks are taken or nothing is left.

    Args:
        candidates: All known candidates; instance ids must be unique.
        processed: Instance ids whose validation finished (any outcome).
        accepted_per_repo: Repository -> accepted task count (absent means 0).
        batch_size: Maximum number of ids returned (>= 1).
        seed: Changes the order inside a repository and between tied repositories.

    Returns:
        Up to ``batch_size`` instance ids, in pick order (empty when nothing is left).

    Raises:
        InputError: ``batch_size`` < 1 or duplicate instance ids.
    """
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    seen: set[str] = set()
    groups: dict[str, list[str]] = defaultdict(list)
    processed_per_repo: dict[str, int] = defaultdict(int)
    for candidate in candidates:
        if candidate.instance_id in seen:
            raise InputError(f"candidates: instance id {candidate.instance_id!r} appears twice")
        seen.add(candidate.instance_id)
        if candidate.instance_id in processed:
            processed_per_repo[candidate.repo] += 1
        elif candidate.image_available:
            groups[candidate.repo].append(candidate.instance_id)

    repo_order = sorted(
        groups,
        key=lambda repo: (
            accepted_per_repo.get(repo, 0) > 0,
            accepted_per_repo.get(repo, 0),
            processed_per_repo[repo],
            stable_key(seed, repo),
        ),
    )
    # how many each repository gives: the round-robin on the queue lengths alone, so only the ids of
    # repositories that give any are keyed (at 500,000 candidates over 1,200 repositories a batch
    # of 40 keys 40 repositories' ids, not all of them)
    take: dict[str, int] = defaultdict(int)
    taken = depth = 0
    while taken < batch_size:
        took = False
        for repo in repo_order:
            if depth < len(groups[repo]):
                take[repo] += 1
                taken += 1
                took = True
                if taken == batch_size:
                    break
        if not took:
            break
        depth += 1
    queues = {repo: heapq.nsmallest(n, groups[repo], key=lambda instance_id: stable_key(seed, instance_id))
              for repo, n in take.items()}
    batch: list[str] = []
    for level in range(depth + 1):
        for repo in repo_order:
            if level < take.get(repo, 0):
                batch.append(queues[repo][level])
    return batch


def longest_first(ids: Sequence[str], seconds: Mapping[str, float]) -> list[str]:
    """``ids`` ordered for a sliding window of validations: longest known first (the longest-
    processing-time rule: a long task started last leaves the other slots idle at the end; Graham,
    "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 17(2), 1969).

    A task without a recorded time counts as the median of the known ones (all equal when none is
    known, so the order is then ``ids``' own); ties keep ``ids``' order.

    Args:
        ids: instance ids.
        seconds: recorded validation seconds per instance id (``Store.validation_seconds``).

    Returns:
        The same ids, reordered.
    """
    known = sorted(seconds[i] for i in ids if i in seconds)
    typical = known[len(known) // 2] if known else 0.0
    return sorted(ids, key=lambda i: -seconds.get(i, typical))
