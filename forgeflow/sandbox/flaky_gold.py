"""Flaky gold: how much evidence a validation gathers before it accepts a task, and the verdict on
Oracle runs that disagree.

A task is validated with a NOP run and Oracle runs (:mod:`forgeflow.sandbox.trial`). A FAIL_TO_PASS
test that passes only sometimes would make every later reward on the task a coin flip, so a task the
first Oracle run accepts gets a second Oracle run in which every FAIL_TO_PASS test and a sample of
PASS_TO_PASS tests run :attr:`ValidationChecks.flaky_repeat_runs` times back to back in one pytest
process (the plugin's repeat mode, as pytest-rerunfailures re-runs a test:
``_pytest.runner.runtestprotocol``): a test that disagrees with itself across the runs is flaky
(:func:`judge_repeats`, by :data:`FLAKY_POLICIES`).
"""

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
    """How much evidence a validation gathers before it accepts a task.

    Attributes:
        oracle_runs: Oracle runs of a task the first Oracle run would accept (>= 1; 2 by default:
            a task whose runs disagree is flaky). A rejected task pays no repeat; the NOP runs once.
        flaky_policy: ``reject`` (a flaky task is not accepted) or ``drop_flaky_pass_to_pass``
            (its disagreeing PASS_TO_PASS tests are dropped; a disagreeing FAIL_TO_PASS still rejects).
        log_parser: None: pytest, read from forgeflow's structured report; else the SWE-bench log
            parser (by function name, e.g. ``parse_log_django``) for a runner without one.
        flaky_repeat_runs: runs of each FAIL_TO_PASS test and of a sample of PASS_TO_PASS tests in
            the second Oracle run, back to back in its one pytest process (0 or 1: no repeats; pytest
            report only; no second Oracle run with ``oracle_runs`` 1). See
            :data:`DEFAULT_FLAKY_REPEAT_RUNS` for the probability it gives.
        flaky_sample_pass_to_pass_tests: PASS_TO_PASS tests repeated with them (a sample seeded by
            the instance id when there are more).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    oracle_runs: int = Field(default=DEFAULT_ORACLE_RUNS, ge=1, le=20)
    flaky_policy: FlakyPolicy = "reject"
    log_parser: str | None = None
    flaky_repeat_runs: int = Field(default=DEFAULT_FLAKY_REPEAT_RUNS, ge=0, le=50,
                                   description="Runs of each FAIL_TO_PASS and sampled PASS_TO_PASS test in the "
                                               "second Oracle run (0 or 1: none).")
    flaky_sample_pass_to_pass_tests: int = Field(default=DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS, ge=0, le=10_000,
                                                 description="PASS_TO_PASS tests repeated with them.")


def disagreeing_tests(runs: list[dict[str, str]], relevant: set[str]) -> list[str]:
    """Tests whose status is not the same in every run (a missing test counts as ``MISSING``).

    Args:
        runs: status maps of repeated runs of the same tree.
        relevant: tests that always matter (FAIL_TO_PASS and PASS_TO_PASS); any other test
            matters only when it failed in some run (a clean tree must pass).

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
    """The verdict on a task the first Oracle run accepted, given every Oracle run's status map.

    Args:
        first: the report of the NOP run against the first Oracle run (accepted).
        runs: the status maps of every Oracle run, the first included, and of every repetition
            inside a run (:func:`with_repetitions`).
        policy: one of :data:`FLAKY_POLICIES`.
        oracle_runs: the Oracle runs (containers) those maps come from; None: one per map.

    Returns:
        ``first`` with ``oracle_runs`` set when every run agrees; otherwise a report with the
        disagreeing tests in ``flaky_tests``: rejected (``reject``, or a FAIL_TO_PASS test
        disagrees) or accepted with those PASS_TO_PASS tests dropped (``drop_flaky_pass_to_pass``).
    """
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
    """The tests the second Oracle run repeats.

    Args:
        instance_id: the task (seeds the PASS_TO_PASS sample: the same task repeats the same tests).
        report: the accepted report of the NOP and first Oracle runs.
        checks: the validation's settings.

    Returns:
        Every FAIL_TO_PASS test and at most ``checks.flaky_sample_pass_to_pass_tests`` PASS_TO_PASS
        tests, each run ``checks.flaky_repeat_runs`` times; None when repeats are off
        (``flaky_repeat_runs`` < 2), a log parser reads the runs, or there is no FAIL_TO_PASS.
    """
    if checks.flaky_repeat_runs < 2 or checks.log_parser is not None or not report.FAIL_TO_PASS:
        return None
    p2p = sorted(report.PASS_TO_PASS)
    if len(p2p) > checks.flaky_sample_pass_to_pass_tests:
        p2p = sorted(random.Random(instance_id).sample(p2p, checks.flaky_sample_pass_to_pass_tests))
    return RepeatPlan(tests=[*report.FAIL_TO_PASS, *p2p], repeat_count=checks.flaky_repeat_runs)


def with_repetitions(result: VerifierResult) -> list[dict[str, str]]:
    """A run's status maps for :func:`judge_repeats`.

    Args:
        result: a run, with repetitions (:attr:`VerifierResult.repeat_runs`) or without.

    Returns:
        The run's own map, then one map per further repetition: the run's map with the repeated
        tests' statuses of that repetition (a test missing from it keeps the first run's status).
    """
    return [result.tests, *({**result.tests, **again} for again in result.repeat_runs[1:])]
