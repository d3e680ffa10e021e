"""Grading test logs: parse ``pytest -rA`` output, validate a candidate bug, score a trial.

Parsing is SWE-bench's own (``swebench.harness.log_parsers.python.parse_log_pytest``, swebench
4.1), scoring follows SWE-bench's resolution rule (``swebench.harness.grading``:
``get_eval_tests_report`` + ``get_resolution_status``), and validation compares the two runs the
way SWE-smith's ``get_valid_report`` does (``swesmith.harness.grading``): only tests present in
both runs are compared, so a bug that breaks collection yields no FAIL_TO_PASS.

A *status map* is ``{test_id: status}`` where ``status`` is one of :class:`TestStatus`'s values
(``"PASSED"``, ``"FAILED"``, ``"ERROR"``, ``"SKIPPED"``, ``"XFAIL"``); ``test_id`` is pytest's node
id (``tests/test_x.py::test_a[1]``).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field
from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, ResolvedStatus, TestStatus
from swebench.harness.grading import get_eval_tests_report, get_resolution_status
from swebench.harness.log_parsers.python import parse_log_pytest

from forgeflow import errors

__all__ = [
    "TestStatus",
    "ValidationReport",
    "parse_test_log",
    "grade_validation",
    "grade_resolved",
    "passed",
    "failed",
]

PASSING = frozenset({TestStatus.PASSED.value, TestStatus.XFAIL.value})
"""Statuses SWE-bench counts as a pass (``swebench.harness.grading.test_passed``)."""

FAILING = frozenset({TestStatus.FAILED.value, TestStatus.ERROR.value})
"""Statuses SWE-bench counts as a failure (``swebench.harness.grading.test_failed``)."""

_PYTEST_MARKERS = re.compile(
    r"=+ test session starts =+|=+ .*\b(passed|failed|error|errors|skipped|no tests ran)\b.* =+",
)
"""Lines only a pytest run prints (session header or final summary): tell "pytest ran and
collected nothing" apart from "this is not pytest output at all"."""


def passed(status: str | None) -> bool:
    """True if ``status`` counts as a pass (PASSED or XFAIL), as in SWE-bench."""
    return status in PASSING


def failed(status: str | None) -> bool:
    """True if ``status`` counts as a failure (FAILED or ERROR), as in SWE-bench."""
    return status in FAILING


def parse_test_log(log: str) -> dict[str, str]:
    """Parse a ``pytest -rA`` log into a status map with SWE-bench's pytest parser.

    Args:
        log: the combined stdout/stderr of one ``pytest -rA`` run.

    Returns:
        ``{test_id: status}``; empty when pytest ran but collected no test (its summary says
        "no tests ran").

    Raises:
        VerifierOutputError: the log is empty or is not pytest output (no test line, no session
            header, no summary): the verifier broke, which is an infrastructure failure and never
            a rejection of the task.
    """
    if not isinstance(log, str):
        raise errors.VerifierOutputError(f"test log must be str, got {type(log).__name__}")
    status_map = parse_log_pytest(log, None)
    if status_map:
        return status_map
    if not log.strip():
        raise errors.VerifierOutputError("test log is empty: the verifier printed nothing")
    if _PYTEST_MARKERS.search(log) is None:
        tail = log.strip()[-300:]
        raise errors.VerifierOutputError(f"test log is not pytest -rA output; it ends with: {tail!r}")
    return {}


class ValidationReport(BaseModel):
    """The verdict on one candidate bug from its NOP (bug present) and Oracle (bug reverted) runs.

    Attributes:
        FAIL_TO_PASS: tests failing or erroring with the bug and passing with it reverted (sorted).
        PASS_TO_PASS: tests passing in both runs (sorted).
        accepted: True iff FAIL_TO_PASS is non-empty and no test fails in the Oracle run.
        reason: why it was accepted or rejected, for a person ("no test failed with the bug",
            "oracle run failed 3 tests", "no test collected with the bug", ...).
    """

    model_config = ConfigDict(frozen=True)

    FAIL_TO_PASS: list[str] = Field(default_factory=list)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    accepted: bool
    reason: str = Field(min_length=1)


