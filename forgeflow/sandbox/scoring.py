"""A submission scored: put in place in a fresh sandbox of the pristine task image, judged on what git saw
change, the task's tests run, the submission's own failures scored as its own.

:func:`verify_submission` (agent trials, RL rewards, re-scores): a fresh container; the submission put in
place and git's list of what changed (a refused diff is reward 0); the task's own files by ``tamper_policy``
and the added lines by ``screen_policy``; the tests and the strict resolution rule.

**The submission's own failures are its outcome**: a test run that overruns, is OOM-killed, hits the process
limit or breaks the runner is reward 0 (``evidence["submission_failure"]``) when the pristine tests fit the
same limits (a recorded pristine run within :data:`PRISTINE_FRACTION` of the timeout, or a pristine re-run
that completes); otherwise it is an infrastructure exception, never reward 0."""

from __future__ import annotations

import hashlib
import threading
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common import errors
from forgeflow.common.names import sanitize_name
from forgeflow.sandbox.backends import SandboxTarget, get_backend
from forgeflow.sandbox.base import OUTPUT_MAX_BYTES, Sandbox, SandboxSpec
from forgeflow.sandbox.changes import TreeChanges, changes_script, os_path_bytes, parse_changes, restore_script
from forgeflow.sandbox.grading import grade_resolved
from forgeflow.sandbox.submission import (
    SCREEN_POLICIES,
    TAMPER_POLICIES,
    ScreenPolicy,
    TamperPolicy,
    classify_changes,
    screen_added_lines,
)
from forgeflow.sandbox.verifier import TESTBED, VERIFIER_ENV, TaskTests, VerifierResult, run_tests

__all__ = ["PRISTINE_FRACTION", "SUBMISSION_FAILURES", "SubmissionVerdict", "verify_submission"]

PRISTINE_FRACTION = 0.5
"""A recorded pristine run at most this fraction of the timeout "fits well inside" it: a submission's
run that overruns is then the submission's doing without a pristine re-run."""

CHANGES_TIMEOUT_S = 600.0
"""Seconds each half of listing what the submission changed may take (the probe and pristine snapshot;
the submission put in place, the second snapshot and git's lists): over it in the second half is the
submission's own timeout."""

SUBMISSION_FAILURES: dict[type[BaseException], str] = {
    errors.VerifierTimeoutError: "timeout",
    errors.SandboxOOMError: "oom",
    errors.SandboxPidsLimitError: "pids_limit",
    errors.VerifierOutputError: "runner_broken",
}
"""Test-run failures a submission can cause by itself, by the kind recorded in its evidence."""

SUBMISSION_PATH_IN_SANDBOX = "/tmp/forgeflow-submission.patch"
TREE_PATH_IN_SANDBOX = "/tmp/forgeflow-agent-tree.tar"


class SubmissionVerdict(BaseModel):
    """The verifier's answer on one submission.

    Attributes:
        reward: 1.0 (every FAIL_TO_PASS and PASS_TO_PASS test PASSED) or 0.0.
        result: the test run (None when no test ran: tampering, a patch git refused, a submission failure).
        notes: why, for a person (tampering with the paths, a patch that did not apply, a report
            that could not be trusted, the submission's own timeout, an empty submission).
        evidence: what the trial record keeps (``submission``: git's list and the policies' findings;
            ``run``: the run's evidence, see :meth:`VerifierResult.evidence`; ``submission_failure``:
            the kind and evidence of the submission's own failure, when there was one).
        submission_patch: the submission as git wrote it in the sandbox (``git diff-tree -p --binary``
            of the pristine and submitted snapshots; empty when nothing changed or git refused it): what
            a re-score re-applies.
        submission_failure: the kind of the submission's own failure (:data:`SUBMISSION_FAILURES`), or None.
    """

    model_config = ConfigDict(frozen=True)

    reward: float = Field(ge=0.0, le=1.0)
    result: VerifierResult | None = None
    notes: list[str] = Field(default_factory=list)
    evidence: dict[str, Any] = Field(default_factory=dict)
    submission_patch: str = ""
    submission_failure: str | None = None


