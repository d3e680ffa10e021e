"""The verifier's channel, read back: the records forgeflow's pytest plugin streamed during a test
run, checked for tampering, and pytest's own final summary line."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "RECORD_PREFIX",
    "TRIPWIRE_MUST_PASS",
    "TRIPWIRE_MUST_FAIL",
    "SUMMARY_CATEGORIES",
    "StreamDigest",
    "read_channel",
    "digest_records",
    "find_summary_lines",
    "summary_counts",
    "tripwire_problems",
    "count_problems",
    "known_test_problems",
    "log_summary_problems",
]

RECORD_PREFIX = "@forgeflow-verifier-"
"""Start of every record line, followed by the run's nonce and a space."""

TRIPWIRE_MUST_PASS = "test_forgeflow_must_pass_"
"""Name of the verifier's tripwire test that must pass, before the nonce."""

TRIPWIRE_MUST_FAIL = "test_forgeflow_must_fail_"
"""Name of the verifier's tripwire test that must fail, before the nonce."""

SUMMARY_CATEGORIES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "deselected")
"""The categories of pytest's final summary line the channel's counts are compared on (warnings,
reruns and plugins' own categories are not outcomes of the task's tests)."""

_COUNT = re.compile(r"(\d+) ([a-z][a-z ]*)")
_SUMMARY_LINE = re.compile(
    r"^(?:=+ )?((?:\d+ [a-z][a-z ]*)(?:, \d+ [a-z][a-z ]*)*|no tests ran)"
    r" in \d+(?:\.\d+)?s(?: \([^)]*\))?(?: =+)?$", re.MULTILINE)
_PLURALS = {"errors": "error", "warnings": "warning"}


def read_channel(stdout: str, nonce: str, repeat: int = 1) -> StreamDigest:
    """Split ``stdout`` into the plugin's records (framed with ``nonce``) and the run's own output, and digest
    the records (:func:`digest_records`; ``repeat``: how many times each item was to run).

    Returns:
        The :class:`StreamDigest` with the output without the records (``log``); a framed line that does not
        parse is listed in ``corrupt``.
    """
    frame = re.compile(r"\n" + re.escape(RECORD_PREFIX + nonce) + r" ([^\n]*)(?:\n|$)")
    records: list[dict[str, Any]] = []
    corrupt: list[str] = []
    parts: list[str] = []
    end_offset: int | None = None
    last, size = 0, 0
    for match in frame.finditer(stdout):
        parts.append(stdout[last:match.start()])
        size += match.start() - last
        last = match.end()
        try:
            record = json.loads(match.group(1))
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
            corrupt.append(match.group(1)[:200])
            continue
        records.append(record)
        if record.get("kind") == "end" and end_offset is None:
            end_offset = size
    parts.append(stdout[last:])
    return digest_records(records, nonce, repeat).model_copy(update={
        "record_count": len(records), "log": "".join(parts), "end_offset": end_offset, "corrupt": corrupt})


