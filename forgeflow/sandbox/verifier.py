"""The verifier: a task's tests, run from pristine test infrastructure, read from a structured report.

Every reward and every NOP/Oracle verdict comes from :func:`run_tests` in a sandbox of the task
image:

* **pinned environment** — the test command runs with :data:`VERIFIER_ENV` (UTC, a fixed hash
  seed, a UTF-8 C locale, no user site-packages, no colours, a fixed terminal width), the one place
  that lists it, so a task gives the same result on every machine;
* **structured report** — for pytest (the default), forgeflow's own report plugin
  (``forgeflow/data/forgeflow_pytest_report.py``, loaded with ``-p`` through ``PYTEST_ADDOPTS``)
  writes pytest's outcomes per node id to a file outside the repository; the outcome is read from
  that report, never scraped from the text the code under test can print. Runners without a
  structured report are parsed from their log by a SWE-bench parser chosen by name
  (:data:`LOG_PARSERS`, e.g. ``parse_log_django``, ``parse_log_sympy``);
* **cross-check with the exit status** — the report must agree with how the command ended
  (:func:`cross_check`): pytest's own exit status equals the command's, exit 0 means no failed
  test, exit 1 means at least one. A disagreement is recorded as the run's ``problem``: a verifier
  run of pristine infrastructure (NOP, Oracle) raises it as
  :class:`~forgeflow.common.errors.VerifierOutputError`; a submission's run is not credited (reward 0,
  the evidence kept).

:func:`forgeflow.sandbox.scoring.verify_submission` (agent trials, RL rewards) applies a submission in a
fresh container of the pristine task image, then runs :func:`run_tests` and the strict resolution rule
(:func:`forgeflow.sandbox.grading.grade_resolved`).

Threat model, said plainly: the submission's code runs inside the test process, so no in-process
record is beyond its reach; what it cannot do is change the tests, their configuration, plugins or
start-up hooks (screened), leave state from the agent's container (fresh container), or pass by
printing (structured report), and a forged report must also forge the process's exit status.
"""

from __future__ import annotations

import ast
import threading
import uuid
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.sandbox.base import ExecResult, OneShotSandbox, Sandbox
from forgeflow.sandbox.grading import failed, parse_test_log

