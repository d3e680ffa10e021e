"""The ledger part of the scale benchmark: a store of a million trials, filled and read as a user reads it.

Run ``python -m benchmarks.scale_ledger [--trials N] [--tasks N] [--jobs N] [--store PATH]``. It prints one
human line per measurement and, as the LAST line, one JSON object::

    {"ledger": {"trials": N, "fill": {"trials_per_s": ..., "wall_s": ..., "store_mb": ...},
                "reads": {"<read>": {"wall_s": ..., "read_s": ..., "peak_rss_mb": ...}, ...},
                "record_paths": {"<path>": {"trials_per_s": ...}, ...}},
     "goals": {...}}

* fill: ``--trials`` trials (default 1,000,000) over ``--tasks`` tasks (3,000, in 30 repositories) and
  ``--jobs`` jobs (49: two validation jobs of NOP and Oracle trials, the rest canary jobs of agent trials on
  one frozen split, a tenth of their trials exceptions) written with the product's batched write
  (:meth:`forgeflow.ledger.store.Store.record_trials`, :data:`FILL_CHUNK` trials a call), timed.
* reads: each user-facing read, the CLI command's function run in-process in a fresh subprocess (its import
  included in ``wall_s``; ``read_s`` is the command alone), peak RSS of that subprocess (``os.wait4``):
  the job list, an unknown job id, one job's first page (table and JSON), ``compare A B --json``,
  ``status --json`` and ``lineage``.
* record paths: trials/s as the flows record them: the curate batch write
  (:meth:`~forgeflow.ledger.store.Store.record_batch_results`, a batch of 100 candidates' 300 trials), the
  curate per-trial sink (a trial as it ends, :meth:`~forgeflow.ledger.store.Store.record_trial`) and the
  canary's write (:func:`tasks.evaluation.record_agent_trial`: the trial and its supervision event together,
  returning once committed) from one thread, and from :data:`CANARY_THREADS` threads at once (a canary at that
  concurrency: trials that end together share transactions), each on a warm store of this process.

Goals (issue 34): every read <= 2 s and <= 500 MB at a million trials; >= 5,000 trials/s batched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchmarks.options import int_option

FILL_CHUNK = 10_000
"""Trials per :meth:`~forgeflow.ledger.store.Store.record_trials` call while filling."""
REPOS = 30
"""Repositories the tasks are spread over."""
VALIDATION_JOBS = 2
"""Jobs of NOP and Oracle trials (the curate runs); the others are canary jobs of agent trials."""
FREEZE = "bench-v1"
"""The freeze (and split ``test``) every canary job ran: ``compare`` pairs any two."""
GOAL_READ_S = 2.0
GOAL_READ_MB = 500.0
GOAL_TRIALS_PER_S = 5000.0
START = datetime(2026, 12, 1, tzinfo=UTC)
SUBMISSION = "diff --git a/src/mod.py b/src/mod.py\n--- a/src/mod.py\n+++ b/src/mod.py\n@@ -10,3 +10,3 @@\n" + (
    " context line\n" * 6) + "-    return a - b\n+    return a + b\n"


def task_id(n: int) -> str:
    """The instance id of synthetic task ``n`` (its repository ``repoNN``)."""
    return f"repo{n % REPOS:02d}__bench-{n:05d}"


def job_id(n: int) -> str:
    """The id of synthetic job ``n``: ``curate-bNN`` for the validation jobs, ``canary-NN-<sha12>`` else."""
    return f"curate-b{n:02d}" if n < VALIDATION_JOBS else f"canary-{n:02d}-{n:012x}"


def _trial(job: int, k: int, tasks: int) -> Any:
    """Trial ``k`` of job ``job``: a NOP/Oracle pair member or an agent trial (reward, or an exception for
    one in ten), created ``k`` seconds after the job's start."""
    from forgeflow.ledger.records import TrialRecord  # noqa: PLC0415

    instance = task_id((k // 2 if job < VALIDATION_JOBS else k) % tasks)
    created = START + timedelta(days=job, seconds=k)
    if job < VALIDATION_JOBS:
        kind = "nop" if k % 2 == 0 else "oracle"
        return TrialRecord(trial_id=f"{job_id(job)}.{instance}.{kind}.{k}", instance_id=instance, kind=kind,
                           job_id=job_id(job), batch_id=f"{job_id(job)}-{k // 200}", reward=float(k % 2),
                           timings={"env_setup_s": 0.3, "verifier_s": 1.5}, created_at=created)
    failed = k % 10 == 7
    return TrialRecord(trial_id=f"{job_id(job)}.{instance}.{k}", instance_id=instance, kind="agent",
                       job_id=job_id(job), reward=None if failed else float((k * 7 + job) % 3 == 0),
                       exception_type="ModelEndpointError" if failed else None,
                       exception_message="connection refused" if failed else None,
                       timings={"env_setup_s": 0.4, "agent_s": 60.0 + k % 50, "verifier_s": 2.0},
                       model_sha256=f"{job:064x}", agent_steps=20 + k % 30, input_tokens=40_000 + k % 997,
                       output_tokens=900 + k % 97, created_at=created,
                       verifier=None if failed else {"tests": {"passed": 12, "failed": 0}, "log_parser": "pytest"},
                       submission=None if failed else SUBMISSION)


def fill(store: Any, trials: int, tasks: int = 3000, jobs: int = 49, chunk: int = FILL_CHUNK) -> dict[str, Any]:
    """Fill ``store`` (migrated) with ``tasks`` accepted tasks, ``jobs`` jobs and ``trials`` trials spread evenly
    over the jobs, with the product's batched writes; plus a freeze, a model lineage (base -> adapter ->
    merged -> GGUF) and its serving generation, for ``status`` and ``lineage``.

    Returns:
        ``{"trials": N, "wall_s": s, "trials_per_s": r, "job_ids": [...], "gguf_sha256": hex}``; the
        timing covers the trials alone (building each record and writing it).
    """
    from forgeflow.ledger.records import (  # noqa: PLC0415
        BatchRecord,
        FreezeRecord,
        JobRecord,
        ModelArtifactRecord,
        ServingGenerationRecord,
        TaskRecord,
    )

    ids = [task_id(n) for n in range(tasks)]
    store.record_batch_results(
        BatchRecord(batch_id="bench-load", kind="load", instance_ids=ids, concurrency=1), [],
        [TaskRecord(instance_id=i, repo=i.split("__")[0], status="accepted", FAIL_TO_PASS=["t::a"],
                    PASS_TO_PASS=["t::b"]) for i in ids])
    for n in range(jobs):
        store.record_job(JobRecord(job_id=job_id(n), kind="curate" if n < VALIDATION_JOBS else "canary",
                                   freeze_name=None if n < VALIDATION_JOBS else FREEZE,
                                   split=None if n < VALIDATION_JOBS else "test", model_sha256=f"{n:064x}"))
    per_job = [trials // jobs + (1 if n < trials % jobs else 0) for n in range(jobs)]
    started = time.perf_counter()
    for n, count in enumerate(per_job):
        for first in range(0, count, chunk):
            store.record_trials([_trial(n, k, tasks) for k in range(first, min(count, first + chunk))])
    wall_s = time.perf_counter() - started
    store.record_freeze(FreezeRecord(name=FREEZE, semantic_sha256="1" * 64, file_sha256="2" * 64,
                                     manifest_path="/nonexistent/bench-v1.json", counts={"test": tasks}))
    chain = [("base", None), ("adapter", None), ("merged", None), ("gguf", "Q8_0")]
    parent = None
    for n, (kind, quantization) in enumerate(chain):
        sha = f"{n + 10:064x}"
        store.record_model_artifact(ModelArtifactRecord(sha256=sha, kind=kind, path=f"/nonexistent/{kind}",
                                                        quantization=quantization, parent_sha256=parent))
        parent = sha
    store.record_serving_generation(ServingGenerationRecord(generation=1, port=8080, gguf_sha256=parent,
                                                            status="active"))
    return {"trials": trials, "wall_s": round(wall_s, 2), "trials_per_s": round(trials / wall_s),
            "job_ids": [job_id(n) for n in range(jobs)], "gguf_sha256": parent}


READS: dict[str, list[str]] = {
    "job_list": ["trials"],
    "unknown_job": ["trials", "--job", "canary-07-00000000007x"],
    "job_page": ["trials", "--job", "{A}"],
    "job_page_json": ["trials", "--job", "{A}", "--json"],
    "compare_json": ["compare", "{A}", "{B}", "--json"],
    "status_json": ["status", "--json"],
    "lineage_json": ["lineage", "{GGUF}", "--json", "--no-verify"],
}
"""Each user-facing read: the ``forgeflow`` command line ({A}, {B}: two canary jobs; {GGUF}: the served GGUF)."""

_CHILD = """
import sys, time
from typer.testing import CliRunner
from deployments.cli import app
started = time.perf_counter()
result = CliRunner().invoke(app, sys.argv[1:])
read_s = time.perf_counter() - started
sys.stderr.write(f"READ_S {read_s} EXIT {result.exit_code} LINES {len(result.output.splitlines())}\\n")
sys.stderr.write(result.output[-300:] + "\\n")
"""


def measure_read(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``forgeflow ARGS`` in-process in a fresh subprocess: its wall seconds (interpreter and imports
    included), the command's own seconds and the subprocess's peak RSS (MB, from ``os.wait4``)."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, *args], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    stderr = child.stderr.read() if child.stderr else ""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall_s = time.perf_counter() - started
    said = next((line.split() for line in stderr.splitlines() if line.startswith("READ_S ")), None)
    if said is None:
        raise RuntimeError(f"forgeflow {' '.join(args)} did not finish: {stderr[-2000:]}")
    return {"wall_s": round(wall_s, 3), "read_s": round(float(said[1]), 3), "exit_code": int(said[3]),
            "output_lines": int(said[5]), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def record_paths(tmp: Path) -> dict[str, Any]:
    """Trials/s of the flows' record paths on a fresh store of this process (see the module docstring)."""
    from forgeflow.ledger.records import BatchRecord, TaskRecord  # noqa: PLC0415
    from forgeflow.ledger.store import Store  # noqa: PLC0415
    from forgeflow.sandbox.trial import TrialResult  # noqa: PLC0415
    from tasks.evaluation import record_agent_trial  # noqa: PLC0415

    url = f"sqlite:///{tmp / 'paths.db'}"
    store = Store(url)
    store.upgrade()
    out: dict[str, Any] = {}
    batches, per_batch = 20, 100
    rows = [[_trial(0, b * per_batch * 3 + k, 100_000) for k in range(per_batch * 3)] for b in range(batches)]
    started = time.perf_counter()
    for b, trials in enumerate(rows):
        ids = sorted({t.instance_id for t in trials})
        store.record_batch_results(BatchRecord(batch_id=f"b{b}", kind="curate", instance_ids=ids, concurrency=8),
                                   trials, [TaskRecord(instance_id=i, repo=i.split("__")[0], status="accepted")
                                            for i in ids])
    out["curate_batch"] = {"trials_per_s": round(batches * per_batch * 3 / (time.perf_counter() - started))}
    singles = [_trial(1, k, 100_000) for k in range(300)]
    started = time.perf_counter()
    for record in singles:
        store.record_trial(record)
    out["curate_per_trial"] = {"trials_per_s": round(len(singles) / (time.perf_counter() - started))}
    def canary_results(prefix: str, count: int) -> list[Any]:
        return [TrialResult(trial_id=f"{prefix}.{k}", instance_id=task_id(k), kind="agent", reward=1.0,
                            started_at=START, env_setup_s=0.4, agent_s=60.0, verifier_s=2.0, agent_steps=25,
                            input_tokens=40_000, output_tokens=900, submission=SUBMISSION) for k in range(count)]

    results = canary_results("canary-path", 300)
    started = time.perf_counter()
    for result in results:
        record_agent_trial(url, result, "canary-path", "c" * 64, "run-1")
    out["canary_per_trial"] = {"trials_per_s": round(len(results) / (time.perf_counter() - started))}
    for threads in CANARY_THREADS:
        out[f"canary_concurrency_{threads}"] = _canary_threads(url, canary_results(f"canary-c{threads}", 3000),
                                                               threads)
    store.dispose()
    return out


CANARY_THREADS = (8, 32)
"""The canary concurrencies the batched record path is measured at (threads recording as their trials end)."""


def _canary_threads(url: str, results: list[Any], threads: int) -> dict[str, Any]:
    """Trials/s of :func:`tasks.evaluation.record_agent_trial` called by ``threads`` threads at once, each
    recording its share of ``results`` one after another (a canary at that concurrency whose trials end
    together: they share transactions, :func:`tasks.common.shared_trial_writer`), and the mean trials per
    transaction."""
    import threading  # noqa: PLC0415

    from tasks.common import shared_trial_writer  # noqa: PLC0415
    from tasks.evaluation import record_agent_trial  # noqa: PLC0415

    writer = shared_trial_writer(url)
    writes, items = writer.writes, writer.items_written
    gate = threading.Barrier(threads + 1)

    def record(share: list[Any]) -> None:
        gate.wait()
        for result in share:
            record_agent_trial(url, result, "canary-path", "c" * 64, "run-1")

    workers = [threading.Thread(target=record, args=(results[n::threads],)) for n in range(threads)]
    for worker in workers:
        worker.start()
    gate.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    wall_s = time.perf_counter() - started
    return {"trials_per_s": round(len(results) / wall_s),
            "trials_per_transaction": round((writer.items_written - items) / max(1, writer.writes - writes), 1)}


def bench_ledger(trials: int, tasks: int, jobs: int, store_path: Path | None) -> dict[str, Any]:
    """Fill, read and record as the module docstring says; returns the JSON object :func:`main` prints."""
    from forgeflow.ledger.store import Store  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="scale-ledger-") as scratch:
        tmp = Path(scratch)
        path = store_path or tmp / "store.db"
        url = f"sqlite:///{path}"
        store = Store(url)
        store.upgrade()
        filled = fill(store, trials, tasks, jobs)
        store.dispose()
        print(f"fill: {trials} trials in {filled['wall_s']} s: {filled['trials_per_s']} trials/s", flush=True)
        env = {**os.environ, "FORGEFLOW_STORE_URL": url, "FORGEFLOW_HOME": str(tmp / "home")}
        names = {"{A}": filled["job_ids"][VALIDATION_JOBS], "{B}": filled["job_ids"][VALIDATION_JOBS + 1],
                 "{GGUF}": filled["gguf_sha256"]}
        reads = {}
        for name, template in READS.items():
            args = [names.get(arg, arg) for arg in template]
            reads[name] = measure_read(args, env)
            print(f"read {name} (forgeflow {' '.join(args)[:60]}): {reads[name]}", flush=True)
        paths = record_paths(tmp)
        print(f"record paths: {paths}", flush=True)
        store_mb = round(sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) / 2**20, 1)
    worst_s = max(r["read_s"] for r in reads.values())
    worst_mb = max(r["peak_rss_mb"] for r in reads.values())
    return {"ledger": {"trials": trials, "tasks": tasks, "jobs": jobs,
                       "fill": {"trials_per_s": filled["trials_per_s"], "wall_s": filled["wall_s"],
                                "store_mb": store_mb},
                       "reads": reads, "record_paths": paths},
            "goals": {"read_s_max": worst_s, "read_s_ok": worst_s <= GOAL_READ_S, "peak_rss_mb_max": worst_mb,
                      "peak_rss_ok": worst_mb <= GOAL_READ_MB,
                      "batched_trials_per_s_ok": min(filled["trials_per_s"], paths["curate_batch"]["trials_per_s"],
                                                     paths[f"canary_concurrency_{CANARY_THREADS[0]}"]["trials_per_s"])
                      >= GOAL_TRIALS_PER_S}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the ledger benchmark and print its JSON object as the last line; returns it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_ledger", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int_option(1, 10_000_000), default=1_000_000,
                        help="trials to fill (default 1,000,000)")
    parser.add_argument("--tasks", type=int_option(1, 1_000_000), default=3000,
                        help="tasks the trials are of (default 3,000)")
    parser.add_argument("--jobs", type=int_option(VALIDATION_JOBS + 2, 10_000), default=49, help="jobs (default 49)")
    parser.add_argument("--store", type=Path, default=None, help="the SQLite file to fill (default a temporary one)")
    args = parser.parse_args(argv)
    out = bench_ledger(args.trials, args.tasks, args.jobs, args.store)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
