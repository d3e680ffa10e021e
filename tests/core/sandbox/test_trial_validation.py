"""validate_candidate's bookkeeping with a scripted sandbox backend (no container).

The scripted sandbox answers the verifier's wrapped test command the way forgeflow's report plugin
does (its records on the channel, the tripwires, pytest's summary line) with the status map its
script holds for that run, so the NOP / Oracle / repeated-Oracle sequence, what each trial records
and when ``on_trial`` sees it are checked exactly. The same flow in real podman containers:
tests/adversarial/test_known_attacks.py and tests/adversarial/test_flaky_gold.py.
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
CONFIRMED = ({"t::f2p": "FAILED"}, [{"t::f2p": "FAILED"}] * 5)
"""The second NOP run of a valid task: only FAIL_TO_PASS runs, six times, failing each time."""


class Bug:
    instance_id = "pkg.bug-1"
    patch = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"


class Script:
    """The status maps the successive test runs report (an exception instance: the run raises it)."""

    def __init__(self, runs: list[dict[str, str] | BaseException]) -> None:
        self.runs: Iterator = iter(runs)
        self.events: list[str] = []
        self.repeats: list[int] = []

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
        if (mark := re.search(r"@@FF-([0-9a-f]+) %s@@", command)) is not None:  # scoring's list of changes
            return ExecResult(exit_code=0, stdout=changes_stdout(mark.group(1)), stderr="", duration_s=0.0)
        run = next(self.script.runs)
        if isinstance(run, BaseException):
            raise run
        again: list[dict[str, str]] = []
        if isinstance(run, tuple):  # (the run's map, the maps of its further repetitions)
            run, again = run
        nonce = re.search(r'FORGEFLOW_VERIFIER_NONCE="([0-9a-f]+)"', command).group(1)
        repeat = re.search(r'FORGEFLOW_VERIFIER_REPEAT="(\d+)"', command)
        self.script.repeats.append(int(repeat.group(1)) if repeat else 1)
        return ExecResult.from_bytes(1, channel_stdout(nonce, run, again=again).encode(), b"", 0.5)


def changes_stdout(nonce: str, path: str = "x.py") -> str:
    """What the verifier's changes script prints when the submission modified ``path`` (one line)."""
    parts = {"probe": json.dumps({"executable": "python3", "sys_path": ["/testbed"], "repo_entries": ["/testbed"],
                                  "names": ["json"]}),
             "trees": f"{'a' * 40} {'b' * 40}",
             "raw": f":100644 100644 {'1' * 40} {'2' * 40} M\0{path}\0".encode().hex(),  # sent as hex
             "patch": f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-a\n+b\n", "end": ""}
    return "".join(f"\n@@FF-{nonce} {name}@@\n{body}" for name, body in parts.items())


_PHASE = {"PASSED": ("call", "passed", False), "FAILED": ("call", "failed", False),
          "ERROR": ("setup", "failed", False), "SKIPPED": ("setup", "skipped", False),
          "XFAIL": ("call", "skipped", True), "XPASS": ("call", "passed", True)}
_WORD = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "xfailed",
         "XPASS": "xpassed"}


def channel_stdout(nonce: str, run: dict[str, str], *, tripwires: bool = True, exitstatus: int = 1,
                   again: list[dict[str, str]] = ()) -> str:
    """What pytest with forgeflow's plugin prints for ``run`` (one report per test and repetition in
    ``again``, the tripwires last, the session end, then pytest's summary line)."""
    wires = {f"/tmp/w.py::test_forgeflow_must_pass_{nonce}": "PASSED",
             f"/tmp/w.py::test_forgeflow_must_fail_{nonce}": "FAILED"} if tripwires else {}
    every = {**run, **wires}
    records = [{"kind": "start", "sys_path": ["/testbed"], "modules": {}}, {"kind": "collected", "ids": list(every)}]
    reported = [(rep, nodeid, status) for rep, statuses in enumerate([every, *again]) for nodeid, status in statuses.items()]
    for rep, nodeid, status in reported:
        when, outcome, xfail = _PHASE[status]
        records.append({"kind": "report", "nodeid": nodeid, "when": when, "outcome": outcome, "xfail": xfail,
                        "rep": rep, "duration_s": 0.25})
    records.append({"kind": "end", "exitstatus": exitstatus, "verbosity": 0})
    lines = [f"\n@forgeflow-verifier-{nonce} " + json.dumps({"seq": i, **r}) + "\n" for i, r in enumerate(records)]
    counts: dict[str, int] = {}
    for _, _, status in reported:
        counts[_WORD[status]] = counts.get(_WORD[status], 0) + 1
    summary = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no tests ran"
    return f"collected {len(every)} items\n" + "".join(lines) + f"==== {summary} in 0.50s ====\n"


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