class StreamDigest(BaseModel):
    """What the channel says about the run (:func:`read_channel`; :func:`digest_records` of the records alone
    leaves the output's fields at their defaults), and every way its records contradict themselves."""

    model_config = ConfigDict(frozen=True)

    record_count: int = Field(0, ge=0, description="the records read (well-formed ones, in the order written).")
    log: str = Field("", description="the run's stdout without the record lines.")
    end_offset: int | None = Field(None,
                                   description="index in log where the session-end record stood (pytest's summary "
                                               "follows it); None without one.")
    corrupt: list[str] = Field(default_factory=list,
                               description="one entry per framed line that is not a JSON object with an int seq.")

    started: bool = Field(False, description="a start record was read (pytest ran with the plugin).")
    ended: bool = Field(False, description="a session-end record was read.")
    exitstatus: int | None = Field(None,
                                   description="pytest's exit status from the session-end record (None without "
                                               "one).")
    verbosity: int | None = Field(None,
                                  description="the terminal's verbosity from the session-end record (below -1: no "
                                              "summary line).")
    tests: dict[str, str] = Field(default_factory=dict,
                                  description="status map of the task's tests (first repetition; tripwires left out")
    repeat_runs: list[dict[str, str]] = Field(
        default_factory=list,
        description="one status map per repetition when items were repeated (else empty).")
    repeat_s: float = Field(default=0.0, ge=0.0,
                            description="pytest's seconds in repetitions after the first (every phase's duration).")
    collected: list[str] | None = Field(None,
                                        description="the collected item ids without the tripwires, in order (None: "
                                                    "collection never finished).")
    deselected: list[str] = Field(default_factory=list, description="ids deselected before the run.")
    collect_errors: list[str] = Field(default_factory=list, description="ids of collectors that failed.")
    tripwires: dict[str, str] = Field(default_factory=dict,
                                      description="{\"must_pass\": status, \"must_fail\": status} for the tripwires "
                                                  "that reported.")
    counts: dict[str, int] = Field(default_factory=dict,
                                   description="reports per summary category (SUMMARY_CATEGORIES), tripwires "
                                               "included, as pytest's terminal counts them.")
    distributed: str | None = Field(None,
                                    description="pytest-xdist's mode and workers when the run was distributed (-n), "
                                                "else None.")
    runner_inputs: dict[str, Any] = Field(
        default_factory=dict,
        description="what the runner read: sys_path and modules at the plugin's import, inipath, rootpath, args, "
                    "plugins, conftests, entry_points, hook_files (the files of every plugin's hook functions), "
                    "registered (plugins registered later: name, file, hook_files).")
    tampering: list[str] = Field(default_factory=list,
                                 description="every contradiction found, for a person (empty: none).")


def _status(when: str, outcome: str, xfail: bool) -> str | None:
    """A report's status (:data:`forgeflow.sandbox.grading.STATUSES`); None: a clean setup/teardown."""
    if when in ("setup", "teardown"):
        if outcome == "failed":
            return "ERROR"
        if outcome == "skipped":
            return "XFAIL" if xfail else "SKIPPED"
        return None
    if outcome == "passed":
        return "XPASS" if xfail else "PASSED"
    if outcome == "skipped":
        return "XFAIL" if xfail else "SKIPPED"
    return "FAILED"


def _category(when: str, outcome: str, xfail: bool) -> str | None:
    """The summary category pytest's terminal files a report under (``pytest_report_teststatus`` of
    its skipping, runner and terminal plugins, in that order); None: not counted."""
    if xfail and outcome in ("skipped", "passed"):
        return "xfailed" if outcome == "skipped" else "xpassed"
    if when in ("setup", "teardown", "collect"):
        return {"failed": "error", "skipped": "skipped"}.get(outcome)
    return outcome if outcome in ("passed", "failed", "skipped") else None


def _tripwire(nodeid: str, nonce: str) -> str | None:
    name = nodeid.rpartition("::")[2]
    return {TRIPWIRE_MUST_PASS + nonce: "must_pass", TRIPWIRE_MUST_FAIL + nonce: "must_fail"}.get(name)


class _Digest:
    """The state of :func:`digest_records` while it walks the records."""

    def __init__(self, nonce: str, repeat: int) -> None:
        self.nonce, self.repeat = nonce, repeat
        self.fields: dict[str, Any] = {"runner_inputs": {}, "deselected": [], "collect_errors": []}
        self.runs: dict[int, dict[str, str]] = {}
        self.tripwires: dict[str, str] = {}
        self.counts: Counter[str] = Counter()
        self.phases: Counter[tuple[str, int, str]] = Counter()
        self.collected: Counter[str] | None = None
        self.tampering: list[str] = []
        self.repeat_s = 0.0

    def report(self, record: dict[str, Any]) -> None:
        nodeid, when, outcome = str(record.get("nodeid")), str(record.get("when")), str(record.get("outcome"))
        rep, xfail = record.get("rep", 0), bool(record.get("xfail"))
        if not isinstance(rep, int) or not 0 <= rep < self.repeat:
            self.tampering.append(f"an outcome record of {nodeid!r} for repetition {rep!r} (the run repeats "
                                  f"{self.repeat} time(s))")
            return
        if self.collected is None or nodeid not in self.collected:
            self.tampering.append(f"an outcome record of {nodeid!r}, a test that was never collected")
            return
        self.phases[(nodeid, rep, when)] += 1
        if self.phases[(nodeid, rep, when)] > self.collected[nodeid]:
            self.tampering.append(f"two {when} outcome records of {nodeid!r} (the second: {outcome})")
            return
        category = _category(when, outcome, xfail)
        if category:
            self.counts[category] += 1
        duration = record.get("duration_s")
        if rep and isinstance(duration, (int, float)) and duration >= 0:
            self.repeat_s += duration
        status = _status(when, outcome, xfail)
        wire = _tripwire(nodeid, self.nonce)
        target = self.tripwires if wire else self.runs.setdefault(rep, {})
        key = wire or nodeid
        if status is None or target.get(key) == "ERROR" or (when == "teardown" and status != "ERROR"):
            return  # an error in setup or teardown stands; a clean teardown changes nothing
        target[key] = status

    def collect(self, record: dict[str, Any]) -> None:
        nodeid, outcome = str(record.get("nodeid")), str(record.get("outcome"))
        category = _category("collect", outcome, False)
        if category:
            self.counts[category] += 1
        if outcome == "failed":
            self.fields["collect_errors"].append(nodeid)

    def collected_ids(self, record: dict[str, Any]) -> None:
        if self.collected is not None:
            self.tampering.append("a second record of the collected tests")
            return
        ids = [str(i) for i in record.get("ids") or []]
        self.collected = Counter(ids)
        self.fields["collected"] = [i for i in ids if not _tripwire(i, self.nonce)]


