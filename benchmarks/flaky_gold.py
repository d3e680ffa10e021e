"""Flaky gold: how often validation accepts a task whose test passes half the time.

Run ``python -m benchmarks.flaky_gold [--validations N] [--baseline N]``. It prints one human line per
figure and, as the LAST line, one JSON object::

    {"validations": ..., "accepted": ..., "accepted_fraction": ..., "flagged_or_rejected_fraction": ...,
     "seconds_per_validation": ..., "repeat_s_mean": ..., "baseline_validations": ...,
     "baseline_accepted_fraction": ..., "baseline_seconds_per_validation": ...}

The task: the calc task image with a coin-flip test (``tests/test_flaky.py::test_coin``: passes iff a
byte of ``os.urandom`` is even; the adversarial corpus's ``FLAKY_IMAGE``), so the coin test is
FAIL_TO_PASS when the NOP run failed it and PASS_TO_PASS when it passed. Each validation is
:func:`forgeflow.sandbox.trial.validate_candidate` at the default settings (two Oracle runs, the
second repeating FAIL_TO_PASS and the PASS_TO_PASS sample ``flaky_repeat_runs`` times); expected
accepted fraction (1/2)^(1 + 6) = 0.8 %. The baseline is the same with the repeats off
(``flaky_repeat_runs=0``, what validation did before): (1/2)^2 = 25 %. ``repeat_s_mean`` is pytest's
own time in the repetitions (the report's ``repeat_s``), per validation that reached them.
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


def _image() -> str:
    from tests.adversarial.calc_task import BUGGY_CALC, FLAKY_IMAGE, TESTS, build_task_image  # noqa: PLC0415
    from tests.adversarial.test_known_attacks import COIN_TEST  # noqa: PLC0415

    return build_task_image(Path(tempfile.mkdtemp()), FLAKY_IMAGE, {
        "calc.py": BUGGY_CALC, "tests/test_calc.py": TESTS.split("\n\n\n@pytest")[0] + "\n",
        "tests/test_flaky.py": COIN_TEST})


def _validate_many(image: str, count: int, repeat_runs: int, label: str) -> dict[str, Any]:
    """``count`` validations of the coin task; accepted count, seconds each, repeat seconds."""
    from forgeflow.sandbox.trial import ValidationChecks, validate_candidate  # noqa: PLC0415
    from tests.adversarial.calc_task import BUGGY_CALC, GOOD_CALC, TEST_COMMAND, make_patch  # noqa: PLC0415

    class Bug:
        instance_id = "calc-add-coin"
        patch = make_patch("calc.py", GOOD_CALC, BUGGY_CALC)

    checks = ValidationChecks(flaky_repeat_runs=repeat_runs)
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
    args = parser.parse_args(argv)
    image = _image()
    new = _validate_many(image, args.validations, 6, "new")
    out: dict[str, Any] = {"validations": new["validations"], "accepted": new["accepted"],
                           "accepted_fraction": new["accepted"] / new["validations"],
                           "flagged_or_rejected_fraction": 1 - new["accepted"] / new["validations"],
                           "seconds_per_validation": round(new["seconds_per_validation"], 2),
                           "repeat_s_mean": new["repeat_s_mean"], "reasons": new["reasons"]}
    print(f"default settings: {new['accepted']}/{new['validations']} accepted, "
          f"{new['seconds_per_validation']:.2f} s per validation, reasons {new['reasons']}", file=sys.stderr)
    if args.baseline:
        old = _validate_many(image, args.baseline, 0, "baseline")
        out.update(baseline_validations=old["validations"],
                   baseline_accepted_fraction=old["accepted"] / old["validations"],
                   baseline_seconds_per_validation=round(old["seconds_per_validation"], 2))
        print(f"repeats off: {old['accepted']}/{old['validations']} accepted, "
              f"{old['seconds_per_validation']:.2f} s per validation", file=sys.stderr)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
