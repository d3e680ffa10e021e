"""Trials on Ray vs in-process: the dispatch overhead per trial, and trials per minute at 1 and 2 nodes.

Run ``python -m benchmarks.dispatch [--per-project N] [--repeats N]``. It starts a local Ray cluster
(a head without sandboxes, then worker nodes with ``{"sandbox": 1}``, tests/raycluster.py; stopped by
PID), and on the demo's generated candidates (``--per-project`` of each demo project, task images
built as the lifecycle builds them and reused) measures:

* ``dispatch_overhead_s``: mean wall seconds of one validation (NOP + one Oracle run) through
  :func:`forgeflow.sandbox.dispatch.validate_on_ray` on one worker node minus the same validation
  called in-process (:func:`forgeflow.sandbox.trial.validate_candidate`), alternating order, one at a
  time; ``dispatch_overhead_per_trial_s`` is that over the trials it ran (goal <= 0.1 s per trial).
* ``trials_per_min_1_node`` / ``trials_per_min_2_nodes``: every candidate validated through Ray with
  two validations in flight, with one worker node and then two (each ``{"sandbox": 1}``).

Human lines first, then as the last line one JSON object. On one 2-core machine both nodes share the
same cores, so the 2-node figure shows the dispatch working, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.options import int_option


def _kwargs(run_key: str) -> dict[str, Any]:
    from forgeflow.sandbox.base import SandboxSpec
    from forgeflow.sandbox.trial import ValidationChecks

    return {"timeout_s": 180.0, "spec": SandboxSpec(memory_mb=2048), "run_key": run_key,
            "checks": ValidationChecks(oracle_runs=1)}


def _in_process(row: Any, run_key: str) -> tuple[float, int]:
    from forgeflow.sandbox import trial

    start = time.perf_counter()
    outcome = trial.validate_candidate(row, row.image, row.test_command, **_kwargs(run_key))
    return time.perf_counter() - start, len(outcome.trials)


def _on_ray(placement: Any, row: Any, run_key: str) -> tuple[float, int]:
    from forgeflow.sandbox import dispatch

    start = time.perf_counter()
    outcome = dispatch.validate_on_ray(placement, row, row.image, row.test_command, **_kwargs(run_key))
    return time.perf_counter() - start, len(outcome.trials)


def _throughput(placement: Any, rows: list[Any], nonce: str) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        trials = sum(n for _, n in pool.map(lambda r: _on_ray(placement, r, f"bench-tp-{nonce}"), rows))
    return trials * 60 / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (module docstring); returns the JSON object it prints last."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-project", type=int_option(1, 20), default=1, help="candidates per demo project")
    parser.add_argument("--repeats", type=int_option(1, 20), default=2, help="rounds over the candidates")
    args = parser.parse_args(argv)

    from forgeflow.common.settings import apply_container_env
    from forgeflow.config import DEMO_PROJECTS
    from forgeflow.curation.generated import build_generated
    from forgeflow.sandbox import dispatch
    from tests.raycluster import ray_head, ray_worker

    apply_container_env()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the cluster fixture polls the dashboard
    rows = build_generated(DEMO_PROJECTS, Path(tempfile.mkdtemp(prefix="forgeflow-bench-dispatch-")), args.per_project)
    nonce = uuid.uuid4().hex[:8]
    with ray_head(num_cpus=1) as head, ray_worker(head, {"sandbox": 1}):
        placement = dispatch.RayPlacement(address=head.address)
        _on_ray(placement, rows[0], f"bench-warm-{nonce}")  # the driver's connection, the worker's imports
        _in_process(rows[0], f"bench-warm-{nonce}")
        local: list[tuple[float, int]] = []
        ray_s: list[tuple[float, int]] = []
        for round_no in range(args.repeats):
            for i, row in enumerate(rows):
                key = f"bench-{nonce}-{round_no}"
                pair = [lambda r=row, k=key: local.append(_in_process(r, k + "-l")),
                        lambda r=row, k=key: ray_s.append(_on_ray(placement, r, k + "-r"))]
                for run in pair if (i + round_no) % 2 == 0 else pair[::-1]:
                    run()
        overhead = statistics.mean(s for s, _ in ray_s) - statistics.mean(s for s, _ in local)
        per_trial = overhead * len(ray_s) / sum(n for _, n in ray_s)
        print(f"{len(ray_s)} validations each way: Ray {statistics.mean(s for s, _ in ray_s):.3f} s, in-process "
              f"{statistics.mean(s for s, _ in local):.3f} s; dispatch overhead {overhead:+.3f} s per validation, "
              f"{per_trial:+.3f} s per trial (goal <= 0.1)")
        one_node = _throughput(placement, rows, nonce + "-1")
        print(f"1 sandbox node: {one_node:.1f} trials/min")
        with ray_worker(head, {"sandbox": 1}):
            two_nodes = _throughput(placement, rows, nonce + "-2")
        print(f"2 sandbox nodes: {two_nodes:.1f} trials/min (one 2-core machine: the nodes share its cores)")
        dispatch.disconnect()
    trials_run = sum(n for _, n in ray_s)
    result = {"dispatch_overhead_s": round(overhead, 3), "dispatch_overhead_per_trial_s": round(per_trial, 3),
              "validations": len(ray_s), "trials": trials_run, "trials_per_min_1_node": round(one_node, 2),
              "trials_per_min_2_nodes": round(two_nodes, 2), "candidates": len(rows)}
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
