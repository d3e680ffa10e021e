"""The verifier's pieces that need no container: the pytest report plugin (run here with this
machine's pytest on a tiny project), the exit-status cross-check, and the repeated-Oracle verdict.
The whole verifier in real task images is tested in tests/integration/test_verifier_adversarial.py."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

import pytest

from forgeflow.sandbox.grading import ValidationReport
from forgeflow.sandbox.trial import disagreeing_tests, judge_repeats
from forgeflow.sandbox.verifier import (
    VERIFIER_ENV,
    _read_report,
    _wrapped_command,
    cross_check,
)

TESTS = textwrap.dedent(
    '''
    import pytest

    def test_pass():
        pass

    def test_fail():
        assert False

    @pytest.mark.parametrize("x", ["a b", "c::d", "é", "[x]"])
    def test_ids(x):
        pass

    @pytest.mark.skip(reason="no")
    def test_skip():
        pass

    @pytest.mark.xfail(reason="known")
    def test_xfail():
        assert False

    @pytest.mark.xfail(reason="known")
    def test_xpass():
        pass

    @pytest.mark.xfail(reason="known", strict=True)
    def test_xpass_strict():
        pass

    @pytest.fixture
    def broken():
        raise RuntimeError("setup broke")

    def test_setup_error(broken):
        pass

    @pytest.fixture
    def bad_teardown():
        yield
        raise RuntimeError("teardown broke")

    def test_teardown_error(bad_teardown):
        pass

    class TestCls:
        def test_method(self):
            pass
    '''
)


def _run_plugin(tmp_path: Path, tests: str = TESTS, extra: str = "") -> tuple[int, dict, str]:
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    source = resources.files("forgeflow").joinpath("data/forgeflow_pytest_report.py").read_text()
    (plugin_dir / "forgeflow_pytest_report.py").write_text(source)
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "test_things.py").write_text(tests)
    if extra:
        (project / "test_broken.py").write_text(extra)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(plugin_dir), "FORGEFLOW_VERIFIER_REPORT": str(report),
           "FORGEFLOW_VERIFIER_NONCE": "n0nce", "PYTEST_ADDOPTS": "-p forgeflow_pytest_report",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, ast.literal_eval(report.read_text(encoding="utf-8")), proc.stdout


def test_plugin_reports_every_outcome_by_exact_node_id(tmp_path: Path) -> None:
    exit_code, report, stdout = _run_plugin(tmp_path)
    assert exit_code == 1 and report["exitstatus"] == 1 and report["schema_version"] == 1
    # the start line reaches the real stdout, before pytest's own header (it is not captured)
    assert stdout.index("FORGEFLOW-VERIFIER-STARTED-n0nce") < stdout.index("test_things.py")
    tests = report["tests"]
    assert tests["test_things.py::test_pass"] == "PASSED"
    assert tests["test_things.py::test_fail"] == "FAILED"
    assert tests["test_things.py::test_skip"] == "SKIPPED"
    assert tests["test_things.py::test_xfail"] == "XFAIL"
    assert tests["test_things.py::test_xpass"] == "XPASS"
    assert tests["test_things.py::test_xpass_strict"] == "FAILED"
    assert tests["test_things.py::test_setup_error"] == "ERROR"
    assert tests["test_things.py::test_teardown_error"] == "ERROR"
    assert tests["test_things.py::TestCls::test_method"] == "PASSED"
    # spaces, "::" and brackets in parameters survive verbatim (pytest escapes non-ASCII ids itself)
    ids = sorted(t for t in tests if "test_ids" in t)
    assert "test_things.py::test_ids[a b]" in ids and "test_things.py::test_ids[c::d]" in ids
    assert "test_things.py::test_ids[[x]]" in ids and len(ids) == 4
    assert all(tests[t] == "PASSED" for t in ids)


def test_plugin_reports_collection_errors(tmp_path: Path) -> None:
    exit_code, report, _ = _run_plugin(tmp_path, extra="import nonexistent_module_xyz\n")
    assert exit_code == 2 and report["exitstatus"] == 2
    assert report["collect_errors"] == ["test_broken.py"]


def test_report_after_the_last_marker_wins_over_what_the_tests_print() -> None:
    marker = "FORGEFLOW-VERIFIER-REPORT-abc"
    fake = json.dumps({"tests": {"t::a": "PASSED"}, "exitstatus": 0})
    real = json.dumps({"tests": {"t::a": "FAILED"}, "exitstatus": 1})
    stdout = f"collected 1\n\n{marker}\n{fake}\nmore output\n\n{marker}\n{real}\n"
    head, report = _read_report(stdout, marker)
    assert report == {"tests": {"t::a": "FAILED"}, "exitstatus": 1}
    assert fake in head and real not in head
    assert _read_report("no marker at all", marker) == ("no marker at all", None)
    assert _read_report(f"x\n{marker}\nnot json", marker)[1] is None


def test_reports_are_parsed_one_at_a_time_cpython_gh_106905(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight validations in flight read their reports in eight threads; CPython 3.11's AST constructor
    keeps one recursion depth per interpreter, so parses overlapping in time can raise SystemError
    (seen at concurrency 8 in the curation benchmark): at most one ``literal_eval`` runs at a time."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    from forgeflow.sandbox import verifier  # noqa: PLC0415

    inside, most = [0], [0]
    guard = threading.Lock()
    real = ast.literal_eval

    def counting(text: str) -> object:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)  # a parse long enough for the other threads to arrive
        with guard:
            inside[0] -= 1
        return real(text)

    monkeypatch.setattr(verifier.ast, "literal_eval", counting)
    marker = "FORGEFLOW-VERIFIER-REPORT-abc"
    stdout = f"out\n{marker}\n{{'tests': {{'t::a': 'PASSED'}}, 'exitstatus': 0}}\n"
    reports: list[object] = []
    threads = [threading.Thread(target=lambda: reports.append(_read_report(stdout, marker)[1])) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert reports == [{"tests": {"t::a": "PASSED"}, "exitstatus": 0}] * 8
    assert most[0] == 1


def test_wrapped_command_keeps_the_test_command_and_installs_the_plugin() -> None:
    script, marker = _wrapped_command("python3 -m pytest -rA tests", "n0nce")
    assert marker == "FORGEFLOW-VERIFIER-REPORT-n0nce"
    assert "(\npython3 -m pytest -rA tests\n) </dev/null" in script
    assert 'PYTEST_ADDOPTS="-p forgeflow_pytest_report' in script and "def pytest_sessionfinish" in script
    assert VERIFIER_ENV["TZ"] == "UTC" and VERIFIER_ENV["PYTHONHASHSEED"] == "0"
    assert VERIFIER_ENV["PYTHONNOUSERSITE"] == "1" and VERIFIER_ENV["LC_ALL"] == "C.UTF-8"


@pytest.mark.parametrize(("tests", "exit_code", "report_exit", "found", "problem"), [
    ({"t::a": "PASSED"}, 0, 0, True, None),
    ({"t::a": "FAILED"}, 1, 1, True, None),
    ({"t::a": "FAILED"}, 2, 2, True, None),
    ({}, 5, 5, True, None),
    ({}, 137, None, False, None),                     # killed before it could report: nothing passed
    ({}, 2, None, False, None),                       # interrupted before the session finished
    ({}, 0, None, False, "exited 0 but wrote no test report"),
    ({}, 1, None, False, "exited 1 but wrote no test report"),
    ({"t::a": "PASSED"}, 0, 1, True, "says pytest exited 1 but the test command exited 0"),
    ({"t::a": "FAILED"}, 0, 0, True, "exited 0 but the report has 1 failed test(s)"),
    ({"t::a": "PASSED"}, 1, 1, True, "exited 1 (tests failed) but the report has no failed test"),
])
def test_cross_check(tests: dict, exit_code: int, report_exit: int | None, found: bool, problem: str | None) -> None:
    found_problem = cross_check(tests, exit_code, report_exit, found)
    if problem is None:
        assert found_problem is None
    else:
        assert found_problem is not None and problem in found_problem


FIRST = ValidationReport(FAIL_TO_PASS=["t::f2p"], PASS_TO_PASS=["t::p2p", "t::p2p_flaky"], accepted=True,
                         reason="accepted: 1 FAIL_TO_PASS, 2 PASS_TO_PASS", oracle_runs=1)
AGREE = {"t::f2p": "PASSED", "t::p2p": "PASSED", "t::p2p_flaky": "PASSED", "t::skip": "SKIPPED"}


def test_repeated_oracle_runs_that_agree_keep_the_verdict() -> None:
    report = judge_repeats(FIRST, [AGREE, dict(AGREE)], "reject")
    assert report.accepted and report.oracle_runs == 2 and report.flaky_tests == []


def test_a_disagreeing_pass_to_pass_test_is_flaky_and_rejected_or_dropped() -> None:
    second = AGREE | {"t::p2p_flaky": "FAILED"}
    rejected = judge_repeats(FIRST, [AGREE, second], "reject")
    assert not rejected.accepted and rejected.flaky_tests == ["t::p2p_flaky"]
    assert rejected.reason.startswith("flaky: 1 test(s) disagree across 2 Oracle runs") and "t::p2p_flaky" in rejected.reason
    dropped = judge_repeats(FIRST, [AGREE, second], "drop_flaky_pass_to_pass")
    assert dropped.accepted and dropped.PASS_TO_PASS == ["t::p2p"] and dropped.flaky_tests == ["t::p2p_flaky"]
    assert "after dropping 1 flaky test" in dropped.reason


def test_a_disagreeing_fail_to_pass_test_rejects_under_every_policy() -> None:
    second = AGREE | {"t::f2p": "FAILED"}
    for policy in ("reject", "drop_flaky_pass_to_pass"):
        report = judge_repeats(FIRST, [AGREE, second], policy)
        assert not report.accepted and report.flaky_tests == ["t::f2p"]
        assert "1 FAIL_TO_PASS test(s) disagree" in report.reason


def test_disagreement_ignores_harmless_differences_of_unrelated_tests() -> None:
    runs = [AGREE, AGREE | {"t::skip": "XFAIL"}, {k: v for k, v in AGREE.items() if k != "t::skip"}]
    assert disagreeing_tests(runs, {"t::f2p", "t::p2p"}) == []
    # an unrelated test that failed in one run does matter (a clean tree must pass)
    assert disagreeing_tests([AGREE, AGREE | {"t::skip": "ERROR"}], {"t::f2p"}) == ["t::skip"]
    assert disagreeing_tests([AGREE, {k: v for k, v in AGREE.items() if k != "t::p2p"}], {"t::p2p"}) == ["t::p2p"]


# --- verify_submission with a scripted sandbox (no container) ------------------------------------
def test_task_tests_pickle_for_a_ray_node_and_refuse_unknown_fields() -> None:
    import pickle

    from pydantic import ValidationError

    from forgeflow.sandbox.verifier import TaskTests

    tests = TaskTests(image_ref="img", test_command="pytest", fail_to_pass=["t::f2p"], pass_to_pass=["t::p2p"],
                      log_parser=None)
    assert pickle.loads(pickle.dumps(tests)) == tests
    with pytest.raises(ValidationError):
        TaskTests(image_ref="img", test_command="pytest", timeout_s=5)


def test_verify_submission_grades_the_task_tests_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripted sandbox of test_trial_validation answers the test run; the verdict follows the
    TaskTests' FAIL_TO_PASS / PASS_TO_PASS, in process through verify_on as directly."""
    from forgeflow.sandbox import backends
    from forgeflow.sandbox.base import SandboxSpec
    from forgeflow.sandbox.dispatch import verify_on
    from forgeflow.sandbox.scoring import verify_submission
    from forgeflow.sandbox.verifier import TaskTests
    from tests.core.sandbox.test_trial_validation import Script

    script = Script([{"t::f2p": "PASSED", "t::p2p": "PASSED"}, {"t::f2p": "FAILED", "t::p2p": "PASSED"}])
    monkeypatch.setitem(backends.BACKENDS, "scripted", lambda target: script.factory)
    tests = TaskTests(image_ref="img", test_command="pytest", fail_to_pass=["t::f2p"], pass_to_pass=["t::p2p"])
    fix = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    kwargs = {"timeout_s": 30, "spec": SandboxSpec(), "name": "ff-agent-x", "backend": "scripted"}
    fixed = verify_submission(tests, fix, **kwargs)
    assert fixed.reward == 1.0 and fixed.result.tests == {"t::f2p": "PASSED", "t::p2p": "PASSED"}
    unfixed = verify_on(None, tests, fix, **kwargs)
    assert unfixed.reward == 0.0 and "node_id" not in unfixed.evidence