def _put_in_place(sandbox: Sandbox, submission: str, tree: bytes | None) -> TreeChanges:
    """Write the submission into ``sandbox``, put it in place and read git's list of what changed."""
    nonce = uuid.uuid4().hex[:16]
    patch_path = tree_path = None
    if tree is not None:
        sandbox.write_file(TREE_PATH_IN_SANDBOX, tree)
        tree_path = TREE_PATH_IN_SANDBOX
    elif submission.strip():
        sandbox.write_file(SUBMISSION_PATH_IN_SANDBOX, submission if submission.endswith("\n") else submission + "\n")
        patch_path = SUBMISSION_PATH_IN_SANDBOX
    base = sandbox.exec(changes_script(TESTBED, nonce, part="base"), timeout_s=CHANGES_TIMEOUT_S, workdir=TESTBED,
                        env=VERIFIER_ENV)  # nothing of the submission's yet: a limit hit here is the sandbox's
    if base.exit_code != 0:
        return parse_changes(base.stdout, base.exit_code, nonce)  # raises SandboxError with the evidence
    try:
        put = sandbox.exec(changes_script(TESTBED, nonce, patch_path=patch_path, tree_path=tree_path, part="put"),
                           timeout_s=CHANGES_TIMEOUT_S, workdir=TESTBED, env=VERIFIER_ENV)
    except tuple(k for k in SUBMISSION_FAILURES if k is not errors.VerifierOutputError) as exc:
        kind = next(k for t, k in SUBMISSION_FAILURES.items() if isinstance(exc, t))
        return TreeChanges(applied=False, put_failure=kind, apply_output=f"{type(exc).__name__}: {exc}"[-4000:])
    if put.dropped_bytes:  # git's listing of what it changed passed the bound: the submission's own size
        return TreeChanges(applied=False, put_failure="output_limit", apply_output=(
            f"git's listing of the submission's changes passed the {OUTPUT_MAX_BYTES >> 20} MiB read per stream "
            f"({put.dropped_bytes} bytes more)"))
    return parse_changes(base.stdout + put.stdout, put.exit_code, nonce)


def _restore(sandbox: Sandbox, changes: TreeChanges, paths: list[str]) -> None:
    """Put ``paths`` back as the pristine snapshot has them.

    Raises:
        SandboxError: the restore failed (the sandbox broke: nothing is graded).
    """
    listing = f"/tmp/forgeflow-restore-{uuid.uuid4().hex[:12]}.list"
    wanted = set(paths)  # every change shown as one of them: its exact bytes (two may look alike)
    sandbox.write_file(listing, b"".join(c.raw_path + b"\0" for c in changes.changes if c.path in wanted))
    res = sandbox.exec(restore_script(TESTBED, changes.base_tree, listing), timeout_s=CHANGES_TIMEOUT_S,
                       workdir=TESTBED, env=VERIFIER_ENV)
    if res.exit_code != 0:
        raise errors.SandboxError(f"putting the task's own files back failed (exit {res.exit_code}): "
                                  f"{(res.stderr or res.stdout).strip()[-400:]}")


_PRISTINE_LOCK = threading.Lock()
_PRISTINE_OK: dict[str, float] = {}
"""Pristine re-runs that completed, by what they ran (image, command, parser, limits): their seconds.
Only completions are kept (an exception is never cached)."""


def _pristine_key(tests: TaskTests, timeout_s: float, spec: SandboxSpec, backend: "str | SandboxTarget") -> str:
    kind = backend if isinstance(backend, str) else type(backend).__name__
    raw = repr((tests.image_ref, tests.test_command, tests.log_parser, timeout_s, spec.model_dump_json(), kind))
    return hashlib.sha256(raw.encode()).hexdigest()


def _attribute(exc: errors.InfraError, tests: TaskTests, *, timeout_s: float, spec: SandboxSpec, name: str,
               backend: "str | SandboxTarget") -> dict[str, Any]:
    """The evidence that a failed test run is the submission's doing, or ``exc`` re-raised when the
    pristine tests fail the same limits too (infrastructure)."""
    kind = next(k for t, k in SUBMISSION_FAILURES.items() if isinstance(exc, t))
    message = f"{type(exc).__name__}: {exc}"
    failure: dict[str, Any] = {"kind": kind, "error": message if len(message) <= 1200 else
                               f"{message[:400]} ... {message[-800:]}", "timeout_s": timeout_s,
                               "memory_mb": spec.memory_mb}
    recorded = tests.pristine_duration_s
    if kind == "timeout" and recorded is not None and recorded <= PRISTINE_FRACTION * timeout_s:
        failure["pristine"] = {"source": "recorded", "duration_s": recorded}
        return failure
    key = _pristine_key(tests, timeout_s, spec, backend)
    with _PRISTINE_LOCK:
        known = _PRISTINE_OK.get(key)
    if known is not None:
        failure["pristine"] = {"source": "re-run (cached)", "duration_s": known}
        return failure
    sandbox = get_backend(backend)(tests.image_ref, spec, sanitize_name(f"{name[:44]}-pristine-{uuid.uuid4().hex[:6]}"))
    try:
        sandbox.start()
        try:
            pristine = run_tests(sandbox, tests.test_command, timeout_s, log_parser=tests.log_parser)
        finally:
            sandbox.stop()
    except errors.InfraError as again:
        raise type(exc)(f"{exc} (a re-run of the task's pristine tests under the same limits failed too: "
                        f"{type(again).__name__}: {str(again)[:300]})") from exc
    with _PRISTINE_LOCK:
        _PRISTINE_OK[key] = pristine.duration_s
    failure["pristine"] = {"source": "re-run", "duration_s": pristine.duration_s, "exit_code": pristine.exit_code}
    return failure


