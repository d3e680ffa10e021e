"""Curation at scale: batch selection, the freeze check and recording a batch of trials.

Run ``python -m benchmarks.curation [--seed N] [--repeats N] [--flow-per-project N] [--concurrency N]
[--c8-candidates N] [--c8-concurrency N] [--c8-sleep-s S] [--skip-flow]``. It prints one human line per
figure (the median wall time of ``--repeats`` runs and its ratio to its target) and, as the LAST
line, one JSON object::

    {"select_batch_50k_s": ..., "freeze_check_3k_s": ..., "record_batch_40_s": ...,
     "flow_vs_loop_ratio": ..., "flow_vs_loop": {...},
     "flow_vs_loop_ratio_c8": ..., "flow_vs_loop_c8": {...}, ...}

Targets: selecting one batch of 40 from 50,000 candidates over 120 repositories
< 0.5 s; the freeze check on 3,000 accepted tasks over 120 repositories with the default quotas
(train 350, validation 75, test 75, at least 70 repositories, at most 20 per repository) < 1 s;
recording a 40-trial batch in a SQLite store < 0.2 s. A ratio <= 1.0 meets the target. How cost
grows: ``select_batch_500k_s`` and ``freeze_check_30k_s`` are the first two at 10x (500,000
candidates, 30,000 accepted, 1,200 repositories), same targets (selection keys only the ids of the
repositories a batch takes from, so it grows with the candidates scanned, not with a sort of each).

``flow_vs_loop_ratio`` (goal <= 1.10): the ``curate`` flow's wall time over that of a plain Python
loop (a thread pool of the same size calling :func:`forgeflow.sandbox.trial.validate_candidate`) doing
the same NOP/Oracle sandbox runs on the demo's tasks: ``--flow-per-project`` generated candidates
(default 2) of each demo project, task images built as the lifecycle builds them
(:func:`forgeflow.curation.generated.build_generated`; reused when they exist), ``--concurrency`` at a time
(default 2: this machine's cores). ``flow_vs_loop_ratio_c8`` (same goal): ``--c8-candidates`` (default 16,
0 skips it) spread over the demo projects, ``--c8-concurrency`` (default 8) at a time, each test
command prefixed with ``sleep S &&`` (``--c8-sleep-s``, default 12 s): real containers and the real
grading, but waiting, so 8 validations in flight are not capped by 2 cores. Order per measurement:
loop, flow, loop; the baseline is the mean of the two loops. The flow runs in-process on a fresh
PREFECT_HOME (no cache hit), a fresh SQLite store per measurement and quotas met only if every
candidate is accepted (it validates every candidate, one batch), after a warm-up flow has started
the Prefect API (its start-up is not counted). ``flow_vs_loop`` / ``flow_vs_loop_c8`` say where the
flow's extra time goes, from Prefect's own task-run times: before the first validation starts (load,
image check, freeze check), inside validation task runs (``task_run_overhead_s``: engine overhead per
task run, vs. the loop's calls), and after the last one ends (recording, artifacts, the final freeze
check); ``overhead_per_validation_s`` is the flow's extra wall time over the validations, and
``load_avg_1m`` the load average before and after (:mod:`benchmarks.curation_flow`).

The catalogue of the first three figures is synthetic and seeded, so every run measures the same input.
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

from benchmarks.curation_flow import FlowBenchOptions, bench_flow_vs_loop
from benchmarks.options import int_option, number_option
from forgeflow.curation.freeze import SplitQuotas, TaskRef, freeze_ready
from forgeflow.curation.selection import select_batch
from forgeflow.ledger.records import TrialRecord
from forgeflow.ledger.store import Store

CANDIDATES = 50_000
REPOS = 120
ACCEPTED = 3_000
BATCH_SIZE = 40
DEFAULT_QUOTAS = SplitQuotas(train=350, validation=75, test=75, max_per_repo=20, min_repos=70)
"""The default freeze quotas of the ``curate`` flow."""

TARGETS_S = {"select_batch_50k_s": 0.5, "freeze_check_3k_s": 1.0, "record_batch_40_s": 0.2,
             "select_batch_500k_s": 0.5, "freeze_check_30k_s": 1.0}
"""Targets in seconds; the ``500k`` / ``30k`` figures are the same measures at 10x (500,000 candidates
and 30,000 accepted tasks over 1,200 repositories) with the same targets."""
SCALE = 10


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
) -> tuple[list[TaskRef], set[str], dict[str, int]]:
    """A seeded catalogue: candidates with skewed repository sizes, 10 % processed.

    Returns:
        (candidates, processed ids, accepted count per repository). About 92 % of images are
        available; a third of the repositories already have accepted tasks.
    """
    rng = random.Random(seed)
    repo_names = [f"org{r % 17:02d}/project-{r:03d}" for r in range(repos)]
    weights = [1.0 / (1 + r % 30) for r in range(repos)]  # a long tail of small repositories
    refs: list[TaskRef] = []
    processed: set[str] = set()
    chosen = rng.choices(repo_names, weights=weights, k=candidates)
    for n, repo in enumerate(chosen):
        instance_id = f"{repo.replace('/', '__')}.{n:06x}.func_pm_{rng.randrange(1 << 24):06x}"
        refs.append(
            TaskRef(instance_id=instance_id, repo=repo, image_available=rng.random() < 0.92)
        )
        if rng.random() < 0.10:
            processed.add(instance_id)
    accepted = {repo: rng.randint(1, 25) for repo in repo_names[: repos // 3]}
    return refs, processed, accepted


def synthetic_accepted(seed: int, tasks: int = ACCEPTED, repos: int = REPOS) -> list[TaskRef]:
    """``tasks`` accepted tasks spread (unevenly, seeded) over ``repos`` repositories."""
    rng = random.Random(seed + 1)
    repo_names = [f"org/accepted-{r:03d}" for r in range(repos)]
    return [
        TaskRef(instance_id=f"acc-{n:05d}", repo=repo)
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
    """Run the three benchmarks, print human lines then the JSON object (last line).

    Every numeric option is checked before any work: a bad one exits 2 with one argparse-style
    line naming the option and value.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.curation", description=__doc__)
    parser.add_argument("--seed", type=int_option(0, 2**32 - 1), default=0, help="0 to 2**32-1")
    parser.add_argument("--repeats", type=int_option(1, 1_000), default=5,
                        help="runs per figure; times are medians (1-1000)")
    parser.add_argument("--flow-per-project", type=int_option(1, 100), default=2,
                        help="generated candidates per demo project for flow_vs_loop_ratio (1-100)")
    parser.add_argument("--concurrency", type=int_option(1, 64), default=2,
                        help="validations at once (flow and loop; 1-64)")
    parser.add_argument("--c8-candidates", type=int_option(0, 600), default=16,
                        help="candidates of the concurrency-8 measurement (0 skips it; 0-600)")
    parser.add_argument("--c8-concurrency", type=int_option(1, 64), default=8,
                        help="validations at once in that measurement (1-64)")
    parser.add_argument("--c8-sleep-s", type=number_option(0.0, 600.0, "seconds"), default=12.0,
                        help="seconds each of its test runs sleeps before the tests (0-600)")
    parser.add_argument("--skip-flow", action="store_true",
                        help="leave both flow_vs_loop ratios null (no podman)")
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

    big_refs, big_processed, big_accepted_per_repo = synthetic_catalogue(args.seed, CANDIDATES * SCALE, REPOS * SCALE)
    select_10x_s = _median_s(
        lambda i: select_batch(big_refs, big_processed, big_accepted_per_repo, BATCH_SIZE, args.seed + i),
        args.repeats,
    )
    big_accepted = synthetic_accepted(args.seed, ACCEPTED * SCALE, REPOS * SCALE)
    freeze_10x_s = _median_s(lambda i: freeze_ready(big_accepted, DEFAULT_QUOTAS, args.seed + i), args.repeats)
    print(f"at {SCALE}x: select_batch over {len(big_refs):,} candidates, freeze_ready over {len(big_accepted):,} "
          f"accepted ({REPOS * SCALE} repos)")


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
        "select_batch_500k_s": round(select_10x_s, 4),
        "freeze_check_30k_s": round(freeze_10x_s, 4),
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
        "flow_vs_loop_ratio_c8": None,
        "repeats": args.repeats,
        "seed": args.seed,
        "python": sys.version.split()[0],
    }
    if not args.skip_flow:
        flow = bench_flow_vs_loop(FlowBenchOptions(
            per_project=args.flow_per_project, concurrency=args.concurrency, c8_candidates=args.c8_candidates,
            c8_concurrency=args.c8_concurrency, c8_sleep_s=args.c8_sleep_s))
        result.update(flow)
        for key, ratio_key in (("flow_vs_loop", "flow_vs_loop_ratio"), ("flow_vs_loop_c8", "flow_vs_loop_ratio_c8")):
            ratio = flow[ratio_key]
            if ratio is not None:
                print(f"{key}: ratio {ratio:.3f} (goal <= 1.10: {'meets' if ratio <= 1.10 else 'MISSES'}); "
                      f"{json.dumps(flow[key])}")
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
