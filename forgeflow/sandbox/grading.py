"""Grading: status maps of test runs, the validation of a candidate bug, the score of a trial.

A *status map* is ``{test_id: status}`` where ``status`` is one of :data:`STATUSES`:
``PASSED``, ``FAILED``, ``ERROR``, ``SKIPPED``, ``XFAIL`` (an expected failure that failed) and
``XPASS`` (an expected failure that passed); ``test_id`` is the runner's id (pytest's node id,
``tests/test_x.py::test_a[1]``, verbatim: spaces, brackets, ``::`` in parameters).

Status maps come from forgeflow's structured pytest report (:mod:`forgeflow.sandbox.verifier`) or, for
runners without one, from SWE-bench's log parsers (``swebench.harness.log_parsers``, swebench
4.1; :func:`parse_test_log`).

The rules are SWE-bench's and SWE-smith's with one strictness added: **only PASSED is a pass**.
SWE-bench's ``test_passed`` also counts XFAIL; here an XFAIL, XPASS, SKIPPED or missing test is
never a pass, so a submission cannot make a FAIL_TO_PASS test "pass" by skipping it or marking it
an expected failure. Validation compares the NOP and Oracle runs as SWE-smith's
``get_valid_report`` does (``swesmith.harness.grading``): only tests present in both runs are
compared, so a bug that breaks collection yields no FAIL_TO_PASS. Resolution follows SWE-bench's
rule (``swebench.harness.grading``: resolved iff every FAIL_TO_PASS and PASS_TO_PASS test passes,
a missing test counting as failed).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import cache

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors

__all__ = [
    "LOG_PARSERS",
    "STATUSES",
    "ValidationReport",
    "parse_test_log",
    "grade_validation",
    "grade_resolved",
    "passed",
    "failed",
]

STATUSES = frozenset({"PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"})
"""Every status a status map may hold."""

PASSING = frozenset({"PASSED"})
"""The only status that counts as a pass (stricter than SWE-bench's, which adds XFAIL)."""

FAILING = frozenset({"FAILED", "ERROR"})
"""Statuses that count as a failure (as SWE-bench's ``test_failed``). SKIPPED, XFAIL and XPASS are
neither: not a failure of a clean tree, never a pass."""

_PYTEST_MARKERS = re.compile(
    r"=+ test session starts =+|=+ .*\b(passed|failed|error|errors|skipped|no tests ran)\b.* =+",
)
"""Lines only a pytest run prints (session header or final summary): tell "pytest ran and
collected nothing" apart from "this is not pytest output at all"."""


def passed(status: str | None) -> bool:
    """True iff ``status`` is PASSED (see :data:`PASSING`)."""
    return status in PASSING


def failed(status: str | None) -> bool:
    """True if ``status`` counts as a failure (FAILED or ERROR), as in SWE-bench."""
    return status in FAILING


def parse_test_log(log: str, parser: Callable[..., dict[str, str]] | None = None) -> dict[str, str]:
    """Parse a test log into a status map with a SWE-bench log parser.

    Args:
        log: the combined stdout/stderr of one test run.
        parser: a SWE-bench Python log parser (``(log, test_spec) -> status map``, e.g.
            ``parse_log_django``); None: ``parse_log_pytest`` on ``pytest -rA`` output, which also
            tells "pytest collected nothing" (its summary says so) from "not pytest output".

    Returns:
        ``{test_id: status}``; empty when the runner ran but reported no test.

    Raises:
        VerifierOutputError: the log is empty, or (pytest) not pytest output at all (no test line,
            no session header, no summary).
    """
    if not isinstance(log, str):
        raise errors.VerifierOutputError(f"test log must be str, got {type(log).__name__}")
    if parser is None:
        from swebench.harness.log_parsers.python import parse_log_pytest as parser
    status_map = parser(log, None)
    if status_map:
        return {str(k): str(v) for k, v in status_map.items()}
    if not log.strip():
        raise errors.VerifierOutputError("test log is empty: the verifier printed nothing")
    if parser.__name__ == "parse_log_pytest" and _PYTEST_MARKERS.search(log) is None:
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
            "oracle run failed 3 tests", "no test collected with the bug", "flaky: ...", ...).
        flaky_tests: tests whose status differed between repeated Oracle runs (sorted; empty when
            they agreed or were not repeated).
        oracle_runs: Oracle runs the verdict rests on (0 when no Oracle ran).
        known_tests: every test id the pristine runs (NOP, Oracle) collected, sorted (the task's
            known tests: :attr:`forgeflow.sandbox.verifier.TaskTests.known_tests`); empty when not
            recorded.
        repeat_s: seconds pytest spent repeating the FAIL_TO_PASS and sampled PASS_TO_PASS tests in
            the second Oracle run (the flaky-gold check's cost beyond a plain run); None: no repeats.
    """

    model_config = ConfigDict(frozen=True)

    FAIL_TO_PASS: list[str] = Field(default_factory=list)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    accepted: bool
    reason: str = Field(min_length=1)
    flaky_tests: list[str] = Field(default_factory=list)
    oracle_runs: int = Field(default=0, ge=0)
    known_tests: list[str] = Field(default_factory=list)
    repeat_s: float | None = Field(default=None, ge=0.0)


def _check_map(name: str, status_map: dict[str, str]) -> None:
    if not isinstance(status_map, dict):
        raise errors.InputError(f"{name} must be a dict of test id -> status, got {type(status_map).__name__}")
    valid = STATUSES
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
        InputError: a map is not a dict or holds a status outside :data:`STATUSES`.
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
    return ValidationReport(FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, accepted=ok, reason=reason, oracle_runs=1)


def grade_resolved(status: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> float:
    """Score one run: 1.0 iff every FAIL_TO_PASS and PASS_TO_PASS test is PASSED.

    SWE-bench's resolution rule (``swebench.harness.grading.get_resolution_status``: FULL when
    every FAIL_TO_PASS and PASS_TO_PASS test passes, a missing test failing) with the strict pass
    of :data:`PASSING`: an XFAIL, XPASS, SKIPPED or missing test is not a pass.

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
    return 1.0 if all(passed(status.get(t)) for t in [*fail_to_pass, *pass_to_pass]) else 0.0


@cache
def _log_parsers() -> dict[str, Callable[..., dict[str, str]]]:
    from swebench.harness.log_parsers import python as python_parsers

    return {name: fn for name, fn in sorted(vars(python_parsers).items())
            if name.startswith("parse_log_") and callable(fn)}


class _LogParsers(Mapping[str, Callable[..., dict[str, str]]]):
    """SWE-bench's Python log parsers by function name (``parse_log_pytest``, ``parse_log_django``,
    ``parse_log_sympy``, ...), read from ``swebench.harness.log_parsers.python`` on first use."""

    def __getitem__(self, name: str) -> Callable[..., dict[str, str]]:
        return _log_parsers()[name]

    def __iter__(self):  # noqa: ANN204 - Mapping protocol
        return iter(_log_parsers())

    def __len__(self) -> int:
        return len(_log_parsers())


LOG_PARSERS: Mapping[str, Callable[..., dict[str, str]]] = _LogParsers()
"""Log parsers for runners without a structured report, by SWE-bench's function name."""