def verify_submission(
    tests: TaskTests, submission: str, *, timeout_s: float, spec: SandboxSpec, name: str,
    tamper_policy: TamperPolicy = "reject", screen_policy: ScreenPolicy = "reject",
    backend: "str | SandboxTarget" = "podman", tree: bytes | None = None,
) -> SubmissionVerdict:
    """Grade a submission in a fresh sandbox of the pristine task image (see the module docstring).

    Args:
        submission: a unified diff (may be empty); ignored when ``tree`` is given.
        timeout_s: limit of the test run, seconds.
        name: sandbox name (a leftover of a crashed run of the same trial is removed first).
        tree: the agent's work tree as a tar archive; new protected files in it (scratch tests, its own
            conftest) are removed rather than rejected.

    Returns:
        The :class:`SubmissionVerdict`: reward 0 for tampering or a screen finding, a refused patch, failing
        tests, an untrustworthy report, or the submission's own failure (``submission_failure``).

    Raises:
        InputError: an unknown policy, parser or backend.
        SandboxError and subclasses, VerifierTimeoutError, VerifierOutputError: the verifier broke, or the
            pristine tests fail the same limits (an exception, never reward 0).
    """
    if tamper_policy not in TAMPER_POLICIES:
        raise errors.InputError(f"unknown tamper policy {tamper_policy!r}; valid: {', '.join(TAMPER_POLICIES)}")
    if screen_policy not in SCREEN_POLICIES:
        raise errors.InputError(f"unknown screen policy {screen_policy!r}; valid: {', '.join(SCREEN_POLICIES)}")
    if not isinstance(submission, str):
        raise errors.InputError(f"submission must be a string (a unified diff), got {type(submission).__name__}")
    test_ids = tests.graded_tests()
    sandbox = get_backend(backend)(tests.image_ref, spec, name)
    sandbox.start()
    try:
        changes = _put_in_place(sandbox, submission, tree)
        record: dict[str, Any] = {"policy": tamper_policy, "screen_policy": screen_policy,
                                  "source": "tree" if tree is not None else "diff"}
        evidence: dict[str, Any] = {"submission": record}
        if not changes.applied:
            what = "the agent's tree could not be put in place" if tree is not None else "the patch did not apply"
            record["applied"] = False
            if changes.put_failure:  # its own limit hit while git took it in: the pristine snapshot fitted
                evidence["submission_failure"] = {
                    "kind": changes.put_failure, "error": changes.apply_output[-1200:], "memory_mb": spec.memory_mb,
                    "pristine": {"source": "the pristine probe and snapshot in the same sandbox", "duration_s": 0.0}}
                return SubmissionVerdict(reward=0.0, evidence=evidence, submission_failure=changes.put_failure,
                                         notes=[f"{what}: the submission's own {changes.put_failure} while git "
                                                f"took it in (the pristine snapshot fitted the same limits): "
                                                f"{changes.apply_output[-300:]}"])
            return SubmissionVerdict(reward=0.0, evidence=evidence,
                                     notes=[f"{what} (the model's fault): {changes.apply_output[-1000:]}"])
        record.update({"changed_paths": len(changes.changes),
                       "patch_sha256": hashlib.sha256(changes.patch.encode("utf-8", "surrogateescape")).hexdigest()})
        verdict, notes = _judge_changes(changes, test_ids, tamper_policy, screen_policy, tree is not None, record)
        if verdict is not None:
            return verdict.model_copy(update={"evidence": evidence, "submission_patch": changes.patch})
        if record.get("dropped_paths"):
            _restore(sandbox, changes, record["dropped_paths"])
        if not changes.changes:
            notes.append("empty submission (no change to /testbed)")
        try:
            result = run_tests(sandbox, tests.test_command, timeout_s, log_parser=tests.log_parser,
                               expect=tests)
        except tuple(SUBMISSION_FAILURES) as exc:
            failure = _attribute(exc, tests, timeout_s=timeout_s, spec=spec, name=name, backend=backend)
            evidence["submission_failure"] = failure
            return SubmissionVerdict(
                reward=0.0, evidence=evidence, submission_patch=changes.patch, submission_failure=failure["kind"],
                notes=[*notes, f"the submission's own {failure['kind']} (the pristine tests fit the same limits: "
                               f"{failure['pristine']['source']}, {failure['pristine']['duration_s']:.1f} s): "
                               f"{failure['error'][-300:]}"])
    finally:
        sandbox.stop()
    evidence["run"] = result.evidence()
    common = {"result": result, "evidence": evidence, "submission_patch": changes.patch}
    read = _runner_read_changed(result, changes, record.get("dropped_paths", []))
    if read:
        record.update({"tampering": True, "runner_read": read})
        return SubmissionVerdict(reward=0.0, notes=[*notes, "tampering: the test runner read files the submission "
                                                            f"changed: {', '.join(read)}"], **common)
    if result.tampering:
        record["tampering"] = True
    if result.credit_blocker is not None:
        return SubmissionVerdict(reward=0.0, notes=[*notes, f"not credited: {result.credit_blocker}"], **common)
    return SubmissionVerdict(reward=grade_resolved(result.tests, list(tests.FAIL_TO_PASS), list(tests.PASS_TO_PASS)),
                             notes=notes, **common)