__all__ = [
    "TESTBED",
    "VERIFIER_ENV",
    "LOG_PARSERS",
    "LOG_TAIL_CHARS",
    "VerifierResult",
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
_RESERVED_EXIT = (126, 127)  # the command could not run at all: the test command is broken

ReportFormat = Literal["pytest-report", "log"]


@cache
def _plugin_source() -> str:
    return resources.files("forgeflow").joinpath(f"data/{REPORT_PLUGIN}.py").read_text(encoding="utf-8")


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


class VerifierResult(BaseModel):
    """One verifier run: the test outcomes and the raw evidence.

    Attributes:
        tests: status map ``{test_id: status}`` (statuses of :data:`forgeflow.sandbox.grading.STATUSES`).
        log_tail: the end of stdout+stderr (at most :data:`LOG_TAIL_CHARS` characters; bytes that
            are not UTF-8 replaced by U+FFFD).
        exit_code: the test command's exit status (pytest: 0 all passed, 1 some failed, 2
            interrupted, 3 internal error, 4 usage error, 5 no test collected).
        duration_s: wall-clock seconds of the run.
        report_format: ``pytest-report`` (forgeflow's plugin) or ``log`` (a log parser).
        log_parser: the parser's name in ``log`` format.
        report_exit_code: pytest's exit status as its report recorded it (None without a report).
        problem: why the report cannot be trusted (missing, or disagreeing with the exit status);
            None when it was consistent.
        stdout_sha256: sha256 of the raw stdout bytes.
        stderr_sha256: sha256 of the raw stderr bytes.
        undecodable: True when the output held bytes that are not UTF-8.
    """

    model_config = ConfigDict(frozen=True)

    tests: dict[str, str]
    log_tail: str
    exit_code: int
    duration_s: float = Field(ge=0.0)
    report_format: ReportFormat = "pytest-report"
    log_parser: str | None = None
    report_exit_code: int | None = None
    problem: str | None = None
    stdout_sha256: str | None = None
    stderr_sha256: str | None = None
    undecodable: bool = False

    def evidence(self) -> dict[str, Any]:
        """What a trial record keeps of the run besides its statuses."""
        out: dict[str, Any] = {"report_format": self.report_format, "exit_code": self.exit_code,
                               "report_exit_code": self.report_exit_code, "stdout_sha256": self.stdout_sha256,
                               "stderr_sha256": self.stderr_sha256}
        if self.log_parser:
            out["log_parser"] = self.log_parser
        if self.undecodable:
            out["undecodable_output"] = True
        if self.problem:
            out["problem"] = self.problem
        return out


def cross_check(tests: Mapping[str, str], exit_code: int, report_exit_code: int | None,
                report_found: bool) -> str | None:
    """Does a test report agree with how the test command ended? None if so, else why not.

    Rules (pytest's exit statuses: 0 all passed, 1 tests failed, 2-5 interrupted / internal error /
    usage error / nothing collected; anything else: the process was killed or exited on its own):

    * a report was expected but is missing while the command exited 0 or 1 (a completed pytest run
      always writes one);
    * the report's own exit status differs from the command's;
    * exit 0 with a FAILED/ERROR test, or exit 1 with none.

    Args:
        tests: the status map read from the report (or log).
        exit_code: the command's exit status.
        report_exit_code: the exit status the report recorded (None: not recorded).
        report_found: whether a report was found at all.
    """
    any_failed = any(failed(s) for s in tests.values())
    if not report_found:
        if exit_code in (0, 1):
            return f"the test command exited {exit_code} but wrote no test report"
        return None
    if report_exit_code is not None and report_exit_code != exit_code:
        return f"the test report says pytest exited {report_exit_code} but the test command exited {exit_code}"
    if exit_code == 0 and any_failed:
        bad = sorted(t for t, s in tests.items() if failed(s))
        return f"the test command exited 0 but the report has {len(bad)} failed test(s), e.g. {bad[0]!r}"
    if exit_code == 1 and not any_failed:
        return "the test command exited 1 (tests failed) but the report has no failed test"
    return None


def _wrapped_command(test_command: str, nonce: str) -> tuple[str, str]:
    """The shell script that installs the report plugin, runs the tests and prints the report after a
    marker; returns ``(script, marker)``."""
    folder = f"{_SANDBOX_DIR}-{nonce}"
    marker = f"FORGEFLOW-VERIFIER-REPORT-{nonce}"
    eof = f"FORGEFLOW_PLUGIN_EOF_{nonce}"
    script = (
        f"mkdir -p {folder} && cat > {folder}/{REPORT_PLUGIN}.py <<'{eof}'\n{_plugin_source()}\n{eof}\n"
        f'export PYTHONPATH="{folder}${{PYTHONPATH:+:$PYTHONPATH}}" '
        f'PYTEST_ADDOPTS="-p {REPORT_PLUGIN}${{PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}}" '
        f'FORGEFLOW_VERIFIER_REPORT="{folder}/report" FORGEFLOW_VERIFIER_NONCE="{nonce}"\n'
        f"cd {TESTBED} || exit 126\n"
        f"(\n{test_command}\n) </dev/null\n"
        "rc=$?\n"
        f"printf '\\n%s\\n' '{marker}'\n"
        f"cat {folder}/report 2>/dev/null\n"
        "exit $rc\n"
    )
    return script, marker


_AST_LOCK = threading.Lock()
"""One ``ast.literal_eval`` at a time in this process: CPython 3.11 keeps the AST constructor's
recursion depth per interpreter, not per thread, so two threads building ASTs at once (validations
in flight in one flow run) can fail with ``SystemError: AST constructor recursion depth mismatch``
(CPython issue gh-106905)."""


def _read_report(stdout: str, marker: str) -> tuple[str, dict[str, Any] | None]:
    """Split stdout at the last marker: (the test run's own output, the parsed report or None).

    The report is a Python literal of dicts, lists, strings and ints (``ast.literal_eval``: data,
    never code), parsed under :data:`_AST_LOCK` (one parse at a time; a few ms per report)."""
    head, sep, tail = stdout.rpartition(f"\n{marker}\n")
    if not sep:
        return stdout, None
    try:
        with _AST_LOCK:
            report = ast.literal_eval(tail.strip()) if tail.strip() else None
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        report = None
    if not isinstance(report, dict) or not isinstance(report.get("tests"), dict):
        return head, None
    return head, report


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
              setup: str | None = None, one_shot: bool = False) -> VerifierResult:
    """Run a task's tests in :data:`TESTBED` of a started sandbox and read their outcomes.

    Args:
        sandbox: a started sandbox of the task image (a submission, if any, already applied).
        test_command: the task's shell command running its tests (pytest: any ``pytest`` or
            ``python -m pytest`` invocation; it must keep ``$PYTHONPATH`` if it sets its own,
            since the report plugin is found there).
        timeout_s: wall-clock limit in seconds (> 0).
        log_parser: None (default) reads forgeflow's pytest report; a name of :data:`LOG_PARSERS`
            parses the log instead, for runners without a structured report.
        setup: a shell fragment run in :data:`TESTBED` before the tests, in the same exec (e.g. the
            Oracle's revert of the bug patch: one ``exec`` per trial instead of three); a non-zero
            exit ends the run with :class:`SetupError` before any test runs.
        one_shot: run the script as the container's own process (``sandbox.run_once``, a
            :class:`~forgeflow.sandbox.base.OneShotSandbox` not yet started) instead of an ``exec`` in
            a started sandbox: the same script, limits and evidence, one container start fewer.

    Returns:
        The :class:`VerifierResult`; ``problem`` is set when the report is missing although the
        run completed, or disagrees with the exit status (:func:`cross_check`). A run that crashed
        before reporting (killed, interrupted) has whatever tests were reported, others missing.

    Raises:
        InputError: ``timeout_s`` <= 0, an empty command or an unknown ``log_parser`` (the valid
            names are listed).
        VerifierTimeoutError: the run exceeded ``timeout_s``.
        SandboxOOMError: the kernel OOM-killed the run (see the sandbox backend).
        SetupError: ``setup`` exited non-zero (its status and output attached).
        VerifierOutputError: the command could not run at all (exit 126/127: not found or not
            executable), or (pytest) pytest never started with the report plugin (its start line
            is missing: the test command is broken, whatever the submission); in ``log`` format,
            a command that exited 0 or 1 with a log in which the parser finds no test (the parser
            cannot tell a broken command from a cut-short run: the structured report can).
    """
    if timeout_s <= 0:
        raise errors.InputError(f"timeout_s must be > 0, got {timeout_s}")
    if not test_command.strip():
        raise errors.InputError("test_command must not be empty")
    if log_parser is not None and log_parser not in LOG_PARSERS:
        raise errors.InputError(f"unknown log_parser {log_parser!r}; valid: {', '.join(LOG_PARSERS)}")
    nonce = uuid.uuid4().hex[:16]
    if log_parser is None:
        script, marker = _wrapped_command(test_command, nonce)
    else:
        script, marker = f"cd {TESTBED} || exit 126\n(\n{test_command}\n) </dev/null\n", ""
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
    own_stdout, report = _read_report(res.stdout, marker) if marker else (res.stdout, None)
    own_stdout = own_stdout.replace(f"\nFORGEFLOW-VERIFIER-STARTED-{nonce}\n", "\n", 1)
    log = own_stdout + ("\n" if own_stdout and not own_stdout.endswith("\n") else "") + res.stderr
    if res.exit_code in _RESERVED_EXIT:
        raise errors.VerifierOutputError(
            f"the test command could not run (exit {res.exit_code}; evidence: {log.strip()[-300:]!r})")
    common = {"log_tail": log[-LOG_TAIL_CHARS:], "exit_code": res.exit_code, "duration_s": res.duration_s,
              "stdout_sha256": res.stdout_sha256, "stderr_sha256": res.stderr_sha256,
              "undecodable": res.undecodable}
    if log_parser is not None:
        try:
            tests = parse_test_log(log, parser=LOG_PARSERS[log_parser])
        except errors.VerifierOutputError as exc:  # not the runner's output
            if res.exit_code in (0, 1):
                raise errors.VerifierOutputError(f"test command exited {res.exit_code}: {exc}") from exc
            tests = {}
        if not tests and res.exit_code in (0, 1):
            raise errors.VerifierOutputError(
                f"the test command exited {res.exit_code} but {log_parser} found no test in its log (evidence: "
                f"the log ends {log.strip()[-300:]!r})")
        return VerifierResult(tests=tests, report_format="log", log_parser=log_parser,
                              problem=cross_check(tests, res.exit_code, None, True), **common)
    if report is None:
        if f"FORGEFLOW-VERIFIER-STARTED-{nonce}" not in res.stdout:
            # pytest never started with the report plugin: the test command is not a pytest run that
            # keeps PYTEST_ADDOPTS / PYTHONPATH, or the interpreter failed. No submission reaches that
            # far (its code runs only after the plugin is imported): the verifier broke
            raise errors.VerifierOutputError(
                f"the test command exited {res.exit_code} without starting pytest with forgeflow's report plugin "
                f"(a pytest command that keeps $PYTHONPATH and $PYTEST_ADDOPTS is needed, or give a log_parser); "
                f"evidence: the output ends {log.strip()[-300:]!r}")
        return VerifierResult(tests={}, problem=cross_check({}, res.exit_code, None, False), **common)
    tests = {str(k): str(v) for k, v in report["tests"].items()}
    tests.update({nodeid: "ERROR" for nodeid in report.get("collect_errors") or [] if nodeid not in tests})
    report_exit = report.get("exitstatus") if isinstance(report.get("exitstatus"), int) else None
    return VerifierResult(tests=tests, report_exit_code=report_exit,
                          problem=cross_check(tests, res.exit_code, report_exit, True), **common)


