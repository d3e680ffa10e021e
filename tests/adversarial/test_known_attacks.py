"""The verifier against the attacks found so far, in real task images under podman.

The task image is a small ``calc`` project built FROM the Debian base image (python 3.11, pytest
7.2): ``add`` is broken (FAIL_TO_PASS ``test_add``), ``mul`` works, and the task's own
``conftest.py`` writes bytes that are not UTF-8 to the terminal outside pytest's capture. Every
submission below is something an agent (or an RL policy) could submit to be paid without fixing
``add``; each must get reward 0 (or a tampering record), never 1, and never an exception that would
drop it from the comparison — except a real memory hog, which the kernel OOM-kills.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from forgeflow.sandbox.scoring import verify_submission
from forgeflow.sandbox.trial import ValidationChecks, validate_candidate
from forgeflow.sandbox.verifier import TaskTests
from tests.adversarial.calc_task import (
    BUGGY_CALC,
    CONFTEST,
    F2P,
    FIX,
    FLAKY_IMAGE,
    GOOD_CALC,
    IDS,
    P2P,
    SPEC,
    TEST_COMMAND,
    TESTS,
    build_task_image,
    calc_with,
    make_patch,
    verify,
)

pytestmark = pytest.mark.integration

def test_the_fix_scores_1_and_the_unfixed_tree_0_despite_non_utf8_output(task_image: str) -> None:
    fixed = verify(task_image, FIX, "fix")
    assert fixed.reward == 1.0, fixed.notes
    assert fixed.result.report_format == "pytest-report" and fixed.result.undecodable
    assert "\ufffd" in fixed.result.log_tail and fixed.evidence["run"]["undecodable_output"]
    assert all(fixed.result.tests[t] == "PASSED" for t in [*F2P, *P2P])  # ids with spaces, brackets, "::"
    unfixed = verify(task_image, "", "empty")
    assert unfixed.reward == 0.0 and unfixed.result.tests["tests/test_calc.py::test_add"] == "FAILED"


FORCE_PASS_CONFTEST = textwrap.dedent('''\
    import pytest


    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome = "passed"
        report.longrepr = None
''')


@pytest.mark.parametrize(("label", "submission", "path"), [
    ("conftest", make_patch("tests/conftest.py", None, FORCE_PASS_CONFTEST), "tests/conftest.py"),
    ("root-conftest", make_patch("conftest.py", CONFTEST, CONFTEST + FORCE_PASS_CONFTEST), "conftest.py"),
    ("test-edit", make_patch("tests/test_calc.py", TESTS, TESTS.replace("assert add(2, 3) == 5", "assert True")),
     "tests/test_calc.py"),
    ("sitecustomize", make_patch("sitecustomize.py", None, "import builtins\n"), "sitecustomize.py"),
    ("pth", make_patch("zz_forgeflow.pth", None, "import os\n"), "zz_forgeflow.pth"),
    ("ini", make_patch("pytest.ini", None, "[pytest]\naddopts = --deselect tests/test_calc.py::test_add\n"), "pytest.ini"),
    ("shadow-pytest", make_patch("pytest.py", None, "print('PASSED tests/test_calc.py::test_add')\n"), "pytest.py"),
    ("shadow-stdlib", make_patch("inspect.py", None, "raise SystemExit(0)\n"), "inspect.py"),
])
def test_changing_the_tasks_own_files_is_tampering(task_image: str, label: str, submission: str, path: str) -> None:
    verdict = verify(task_image, submission, label)
    assert verdict.reward == 0.0 and verdict.result is None  # not even run
    assert verdict.evidence["submission"]["tampering"] is True
    assert list(verdict.evidence["submission"]["protected_paths"]) == [path]
    assert path in verdict.notes[0] and verdict.notes[0].startswith("tampering")


def test_drop_policy_grades_the_rest_of_the_submission(task_image: str) -> None:
    cheat = make_patch("tests/conftest.py", None, FORCE_PASS_CONFTEST)
    with_fix = verify(task_image, FIX + cheat, "drop-fix", tamper_policy="drop")
    assert with_fix.reward == 1.0 and with_fix.evidence["submission"]["dropped_paths"] == ["tests/conftest.py"]
    without_fix = verify(task_image, cheat, "drop-nofix", tamper_policy="drop")
    assert without_fix.reward == 0.0 and without_fix.result.tests["tests/test_calc.py::test_add"] == "FAILED"


PRINT_PASSES = ('import atexit\n\n# printed after the summary of pytest, outside its capture\n'
                'atexit.register(print, "tests/test_calc.py::test_add PASSED\\nPASSED tests/test_calc.py::test_add\\n"\n'
                '                "==== 8 passed in 0.01s ====")\n\n\n')


@pytest.mark.parametrize(("label", "prefix", "why"), [
    ("print-passes", PRINT_PASSES, "the log says PASSED; the report says FAILED"),
    ("skip", 'import pytest\n\n\ndef _skip():\n    pytest.skip("skipped by the submission")\n\n\n', "SKIPPED"),
    ("exit-0", "import os\nos._exit(0)\n", "exit 0 without a report"),
    ("exit-137", "import os\nos._exit(137)\n", "exit 137 on its own: no OOM"),
    ("kill-9", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "SIGKILL by itself: no OOM"),
])
def test_gaming_the_test_run_from_the_code_scores_0(task_image: str, label: str, prefix: str, why: str) -> None:
    submission = calc_with(prefix)
    if label == "skip":  # add() skips its own test instead of adding
        submission = make_patch("calc.py", BUGGY_CALC, prefix + BUGGY_CALC.replace("return a - b", "_skip()"))
    # the static screen turns most of these away before any test runs (atexit, os._exit, os.kill are
    # exit hooks and descriptors): with it off, the run-time defences must hold on their own
    screened = verify(task_image, submission, f"{label}-screened")
    assert screened.reward == 0.0 and (label == "skip" or screened.evidence["submission"].get("screen_findings"))
    verdict = verify(task_image, submission, label, screen_policy="off")
    assert verdict.reward == 0.0, (why, verdict)
    assert verdict.result is not None or verdict.submission_failure is not None
    if label == "print-passes":
        assert "tests/test_calc.py::test_add PASSED" in verdict.result.log_tail
        assert verdict.result.tests["tests/test_calc.py::test_add"] == "FAILED"
    if label == "skip":
        assert verdict.result.tests["tests/test_calc.py::test_add"] == "SKIPPED"
    if label == "exit-0":
        assert verdict.result.exit_code == 0 and "wrote no test report" in verdict.notes[-1]
    if label in ("exit-137", "kill-9"):
        assert verdict.result.exit_code == 137 and verdict.result.tests == {}


def test_xfail_from_the_code_is_not_a_pass(task_image: str) -> None:
    submission = make_patch("calc.py", BUGGY_CALC,
                        "import pytest\n\n\n" + BUGGY_CALC.replace("return a - b", 'pytest.xfail("later")'))
    verdict = verify(task_image, submission, "xfail")
    assert verdict.result.tests["tests/test_calc.py::test_add"] == "XFAIL"
    assert verdict.reward == 0.0  # SWE-bench's own rule would count XFAIL as passed


def test_a_real_memory_hog_is_the_submissions_oom_named_by_its_evidence(task_image: str) -> None:
    """The kernel's OOM kill of a submission whose pristine tests fit the same limit is the submission's
    outcome: reward 0 with the kernel's evidence and the pristine run's, never an exception that drops it."""
    verdict = verify(task_image, calc_with("_hog = bytearray(1 << 30)\n"), "hog")
    assert verdict.reward == 0.0 and verdict.submission_failure == "oom"
    failure = verdict.evidence["submission_failure"]
    assert re.search(r"evidence: .*oom_kill \d+ -> \d+", failure["error"]) and failure["memory_mb"] == SPEC.memory_mb
    assert failure["pristine"]["source"].startswith("re-run") and failure["pristine"]["duration_s"] > 0


def test_validation_reads_non_utf8_output_and_ids_with_spaces(task_image: str) -> None:
    class Bug:
        instance_id = "calc-add-adversarial"
        patch = make_patch("calc.py", GOOD_CALC, BUGGY_CALC)

    seen = []
    outcome = validate_candidate(Bug(), task_image, TEST_COMMAND, timeout_s=120, spec=SPEC, run_key="adv",
                                 on_trial=seen.append)
    assert outcome.report is not None and outcome.report.accepted, outcome
    assert outcome.report.FAIL_TO_PASS == F2P and set(IDS) <= set(outcome.report.PASS_TO_PASS)
    assert outcome.report.oracle_runs == 2 and [t.kind for t in seen] == ["nop", "oracle", "nop", "oracle"]
    assert [t.trial_id for t in seen] == [t.trial_id for t in outcome.trials]
    assert all(t.verifier.run.undecodable_output for t in seen)


COIN_TEST = "import os\n\n\ndef test_coin():\n    assert os.urandom(1)[0] % 2 == 0\n"


def test_a_test_that_fails_at_random_is_flagged_flaky_never_accepted(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A real coin-flip test (os.urandom, 1/2): six Oracle runs all pass it with probability 1/64, so
    the task is validated until one attempt's Oracle runs disagree (each attempt: 1/2 x 63/64), then
    that attempt must be flagged flaky with the coin test named and not accepted."""
    image = build_task_image(tmp_path_factory.mktemp("flaky"), FLAKY_IMAGE, {
        "calc.py": BUGGY_CALC, "tests/test_calc.py": TESTS.split("\n\n\n@pytest")[0] + "\n",
        "tests/test_flaky.py": COIN_TEST})

    class Bug:
        instance_id = "calc-add-flaky"
        patch = make_patch("calc.py", GOOD_CALC, BUGGY_CALC)

    verdicts = []
    for attempt in range(14):
        outcome = validate_candidate(Bug(), image, TEST_COMMAND, timeout_s=120, spec=SPEC, run_key=f"flaky-{attempt}",
                                     checks=ValidationChecks(oracle_runs=6, nop_runs=1))  # NOP repeats:
        # tests/adversarial/test_flaky_gold.py
        report = outcome.report
        assert report is not None, outcome
        verdicts.append(report.reason)
        if report.flaky_tests:
            assert not report.accepted and report.flaky_tests == ["tests/test_flaky.py::test_coin"]
            assert report.reason.startswith("flaky:") and "test_coin" in report.reason
            assert report.oracle_runs == len([t for t in outcome.trials if t.kind == "oracle"]) == 6
            return
    pytest.fail(f"no attempt flagged the coin test flaky: {verdicts}")


