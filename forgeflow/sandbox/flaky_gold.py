"""Flaky gold: how much evidence a validation gathers before it accepts a task, and the verdict on
Oracle runs that disagree or NOP runs whose FAIL_TO_PASS tests do not fail every time.

A FAIL_TO_PASS test is one that fails with the bug and passes with it reverted. Both halves are
evidence a single run can fake by chance: a test that fails intermittently for reasons of its own (a
socket test on a loaded machine) fails in one NOP run, passes in the Oracle runs, and becomes
FAIL_TO_PASS of a task whose bug it does not detect. An agent that submits nothing is then paid
whenever the flake does not recur. So the Oracle runs are repeated (each FAIL_TO_PASS test must pass
every time) and so is the NOP run (each FAIL_TO_PASS test must fail every time)."""

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
    "DEFAULT_NOP_RUNS",
    "DEFAULT_FLAKY_REPEAT_RUNS",
    "DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS",
    "DEFAULT_FLAKY_SAMPLE_FAIL_TO_PASS",
    "ValidationChecks",
    "disagreeing_tests",
    "judge_repeats",
    "judge_nop_runs",
    "repeat_plan",
    "nop_repeat_plan",
    "with_repetitions",
]

FlakyPolicy = Literal["reject", "drop_flaky_pass_to_pass"]
"""What a disagreement between Oracle runs does: ``reject`` — the task is not accepted (reason
``flaky: ...``, the tests named); ``drop_flaky_pass_to_pass`` — PASS_TO_PASS tests that disagree
are dropped and the task accepted, unless a FAIL_TO_PASS test disagrees (then rejected as flaky)."""

FLAKY_POLICIES: tuple[str, ...] = FlakyPolicy.__args__

DEFAULT_ORACLE_RUNS = 2
"""Oracle runs of a task that would be accepted (the first and one repeat)."""

DEFAULT_NOP_RUNS = 2
"""NOP runs of a task the first Oracle run would accept (the first and one confirmation run)."""

DEFAULT_FLAKY_REPEAT_RUNS = 6
"""Runs of each FAIL_TO_PASS (and sampled PASS_TO_PASS) test in the second Oracle run. A test that
passes with probability 1/2 is accepted only if it passes the first Oracle run and all 6 runs of the
second: P = (1/2)^7 < 0.8 %, so it is flagged or rejected with probability > 99 % (> 98 % once the
first Oracle run has passed it: 1 - (1/2)^6), against (1/2)^2 = 25 % accepted with two plain runs."""

DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS = 10
"""PASS_TO_PASS tests repeated beside the FAIL_TO_PASS ones (a seeded sample when there are more)."""

DEFAULT_FLAKY_SAMPLE_FAIL_TO_PASS = 10
"""FAIL_TO_PASS tests the second NOP run repeats (a seeded sample when there are more). An unfixed tree is paid
only when every FAIL_TO_PASS test passes, so a task whose FAIL_TO_PASS tests all fail for reasons of their own is
caught whenever it has at most this many. A bug can make its failing tests slow: a demo task (tabulate, 82
FAIL_TO_PASS tests) took 49 s for one NOP run and over the 180 s limit with all of them repeated 6 times."""


