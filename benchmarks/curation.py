"""Curation at scale: batch selection, the freeze check and recording a batch of trials.

Run ``python -m benchmarks.curation [--seed N] [--repeats N]``. It prints one human line per
figure (the median wall time of ``--repeats`` runs and its ratio to the target of issue 3) and,
as the LAST line, one JSON object::

    {"select_batch_50k_s": ..., "freeze_check_3k_s": ..., "record_batch_40_s": ...,
     "flow_vs_loop_ratio": null, ...}

Targets (issue 3): selecting one batch of 40 from 50,000 candidates over 120 repositories
< 0.5 s; the freeze check on 3,000 accepted tasks over 120 repositories with the default quotas
(train 350, validation 75, test 75, at least 70 repositories, at most 20 per repository) < 1 s;
recording a 40-trial batch in a SQLite store < 0.2 s. A ratio <= 1.0 meets the target.

``flow_vs_loop_ratio`` (the curate flow's wall time over a plain loop's) is null until the
curate flow exists. The catalogue is synthetic and seeded, so every run measures the same input.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forgeflow.freeze import AcceptedTask, SplitQuotas, freeze_ready
from forgeflow.selection import CandidateRef, select_batch
from forgeflow.store import Store, TrialRecord

CANDIDATES = 50_000
REPOS = 120
ACCEPTED = 3_000
BATCH_SIZE = 40
DEFAULT_QUOTAS = SplitQuotas(train=350, validation=75, test=75, max_per_repo=20, min_repos=70)
"""The default freeze quotas of issue 3."""

TARGETS_S = {"select_batch_50k_s": 0.5, "freeze_check_3k_s": 1.0, "record_batch_40_s": 0.2}


def _median_s(run: Callable[[int], Any], repeats: int) -> float:
    """Median wall seconds of ``run(i)`` over ``repeats`` calls (``time.perf_counter``)."""
    samples = []
    for i in range(repeats):
        start = time.perf_counter()
        run(i)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def synthetic_catalogue(
    seed: int, candidates: int = CANDIDATES, repos: int = REPOS
) -> tuple[list[CandidateRef], set[str], dict[str, int]]:
    """A seeded catalogue: candidates with skewed repository sizes, 10 % processed.

    Returns:
        (candidates, processed ids, accepted count per repository). About 92 % of images are
        available; a third of the repositories already have accepted tasks.
    """
    rng = random.Random(seed)
    repo_names = [f"org{r % 17:02d}/project-{r:03d}" for r in range(repos)]
    weights = [1.0 / (1 + r % 30) for r in range(repos)]  # a long tail of small repositories
    refs: list[CandidateRef] = []
    processed: set[str] = set()
    chosen = rng.choices(repo_names, weights=weights, k=candidates)
    for n, repo in enumerate(chosen):
        instance_id = f"{repo.replace('/', '__')}.{n:06x}.func_pm_{rng.randrange(1 << 24):06x}"
        refs.append(
            CandidateRef(instance_id=instance_id, repo=repo, image_available=rng.random() < 0.92)
        )
        if rng.random() < 0.10:
            processed.add(instance_id)
    accepted = {repo: rng.randint(1, 25) for repo in repo_names[: repos // 3]}
    return refs, processed, accepted


def synthetic_accepted(seed: int, tasks: int = ACCEPTED, repos: int = REPOS) -> list[AcceptedTask]:
    """``tasks`` accepted tasks spread (unevenly, seeded) over ``repos`` repositories."""
    rng = random.Random(seed + 1)
    repo_names = [f"org/accepted-{r:03d}" for r in range(repos)]
    return [
        AcceptedTask(instance_id=f"acc-{n:05d}", repo=repo)
        for n, repo in enumerate(rng.choices(repo_names, k=tasks))
    ]


def _trials(repeat: int, tag: str) -> list[TrialRecord]:
    return [
        TrialRecord(
            trial_id=f"{tag}-{repeat}.nop.{i:03d}",
            instance_id=f"task-{i:03d}",
            batch_id=f"{tag}-{repeat}",
            kind="nop",
            reward=0.0 if i % 3 else 1.0,
            timings={"sandbox_s": 1.5, "verifier_s": 0.4},
        )
        for i in range(BATCH_SIZE)
    ]


def bench_record_batch(repeats: int) -> tuple[float, float]:
    """Median seconds to record 40 trials in a fresh SQLite store, two ways.

    Returns:
        (``Store.record_trials`` of the batch: one transaction, what the flows use;
        ``Store.record_trial`` x40: one transaction and commit per trial, the baseline).
    """
    with tempfile.TemporaryDirectory(prefix="forgeflow-bench-") as tmp:
        store = Store(f"sqlite:///{Path(tmp) / 'store.db'}")
        store.upgrade()
        try:

            def record_batch(repeat: int) -> None:
                store.record_trials(_trials(repeat, "bulk"))

            def record_one_by_one(repeat: int) -> None:
                for trial in _trials(repeat, "single"):
                    store.record_trial(trial)

            record_batch(-1)  # warm the connection pool and SQLAlchemy's statement cache
            record_one_by_one(-1)
            return _median_s(record_batch, repeats), _median_s(record_one_by_one, repeats)
        finally:
            store.dispose()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the three benchmarks, print human lines then the JSON object (last line)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.curation", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    refs, processed, accepted_per_repo = synthetic_catalogue(args.seed)
    batch = select_batch(refs, processed, accepted_per_repo, batch_size=BATCH_SIZE, seed=args.seed)
    select_s = _median_s(
        lambda i: select_batch(refs, processed, accepted_per_repo, BATCH_SIZE, args.seed + i),
        args.repeats,
    )
    print(
        f"select_batch: {len(refs):,} candidates over {len({r.repo for r in refs})} repos, "
        f"{len(processed):,} processed -> batch of {len(batch)} from "
        f"{len({r.repo for r in refs if r.instance_id in set(batch)})} repos"
    )

    accepted = synthetic_accepted(args.seed)
    selection = freeze_ready(accepted, DEFAULT_QUOTAS, args.seed)
    freeze_s = _median_s(
        lambda i: freeze_ready(accepted, DEFAULT_QUOTAS, args.seed + i), args.repeats
    )
    print(
        f"freeze_ready: {len(accepted):,} accepted over {len({t.repo for t in accepted})} repos -> "
        f"ready={selection.ready}, counts={selection.counts}, capped={len(selection.capped)}"
    )

    record_s, record_one_by_one_s = bench_record_batch(args.repeats)
    print(
        f"record_trials of {BATCH_SIZE}: {record_s:.4f} s in one transaction; "
        f"{record_one_by_one_s:.4f} s one transaction per trial "
        f"(batch is {record_one_by_one_s / record_s:.1f}x faster)"
    )

    figures = {
        "select_batch_50k_s": round(select_s, 4),
        "freeze_check_3k_s": round(freeze_s, 4),
        "record_batch_40_s": round(record_s, 4),
    }
    for key, value in figures.items():
        ratio = value / TARGETS_S[key]
        verdict = "meets" if ratio <= 1.0 else "MISSES"
        print(f"{key}: {value:.4f} s = {ratio:.2f} x target {TARGETS_S[key]} s ({verdict})")
    result: dict[str, Any] = {
        **figures,
        "ratios_to_target": {k: round(v / TARGETS_S[k], 3) for k, v in figures.items()},
        "record_batch_40_one_by_one_s": round(record_one_by_one_s, 4),
        "flow_vs_loop_ratio": None,
        "flow_vs_loop_note": "curate flow not built yet; measured once it exists (goal <= 1.10)",
        "repeats": args.repeats,
        "seed": args.seed,
        "python": sys.version.split()[0],
    }
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
