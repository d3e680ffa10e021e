"""The verifier's pieces that need no container: the pytest report plugin and its channel (run here
with this machine's pytest on tiny projects, through run_tests and a local stand-in for the sandbox),
the channel's tamper checks, the cross-checks with the exit status, pytest's summary and the known
tests, and the repeated-Oracle verdict. The whole verifier in real task images: tests/adversarial/."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from forgeflow.sandbox.base import ExecResult
from forgeflow.sandbox.grading import ValidationReport
from forgeflow.sandbox.trial import disagreeing_tests, judge_repeats
from forgeflow.sandbox.verifier import (
    VERIFIER_ENV,
    RepeatPlan,
    TaskTests,
    _read_pytest_run,
    _wrapped_command,
    cross_check,
    run_tests,
)
from forgeflow.sandbox.verifier_channel import digest_records, find_summary_lines, read_channel, summary_counts

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


class LocalSandbox:
    """Runs the verifier's script with bash on this machine: ``/testbed`` is ``project`` and the
    verifier's folder lives under ``tmp`` (this machine's pytest; entry-point plugins off for speed)."""

    def __init__(self, project: Path, tmp: Path) -> None:
        self.project, self.tmp = project, tmp

    def exec(self, command, timeout_s, workdir=None, env=None) -> ExecResult:
        script = command.replace("/tmp/forgeflow-verifier", str(self.tmp / "verifier")).replace(
            "/testbed", str(self.project))
        full = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "FORGEFLOW_VERIFIER"))}
        full.update(env or {}, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        proc = subprocess.run(["bash", "-c", script], env=full, capture_output=True, timeout=timeout_s)
        return ExecResult.from_bytes(proc.returncode, proc.stdout, proc.stderr, 0.1)


def _project(tmp_path: Path, files: dict[str, str]) -> LocalSandbox:
    project = tmp_path / "project"
    for rel, text in files.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    return LocalSandbox(project, tmp_path)


COMMAND = "python3 -m pytest -rA -p no:cacheprovider"


def test_the_plugin_streams_every_outcome_by_exact_node_id_and_what_the_runner_read(tmp_path: Path) -> None:
    sandbox = _project(tmp_path, {"test_things.py": TESTS, "conftest.py": "", "pytest.ini": "[pytest]\n"})
    result = run_tests(sandbox, COMMAND, 120)
    assert result.problem is None and result.tampering == [], result.log_tail
    # the must-fail tripwire ends a clean run with exit 1; the task's outcomes leave both tripwires out
    assert result.exit_code == 1 == result.report_exit_code
    assert result.tripwires == {"must_pass": "PASSED", "must_fail": "FAILED"} and result.credit_blocker is None
    tests = result.tests
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
    assert "test_things.py::test_ids[[x]]" in ids and len(ids) == 4 and all(tests[t] == "PASSED" for t in ids)
    assert len(tests) == 13 and result.collected == list(tests)
    # pytest's own summary agrees count by count (a failed test with a teardown error counts in both)
    assert result.summary_counts == {"failed": 3, "passed": 8, "skipped": 1, "xfailed": 1, "xpassed": 1, "error": 2}
    assert "@forgeflow-verifier-" not in result.log_tail and "short test summary info" in result.log_tail
    inputs = result.runner_inputs
    project = str(tmp_path / "project")
    assert inputs["rootpath"] == project and inputs["inipath"] == f"{project}/pytest.ini"
    assert inputs["conftests"] == [f"{project}/conftest.py"]
    assert inputs["plugins"]["forgeflow-verifier-reporter"].endswith("/plugin/forgeflow_pytest_report.py")
    assert inputs["sys_path"][0] == project and inputs["modules"]["pytest"].endswith("pytest/__init__.py")
    assert all(not f.startswith(project) for f in inputs["modules"].values())  # nothing of the repository yet


def test_collection_errors_are_errors_under_the_collectors_id(tmp_path: Path) -> None:
    sandbox = _project(tmp_path, {"test_things.py": "def test_a():\n    pass\n",
                                  "test_broken.py": "import nonexistent_module_xyz\n"})
    result = run_tests(sandbox, COMMAND, 120)
    assert result.exit_code == 2 == result.report_exit_code and result.problem is None
    assert result.tests == {"test_broken.py": "ERROR"} and result.summary_counts == {"error": 1}
    assert result.credit_blocker.startswith("the verifier's tripwires did not both run")


COUNTER_TEST = textwrap.dedent('''\
    from pathlib import Path


    def test_alternates(tmp_path_factory):
        count = Path(__file__).with_name("count.txt")
        n = int(count.read_text()) if count.exists() else 0
        count.write_text(str(n + 1))
        assert n % 3 != 2


    def test_steady():
        pass


    def test_other():
        pass
''')


def test_a_repeat_run_runs_the_selected_tests_back_to_back_in_one_process(tmp_path: Path) -> None:
    sandbox = _project(tmp_path, {"test_c.py": COUNTER_TEST})
    plan = RepeatPlan(tests=["test_c.py::test_alternates", "test_c.py::test_steady"], repeat_count=4)
    result = run_tests(sandbox, COMMAND, 120, repeat=plan)
    assert result.problem is None, result.problem
    assert [r.get("test_c.py::test_alternates") for r in result.repeat_runs] == ["PASSED", "PASSED", "FAILED", "PASSED"]
    assert [len(r) for r in result.repeat_runs] == [3, 2, 2, 2]  # the others run once
    # pytest counts every repetition, and the tripwires
    assert result.summary_counts == {"failed": 2, "passed": 9} and result.repeat_s is not None
    only = run_tests(sandbox, COMMAND, 120, repeat=plan.model_copy(update={"only_selected": True}))
    assert only.problem is None and only.collected == plan.tests and only.summary_counts["deselected"] == 1


def _records(nonce: str, *extra: dict, ids=("t::a", "t::b")) -> list[dict]:
    wires = [f"w.py::test_forgeflow_must_pass_{nonce}", f"w.py::test_forgeflow_must_fail_{nonce}"]
    body = [{"kind": "start"}, {"kind": "collected", "ids": [*ids, *wires]},
            {"kind": "report", "nodeid": "t::a", "when": "call", "outcome": "failed"},
            {"kind": "report", "nodeid": "t::b", "when": "call", "outcome": "passed"},
            {"kind": "report", "nodeid": wires[0], "when": "call", "outcome": "passed"},
            {"kind": "report", "nodeid": wires[1], "when": "call", "outcome": "failed"},
            {"kind": "end", "exitstatus": 1, "verbosity": 0}, *extra]
    return [{"seq": i, **r} for i, r in enumerate(body)]


def test_every_contradiction_in_the_stream_is_named_tampering() -> None:
    nonce = "n0nce"
    clean = digest_records(_records(nonce), nonce)
    assert clean.tampering == [] and clean.tests == {"t::a": "FAILED", "t::b": "PASSED"}
    assert clean.tripwires == {"must_pass": "PASSED", "must_fail": "FAILED"}
    assert clean.counts == {"failed": 2, "passed": 2, "deselected": 0}
    after_end = _records(nonce, {"kind": "report", "nodeid": "t::a", "when": "call", "outcome": "passed"})
    assert "a 'report' record after the session-end record" in digest_records(after_end, nonce).tampering
    second = _records(nonce)
    second.insert(4, {"kind": "report", "nodeid": "t::a", "when": "call", "outcome": "passed"})
    for i, r in enumerate(second):
        r["seq"] = i
    assert "two call outcome records of 't::a' (the second: passed)" in digest_records(second, nonce).tampering
    stranger = _records(nonce)
    stranger[2]["nodeid"] = "t::never"
    assert "an outcome record of 't::never', a test that was never collected" in digest_records(stranger, nonce).tampering
    gap = _records(nonce)
    del gap[3]
    assert any("sequence number" in t for t in digest_records(gap, nonce).tampering)
    assert any("repetition 3" in t for t in digest_records(
        [{**r, "rep": 3} if r["kind"] == "report" else r for r in _records(nonce)], nonce).tampering)
    # the reader: the records come out of the log whatever surrounds them; a corrupt one is named
    out = f"tests/t.py .\n@forgeflow-verifier-{nonce} {json.dumps(_records(nonce)[0])}\nF\n@forgeflow-verifier-{nonce} {{oops\n"
    reading = read_channel(out, nonce)
    assert reading.log == "tests/t.py .F" and reading.corrupt == ["{oops"]
    assert reading.record_count == 1 and reading.started and not reading.ended  # the start record, digested


def _stdout(nonce: str, records: list[dict], summary: str) -> str:
    return "".join(f"\n@forgeflow-verifier-{nonce} {json.dumps(r)}\n" for r in records) + summary + "\n"


def test_the_stream_must_agree_with_pytests_summary_the_exit_status_and_the_known_tests() -> None:
    nonce = "n0nce"

    def read(records, summary="==== 2 failed, 2 passed in 0.10s ====", exit_code=1, expect=None):
        res = ExecResult.from_bytes(exit_code, _stdout(nonce, records, summary).encode(), b"", 0.1)
        return _read_pytest_run(res, nonce, expect, None)

    assert read(_records(nonce)).problem is None
    forged = read(_records(nonce), "==== 1 failed, 3 passed in 0.10s ====")
    assert forged.tampering == ["pytest's own summary line disagrees with the outcomes read (3 passed there, 2 read, "
                                "1 failed there, 2 read)"]
    assert "summary line is missing" in read(_records(nonce), "bye").problem
    early = _stdout(nonce, [], "==== 4 passed in 0.1s ====") + _stdout(nonce, _records(nonce), "done")
    res = ExecResult.from_bytes(1, early.encode(), b"", 0.1)
    assert "summary line is missing" in _read_pytest_run(res, nonce, None, None).problem  # only after the end counts
    says_0 = [{**r, "exitstatus": 0} if r["kind"] == "end" else r for r in _records(nonce)]
    assert "exited 0 but the report has 1 failed test(s), e.g. 't::a'" in read(says_0, exit_code=0).problem
    assert "says pytest exited 1 but the test command exited 0" in read(_records(nonce), exit_code=0).problem
    no_end = read(_records(nonce)[:-1], "")
    assert no_end.problem == "the test command exited 1 but wrote no test report" and no_end.tampering
    flipped = [{**r, "outcome": "passed"} if "must_fail" in str(r.get("nodeid")) else r for r in _records(nonce)]
    assert any("must-fail tripwire reported PASSED" in t for t in read(flipped, "== 1 failed, 3 passed in 0.1s ==").tampering)
    expect = TaskTests(instance_id="t", image_ref="img", test_command="pytest", known_tests=["t::a", "t::b"],
                       FAIL_TO_PASS=["t::a"])
    assert read(_records(nonce), expect=expect).problem is None
    assert "1 known test(s) not collected, e.g. 't::c'" in read(
        _records(nonce), expect=expect.model_copy(update={"known_tests": ["t::a", "t::b", "t::c"]})).problem
    extra = read(_records(nonce, ids=("t::a", "t::b", "t::a")), expect=expect).problem
    assert "'t::a' x2" in extra and "collected exactly once" in extra
    unknown = expect.model_copy(update={"known_tests": ["t::a"]})
    assert "1 collected test(s) the task does not know, e.g. 't::b'" in read(_records(nonce), expect=unknown).problem


def test_pytest_summary_lines_are_read_in_every_verbosity() -> None:
    text = "x\n==== 1 failed, 5 passed, 2 errors, 3 warnings in 0.12s ====\n1 passed in 0.05s\n= no tests ran in 61.20s (0:01:01) =\n"
    lines = [line for _, line in find_summary_lines(text)]
    assert [summary_counts(line) for line in lines] == [{"failed": 1, "passed": 5, "error": 2, "warning": 3},
                                                        {"passed": 1}, {}]
    assert find_summary_lines("!!! Interrupted: 1 error during collection !!!\nshort test summary info") == []


def test_wrapped_command_keeps_the_test_command_and_installs_the_plugin_and_tripwires() -> None:
    script, prefix = _wrapped_command("python3 -m pytest -rA tests", "n0nce")
    assert prefix == "@forgeflow-verifier-n0nce"
    assert "(\npython3 -m pytest -rA tests\n) </dev/null 9>&1" in script
    assert 'PYTEST_ADDOPTS="-p forgeflow_pytest_report' in script and "def pytest_sessionfinish" in script
    assert 'PYTHONPYCACHEPREFIX="/tmp/forgeflow-verifier-n0nce/pycache"' in script
    assert "def test_forgeflow_must_fail_n0nce():" in script and 'FORGEFLOW_VERIFIER_SELECT="' not in script
    assert VERIFIER_ENV["TZ"] == "UTC" and VERIFIER_ENV["PYTHONHASHSEED"] == "0"
    assert VERIFIER_ENV["PYTHONNOUSERSITE"] == "1" and VERIFIER_ENV["LC_ALL"] == "C.UTF-8"
    assert VERIFIER_ENV["PYTHONDONTWRITEBYTECODE"] == "1"


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
    # the must-fail tripwire's failure explains exit 1, and contradicts exit 0
    assert cross_check({"t::a": "PASSED"}, 1, 1, True, extra_failure=True) is None
    assert "exited 0 but the report has 1 failed" in cross_check({"t::a": "PASSED"}, 0, 0, True, extra_failure=True)


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

    tests = TaskTests(instance_id="i", image_ref="img", test_command="pytest", FAIL_TO_PASS=["t::f2p"],
                      PASS_TO_PASS=["t::p2p"], log_parser=None)
    assert pickle.loads(pickle.dumps(tests)) == tests
    with pytest.raises(ValidationError):
        TaskTests(instance_id="i", image_ref="img", test_command="pytest", timeout_s=5)


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
    tests = TaskTests(instance_id="i", image_ref="img", test_command="pytest", FAIL_TO_PASS=["t::f2p"],
                      PASS_TO_PASS=["t::p2p"])
    fix = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    kwargs = {"timeout_s": 30, "spec": SandboxSpec(), "name": "ff-agent-x", "backend": "scripted"}
    fixed = verify_submission(tests, fix, **kwargs)
    assert fixed.reward == 1.0 and fixed.result.tests == {"t::f2p": "PASSED", "t::p2p": "PASSED"}
    unfixed = verify_on(None, tests, fix, **kwargs)
    assert unfixed.reward == 0.0 and "node_id" not in unfixed.evidence
