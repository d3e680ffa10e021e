"""Validation against gold that cannot be trusted, in real task images under podman: a FAIL_TO_PASS
test that passes only sometimes, and a bug whose NOP run hangs.

Both candidates were accepted or left unjudged before: a FAIL_TO_PASS test that passes only on its
first run in a process passed every plain Oracle run (each a fresh process), so it was accepted;
a NOP run that hung was an infrastructure exception (no verdict) though the Oracle run completes,
and such a task costs the timeout on every later use. The coin-flip rate (a test that passes half
the time) is measured over many validations by ``benchmarks/flaky_gold.py``.
"""

from __future__ import annotations

import textwrap

import pytest

from forgeflow.sandbox.trial import validate_candidate
from tests.adversarial.calc_task import BUGGY_CALC, GOOD_CALC, SPEC, TEST_COMMAND, build_task_image, make_patch

pytestmark = pytest.mark.integration

LEAKY_IMAGE = "localhost/forgeflow/test-verifier-leaky:1"
HANGING_IMAGE = "localhost/forgeflow/test-verifier-hanging:1"
LEAKY_TESTS = textwrap.dedent('''\
    from calc import add, mul

    _runs = []


    def test_add():
        _runs.append(1)
        assert add(2, 3) == 5
        assert len(_runs) == 1, "passes only on its first run in a process (state an earlier run left)"


    def test_mul():
        assert mul(2, 3) == 6
''')
HANGING_TESTS = textwrap.dedent('''\
    from calc import add


    def test_add():
        assert add(2, 3) == 5


    def test_spin():
        while add(1, 1) != 2:  # with the bug: forever
            pass
''')


class Bug:
    instance_id = "calc-add-gold"
    patch = make_patch("calc.py", GOOD_CALC, BUGGY_CALC)


def test_a_fail_to_pass_test_that_passes_only_once_per_process_is_flagged_flaky(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    image = build_task_image(tmp_path_factory.mktemp("leaky"), LEAKY_IMAGE,
                             {"calc.py": BUGGY_CALC, "tests/test_calc.py": LEAKY_TESTS})
    seen = []
    outcome = validate_candidate(Bug(), image, TEST_COMMAND, timeout_s=120, spec=SPEC, run_key="leaky",
                                 on_trial=seen.append)
    report = outcome.report
    assert report is not None and not report.accepted, outcome
    assert report.flaky_tests == ["tests/test_calc.py::test_add"] and report.oracle_runs == 2
    assert report.reason.startswith("flaky: 1 FAIL_TO_PASS test(s) disagree across 2 Oracle runs (7 runs")
    assert [t.kind for t in seen] == ["nop", "oracle", "oracle"] and [t.reward for t in seen] == [0.0, 1.0, 1.0]
    # the repeats' cost, from pytest's own durations, is reported with the verdict and the trial
    assert report.repeat_s is not None and 0 <= report.repeat_s < 5
    assert seen[-1].verifier.repeat.model_dump() == {"repeat_s": report.repeat_s, "runs": 6, "tests": 2}
    assert report.known_tests == ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"]


def test_a_bug_whose_nop_run_hangs_is_rejected_for_it_not_left_as_an_exception(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    image = build_task_image(tmp_path_factory.mktemp("hanging"), HANGING_IMAGE,
                             {"calc.py": BUGGY_CALC, "tests/test_calc.py": HANGING_TESTS})
    seen = []
    outcome = validate_candidate(Bug(), image, TEST_COMMAND, timeout_s=8, spec=SPEC, run_key="hang",
                                 on_trial=seen.append)
    report = outcome.report
    assert report is not None and not report.accepted and outcome.failed_trial is None, outcome
    assert report.reason.startswith("the NOP run (bug present) hung past the verifier's limit while the Oracle run "
                                    "completed in") and "VerifierTimeoutError" in report.reason
    nop, oracle = seen
    assert nop.kind == "nop" and nop.reward == 0.0 and nop.verifier.outcome.error_type == "VerifierTimeoutError"
    assert oracle.kind == "oracle" and oracle.reward == 1.0 and oracle.tests["tests/test_calc.py::test_spin"] == "PASSED"