class ValidationChecks(BaseModel):
    """How much evidence a validation gathers before it accepts a task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    oracle_runs: int = Field(default=DEFAULT_ORACLE_RUNS, ge=1, le=20,
                             description="Oracle runs of a task the first Oracle run would accept (>= 1; 2 by "
                                         "default: a task whose runs disagree is flaky)")
    nop_runs: int = Field(default=DEFAULT_NOP_RUNS, ge=1, le=20,
                          description="NOP runs of a task the first Oracle run would accept (>= 1; 2 by default: a "
                                      "FAIL_TO_PASS test that does not fail in every one is flaky and the task "
                                      "rejected).")
    flaky_policy: FlakyPolicy = Field("reject",
                                      description="reject (a flaky task is not accepted) or drop_flaky_pass_to_pass "
                                                  "(its disagreeing PASS_TO_PASS tests are dropped")
    log_parser: str | None = Field(None,
                                   description="None: pytest, read from forgeflow's structured report; else the "
                                               "SWE-bench log parser (by function name, e.g")
    flaky_repeat_runs: int = Field(default=DEFAULT_FLAKY_REPEAT_RUNS, ge=0, le=50,
                                   description="Runs of each FAIL_TO_PASS and sampled PASS_TO_PASS test in the "
                                               "second Oracle run, and of each FAIL_TO_PASS test in the second NOP "
                                               "run (0 or 1: none).")
    flaky_sample_pass_to_pass_tests: int = Field(default=DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS, ge=0, le=10_000,
                                                 description="PASS_TO_PASS tests repeated with them.")
    flaky_sample_fail_to_pass_tests: int = Field(default=DEFAULT_FLAKY_SAMPLE_FAIL_TO_PASS, ge=1, le=10_000,
                                                 description="FAIL_TO_PASS tests the second NOP run repeats (a "
                                                             "seeded sample when there are more).")


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


def nop_repeat_plan(instance_id: str, report: ValidationReport, checks: ValidationChecks) -> RepeatPlan | None:
    """The tests the second NOP run repeats: only FAIL_TO_PASS tests (a sample of
    ``checks.flaky_sample_fail_to_pass_tests``, seeded by ``instance_id``, when there are more), each
    ``checks.flaky_repeat_runs`` times, the other tests deselected; None when repeats are off, a log parser reads the
    runs, or no FAIL_TO_PASS."""
    if checks.flaky_repeat_runs < 2 or checks.log_parser is not None or not report.FAIL_TO_PASS:
        return None
    f2p = sorted(report.FAIL_TO_PASS)
    if len(f2p) > checks.flaky_sample_fail_to_pass_tests:
        f2p = sorted(random.Random(instance_id).sample(f2p, checks.flaky_sample_fail_to_pass_tests))
    return RepeatPlan(tests=f2p, repeat_count=checks.flaky_repeat_runs, only_selected=True)


def judge_nop_runs(first: ValidationReport, runs: list[dict[str, str]], *, nop_runs: int,
                   tests: list[str] | None = None) -> ValidationReport:
    """The verdict on a task the first Oracle run accepted, given the status maps of its NOP runs (the first NOP
    run's and each later repetition's): ``first`` when each of ``tests`` (None: every FAIL_TO_PASS test) failed
    (FAILED or ERROR) in every one; else rejected as flaky, whatever the flaky policy (a FAIL_TO_PASS test that
    passes with the bug present does not tell a fix from no fix), the tests named in ``flaky_tests``.

    Args:
        nop_runs: the NOP containers the runs came from (a repeat run gives several maps).
        tests: the FAIL_TO_PASS tests every run ran (the repeat plan's sample).
    """
    checked = first.FAIL_TO_PASS if tests is None else tests
    flaky = sorted(t for t in checked if not all(failed(run.get(t)) for run in runs))
    if not flaky:
        return first
    across = f"{nop_runs} NOP runs" + (f" ({len(runs)} runs of the tests)" if len(runs) != nop_runs else "")
    shown = ", ".join(repr(t) for t in flaky[:5]) + (f" and {len(flaky) - 5} more" if len(flaky) > 5 else "")
    return first.model_copy(update={
        "accepted": False, "flaky_tests": flaky,
        "reason": f"flaky: {len(flaky)} FAIL_TO_PASS test(s) did not fail in every one of {across} with the bug "
                  f"present: {shown}"})


def with_repetitions(result: VerifierResult) -> list[dict[str, str]]:
    """A run's status maps for :func:`judge_repeats`."""
    return [result.tests, *({**result.tests, **again} for again in result.repeat_runs[1:])]
