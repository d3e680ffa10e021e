"""The verifier: a task's tests run from pristine test infrastructure, read from a channel the code
under test cannot rewrite.

:func:`run_tests` runs with a pinned environment (:data:`VERIFIER_ENV`), a fresh bytecode cache outside the
repository, and forgeflow's pytest plugin (``forgeflow/data/forgeflow_pytest_report.py``) streaming each event
on a private duplicate of the output pipe as it happens (:mod:`forgeflow.sandbox.verifier_channel`). The
outcomes must agree with the exit status, pytest's summary line and the task's known tests, and two
tripwire tests (one must pass, one must fail) catch a hook that forces every outcome; any contradiction is
``problem``/``tampering``. Threat model: the submission is hostile and runs inside the test process; the
channel stops rewriting, deleting or silently adding outcomes, but not code that intercepts outcomes before
they are written (patching pytest or this plugin): the tripwires, cross-checks and the static screen
(:mod:`forgeflow.sandbox.scoring`) raise that attack's cost, none makes it impossible."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from forgeflow.common import errors
from forgeflow.common.task import Task
from forgeflow.sandbox.base import OUTPUT_MAX_BYTES, ExecResult, OneShotSandbox, Sandbox
from forgeflow.sandbox.grading import LOG_PARSERS, failed, parse_test_log
from forgeflow.sandbox.verifier_channel import (
    RECORD_PREFIX,
    SUMMARY_CATEGORIES,
    TRIPWIRE_MUST_FAIL,
    TRIPWIRE_MUST_PASS,
    count_problems,
    find_summary_lines,
    known_test_problems,
    log_summary_problems,
    read_channel,
    summary_counts,
    tripwire_problems,
)

__all__ = [
    "TESTBED",
    "VERIFIER_ENV",
    "LOG_PARSERS",
    "LOG_TAIL_CHARS",
    "VerifierResult",
    "RepeatPlan",
    "TaskTests",
    "run_tests",
    "cross_check",
]

TESTBED = "/testbed"
"""Where the project lives inside every task image; the verifier runs there."""

LOG_TAIL_CHARS = 4000
"""How much of a verifier log a trial record keeps (the end, where pytest's summary is)."""

VERIFIER_ENV: dict[str, str] = {
    "TZ": "UTC",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONNOUSERSITE": "1",
    "PYTHONIOENCODING": "utf-8",
    "PY_COLORS": "0",
    "NO_COLOR": "1",
    "COLUMNS": "200",
    "PIP_NO_INPUT": "1",
}
"""The environment every verifier run gets, on top of the image's (one place, every backend):
UTC time zone, hash seed 0 (set and dict orders repeat), a UTF-8 C locale, no ``.pyc`` writes,
user site-packages off (so ``usercustomize`` and user ``.pth`` files do not load), UTF-8 I/O, no
colour codes, a fixed terminal width for runners that wrap."""

REPORT_PLUGIN = "forgeflow_pytest_report"
"""Module name of the report plugin inside the sandbox (``-p forgeflow_pytest_report``)."""

_SANDBOX_DIR = "/tmp/forgeflow-verifier"
_CHANNEL_FD = 9  # the wrapper's copy of its stdout for the plugin (it keeps a private duplicate)
_RESERVED_EXIT = (126, 127)  # the command could not run at all: the test command is broken

ReportFormat = Literal["pytest-report", "log"]


@cache
def _plugin_source() -> str:
    return resources.files("forgeflow").joinpath(f"data/{REPORT_PLUGIN}.py").read_text(encoding="utf-8")


class VerifierResult(BaseModel):
    """One verifier run: the test outcomes and the raw evidence."""

    model_config = ConfigDict(frozen=True)

    tests: dict[str, str] = Field(
        description="status map {test_id: status} (statuses of forgeflow.sandbox.grading.STATUSES; the verifier's "
                    "tripwires left out).")
    log_tail: str = Field(
        description="the end of stdout+stderr without the channel's records (at most LOG_TAIL_CHARS characters")
    exit_code: int = Field(
        description="the test command's exit status (pytest: 0 all passed, 1 some failed, 2 interrupted, 3 internal "
                    "error, 4 usage error, 5 no test collected; with the tripwires a complete run that reports ends "
                    "1, the must-fail tripwire's failure).")
    duration_s: float = Field(ge=0.0, description="wall-clock seconds of the run.")
    report_format: ReportFormat = Field("pytest-report",
                                        description="pytest-report (forgeflow's plugin) or log (a log parser).")
    log_parser: str | None = Field(None, description="the parser's name in log format.")
    report_exit_code: int | None = Field(
        None,
        description="pytest's exit status as its session-end record gave it (None without one).")
    problem: str | None = Field(None,
                                description="why the outcomes cannot be trusted (every contradiction, ; -joined); "
                                            "None when they were consistent.")
    tampering: list[str] = Field(default_factory=list,
                                 description="each contradiction that is evidence of tampering, named for a person "
                                             "(a second outcome for a test, a record after the end, pytest's "
                                             "summary disagreeing, an unknown test, a tripwire with the wrong "
                                             "outcome, ...); empty when none.")
    tripwires: dict[str, str] = Field(default_factory=dict,
                                      description="the tripwires' statuses (must_pass, must_fail) where they "
                                                  "reported.")
    collected: list[str] | None = Field(None,
                                        description="the collected test ids (tripwires left out; None: collection "
                                                    "never finished or a log was parsed).")
    repeat_runs: list[dict[str, str]] = Field(
        default_factory=list,
        description="with a RepeatPlan, one status map per repetition (else empty): the first holds every test that "
                    "ran, the others the repeated tests only.")
    repeat_s: float | None = Field(default=None, ge=0.0,
                                   description="with a RepeatPlan, pytest's seconds in the repetitions after the "
                                               "first (setup, call and teardown of each)")
    summary_counts: dict[str, int] | None = Field(
        None,
        description="the counts of pytest's own final summary line (None: none was read).")
    runner_inputs: dict[str, Any] = Field(default_factory=dict, description="what the runner read (see StreamDigest).")
    stdout_sha256: str | None = Field(None, description="sha256 of the raw stdout bytes.")
    stderr_sha256: str | None = Field(None, description="sha256 of the raw stderr bytes.")
    undecodable: bool = Field(False, description="True when the output held bytes that are not UTF-8.")

    @property
    def credit_blocker(self) -> str | None:
        """Why this run may not earn a reward whatever its statuses: its ``problem``, or (pytest
        report) tripwires that did not both report (a run cut short before them: ``-x``, an
        interruption); None when it may."""
        if self.problem is not None:
            return self.problem
        if self.report_format == "pytest-report" and set(self.tripwires) != {"must_pass", "must_fail"}:
            return f"the verifier's tripwires did not both run (reported: {sorted(self.tripwires) or 'none'})"
        return None

    def evidence(self) -> dict[str, Any]:
        """What a trial record keeps of the run besides its statuses (not the runner's inputs: see
        :attr:`runner_inputs`)."""
        out: dict[str, Any] = {"report_format": self.report_format, "exit_code": self.exit_code,
                               "report_exit_code": self.report_exit_code, "stdout_sha256": self.stdout_sha256,
                               "stderr_sha256": self.stderr_sha256}
        if self.log_parser:
            out["log_parser"] = self.log_parser
        if self.undecodable:
            out["undecodable_output"] = True
        if self.problem:
            out["problem"] = self.problem
        if self.tampering:
            out["tampering"] = list(self.tampering)
        if self.tripwires:
            out["tripwires"] = dict(self.tripwires)
        if self.summary_counts is not None:
            out["summary_counts"] = dict(self.summary_counts)
        return out


class RepeatPlan(BaseModel):
    """A run that repeats some tests (flaky-gold detection): each of ``tests`` runs ``repeat_count``
    times in one pytest process, back to back; the other tests run once, or not at all with
    ``only_selected`` (the plugin deselects them after collection)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tests: list[str] = Field(min_length=1,
                             description="node ids to repeat (one a line in the sandbox; ids hold no newline: "
                                         "pytest escapes them).")
    repeat_count: int = Field(ge=2, le=100, description="runs of each of them (>= 2).")
    only_selected: bool = Field(False, description="deselect every other test.")


def cross_check(tests: Mapping[str, str], exit_code: int, report_exit_code: int | None,
                report_found: bool, *, extra_failure: bool = False) -> str | None:
    """Does a test report agree with how the test command ended? None if so, else why not.

    Args:
        report_exit_code: the exit status the report recorded (None: not recorded).
    """
    any_failed = any(failed(s) for s in tests.values())
    if not report_found:
        if exit_code in (0, 1):
            return f"the test command exited {exit_code} but wrote no test report"
        return None
    if report_exit_code is not None and report_exit_code != exit_code:
        return f"the test report says pytest exited {report_exit_code} but the test command exited {exit_code}"
    if exit_code == 0 and (any_failed or extra_failure):
        bad = sorted(t for t, s in tests.items() if failed(s)) or ["the must-fail tripwire"]
        return f"the test command exited 0 but the report has {len(bad)} failed test(s), e.g. {bad[0]!r}"
    if exit_code == 1 and not any_failed and not extra_failure:
        return "the test command exited 1 (tests failed) but the report has no failed test"
    return None


def _tripwire_source(nonce: str) -> str:
    return (f"def {TRIPWIRE_MUST_PASS}{nonce}():\n    pass\n\n\n"
            f"def {TRIPWIRE_MUST_FAIL}{nonce}():\n"
            "    raise AssertionError(\"forgeflow verifier tripwire: this test must fail (it is left out of the "
            "task's outcomes)\")\n")


def _wrapped_command(test_command: str, nonce: str, repeat: RepeatPlan | None = None) -> tuple[str, str]:
    """The shell script that installs the report plugin and the tripwires outside the repository and
    runs the tests with the channel's descriptor and a fresh bytecode cache; returns ``(script,
    record prefix)``."""
    folder = f"{_SANDBOX_DIR}-{nonce}"
    eof = f"FORGEFLOW_PLUGIN_EOF_{nonce}"
    wires = f"{folder}/tripwires/forgeflow_tripwire_{nonce}.py"
    env = (f'export PYTHONPATH="{folder}/plugin${{PYTHONPATH:+:$PYTHONPATH}}" '
           f'PYTEST_ADDOPTS="-p {REPORT_PLUGIN}${{PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}}" '
           f'PYTHONPYCACHEPREFIX="{folder}/pycache" FORGEFLOW_VERIFIER_NONCE="{nonce}" '
           f'FORGEFLOW_VERIFIER_FD="{_CHANNEL_FD}" FORGEFLOW_VERIFIER_TRIPWIRES="{wires}"')
    select = ""
    if repeat is not None:
        select = f"cat > {folder}/select <<'{eof}'\n" + "".join(t + "\n" for t in repeat.tests) + f"{eof}\n"
        env += (f' FORGEFLOW_VERIFIER_SELECT="{folder}/select" FORGEFLOW_VERIFIER_REPEAT="{repeat.repeat_count}" '
                f'FORGEFLOW_VERIFIER_ONLY_SELECTED="{int(repeat.only_selected)}"')
    script = (
        f"mkdir -p {folder}/plugin {folder}/tripwires {folder}/pycache || exit 126\n"
        f"cat > {folder}/plugin/{REPORT_PLUGIN}.py <<'{eof}'\n{_plugin_source()}\n{eof}\n"
        f"cat > {wires} <<'{eof}'\n{_tripwire_source(nonce)}{eof}\n{select}{env}\n"
        f"cd {TESTBED} || exit 126\n"
        f"(\n{test_command}\n) </dev/null {_CHANNEL_FD}>&1\n"
        "exit $?\n"
    )
    return script, RECORD_PREFIX + nonce


def _log_command(test_command: str, nonce: str) -> str:
    """The script of a log-parser run: the test command with a fresh bytecode cache."""
    return (f'export PYTHONPYCACHEPREFIX="{_SANDBOX_DIR}-{nonce}/pycache"\n'
            f"cd {TESTBED} || exit 126\n(\n{test_command}\n) </dev/null\n")


class SetupError(errors.SandboxError):
    """The ``setup`` fragment of :func:`run_tests` exited non-zero (no test ran).

    Attributes:
        exit_code: its exit status.
        output: its stdout and stderr (the end of them).
    """

    def __init__(self, exit_code: int, output: str) -> None:
        super().__init__(f"setup exited {exit_code}: {output.strip()[-500:]}")
        self.exit_code, self.output = exit_code, output


def _with_setup(script: str, setup: str, nonce: str) -> tuple[str, str]:
    """``script`` preceded by ``setup`` (run in :data:`TESTBED`, output to a file); a failing setup
    prints a marker, its exit status and its output, and the script ends there. Returns
    ``(script, marker)``."""
    marker = f"FORGEFLOW-SETUP-FAILED-{nonce}"
    out = f"/tmp/forgeflow-setup-{nonce}.log"
    return (f"cd {TESTBED} || exit 126\n(\n{setup}\n) </dev/null >{out} 2>&1 || "
            f"{{ rc=$?; printf '\\n%s %s\\n' '{marker}' \"$rc\"; cat {out}; exit 0; }}\n"
            f"rm -f {out}\n{script}"), marker


def run_tests(sandbox: Sandbox, test_command: str, timeout_s: float, *, log_parser: str | None = None,
              setup: str | None = None, one_shot: bool = False, expect: TaskTests | None = None,
              repeat: RepeatPlan | None = None) -> VerifierResult:
    """Run a task's tests in :data:`TESTBED` of a started sandbox and read their outcomes.

    Args:
        timeout_s: wall-clock limit in seconds (> 0).
        log_parser: None reads forgeflow's pytest report channel; a :data:`LOG_PARSERS` name parses the log.
        setup: a shell fragment run before the tests in the same exec (e.g. the Oracle's revert).
        expect: the task whose known and graded tests (``known_tests``, :meth:`TaskTests.graded_tests`) the run is
            cross-checked against; None: only the channel's own checks.

    Returns:
        The :class:`VerifierResult`; ``problem`` (and ``tampering``) set when the outcomes contradict the
        exit status, pytest's summary or the known tests.

    Raises:
        InputError: ``timeout_s`` <= 0, an empty command, an unknown ``log_parser``, or ``repeat`` with one.
        VerifierTimeoutError: the run exceeded ``timeout_s``.
        SandboxOOMError: the kernel OOM-killed the run.
        SetupError: ``setup`` exited non-zero (its status and output attached).
        VerifierOutputError: the command could not run (exit 126/127), pytest never started with the report
            plugin, or (``log`` format) an exit 0 or 1 whose log holds no test.
    """
    if timeout_s <= 0:
        raise errors.InputError(f"timeout_s must be > 0, got {timeout_s}")
    if not test_command.strip():
        raise errors.InputError("test_command must not be empty")
    if log_parser is not None and log_parser not in LOG_PARSERS:
        raise errors.InputError(f"unknown log_parser {log_parser!r}; valid: {', '.join(LOG_PARSERS)}")
    if log_parser is not None and repeat is not None:
        raise errors.InputError("a repeat run needs forgeflow's pytest report (no log_parser)")
    nonce = uuid.uuid4().hex[:16]
    channel = log_parser is None or log_parser.startswith("parse_log_pytest")  # a pytest log: the plugin too
    script = _wrapped_command(test_command, nonce, repeat)[0] if channel else _log_command(test_command, nonce)
    setup_marker = ""
    if setup is not None:
        script, setup_marker = _with_setup(script, setup, nonce)
    if one_shot:
        if not isinstance(sandbox, OneShotSandbox):
            raise errors.InputError(f"one_shot needs a sandbox with run_once; {type(sandbox).__name__} has none")
        res: ExecResult = sandbox.run_once(script, timeout_s=timeout_s, workdir=TESTBED, env=VERIFIER_ENV)
    else:
        res = sandbox.exec(script, timeout_s=timeout_s, workdir=TESTBED, env=VERIFIER_ENV)
    if setup_marker:
        _, found, rest = res.stdout.rpartition(f"\n{setup_marker} ")
        if found:
            code, _, output = rest.partition("\n")
            raise SetupError(int(code) if code.strip().isdigit() else -1, output + res.stderr)
    if log_parser is not None:
        return _read_log_run(res, log_parser, expect, nonce if channel else None)
    return _read_pytest_run(res, nonce, expect, repeat)


def _joined_log(stdout: str, stderr: str) -> str:
    return stdout + ("\n" if stdout and not stdout.endswith("\n") else "") + stderr


def _common(res: ExecResult, log: str) -> dict[str, Any]:
    if res.dropped_bytes:  # the run flooded its output: what it reported cannot all be read
        raise errors.VerifierOutputError(
            f"the test command's output passed the {OUTPUT_MAX_BYTES >> 20} MiB kept per stream "
            f"({res.dropped_bytes} bytes more were dropped): its report cannot be read whole")
    if res.exit_code in _RESERVED_EXIT:
        raise errors.VerifierOutputError(
            f"the test command could not run (exit {res.exit_code}; evidence: {log.strip()[-300:]!r})")
    return {"log_tail": log[-LOG_TAIL_CHARS:], "exit_code": res.exit_code, "duration_s": res.duration_s,
            "stdout_sha256": res.stdout_sha256, "stderr_sha256": res.stderr_sha256, "undecodable": res.undecodable}


def _read_pytest_run(res: ExecResult, nonce: str, expect: TaskTests | None,
                     repeat: RepeatPlan | None) -> VerifierResult:
    """The outcome of a run with forgeflow's plugin: its records, checked three ways."""
    digest = read_channel(res.stdout, nonce, repeat.repeat_count if repeat else 1)
    log = _joined_log(digest.log, res.stderr)
    common = _common(res, log)
    if not digest.record_count and not digest.corrupt:
        # pytest never started with the report plugin: the test command is not a pytest run that
        # keeps PYTEST_ADDOPTS / PYTHONPATH, or the interpreter failed. No submission reaches that
        # far (its code runs only after the plugin is imported): the verifier broke
        raise errors.VerifierOutputError(
            f"the test command exited {res.exit_code} without starting pytest with forgeflow's report plugin "
            f"(a pytest command that keeps $PYTHONPATH and $PYTEST_ADDOPTS is needed, or give a log_parser); "
            f"evidence: the output ends {log.strip()[-300:]!r}")
    tampering = [f"a corrupt record on the channel: {c!r}" for c in digest.corrupt] + list(digest.tampering)
    if digest.distributed and expect is None:  # the task's own command (a pristine run): not gradable
        raise errors.VerifierOutputError(
            f"the test command runs pytest-xdist ({digest.distributed}): forgeflow's report channel reads one "
            f"pytest process; drop -n/--dist from the task's test command, or give a log_parser (evidence: the "
            f"plugin's distributed record)")
    if digest.distributed:  # a validated task's pristine runs were not distributed: the submission made it so
        tampering.append(f"the run became distributed by pytest-xdist ({digest.distributed}), which the task's "
                         "validated command is not")
    exit_problem = cross_check(digest.tests, res.exit_code, digest.exitstatus, digest.ended,
                               extra_failure=digest.tripwires.get("must_fail") == "FAILED")
    tampering += [exit_problem] if exit_problem else []
    tampering += tripwire_problems(digest.tripwires)
    counts = None
    if digest.ended and (digest.verbosity or 0) >= -1 and digest.exitstatus in (0, 1, 2, 5):
        lines = find_summary_lines(digest.log[digest.end_offset or 0:])
        if not lines:
            tampering.append("pytest's final summary line is missing after its session end")
        else:
            counts = summary_counts(lines[0][1])
            tampering += count_problems(counts, digest.counts, SUMMARY_CATEGORIES, exact=True)
    if expect is not None:
        tampering += known_test_problems(digest, expect.known_tests, expect.graded_tests())
    return VerifierResult(tests=digest.tests, report_exit_code=digest.exitstatus, tampering=tampering,
                          problem="; ".join(tampering) or None, tripwires=digest.tripwires,
                          collected=digest.collected, repeat_runs=digest.repeat_runs, summary_counts=counts,
                          repeat_s=digest.repeat_s if repeat else None,
                          runner_inputs=digest.runner_inputs, **common)


def _read_log_run(res: ExecResult, log_parser: str, expect: TaskTests | None,
                  nonce: str | None = None) -> VerifierResult:
    """The outcome of a log-parser run, with the exit-status check and, for pytest logs, the summary check and
    the report plugin's (run beside the log: ``nonce``) tripwires, integrity and registration checks; the
    outcomes are the log's. A pytest command that drops the plugin leaves the log alone to read."""
    reading = read_channel(res.stdout, nonce) if nonce else None
    digest = reading if reading is not None and reading.record_count else None
    digest = None if digest is not None and digest.distributed else digest  # xdist: the log alone (no collection)
    stdout = reading.log if reading is not None else res.stdout
    log = _joined_log(stdout, res.stderr)
    common = _common(res, log)
    parser = LOG_PARSERS[log_parser]
    try:
        tests = {t: s for t, s in parse_test_log(log, parser=parser).items()
                 if not (nonce and (f"{TRIPWIRE_MUST_PASS}{nonce}" in t or f"{TRIPWIRE_MUST_FAIL}{nonce}" in t))}
    except errors.VerifierOutputError as exc:  # not the runner's output
        if res.exit_code in (0, 1):
            raise errors.VerifierOutputError(f"test command exited {res.exit_code}: {exc}") from exc
        tests = {}
    if not tests and res.exit_code in (0, 1):
        raise errors.VerifierOutputError(
            f"the test command exited {res.exit_code} but {log_parser} found no test in its log (evidence: "
            f"the log ends {log.strip()[-300:]!r})")
    wires = digest.tripwires if digest is not None else {}
    problems = [p for p in [cross_check(tests, res.exit_code, None, True,
                                        extra_failure=wires.get("must_fail") == "FAILED")] if p]
    if digest is not None:
        problems += [f"a corrupt record on the channel: {c!r}" for c in digest.corrupt] + list(digest.tampering)
        problems += tripwire_problems(wires) + ([] if set(wires) == {"must_pass", "must_fail"} else [
            f"the verifier's tripwires did not both run (reported: {sorted(wires) or 'none'})"])
        forged = sorted(t for t, status in tests.items()
                        if status == "PASSED" and digest.tests.get(t, status) != status)
        if forged:  # the log reads PASSED where the report channel saw the test's own outcome
            problems.append(f"{len(forged)} test(s) PASSED in the log but not on the report channel, e.g. "
                            f"{forged[0]!r} ({digest.tests[forged[0]]})")
    counts = None
    if log_parser.startswith("parse_log_pytest") and res.exit_code in (0, 1):
        counts, found = log_summary_problems(stdout, tests, parser)
        problems += found
    if expect is not None and expect.known_tests is not None:
        known = set(expect.known_tests)
        unknown = sorted(t for t, s in tests.items() if s in ("PASSED", "FAILED", "ERROR") and t not in known)
        if unknown:
            problems.append(f"{len(unknown)} test(s) the task does not know in the log, e.g. {unknown[0]!r}")
    return VerifierResult(tests=tests, report_format="log", log_parser=log_parser, summary_counts=counts,
                          problem="; ".join(problems) or None, tampering=problems, tripwires=wires,
                          runner_inputs=digest.runner_inputs if digest is not None else {}, **common)


class TaskTests(Task):
    """A :class:`~forgeflow.common.task.Task` with its pristine-run evidence (an empty ``known_tests`` is read as
    not recorded); neither is dumped while not recorded, so dumps (cache keys) of tasks without them stay as
    they were."""

    known_tests: list[str] | None = Field(default=None, exclude_if=lambda v: v is None, description="Every test id "
                                          "the task's pristine NOP/Oracle runs collected "
                                          "(ValidationReport.known_tests); None: not recorded.")
    pristine_duration_s: float | None = Field(default=None, ge=0, exclude_if=lambda v: v is None, description="The "
                                              "longest recorded pristine (Oracle) run of the tests, seconds; None: "
                                              "not recorded.")

    @field_validator("known_tests")
    @classmethod
    def _empty_is_unrecorded(cls, value: list[str] | None) -> list[str] | None:
        return value or None