def _judge_changes(changes: TreeChanges, test_ids: list[str], tamper_policy: TamperPolicy,
                   screen_policy: ScreenPolicy, from_tree: bool,
                   record: dict[str, Any]) -> tuple[SubmissionVerdict | None, list[str]]:
    """Apply the tamper and screen policies to git's list; fill ``record``. Returns ``(verdict, notes)``: a
    verdict (reward 0, no test run) when a policy rejects, else None and the notes of a run that goes on
    (``record["dropped_paths"]``: the paths to put back first)."""
    protected = classify_changes(changes, test_ids, TESTBED)
    status = {c.path: c.status for c in changes.changes}
    notes: list[str] = []
    dropped = [p for p in protected if from_tree and status.get(p) == "A"]  # an agent's scratch files
    judged = {p: why for p, why in protected.items() if p not in dropped}
    if protected:
        record["protected_paths"] = dict(protected)
    if judged and tamper_policy == "reject":
        record["tampering"] = True
        paths = ", ".join(f"{p} ({why})" for p, why in judged.items())
        return SubmissionVerdict(reward=0.0, notes=[f"tampering: the submission changes the task's own files: "
                                                    f"{paths}"]), notes
    dropped = sorted({*dropped, *judged})
    if dropped:
        record["dropped_paths"] = dropped
        notes.append(f"dropped the submission's changes to the task's own files: {', '.join(dropped)}")
    if screen_policy != "off":
        findings = screen_added_lines(changes.patch, skip=protected)
        if findings:
            record["screen_findings"] = [f.model_dump() for f in findings[:20]]
            shown = "; ".join(f"{f.path}: {f.kind}: {f.line.strip()[:80]!r}" for f in findings[:5])
            if screen_policy == "reject":
                record["tampering"] = True
                return SubmissionVerdict(reward=0.0, notes=[*notes, f"tampering: the submission's added lines reach "
                                                                    f"into the test run ({shown})"]), notes
            notes.append(f"flagged by the static screen: {shown}")
    return None, notes


def _runner_read_changed(result: VerifierResult, changes: TreeChanges, restored: list[str]) -> list[str]:
    """Repository files the test runner reported reading before any test ran (configuration, plugins, conftest
    modules, modules already imported) that the submission changed and that were not put back."""
    inputs = result.runner_inputs or {}
    files: set[str] = set()
    if isinstance(inputs.get("inipath"), str):
        files.add(inputs["inipath"])
    files.update(f for f in inputs.get("conftests") or [] if isinstance(f, str))
    for key in ("plugins", "modules", "hook_files"):
        value = inputs.get(key) or {}
        files.update(f for f in (value.values() if isinstance(value, dict) else value) if isinstance(f, str))
    for plugin in inputs.get("registered") or []:  # registered later, by a conftest or by code under test
        if isinstance(plugin, dict):
            files.update(f for f in [plugin.get("file"), *(plugin.get("hook_files") or [])] if isinstance(f, str))
    folders: set[str] = set()
    for entry in inputs.get("entry_points") or []:
        if isinstance(entry, dict):
            files.update(v for v in (entry.get("plugin"),) if isinstance(v, str))
            folders.update(v for v in (entry.get("dist"),) if isinstance(v, str))
    put_back = set(restored)
    changed = {c.raw_path: c.path for c in changes.changes if c.path not in put_back}  # exact bytes -> shown
    prefix = os_path_bytes(TESTBED.rstrip("/") + "/")
    read = {os_path_bytes(f) for f in files}
    hits = {changed[f[len(prefix):]] for f in read if f.startswith(prefix) and f[len(prefix):] in changed}
    for folder in {os_path_bytes(f) for f in folders}:
        if folder.startswith(prefix):
            rel = folder[len(prefix):].rstrip(b"/") + b"/"
            hits.update(shown for raw, shown in changed.items() if raw.startswith(rel))
    return sorted(hits)