def test_a_valid_task_runs_the_nop_and_the_oracle_twice_and_records_each_trial_as_it_ends(script) -> None:
    s = script([BUGGY, GOOD, CONFIRMED, GOOD])
    outcome, seen = _validate(s)
    assert outcome.report.accepted and outcome.report.oracle_runs == 2 and outcome.report.flaky_tests == []
    assert s.events == ["start nop", "recorded nop", "start oracle", "recorded oracle", "start nop", "recorded nop",
                        "start oracle", "recorded oracle"]
    assert [t.reward for t in seen] == [0.0, 1.0, 0.0, 1.0]
    assert len({t.trial_id for t in seen}) == 4 and seen == outcome.trials
    assert [t.kind for t in outcome.nop_repeats] == ["nop"] and len(outcome.oracle_repeats) == 1
    assert seen[0].verifier.run.report_format == "pytest-report"
    assert seen[0].verifier.run.tripwires == {"must_pass": "PASSED", "must_fail": "FAILED"}
    # the task's known tests: every id its pristine runs collected (the tripwires left out)
    assert outcome.report.known_tests == ["t::f2p", "t::p2p"]
    # the second NOP run repeats FAIL_TO_PASS alone, the second Oracle run FAIL_TO_PASS + the PASS_TO_PASS
    # sample, 6 runs by default; the report's repeat_s is the Oracle's
    assert s.repeats == [1, 1, 6, 6] and outcome.report.repeat_s == 0.0
    assert seen[2].verifier.repeat.model_dump() == {"repeat_s": 1.25, "runs": 6, "tests": 1}


def test_a_fail_to_pass_test_that_fails_in_one_repetition_is_flaky_and_its_cost_reported(script) -> None:
    """The second Oracle run repeats FAIL_TO_PASS back to back; one failing repetition of six flags it
    (under every policy), and the report says what the repetitions cost (pytest's own durations)."""
    again = [GOOD, GOOD, GOOD | {"t::f2p": "FAILED"}, GOOD, GOOD]
    for policy in ("reject", "drop_flaky_pass_to_pass"):
        s = script([BUGGY, GOOD, CONFIRMED, (GOOD, again)])
        outcome, seen = _validate(s, ValidationChecks(flaky_policy=policy))
        report = outcome.report
        assert not report.accepted and report.flaky_tests == ["t::f2p"] and report.oracle_runs == 2
        assert report.reason == "flaky: 1 FAIL_TO_PASS test(s) disagree across 2 Oracle runs (7 runs of the tests): " \
                                "'t::f2p'"
        assert report.repeat_s == pytest.approx(5 * 2 * 0.25)  # 5 further repetitions of 2 tests
        assert seen[-1].verifier.repeat.model_dump() == {"repeat_s": report.repeat_s, "runs": 6, "tests": 2}
    off = script([BUGGY, GOOD, BUGGY, GOOD])  # the repeats off: the second NOP and Oracle runs are plain runs
    outcome, _ = _validate(off, ValidationChecks(flaky_repeat_runs=0))
    assert outcome.report.accepted and off.repeats == [1, 1, 1, 1] and outcome.report.repeat_s is None


def test_a_nop_run_that_hangs_or_exhausts_memory_rejects_the_task_when_the_oracle_completes(script) -> None:
    """Such a task would cost the limit on every later use: rejected, its NOP scored 0 with the error
    as evidence (recorded once the Oracle has decided), never an exception; when the Oracle fails too,
    both stay infrastructure exceptions."""
    for error in (errors.VerifierTimeoutError("exceeded 180 s"), errors.SandboxOOMError("oom_kill 0 -> 1"),
                  errors.SandboxPidsLimitError("pids max 0 -> 3")):
        s = script([error, GOOD])
        outcome, seen = _validate(s)
        assert outcome.report is not None and not outcome.report.accepted
        assert type(error).__name__ in outcome.report.reason and "NOP run (bug present)" in outcome.report.reason
        assert [t.kind for t in seen] == ["nop", "oracle"] and s.events[:2] == ["start nop", "start oracle"]
        nop = seen[0]
        assert nop.reward == 0.0 and nop.exception_type is None
        assert nop.verifier.outcome.error_type == type(error).__name__
        assert outcome.failed_trial is None and outcome.report.known_tests == ["t::f2p", "t::p2p"]
    s = script([errors.VerifierTimeoutError("exceeded 180 s"), errors.VerifierTimeoutError("exceeded 180 s")])
    outcome, seen = _validate(s)
    assert outcome.report is None and [t.exception_type for t in seen] == ["VerifierTimeoutError"] * 2
    s = script([errors.ImageNotFoundError("no such image")])
    outcome, seen = _validate(s)
    assert outcome.report is None and outcome.oracle is None and seen[0].exception_type == "ImageNotFoundError"