def digest_records(records: list[dict[str, Any]], nonce: str, repeat: int = 1) -> StreamDigest:
    """Turn a run's records into status maps, counts and the runner's inputs; name every contradiction.

    Args:
        repeat: how many times each item was to run (1: no repeats).
    """
    state = _Digest(nonce, max(1, repeat))
    ended = started = False
    for index, record in enumerate(records):
        kind = record.get("kind")
        if record.get("seq") != index:
            state.tampering.append(f"record {index} carries sequence number {record.get('seq')!r} (a record was "
                                   "inserted or lost)")
        if ended:
            state.tampering.append(f"a {kind!r} record after the session-end record")
            continue
        if kind == "start":
            if started:
                state.tampering.append("a second start record")
            started = True
            state.fields["runner_inputs"].update({k: record.get(k) for k in ("sys_path", "modules", "pytest")})
        elif kind == "inputs":
            state.fields["runner_inputs"].update({k: v for k, v in record.items() if k not in ("seq", "kind")})
        elif kind == "deselected":
            state.fields["deselected"].extend(str(i) for i in record.get("ids") or [])
        elif kind == "collected":
            state.collected_ids(record)
        elif kind == "collect":
            state.collect(record)
        elif kind == "report":
            state.report(record)
        elif kind == "integrity":  # the plugin saw pytest's outcome functions replaced in the process
            names = ", ".join(str(n) for n in record.get("replaced") or [])
            state.tampering.append(f"pytest's own functions were replaced while the tests ran: {names}")
        elif kind == "registered":  # a plugin registered after the reporter: its files are runner inputs
            state.fields["runner_inputs"].setdefault("registered", []).append(
                {k: record.get(k) for k in ("name", "file", "hook_files", "conftest", "collecting")})
            if record.get("collecting") is True and record.get("conftest") is not True:
                state.tampering.append(f"a plugin was registered while the tests were collected or ran, by code "
                                       f"that is not a conftest: {record.get('name')!r}")
        elif kind == "distributed":  # pytest-xdist: outcomes come from workers the plugin does not report from
            state.fields["distributed"] = f"{record.get('dist')} with {record.get('workers')} workers"
        elif kind == "end":
            ended = True
            status, verbosity = record.get("exitstatus"), record.get("verbosity")
            state.fields["exitstatus"] = status if isinstance(status, int) else None
            state.fields["verbosity"] = verbosity if isinstance(verbosity, int) else None
        else:
            state.tampering.append(f"a record of unknown kind {kind!r}")
    state.counts["deselected"] = len(state.fields["deselected"])
    tests = dict(state.runs.get(0, {}))
    tests.update({nodeid: "ERROR" for nodeid in state.fields["collect_errors"] if nodeid not in tests})
    repeat_runs = [state.runs.get(rep, {}) for rep in range(state.repeat)] if state.repeat > 1 else []
    return StreamDigest(started=started, ended=ended, tests=tests, repeat_runs=repeat_runs,
                        tripwires=state.tripwires, counts=dict(state.counts), tampering=state.tampering,
                        repeat_s=state.repeat_s,
                        **state.fields)


