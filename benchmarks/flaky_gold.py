"""Flaky gold: how often validation accepts a task whose test passes half the time, and a task whose bug no
test detects but whose bug-independent test fails one time in eight.

Run ``python -m benchmarks.flaky_gold [--validations N] [--baseline N] [--undetected N]``. It prints one human
line per figure and, as the LAST line, one JSON object::

    {"validations": ..., "accepted": ..., "accepted_fraction": ..., "flagged_or_rejected_fraction": ...,
     "seconds_per_validation": ..., "repeat_s_mean": ..., "baseline_validations": ...,
     "baseline_accepted_fraction": ..., "baseline_seconds_per_validation": ...,
     "undetected_validations": ..., "undetected_accepted": ..., "undetected_baseline_accepted": ...}

The task: the calc task image with a coin-flip test (``tests/test_flaky.py::test_coin``: passes iff a
byte of ``os.urandom`` is even; the adversarial corpus's ``FLAKY_IMAGE``), so the coin test is
FAIL_TO_PASS when the NOP run failed it and PASS_TO_PASS when it passed. Each validation is
:func:`forgeflow.sandbox.trial.validate_candidate` at the default settings (two Oracle runs, the
second repeating FAIL_TO_PASS and the PASS_TO_PASS sample ``flaky_repeat_runs`` times; two NOP runs, the
second repeating FAIL_TO_PASS as often). The coin passes seven Oracle runs with probability (1/2)^7; the NOP run
passed it (PASS_TO_PASS) half the time, and when it failed it (FAIL_TO_PASS) it must also fail six NOP repeats:
expected accepted fraction (1/2)^8 + (1/2)^14 = 0.4 % (0.8 % with one NOP run). The baseline is the same with the
repeats off (``flaky_repeat_runs=0``, ``nop_runs=1``, what validation did before them): (1/2)^2 = 25 %.
``repeat_s_mean`` is pytest's own time in the Oracle repetitions (the report's ``repeat_s``), per validation that
reached them.

The undetected bug (``tests/test_flaky.py::test_die``: fails iff a byte of ``os.urandom`` is a multiple of 8;
no test calls the broken ``add``) is accepted only when the die test fails in the NOP run and passes in every
Oracle run, and then an empty submission is paid whenever the die does not fail. With one NOP run (the baseline
of this class, ``nop_runs=1``) that is 1/8 x (7/8)^7 = 4.9 % of validations; with the NOP repeats the die must
also fail six more times: 1/8^7 x (7/8)^7, about 2e-7.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DIE_TEST = "import os\n\n\ndef test_die():\n    assert os.urandom(1)[0] % 8 != 0\n"
"""A bug-independent test that fails one time in eight."""
UNDETECTED_IMAGE = "localhost/forgeflow/test-verifier-die:1"


def _image() -> str:
    from tests.adversarial.calc_task import BUGGY_CALC, FLAKY_IMAGE, TESTS, build_task_image  # noqa: PLC0415
    from tests.adversarial.test_known_attacks import COIN_TEST  # noqa: PLC0415

    return build_task_image(Path(tempfile.mkdtemp()), FLAKY_IMAGE, {
        "calc.py": BUGGY_CALC, "tests/test_calc.py": TESTS.split("\n\n\n@pytest")[0] + "\n",
        "tests/test_flaky.py": COIN_TEST})


def _undetected_image() -> str:
    from tests.adversarial.calc_task import BUGGY_CALC, build_task_image  # noqa: PLC0415
    from tests.adversarial.test_flaky_gold import MUL_TEST  # noqa: PLC0415

    return build_task_image(Path(tempfile.mkdtemp()), UNDETECTED_IMAGE, {
        "calc.py": BUGGY_CALC, "tests/test_calc.py": MUL_TEST, "tests/test_flaky.py": DIE_TEST})


def _validate_many(image: str, count: int, checks: Any, label: str) -> dict[str, Any]:
    """``count`` validations of the task in ``image`` (its bug: calc's ``add``) under ``checks``; accepted count,
    seconds each, repeat seconds, the reasons counted."""
    from forgeflow.sandbox.trial import validate_candidate  # noqa: PLC0415
    from tests.adversarial.calc_task import BUGGY_CALC, GOOD_CALC, TEST_COMMAND, make_patch  # noqa: PLC0415

    class Bug:
        instance_id = "calc-add-coin"
        patch = make_patch("calc.py", GOOD_CALC, BUGGY_CALC)

    accepted, seconds, repeat_s, reasons = 0, [], [], {}
    for i in range(count):
        start = time.perf_counter()
        outcome = validate_candidate(Bug(), image, TEST_COMMAND, timeout_s=120, checks=checks,
                                     run_key=f"bench-{label}-{i}-{time.time()}")
        seconds.append(time.perf_counter() - start)
        report = outcome.report
        if report is None:
            raise RuntimeError(f"validation {i} had no verdict: {outcome.failed_trial}")
        accepted += report.accepted
        if report.repeat_s is not None:
            repeat_s.append(report.repeat_s)
        kind = "accepted" if report.accepted else report.reason.split(":")[0]
        reasons[kind] = reasons.get(kind, 0) + 1
    return {"validations": count, "accepted": accepted, "seconds_per_validation": statistics.mean(seconds),
            "repeat_s_mean": statistics.mean(repeat_s) if repeat_s else None, "reasons": reasons}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure; print the figures and, last, the JSON line. Returns the JSON object."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flaky_gold", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--validations", type=int, default=64, help="validations at the default settings")
    parser.add_argument("--baseline", type=int, default=32, help="validations with the repeats off (0: none)")
    parser.add_argument("--undetected", type=int, default=64,
                        help="validations of the undetected bug, at the default settings and with one NOP run each")
    args = parser.parse_args(argv)
    from forgeflow.sandbox.trial import ValidationChecks  # noqa: PLC0415

    image = _image()
    new = _validate_many(image, args.validations, ValidationChecks(), "new")
    out: dict[str, Any] = {"validations": new["validations"], "accepted": new["accepted"],
                           "accepted_fraction": new["accepted"] / new["validations"],
                           "flagged_or_rejected_fraction": 1 - new["accepted"] / new["validations"],
                           "seconds_per_validation": round(new["seconds_per_validation"], 2),
                           "repeat_s_mean": new["repeat_s_mean"], "reasons": new["reasons"]}
    print(f"default settings: {new['accepted']}/{new['validations']} accepted, "
          f"{new['seconds_per_validation']:.2f} s per validation, reasons {new['reasons']}", file=sys.stderr)
    if args.baseline:
        old = _validate_many(image, args.baseline, ValidationChecks(flaky_repeat_runs=0, nop_runs=1), "baseline")
        out.update(baseline_validations=old["validations"],
                   baseline_accepted_fraction=old["accepted"] / old["validations"],
                   baseline_seconds_per_validation=round(old["seconds_per_validation"], 2))
        print(f"repeats off: {old['accepted']}/{old['validations']} accepted, "
              f"{old['seconds_per_validation']:.2f} s per validation", file=sys.stderr)
    if args.undetected:
        die = _undetected_image()
        now = _validate_many(die, args.undetected, ValidationChecks(), "die")
        one = _validate_many(die, args.undetected, ValidationChecks(nop_runs=1), "die-one-nop")
        out.update(undetected_validations=args.undetected, undetected_accepted=now["accepted"],
                   undetected_baseline_accepted=one["accepted"], undetected_reasons=now["reasons"],
                   undetected_seconds_per_validation=round(now["seconds_per_validation"], 2))
        print(f"undetected bug, die test: {now['accepted']}/{args.undetected} accepted with the NOP repeats "
              f"({now['reasons']}), {one['accepted']}/{args.undetected} with one NOP run", file=sys.stderr)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
