"""The lifecycle's stage kit: the sliding window (``StageLog.window``: the next task run starts when any one
ends, not when a whole wave has ended) and stages as subflow runs (``run_stage_flow``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def test_the_window_refills_a_slot_as_soon_as_one_task_run_ends(prefect_harness, tmp_path: Path) -> None:
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    from flows.stagekit import StageLog

    @task(cache_policy=NO_CACHE)
    def work(name: str, seconds: float) -> tuple[str, float, float]:
        start = time.monotonic()
        time.sleep(seconds)
        return name, start, time.monotonic()

    @flow
    def run() -> tuple[list[str], dict[str, tuple[float, float]], dict]:
        log = StageLog(tmp_path / "summary.json", None)
        with log.stage("window") as st:
            items = [("slow", 3.0), ("a", 0.2), ("b", 0.2), ("c", 0.2)]
            ended = [(name, state.result()) for (name, _), state in
                     log.window(items, lambda item: work.submit(*item), concurrency=2)]
        return [n for n, _ in ended], {n: (r[1], r[2]) for n, r in ended}, st

    order, spans, stage = run()
    # with waves of 2, "b" would wait for "slow"; in a window it runs while "slow" still runs
    assert order[-1] == "slow"
    assert spans["b"][0] < spans["slow"][1] and spans["c"][0] < spans["slow"][1]
    assert stage["tasks_run"] == 4 and stage["status"] == "completed"


def test_the_window_refuses_a_concurrency_below_one(tmp_path: Path) -> None:
    from flows.stagekit import StageLog

    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        list(StageLog(tmp_path / "s.json", None).window([1], lambda item: None, concurrency=0))


def test_a_stage_runs_as_a_named_subflow_run_and_its_failure_fails_the_stage(prefect_harness, tmp_path: Path) -> None:
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId
    from prefect.runtime import flow_run

    from flows.stagekit import STAGE_FLOW_NAME, StageLog, run_stage_flow

    @task(cache_policy=NO_CACHE)
    def double(x: int) -> int:
        return 2 * x

    log = StageLog(tmp_path / "summary.json", None)

    def counting(xs: list[int]) -> list[int]:
        with log.stage("counting") as st:
            out = [log.call(double, x) for x in xs]
            st["counts"] = {"items": len(out)}
        return out

    def broken(lock: object) -> None:  # an argument that is not JSON: the subflow takes no parameters
        with log.stage("broken"):
            raise RuntimeError(f"stage body failed holding {type(lock).__name__}")

    @flow
    def parent() -> tuple[str, list[int]]:
        doubled = run_stage_flow("counting", counting, [1, 2, 3])
        with pytest.raises(RuntimeError, match="stage body failed holding"):
            run_stage_flow("broken", broken, object())
        return str(flow_run.get_id()), doubled

    parent_id, doubled = parent()
    assert doubled == [2, 4, 6]
    assert log.stages["counting"]["tasks_run"] == 3 and log.stages["broken"]["status"] == "failed"
    with get_client(sync_client=True) as client:
        children = {run.name: run for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))}
        assert set(children) == {"counting", "broken"}
        assert {client.read_flow(run.flow_id).name for run in children.values()} == {STAGE_FLOW_NAME}
        assert children["counting"].state.is_completed() and children["broken"].state.is_failed()
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[children["counting"].id])))
        assert sorted(t.name.split("-")[0] for t in tasks) == ["double"] * 3


def test_a_nested_stage_logs_task_runs_count_in_the_enclosing_stage(prefect_harness, tmp_path: Path) -> None:
    """A stage flow with its own StageLog (the canary's) run inside a lifecycle stage: its task runs count in
    its own stage and in the enclosing one, so the enclosing stage is cached when the nested tasks were; a
    stage nested in the same log counts only in the inner stage, and nothing is forwarded once it ended."""
    from uuid import uuid4

    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    from flows.stagekit import StageLog

    token = uuid4().hex  # this test's own cache keys

    @task(cache_key_fn=lambda _context, parameters: f"nested-{token}-{parameters['x']}")
    def cached(x: int) -> int:
        return x + 1

    @task(cache_policy=NO_CACHE)
    def plain(x: int) -> int:
        return x

    @flow
    def stage_flow(summary: Path) -> dict:  # a user's flow: its own log, one stage
        own = StageLog(summary, None)
        with own.stage("canary"):
            own.call(cached, 1)
            own.call(cached, 2)
        own.call(plain, 3)  # no stage of its own open: counted nowhere
        return own.stages["canary"]

    def lifecycle_run(n: int) -> tuple[StageLog, dict]:
        outer = StageLog(tmp_path / f"outer-{n}.json", None)

        @flow
        def parent() -> dict:
            with outer.stage("canary_baseline"):
                nested = stage_flow(tmp_path / f"inner-{n}.json")
            with outer.stage("promote"):
                with outer.stage("serve_stage"):  # the same log: the inner stage counts, not the outer
                    outer.call(plain, 4)
            return nested

        return outer, parent()

    first, nested = lifecycle_run(1)
    counts = {name: (st["tasks_run"], st["tasks_cached"], st["status"]) for name, st in first.stages.items()}
    assert (nested["tasks_run"], nested["tasks_cached"], nested["status"]) == (2, 0, "completed")
    assert counts == {"canary_baseline": (2, 0, "completed"), "promote": (0, 0, "completed"),
                      "serve_stage": (1, 0, "completed")}
    second, nested = lifecycle_run(2)  # the same inputs: both nested task runs answered from the cache
    assert (nested["tasks_run"], nested["tasks_cached"], nested["status"]) == (2, 2, "cached")
    assert second.stages["canary_baseline"]["tasks_run"] == 2 and second.stages["canary_baseline"]["status"] == "cached"