def test_a_rejected_task_pays_no_repeat(script) -> None:
    s = script([BUGGY, BUGGY])
    outcome, seen = _validate(s)
    assert not outcome.report.accepted and outcome.report.reason == "oracle run failed 1 tests"
    assert [t.kind for t in seen] == ["nop", "oracle"] and outcome.oracle_repeats == outcome.nop_repeats == []


def test_oracle_runs_that_disagree_flag_the_task_flaky(script) -> None:
    s = script([BUGGY, GOOD, CONFIRMED, GOOD, GOOD | {"t::p2p": "FAILED"}])
    outcome, _ = _validate(s, ValidationChecks(oracle_runs=3))
    assert not outcome.report.accepted and outcome.report.flaky_tests == ["t::p2p"]
    assert outcome.report.reason.startswith("flaky: 1 test(s) disagree across 3 Oracle runs")
    assert [t.reward for t in outcome.oracle_repeats] == [1.0, 0.0]
    s = script([BUGGY, GOOD, CONFIRMED, GOOD | {"t::p2p": "FAILED"}])
    dropped, _ = _validate(s, ValidationChecks(flaky_policy="drop_flaky_pass_to_pass"))
    assert dropped.report.accepted and dropped.report.PASS_TO_PASS == [] and dropped.report.FAIL_TO_PASS == ["t::f2p"]


def test_an_infrastructure_error_in_a_repeat_leaves_no_verdict(script) -> None:
    for runs in ([BUGGY, GOOD, CONFIRMED, errors.VerifierTimeoutError("exceeded 1 s (evidence: forgeflow's clock)")],
                 [BUGGY, GOOD, errors.VerifierTimeoutError("exceeded 1 s (evidence: forgeflow's clock)")]):
        s = script(runs)
        outcome, seen = _validate(s)
        assert outcome.report is None and len(seen) == len(runs)
        assert outcome.failed_trial.exception_type == "VerifierTimeoutError" and outcome.failed_trial is seen[-1]
        assert "evidence" in outcome.failed_trial.exception_message and outcome.failed_trial.reward is None


def test_a_fail_to_pass_test_that_passes_with_the_bug_in_a_nop_repeat_rejects_the_task(script) -> None:
    """The hole a flaky test opened: a test that failed in the one NOP run for reasons of its own (a socket
    test on a loaded machine) and passed with the bug reverted became the task's FAIL_TO_PASS, so an empty
    submission was paid whenever it did not flake again. The NOP run is repeated: a FAIL_TO_PASS test that
    does not fail (FAILED or ERROR) in every repetition rejects the task under every policy, and no Oracle
    repeat is paid for it."""
    flaked = {"t::f2p": "FAILED", "t::p2p": "PASSED"}  # the first NOP run: the flake failed
    for repetitions, reward in ((({"t::f2p": "PASSED"}, [{"t::f2p": "PASSED"}] * 5), 1.0),
                                (({"t::f2p": "FAILED"}, [{"t::f2p": "FAILED"}] * 3 + [{"t::f2p": "PASSED"}] * 2), 0.0),
                                (({"t::f2p": "ERROR"}, [{"t::f2p": "ERROR"}] * 4 + [{"t::f2p": "PASSED"}]), 0.0)):
        for policy in ("reject", "drop_flaky_pass_to_pass"):
            s = script([flaked, GOOD, repetitions])
            outcome, seen = _validate(s, ValidationChecks(flaky_policy=policy))
            report = outcome.report
            assert not report.accepted and report.flaky_tests == ["t::f2p"] and report.FAIL_TO_PASS == ["t::f2p"]
            assert report.reason == ("flaky: 1 FAIL_TO_PASS test(s) did not fail in every one of 2 NOP runs (7 runs of "
                                     "the tests) with the bug present: 't::f2p'")
            assert [t.kind for t in seen] == ["nop", "oracle", "nop"] and outcome.oracle_repeats == []
            assert seen[-1].reward == reward and s.repeats == [1, 1, 6]  # 1.0: the bug went undetected in its run
            assert report.known_tests == ["t::f2p", "t::p2p"]
    # three NOP runs, the third plain: its pass rejects the task too
    s = script([BUGGY, GOOD, CONFIRMED, GOOD])
    outcome, seen = _validate(s, ValidationChecks(nop_runs=3, oracle_runs=1))
    assert not outcome.report.accepted and [t.kind for t in seen] == ["nop", "oracle", "nop", "nop"]
    assert outcome.report.reason.startswith("flaky: 1 FAIL_TO_PASS test(s) did not fail in every one of 3 NOP runs "
                                            "(8 runs of the tests)")
    # one NOP run (the setting that validation had before): accepted on the one NOP failure
    s = script([flaked, GOOD, GOOD])
    outcome, seen = _validate(s, ValidationChecks(nop_runs=1))
    assert outcome.report.accepted and [t.kind for t in seen] == ["nop", "oracle", "oracle"]


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


