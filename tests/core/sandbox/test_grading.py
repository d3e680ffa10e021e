"""Grading on real ``pytest -rA`` logs (produced here by running pytest on tiny projects)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forgeflow.common import errors
from forgeflow.sandbox.grading import (
    ValidationReport,
    grade_resolved,
    grade_validation,
    parse_test_log,
)

GOOD_IMPL = "def add(a, b):\n    return a + b\n\ndef neg(a):\n    return -a\n"
BUGGY_IMPL = "def add(a, b):\n    return a - b\n\ndef neg(a):\n    return -a\n"
BROKEN_IMPL = "def add(a, b)\n    return a + b\n"  # syntax error: collection breaks

TESTS = textwrap.dedent(
    """
    import pytest
    from calc import add, neg

    def test_add():
        assert add(2, 3) == 5

    @pytest.mark.parametrize("x", [1, 2])
    def test_neg(x):
        assert neg(x) == -x

    def test_add_zero():
        assert add(0, 0) == 0

    @pytest.mark.skip(reason="not today")
    def test_skipped():
        pass

    @pytest.mark.xfail(reason="known")
    def test_xfail():
        assert False

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_fixture_error(broken):
        pass
    """
)


_LOGS: dict[tuple[str, str], str] = {}


def run_pytest(tmp_path: Path, impl: str, tests: str = TESTS) -> str:
    """Write ``calc.py`` + ``test_calc.py`` into a fresh folder and return pytest -rA's output.

    Each (impl, tests) pair runs once per session: the logs are real pytest output, reused.
    """
    key = (impl, tests)
    if key not in _LOGS:
        project = tmp_path / f"p{len(_LOGS)}"
        project.mkdir()
        (project / "calc.py").write_text(impl)
        (project / "test_calc.py").write_text(tests)
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_calc.py"],
            cwd=project, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        )
        _LOGS[key] = proc.stdout + proc.stderr
    return _LOGS[key]


TESTS_NO_ERROR = TESTS.split("@pytest.fixture")[0]


def test_parse_log_gives_each_tests_status(tmp_path: Path) -> None:
    status = parse_test_log(run_pytest(tmp_path, BUGGY_IMPL))
    assert status["test_calc.py::test_add"] == 'FAILED'
    assert status["test_calc.py::test_add_zero"] == 'PASSED'
    assert status["test_calc.py::test_neg[1]"] == 'PASSED'
    assert status["test_calc.py::test_neg[2]"] == 'PASSED'
    # pytest -rA prints skips as "SKIPPED [1] file:line: reason": SWE-bench's parser keeps no test id
    assert "test_calc.py::test_skipped" not in status
    assert status["test_calc.py::test_xfail"] == 'XFAIL'
    assert status["test_calc.py::test_fixture_error"] == 'ERROR'


def test_valid_bug_is_accepted_with_fail_to_pass(tmp_path: Path) -> None:
    nop = parse_test_log(run_pytest(tmp_path, BUGGY_IMPL, TESTS_NO_ERROR))
    oracle = parse_test_log(run_pytest(tmp_path, GOOD_IMPL, TESTS_NO_ERROR))
    report = grade_validation(nop, oracle)
    assert report.accepted, report.reason
    assert report.FAIL_TO_PASS == ["test_calc.py::test_add"]
    # only PASSED is a pass: the XFAIL test is in neither list
    assert report.PASS_TO_PASS == [
        "test_calc.py::test_add_zero",
        "test_calc.py::test_neg[1]",
        "test_calc.py::test_neg[2]",
    ]
    # Harbor convention: a valid task gives nop reward 0 and oracle reward 1
    assert grade_resolved(nop, report.FAIL_TO_PASS, report.PASS_TO_PASS) == 0.0
    assert grade_resolved(oracle, report.FAIL_TO_PASS, report.PASS_TO_PASS) == 1.0


def test_bug_no_test_detects_is_rejected(tmp_path: Path) -> None:
    harmless = GOOD_IMPL + "\n\ndef unused():\n    return 1\n"
    nop = parse_test_log(run_pytest(tmp_path, harmless, TESTS_NO_ERROR))
    assert grade_validation(nop, None) == ValidationReport(
        accepted=False, reason="no test failed with the bug"
    )
    oracle = parse_test_log(run_pytest(tmp_path, GOOD_IMPL, TESTS_NO_ERROR))
    report = grade_validation(nop, oracle)
    assert not report.accepted
    assert report.reason == "no test failed with the bug"
    assert report.FAIL_TO_PASS == []


def test_oracle_failures_reject(tmp_path: Path) -> None:
    # the fixture error fails in both runs: a task whose clean tree fails is not valid
    nop = parse_test_log(run_pytest(tmp_path, BUGGY_IMPL))
    oracle = parse_test_log(run_pytest(tmp_path, GOOD_IMPL))
    report = grade_validation(nop, oracle)
    assert not report.accepted
    assert report.reason == "oracle run failed 1 tests"
    assert report.FAIL_TO_PASS == ["test_calc.py::test_add"]


def test_bug_that_breaks_collection_is_rejected(tmp_path: Path) -> None:
    nop = parse_test_log(run_pytest(tmp_path, BROKEN_IMPL, TESTS_NO_ERROR))
    assert nop == {"test_calc.py": 'ERROR'}
    oracle = parse_test_log(run_pytest(tmp_path, GOOD_IMPL, TESTS_NO_ERROR))
    report = grade_validation(nop, oracle)
    assert not report.accepted
    assert report.reason == "no test collected with the bug"


def test_empty_collection_is_a_result_not_an_error(tmp_path: Path) -> None:
    log = run_pytest(tmp_path, GOOD_IMPL, "def helper():\n    pass\n")
    assert parse_test_log(log) == {}
    assert grade_validation({}, None).reason == "no test collected with the bug"


@pytest.mark.parametrize(
    "log",
    ["", "   \n", "bash: line 1: pytest: command not found\n", "Traceback (most recent call last):\n  boom\n"],
)
def test_unparseable_log_is_an_infra_error(log: str) -> None:
    with pytest.raises(errors.VerifierOutputError):
        parse_test_log(log)


def test_grade_resolved_counts_missing_tests_as_failed() -> None:
    status = {"t::a": "PASSED"}
    assert grade_resolved(status, ["t::a"], []) == 1.0
    assert grade_resolved(status, ["t::a"], ["t::b"]) == 0.0


def test_grade_resolved_refuses_nothing_to_grade() -> None:
    with pytest.raises(errors.InputError, match="both empty"):
        grade_resolved({"t::a": "PASSED"}, [], [])


def test_unknown_status_is_rejected_with_its_name() -> None:
    with pytest.raises(errors.InputError, match="oracle has 1 unknown statuses"):
        grade_validation({"t::a": "FAILED"}, {"t::a": "GREEN"})


@pytest.mark.parametrize("status", ["XFAIL", "XPASS", "SKIPPED", None])
def test_only_passed_is_a_pass_for_fail_to_pass_and_pass_to_pass(status: str | None) -> None:
    """A FAIL_TO_PASS or PASS_TO_PASS test that is skipped, xfailed, xpassed or missing scores 0
    (SWE-bench's own rule counts XFAIL as a pass: a submission could mark its way to reward 1)."""
    base = {"t::f2p": "PASSED", "t::p2p": "PASSED"}
    assert grade_resolved(base, ["t::f2p"], ["t::p2p"]) == 1.0
    for test in ("t::f2p", "t::p2p"):
        run = {k: v for k, v in base.items() if k != test} | ({test: status} if status else {})
        assert grade_resolved(run, ["t::f2p"], ["t::p2p"]) == 0.0, (test, status)


def test_an_xfail_in_the_oracle_is_no_fail_to_pass() -> None:
    report = grade_validation({"t::a": "FAILED", "t::b": "PASSED"}, {"t::a": "XFAIL", "t::b": "PASSED"})
    assert not report.accepted and report.FAIL_TO_PASS == [] and report.PASS_TO_PASS == ["t::b"]