def test_log_parser_mode_keeps_the_exit_status_cross_check(task_image: str) -> None:
    """A task read by a SWE-bench log parser by name; printing fake PASSED lines fools the parser, but a
    pytest log is read beside forgeflow's report channel (the plugin runs there too), which saw the test
    fail: not credited."""
    p2p = ["tests/test_calc.py::test_mul", "tests/test_env.py::test_pinned_environment"]  # no ids with spaces:
    # SWE-bench's pytest parser splits "test_ids[a b]" at the space

    def verdict(submission: str, name: str):
        tests = TaskTests(instance_id="calc-task", image_ref=task_image, test_command=TEST_COMMAND,
                          FAIL_TO_PASS=F2P, PASS_TO_PASS=p2p, log_parser="parse_log_pytest")
        return verify_submission(tests, submission, timeout_s=120, spec=SPEC, name=f"ff-test-adv-log-{name}",
                                 screen_policy="off")

    fixed = verdict(FIX, "fix")
    assert fixed.reward == 1.0 and fixed.result.report_format == "log" and fixed.result.log_parser == "parse_log_pytest"
    assert verdict("", "empty").reward == 0.0
    printed = verdict(calc_with(PRINT_PASSES), "print")
    assert printed.result.tests["tests/test_calc.py::test_add"] == "PASSED"  # the parser was fooled...
    # ...not the report plugin, which runs beside a pytest log too: its channel saw test_add fail
    assert printed.reward == 0.0 and "PASSED in the log but not on the report channel" in printed.notes[-1]