def test_the_second_nop_run_repeats_a_seeded_sample_of_many_fail_to_pass_tests(script, monkeypatch) -> None:
    """A bug can make its failing tests slow (a demo task: 82 FAIL_TO_PASS tests, 49 s for one NOP run, over the
    180 s limit repeated six times): the second NOP run repeats at most ``flaky_sample_fail_to_pass_tests`` of
    them, the same sample for the same task, and holds only those against it."""
    many = {f"t::f2p{i:02d}": "FAILED" for i in range(12)}
    still_failing = ({**many}, [{**many}] * 5)
    s = script([{**many, "t::p2p": "PASSED"}, {**dict.fromkeys(many, "PASSED"), "t::p2p": "PASSED"}, still_failing])
    selected: list[list[str]] = []
    real_exec = ScriptedSandbox.exec

    def recording_exec(self, command, timeout_s, workdir=None, env=None):
        if isinstance(command, str) and (mark := re.search(r"/select <<'(\S+)'\n", command)) is not None:
            selected.append(command[mark.end():].split(f"{mark.group(1)}\n", 1)[0].splitlines())
        return real_exec(self, command, timeout_s, workdir, env)

    monkeypatch.setattr(ScriptedSandbox, "exec", recording_exec)
    outcome, seen = _validate(s, ValidationChecks(oracle_runs=1))
    assert outcome.report.accepted and len(outcome.report.FAIL_TO_PASS) == 12
    assert [t.kind for t in seen] == ["nop", "oracle", "nop"] and s.repeats == [1, 1, 6]
    assert seen[-1].reward == 0.0
    assert len(selected) == 1 and len(selected[0]) == 10 and set(selected[0]) < set(many)
    # the same task, the same sample; a sampled test passing once rejects it, an unsampled one is not asked
    sample = selected[0]
    unsampled = sorted(set(many) - set(sample))
    for passing, accepted in ((sample[3], False), (unsampled[0], True)):
        flaky_once = ({**many}, [{**many}] * 4 + [{**many, passing: "PASSED"}])
        s = script([{**many, "t::p2p": "PASSED"}, {**dict.fromkeys(many, "PASSED"), "t::p2p": "PASSED"}, flaky_once])
        outcome, _ = _validate(s, ValidationChecks(oracle_runs=1))
        assert selected[-1] == sample and outcome.report.accepted is accepted
        assert outcome.report.flaky_tests == ([] if accepted else [passing])
    # the second NOP run is scored on the tests it ran: 1.0 when every sampled test passed (the bug went
    # undetected in that run), though the ones it did not run are missing from its map
    undetected = ({t: "PASSED" for t in sample}, [{t: "PASSED" for t in sample}] * 5)
    s = script([{**many, "t::p2p": "PASSED"}, {**dict.fromkeys(many, "PASSED"), "t::p2p": "PASSED"}, undetected])
    outcome, seen = _validate(s, ValidationChecks(oracle_runs=1))
    assert not outcome.report.accepted and outcome.report.flaky_tests == sorted(sample) and seen[-1].reward == 1.0


def test_bad_checks_are_refused_before_anything_runs(script) -> None:
    s = script([])
    with pytest.raises(errors.InputError, match="unknown log_parser 'parse_log_nope'; valid: parse_log_astroid"):
        _validate(s, ValidationChecks(log_parser="parse_log_nope"))
    with pytest.raises(ValueError, match="oracle_runs"):
        ValidationChecks(oracle_runs=0)
    with pytest.raises(ValueError, match="nop_runs"):
        ValidationChecks(nop_runs=0)
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
        start = f'\n@forgeflow-verifier-{nonce} {{"seq": 0, "kind": "start"}}\ncollected 2\n'
        return ExecResult.from_bytes(0, start.encode(), b"", 0.1)

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
