"""Grading: status maps of test runs, the validation of a candidate bug, the score of a trial.

A *status map* is ``{test_id: status}`` (:data:`STATUSES`; pytest node ids verbatim), from forgeflow's pytest
report or SWE-bench's log parsers (``swebench.harness.log_parsers``, swebench 4.1). The rules are SWE-bench's
(``swebench.harness.grading``) and SWE-smith's (``get_valid_report`` in ``swesmith.harness.grading``: only
tests present in both runs are compared) with one strictness added: **only PASSED is a pass** (an XFAIL,
XPASS, SKIPPED or missing test never is)."""

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
    """Parse a test log into a ``{test_id: status}`` map (empty: the runner reported no test).

    Args:
        parser: a SWE-bench log parser (``(log, test_spec) -> status map``); None: ``parse_log_pytest`` on
            ``pytest -rA`` output.

    Raises:
        VerifierOutputError: the log is empty, or (pytest) not pytest output at all.
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
    """The verdict on one candidate bug from its NOP (bug present) and Oracle (bug reverted) runs."""

    model_config = ConfigDict(frozen=True)

    FAIL_TO_PASS: list[str] = Field(default_factory=list,
                                    description="tests failing or erroring with the bug and passing with it "
                                                "reverted (sorted).")
    PASS_TO_PASS: list[str] = Field(default_factory=list, description="tests passing in both runs (sorted).")
    accepted: bool = Field(description="True iff FAIL_TO_PASS is non-empty and no test fails in the Oracle run.")
    reason: str = Field(min_length=1,
                        description="why it was accepted or rejected, for a person (\"no test failed with the "
                                    "bug\", \"oracle run failed 3 tests\", \"no test collected with the bug\", "
                                    "\"flaky: ...\", ...).")
    flaky_tests: list[str] = Field(default_factory=list,
                                   description="tests whose status differed between repeated Oracle runs, or "
                                               "FAIL_TO_PASS tests that did not fail in every NOP run (sorted; "
                                               "empty when they agreed or were not repeated).")
    oracle_runs: int = Field(default=0, ge=0, description="Oracle runs the verdict rests on (0 when no Oracle ran).")
    known_tests: list[str] = Field(default_factory=list,
                                   description="every test id the pristine runs (NOP, Oracle) collected, sorted "
                                               "(the task's known tests: "
                                               "forgeflow.sandbox.verifier.TaskTests.known_tests); empty when not "
                                               "recorded.")
    repeat_s: float | None = Field(default=None, ge=0.0,
                                   description="seconds pytest spent repeating the FAIL_TO_PASS and sampled "
                                               "PASS_TO_PASS tests in the second Oracle run (the flaky-gold check's "
                                               "cost beyond a plain run); None: no repeats.")


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
    """Compare the NOP and Oracle status maps of a candidate bug (SWE-smith's validation rule; ``oracle`` None:
    not run).

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
    """Score one run: 1.0 iff every FAIL_TO_PASS and PASS_TO_PASS test is PASSED, else 0.0.

    Raises:
        InputError: both lists are empty (SWE-bench would call that resolved) or ``status`` is malformed.
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
