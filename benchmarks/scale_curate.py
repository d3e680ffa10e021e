"""The curate part of the scale benchmark: orchestration per candidate, flow against a plain loop.

Run ``python -m benchmarks.scale_curate [--sizes 1000,10000] [--batch-size N] [--concurrency N]``. It
prints one human line per measurement and, as the LAST line, one JSON object::

    {"curate": {"1000": {"flow_s_per_candidate": ..., "loop_s_per_candidate": ..., "ratio": ...}, ...},
     "ratio_max": ..., "flat_ratio": ..., "goals": {...}}

For each size N: N synthetic candidates over N/20 repositories (one local image, imported empty once),
validated on the instant stand-in sandbox (:mod:`benchmarks.standin_sandbox`, a ``forgeflow-sandbox`` block
of its kind: the trial runner, grading, flaky repeat and store writes are the product's; only the
container is left out), each on a fresh SQLite store, with quotas met only when every candidate is
accepted (every candidate is validated, then the freeze-ready event is emitted):

* ``loop``: a plain loop doing the same reads and writes without Prefect: the run-scoped state once
  (:func:`forgeflow.curation.run_reads.curation_state`), then per batch the same incremental selection
  (:class:`forgeflow.curation.selection.BatchSelector`), the same readiness check and the same thread pool
  of ``concurrency`` validations (:func:`forgeflow.curation.batch_run.run_batch`), each trial stored as it
  ends and each verdict as it is known, then the batch row.
* ``flow``: the ``curate`` flow (real Prefect: an ephemeral API started before anything is timed).

``flow_s_per_candidate`` / ``loop_s_per_candidate``: wall seconds over N (with an instant sandbox the
wall time is all orchestration). Goals: ``ratio`` <= 1.5 at every size and ``flat_ratio`` (per-candidate
flow seconds at the largest size over the smallest) <= 1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.options import int_option

IMAGE = "localhost/forgeflow-bench-instant:1"
"""The one (empty) local image every synthetic candidate names: ``podman image exists`` finds it."""
BLOCK = "bench-instant"
"""The ``forgeflow-sandbox`` block the flow runs on."""
REPO_SIZE = 20
"""Candidates per synthetic repository."""
PATCH = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"


def _ensure_image() -> None:
    """Import an empty image as :data:`IMAGE` unless podman has it."""
    from forgeflow.common.settings import tool_env  # noqa: PLC0415

    env = tool_env()
    if subprocess.run(["podman", "image", "exists", IMAGE], env=env, check=False).returncode != 0:
        empty = subprocess.run(["tar", "cf", "-", "--files-from", "/dev/null"], capture_output=True, check=True).stdout
        subprocess.run(["podman", "import", "-", IMAGE], input=empty, env=env, capture_output=True, check=True)


def write_candidates(path: Path, count: int) -> Path:
    """``count`` candidate rows (JSONL, :func:`forgeflow.curation.candidates.load_candidates`' format) over
    ``count / REPO_SIZE`` repositories, each with its own test command; returns ``path``."""
    with path.open("w") as out:
        for i in range(count):
            out.write(json.dumps({"instance_id": f"bench-r{i // REPO_SIZE:05d}.c{i:06d}",
                                  "repo": f"bench-r{i // REPO_SIZE:05d}", "patch": PATCH, "image": IMAGE,
                                  "FAIL_TO_PASS": ["t::f2p"], "PASS_TO_PASS": ["t::p2p"],
                                  "test_command": "pytest -q"}) + "\n")
    return path


def run_loop(candidates: Path, store_url: str, batch_size: int, concurrency: int, kind: str) -> dict[str, Any]:
    """The plain loop (module docstring) on a fresh store at ``store_url``; wall seconds and counts."""
    from forgeflow.curation import run_reads  # noqa: PLC0415
    from forgeflow.curation.batch_run import BatchJob, run_batch  # noqa: PLC0415
    from forgeflow.curation.candidates import load_candidates, to_candidate_refs  # noqa: PLC0415
    from forgeflow.curation.freeze import SplitQuotas, TaskRef, freeze_ready  # noqa: PLC0415
    from forgeflow.curation.selection import BatchSelector  # noqa: PLC0415
    from forgeflow.ledger.records import BatchRecord, TaskRecord, TrialRecord  # noqa: PLC0415
    from forgeflow.ledger.store import Store  # noqa: PLC0415
    from forgeflow.sandbox import trial  # noqa: PLC0415

    start = time.perf_counter()
    store = Store(store_url)
    store.upgrade()
    rows = load_candidates(candidates)
    by_id = {row.instance_id: row for row in rows}
    refs = to_candidate_refs(rows, {IMAGE})
    store.record_batch_results(BatchRecord(batch_id="load-loop", kind="load", instance_ids=sorted(by_id),
                                           concurrency=1), [], [
        TaskRecord(instance_id=r.instance_id, repo=r.repo, patch=r.patch, image_ref=r.image, status="candidate")
        for r in rows])
    trials: list[str] = []
    batches = 0
    state = run_reads.curation_state(store.engine, list(by_id))
    processed, per_repo = set(state.processed), dict(state.accepted_per_repo)
    accepted = {task.instance_id: task for task in state.accepted}
    selector = BatchSelector(refs, 0)
    selector.mark_processed(processed)
    while True:  # as the flow: readiness checked once enough tasks are accepted (here: after the last batch)
        if len(accepted) >= len(by_id) and freeze_ready(sorted(accepted.values(), key=lambda t: t.instance_id),
                                                        SplitQuotas(train=len(by_id), validation=0, test=0,
                                                                    max_per_repo=REPO_SIZE,
                                                                    min_repos=len(by_id) // REPO_SIZE), 0).ready:
            break
        ids = selector.select(per_repo, batch_size)
        if not ids:
            break
        batch_id = f"loop-{batches}"

        def validate(iid: str, run_key: str, batch_id: str = batch_id) -> Any:
            def on_trial(record: Any) -> None:
                store.record_trial(TrialRecord.from_trial(record, "curate", None, None, batch_id=batch_id))
                trials.append(record.trial_id)
            return trial.validate_candidate(by_id[iid], IMAGE, "pytest -q", backend=kind, run_key=run_key,
                                            on_trial=on_trial)

        job = BatchJob(batch_id=batch_id, run_id="loop", ids=ids, rows={i: by_id[i] for i in ids},
                       concurrency=concurrency, max_retries=0, store_url=store_url)
        selector.mark_processed(ids)
        for verdict in run_batch(job, validate, lambda verdict, _outcome: store.record_task(verdict)):
            processed.add(verdict.instance_id)
            if verdict.status == "accepted":
                per_repo[verdict.repo] = per_repo.get(verdict.repo, 0) + 1
                accepted[verdict.instance_id] = TaskRef(instance_id=verdict.instance_id, repo=verdict.repo)
        store.record_batch(BatchRecord(batch_id=batch_id, kind="curate", instance_ids=ids, concurrency=concurrency))
        batches += 1
    store.dispose()
    return {"wall_s": time.perf_counter() - start, "trials": len(trials), "batches": batches}


def run_flow(candidates: Path, batch_size: int, concurrency: int, count: int) -> dict[str, Any]:
    """The ``curate`` flow over ``candidates`` on the stand-in block; wall seconds, status and counts."""
    from flows.curate import CurateParams, curate  # noqa: PLC0415
    from forgeflow.curation.curate_settings import CurateSettings  # noqa: PLC0415
    from forgeflow.curation.freeze import SplitQuotas  # noqa: PLC0415
    from forgeflow.curation.task_rows import TaskSource  # noqa: PLC0415

    quotas = SplitQuotas(train=count, validation=0, test=0, max_per_repo=REPO_SIZE, min_repos=count // REPO_SIZE)
    settings = CurateSettings(batch_size=batch_size, concurrency=concurrency, max_retries=0, seed=0)
    start = time.perf_counter()
    out = curate(CurateParams(source=TaskSource(candidates_path=candidates), quotas=quotas, settings=settings,
                              sandbox=BLOCK))
    wall_s = time.perf_counter() - start
    if out.status != "freeze-ready" or len(out.validated) != count:
        raise RuntimeError(f"flow: {out.status} after validating {len(out.validated)} of {count} candidates")
    return {"wall_s": wall_s, "trials": out.trials_recorded, "batches": len(out.batches)}


def measure(count: int, batch_size: int, concurrency: int, tmp: Path) -> dict[str, Any]:
    """Loop then flow at ``count`` candidates, each on its own fresh store; the per-candidate figures."""
    from benchmarks.standin_sandbox import KIND  # noqa: PLC0415

    candidates = write_candidates(tmp / f"candidates-{count}.jsonl", count)
    loop = run_loop(candidates, f"sqlite:///{tmp / f'loop-{count}.db'}", batch_size, concurrency, KIND)
    print(f"[{count}] loop: {loop['wall_s']:.1f} s, {loop['trials']} trials, {loop['batches']} batches", flush=True)
    os.environ["FORGEFLOW_STORE_URL"] = f"sqlite:///{tmp / f'flow-{count}.db'}"
    flow = run_flow(candidates, batch_size, concurrency, count)
    print(f"[{count}] flow: {flow['wall_s']:.1f} s, {flow['trials']} trials, {flow['batches']} batches", flush=True)
    return {"flow_s_per_candidate": round(flow["wall_s"] / count, 4),
            "loop_s_per_candidate": round(loop["wall_s"] / count, 4),
            "ratio": round(flow["wall_s"] / loop["wall_s"], 2), "flow_wall_s": round(flow["wall_s"], 1),
            "loop_wall_s": round(loop["wall_s"], 1), "batches": flow["batches"], "trials": flow["trials"]}


def bench_curate(sizes: list[int], batch_size: int, concurrency: int) -> dict[str, Any]:
    """Every size in ``sizes`` (module docstring) on a fresh PREFECT_HOME; the figures for the JSON line.

    Raises:
        RuntimeError: a flow run did not validate every candidate.
    """
    from benchmarks.curation_flow import _prefect_home  # noqa: PLC0415
    from benchmarks.standin_sandbox import KIND, install  # noqa: PLC0415

    tmp = _prefect_home()
    from forgeflow.common.settings import apply_container_env  # noqa: PLC0415

    apply_container_env()
    _ensure_image()
    install()
    from prefect import flow  # noqa: PLC0415 - after PREFECT_HOME is set

    import flows.curate  # noqa: F401, PLC0415 - imported now: what runs is the code as it was at the start
    from blocks.core import SandboxBackend  # noqa: PLC0415

    @flow(name="bench-warmup")
    def warmup() -> None:
        """Starts the Prefect API (ephemeral server) before anything is timed."""

    warmup()
    SandboxBackend(kind=KIND).save(BLOCK, overwrite=True)
    figures = {str(n): measure(n, batch_size, concurrency, tmp) for n in sizes}
    per = [figures[str(n)]["flow_s_per_candidate"] for n in sizes]
    return {"curate": figures, "batch_size": batch_size, "concurrency": concurrency,
            "ratio_max": max(f["ratio"] for f in figures.values()),
            "flat_ratio": round(per[-1] / per[0], 2) if len(per) > 1 else None,
            "goals": {"ratio_max": 1.5, "flat_ratio": 1.2}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the options, run :func:`bench_curate`, print the JSON object as the last line and return it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_curate", description=__doc__)
    parser.add_argument("--sizes", default="1000,10000", help="candidate counts, comma-separated (each 20-100000)")
    parser.add_argument("--batch-size", type=int_option(1, 100_000), default=None,
                        help="candidates per batch (default: CurateSettings' default)")
    parser.add_argument("--concurrency", type=int_option(1, 256), default=None,
                        help="validations in flight (default: CurateSettings' default)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"argument --sizes: not integers: {args.sizes!r}")
    if any(not REPO_SIZE <= n <= 100_000 for n in sizes):
        parser.error(f"argument --sizes: each must be between {REPO_SIZE} and 100000, got {args.sizes!r}")
    from forgeflow.curation.curate_settings import CurateSettings  # noqa: PLC0415

    defaults = CurateSettings()
    result = bench_curate(sizes, args.batch_size or defaults.batch_size, args.concurrency or defaults.concurrency)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
