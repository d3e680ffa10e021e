"""validate_candidate's bookkeeping with a scripted sandbox backend (no container).

The scripted sandbox answers the verifier's wrapped test command the way forgeflow's report plugin
does (its marker, then the report JSON) with the status map its script holds for that run, so the
NOP / Oracle / repeated-Oracle sequence, what each trial records and when ``on_trial`` sees it are
checked exactly. The same flow in real podman containers: tests/integration/test_verifier_adversarial.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from forgeflow.common import errors
from forgeflow.sandbox import backends
from forgeflow.sandbox.base import ExecResult
from forgeflow.sandbox.trial import ValidationChecks, validate_candidate

GOOD = {"t::f2p": "PASSED", "t::p2p": "PASSED"}
BUGGY = {"t::f2p": "FAILED", "t::p2p": "PASSED"}


class Bug:
    instance_id = "pkg.bug-1"
    patch = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"


class Script:
    """The status maps the successive test runs report (an exception instance: the run raises it)."""

    def __init__(self, runs: list[dict[str, str] | BaseException]) -> None:
        self.runs: Iterator = iter(runs)
        self.events: list[str] = []

    def factory(self, image: str, spec: object, name: str) -> "ScriptedSandbox":
        return ScriptedSandbox(self, name)


class ScriptedSandbox:
    def __init__(self, script: Script, name: str) -> None:
        self.script, self.name = script, name

    def start(self) -> None:
        self.script.events.append(f"start {self.name.split('-')[1]}")

    def write_file(self, path: str, content: str) -> None:
        pass

    def stop(self) -> None:
        pass

    def stop_async(self):
        return lambda: None

    def exec(self, command, timeout_s, workdir=None, env=None) -> ExecResult:
        if not isinstance(command, str):  # git apply -R, rm: fine
            return ExecResult(exit_code=0, stdout="", stderr="", duration_s=0.0)
        run = next(self.script.runs)
        if isinstance(run, BaseException):
            raise run
        marker = re.search(r"FORGEFLOW-VERIFIER-REPORT-[0-9a-f]+", command).group(0)
        code = 1 if any(s in ("FAILED", "ERROR") for s in run.values()) else 0
        out = f"collected {len(run)} items\n\n{marker}\n" + json.dumps({"exitstatus": code, "tests": run})
        return ExecResult.from_bytes(code, out.encode(), b"", 0.5)


@pytest.fixture()
def script(monkeypatch: pytest.MonkeyPatch):
    def install(runs: list) -> Script:
        s = Script(runs)
        monkeypatch.setitem(backends.BACKENDS, "scripted", lambda target: s.factory)
        return s

    return install


def _validate(runs_script: Script, checks: ValidationChecks | None = None):
    seen = []

    def on_trial(record) -> None:
        seen.append(record)
        runs_script.events.append(f"recorded {record.kind}")

    outcome = validate_candidate(Bug(), "img", "pytest", backend="scripted", checks=checks, on_trial=on_trial)
    return outcome, seen


def test_a_valid_task_runs_the_oracle_twice_and_records_each_trial_as_it_ends(script) -> None:
    s = script([BUGGY, GOOD, GOOD])
    outcome, seen = _validate(s)
    assert outcome.report.accepted and outcome.report.oracle_runs == 2 and outcome.report.flaky_tests == []
    assert s.events == ["start nop", "recorded nop", "start oracle", "recorded oracle", "start oracle",
                        "recorded oracle"]
    assert [t.reward for t in seen] == [0.0, 1.0, 1.0]
    assert len({t.trial_id for t in seen}) == 3 and seen == outcome.trials
    assert seen[0].verifier["run"]["report_format"] == "pytest-report"


def test_a_rejected_task_pays_no_repeat(script) -> None:
    s = script([BUGGY, BUGGY])
    outcome, seen = _validate(s)
    assert not outcome.report.accepted and outcome.report.reason == "oracle run failed 1 tests"
    assert [t.kind for t in seen] == ["nop", "oracle"] and outcome.oracle_repeats == []


def test_oracle_runs_that_disagree_flag_the_task_flaky(script) -> None:
    s = script([BUGGY, GOOD, GOOD, GOOD | {"t::p2p": "FAILED"}])
    outcome, _ = _validate(s, ValidationChecks(oracle_runs=3))
    assert not outcome.report.accepted and outcome.report.flaky_tests == ["t::p2p"]
    assert outcome.report.reason.startswith("flaky: 1 test(s) disagree across 3 Oracle runs")
    assert [t.reward for t in outcome.oracle_repeats] == [1.0, 0.0]
    s = script([BUGGY, GOOD, GOOD | {"t::p2p": "FAILED"}])
    dropped, _ = _validate(s, ValidationChecks(flaky_policy="drop_flaky_pass_to_pass"))
    assert dropped.report.accepted and dropped.report.PASS_TO_PASS == [] and dropped.report.FAIL_TO_PASS == ["t::f2p"]


def test_an_infrastructure_error_in_a_repeat_leaves_no_verdict(script) -> None:
    s = script([BUGGY, GOOD, errors.VerifierTimeoutError("exceeded 1 s (evidence: forgeflow's wall clock)")])
    outcome, seen = _validate(s)
    assert outcome.report is None
    assert outcome.failed_trial.exception_type == "VerifierTimeoutError" and outcome.failed_trial is seen[-1]
    assert "evidence" in outcome.failed_trial.exception_message


def test_a_report_that_disagrees_with_the_exit_status_is_no_verdict(script, monkeypatch) -> None:
    s = script([BUGGY])
    real_exec = ScriptedSandbox.exec

    def lying_exec(self, command, timeout_s, workdir=None, env=None):
        result = real_exec(self, command, timeout_s, workdir, env)
        return result.model_copy(update={"exit_code": 0}) if isinstance(command, str) else result

    monkeypatch.setattr(ScriptedSandbox, "exec", lying_exec)
    outcome, seen = _validate(s)
    assert outcome.report is None and seen[0].exception_type == "VerifierOutputError"
    assert "says pytest exited 1 but the test command exited 0" in seen[0].exception_message


def test_bad_checks_are_refused_before_anything_runs(script) -> None:
    s = script([])
    with pytest.raises(errors.InputError, match="unknown log_parser 'parse_log_nope'; valid: parse_log_astroid"):
        _validate(s, ValidationChecks(log_parser="parse_log_nope"))
    with pytest.raises(ValueError, match="oracle_runs"):
        ValidationChecks(oracle_runs=0)
    assert s.events == []


def test_a_command_that_never_started_pytest_is_an_exception_not_a_rejection(script, monkeypatch) -> None:
    """No report and no start line of the plugin: the test command broke (it is not a pytest run that
    keeps PYTEST_ADDOPTS), which no submission can cause; a cut-short run prints the start line."""
    s = script([BUGGY])

    def no_pytest(self, command, timeout_s, workdir=None, env=None):
        next(self.script.runs)
        return ExecResult.from_bytes(0, b"Segmentation fault\n", b"", 0.1)

    monkeypatch.setattr(ScriptedSandbox, "exec", no_pytest)
    outcome, seen = _validate(s)
    assert outcome.report is None and seen[0].exception_type == "VerifierOutputError"
    assert "without starting pytest with forgeflow's report plugin" in seen[0].exception_message

    s = script([BUGGY])

    def cut_short(self, command, timeout_s, workdir=None, env=None):
        next(self.script.runs)
        nonce = re.search(r'FORGEFLOW_VERIFIER_NONCE="([0-9a-f]+)"', command).group(1)
        return ExecResult.from_bytes(0, f"\nFORGEFLOW-VERIFIER-STARTED-{nonce}\ncollected 2\n".encode(), b"", 0.1)

    monkeypatch.setattr(ScriptedSandbox, "exec", cut_short)
    outcome, seen = _validate(s)
    assert seen[0].exception_type == "VerifierOutputError" and "exited 0 but wrote no test report" in seen[0].exception_message


def test_the_oracle_revert_fragment_carries_the_patch_bytes_exactly(tmp_path) -> None:
    """The Oracle's revert runs inside its test exec as a shell fragment (a quoted heredoc): a patch
    holding ``$(...)``, backticks, backslashes and a line ``EOF`` is reverted byte for byte, nothing
    in it is executed, and a patch the tree does not hold exits non-zero (git's status kept). A small
    patch never touches the sandbox (no write_file: one exec)."""
    import subprocess
    from types import SimpleNamespace

    from forgeflow.sandbox.trial import _revert_setup

    tricky = "x = '$(touch pwned)' `touch pwned2` \\\\n\nEOF\n"
    (tmp_path / "a.txt").write_text(tricky)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "a.txt"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=tmp_path, check=True)
    (tmp_path / "a.txt").write_text(tricky.replace("EOF", "EOF $HOME"))  # the bug
    patch = subprocess.run([*git, "diff"], cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    bug = SimpleNamespace(instance_id="pkg.tricky", patch=patch)
    run = subprocess.run(["bash", "-c", _revert_setup(bug, SimpleNamespace())], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "a.txt").read_text() == tricky
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    again = subprocess.run(["bash", "-c", _revert_setup(bug, SimpleNamespace())], cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode != 0 and "patch does not apply" in again.stderr