def summary_counts(line: str) -> dict[str, int]:
    """The counts of one pytest final summary line (``"== 1 failed, 5 passed, 2 errors in 0.12s =="``,
    or without the ``=`` under ``-q``): ``{"failed": 1, "passed": 5, "error": 2}`` (plurals made
    singular: ``errors``, ``warnings``); ``{}`` for "no tests ran"."""
    head = line.strip().strip("=").strip().rsplit(" in ", 1)[0]
    return {_PLURALS.get(word.strip(), word.strip()): int(count) for count, word in _COUNT.findall(head)}


def find_summary_lines(text: str) -> list[tuple[int, str]]:
    """Every line of ``text`` shaped like pytest's final summary line, as ``(offset, line)``."""
    return [(m.start(), m.group(0)) for m in _SUMMARY_LINE.finditer(text)]


def tripwire_problems(tripwires: Mapping[str, str]) -> list[str]:
    """One sentence per tripwire with the wrong status (a missing one is not a problem here: see
    :attr:`forgeflow.sandbox.verifier.VerifierResult.credit_blocker`)."""
    out = []
    for wire, want in (("must_fail", "FAILED"), ("must_pass", "PASSED")):
        if tripwires.get(wire, want) != want:
            out.append(f"the verifier's {wire.replace('_', '-')} tripwire reported {tripwires[wire]}: something "
                       "forces test outcomes")
    return out


def count_problems(summary: Mapping[str, int], seen: Mapping[str, int], categories: Collection[str], *,
                   exact: bool) -> list[str]:
    """Where pytest's summary counts and the outcomes disagree, one sentence per category (``[]``: they agree);
    without ``exact`` the outcomes may hold fewer (SWE-bench's pytest parser splits ids at spaces)."""
    bad = [c for c in categories if seen.get(c, 0) > summary.get(c, 0)
           or (exact and seen.get(c, 0) < summary.get(c, 0))]
    if not bad:
        return []
    shown = ", ".join(f"{summary.get(c, 0)} {c} there, {seen.get(c, 0)} read" for c in bad)
    return [f"pytest's own summary line disagrees with the outcomes read ({shown})"]


def known_test_problems(digest: StreamDigest, known_tests: Collection[str] | None,
                        graded_tests: Collection[str]) -> list[str]:
    """The known-tests cross-check of a run (``known_tests`` None: not recorded); one sentence per broken rule."""
    if digest.collected is None:
        return []
    out = []
    times = Counter(digest.collected)
    wrong = {t: times[t] for t in graded_tests if times[t] > 1 or (times[t] == 0 and not digest.collect_errors)}
    if wrong:
        out.append("FAIL_TO_PASS/PASS_TO_PASS tests not collected exactly once: "
                   + ", ".join(f"{t!r} x{n}" for t, n in sorted(wrong.items())[:5]))
    if known_tests is not None:
        known = set(known_tests)
        unknown = sorted(set(digest.collected) - known)
        missing = sorted(known - set(digest.collected) - set(digest.deselected))
        if unknown:
            out.append(f"{len(unknown)} collected test(s) the task does not know, e.g. {unknown[0]!r}")
        if missing and not digest.collect_errors:
            out.append(f"{len(missing)} known test(s) not collected, e.g. {missing[0]!r}")
    return out


def log_summary_problems(stdout: str, tests: Mapping[str, str],
                         parser: Callable[..., dict[str, str]]) -> tuple[dict[str, int] | None, list[str]]:
    """The summary cross-check of a pytest log read by a SWE-bench parser.

    Returns:
        ``(the summary's counts or None, problems)``.
    """
    lines = find_summary_lines(stdout)
    if len(lines) != 1:
        return None, [f"the log holds {len(lines)} pytest summary lines (pytest prints one)"]
    offset, line = lines[0]
    counts = summary_counts(line)
    out = []
    if parser(stdout[offset + len(line):], None):
        out.append("test statuses printed after pytest's own summary line")
    names = {"ERROR": "error", "XFAIL": "xfailed", "XPASS": "xpassed"}
    seen = Counter(names.get(status, status.lower()) for status in tests.values())
    out += count_problems(counts, seen, ("passed", "failed", "error", "xfailed", "xpassed"), exact=False)
    return counts, out
