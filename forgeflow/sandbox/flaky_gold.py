"""Flaky gold: how much evidence a validation gathers before it accepts a task, and the verdict on
Oracle runs that disagree."""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.sandbox.grading import ValidationReport, failed
from forgeflow.sandbox.verifier import RepeatPlan, VerifierResult

__all__ = [
    "FlakyPolicy",
    "FLAKY_POLICIES",
    "DEFAULT_ORACLE_RUNS",
    "DEFAULT_FLAKY_REPEAT_RUNS",
    "DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS",
    "ValidationChecks",
    "disagreeing_tests",
    "judge_repeats",
    "repeat_plan",
    "with_repetitions",
]

FlakyPolicy = Literal["reject", "drop_flaky_pass_to_pass"]
"""What a disagreement between Oracle runs does: ``reject`` — the task is not accepted (reason
``flaky: ...``, the tests named); ``drop_flaky_pass_to_pass`` — PASS_TO_PASS tests that disagree
are dropped and the task accepted, unless a FAIL_TO_PASS test disagrees (then rejected as flaky)."""

FLAKY_POLICIES: tuple[str, ...] = FlakyPolicy.__args__

DEFAULT_ORACLE_RUNS = 2
"""Oracle runs of a task that would be accepted (the first and one repeat)."""

DEFAULT_FLAKY_REPEAT_RUNS = 6
"""Runs of each FAIL_TO_PASS (and sampled PASS_TO_PASS) test in the second Oracle run. A test that
passes with probability 1/2 is accepted only if it passes the first Oracle run and all 6 runs of the
second: P = (1/2)^7 < 0.8 %, so it is flagged or rejected with probability > 99 % (> 98 % once the
first Oracle run has passed it: 1 - (1/2)^6), against (1/2)^2 = 25 % accepted with two plain runs."""

DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS = 10
"""PASS_TO_PASS tests repeated beside the FAIL_TO_PASS ones (a seeded sample when there are more)."""


class ValidationChecks(BaseModel):
    """How much evidence a validation gathers before it accepts a task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    oracle_runs: int = Field(default=DEFAULT_ORACLE_RUNS, ge=1, le=20,
                             description="Oracle runs of a task the first Oracle run would accept (>= 1; 2 by "
                                         "default: a task whose runs disagree is flaky)")
    flaky_policy: FlakyPolicy = Field("reject",
                                      description="reject (a flaky task is not accepted) or drop_flaky_pass_to_pass "
                                                  "(its disagreeing PASS_TO_PASS tests are dropped")
    log_parser: str | None = Field(None,
                                   description="None: pytest, read from forgeflow's structured report; else the "
                                               "SWE-bench log parser (by function name, e.g")
    flaky_repeat_runs: int = Field(default=DEFAULT_FLAKY_REPEAT_RUNS, ge=0, le=50,
                                   description="Runs of each FAIL_TO_PASS and sampled PASS_TO_PASS test in the "
                                               "second Oracle run (0 or 1: none).")
    flaky_sample_pass_to_pass_tests: int = Field(default=DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS, ge=0, le=10_000,
                                                 description="PASS_TO_PASS tests repeated with them.")


def disagreeing_tests(runs: list[dict[str, str]], relevant: set[str]) -> list[str]:
    """Tests whose status is not the same in every run (a missing test counts as ``MISSING``).

    Returns:
        The disagreeing tests, sorted.
    """
    ids = set().union(*runs) if runs else set()
    out = []
    for test in ids:
        statuses = [run.get(test, "MISSING") for run in runs]
        if len(set(statuses)) > 1 and (test in relevant or any(failed(s) for s in statuses)):
            out.append(test)
    return sorted(out)


def judge_repeats(first: ValidationReport, runs: list[dict[str, str]], policy: FlakyPolicy, *,
                  oracle_runs: int | None = None) -> ValidationReport:
    """The verdict on a task the first Oracle run accepted, given every Oracle run's status map: ``first`` when every
    run agrees; else the disagreeing tests in ``flaky_tests``, rejected (``reject``, or a FAIL_TO_PASS test
    disagrees) or accepted without those PASS_TO_PASS tests (``drop_flaky_pass_to_pass``)."""
    flaky = disagreeing_tests(runs, set(first.FAIL_TO_PASS) | set(first.PASS_TO_PASS))
    containers = oracle_runs or len(runs)
    base = first.model_copy(update={"oracle_runs": containers})
    if not flaky:
        return base
    across = f"{containers} Oracle runs" + (f" ({len(runs)} runs of the tests)" if len(runs) != containers else "")
    shown = ", ".join(repr(t) for t in flaky[:5]) + (f" and {len(flaky) - 5} more" if len(flaky) > 5 else "")
    flaky_f2p = [t for t in flaky if t in first.FAIL_TO_PASS]
    if policy == "drop_flaky_pass_to_pass" and not flaky_f2p:
        kept = [t for t in first.PASS_TO_PASS if t not in set(flaky)]
        return base.model_copy(update={
            "PASS_TO_PASS": kept, "flaky_tests": flaky,
            "reason": f"accepted: {len(first.FAIL_TO_PASS)} FAIL_TO_PASS, {len(kept)} PASS_TO_PASS after dropping "
                      f"{len(flaky)} flaky test(s) that disagree across {across}: {shown}"})
    what = f"{len(flaky_f2p)} FAIL_TO_PASS" if flaky_f2p else f"{len(flaky)}"
    return base.model_copy(update={
        "accepted": False, "flaky_tests": flaky,
        "reason": f"flaky: {what} test(s) disagree across {across}: {shown}"})


def repeat_plan(instance_id: str, report: ValidationReport, checks: ValidationChecks) -> RepeatPlan | None:
    """The tests the second Oracle run repeats: every FAIL_TO_PASS test and a sample of PASS_TO_PASS tests, each
    ``checks.flaky_repeat_runs`` times; None when repeats are off, a log parser reads the runs, or no FAIL_TO_PASS."""
    if checks.flaky_repeat_runs < 2 or checks.log_parser is not None or not report.FAIL_TO_PASS:
        return None
    p2p = sorted(report.PASS_TO_PASS)
    if len(p2p) > checks.flaky_sample_pass_to_pass_tests:
        p2p = sorted(random.Random(instance_id).sample(p2p, checks.flaky_sample_pass_to_pass_tests))
    return RepeatPlan(tests=[*report.FAIL_TO_PASS, *p2p], repeat_count=checks.flaky_repeat_runs)


def with_repetitions(result: VerifierResult) -> list[dict[str, str]]:
    """A run's status maps for :func:`judge_repeats`."""
    return [result.tests, *({**result.tests, **again} for again in result.repeat_runs[1:])]