def _check_map(name: str, status_map: dict[str, str]) -> None:
    if not isinstance(status_map, dict):
        raise errors.InputError(f"{name} must be a dict of test id -> status, got {type(status_map).__name__}")
    valid = {s.value for s in TestStatus}
    bad = {k: v for k, v in status_map.items() if v not in valid}
    if bad:
        first = next(iter(bad.items()))
        raise errors.InputError(
            f"{name} has {len(bad)} unknown statuses (e.g. {first!r}); valid: {sorted(valid)}"
        )


def grade_validation(nop: dict[str, str], oracle: dict[str, str] | None) -> ValidationReport:
    """Compare the NOP and Oracle status maps of a candidate bug (SWE-smith's validation rule).

    Rules, in order (first match rejects):

    1. ``oracle is None`` (the Oracle was skipped because nothing failed with the bug): rejected,
       "no test collected with the bug" if the NOP map is empty, else "no test failed with the bug".
    2. Oracle map empty: "no test collected in the oracle run".
    3. N > 0 tests FAILED/ERROR in the Oracle run: "oracle run failed N tests" (the clean tree
       must pass, or the task is flaky or environment-broken).
    4. No test id appears in both runs (the bug broke collection, e.g. an import error):
       "no test collected with the bug".
    5. FAIL_TO_PASS empty: "no test failed with the bug".

    Args:
        nop: status map of the run with the bug present.
        oracle: status map of the run with the bug reverted, or None if it was not run.

    Returns:
        The :class:`ValidationReport` (FAIL_TO_PASS/PASS_TO_PASS filled whenever computable).

    Raises:
        InputError: a map is not a dict or holds a status outside :class:`TestStatus`.
    """
    _check_map("nop", nop)
    if oracle is None:
        if not nop:
            return ValidationReport(accepted=False, reason="no test collected with the bug")
        if any(failed(s) for s in nop.values()):
            return ValidationReport(
                accepted=False, reason="oracle run missing although tests failed with the bug"
            )
        return ValidationReport(accepted=False, reason="no test failed with the bug")
    _check_map("oracle", oracle)
    common = sorted(set(nop) & set(oracle))
    f2p = [t for t in common if failed(nop[t]) and passed(oracle[t])]
    p2p = [t for t in common if passed(nop[t]) and passed(oracle[t])]
    oracle_failures = sum(1 for s in oracle.values() if failed(s))
    if not oracle:
        reason, ok = "no test collected in the oracle run", False
    elif oracle_failures:
        reason, ok = f"oracle run failed {oracle_failures} tests", False
    elif not common:
        reason, ok = "no test collected with the bug", False
    elif not f2p:
        reason, ok = "no test failed with the bug", False
    else:
        reason, ok = f"accepted: {len(f2p)} FAIL_TO_PASS, {len(p2p)} PASS_TO_PASS", True
    return ValidationReport(FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, accepted=ok, reason=reason)


def grade_resolved(status: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> float:
    """Score one run by SWE-bench's rule: 1.0 iff every FAIL_TO_PASS and PASS_TO_PASS test passes.

    A test missing from ``status`` counts as failed (SWE-bench's ``test_failed``). Implemented with
    ``swebench.harness.grading.get_eval_tests_report`` and ``get_resolution_status`` (FULL -> 1.0,
    PARTIAL or NO -> 0.0).

    Args:
        status: status map of the run to score.
        fail_to_pass: the task's FAIL_TO_PASS test ids.
        pass_to_pass: the task's PASS_TO_PASS test ids.

    Returns:
        1.0 or 0.0.

    Raises:
        InputError: both lists are empty (nothing to grade: SWE-bench would call that resolved) or
            ``status`` is malformed.
    """
    _check_map("status", status)
    if not fail_to_pass and not pass_to_pass:
        raise errors.InputError("grade_resolved: FAIL_TO_PASS and PASS_TO_PASS are both empty; nothing to grade")
    report = get_eval_tests_report(
        status, {FAIL_TO_PASS: list(fail_to_pass), PASS_TO_PASS: list(pass_to_pass)}
    )
    return 1.0 if get_resolution_status(report) == ResolvedStatus.FULL.value else 0.0
