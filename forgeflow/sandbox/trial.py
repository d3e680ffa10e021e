"""Trials: one sandboxed run of a task's tests, recorded with its reward or its infrastructure error.

A *NOP* trial runs the tests on the task image as built; an *Oracle* trial reverts the bug patch
(``git apply -R``) first; every trial runs in a fresh container. Reward convention (Harbor's): 1.0 iff every
FAIL_TO_PASS and PASS_TO_PASS test passes, so a valid task gives **nop 0.0 and oracle 1.0**; without
FAIL_TO_PASS yet, 1.0 iff at least one test passed and none failed (a NOP 1.0 flags an undetected bug).

An infrastructure failure (OOM, timeout, image pull, an untrustworthy report, a patch that does not revert)
is the trial's ``exception_type`` with ``reward = None``, never 0. But a NOP run that hangs, is OOM-killed or
hits the process limit while the Oracle run completes is the task's own outcome: the candidate is rejected
and the NOP recorded with reward 0. A task the first Oracle run accepts gets repeated NOP runs (``nop_runs``: each
FAIL_TO_PASS test must fail every time) and repeated Oracle runs (``oracle_runs``: each must pass every time), the
flaky-test checks of :mod:`forgeflow.sandbox.flaky_gold` (:data:`FLAKY_POLICIES`)."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.common.fsutil import sha256_json
from forgeflow.common.names import sanitize_name
from forgeflow.ledger.tables import TrialKind
from forgeflow.ledger.trial_result import ErrorOutcome, RepeatEvidence, RunEvidence, TrialResult, VerifierEvidence
from forgeflow.sandbox.backends import SandboxTarget, get_backend
from forgeflow.sandbox.base import OneShotSandbox, Sandbox, SandboxSpec
from forgeflow.sandbox.flaky_gold import (
    DEFAULT_FLAKY_REPEAT_RUNS,
    DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS,
    DEFAULT_ORACLE_RUNS,
    FLAKY_POLICIES,
    FlakyPolicy,
    ValidationChecks,
    disagreeing_tests,
    judge_nop_runs,
    judge_repeats,
    nop_repeat_plan,
    repeat_plan,
    with_repetitions,
)
from forgeflow.sandbox.grading import (
    ValidationReport,
    failed,
    grade_resolved,
    grade_validation,
    passed,
)
from forgeflow.sandbox.limits import DEFAULT_VERIFIER_TIMEOUT_S, SandboxLimits, VerifierTimeoutS
from forgeflow.sandbox.verifier import (
    LOG_PARSERS,
    LOG_TAIL_CHARS,
    TESTBED,
    RepeatPlan,
    SetupError,
    VerifierResult,
    run_tests,
)

__all__ = [
    "TrialKind",
    "TrialResult",
    "VerifierResult",
    "VerifierEvidence",
    "ValidationOutcome",
    "FlakyPolicy",
    "FLAKY_POLICIES",
    "ValidationChecks",
    "ValidationSettings",
    "DEFAULT_ORACLE_RUNS",
    "DEFAULT_FLAKY_REPEAT_RUNS",
    "DEFAULT_FLAKY_SAMPLE_PASS_TO_PASS",
    "disagreeing_tests",
    "judge_repeats",
    "TESTBED",
    "LOG_TAIL_CHARS",
    "sanitize_name",
    "make_trial_id",
    "container_name",
    "verify",
    "validate_candidate",
]

class ValidationSettings(SandboxLimits):
    """How each NOP/Oracle validation of a stage runs: the verifier's limit, the sandbox's limits
    (:class:`~forgeflow.sandbox.limits.SandboxLimits`, already resolved against a sandbox block) and
    the evidence it gathers (what every validation of a batch shares, beside its candidate).

    Attributes:
        verifier_timeout_s: absolute limit per test run, seconds (> 0).
        checks: Oracle repeats, flaky policy and log parser (:class:`ValidationChecks`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    verifier_timeout_s: VerifierTimeoutS = DEFAULT_VERIFIER_TIMEOUT_S
    checks: ValidationChecks = Field(default_factory=ValidationChecks,
                                     description="Oracle repeats, flaky policy and log parser.")


PATCH_PATH_IN_SANDBOX = "/tmp/forgeflow-bug.patch"


# exceptions recorded on a trial rather than raised: the infrastructure broke, or the Oracle
# could not revert the patch (the image does not hold the bug it claims)
_RECORDED_ERRORS: tuple[type[BaseException], ...] = (errors.InfraError, errors.PatchApplyError)


class ValidationOutcome(BaseModel):
    """The NOP and Oracle trials of one candidate and the verdict.

    Attributes:
        nop: the NOP trial (always run).
        oracle: the first Oracle trial; None when the NOP had an infra error or no test failed with the bug
            (a NOP that hung or exhausted memory or processes is followed by an Oracle trial).
        nop_repeats: the repeated NOP trials (run only for a task the first Oracle would accept).
        oracle_repeats: the repeated Oracle trials (run only for a task the first Oracle and the NOP repeats
            would accept).
        report: the verdict; None when a trial had an infra error (no verdict: retry, do not reject).
    """

    model_config = ConfigDict(frozen=True)

    nop: TrialResult
    oracle: TrialResult | None = None
    nop_repeats: list[TrialResult] = Field(default_factory=list)
    oracle_repeats: list[TrialResult] = Field(default_factory=list)
    report: ValidationReport | None = None

    @property
    def trials(self) -> list[TrialResult]:
        """Every trial of the validation, in the order they ran."""
        return [self.nop, *([self.oracle] if self.oracle is not None else []), *self.nop_repeats,
                *self.oracle_repeats]

    @property
    def failed_trial(self) -> TrialResult | None:
        """The last trial that ended in an exception (why there is no verdict), or None."""
        return next((t for t in reversed(self.trials) if t.exception_type is not None), None)


def make_trial_id(instance_id: str, kind: TrialKind, image_ref: str, run_key: str) -> str:
    """Deterministic trial id: the first 32 hex of the sha256 of the canonical JSON of
    ``{instance_id, kind, image, run_key}`` (the same inputs resume the same trial)."""
    return sha256_json(
        {"instance_id": instance_id, "kind": kind, "image": image_ref, "run_key": run_key}
    )[:32]


def container_name(instance_id: str, kind: TrialKind, trial_id: str) -> str:
    """The sandbox name of a trial: ``ff-<kind>-<instance id>-<trial id[:10]>``, sanitized."""
    return sanitize_name(f"ff-{kind}-{instance_id}-{trial_id[:10]}")


def verify(sandbox: Sandbox, test_command: str, timeout_s: float, *, log_parser: str | None = None,
           setup: str | None = None, one_shot: bool = False, repeat: RepeatPlan | None = None) -> VerifierResult:
    """Run the tests of pristine test infrastructure (a NOP or Oracle run): :func:`forgeflow.sandbox.verifier.run_tests`
    with an untrustworthy report raised (on pristine infrastructure it means the verifier broke).

    Raises:
        InputError: ``timeout_s`` <= 0, an empty command, an unknown log parser.
        SetupError: ``setup`` exited non-zero.
        VerifierTimeoutError, SandboxOOMError: the run was stopped (see the backend).
        VerifierOutputError: the command could not run, or ``problem`` (evidence and the log's tail named).
    """
    result = run_tests(sandbox, test_command, timeout_s, log_parser=log_parser, setup=setup, one_shot=one_shot,
                       repeat=repeat)
    if result.problem is not None:
        raise errors.VerifierOutputError(
            f"verifier report not trusted: {result.problem} (evidence: exit {result.exit_code}, report exit "
            f"{result.report_exit_code}; log ends {result.log_tail.strip()[-300:]!r})"
        )
    return result


@dataclass(frozen=True)
class _Run:
    trial_id: str
    started_at: datetime
    env_setup_s: float
    result: VerifierResult | None
    error: BaseException | None


@dataclass(frozen=True)
class _Tests:
    """How a candidate's tests run (what every trial of one validation shares)."""

    image_ref: str
    command: str
    timeout_s: float
    spec: SandboxSpec
    backend: "str | SandboxTarget"
    log_parser: str | None


def _run_trial(instance_id: str, kind: TrialKind, tests: _Tests, run_key: str,
               revert: "BugTask | None" = None,
               removals: list[Callable[[], None]] | None = None, repeat: RepeatPlan | None = None) -> _Run:
    """Start a fresh sandbox, run the verifier (after reverting ``revert``'s bug patch in the same exec); catch
    what a trial records. A :class:`~forgeflow.sandbox.base.OneShotSandbox` runs it as the container's own
    process; with ``removals`` the container is removed in the background."""
    sandbox_cls = get_backend(tests.backend)
    trial_id = make_trial_id(instance_id, kind, tests.image_ref, run_key)
    name = container_name(instance_id, kind, trial_id)
    started_at = datetime.now(timezone.utc)
    t0 = time.monotonic()
    env_setup_s = 0.0
    sandbox = sandbox_cls(tests.image_ref, tests.spec, name)
    one_shot = isinstance(sandbox, OneShotSandbox) and (revert is None or _patch_inline(revert))
    try:
        try:
            if not one_shot:
                sandbox.start()
                env_setup_s = time.monotonic() - t0
            try:
                result = verify(sandbox, tests.command, tests.timeout_s, log_parser=tests.log_parser,
                                setup=_revert_setup(revert, sandbox) if revert is not None else None,
                                one_shot=one_shot, repeat=repeat)
            except SetupError as exc:  # only a revert is a setup
                assert revert is not None
                raise _revert_error(revert, exc) from exc
            finally:
                if one_shot:
                    env_setup_s = getattr(sandbox, "setup_s", None) or time.monotonic() - t0
        finally:
            try:
                if removals is not None:
                    removals.append(sandbox.stop_async())
                else:
                    sandbox.stop()
            except (OSError, subprocess.SubprocessError):
                pass  # the next run of this trial removes a leftover container by name
    except _RECORDED_ERRORS as exc:
        if not env_setup_s:
            env_setup_s = time.monotonic() - t0
        return _Run(trial_id, started_at, env_setup_s, None, exc)
    return _Run(trial_id, started_at, env_setup_s, result, None)


def _record(instance_id: str, kind: TrialKind, run: _Run, reward: float | None) -> TrialResult:
    """The trial record of ``run``: its reward and evidence, or its exception. A run that ended in an
    error but is scored (``reward`` given: the task's own NOP hang or OOM) keeps the error as evidence."""
    if run.error is not None and reward is None:
        return TrialResult(
            trial_id=run.trial_id, instance_id=instance_id, kind=kind, reward=None,
            exception_type=type(run.error).__name__, exception_message=str(run.error) or repr(run.error),
            started_at=run.started_at, env_setup_s=run.env_setup_s,
        )
    if run.error is not None:
        return TrialResult(
            trial_id=run.trial_id, instance_id=instance_id, kind=kind, reward=reward, started_at=run.started_at,
            env_setup_s=run.env_setup_s, verifier=VerifierEvidence(outcome=ErrorOutcome(
                error_type=type(run.error).__name__, error_message=str(run.error) or repr(run.error))))
    assert run.result is not None
    repeat = None if run.result.repeat_s is None else RepeatEvidence(
        repeat_s=run.result.repeat_s, runs=len(run.result.repeat_runs),
        tests=len(run.result.repeat_runs[-1]) if run.result.repeat_runs else 0)
    evidence = VerifierEvidence(run=RunEvidence.model_validate(run.result.evidence()), repeat=repeat)
    return TrialResult(
        trial_id=run.trial_id, instance_id=instance_id, kind=kind, reward=reward,
        started_at=run.started_at, env_setup_s=run.env_setup_s, verifier_s=run.result.duration_s,
        tests=run.result.tests, log_tail=run.result.log_tail, verifier=evidence,
    )


def _reward(tests: dict[str, str], report: ValidationReport | None) -> float:
    """The module's reward convention (SWE-bench resolution when FAIL_TO_PASS is known)."""
    if report is not None and report.FAIL_TO_PASS:
        return grade_resolved(tests, report.FAIL_TO_PASS, report.PASS_TO_PASS)
    statuses = tests.values()
    return 1.0 if any(passed(s) for s in statuses) and not any(failed(s) for s in statuses) else 0.0


INLINE_PATCH_MAX_BYTES = 64 * 1024
"""Bug patches up to this size go inline in the test command (a heredoc: no extra exec); larger ones
are written to the sandbox first (:meth:`Sandbox.write_file`, bytes on stdin), since the whole
command is one argv string and Linux caps one at 128 KiB (MAX_ARG_STRLEN, 32 pages; execve(2))."""


def _patch_body(candidate: "BugTask") -> str:
    return candidate.patch if candidate.patch.endswith("\n") else candidate.patch + "\n"


def _patch_inline(candidate: "BugTask") -> bool:
    """Whether :func:`_revert_setup` writes ``candidate``'s patch inline (no write into a started sandbox)."""
    return len(_patch_body(candidate).encode()) <= INLINE_PATCH_MAX_BYTES


def _revert_setup(candidate: "BugTask", sandbox: Sandbox) -> str:
    """The shell fragment that reverts ``candidate``'s bug patch (``git apply -R``), keeping git's exit status; a
    patch over :data:`INLINE_PATCH_MAX_BYTES` is written into ``sandbox`` now, a smaller one by a heredoc.

    Raises:
        SandboxError: writing a large patch into the sandbox failed.
    """
    body = _patch_body(candidate)
    revert = f"git apply -R {PATCH_PATH_IN_SANDBOX}; rc=$?; rm -f {PATCH_PATH_IN_SANDBOX}; exit $rc"
    if not _patch_inline(candidate):
        sandbox.write_file(PATCH_PATH_IN_SANDBOX, body)
        return revert
    eof = f"FORGEFLOW_PATCH_EOF_{uuid.uuid4().hex}"
    return f"cat > {PATCH_PATH_IN_SANDBOX} <<'{eof}'\n{body}{eof}\n{revert}"


def _revert_error(candidate: "BugTask", exc: SetupError) -> errors.ForgeflowError:
    """What a failed revert is: git missing from the image (exit 127, an infrastructure fault) or a
    bug patch the image does not hold (PatchApplyError)."""
    iid = candidate.instance_id
    if exc.exit_code == 127:
        return errors.SandboxError(f"git is not installed in the task image of {iid}")
    return errors.PatchApplyError(f"oracle of {iid}: reverting the bug patch failed: {exc.output.strip()[:500]}")


class BugTask(Protocol):
    """What validation reads of a candidate: its id and the bug patch the task image has applied
    (a :class:`forgeflow.curation.bugs.Candidate`, a :class:`forgeflow.curation.candidates.CandidateTask`, ...)."""

    @property
    def instance_id(self) -> str: ...

    @property
    def patch(self) -> str: ...


def validate_candidate(
    candidate: BugTask,
    image_ref: str,
    test_command: str,
    *,
    timeout_s: float = 180,
    spec: SandboxSpec | None = None,
    backend: "str | SandboxTarget" = "podman",
    run_key: str = "validate",
    checks: ValidationChecks | None = None,
    on_trial: Callable[[TrialResult], None] | None = None,
) -> ValidationOutcome:
    """Validate a candidate bug with a NOP and Oracle trials, each in a fresh sandbox.

    1. NOP: an infra error ends validation (no verdict); no failing test: the Oracle is skipped, rejected.
    2. Oracle: the bug patch reverted, the tests run, :func:`~forgeflow.sandbox.grading.grade_validation`.
    3. Only when accepted: ``nop_runs - 1`` more NOP runs, the first repeating only FAIL_TO_PASS tests (up to
       ``flaky_sample_fail_to_pass_tests``); :func:`judge_nop_runs` rejects the task unless each failed every time.
    4. Only when still accepted: ``oracle_runs - 1`` more Oracle runs, the first repeating FAIL_TO_PASS and sampled
       PASS_TO_PASS tests; :func:`judge_repeats` flags disagreement by ``flaky_policy``.

    Args:
        timeout_s: per verifier run, in seconds.
        backend: sandbox kind (``podman``, ``kubernetes``) or a :class:`~forgeflow.sandbox.backends.SandboxTarget`.
        run_key: distinguishes repeated validations in trial ids (the k-th repeated NOP or Oracle run adds
            ``/nop-k`` or ``/oracle-k``).
        on_trial: called with each trial record as soon as the trial ends.

    Raises:
        InputError: unknown backend or log parser, ``timeout_s`` <= 0 or an empty test command (nothing ran).
    """
    get_backend(backend)
    if timeout_s <= 0:
        raise errors.InputError(f"timeout_s must be > 0, got {timeout_s}")
    if not test_command.strip():
        raise errors.InputError("test_command must not be empty")
    checks = checks or ValidationChecks()
    if checks.log_parser is not None and checks.log_parser not in LOG_PARSERS:
        raise errors.InputError(f"unknown log_parser {checks.log_parser!r}; valid: {', '.join(LOG_PARSERS)}")
    tests = _Tests(image_ref, test_command, timeout_s, spec or SandboxSpec(), backend, checks.log_parser)
    removals: list[Callable[[], None]] = []
    try:
        return _validate(candidate, tests, run_key, checks, on_trial, removals)
    finally:  # every container of this validation is gone before it reports
        for wait in removals:
            wait()


_TASK_OUTCOME_ERRORS: tuple[type[errors.SandboxError], ...] = (
    errors.VerifierTimeoutError, errors.SandboxOOMError, errors.SandboxPidsLimitError)
"""A NOP run that ends in one of these while the Oracle run completes is the task's own outcome (the bug
hangs or exhausts memory or processes), not the infrastructure's: the candidate is rejected for it."""

_NOP_BROKE = {"VerifierTimeoutError": "hung past the verifier's limit", "SandboxOOMError": "ran out of memory",
              "SandboxPidsLimitError": "hit the sandbox's process limit"}

_Ended = Callable[[TrialKind, _Run, "float | None"], TrialResult]


def _collected(result: VerifierResult) -> set[str]:
    """The ids a pristine run collected (its status map's ids when a log was parsed)."""
    return set(result.collected if result.collected is not None else result.tests)


def _nop_broke(candidate: BugTask, tests: _Tests, run_key: str, nop_run: _Run, ended: _Ended,
               removals: list[Callable[[], None]]) -> ValidationOutcome:
    """The NOP run hung or exhausted memory/processes: run the Oracle. If it completes, the candidate is
    rejected for the NOP's failure (recorded as the NOP's outcome, reward 0, the error as evidence);
    if it fails too, both stay infrastructure exceptions (no verdict)."""
    iid = candidate.instance_id
    oracle_run = _run_trial(iid, "oracle", tests, run_key, candidate, removals)
    if oracle_run.result is None:
        return ValidationOutcome(nop=ended("nop", nop_run, None), oracle=ended("oracle", oracle_run, None))
    error = nop_run.error
    name = type(error).__name__
    reason = (f"the NOP run (bug present) {_NOP_BROKE[name]} while the Oracle run completed in "
              f"{oracle_run.result.duration_s:.1f} s: every later use of the task would pay it "
              f"({name}: {str(error)[:300]})")
    report = ValidationReport(accepted=False, reason=reason, oracle_runs=1,
                              known_tests=sorted(_collected(oracle_run.result)))
    nop = ended("nop", nop_run, 0.0)
    return ValidationOutcome(nop=nop, oracle=ended("oracle", oracle_run, _reward(oracle_run.result.tests, None)),
                             report=report)


def _confirm_nop(iid: str, tests: _Tests, run_key: str, checks: ValidationChecks, report: ValidationReport,
                 nop_tests: dict[str, str], ended: _Ended,
                 removals: list[Callable[[], None]]) -> tuple[list[TrialResult], ValidationReport | None, set[str]]:
    """The NOP runs after the first (``checks.nop_runs - 1``; the second repeats only FAIL_TO_PASS tests, sampled) of a
    task the first Oracle run accepted: their trial records (each scored 1.0 iff every FAIL_TO_PASS test it ran passed
    in its first repetition: the bug went undetected), the verdict of :func:`judge_nop_runs` (None: a run ended in an
    exception, no verdict) and the tests they collected."""
    plan = nop_repeat_plan(iid, report, checks)
    checked = plan.tests if plan is not None else report.FAIL_TO_PASS  # what every run ran
    records: list[TrialResult] = []
    runs, known = [nop_tests], set()
    for k in range(2, checks.nop_runs + 1):
        run = _run_trial(iid, "nop", tests, f"{run_key}/nop-{k}", None, removals, plan if k == 2 else None)
        if run.result is None:
            records.append(ended("nop", run, None))
            return records, None, known
        known |= _collected(run.result)
        runs += with_repetitions(run.result)
        records.append(ended("nop", run, grade_resolved(run.result.tests, checked, [])))
    return records, judge_nop_runs(report, runs, nop_runs=checks.nop_runs, tests=checked), known


def _validate(candidate: BugTask, tests: _Tests, run_key: str, checks: ValidationChecks,
              on_trial: Callable[[TrialResult], None] | None, removals: list[Callable[[], None]]) -> ValidationOutcome:
    """The NOP / Oracle / repeats sequence of :func:`validate_candidate` (containers removed in the
    background, their waits appended to ``removals``)."""
    iid = candidate.instance_id

    def ended(kind: TrialKind, run: _Run, reward: float | None) -> TrialResult:
        record = _record(iid, kind, run, reward)
        if on_trial is not None:
            on_trial(record)
        return record

    nop_run = _run_trial(iid, "nop", tests, run_key, None, removals)
    if nop_run.result is None:
        if isinstance(nop_run.error, _TASK_OUTCOME_ERRORS):
            return _nop_broke(candidate, tests, run_key, nop_run, ended, removals)
        return ValidationOutcome(nop=ended("nop", nop_run, None))
    nop_tests = nop_run.result.tests
    if not any(failed(s) for s in nop_tests.values()):
        report = grade_validation(nop_tests, None)
        return ValidationOutcome(nop=ended("nop", nop_run, _reward(nop_tests, report)), report=report)
    # a test failed with the bug, so the NOP's reward is 0.0 whatever the Oracle finds: record it now
    nop = ended("nop", nop_run, _reward(nop_tests, None))
    oracle_run = _run_trial(iid, "oracle", tests, run_key, candidate, removals)
    if oracle_run.result is None:
        return ValidationOutcome(nop=nop, oracle=ended("oracle", oracle_run, None))
    report = grade_validation(nop_tests, oracle_run.result.tests)
    oracle = ended("oracle", oracle_run, _reward(oracle_run.result.tests, report))
    known = _collected(nop_run.result) | _collected(oracle_run.result)
    nop_repeats: list[TrialResult] = []
    if report.accepted and checks.nop_runs > 1:
        nop_repeats, confirmed, collected = _confirm_nop(iid, tests, run_key, checks, report, nop_tests, ended,
                                                         removals)
        if confirmed is None:
            return ValidationOutcome(nop=nop, oracle=oracle, nop_repeats=nop_repeats)
        report, known = confirmed, known | collected
    if not report.accepted or checks.oracle_runs == 1:
        return ValidationOutcome(nop=nop, oracle=oracle, nop_repeats=nop_repeats, report=report.model_copy(
            update={"oracle_runs": 1, "known_tests": sorted(known)}))
    plan = repeat_plan(iid, report, checks)
    repeats: list[TrialResult] = []
    runs = [oracle_run.result.tests]
    repeat_s = None
    for k in range(2, checks.oracle_runs + 1):
        run = _run_trial(iid, "oracle", tests, f"{run_key}/oracle-{k}", candidate, removals, plan if k == 2 else None)
        if run.result is None:
            repeats.append(ended("oracle", run, None))
            return ValidationOutcome(nop=nop, oracle=oracle, nop_repeats=nop_repeats, oracle_repeats=repeats)
        known |= _collected(run.result)
        runs += with_repetitions(run.result)
        repeat_s = run.result.repeat_s if k == 2 else repeat_s
        repeats.append(ended("oracle", run, _reward(run.result.tests, report)))
    judged = judge_repeats(report, runs, checks.flaky_policy, oracle_runs=checks.oracle_runs)
    return ValidationOutcome(nop=nop, oracle=oracle, nop_repeats=nop_repeats, oracle_repeats=repeats,
                             report=judged.model_copy(update={"known_tests": sorted(known), "repeat_s": repeat_s}))
