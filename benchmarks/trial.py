"""Trials at the speed of the container: forgeflow's NOP/Oracle validation vs raw ``podman run --rm``.

Run ``python -m benchmarks.trial [--per-project N] [--repeats N] [--concurrency N]``. It prints one
human line per figure and, as the LAST line, one JSON object::

    {"overhead_per_trial_s": ..., "validation_s": ..., "raw_validation_s": ..., "throughput_per_min": ...,
     "throughput_limit_per_min": ..., "throughput_vs_limit": ..., ...}

What is compared, candidate by candidate (the demo's generated candidates, ``--per-project`` of each
demo project, task images built as the lifecycle builds them and reused when they exist):

* forgeflow: :func:`forgeflow.sandbox.trial.validate_candidate` (NOP in a fresh container, then the
  Oracle in another: bug patch reverted, tests run, both graded from forgeflow's report plugin; on
  podman each run is the container's own process, ``PodmanSandbox.run_once``), as
  the ``curate`` flow's validation task calls it, without Prefect, with one Oracle run
  (``oracle_runs=1``; the default repeats an accepted task's Oracle once for flakiness).
* raw: the same two container runs as plain ``podman run --rm`` commands with the same limits
  (``--init --network none --memory --memory-swap --cpus --pids-limit``), the same environment and
  the same test script (the verifier's own, report plugin included); the Oracle's patch goes in on
  stdin and is reverted with ``git apply -R`` in the same command.

The two alternate which goes first, candidate by candidate, ``--repeats`` times, one at a time.
``overhead_per_trial_s`` = (mean forgeflow validation − mean raw validation) / 2 trials: what forgeflow
adds per trial beyond the container (goal <= 0.05 s). ``bare_run_s`` is ``podman run --rm IMAGE
true`` for scale; ``sandbox_steps_s`` says where forgeflow's extra time goes (:func:`sandbox_steps`).

Throughput: ``validate_candidate`` over all candidates, each ``--repeats`` times (a stream of validations,
as a curate batch is: the idle tail of the last ones weighs less), at ``--concurrency`` (default 2, this
machine's cores) as a thread pool, longest first as the flows order a window (the warm-up's times), in
validated candidates per minute, against the limit the raw runs set: ``cores x 60 / raw_validation_s``
(every core busy with raw container runs, nothing else), goal ``throughput_vs_limit`` >= 0.90.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.options import int_option


def _raw_argv(image: str, spec: Any, script: str, stdin: bool) -> list[str]:
    """``podman run --rm`` of ``script`` with the limits and environment the trial runner uses."""
    from forgeflow.sandbox.verifier import TESTBED, VERIFIER_ENV  # noqa: PLC0415

    argv = ["podman", "run", "--rm", "--init", "--memory", f"{spec.memory_mb}m", "--memory-swap",
            f"{spec.memory_mb}m", "--cpus", str(spec.cpus), "--network", "none", "--workdir", TESTBED]
    if spec.pids_limit is not None:
        argv += ["--pids-limit", str(spec.pids_limit)]
    if stdin:
        argv.append("-i")
    for key, value in VERIFIER_ENV.items():
        argv += ["--env", f"{key}={value}"]
    return [*argv, image, "bash", "-c", script]


def raw_validation(row: Any, spec: Any) -> float:
    """Wall seconds of the raw NOP + Oracle runs of ``row`` (module docstring).

    Raises:
        RuntimeError: a raw run did not run its tests (exit 125-127: podman or the script failed).
    """
    from forgeflow.sandbox.verifier import _wrapped_command  # noqa: PLC0415

    start = time.perf_counter()
    nop_script, _ = _wrapped_command(row.test_command, uuid.uuid4().hex[:16])
    oracle_script, _ = _wrapped_command(row.test_command, uuid.uuid4().hex[:16])
    oracle_script = ("cat > /tmp/forgeflow-bug.patch && git apply -R /tmp/forgeflow-bug.patch && "
                     "rm -f /tmp/forgeflow-bug.patch || exit 125\n" + oracle_script)
    for script, stdin in ((nop_script, None), (oracle_script, row.patch)):
        proc = subprocess.run(_raw_argv(row.image, spec, script, stdin is not None), input=stdin,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode in (125, 126, 127):
            raise RuntimeError(f"raw run of {row.instance_id} failed ({proc.returncode}): {proc.stderr[-300:]}")
    return time.perf_counter() - start


def forgeflow_validation(row: Any, spec: Any, run_key: str) -> float | None:
    """Wall seconds of :func:`forgeflow.sandbox.trial.validate_candidate` on ``row``; None when no
    Oracle ran (no test failed with the bug: a rejected candidate, one trial only).

    Raises:
        RuntimeError: the validation hit an infrastructure error.
    """
    from forgeflow.sandbox import trial  # noqa: PLC0415

    start = time.perf_counter()
    outcome = trial.validate_candidate(row, row.image, row.test_command, timeout_s=180.0, spec=spec, run_key=run_key,
                                       checks=trial.ValidationChecks(oracle_runs=1))  # NOP + one Oracle, as raw
    seconds = time.perf_counter() - start
    failed = next((t for t in outcome.trials if t.exception_type), None)
    if failed is not None:
        raise RuntimeError(f"{row.instance_id}: {failed.kind}: {failed.exception_type} {failed.exception_message}")
    return seconds if outcome.oracle is not None else None


def bare_run(image: str, repeats: int) -> float:
    """Median wall seconds of ``podman run --rm --network none IMAGE true``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(["podman", "run", "--rm", "--network", "none", image, "true"], capture_output=True,
                       timeout=120, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sandbox_steps(image: str, spec: Any, repeats: int) -> dict[str, float]:
    """Median wall seconds of the steps of a forgeflow trial on
    :class:`forgeflow.sandbox.podman.PodmanSandbox`: ``run_once`` (the trial's own path: ``podman run
    -i --rm`` of ``true`` under the wrapper, to the result), ``of_which_start`` (its container start,
    ``setup_s``), ``removal_wait`` (waiting for the background removal afterwards, off the critical
    path for all but a validation's last trial); and, for comparison, the path for backends without
    ``run_once``: ``start`` (``podman run -d`` + cgroup lookup), ``exec_true`` (one ``podman exec``)
    and ``remove`` (``podman rm -f -t 0``)."""
    from forgeflow.sandbox.podman import PodmanSandbox  # noqa: PLC0415

    steps: dict[str, list[float]] = {"run_once": [], "of_which_start": [], "removal_wait": [], "start": [],
                                     "exec_true": [], "remove": []}
    for _ in range(repeats):
        box = PodmanSandbox(image, spec)
        start = time.perf_counter()
        box.run_once("true", timeout_s=60)
        steps["run_once"].append(time.perf_counter() - start)
        steps["of_which_start"].append(box.setup_s or 0.0)
        wait = box.stop_async()
        start = time.perf_counter()
        wait()
        steps["removal_wait"].append(time.perf_counter() - start)
        box = PodmanSandbox(image, spec)
        for step, call in (("start", box.start), ("exec_true", lambda b=box: b.exec(["true"], timeout_s=60)),
                           ("remove", box.stop)):
            start = time.perf_counter()
            call()
            steps[step].append(time.perf_counter() - start)
    return {step: round(statistics.median(times), 3) for step, times in steps.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (module docstring) and print its figures; returns the JSON object.

    Every numeric option is checked before any work: a bad one exits 2 naming it.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trial", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-project", type=int_option(1, 20), default=1,
                        help="generated candidates per demo project (default 1)")
    parser.add_argument("--repeats", type=int_option(1, 20), default=2, help="rounds over the candidates (default 2)")
    parser.add_argument("--concurrency", type=int_option(1, 16), default=2,
                        help="thread pool size of the throughput figure (default 2)")
    args = parser.parse_args(argv)

    from forgeflow.common.settings import apply_container_env  # noqa: PLC0415
    from forgeflow.config import DEMO_PROJECTS  # noqa: PLC0415
    from forgeflow.curation.generated import build_generated  # noqa: PLC0415
    from forgeflow.curation.selection import longest_first  # noqa: PLC0415
    from forgeflow.sandbox.base import SandboxSpec  # noqa: PLC0415

    apply_container_env()
    work = Path(tempfile.mkdtemp(prefix="forgeflow-bench-trial-"))
    rows = build_generated(DEMO_PROJECTS, work / "work", args.per_project)
    spec = SandboxSpec(memory_mb=2048)
    nonce = uuid.uuid4().hex[:8]
    # warm-up (images and page cache warm for both); only candidates with a NOP + Oracle pair are compared
    warm = {row.instance_id: forgeflow_validation(row, spec, f"bench-warm-{nonce}") for row in rows}
    rows = [row for row in rows if warm[row.instance_id] is not None]
    if not rows:
        raise RuntimeError("no generated candidate has a failing test: nothing to compare")
    raw_validation(rows[0], spec)
    ours, raw = [], []
    for round_no in range(args.repeats):
        for i, row in enumerate(rows):
            pair = [lambda r=row, k=f"bench-{nonce}-{round_no}": ours.append(forgeflow_validation(r, spec, k)),
                    lambda r=row: raw.append(raw_validation(r, spec))]
            for run in (pair if (i + round_no) % 2 == 0 else pair[::-1]):
                run()
    ours_s, raw_s = statistics.mean(ours), statistics.mean(raw)
    overhead = (ours_s - raw_s) / 2
    deltas = sorted((a - b) / 2 for a, b in zip(ours, raw, strict=True))
    print(f"validation (NOP + Oracle), {len(ours)} pairs: forgeflow {ours_s:.3f} s, raw podman run --rm {raw_s:.3f} s; "
          f"overhead per trial {overhead:+.3f} s (median {statistics.median(deltas):+.3f}; goal <= 0.05)")
    bare = bare_run(rows[0].image, 5)
    steps = sandbox_steps(rows[0].image, spec, 5)
    print(f"bare podman run --rm IMAGE true: {bare:.3f} s; a forgeflow trial's steps (median s): "
          + ", ".join(f"{k} {v:.3f}" for k, v in steps.items()))

    cores = os.cpu_count() or 1
    # the order the lifecycle's and curate's sliding windows take: longest (as last measured) first
    by_id = {row.instance_id: row for row in rows}
    ordered = [(by_id[i], k) for i in longest_first(list(by_id), {i: s for i, s in warm.items() if s is not None})
               for k in range(args.repeats)]  # each repeat its own run key: its own trial ids and container names
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        list(pool.map(lambda item: forgeflow_validation(item[0], spec, f"bench-tp-{nonce}-{item[1]}"), ordered))
    wall = time.perf_counter() - start
    throughput = len(ordered) * 60 / wall
    limit = min(cores, args.concurrency) * 60 / raw_s
    print(f"throughput at concurrency {args.concurrency}: {throughput:.2f} validated candidates/min; limit "
          f"{limit:.2f} (= {min(cores, args.concurrency)} cores x 60 / raw validation {raw_s:.2f} s): "
          f"{throughput / limit:.0%} (goal >= 90 %)")
    result = {
        "overhead_per_trial_s": round(overhead, 3),
        "overhead_per_trial_median_s": round(statistics.median(deltas), 3),
        "validation_s": round(ours_s, 3), "raw_validation_s": round(raw_s, 3), "pairs": len(ours),
        "bare_run_s": round(bare, 3), "sandbox_steps_s": steps, "throughput_per_min": round(throughput, 2),
        "throughput_limit_per_min": round(limit, 2), "throughput_vs_limit": round(throughput / limit, 3),
        "concurrency": args.concurrency, "cores": cores, "candidates": len(rows),
        "throughput_validations": len(ordered),
        "warm_validation_s": {i: round(s, 3) for i, s in warm.items() if s is not None},
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
