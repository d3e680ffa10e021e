"""Validation against gold that cannot be trusted, in real task images under podman: a FAIL_TO_PASS
test that passes only sometimes, a test that fails in the NOP run for reasons of its own, and a bug
whose NOP run hangs.

Each was accepted or left unjudged before: a FAIL_TO_PASS test that passes only on its first run in a
process passed every plain Oracle run (each a fresh process), so it was accepted; a test that failed
once with the bug present for a reason unrelated to it (a socket test on a loaded machine) became the
FAIL_TO_PASS of a bug no test detects, and an empty submission was paid; a NOP run that hung was an
infrastructure exception (no verdict) though the Oracle run completes, and such a task costs the
timeout on every later use. The coin-flip rates (a test that passes half the time, a bug-independent
test that fails one time in eight) are measured over many validations by ``benchmarks/flaky_gold.py``.
"""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgeflow.common.settings import tool_env
from forgeflow.registry.images import image_exists
from forgeflow.sandbox.scoring import verify_submission
from forgeflow.sandbox.trial import ValidationChecks, validate_candidate
from forgeflow.sandbox.verifier import TaskTests
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
    assert [t.kind for t in seen] == ["nop", "oracle", "nop", "oracle"]
    assert [t.reward for t in seen] == [0.0, 1.0, 0.0, 1.0]
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


PEER = "/etc/forgeflow-netstring-peer"
"""What the bug-independent test's "peer" does: ``reset`` in the image the first NOP run sees, ``ok`` after."""
MUL_TEST = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"


def flake_variants() -> Iterator[tuple[str, str, str]]:
    """The attack class "a bug-independent test that fails intermittently", one variant per way the flake shows:
    ``(label, test id, test file)``. Each test reads only :data:`PEER`, never the code under test."""
    yield "failed", "tests/test_net.py::test_netstring", textwrap.dedent(f'''\
        def test_netstring():
            assert open("{PEER}").read().strip() == "ok", "connection reset by peer"
    ''')
    yield "error", "tests/test_net.py::test_roundtrip[peer 1]", textwrap.dedent(f'''\
        import pytest


        @pytest.fixture
        def peer():
            if open("{PEER}").read().strip() != "ok":
                raise ConnectionResetError("connection reset by peer")


        @pytest.mark.parametrize("n", ["peer 1"])
        def test_roundtrip(peer, n):
            assert n
    ''')


def _with_peer(base: str, tag: str, peer: str, tmp: Path) -> str:
    """``base`` with :data:`PEER` saying ``peer``, tagged ``tag`` (built once, kept by podman under its tag)."""
    if not image_exists(tag):
        (tmp / "Containerfile").write_text(f"FROM {base}\nRUN echo {peer} > {PEER}\n")
        subprocess.run(["podman", "build", "-q", "-t", tag, "-f", str(tmp / "Containerfile"), str(tmp)],
                       env=tool_env(), check=True, capture_output=True, text=True, timeout=600)
    return tag


class UndetectedBug:
    instance_id = "calc-add-undetected"
    patch = make_patch("calc.py", GOOD_CALC, BUGGY_CALC)  # no test calls add


def test_a_test_that_fails_in_the_nop_run_for_reasons_of_its_own_is_not_made_fail_to_pass(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The flake is driven from outside the task, as load drives a real one: the task's tag points at the image
    whose peer resets for the first NOP run and is moved to the one whose peer answers as soon as that run is
    recorded, so every later run (the Oracle's, the NOP's repeats, a submission's) sees a quiet machine.
    With one NOP run (what validation did before: ``nop_runs=1``) the flake is the task's FAIL_TO_PASS and an
    empty submission scores 1; with the default two, the task is rejected as flaky, whichever way it flakes."""
    for label, test_id, test_file in flake_variants():
        tmp = tmp_path_factory.mktemp(f"flake-{label}")
        base = build_task_image(tmp, f"localhost/forgeflow/test-verifier-flake-{label}:1",
                                {"calc.py": BUGGY_CALC, "tests/test_calc.py": MUL_TEST, "tests/test_net.py": test_file})
        loaded = _with_peer(base, f"localhost/forgeflow/test-verifier-flake-{label}:loaded", "reset", tmp)
        quiet = _with_peer(base, f"localhost/forgeflow/test-verifier-flake-{label}:quiet", "ok", tmp)
        task = f"localhost/forgeflow/test-verifier-flake-{label}:task"

        def point(image: str, task: str = task) -> None:
            subprocess.run(["podman", "tag", image, task], env=tool_env(), check=True, capture_output=True)

        def validate(checks: ValidationChecks, run_key: str) -> tuple:
            point(loaded)
            seen = []

            def quiet_after_the_first_nop(trial) -> None:
                seen.append(trial)
                if len(seen) == 1:
                    point(quiet)

            outcome = validate_candidate(UndetectedBug(), task, TEST_COMMAND, timeout_s=120, spec=SPEC,
                                         run_key=run_key, checks=checks, on_trial=quiet_after_the_first_nop)
            return outcome.report, [t.kind for t in seen]

        report, kinds = validate(ValidationChecks(), f"flake-{label}")
        assert report is not None and not report.accepted, report
        assert report.flaky_tests == [test_id] and report.FAIL_TO_PASS == [test_id], report
        assert report.reason.startswith("flaky: 1 FAIL_TO_PASS test(s) did not fail in every one of 2 NOP runs "
                                        "(7 runs of the tests)"), report.reason
        assert kinds == ["nop", "oracle", "nop"]
        if label != "failed":
            continue
        before, kinds = validate(ValidationChecks(nop_runs=1), f"flake-{label}-one-nop")
        assert before.accepted and before.FAIL_TO_PASS == [test_id] and kinds == ["nop", "oracle", "oracle"]
        hole = TaskTests(instance_id=UndetectedBug.instance_id, image_ref=task, test_command=TEST_COMMAND,
                         FAIL_TO_PASS=before.FAIL_TO_PASS, PASS_TO_PASS=before.PASS_TO_PASS)
        empty = verify_submission(hole, "", timeout_s=120, spec=SPEC, name=f"ff-test-adv-flake-{label}-empty")
        assert empty.reward == 1.0, empty.notes  # what a policy learns on such a task: submit nothing
