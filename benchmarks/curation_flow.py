"""The ``curate`` flow against a plain loop doing the same NOP/Oracle validations (``flow_vs_loop_ratio``).

Part of ``python -m benchmarks.curation`` (its module docstring says what the figures mean). Two
measurements, each on a fresh SQLite store and with its own candidates file:

* ``flow_vs_loop``: the demo's tasks (``per_project`` generated candidates of each demo project) with
  their real test commands, ``concurrency`` at a time (default 2: the machine's cores).
* ``flow_vs_loop_c8``: ``c8_candidates`` candidates spread round-robin over the demo projects,
  ``c8_concurrency`` at a time (default 8), each test command prefixed with ``sleep S &&`` (S =
  ``c8_sleep_s``). The tests still run, whole, in a fresh container of the task image per trial and are
  graded from forgeflow's report as always; the sleep only makes each run wait, so 8 validations in
  flight are not capped by 2 cores and the figure shows the flow's own cost per task run.

Each measurement runs loop, flow, loop; the baseline is the mean of the two loops. The loop takes the
candidates in the order the flow submits them (:func:`in_flow_order`): with 8 in flight, which
validations start first changes the wall time by more than the flow's overhead.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FlowBenchOptions:
    """What the flow-vs-loop measurements run.

    Attributes:
        per_project: generated candidates per demo project at ``concurrency`` (>= 1).
        concurrency: validations in flight in the first measurement (>= 1).
        c8_candidates: candidates of the second measurement (0: not run, its figures null).
        c8_concurrency: validations in flight in the second measurement (>= 1).
        c8_sleep_s: seconds each test run of the second measurement sleeps before its tests (>= 0).
    """

    per_project: int = 2
    concurrency: int = 2
    c8_candidates: int = 16
    c8_concurrency: int = 8
    c8_sleep_s: float = 12.0


def _loop_validations(rows: list[Any], concurrency: int, run_key: str) -> tuple[float, list[float]]:
    """The plain loop: a thread pool of ``concurrency`` calling trial.validate_candidate on each row.

    Returns:
        (wall seconds, per-call seconds).

    Raises:
        RuntimeError: a validation ended in an infrastructure error.
    """
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from forgeflow.sandbox import trial  # noqa: PLC0415
    from forgeflow.sandbox.base import SandboxSpec  # noqa: PLC0415

    def one(row: Any) -> float:
        start = time.perf_counter()
        outcome = trial.validate_candidate(row, row.image, row.test_command, timeout_s=180.0,
                                           spec=SandboxSpec(memory_mb=2048), run_key=run_key)
        if outcome.report is None:
            raise RuntimeError(f"loop: infrastructure error validating {row.instance_id}: "
                               f"{outcome.nop.exception_type} {outcome.nop.exception_message}")
        return time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        calls = list(pool.map(one, rows))
    return time.perf_counter() - start, calls


def _round_robin(rows: list[Any], count: int) -> list[Any]:
    """The first ``count`` rows taking one per repository in turn (repositories in first-seen order)."""
    by_repo: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        by_repo[row.repo].append(row)
    picked: list[Any] = []
    while len(picked) < count and any(by_repo.values()):
        for group in by_repo.values():
            if group and len(picked) < count:
                picked.append(group.pop(0))
    return picked


def in_flow_order(rows: list[Any], seed: int = 0) -> list[Any]:
    """``rows`` in the order the ``curate`` flow submits them (its first batch on an empty store:
    :func:`forgeflow.curation.selection.select_batch`), so loop and flow start the same validations first."""
    from forgeflow.curation.candidates import to_candidate_refs  # noqa: PLC0415
    from forgeflow.curation.selection import select_batch  # noqa: PLC0415

    by_id = {row.instance_id: row for row in rows}
    refs = to_candidate_refs(rows, {row.image for row in rows})
    return [by_id[iid] for iid in select_batch(refs, set(), {}, len(rows), seed)]


def sleeping(rows: list[Any], sleep_s: float) -> list[Any]:
    """``rows`` with each test command prefixed by ``sleep S &&`` (same tests, same grading)."""
    return [row.model_copy(update={"test_command": f"sleep {sleep_s:g} && {row.test_command}"}) for row in rows]


def _prefect_home() -> Path:
    """A fresh temporary PREFECT_HOME / FORGEFLOW_HOME, exported; the folder is removed at exit."""
    tmp = Path(tempfile.mkdtemp(prefix="forgeflow-bench-flow-"))
    # removed at interpreter exit, success or failure: after Prefect's own exit handlers (registered
    # later, run earlier) have stopped the ephemeral API server that keeps its database in here
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    os.environ.update({"PREFECT_HOME": str(tmp / "prefect"), "FORGEFLOW_HOME": str(tmp / "home"),
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240"})
    (tmp / "prefect").mkdir(parents=True)
    return tmp


def _flow_breakdown(flow_run_id: Any, tasks: int, concurrency: int) -> dict[str, Any]:
    """Where the flow run's time went, from Prefect's task-run times (seconds).

    ``flow_refill_gap_mean_s``: the mean time from a validation's end (Prefect's end time) to the
    start of the one that took its slot (Prefect's start time): the flow's recording, progress
    artifact and task-run submission between two validations (a thread pool's is ~0); None when
    no slot was refilled.

    Raises:
        RuntimeError: the flow run has not one validation task run per candidate.
    """
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId  # noqa: PLC0415

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    validations = [t for t in task_runs if t.name.startswith("validate-") and t.start_time and t.end_time]
    if len(validations) != tasks:
        raise RuntimeError(f"flow: {len(validations)} validation task runs for {tasks} candidates")
    first_start = min(t.start_time for t in validations)
    last_end = max(t.end_time for t in validations)
    starts = sorted(t.start_time for t in validations)
    ends = sorted(t.end_time for t in validations)
    # the k-th start after the first ``concurrency`` takes the slot the (k - concurrency)-th end freed
    gaps = [(start - end).total_seconds() for start, end in zip(starts[concurrency:], ends, strict=False)]
    return {
        "flow_run_s": round((run.end_time - run.start_time).total_seconds(), 2),
        "flow_before_first_validation_s": round((first_start - run.start_time).total_seconds(), 2),
        "flow_validations_window_s": round((last_end - first_start).total_seconds(), 2),
        "flow_after_last_validation_s": round((run.end_time - last_end).total_seconds(), 2),
        "flow_validation_task_runs_sum_s": round(
            sum((t.end_time - t.start_time).total_seconds() for t in validations), 2),
        "flow_refill_gap_mean_s": round(sum(gaps) / len(gaps), 3) if gaps else None,
    }


def measure(rows: list[Any], concurrency: int, tag: str, tmp: Path) -> dict[str, Any]:
    """Loop, flow, loop over ``rows`` at ``concurrency``; the flow on a fresh store ``store-<tag>.db``.

    The flow's quotas are met only if every candidate is accepted (so it passes the feasibility
    preflight and validates all of them in one batch).

    Returns:
        ``ratio`` (flow wall / mean loop wall) and the figures: walls (s), the flow's breakdown
        (:func:`_flow_breakdown`), ``overhead_per_validation_s`` (flow wall - loop wall, over the
        validations), ``task_run_overhead_s`` (per validation: flow task-run time - loop call time),
        the 1-minute load average before and after.

    Raises:
        RuntimeError: a validation hit an infrastructure error (the figure would be meaningless).
    """
    from flows.curate import CurateParams, curate  # noqa: PLC0415 - after PREFECT_HOME is set
    from forgeflow.curation.curate_settings import CurateSettings  # noqa: PLC0415
    from forgeflow.curation.freeze import SplitQuotas  # noqa: PLC0415
    from forgeflow.curation.generated import write_generated  # noqa: PLC0415
    from forgeflow.curation.task_rows import TaskSource  # noqa: PLC0415

    generated = write_generated(tmp / f"candidates-{tag}.jsonl", rows)
    seed = 0
    rows = in_flow_order(rows, seed)
    os.environ["FORGEFLOW_STORE_URL"] = f"sqlite:///{tmp / f'store-{tag}.db'}"
    repos = len({row.repo for row in rows})
    quotas = SplitQuotas(train=len(rows), validation=0, test=0, max_per_repo=len(rows), min_repos=repos)
    settings = CurateSettings(concurrency=concurrency, max_retries=0, batch_size=len(rows), seed=seed)
    nonce, load_before = uuid.uuid4().hex[:8], os.getloadavg()[0]
    loop1_s, calls1 = _loop_validations(rows, concurrency, f"bench-{tag}-loop1-{nonce}")
    print(f"[{tag}] loop 1: {len(rows)} validations at concurrency {concurrency} in {loop1_s:.1f} s")
    start = time.perf_counter()
    state = curate(CurateParams(source=TaskSource(generated_path=generated), quotas=quotas, settings=settings),
                   return_state=True)
    flow_s = time.perf_counter() - start
    out = state.result()
    print(f"[{tag}] flow: {len(rows)} validations in {flow_s:.1f} s ({out.status}, {out.trials_recorded} trials)")
    loop2_s, calls2 = _loop_validations(rows, concurrency, f"bench-{tag}-loop2-{nonce}")
    print(f"[{tag}] loop 2: {len(rows)} validations in {loop2_s:.1f} s")
    breakdown = _flow_breakdown(state.state_details.flow_run_id, len(rows), concurrency)
    loop_s = (loop1_s + loop2_s) / 2
    loop_call_s = (sum(calls1) + sum(calls2)) / 2
    return {
        "ratio": round(flow_s / loop_s, 3),
        "tasks": len(rows), "projects": repos, "concurrency": concurrency,
        "flow_wall_s": round(flow_s, 2), "loop_wall_s": [round(loop1_s, 2), round(loop2_s, 2)],
        **breakdown,
        "loop_validation_calls_sum_s": round(loop_call_s, 2),
        "overhead_per_validation_s": round((flow_s - loop_s) / len(rows), 3),
        "task_run_overhead_s": round((breakdown["flow_validation_task_runs_sum_s"] - loop_call_s) / len(rows), 3),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "status": out.status, "trials_recorded": out.trials_recorded,
    }


def bench_flow_vs_loop(options: FlowBenchOptions) -> dict[str, Any]:
    """Both measurements (module docstring); the figures for the benchmark's JSON line.

    Returns:
        ``flow_vs_loop_ratio`` and ``flow_vs_loop`` (concurrency ``options.concurrency``);
        ``flow_vs_loop_ratio_c8`` and ``flow_vs_loop_c8`` (with ``sleep_s``; None when
        ``options.c8_candidates`` is 0).

    Raises:
        RuntimeError: a validation hit an infrastructure error.
    """
    from forgeflow.common.settings import apply_container_env  # noqa: PLC0415
    from forgeflow.config import DEMO_PROJECTS  # noqa: PLC0415
    from forgeflow.curation.generated import build_generated  # noqa: PLC0415

    apply_container_env()
    tmp = _prefect_home()
    per_project = max(options.per_project, math.ceil(options.c8_candidates / len(DEMO_PROJECTS)))
    built = build_generated(DEMO_PROJECTS, tmp / "work", per_project)
    rows = _round_robin(built, options.per_project * len(DEMO_PROJECTS))

    from prefect import flow  # noqa: PLC0415 - after PREFECT_HOME is set

    @flow(name="bench-warmup")
    def warmup() -> None:
        """Starts the Prefect API (ephemeral server) before anything is timed."""

    warmup()
    c2 = measure(rows, options.concurrency, f"c{options.concurrency}", tmp)
    result: dict[str, Any] = {"flow_vs_loop_ratio": c2.pop("ratio"), "flow_vs_loop": c2,
                              "flow_vs_loop_ratio_c8": None, "flow_vs_loop_c8": None}
    if options.c8_candidates:
        slow = sleeping(_round_robin(built, options.c8_candidates), options.c8_sleep_s)
        c8 = measure(slow, options.c8_concurrency, f"c{options.c8_concurrency}-sleep", tmp)
        result.update(flow_vs_loop_ratio_c8=c8.pop("ratio"), flow_vs_loop_c8={**c8, "sleep_s": options.c8_sleep_s})
    return result
