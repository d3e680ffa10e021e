"""The lifecycle's sliding window (``StageLog.window``): the next task run starts when any one ends,
not when a whole wave has ended, so one slow validation no longer holds the others back."""

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