class TaskTests(BaseModel):
    """A task's tests as the verifier runs and grades them: the pristine task image, the command, the
    test ids the strict resolution rule reads and how the runner's output is read.

    A module-level model, so it pickles by reference (a verifier run dispatched to a Ray node,
    :func:`forgeflow.sandbox.dispatch.verify_on`).

    Attributes:
        image_ref: the task image (bug present at /testbed, a git repository).
        test_command: the task's test command (see :func:`run_tests`).
        fail_to_pass: the task's FAIL_TO_PASS test ids.
        pass_to_pass: the task's PASS_TO_PASS test ids.
        log_parser: a SWE-bench log parser by name (:data:`LOG_PARSERS`) for a runner without
            forgeflow's pytest report; None: the pytest report (see :func:`run_tests`).
        pristine_duration_s: the longest recorded run of the task's pristine tests (its Oracle runs),
            seconds; None when not recorded. A submission's run that overruns the limit while this
            fits well inside it is the submission's outcome (:mod:`forgeflow.sandbox.scoring`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    image_ref: str = Field(description="The task image (bug present at /testbed, a git repository).")
    test_command: str = Field(description="The task's test command, run in /testbed.")
    fail_to_pass: list[str] = Field(default_factory=list, description="The task's FAIL_TO_PASS test ids.")
    pass_to_pass: list[str] = Field(default_factory=list, description="The task's PASS_TO_PASS test ids.")
    log_parser: str | None = Field(default=None, description="A SWE-bench log parser by name; None: forgeflow's "
                                                             "pytest report.")
    pristine_duration_s: float | None = Field(default=None, ge=0, description="The longest recorded pristine "
                                              "(Oracle) run of the tests, seconds; None: not recorded.")
